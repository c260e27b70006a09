// The reference ("sort") MoE paths: the order the frameworks define, computed
// the way they define it. The transposed 0/1 routing map becomes FP32 keys and
// a STABLE descending sort puts the routed pairs first in expert-major,
// increasing-token order (FP32 holds 0 and 1 exactly, stability makes the
// order unique). Loops are serial and per element: this is the oracle of the
// fused path and the benchmark baseline, not a fast path.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "moe/common.h"
#include "moe/kernels.h"

namespace leanstep::moe::detail {

namespace {

// Stable descending argsort of FP32 keys.
std::vector<int64_t> stable_argsort_descending(const std::vector<float>& keys) {
  std::vector<int64_t> order(keys.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return keys[static_cast<size_t>(a)] > keys[static_cast<size_t>(b)]; });
  return order;
}

void gather_rows(const PermuteProblem& p, const std::vector<int64_t>& slot_token,
                 const std::vector<int64_t>& slot_expert) {
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t t = slot_token[static_cast<size_t>(i)];
    const int64_t e = slot_expert[static_cast<size_t>(i)];
    p.indices.set(i, t);
    char* dst = p.permuted + static_cast<size_t>(i) * p.row_bytes;
    if (t < 0) {
      std::memset(dst, 0, p.row_bytes);
      if (p.permuted_probs) std::memset(p.permuted_probs + static_cast<size_t>(i) * p.prob_bytes, 0, p.prob_bytes);
      continue;
    }
    std::memcpy(dst, p.tokens + static_cast<size_t>(t) * p.row_bytes, p.row_bytes);
    if (p.permuted_probs)
      std::memcpy(p.permuted_probs + static_cast<size_t>(i) * p.prob_bytes,
                  p.probs + static_cast<size_t>(t * p.E + e) * p.prob_bytes, p.prob_bytes);
  }
}

}  // namespace

void permute_sort(const PermuteProblem& p) {
  const int64_t T = p.T, E = p.E;
  std::vector<int64_t> slot_token(static_cast<size_t>(p.N), -1), slot_expert(static_cast<size_t>(p.N), -1);
  if (p.drop_and_pad) {
    // Per expert: stable descending sort of its 0/1 row, first `capacity` kept.
    std::vector<float> keys(static_cast<size_t>(T));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t t = 0; t < T; ++t) keys[static_cast<size_t>(t)] = p.map[t * E + e] ? 1.0f : 0.0f;
      const std::vector<int64_t> order = stable_argsort_descending(keys);
      for (int64_t j = 0; j < p.capacity; ++j) {
        slot_token[static_cast<size_t>(e * p.capacity + j)] = order[static_cast<size_t>(j)];
        slot_expert[static_cast<size_t>(e * p.capacity + j)] = e;
      }
    }
  } else {
    // Flattened transposed map [E * T] as FP32 keys.
    std::vector<float> keys(static_cast<size_t>(E * T));
    int64_t routed = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t t = 0; t < T; ++t) {
        const bool on = p.map[t * E + e] != 0;
        keys[static_cast<size_t>(e * T + t)] = on ? 1.0f : 0.0f;
        routed += on;
      }
    if (routed > p.N)
      throw_arg_error("permute", "num_out_tokens",
                      fmt::format("must be >= the number of routed (token, expert) pairs (got {}, routed {})",
                                  p.N, routed));
    const std::vector<int64_t> order = stable_argsort_descending(keys);
    for (int64_t i = 0; i < routed; ++i) {
      slot_token[static_cast<size_t>(i)] = order[static_cast<size_t>(i)] % T;
      slot_expert[static_cast<size_t>(i)] = order[static_cast<size_t>(i)] / T;
    }
  }
  gather_rows(p, slot_token, slot_expert);
}

void unpermute_sort(const UnpermuteProblem& p) {
  // Scatter-add in slot order into fp32 accumulators that start at +0, then cast once.
  std::vector<float> acc(static_cast<size_t>(p.T * p.H), 0.0f);
  for (int64_t i = 0; i < p.N; ++i) {
    const int64_t t = p.indices.get(i);
    if (t < 0) continue;
    const float prob = p.slot_probs ? p.slot_probs[i] : 1.0f;
    for (int64_t h = 0; h < p.H; ++h) {
      const float x = load_f32(p.permuted, p.dtype, i * p.H + h);
      acc[static_cast<size_t>(t * p.H + h)] += x * prob;
    }
  }
  convert_from_f32(acc.data(), p.out, p.dtype, p.T * p.H);
}

namespace {

// An fp32 or bf16 element, exactly, as a double.
double element(const void* p, DType dtype, int64_t h) {
  return dtype == DType::kFloat32 ? static_cast<const float*>(p)[h]
                                  : bf16_to_float(static_cast<const uint16_t*>(p)[h]);
}

}  // namespace

double dot_f64_finish(double* partial, const void* a, const void* b, DType dtype, int64_t h, int64_t n) {
  for (size_t j = 0; h < n; ++h, ++j) partial[j] += element(a, dtype, h) * element(b, dtype, h);
  return dot_f64_tree(partial);
}

double dot_f64_reference(const void* a, const void* b, DType dtype, int64_t n) {
  double partial[kDotPartials] = {};
  int64_t h = 0;
  for (; h + static_cast<int64_t>(kDotPartials) <= n; h += kDotPartials)
    for (size_t j = 0; j < kDotPartials; ++j)
      partial[j] += element(a, dtype, h + static_cast<int64_t>(j)) * element(b, dtype, h + static_cast<int64_t>(j));
  return dot_f64_finish(partial, a, b, dtype, h, n);
}

void unpermute_backward_row(const UnpermuteBackwardProblem& p, int64_t i, float* scratch) {
  const size_t elem = dtype_size(p.dtype);
  char* drow = p.dpermuted + static_cast<size_t>(i * p.H) * elem;
  const int64_t t = p.indices.get(i);
  if (t < 0) {
    std::memset(drow, 0, static_cast<size_t>(p.H) * elem);
    if (p.dslot_probs) p.dslot_probs[i] = 0.0;
    return;
  }
  const char* dout_row = p.dout + static_cast<size_t>(t * p.H) * elem;
  if (!p.slot_probs && !p.dslot_probs) {
    // A gather: the row times exactly 1 is the row (a bit copy, as torch's index_select).
    std::memcpy(drow, dout_row, static_cast<size_t>(p.H) * elem);
    return;
  }
  const float prob = p.slot_probs ? p.slot_probs[i] : 1.0f;
  if (p.dtype == DType::kFloat32 || p.dtype == DType::kBFloat16) {
    const char* x = p.permuted + static_cast<size_t>(i * p.H) * elem;
    const double dot = scale_row_dot(dout_row, x, p.dtype, prob, drow, p.H, p.dslot_probs != nullptr);
    if (p.dslot_probs) p.dslot_probs[i] = dot;
    return;
  }
  if (!p.dslot_probs && p.dtype == DType::kFloat32) {
    // fp32 needs no conversion: scale straight into the output row (the same products).
    const float* dy = reinterpret_cast<const float*>(dout_row);
    float* out = reinterpret_cast<float*>(drow);
    for (int64_t h = 0; h < p.H; ++h) out[h] = dy[h] * prob;
    return;
  }
  float* dy = scratch;
  float* x = scratch + p.H;
  convert_to_f32(dout_row, p.dtype, dy, p.H);
  if (p.dslot_probs) {
    convert_to_f32(p.permuted + static_cast<size_t>(i * p.H) * elem, p.dtype, x, p.H);
    p.dslot_probs[i] = dot_f64_reference(dy, x, DType::kFloat32, p.H);  // fp16 widened exactly
  }
  for (int64_t h = 0; h < p.H; ++h) x[h] = dy[h] * prob;
  convert_from_f32(x, drow, p.dtype, p.H);
}

void unpermute_backward_sort(const UnpermuteBackwardProblem& p) {
  std::vector<float> scratch(static_cast<size_t>(2 * p.H));
  for (int64_t i = 0; i < p.N; ++i) unpermute_backward_row(p, i, scratch.data());
}

}  // namespace leanstep::moe::detail
