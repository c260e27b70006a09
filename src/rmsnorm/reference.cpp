// The reference RMSNorm: obvious per-row scalar code on one thread. Every
// element-wise operation is done in fp32 exactly as the semantics state; the
// row sums (mean of squares, the backward's mean, dgamma) are accumulated in
// fp64 so the only rounding in a statistic is the final one to fp32. This is the
// oracle of semantics for the fused kernels and the benchmark baseline.
#include <cmath>
#include <vector>

#include "leanstep/rmsnorm.h"
#include "rmsnorm/checks.h"
#include "rmsnorm/kernels.h"

namespace leanstep::rmsnorm {
namespace {

float load(const void* data, DType dtype, int64_t i) { return static_cast<float>(load_as_double(data, dtype, i)); }
void store(void* data, DType dtype, int64_t i, float v) { store_from_double(data, dtype, i, v); }

// Rounds an fp32 value to `dtype` and back (the "cast" of cast-then-scale).
float round_to(DType dtype, float v) {
  switch (dtype) {
    case DType::kFloat16: return half_to_float(float_to_half(v));
    case DType::kBFloat16: return bf16_to_float(float_to_bf16(v));
    default: return v;
  }
}

}  // namespace

void forward_reference(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                       const Options& options) {
  const auto s = detail::check_forward("rmsnorm::forward_reference", x, gamma, y, rstd, options);
  const std::vector<float> g = detail::effective_gamma(gamma, options.zero_centered_gamma);
  const float eps = static_cast<float>(options.eps);
  const int64_t h = s.hidden;
  const bool torch_order = options.sum_order == SumOrder::kTorchCpu;
  std::vector<float> widened(torch_order ? static_cast<size_t>(h) : 0);  // one row, reused
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t base = row * h;
    float r;
    if (torch_order) {  // an order, not an accuracy: torch's
      for (int64_t i = 0; i < h; ++i) widened[static_cast<size_t>(i)] = load(x.data, x.dtype, base + i);
      r = detail::inv_rms(detail::sum_squares_torch_order(widened.data(), DType::kFloat32, h), h, eps);
    } else {
      double sum_squares = 0;
      for (int64_t i = 0; i < h; ++i) {
        const double v = load(x.data, x.dtype, base + i);
        sum_squares += v * v;
      }
      const float mean_square = static_cast<float>(sum_squares / static_cast<double>(h));
      r = 1.0f / std::sqrt(mean_square + eps);
    }
    static_cast<float*>(rstd.data)[row] = r;
    for (int64_t i = 0; i < h; ++i) {
      const float xv = load(x.data, x.dtype, base + i);
      const float out = options.rounding == RoundingOrder::kScaleThenCast
                            ? xv * r * g[static_cast<size_t>(i)]
                            : g[static_cast<size_t>(i)] * round_to(x.dtype, xv * r);
      store(y.data, y.dtype, base + i, out);
    }
  }
}

void backward_reference(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                        const Tensor& dx, const Tensor* dgamma, const Options& options) {
  const auto s = detail::check_backward("rmsnorm::backward_reference", dy, x, rstd, gamma, dx, dgamma, options);
  const std::vector<float> g = detail::effective_gamma(gamma, options.zero_centered_gamma);
  const int64_t h = s.hidden;
  std::vector<double> dgamma_sum(dgamma ? static_cast<size_t>(h) : 0, 0.0);
  std::vector<float> xhat(static_cast<size_t>(h)), g_dy(static_cast<size_t>(h));
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t base = row * h;
    const float r = static_cast<const float*>(rstd.data)[row];
    double dot = 0;
    for (int64_t i = 0; i < h; ++i) {
      const size_t k = static_cast<size_t>(i);
      xhat[k] = load(x.data, x.dtype, base + i) * r;
      const float dyv = load(dy.data, dy.dtype, base + i);
      g_dy[k] = g[k] * dyv;
      dot += static_cast<double>(g_dy[k] * xhat[k]);
      if (dgamma) dgamma_sum[k] += static_cast<double>(dyv * xhat[k]);
    }
    const float mean_dot = static_cast<float>(dot / static_cast<double>(h));
    for (int64_t i = 0; i < h; ++i) {
      const size_t k = static_cast<size_t>(i);
      store(dx.data, dx.dtype, base + i, r * (g_dy[k] - xhat[k] * mean_dot));
    }
  }
  if (dgamma)
    for (int64_t i = 0; i < h; ++i) store_from_double(dgamma->data, dgamma->dtype, i, dgamma_sum[static_cast<size_t>(i)]);
}

}  // namespace leanstep::rmsnorm
