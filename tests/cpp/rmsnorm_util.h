// RMSNorm test helpers: float64 oracles and the per-element error bounds the
// tests check against (derived in the comments below).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "leanstep/rmsnorm.h"
#include "test_util.h"

namespace leanstep::testing::rmsnorm_util {

using leanstep::rmsnorm::Options;
using leanstep::rmsnorm::RoundingOrder;

inline double u32() { return std::ldexp(1.0, -24); }

// Smallest subnormal spacing of a dtype: the absolute error of rounding a value
// that lands in the subnormal range.
inline double subnormal_step(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return std::ldexp(1.0, -24);
    case DType::kBFloat16: return std::ldexp(1.0, -133);
    default: return std::ldexp(1.0, -149);
  }
}

inline std::vector<double> effective_gamma64(const Tensor& gamma, bool zero_centered) {
  std::vector<double> g = to_doubles(gamma);
  if (zero_centered)
    for (double& v : g) v = static_cast<double>(1.0f + static_cast<float>(v));  // 1+gamma is formed in fp32
  return g;
}

struct ForwardOracle {
  std::vector<double> y, rstd;
};

// Exact math in fp64 on the (already rounded) inputs; eps used as fp32, as the kernels do.
inline ForwardOracle forward_oracle(const Tensor& x, const Tensor& gamma, const Options& o) {
  const int64_t h = x.shape[x.ndim - 1];
  const int64_t rows = x.numel() / h;
  const std::vector<double> xv = to_doubles(x), g = effective_gamma64(gamma, o.zero_centered_gamma);
  const double eps = static_cast<float>(o.eps);
  ForwardOracle out{std::vector<double>(xv.size()), std::vector<double>(static_cast<size_t>(rows))};
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += xv[r * h + i] * xv[r * h + i];
    const double rs = 1.0 / std::sqrt(ss / h + eps);
    out.rstd[r] = rs;
    for (int64_t i = 0; i < h; ++i) out.y[r * h + i] = xv[r * h + i] * rs * g[i];
  }
  return out;
}

// Relative error bound of the computed fp32 rstd. The sum of squares is split
// over >= 4 independent accumulators (vector lanes x 4 accumulators in the fused
// kernel), so each partial sum has at most ceil(H/4) terms: relative error
// <= (H/4 + 12) u (12 covers a lane-combining tree of up to 64 lanes, the final
// division by H and the eps addition). sqrt halves that and adds u; the
// reciprocal adds u.
inline double rstd_rel_bound(int64_t h) { return ((static_cast<double>(h) / 4 + 13) / 2 + 2) * u32(); }

// |y - y64| <= |y64| (delta_r + 2u + u_y [+ u_x for cast-then-scale]) + subnormal
// steps: the two fp32 multiplies, the one cast to y (and the extra cast to x's
// dtype of cast-then-scale, whose value is then multiplied by g).
inline double y_bound(double y64, double g, int64_t h, DType x_dtype, DType y_dtype, const Options& o) {
  double rel = rstd_rel_bound(h) + 3 * u32() + unit_roundoff(y_dtype);
  double abs = subnormal_step(y_dtype);
  if (o.rounding == RoundingOrder::kCastThenScale) {
    rel += unit_roundoff(x_dtype);
    abs += std::abs(g) * subnormal_step(x_dtype);
  }
  return 1.5 * (rel * std::abs(y64) + abs);  // 1.5: slack for second-order terms
}

struct BackwardOracle {
  std::vector<double> dx, dgamma;
  std::vector<double> dx_bound;       // per-element bound for the fused and reference dx
  std::vector<double> dgamma_bound;   // per-column bound for dgamma
};

// Exact math in fp64 given the saved fp32 rstd (the backward's input), with the
// error bounds of an fp32 implementation (derivation inline).
inline BackwardOracle backward_oracle(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                                      DType dx_dtype, DType dgamma_dtype, const Options& o) {
  const int64_t h = x.shape[x.ndim - 1];
  const int64_t rows = x.numel() / h;
  const std::vector<double> xv = to_doubles(x), dyv = to_doubles(dy), rv = to_doubles(rstd);
  const std::vector<double> g = effective_gamma64(gamma, o.zero_centered_gamma);
  const double u = u32();
  BackwardOracle b;
  b.dx.resize(xv.size());
  b.dx_bound.resize(xv.size());
  b.dgamma.assign(static_cast<size_t>(h), 0.0);
  std::vector<double> dgamma_abs(static_cast<size_t>(h), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double rs = rv[r];
    double dot = 0, dot_abs = 0;
    for (int64_t i = 0; i < h; ++i) {
      const double t = g[i] * dyv[r * h + i] * xv[r * h + i] * rs;
      dot += t;
      dot_abs += std::abs(t);
    }
    const double m = dot / h;
    // Each term g*dy*(x*r) carries 3 roundings; the fp32 sum of H terms over >= 4
    // accumulators adds (H/4 + 12) u of sum|terms|; /H adds one more.
    const double m_err = (static_cast<double>(h) / 4 + 16) * u * dot_abs / h;
    for (int64_t i = 0; i < h; ++i) {
      const size_t k = static_cast<size_t>(r * h + i);
      const double xhat = xv[k] * rs, gdy = g[i] * dyv[k];
      b.dx[k] = rs * (gdy - xhat * m);
      b.dgamma[i] += dyv[k] * xhat;
      dgamma_abs[i] += std::abs(dyv[k] * xhat);
      // dx = r*(g*dy - xhat*m): g*dy and xhat one rounding each, xhat*m one more,
      // the subtraction (or FMA) one, the multiply by r one, the cast to dx's dtype.
      const double inner = 2 * u * std::abs(gdy) + std::abs(xhat) * (3 * u * std::abs(m) + m_err);
      b.dx_bound[k] = 1.5 * (std::abs(rs) * inner + (2 * u + unit_roundoff(dx_dtype)) * std::abs(b.dx[k]) +
                             subnormal_step(dx_dtype));
    }
  }
  // dgamma: each term dy*(x*r) has 2 roundings; rows are summed sequentially in
  // fixed chunks and the chunks by a tree: at most rows + 2 accumulated roundings
  // of sum|terms| (a loose but valid bound); then one cast to dgamma's dtype.
  b.dgamma_bound.resize(static_cast<size_t>(h));
  for (int64_t i = 0; i < h; ++i)
    b.dgamma_bound[i] = 1.5 * ((static_cast<double>(rows) + 4) * u * dgamma_abs[i] +
                               unit_roundoff(dgamma_dtype) * std::abs(b.dgamma[i]) + subnormal_step(dgamma_dtype));
  return b;
}

// The anchors' tolerances (reference note, "Reference tolerances used by the
// anchors"): |a - b| <= atol + rtol |b|.
struct Tol {
  double rtol, atol;
};
// Output y: fp32 atol 5e-7 (upper end of the anchors' 1e-7..5e-7) with torch's
// default fp32 rtol 1.3e-6; fp16 rtol 1e-3 / atol 2e-3; bf16 rtol 1e-2 / atol 2e-2.
inline Tol anchor_y(DType y_dtype) {
  switch (y_dtype) {
    case DType::kFloat16: return {1e-3, 2e-3};
    case DType::kBFloat16: return {1e-2, 2e-2};
    default: return {1.3e-6, 5e-7};
  }
}
// Gradients: rtol = atol = 5e-4 (the C++ operator tests; fp32 and fp16), bf16 rtol 1.6e-2 / atol 2e-2.
inline Tol anchor_grad(DType dtype) {
  return dtype == DType::kBFloat16 ? Tol{1.6e-2, 2e-2} : Tol{5e-4, 5e-4};
}

// Counts elements violating |got - want| <= bound (NaN counts as a violation);
// reports the first few.
inline int64_t count_violations(const std::vector<double>& got, const std::vector<double>& want,
                                const std::vector<double>& bound, const char* what) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    if (!(err <= bound[i])) {
      if (bad < 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << " want " << want[i] << " err " << err
                      << " > bound " << bound[i];
      ++bad;
    }
  }
  return bad;
}

inline std::vector<double> anchor_bounds(const std::vector<double>& want, Tol tol) {
  std::vector<double> b(want.size());
  for (size_t i = 0; i < want.size(); ++i) b[i] = tol.atol + tol.rtol * std::abs(want[i]);
  return b;
}

}  // namespace leanstep::testing::rmsnorm_util
