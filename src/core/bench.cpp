#include "leanstep/bench.h"
#include "core/parallel.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>

#include "leanstep/core.h"

namespace leanstep::bench {

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Timing time_it(const std::function<void()>& fn, int min_reps, double min_seconds, int warmup,
               int max_reps, const std::function<void()>& setup) {
  using clock = std::chrono::steady_clock;
  for (int i = 0; i < warmup; ++i) {
    if (setup) setup();
    fn();
  }
  std::vector<double> ms;
  const auto start = clock::now();
  while (static_cast<int>(ms.size()) < max_reps) {
    if (setup) setup();
    const auto t0 = clock::now();
    fn();
    const auto t1 = clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    const double elapsed = std::chrono::duration<double>(t1 - start).count();
    if (static_cast<int>(ms.size()) >= min_reps && elapsed >= min_seconds) break;
  }
  Timing t;
  t.reps = static_cast<int>(ms.size());
  t.min_ms = *std::min_element(ms.begin(), ms.end());
  t.max_ms = *std::max_element(ms.begin(), ms.end());
  t.median_ms = median(ms);
  return t;
}

const char* access_name(Access access) {
  switch (access) {
    case Access::kRead: return "read";
    case Access::kInPlace: return "inplace";
    case Access::kCopy: return "copy";
  }
  return "?";
}

namespace {
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float, FreeDeleter>;

Buffer alloc_floats(size_t n) {
  auto* p = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
  if (!p) throw Error("measure_bandwidth: out of memory");
  return Buffer(p);
}

// Each thread touches a contiguous static slice, as the ops under test do.
void first_touch(float* p, int64_t n, float value) {
#pragma omp parallel for schedule(static) if (detail::parallel_allowed())
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}
}  // namespace

Bandwidth measure_bandwidth(Access access, size_t buffer_bytes) {
  const int64_t n = static_cast<int64_t>(buffer_bytes / sizeof(float));
  Buffer a = alloc_floats(static_cast<size_t>(n));
  Buffer b = access == Access::kCopy ? alloc_floats(static_cast<size_t>(n)) : Buffer();
  first_touch(a.get(), n, 1.0f);
  if (b) first_touch(b.get(), n, 0.0f);
  float* pa = a.get();
  float* pb = b.get();
  volatile uint64_t sink = 0;
  std::function<void()> kernel;
  switch (access) {
    case Access::kRead:
      kernel = [&] {
        const auto* p = reinterpret_cast<const uint64_t*>(pa);
        const int64_t words = n / 2;
        uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) if (detail::parallel_allowed())
        for (int64_t i = 0; i < words; ++i) total += p[i];
        sink = total;
      };
      break;
    case Access::kInPlace:
      kernel = [&] {
#pragma omp parallel for schedule(static) if (detail::parallel_allowed())
        for (int64_t i = 0; i < n; ++i) pa[i] *= 1.0000001f;
      };
      break;
    case Access::kCopy:
      kernel = [&] {
        const int threads = omp_get_max_threads();
#pragma omp parallel num_threads(threads) if (detail::parallel_allowed())
        {
          const int t = omp_get_thread_num();
          const int nt = omp_get_num_threads();
          const int64_t begin = n * t / nt, end = n * (t + 1) / nt;
          std::memcpy(pb + begin, pa + begin, static_cast<size_t>(end - begin) * sizeof(float));
        }
      };
      break;
  }
  Bandwidth bw;
  bw.access = access;
  bw.buffer_bytes = static_cast<size_t>(n) * sizeof(float);
  bw.bytes_moved = static_cast<double>(bw.buffer_bytes) * (access == Access::kRead ? 1.0 : 2.0);
  bw.timing = time_it(kernel, 7, 0.5, 2);
  (void)sink;
  return bw;
}

}  // namespace leanstep::bench
