// Benchmark helpers: robust timing (median of repetitions) and the machine's
// memory bandwidth measured with all threads by kernels of a given access
// pattern, the physical floor the memory-bound ops are compared against.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace leanstep::bench {

struct Timing {
  double median_ms = 0;
  double min_ms = 0;
  double max_ms = 0;
  int reps = 0;
};

// Runs `fn` `warmup` times, then at least `min_reps` times and until
// `min_seconds` have passed (at most `max_reps`); reports median/min/max.
// `setup`, if given, runs before every call outside the timed region.
Timing time_it(const std::function<void()>& fn, int min_reps = 7, double min_seconds = 0.3,
               int warmup = 2, int max_reps = 1000, const std::function<void()>& setup = {});

enum class Access {
  kRead,     // read-only sweep (a norm's pattern); bytes = buffer size
  kInPlace,  // read + write the same buffer (a scale's pattern); bytes = 2 x buffer
  kCopy,     // read one buffer, write another (a gather's pattern); bytes = 2 x buffer
};
const char* access_name(Access access);

struct Bandwidth {
  Access access;
  size_t buffer_bytes;
  double bytes_moved;  // per repetition
  Timing timing;
  double gbps() const { return bytes_moved / (timing.median_ms * 1e-3) / 1e9; }
};

// Measures bandwidth with all OpenMP threads over buffers of `buffer_bytes`
// (default 256 MiB: far beyond the last-level cache).
Bandwidth measure_bandwidth(Access access, size_t buffer_bytes = size_t{256} << 20);

double median(std::vector<double> values);

}  // namespace leanstep::bench
