#include "rmsnorm/checks.h"

#include <fmt/format.h>

#include <cmath>
#include <string>

namespace leanstep::rmsnorm::detail {
namespace {

constexpr std::initializer_list<DType> kFloatDTypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

void check_view(const Tensor& t, const char* where, const char* arg, bool cpu_only) {
  check_tensor(t, where, arg);
  if (cpu_only) check_cpu(t, where, arg);
  check_dtype(t, kFloatDTypes, where, arg);
  LEANSTEP_CHECK_ARG(t.is_contiguous(), where, arg,
                     fmt::format("must be contiguous (row-major) (got {} with strides [{}])", t.describe(),
                                 fmt::join(t.strides, t.strides + t.ndim, ", ")));
}

bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int d = 0; d < a.ndim; ++d)
    if (a.shape[d] != b.shape[d]) return false;
  return true;
}

std::string shape_string(const Tensor& t) {
  return fmt::format("[{}]", fmt::join(t.shape, t.shape + t.ndim, ", "));
}

bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty()) return false;
  return a.byte_begin() < b.byte_end() && b.byte_begin() < a.byte_end();
}

// `out` must not overlap `in`, except when it is exactly the same memory and
// dtype (an elementwise in-place update) and `in_place_ok`.
void check_no_overlap(const Tensor& out, const char* out_name, const Tensor& in, const char* in_name,
                      const char* where, bool in_place_ok) {
  if (!overlaps(out, in)) return;
  const bool identical = out.byte_begin() == in.byte_begin() && out.byte_end() == in.byte_end() &&
                         out.dtype == in.dtype;
  LEANSTEP_CHECK_ARG(in_place_ok && identical, where, out_name,
                     fmt::format("must not overlap '{}'{}", in_name,
                                 in_place_ok ? " (except as exactly the same memory and dtype)" : ""));
}

RowShape check_common(const char* where, const Tensor& x, const Tensor& gamma, const Tensor& rstd,
                      const Options& options, bool cpu_only) {
  check_view(x, where, "x", cpu_only);
  LEANSTEP_CHECK_ARG(x.ndim >= 1, where, "x", "must have at least 1 dim [..., H] (got a 0-dim tensor)");
  RowShape s;
  s.hidden = x.shape[x.ndim - 1];
  LEANSTEP_CHECK_ARG(s.hidden > 0, where, "x", fmt::format("must have a hidden size H > 0 (got shape {})", shape_string(x)));
  s.rows = x.numel() / s.hidden;

  check_view(gamma, where, "gamma", cpu_only);
  LEANSTEP_CHECK_ARG(gamma.ndim == 1 && gamma.shape[0] == s.hidden, where, "gamma",
                     fmt::format("must have shape [{}] (H of x) (got {})", s.hidden, shape_string(gamma)));

  check_tensor(rstd, where, "rstd");
  if (cpu_only) check_cpu(rstd, where, "rstd");
  check_dtype(rstd, {DType::kFloat32}, where, "rstd");
  LEANSTEP_CHECK_ARG(rstd.is_contiguous(), where, "rstd", "must be contiguous");
  LEANSTEP_CHECK_ARG(rstd.numel() == s.rows, where, "rstd",
                     fmt::format("must have one element per row ({} rows of x {}) (got {} elements)", s.rows,
                                 shape_string(x), rstd.numel()));

  LEANSTEP_CHECK_ARG(std::isfinite(options.eps) && options.eps >= 0, where, "eps",
                     fmt::format("must be finite and >= 0 (got {})", options.eps));
  LEANSTEP_CHECK_ARG(options.eps <= 3.0e38, where, "eps", fmt::format("must fit in fp32 (got {})", options.eps));
  LEANSTEP_CHECK_ARG(options.rounding == RoundingOrder::kScaleThenCast ||
                         options.rounding == RoundingOrder::kCastThenScale,
                     where, "rounding", "must be scale_then_cast or cast_then_scale");
  return s;
}

}  // namespace

RowShape check_forward(const char* where, const Tensor& x, const Tensor& gamma, const Tensor& y,
                       const Tensor& rstd, const Options& options, bool cpu_only) {
  const RowShape s = check_common(where, x, gamma, rstd, options, cpu_only);
  check_view(y, where, "y", cpu_only);
  LEANSTEP_CHECK_ARG(same_shape(y, x), where, "y",
                     fmt::format("must have the shape of x {} (got {})", shape_string(x), shape_string(y)));
  check_no_overlap(y, "y", x, "x", where, /*in_place_ok=*/true);
  check_no_overlap(y, "y", gamma, "gamma", where, false);
  check_no_overlap(rstd, "rstd", x, "x", where, false);
  check_no_overlap(rstd, "rstd", y, "y", where, false);
  check_no_overlap(rstd, "rstd", gamma, "gamma", where, false);
  return s;
}

RowShape check_backward(const char* where, const Tensor& dy, const Tensor& x, const Tensor& rstd,
                        const Tensor& gamma, const Tensor& dx, const Tensor* dgamma, const Options& options,
                        bool cpu_only) {
  const RowShape s = check_common(where, x, gamma, rstd, options, cpu_only);
  check_view(dy, where, "dy", cpu_only);
  LEANSTEP_CHECK_ARG(same_shape(dy, x), where, "dy",
                     fmt::format("must have the shape of x {} (got {})", shape_string(x), shape_string(dy)));
  check_view(dx, where, "dx", cpu_only);
  LEANSTEP_CHECK_ARG(same_shape(dx, x), where, "dx",
                     fmt::format("must have the shape of x {} (got {})", shape_string(x), shape_string(dx)));
  check_no_overlap(dx, "dx", x, "x", where, true);
  check_no_overlap(dx, "dx", dy, "dy", where, true);
  check_no_overlap(dx, "dx", gamma, "gamma", where, false);
  check_no_overlap(dx, "dx", rstd, "rstd", where, false);
  if (dgamma) {
    check_view(*dgamma, where, "dgamma", cpu_only);
    LEANSTEP_CHECK_ARG(dgamma->ndim == 1 && dgamma->shape[0] == s.hidden, where, "dgamma",
                       fmt::format("must have shape [{}] (H of x) (got {})", s.hidden, shape_string(*dgamma)));
    check_no_overlap(*dgamma, "dgamma", x, "x", where, false);
    check_no_overlap(*dgamma, "dgamma", dy, "dy", where, false);
    check_no_overlap(*dgamma, "dgamma", dx, "dx", where, false);
    check_no_overlap(*dgamma, "dgamma", gamma, "gamma", where, false);
    check_no_overlap(*dgamma, "dgamma", rstd, "rstd", where, false);
  }
  return s;
}

std::vector<float> effective_gamma(const Tensor& gamma, bool zero_centered) {
  const int64_t h = gamma.numel();
  std::vector<float> g(static_cast<size_t>(h));
  convert_to_f32(gamma.data, gamma.dtype, g.data(), h);
  if (zero_centered)
    for (float& v : g) v = 1.0f + v;
  return g;
}

}  // namespace leanstep::rmsnorm::detail

namespace leanstep::rmsnorm {

// The names are the Python entry points': the device backends' callers.
void check_forward_args(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                        const Options& options) {
  detail::check_forward("rms_norm", x, gamma, y, rstd, options, /*cpu_only=*/false);
}

void check_backward_args(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                         const Tensor& dx, const Tensor* dgamma) {
  detail::check_backward("rms_norm_backward", dy, x, rstd, gamma, dx, dgamma, Options{}, /*cpu_only=*/false);
}

}  // namespace leanstep::rmsnorm
