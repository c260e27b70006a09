// Scalar kernels: the exact per-element semantics, used for the rare cases
// the SIMD kernel does not take (fp64, general p, aliased runs, strided views).
#include <cmath>

#include "grad/kernels.h"

namespace leanstep::grad::detail {

NormKind norm_kind(double p) {
  if (std::isinf(p) && p > 0) return NormKind::kInf;
  if (p == 2.0) return NormKind::kL2;
  if (p == 1.0) return NormKind::kL1;
  return NormKind::kGeneral;
}

Partial combine(const Partial& a, const Partial& b) {
  Partial r;
  r.sum = a.sum + b.sum;
  r.max = a.max > b.max ? a.max : b.max;
  r.nan = a.nan || b.nan;
  r.nonfinite = a.nonfinite || b.nonfinite;
  r.zeros = a.zeros + b.zeros;
  return r;
}

namespace {

template <class OffsetOf>
void reduce_scale_generic(void* data, DType dtype, int64_t n, OffsetOf offset_of, int multiplicity, NormKind kind,
                          double p, bool do_scale, float scale, Partial& out) {
  double sum = 0.0;
  for (int64_t e = 0; e < n; ++e) {
    const int64_t off = offset_of(e);
    double v = load_as_double(data, dtype, off);
    for (int j = 0; j < (do_scale ? multiplicity : 1); ++j) {
      if (!std::isfinite(v)) out.nonfinite = true;
      if (do_scale) v = scale_round(v, dtype, scale);
    }
    if (do_scale) store_from_double(data, dtype, off, v);
    if (kind == NormKind::kInf) {
      if (std::isnan(v)) out.nan = true;
      else if (std::fabs(v) > out.max) out.max = static_cast<float>(std::fabs(v));
    } else if (kind != NormKind::kNone) {
      sum += multiplicity * power_term(v, kind, p);
    }
  }
  out.sum += sum;
}

}  // namespace

void reduce_scale_run(void* data, DType dtype, int64_t n, int multiplicity, NormKind kind, double p, bool do_scale,
                      float scale, Partial& out) {
  if (n <= 0) return;
  if (multiplicity == 1 || !do_scale) {
    Partial simd;
    if (simd_reduce_scale_run(data, dtype, n, kind, do_scale, scale, simd)) {
      simd.sum *= multiplicity;  // k views of the same values: k times the sum
      out = combine(out, simd);
      return;
    }
  }
  reduce_scale_generic(data, dtype, n, [](int64_t e) { return e; }, multiplicity, kind, p, do_scale, scale, out);
}

std::vector<int64_t> element_offsets(const Tensor& view) {
  const int64_t n = view.numel();
  std::vector<int64_t> offsets(static_cast<size_t>(n));
  if (n == 0) return offsets;
  int64_t index[kMaxDims] = {};
  int64_t off = 0;
  for (int64_t e = 0; e < n; ++e) {
    offsets[static_cast<size_t>(e)] = off;
    for (int d = view.ndim - 1; d >= 0; --d) {
      if (++index[d] < view.shape[d]) {
        off += view.strides[d];
        break;
      }
      off -= view.strides[d] * (view.shape[d] - 1);
      index[d] = 0;
    }
  }
  return offsets;
}

void reduce_scale_view(const Tensor& view, NormKind kind, double p, bool do_scale, float scale, Partial& out) {
  if (view.is_contiguous()) {
    reduce_scale_run(view.data, view.dtype, view.numel(), 1, kind, p, do_scale, scale, out);
    return;
  }
  const auto offsets = element_offsets(view);
  reduce_scale_generic(view.data, view.dtype, view.numel(), [&](int64_t e) { return offsets[static_cast<size_t>(e)]; },
                       1, kind, p, do_scale, scale, out);
}

int64_t count_zeros_run(const void* data, DType dtype, int64_t n) {
  int64_t zeros = 0;
  switch (dtype) {
    case DType::kFloat32: {
      const float* x = static_cast<const float*>(data);
      for (int64_t i = 0; i < n; ++i) zeros += x[i] == 0.0f;
      break;
    }
    case DType::kFloat64: {
      const double* x = static_cast<const double*>(data);
      for (int64_t i = 0; i < n; ++i) zeros += x[i] == 0.0;
      break;
    }
    case DType::kFloat16:
    case DType::kBFloat16: {
      const uint16_t* x = static_cast<const uint16_t*>(data);
      for (int64_t i = 0; i < n; ++i) zeros += (x[i] & 0x7FFFu) == 0;
      break;
    }
    default:
      for (int64_t i = 0; i < n; ++i) zeros += load_as_double(data, dtype, i) == 0.0;
  }
  return zeros;
}

int64_t count_zeros_view(const Tensor& view) {
  if (view.is_contiguous()) return count_zeros_run(view.data, view.dtype, view.numel());
  int64_t zeros = 0;
  for (int64_t off : element_offsets(view)) zeros += load_as_double(view.data, view.dtype, off) == 0.0;
  return zeros;
}

}  // namespace leanstep::grad::detail
