// Internal pieces shared by the MoE reference and fused paths: validated
// problem descriptions (raw pointers + 64-bit sizes), index and float row
// access. Validation happens once in moe.cpp; the implementations trust these.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "leanstep/core.h"

namespace leanstep::moe::detail {

// Index vector of int64 or int32 elements (sorted_indices, split sizes, ...).
struct IndexView {
  void* data = nullptr;
  bool is64 = true;
  int64_t get(int64_t i) const {
    return is64 ? static_cast<const int64_t*>(data)[i] : static_cast<const int32_t*>(data)[i];
  }
  void set(int64_t i, int64_t v) const {
    if (is64) static_cast<int64_t*>(data)[i] = v;
    else static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v);
  }
};

// Loads element i of a fp32/fp16/bf16 buffer as float (exact).
inline float load_f32(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kFloat16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<float>(load_as_double(data, dtype, i));
  }
}

// permute, both paths. Row copies are dtype-agnostic byte copies (a gather is bit-exact).
struct PermuteProblem {
  const uint8_t* map = nullptr;  // bool [T, E]
  int64_t T = 0, E = 0;
  const char* tokens = nullptr;  // [T, row_bytes]
  size_t row_bytes = 0;
  const char* probs = nullptr;   // [T, E] of prob_bytes each, or null
  size_t prob_bytes = 0;
  int64_t N = 0;                 // output rows
  bool drop_and_pad = false;
  int64_t capacity = 0;          // drop_and_pad: N / E
  char* permuted = nullptr;      // [N, row_bytes]
  char* permuted_probs = nullptr;  // [N] or null
  IndexView indices;             // [N]
};

// Both paths return the number of routed pairs and throw (before writing anything)
// when the plain path has more routed pairs than N.
void permute_sort(const PermuteProblem& p);
void permute_fused(const PermuteProblem& p);

// unpermute / permute backward, both paths.
struct UnpermuteProblem {
  const char* permuted = nullptr;  // [N, H] of dtype
  DType dtype = DType::kFloat32;
  int64_t N = 0, H = 0, T = 0;
  IndexView indices;               // [N], values in [-1, T)
  const float* slot_probs = nullptr;  // [N] or null (prob 1)
  char* out = nullptr;             // [T, H] of dtype
};
void unpermute_sort(const UnpermuteProblem& p);
void unpermute_fused(const UnpermuteProblem& p);

// unpermute backward: dpermuted[i] = cast(dout[t_i] * prob_i); dslot_probs[i] = dot in float64.
struct UnpermuteBackwardProblem {
  const char* dout = nullptr;      // [T, H]
  const char* permuted = nullptr;  // [N, H] (needed only for dslot_probs)
  DType dtype = DType::kFloat32;
  int64_t N = 0, H = 0, T = 0;
  IndexView indices;
  const float* slot_probs = nullptr;  // [N] or null
  char* dpermuted = nullptr;          // [N, H]
  double* dslot_probs = nullptr;      // [N] or null
};
void unpermute_backward_sort(const UnpermuteBackwardProblem& p);
void unpermute_backward_fused(const UnpermuteBackwardProblem& p);

// One row of unpermute backward (shared: both paths do the same per-row arithmetic,
// the fused path only runs rows in parallel). `scratch` holds 2*H floats.
void unpermute_backward_row(const UnpermuteBackwardProblem& p, int64_t i, float* scratch);

}  // namespace leanstep::moe::detail
