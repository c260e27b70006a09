// The statistics of torch's composite rms_norm on the CPU, bit for bit.
//
// torch runs rms_norm on CPU tensors as separate ops: x in fp32, pow(x, 2),
// mean over the last dim, + eps, rsqrt, two products. The products and the
// rsqrt round once each and leanstep's kernels already form them the same way;
// only the sum of squares differs, by its order. torch's mean is a sum, then a
// division by n, and its sum is a cascade over 8-lane vectors: its sum kernel
// has no AVX-512 build, so the AVX2 and default kernels run on every x86 CPU,
// both with 8 floats to a vector. The order, for a row of n fp32 squares:
//
// - n >= 8: the row is n / 8 vectors and a tail of n % 8 scalars. The vectors
//   are summed lane by lane in 4 interleaved streams (vector i goes to stream
//   i % 4) through a 4-level cascade (below); the vectors left over after the
//   last whole group of 4 go into stream 0; streams 1, 2, 3 are then added to
//   stream 0 in turn. The scalar tail is summed in order from 0, and the 8
//   lanes are then added to it in order.
// - n < 8: the same 4 interleaved streams over scalars.
//
// The cascade (of each stream, over its `size` entries): level 0 sums runs of
// `step` = 2^max(4, ceil(log2(size)) / 4) entries; after each run it is added
// into level 1 and cleared; level 1 goes on into level 2 (and level 2 into 3)
// each time its own count of runs reaches a power of `step`. What is left
// after the last whole run is added to level 0 in order, and levels 1, 2, 3
// are added to level 0 last.
//
// Compiled without contraction (CMakeLists.txt): a square and the sum it goes
// into are two roundings, as in torch, never one fused multiply-add.
#include <algorithm>
#include <array>
#include <cstdint>

#include "leanstep/core.h"
#include "rmsnorm/kernels.h"

namespace leanstep::rmsnorm::detail {
namespace {

constexpr int64_t kTorchLanes = 8;  // floats in a vector of torch's sum kernel
constexpr int kStreams = 4;         // its interleaved accumulators
constexpr int kLevels = 4;          // its cascade levels

using Lanes = std::array<float, kTorchLanes>;

template <class T>
struct Squares {
  const T* x;
  float at(int64_t i) const {
    float v;
    if constexpr (sizeof(T) == 4) v = x[i];
    else v = bf16_to_float(x[i]);  // inline (core.h): the lanes vectorise
    return v * v;  // rounded to fp32: torch materialises pow(x, 2)
  }
  void add_vector(Lanes& acc, int64_t vector) const {  // acc += squares of vector `vector`
    for (int64_t k = 0; k < kTorchLanes; ++k) acc[static_cast<size_t>(k)] += at(vector * kTorchLanes + k);
  }
};

int64_t ceil_log2(int64_t v) {  // torch's: 1 for v <= 2
  if (v <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t u = static_cast<uint64_t>(v) - 1; u != 0; u >>= 1) ++bits;
  return bits;
}

void add_into(Lanes& dst, const Lanes& src) {
  for (size_t k = 0; k < dst.size(); ++k) dst[k] += src[k];
}
void add_into(float& dst, const float& src) { dst += src; }

// The cascade of kStreams interleaved streams over `size` entries; entry(i, s, acc)
// adds entry i of stream s to acc. Acc: Lanes (vectors) or float (scalars).
template <class Acc, class Entry>
std::array<Acc, kStreams> cascade(int64_t size, Entry entry) {
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t{1} << power;
  const int64_t mask = step - 1;
  if (size < step) {
    // No whole run: only level 0 takes entries, and the other levels would add their
    // +0 to it, which changes no sum of squares (never -0: every square is >= +0 or
    // NaN). The rows of most hidden sizes (under 512 elements) take this path.
    std::array<Acc, kStreams> level0{};
    for (int64_t i = 0; i < size; ++i)
      for (int s = 0; s < kStreams; ++s) entry(i, s, level0[static_cast<size_t>(s)]);
    return level0;
  }
  std::array<std::array<Acc, kStreams>, kLevels> acc{};
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int s = 0; s < kStreams; ++s) entry(i, s, acc[0][static_cast<size_t>(s)]);
    for (int level = 1; level < kLevels; ++level) {
      for (int s = 0; s < kStreams; ++s) {
        add_into(acc[static_cast<size_t>(level)][static_cast<size_t>(s)],
                 acc[static_cast<size_t>(level - 1)][static_cast<size_t>(s)]);
        acc[static_cast<size_t>(level - 1)][static_cast<size_t>(s)] = Acc{};
      }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int s = 0; s < kStreams; ++s) entry(i, s, acc[0][static_cast<size_t>(s)]);
  for (int level = 1; level < kLevels; ++level)
    for (int s = 0; s < kStreams; ++s)
      add_into(acc[0][static_cast<size_t>(s)], acc[static_cast<size_t>(level)][static_cast<size_t>(s)]);
  return acc[0];
}

// kStreams interleaved streams over `count` entries, the leftovers into stream 0,
// then streams 1.. added to stream 0.
template <class Acc, class Entry>
Acc streams_sum(int64_t count, Entry entry) {
  const int64_t groups = count / kStreams;
  std::array<Acc, kStreams> partial = cascade<Acc>(groups, [&](int64_t i, int s, Acc& acc) {
    entry(i * kStreams + s, acc);
  });
  for (int64_t i = groups * kStreams; i < count; ++i) entry(i, partial[0]);
  for (int s = 1; s < kStreams; ++s) add_into(partial[0], partial[static_cast<size_t>(s)]);
  return partial[0];
}

template <class T>
float sum_squares(const T* x, int64_t n) {
  const Squares<T> sq{x};
  if (n < kTorchLanes) return streams_sum<float>(n, [&](int64_t i, float& acc) { acc += sq.at(i); });
  const int64_t vectors = n / kTorchLanes;
  const Lanes lanes = streams_sum<Lanes>(vectors, [&](int64_t v, Lanes& acc) { sq.add_vector(acc, v); });
  float total = 0.0f;
  for (int64_t i = vectors * kTorchLanes; i < n; ++i) total += sq.at(i);
  for (const float lane : lanes) total += lane;
  return total;
}

// The same sum for the rows on which the cascade never leaves level 0 (8 <= n <
// kLevel0Below: fewer than `step` = 16 groups of 4 vectors), written out with
// plain arrays so that the 8 lanes vectorise: each lane still adds its squares in
// the order above, from +0, and the streams and the tail are added as there. The
// fused forward's; the reference keeps the general form, and the tests hold the two
// (and torch) to the same bits.
constexpr int64_t kLevel0Below = int64_t{16} * kStreams * kTorchLanes;

template <class T>
float sum_squares_level0(const T* x, int64_t n) {
  const Squares<T> sq{x};
  const int64_t vectors = n / kTorchLanes;
  const int64_t whole = vectors / kStreams * kStreams;
  float acc[kStreams][kTorchLanes] = {};
  for (int64_t v = 0; v < whole; v += kStreams)
    for (int s = 0; s < kStreams; ++s)
      for (int64_t k = 0; k < kTorchLanes; ++k) acc[s][k] += sq.at((v + s) * kTorchLanes + k);
  for (int64_t v = whole; v < vectors; ++v)  // the vectors after the last whole group
    for (int64_t k = 0; k < kTorchLanes; ++k) acc[0][k] += sq.at(v * kTorchLanes + k);
  for (int s = 1; s < kStreams; ++s)
    for (int64_t k = 0; k < kTorchLanes; ++k) acc[0][k] += acc[s][k];
  float total = 0.0f;
  for (int64_t i = vectors * kTorchLanes; i < n; ++i) total += sq.at(i);
  for (int64_t k = 0; k < kTorchLanes; ++k) total += acc[0][k];
  return total;
}

template <class T>
void inv_rms_rows(const T* x, int64_t rows, int64_t n, float eps, float* rstd) {
  if (n < kTorchLanes || n >= kLevel0Below) {
    for (int64_t row = 0; row < rows; ++row) rstd[row] = inv_rms(sum_squares(x + row * n, n), n, eps);
    return;
  }
  for (int64_t row = 0; row < rows; ++row) rstd[row] = inv_rms(sum_squares_level0(x + row * n, n), n, eps);
}

}  // namespace

float sum_squares_torch_order(const void* x, DType dtype, int64_t n) {
  if (dtype == DType::kBFloat16) return sum_squares(static_cast<const uint16_t*>(x), n);
  return sum_squares(static_cast<const float*>(x), n);  // fp32 (fp16 rows come widened)
}

void inv_rms_torch_order_rows(const void* x, DType dtype, int64_t rows, int64_t n, float eps,
                              float* rstd) {
  if (dtype == DType::kBFloat16) return inv_rms_rows(static_cast<const uint16_t*>(x), rows, n, eps, rstd);
  inv_rms_rows(static_cast<const float*>(x), rows, n, eps, rstd);  // fp32 (fp16 rows come widened)
}

}  // namespace leanstep::rmsnorm::detail
