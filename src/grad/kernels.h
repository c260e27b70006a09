// Internal kernels of the gradient engine (shared by the fused path and the
// per-tensor reference). Each kernel processes one contiguous run (or one
// strided view) on the calling thread; the ops distribute runs over threads.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "leanstep/core.h"

namespace leanstep::grad::detail {

enum class NormKind : int { kNone = 0, kL2 = 1, kInf = 2, kL1 = 3, kGeneral = 4 };

NormKind norm_kind(double p);

// Partial result of a reduction. `sum` holds the sum of |x|^p (L2: squares,
// L1: |x|, general p), `max` the max |x| of non-NaN elements.
struct Partial {
  double sum = 0.0;
  float max = 0.0f;
  bool nan = false;        // a NaN was seen (inf-norm must return NaN)
  bool nonfinite = false;  // an inf or NaN INPUT was seen
  int64_t zeros = 0;
};

Partial combine(const Partial& a, const Partial& b);

// One contiguous run: optionally scales in place by `scale` (`multiplicity`
// times, rounding to the dtype after each, like the per-tensor loop applied to
// `multiplicity` views of the same memory) and accumulates the norm of the
// resulting values, counted `multiplicity` times. Non-finite checks see each
// value before it is scaled. `do_scale` false: read-only.
void reduce_scale_run(void* data, DType dtype, int64_t n, int multiplicity, NormKind kind, double p, bool do_scale,
                      float scale, Partial& out);

// Same for an arbitrary (strided) view, multiplicity 1, row-major element order.
void reduce_scale_view(const Tensor& view, NormKind kind, double p, bool do_scale, float scale, Partial& out);

// Number of elements equal to zero (+0 or -0) in a contiguous run / a view.
int64_t count_zeros_run(const void* data, DType dtype, int64_t n);
int64_t count_zeros_view(const Tensor& view);

// Element offsets (in elements, relative to view.data) in row-major order.
std::vector<int64_t> element_offsets(const Tensor& view);

// Value of x converted to fp32, multiplied by `scale` in fp32 and rounded once
// to `dtype` (fp64 values are scaled in double). Returned as double (exact).
inline double scale_round(double x, DType dtype, float scale) {
  switch (dtype) {
    case DType::kFloat64: return x * static_cast<double>(scale);
    case DType::kFloat32: return static_cast<double>(static_cast<float>(x) * scale);
    case DType::kFloat16: return half_to_float(float_to_half(static_cast<float>(x) * scale));
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(static_cast<float>(x) * scale));
    default: return x;
  }
}

// The p-th power contribution of one value.
inline double power_term(double v, NormKind kind, double p) {
  switch (kind) {
    case NormKind::kL2: return v * v;
    case NormKind::kL1: return std::fabs(v);
    case NormKind::kGeneral: return std::pow(std::fabs(v), p);
    default: return 0.0;
  }
}

// The SIMD run kernel (Highway, dynamic dispatch): fp32/fp16/bf16 with
// multiplicity 1 and kind in {None, L2, Inf, L1}. Returns false when it does
// not handle the case (the caller then uses the scalar path).
bool simd_reduce_scale_run(void* data, DType dtype, int64_t n, NormKind kind, bool do_scale, float scale,
                           Partial& out);

}  // namespace leanstep::grad::detail
