// The conformance harness (after ggml's test-backend-ops): every op of the
// table (leanstep/ops.h) x every installed implementation x every compiled
// Highway target, against the op's reference, over shapes, dtypes, odd and
// empty sizes, strided views and in-place calls, with each op's declared
// tolerance:
//
//   moe.*      bitwise (the fused path keeps the reference's order and sums)
//   rmsnorm.*  within bounds derived from the inputs (the reference sums a
//              row in one fp32 accumulator, the fast path in SIMD lanes; see
//              rmsnorm_bounds below)
//   grad.*     bitwise for everything but a norm: scaled grads, found_inf, the
//              clip coefficient of a given norm, zero counts; a norm within 8
//              fp32 ulp of the reference's (both are within 2 ulp of a float64
//              oracle at these sizes, docs/grad.md), and what norm_clip derives
//              from it: its coefficient 8 fp32 ulp, its grads 10 fp32 ulp or 2
//              ulp of a 16-bit dtype.
//
// The CPU backend is the only one in C++; the torch and Triton backends are
// held to the same reference by tests/python/test_*_device.py and
// test_triton_*.py. Adding an op means one row in the table, its kernels, and
// one case list here (the static_assert below fails until it exists).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <hwy/targets.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/ops.h"
#include "moe_util.h"
#include "test_util.h"

namespace leanstep {
namespace {

using testing::fill_normal;

// ---------------------------------------------------------------- the harness

// One output of a call and the tolerance that applies to it.
struct Output {
  std::string name;
  Buffer value;
  double rel_ulps = 0;        // 0 (and no bound): bitwise; else |a - b| <= rel_ulps * ulp(dtype) * |reference|
  std::vector<double> bound;  // if given: |a - b| <= bound[i], derived from the inputs
};
using Outputs = std::vector<Output>;

// A case builds its inputs from `seed` (the same for every implementation),
// runs `impl` through the op's call_impl and returns its outputs, or nullopt
// when that implementation's guard declines the case.
struct Case {
  std::string name;
  std::function<std::optional<Outputs>(const std::string& impl, uint64_t seed)> run;
};

struct OpCases {
  std::string op;
  std::vector<Case> cases;
};

int64_t offset_of(const Tensor& t, int64_t i) {
  int64_t offset = 0;
  for (int d = t.ndim - 1; d >= 0; --d) {
    offset += (i % t.shape[d]) * t.strides[d];
    i /= t.shape[d];
  }
  return offset;
}

// A contiguous copy of any (possibly strided) view.
Buffer copy_of(const Tensor& t) {
  Buffer b(t.dtype, std::vector<int64_t>(t.shape, t.shape + t.ndim));
  const size_t es = t.element_size();
  for (int64_t i = 0; i < t.numel(); ++i)
    std::memcpy(static_cast<char*>(b.data()) + i * es, static_cast<const char*>(t.data) + offset_of(t, i) * es, es);
  return b;
}

double ulp(DType dtype) { return 2 * testing::unit_roundoff(dtype); }

std::string describe_difference(const std::string& name, int64_t i, double got, double want, const char* what) {
  char buf[320];
  std::snprintf(buf, sizeof buf, "%s[%lld]: %.9g vs reference %.9g (%s)", name.c_str(), static_cast<long long>(i),
                got, want, what);
  return buf;
}

// "" when `got` matches `want` under want's tolerance, else the first difference.
std::string compare(const Output& got, const Output& want) {
  const Tensor& a = got.value.view();
  const Tensor& b = want.value.view();
  if (a.dtype != b.dtype || a.numel() != b.numel()) return want.name + ": shape or dtype differs";
  const size_t es = a.element_size();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const bool same = std::memcmp(static_cast<const char*>(a.data) + i * es, static_cast<const char*>(b.data) + i * es,
                                  es) == 0;
    if (same) continue;
    const double x = load_as_double(a.data, a.dtype, i), y = load_as_double(b.data, b.dtype, i);
    if (want.rel_ulps == 0 && want.bound.empty()) return describe_difference(want.name, i, x, y, "bits differ");
    if (std::isnan(x) && std::isnan(y)) continue;
    const double limit = want.bound.empty() ? want.rel_ulps * ulp(b.dtype) * std::fabs(y)
                                            : want.bound[static_cast<size_t>(i)];
    if (!(std::fabs(x - y) <= limit)) return describe_difference(want.name, i, x, y, "outside the declared bound");
  }
  return "";
}

// Every disagreement of an installed implementation with the reference, as
// "op / impl / case: what", over `seeds` fresh inputs per case.
std::vector<std::string> disagreements(const OpCases& spec, const std::vector<uint64_t>& seeds) {
  const dispatch::OpBase& op = dispatch::registry().op(spec.op);
  std::vector<std::string> found;
  for (const Case& c : spec.cases) {
    for (uint64_t seed : seeds) {
      const std::optional<Outputs> want = c.run(op.reference_name(), seed);
      if (!want) {
        found.push_back(spec.op + " / " + op.reference_name() + " / " + c.name + ": the reference declined");
        continue;
      }
      for (const std::string& impl : op.installed()) {
        const std::optional<Outputs> got = c.run(impl, seed);
        if (!got) continue;  // its guard declined: the dispatcher would not run it here
        for (size_t k = 0; k < want->size(); ++k) {
          const std::string diff = compare((*got)[k], (*want)[k]);
          if (!diff.empty())
            found.push_back(spec.op + " / " + impl + " / " + c.name + " (seed " + std::to_string(seed) + "): " + diff);
        }
      }
    }
  }
  return found;
}

// The backend context every case runs with (host memory; no workspace).
const dispatch::Context kHost{};

// Runs a void implementation with the host context; false when its guard declined.
template <class Slot, class... Args>
bool run_impl(Slot& slot, const std::string& impl, Args&&... args) {
  return slot.call_impl(impl, std::forward<Args>(args)..., kHost) == nullptr;
}

template <class... O>
Outputs make_outputs(O&&... o) {
  Outputs v;
  (v.push_back(std::forward<O>(o)), ...);
  return v;
}

Output bitwise(std::string name, const Tensor& t) { return Output{std::move(name), copy_of(t), 0, {}}; }
Output within(std::string name, const Tensor& t, double rel_ulps) { return Output{std::move(name), copy_of(t), rel_ulps, {}}; }
Output bounded(std::string name, const Tensor& t, std::vector<double> bound) {
  return Output{std::move(name), copy_of(t), 0, std::move(bound)};
}

// ---------------------------------------------------------------- grad cases

// A list of grads: views of a few buffers (adjacent views of one dtype
// coalesce into regions), optionally with an empty view, a strided (generic)
// view, a non-finite value and exact zeros.
struct GradShape {
  std::string name;
  std::vector<std::pair<DType, std::vector<int64_t>>> buffers;  // per buffer: dtype, sizes of its views
  bool strided = false;
  bool nonfinite = false;
};

struct Grads {
  std::vector<Buffer> storage;
  std::vector<Tensor> views;
};

Grads make_grads(const GradShape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Grads g;
  for (const auto& [dtype, sizes] : shape.buffers) {
    int64_t total = 0;
    for (int64_t s : sizes) total += s;
    g.storage.emplace_back(dtype, std::initializer_list<int64_t>{total});
    Buffer& b = g.storage.back();
    if (dtype == DType::kFloat64) {
      // Uniform in [-0.5, 0.5) with all 53 bits from the generator: normal_distribution
      // goes through log and sqrt, whose last bit differs between libms (aarch64 vs
      // x86-64), and fp64 keeps that bit, so the cross-architecture digests would differ.
      for (int64_t i = 0; i < total; ++i)
        store_from_double(b.data(), dtype, i, static_cast<double>(rng() >> 11) * 0x1p-53 - 0.5);
    } else {
      fill_normal(b.view(), rng, 0.0, 0.5);
    }
    for (int64_t i = 0; i < total; i += 7) store_from_double(b.data(), dtype, i, 0.0);  // zeros to count
    int64_t at = 0;
    for (int64_t s : sizes) {
      g.views.push_back(Tensor::contiguous(static_cast<char*>(b.data()) + at * dtype_size(dtype), dtype, &s, 1));
      at += s;
    }
  }
  if (shape.strided) {  // a [6, 5] view with row stride 9: generic
    g.storage.emplace_back(DType::kFloat32, std::initializer_list<int64_t>{54});
    Buffer& b = g.storage.back();
    fill_normal(b.view(), rng);
    Tensor v = Tensor::contiguous(b.data(), DType::kFloat32, std::vector<int64_t>{6, 5}.data(), 2);
    v.strides[0] = 9;
    g.views.push_back(v);
  }
  if (shape.nonfinite && !g.views.empty()) {
    const Tensor& last = g.storage.front().view();
    store_from_double(last.data, last.dtype, last.numel() - 1, INFINITY);
  }
  return g;
}

std::vector<GradShape> grad_shapes() {
  return {
      {"empty list", {}, false, false},
      {"one fp32 grad of one element", {{DType::kFloat32, {1}}}, false, false},
      {"mixed dtypes, odd sizes, an empty view",
       {{DType::kFloat32, {17, 0, 70001, 3}}, {DType::kBFloat16, {1025, 9}}, {DType::kFloat16, {4099}}},
       false, false},
      // fp64 grads are scaled in double by every implementation (the reference
      // scale once went through multi_tensor_scale's fp32 arithmetic).
      {"fp64 and fp32 grads", {{DType::kFloat64, {1000, 7}}, {DType::kFloat32, {33}}}, false, false},
      {"with a strided view", {{DType::kFloat32, {31, 4097}}}, true, false},
      {"only a strided view", {}, true, false},
      {"a non-finite value", {{DType::kFloat32, {100, 2000}}, {DType::kBFloat16, {77}}}, false, true},
  };
}

Buffer scalar(DType dtype, double value) {
  Buffer b(dtype, {1});
  store_from_double(b.data(), dtype, 0, value);
  return b;
}

Outputs grads_after(const Grads& g, double rel_ulps_fp32, double rel_ulps_16bit) {
  Outputs out;
  for (size_t i = 0; i < g.views.size(); ++i) {
    const double tol = g.views[i].dtype == DType::kFloat32 ? rel_ulps_fp32 : rel_ulps_16bit;
    out.push_back(within("grads[" + std::to_string(i) + "]", g.views[i], tol));
  }
  return out;
}

constexpr double kNormUlps = 8;

OpCases grad_cases(const std::string& op_name) {
  OpCases spec{op_name, {}};
  for (const GradShape& shape : grad_shapes()) {
    for (double p : {2.0, 1.0, grad::kInfNorm}) {
      const bool norm_op = op_name == "grad.norm" || op_name == "grad.unscale_norm" || op_name == "grad.norm_clip";
      if (!norm_op && p != 2.0) continue;
      const std::string name = shape.name + (norm_op ? ", p=" + std::to_string(p) : "");
      spec.cases.push_back({name, [shape, p, op_name](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
        Grads g = make_grads(shape, seed);
        const grad::Plan plan(g.views);
        Buffer norm = scalar(DType::kFloat32, -1), found = scalar(DType::kFloat32, 0);
        Buffer coeff = scalar(DType::kFloat32, -1);
        Outputs out;
        if (op_name == "grad.norm") {
          if (!run_impl(ops::grad_norm_op(), impl, plan, norm.view(), p, &found.view(), nullptr)) return std::nullopt;
          out = make_outputs(within("norm", norm, kNormUlps), bitwise("found_inf", found));
        } else if (op_name == "grad.unscale_norm") {
          Buffer inv = scalar(DType::kFloat32, 0.25);
          if (!run_impl(ops::grad_unscale_norm_op(), impl, plan, inv.view(), norm.view(), found.view(), p, nullptr))
            return std::nullopt;
          out = grads_after(g, 0, 0);
          out.push_back(within("norm", norm, kNormUlps));
          out.push_back(bitwise("found_inf", found));
        } else if (op_name == "grad.unscale") {
          Buffer inv = scalar(DType::kFloat32, 0.25);
          if (!run_impl(ops::grad_unscale_op(), impl, plan, inv.view(), found.view())) return std::nullopt;
          out = grads_after(g, 0, 0);
          out.push_back(bitwise("found_inf", found));
        } else if (op_name == "grad.clip") {
          Buffer total = scalar(DType::kFloat32, 3.75);
          if (!run_impl(ops::grad_clip_op(), impl, plan, total.view(), 1.0, &coeff.view())) return std::nullopt;
          out = grads_after(g, 0, 0);
          out.push_back(bitwise("coeff", coeff));
        } else if (op_name == "grad.norm_clip") {
          if (!run_impl(ops::grad_norm_clip_op(), impl, plan, 0.5, norm.view(), p, &found.view(), &coeff.view(),
                        nullptr))
            return std::nullopt;
          out = grads_after(g, 10, 2);
          out.push_back(within("norm", norm, kNormUlps));
          out.push_back(bitwise("found_inf", found));
          out.push_back(within("coeff", coeff, kNormUlps));
        } else if (op_name == "grad.scale") {
          Buffer s = scalar(DType::kFloat32, 0.37);
          if (!run_impl(ops::grad_scale_op(), impl, plan, s.view())) return std::nullopt;
          out = grads_after(g, 0, 0);
        } else if (op_name == "grad.count_zeros") {
          Buffer count = scalar(DType::kInt64, -1);
          if (!run_impl(ops::grad_count_zeros_op(), impl, plan, count.view(), nullptr)) return std::nullopt;
          out = make_outputs(bitwise("count", count));
        }
        return out;
      }});
    }
  }
  return spec;
}

OpCases multi_tensor_scale_cases() {
  OpCases spec{"grad.multi_tensor_scale", {}};
  struct Pairs {
    std::string name;
    std::vector<std::pair<DType, DType>> dtypes;  // source -> destination
    std::vector<int64_t> sizes;
    bool in_place;
    bool nonfinite;
  };
  const std::vector<Pairs> shapes = {
      {"no pairs", {}, {}, false, false},
      {"fp32 -> bf16/fp16, odd sizes", {{DType::kFloat32, DType::kBFloat16}, {DType::kFloat32, DType::kFloat16}},
       {4099, 1}, false, false},
      {"fp16 -> fp32 and bf16 -> fp32", {{DType::kFloat16, DType::kFloat32}, {DType::kBFloat16, DType::kFloat32}},
       {33, 70000}, false, false},
      {"in place fp32, an empty pair", {{DType::kFloat32, DType::kFloat32}, {DType::kFloat32, DType::kFloat32}},
       {0, 513}, true, false},
      {"a non-finite source", {{DType::kFloat32, DType::kFloat32}}, {100}, false, true},
  };
  for (const Pairs& shape : shapes) {
    spec.cases.push_back({shape.name, [shape](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
      std::mt19937_64 rng(seed);
      std::vector<Buffer> src, dst;
      for (size_t i = 0; i < shape.dtypes.size(); ++i) {
        src.emplace_back(shape.dtypes[i].first, std::initializer_list<int64_t>{shape.sizes[i]});
        fill_normal(src.back().view(), rng, 0.0, 100.0);
        dst.emplace_back(shape.dtypes[i].second, std::initializer_list<int64_t>{shape.sizes[i]});
      }
      if (shape.nonfinite) store_from_double(src[0].data(), src[0].view().dtype, 50, NAN);
      std::vector<Tensor> in, out;
      for (size_t i = 0; i < src.size(); ++i) {
        in.push_back(src[i].view());
        out.push_back(shape.in_place ? src[i].view() : dst[i].view());
      }
      Buffer s = scalar(DType::kFloat32, 0.01), found = scalar(DType::kFloat32, 0);
      if (!run_impl(ops::grad_multi_tensor_scale_op(), impl, std::span<const Tensor>(in),
                    std::span<const Tensor>(out), s.view(), found.view()))
        return std::nullopt;
      Outputs o;
      for (size_t i = 0; i < out.size(); ++i) o.push_back(bitwise("dst[" + std::to_string(i) + "]", out[i]));
      o.push_back(bitwise("found_inf", found));
      return o;
    }});
  }
  return spec;
}

// ---------------------------------------------------------------- rmsnorm cases

struct NormShape {
  int64_t rows, hidden;
  DType x, gamma, y;
  bool zero_centered;
  rmsnorm::RoundingOrder rounding;
  bool in_place;
};

std::vector<NormShape> norm_shapes() {
  using R = rmsnorm::RoundingOrder;
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  return {
      {0, 8, f32, f32, f32, false, R::kScaleThenCast, false},
      {1, 1, f32, f32, f32, false, R::kScaleThenCast, false},
      {5, 7, bf16, bf16, bf16, true, R::kScaleThenCast, false},
      {33, 300, f32, f32, f32, false, R::kScaleThenCast, true},
      {9, 4100, bf16, bf16, bf16, false, R::kCastThenScale, false},
      {17, 129, f16, f32, f16, true, R::kScaleThenCast, false},
      {6, 2048, bf16, f32, f32, false, R::kScaleThenCast, false},
      {64, 1000, bf16, bf16, bf16, false, R::kScaleThenCast, true},
  };
}

std::string norm_name(const NormShape& s) {
  return std::to_string(s.rows) + "x" + std::to_string(s.hidden) + " x " + dtype_name(s.x) + ", gamma " +
         dtype_name(s.gamma) + ", y " + dtype_name(s.y) + (s.zero_centered ? ", zero-centered" : "") +
         (s.rounding == rmsnorm::RoundingOrder::kCastThenScale ? ", cast then scale" : "") +
         (s.in_place ? ", in place" : "");
}

// The declared rmsnorm tolerance, per element, from the inputs (u = 2^-24).
// A row's sum of H squares has relative error <= (H - 1) u in one sequential
// fp32 accumulator (the reference) and <= (H/4 + 12) u in the fast path's
// lanes (docs/rmsnorm.md); /H, + eps, sqrt (halves it, + u) and the
// reciprocal (+ u) give |r - r'| <= d_r r with d_r = ((1.25 H + 24) / 2 + 4) u.
// - y = cast(x r g): (d_r + 4u) |y| for the fp32 products, + 1 ulp of y's
//   dtype (the cast may round either way), + 1 ulp of x's dtype for
//   cast-then-scale (x r is rounded to x's dtype first).
// - dx = r (g dy - xhat m), m = mean(g dy xhat) (rstd is an input here, the
//   same on both sides): the mean's sums differ by (1.25 H + 24) u of
//   mean|g dy xhat|, carried by r |xhat|; the last operations by 4 u of
//   r (|g dy| + |xhat m|); the cast by 1 ulp of dx's dtype. Doubled.
// - dgamma = sum over rows of dy xhat: 2 (rows + 4) u sum|dy xhat| (sequential
//   fp32 sums on one side, per-chunk partials plus a pairwise tree on the
//   other), + 1 ulp of dgamma's dtype.
double rstd_delta(int64_t h) { return ((1.25 * static_cast<double>(h) + 24) / 2 + 4) * std::ldexp(1.0, -24); }

std::vector<double> y_bounds(const Tensor& y_ref, int64_t h, DType x_dtype, bool cast_then_scale) {
  const double u = std::ldexp(1.0, -24);
  std::vector<double> b(static_cast<size_t>(y_ref.numel()));
  for (int64_t i = 0; i < y_ref.numel(); ++i) {
    const double y = std::fabs(load_as_double(y_ref.data, y_ref.dtype, i));
    b[static_cast<size_t>(i)] =
        y * (rstd_delta(h) + 4 * u + ulp(y_ref.dtype) + (cast_then_scale ? ulp(x_dtype) : 0.0)) + 1e-37;
  }
  return b;
}

std::vector<double> rstd_bounds(const Tensor& rstd_ref, int64_t h) {
  std::vector<double> b(static_cast<size_t>(rstd_ref.numel()));
  for (int64_t i = 0; i < rstd_ref.numel(); ++i)
    b[static_cast<size_t>(i)] = rstd_delta(h) * std::fabs(load_as_double(rstd_ref.data, DType::kFloat32, i));
  return b;
}

OpCases rmsnorm_forward_cases() {
  OpCases spec{"rmsnorm.forward", {}};
  for (const NormShape& s : norm_shapes()) {
    if (s.in_place && s.x != s.y) continue;
    spec.cases.push_back({norm_name(s), [s](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
      std::mt19937_64 rng(seed);
      Buffer x(s.x, {s.rows, s.hidden}), gamma(s.gamma, {s.hidden}), y(s.y, {s.rows, s.hidden});
      Buffer rstd(DType::kFloat32, {s.rows});
      fill_normal(x.view(), rng);
      fill_normal(gamma.view(), rng, s.zero_centered ? 0.0 : 1.0, 0.2);
      const rmsnorm::Options o{1e-6, s.zero_centered, s.rounding};
      const Tensor& out = s.in_place ? x.view() : y.view();
      if (!run_impl(ops::rmsnorm_forward_op(), impl, x.view(), gamma.view(), out, rstd.view(), o,
                    rmsnorm::CallContext{}))
        return std::nullopt;
      const bool cts = s.rounding == rmsnorm::RoundingOrder::kCastThenScale;
      return make_outputs(bounded("y", out, y_bounds(out, s.hidden, s.x, cts)),
                          bounded("rstd", rstd, rstd_bounds(rstd.view(), s.hidden)));
    }});
  }
  return spec;
}

struct BackwardBounds {
  std::vector<double> dx, dgamma;
};

BackwardBounds backward_bounds(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                               bool zero_centered, const Tensor& dx_ref, const Tensor* dgamma_ref) {
  const double u = std::ldexp(1.0, -24);
  const int64_t rows = x.shape[0], h = x.shape[1];
  BackwardBounds b;
  b.dx.resize(static_cast<size_t>(rows * h));
  std::vector<double> column_abs(static_cast<size_t>(h), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double rs = load_as_double(rstd.data, DType::kFloat32, r);
    double mean = 0, mean_abs = 0;
    for (int64_t j = 0; j < h; ++j) {
      const double g = load_as_double(gamma.data, gamma.dtype, j) + (zero_centered ? 1.0 : 0.0);
      const double t = g * load_as_double(dy.data, dy.dtype, r * h + j) * load_as_double(x.data, x.dtype, r * h + j) * rs;
      mean += t;
      mean_abs += std::fabs(t);
    }
    mean /= static_cast<double>(h);
    mean_abs /= static_cast<double>(h);
    for (int64_t j = 0; j < h; ++j) {
      const double g = load_as_double(gamma.data, gamma.dtype, j) + (zero_centered ? 1.0 : 0.0);
      const double d = load_as_double(dy.data, dy.dtype, r * h + j);
      const double xhat = std::fabs(load_as_double(x.data, x.dtype, r * h + j) * rs);
      const double dxv = std::fabs(load_as_double(dx_ref.data, dx_ref.dtype, r * h + j));
      b.dx[static_cast<size_t>(r * h + j)] =
          2 * (rs * xhat * (1.25 * static_cast<double>(h) + 24) * u * mean_abs +
               4 * u * rs * (std::fabs(g * d) + xhat * std::fabs(mean))) +
          ulp(dx_ref.dtype) * dxv + 1e-37;
      column_abs[static_cast<size_t>(j)] += std::fabs(d * xhat);
    }
  }
  if (dgamma_ref) {
    for (int64_t j = 0; j < h; ++j)
      b.dgamma.push_back(2 * static_cast<double>(rows + 4) * u * column_abs[static_cast<size_t>(j)] +
                         ulp(dgamma_ref->dtype) * std::fabs(load_as_double(dgamma_ref->data, dgamma_ref->dtype, j)) +
                         1e-37);
  }
  return b;
}

OpCases rmsnorm_backward_cases() {
  OpCases spec{"rmsnorm.backward", {}};
  for (const NormShape& s : norm_shapes()) {
    if (s.in_place || s.y != s.x) continue;
    for (bool trainable : {false, true}) {
      spec.cases.push_back({norm_name(s) + (trainable ? ", trainable" : ", frozen"),
                            [s, trainable](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
        std::mt19937_64 rng(seed);
        Buffer x(s.x, {s.rows, s.hidden}), gamma(s.gamma, {s.hidden}), dy(s.x, {s.rows, s.hidden});
        Buffer dx(s.x, {s.rows, s.hidden}), dgamma(s.gamma, {s.hidden}), rstd(DType::kFloat32, {s.rows});
        fill_normal(x.view(), rng);
        fill_normal(dy.view(), rng);
        fill_normal(gamma.view(), rng, s.zero_centered ? 0.0 : 1.0, 0.2);
        for (int64_t r = 0; r < s.rows; ++r) rstd.data_as<float>()[r] = 0.5f + 0.01f * static_cast<float>(r % 13);
        const rmsnorm::Options o{1e-6, s.zero_centered, s.rounding};
        rmsnorm::CallContext context;
        context.weight_requires_grad = trainable;
        if (!run_impl(ops::rmsnorm_backward_op(), impl, dy.view(), x.view(), rstd.view(), gamma.view(), dx.view(),
                      trainable ? &dgamma.view() : nullptr, o, context))
          return std::nullopt;
        BackwardBounds b = backward_bounds(dy.view(), x.view(), rstd.view(), gamma.view(), s.zero_centered, dx.view(),
                                           trainable ? &dgamma.view() : nullptr);
        Outputs out = make_outputs(bounded("dx", dx, std::move(b.dx)));
        if (trainable) out.push_back(bounded("dgamma", dgamma, std::move(b.dgamma)));
        return out;
      }});
    }
  }
  return spec;
}

// ---------------------------------------------------------------- moe cases

struct MoeShape {
  int64_t T, E, k, H;
  DType dtype;
  bool probs;
  int extra_rows;      // num_out_tokens = routed + extra (-1: not given)
  bool drop_and_pad;   // num_out_tokens = E * capacity
};

std::vector<MoeShape> moe_shapes() {
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  return {
      {0, 4, 2, 8, f32, true, 3, false},     {1, 1, 1, 1, f32, false, -1, false},
      {37, 5, 2, 19, bf16, true, -1, false}, {64, 16, 4, 130, f16, true, 5, false},
      {41, 6, 3, 23, f32, true, 0, true},    {50, 8, 2, 2050, bf16, false, 0, false},
  };
}

std::string moe_name(const MoeShape& s) {
  return "T" + std::to_string(s.T) + " E" + std::to_string(s.E) + " k" + std::to_string(s.k) + " H" +
         std::to_string(s.H) + " " + dtype_name(s.dtype) + (s.probs ? ", probs" : "") +
         (s.drop_and_pad ? ", drop and pad" : s.extra_rows >= 0 ? ", +" + std::to_string(s.extra_rows) + " rows" : "");
}

// The routing and the reference permutation of a case (its indices feed the
// other ops' inputs).
struct Routed {
  Buffer map, probs, tokens, permuted, permuted_probs, indices;
  std::optional<int64_t> num_out;
  int64_t rows = 0;
};

Routed route_case(const MoeShape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Routed r;
  r.map = testing::random_map(s.T, s.E, s.k, rng, 0.1, s.E > 2 ? 1 : -1);
  r.probs = testing::random_probs(r.map.view(), DType::kFloat32, rng);
  r.tokens = Buffer(s.dtype, {s.T, s.H});
  fill_normal(r.tokens.view(), rng);
  const int64_t routed = moe::count_routed(r.map.view());
  if (s.drop_and_pad) r.num_out = s.E * std::max<int64_t>(1, s.T / s.E);
  else if (s.extra_rows >= 0) r.num_out = routed + s.extra_rows;
  r.rows = moe::permute_output_rows(r.map.view(), r.num_out, s.drop_and_pad);
  r.permuted = Buffer(s.dtype, {r.rows, s.H});
  r.permuted_probs = Buffer(DType::kFloat32, {r.rows});
  r.indices = Buffer(DType::kInt64, {r.rows});
  return r;
}

OpCases moe_cases(const std::string& op_name) {
  OpCases spec{op_name, {}};
  for (const MoeShape& s : moe_shapes()) {
    spec.cases.push_back({moe_name(s), [s, op_name](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
      Routed r = route_case(s, seed);
      const Tensor* probs = s.probs ? &r.probs.view() : nullptr;
      if (op_name == "moe.permute") {
        if (!run_impl(ops::moe_permute_op(), impl, r.tokens.view(), r.map.view(), probs, r.num_out, s.drop_and_pad,
                      r.permuted.view(), s.probs ? &r.permuted_probs.view() : nullptr, r.indices.view()))
          return std::nullopt;
        Outputs out = make_outputs(bitwise("permuted", r.permuted), bitwise("sorted_indices", r.indices));
        if (s.probs) out.push_back(bitwise("permuted_probs", r.permuted_probs));
        return out;
      }
      // The other ops take the reference permutation's indices and fresh rows.
      ops::moe_permute_op().call_impl("sort", r.tokens.view(), r.map.view(), probs, r.num_out, s.drop_and_pad,
                                      r.permuted.view(), s.probs ? &r.permuted_probs.view() : nullptr, r.indices.view(),
                                      kHost);
      std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ULL);
      Buffer rows(s.dtype, {r.rows, s.H});
      fill_normal(rows.view(), rng);
      const Tensor* map = s.probs ? &r.map.view() : nullptr;
      if (op_name == "moe.unpermute") {
        Buffer out(s.dtype, {s.T, s.H});
        if (!run_impl(ops::moe_unpermute_op(), impl, rows.view(), r.indices.view(), out.view(), probs, map,
                      s.drop_and_pad && s.probs))
          return std::nullopt;
        return make_outputs(bitwise("out", out));
      }
      if (op_name == "moe.permute_backward") {
        Buffer dtokens(s.dtype, {s.T, s.H});
        if (!run_impl(ops::moe_permute_backward_op(), impl, rows.view(), r.indices.view(), dtokens.view()))
          return std::nullopt;
        return make_outputs(bitwise("dtokens", dtokens));
      }
      Buffer dout(s.dtype, {s.T, s.H}), dpermuted(s.dtype, {r.rows, s.H}), dprobs(DType::kFloat32, {s.T, s.E});
      fill_normal(dout.view(), rng);
      if (!run_impl(ops::moe_unpermute_backward_op(), impl, dout.view(), rows.view(), r.indices.view(), probs, map,
                    s.drop_and_pad && s.probs, dpermuted.view(), s.probs ? &dprobs.view() : nullptr))
        return std::nullopt;
      Outputs out = make_outputs(bitwise("dpermuted", dpermuted));
      if (s.probs) out.push_back(bitwise("dprobs", dprobs));
      return out;
    }});
  }
  return spec;
}

// The MoE ops with one implementation (their reference): held to themselves
// here, to their oracles in tests/cpp/test_moe*.cpp; listed so that every op
// of the table runs on every target and gets its digest.
OpCases moe_probs_backward_cases() {
  OpCases spec{"moe.permute_probs_backward", {}};
  for (const MoeShape& s : moe_shapes()) {
    spec.cases.push_back({moe_name(s), [s](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
      Routed r = route_case(s, seed);
      ops::moe_permute_op().call_impl("sort", r.tokens.view(), r.map.view(), nullptr, r.num_out, s.drop_and_pad,
                                      r.permuted.view(), nullptr, r.indices.view(), kHost);
      std::mt19937_64 rng(seed ^ 0x5bd1e995ULL);
      Buffer dpermuted_probs(DType::kFloat32, {r.rows}), dprobs(DType::kFloat32, {s.T, s.E});
      fill_normal(dpermuted_probs.view(), rng);
      if (!run_impl(ops::moe_permute_probs_backward_op(), impl, dpermuted_probs.view(), r.indices.view(),
                    r.map.view(), s.drop_and_pad, dprobs.view()))
        return std::nullopt;
      return make_outputs(bitwise("dprobs", dprobs));
    }});
  }
  return spec;
}

OpCases pad_routing_map_cases() {
  OpCases spec{"moe.pad_routing_map", {}};
  for (const MoeShape& s : moe_shapes()) {
    for (int64_t multiple : {1, 4, 7}) {
      spec.cases.push_back({moe_name(s) + ", multiple " + std::to_string(multiple),
                            [s, multiple](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
        Routed r = route_case(s, seed);
        Buffer out(DType::kBool, {s.T, s.E});
        if (!run_impl(ops::moe_pad_routing_map_op(), impl, r.map.view(), multiple, out.view())) return std::nullopt;
        return make_outputs(bitwise("out", out));
      }});
    }
  }
  return spec;
}

OpCases sort_chunks_cases() {
  OpCases spec{"moe.sort_chunks_by_idxs", {}};
  struct Chunks {
    std::vector<int64_t> sizes;
    int64_t extra_rows, hidden;
    DType dtype;
    bool probs;
  };
  const DType f32 = DType::kFloat32, bf16 = DType::kBFloat16, f16 = DType::kFloat16;
  const std::vector<Chunks> shapes = {
      {{}, 0, 8, f32, false},          {{0, 0}, 3, 5, f32, true},      {{3, 0, 5, 1}, 0, 17, bf16, true},
      {{7, 2, 9}, 4, 2050, f16, false}, {{1, 1, 1, 1, 1, 1, 1}, 0, 1, f32, true},
  };
  for (const Chunks& c : shapes) {
    std::string name = "sizes";
    for (int64_t v : c.sizes) name += " " + std::to_string(v);
    name += ", +" + std::to_string(c.extra_rows) + " rows, H" + std::to_string(c.hidden) + " " + dtype_name(c.dtype) +
            (c.probs ? ", probs" : "");
    spec.cases.push_back({name, [c](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
      std::mt19937_64 rng(seed);
      int64_t rows = c.extra_rows;
      for (int64_t v : c.sizes) rows += v;
      std::vector<int64_t> order(c.sizes.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
      std::shuffle(order.begin(), order.end(), rng);
      Buffer sizes = testing::index_buffer(c.sizes), idxs = testing::index_buffer(order);
      Buffer in(c.dtype, {rows, c.hidden}), out(c.dtype, {rows, c.hidden});
      Buffer probs(DType::kFloat32, {rows}), out_probs(DType::kFloat32, {rows});
      fill_normal(in.view(), rng);
      fill_normal(probs.view(), rng);
      fill_normal(out.view(), rng);  // rows beyond the chunks keep their place: start from noise
      if (!run_impl(ops::moe_sort_chunks_by_idxs_op(), impl, in.view(), sizes.view(), idxs.view(), out.view(),
                    c.probs ? &probs.view() : nullptr, c.probs ? &out_probs.view() : nullptr))
        return std::nullopt;
      Outputs o = make_outputs(bitwise("out", out));
      if (c.probs) o.push_back(bitwise("out_probs", out_probs));
      return o;
    }});
  }
  return spec;
}

OpCases route_cases() {
  OpCases spec{"moe.route", {}};
  struct Routing {
    int64_t T, E, k;
    DType dtype;
    moe::ScoreFunction score;
    std::optional<double> capacity_factor;
    bool pad_to_capacity;
  };
  using SF = moe::ScoreFunction;
  const std::vector<Routing> shapes = {
      {0, 4, 2, DType::kFloat32, SF::kSoftmax, std::nullopt, false},
      {1, 1, 1, DType::kFloat32, SF::kSigmoid, std::nullopt, false},
      {37, 8, 2, DType::kBFloat16, SF::kSoftmax, 1.0, false},
      {64, 16, 4, DType::kFloat16, SF::kSigmoid, 0.5, true},
      {33, 5, 3, DType::kFloat32, SF::kSoftmax, std::nullopt, false},
  };
  for (const Routing& c : shapes) {
    const std::string name = "T" + std::to_string(c.T) + " E" + std::to_string(c.E) + " k" + std::to_string(c.k) +
                             " " + dtype_name(c.dtype) + (c.score == SF::kSigmoid ? ", sigmoid" : ", softmax") +
                             (c.capacity_factor ? ", capacity" : "") + (c.pad_to_capacity ? ", padded" : "");
    spec.cases.push_back({name, [c](const std::string& impl, uint64_t seed) -> std::optional<Outputs> {
      std::mt19937_64 rng(seed);
      Buffer logits(c.dtype, {c.T, c.E}), map(DType::kBool, {c.T, c.E}), probs(DType::kFloat32, {c.T, c.E});
      Buffer counts(DType::kInt64, {c.E});
      fill_normal(logits.view(), rng);
      moe::RoutingConfig config;
      config.topk = c.k;
      config.score_function = c.score;
      config.capacity_factor = c.capacity_factor;
      config.pad_to_capacity = c.pad_to_capacity;
      if (!run_impl(ops::moe_route_op(), impl, logits.view(), config, nullptr, map.view(), probs.view(),
                    counts.view()))
        return std::nullopt;
      return make_outputs(bitwise("routing_map", map), bitwise("probs", probs),
                          bitwise("tokens_per_expert", counts));
    }});
  }
  return spec;
}

// ---------------------------------------------------------------- the case lists, one per op

// One entry per op of the table, in its order; a new op fails the
// static_assert until its cases are listed here.
struct CaseList {
  const char* op;
  OpCases (*make)();
};
constexpr CaseList kCaseLists[] = {
    {"grad.norm", [] { return grad_cases("grad.norm"); }},
    {"grad.unscale_norm", [] { return grad_cases("grad.unscale_norm"); }},
    {"grad.unscale", [] { return grad_cases("grad.unscale"); }},
    {"grad.clip", [] { return grad_cases("grad.clip"); }},
    {"grad.norm_clip", [] { return grad_cases("grad.norm_clip"); }},
    {"grad.scale", [] { return grad_cases("grad.scale"); }},
    {"grad.count_zeros", [] { return grad_cases("grad.count_zeros"); }},
    {"grad.multi_tensor_scale", &multi_tensor_scale_cases},
    {"rmsnorm.forward", &rmsnorm_forward_cases},
    {"rmsnorm.backward", &rmsnorm_backward_cases},
    {"moe.permute", [] { return moe_cases("moe.permute"); }},
    {"moe.unpermute", [] { return moe_cases("moe.unpermute"); }},
    {"moe.permute_backward", [] { return moe_cases("moe.permute_backward"); }},
    {"moe.unpermute_backward", [] { return moe_cases("moe.unpermute_backward"); }},
    {"moe.permute_probs_backward", &moe_probs_backward_cases},
    {"moe.pad_routing_map", &pad_routing_map_cases},
    {"moe.sort_chunks_by_idxs", &sort_chunks_cases},
    {"moe.route", &route_cases},
};
static_assert(std::size(kCaseLists) == ops::kNumOps,
              "every op of the table needs its case list in the conformance harness");

std::vector<OpCases> all_cases() {
  std::vector<OpCases> all;
  for (const CaseList& list : kCaseLists) {
    all.push_back(list.make());
    EXPECT_EQ(all.back().op, list.op);
  }
  return all;
}

// ---------------------------------------------------------------- tests

TEST(Conformance, EveryOpOfTheTableHasCases) {
  std::set<std::string> table, covered;
  for (const ops::OpEntry& e : ops::op_table()) table.insert(e.name);
  for (const OpCases& c : all_cases()) {
    covered.insert(c.op);
    EXPECT_FALSE(c.cases.empty()) << c.op;
  }
  EXPECT_EQ(table, covered);
}

// The Highway names of `targets`, space-separated.
std::string target_names(const std::vector<int64_t>& targets) {
  std::string names;
  for (int64_t target : targets) names += std::string(names.empty() ? "" : " ") + hwy::TargetName(target);
  return names;
}

// The targets to run: every one this build generated that the CPU has, or, where
// LEANSTEP_CONFORMANCE_TARGETS lists Highway target names (space-separated), those
// alone; each listed name must be one of them (else the test fails, naming it). The
// aarch64 suite's SVE passes name the targets whose code depends on the vector length,
// not NEON's (128-bit registers at every SVE length, run in its first pass).
std::vector<int64_t> targets_to_run() {
  const std::vector<int64_t> supported = hwy::SupportedAndGeneratedTargets();
  const char* listed = std::getenv("LEANSTEP_CONFORMANCE_TARGETS");
  if (listed == nullptr || *listed == '\0') return supported;
  std::vector<int64_t> chosen;
  std::istringstream words(listed);
  for (std::string word; words >> word;) {
    const auto it = std::find_if(supported.begin(), supported.end(),
                                 [&](int64_t t) { return word == hwy::TargetName(t); });
    if (it == supported.end()) {
      ADD_FAILURE() << "LEANSTEP_CONFORMANCE_TARGETS: each name must be a target this CPU runs ("
                    << target_names(supported) << "), got '" << word << "'";
      return {};
    }
    if (std::find(chosen.begin(), chosen.end(), *it) == chosen.end()) chosen.push_back(*it);
  }
  return chosen;
}

// LEANSTEP_CONFORMANCE_TARGETS as set for the test below, then restored.
class ConformanceTargetsEnv {
 public:
  explicit ConformanceTargetsEnv(const char* value) {
    const char* old = std::getenv(kName);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value == nullptr) unsetenv(kName);
    else setenv(kName, value, 1);
  }
  ~ConformanceTargetsEnv() {
    if (had_) setenv(kName, old_.c_str(), 1);
    else unsetenv(kName);
  }

 private:
  static constexpr const char* kName = "LEANSTEP_CONFORMANCE_TARGETS";
  bool had_ = false;
  std::string old_;
};

std::vector<int64_t> chosen_targets;  // static: EXPECT_NONFATAL_FAILURE takes no locals

TEST(Conformance, TargetListNarrowsTheRunAndNamesAnUnknownTarget) {
  const std::vector<int64_t> supported = hwy::SupportedAndGeneratedTargets();
  ASSERT_FALSE(supported.empty());
  {
    ConformanceTargetsEnv env(nullptr);
    EXPECT_EQ(targets_to_run(), supported);
  }
  {
    ConformanceTargetsEnv env("");
    EXPECT_EQ(targets_to_run(), supported);
  }
  {
    const std::string last = hwy::TargetName(supported.back());
    ConformanceTargetsEnv env((" " + last + "  " + last + " ").c_str());  // spaces, a repeat
    EXPECT_EQ(targets_to_run(), std::vector<int64_t>{supported.back()});
  }
  {
    ConformanceTargetsEnv env((std::string(hwy::TargetName(supported.front())) + " NO_SUCH_TARGET").c_str());
    EXPECT_NONFATAL_FAILURE(chosen_targets = targets_to_run(),
                            "LEANSTEP_CONFORMANCE_TARGETS: each name must be a target this CPU runs");
    EXPECT_TRUE(chosen_targets.empty());
  }
}

TEST(Conformance, EveryImplementationAgreesWithTheReferenceOnEveryTarget) {
  const uint64_t seed = testing::test_seed();
  const std::vector<uint64_t> seeds = {seed, seed + 1};
  const std::vector<OpCases> all = all_cases();
  std::vector<int64_t> targets = targets_to_run();
  ASSERT_FALSE(targets.empty());
  // Which targets ran is part of the result (on aarch64 under qemu: NEON and
  // the SVE targets qemu's CPU exposes); the CTest log and XML carry it.
  const std::string names = target_names(targets);
  std::printf("Highway targets run: %s\n", names.c_str());
  RecordProperty("highway_targets", names);
  // Every target of this build's baseline and above that the CPU has, each run.
  EXPECT_NE(hwy::SupportedTargets() & HWY_BASELINE_TARGETS, 0) << names;
  for (int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    size_t ran = 0;
    for (const OpCases& spec : all) {
      for (const std::string& d : disagreements(spec, seeds)) ADD_FAILURE() << hwy::TargetName(target) << ": " << d;
      ran += spec.cases.size();
    }
    EXPECT_GT(ran, 0u);
  }
  hwy::SetSupportedTargetsForTest(0);  // back to the best target
}

// The bitwise outputs of every case, from fixed seeds, folded into one
// FNV-1a digest per op / case / implementation: the same lines on every
// architecture (make test-aarch64 diffs the x86-64 run's against the arm64
// run's under qemu). Written where LEANSTEP_CONFORMANCE_DIGEST names a file.
uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

TEST(Conformance, BitwiseOutputsHaveTheSameDigestOnEveryArchitecture) {
  const char* path = std::getenv("LEANSTEP_CONFORMANCE_DIGEST");
  std::string lines;
  size_t digested = 0;
  for (const OpCases& spec : all_cases()) {
    const dispatch::OpBase& op = dispatch::registry().op(spec.op);
    std::vector<std::string> impls = {op.reference_name()};
    for (const std::string& impl : op.installed()) impls.push_back(impl);
    for (const Case& c : spec.cases) {
      for (const std::string& impl : impls) {
        for (uint64_t seed : {uint64_t{20261202}, uint64_t{7}}) {
          const std::optional<Outputs> got = c.run(impl, seed);
          if (!got) continue;
          uint64_t h = 14695981039346656037ull;
          size_t bitwise = 0;
          for (const Output& o : *got) {
            if (o.rel_ulps != 0 || !o.bound.empty()) continue;  // not bitwise on one machine either
            h = fnv1a(h, o.name.data(), o.name.size());
            h = fnv1a(h, o.value.data(), o.value.nbytes());
            ++bitwise;
          }
          if (bitwise == 0) continue;  // a norm alone: held to its bound, not to bits
          digested += bitwise;
          char buf[32];
          std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
          lines += spec.op + " / " + c.name + " / " + impl + " / seed " + std::to_string(seed) + ": " + buf + "\n";
        }
      }
    }
  }
  EXPECT_GT(digested, 0u);
  if (path && *path) {
    std::FILE* f = std::fopen(path, "w");
    ASSERT_NE(f, nullptr) << path;
    const bool written = std::fputs(lines.c_str(), f) >= 0;
    EXPECT_EQ(std::fclose(f), 0) << path;
    EXPECT_TRUE(written) << path;
  }
}

// The harness itself: an implementation that is wrong by one bit in one
// element, or only on empty-free inputs, is caught and named.
void off_by_one_bit(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out, const Tensor* probs,
                    const Tensor* routing_map, bool drop_and_pad, const dispatch::Context&) {
  moe::unpermute(permuted, sorted_indices, out, probs, routing_map, drop_and_pad, moe::Method::kFused);
  if (out.numel() > 3) static_cast<unsigned char*>(out.data)[3 * out.element_size()] ^= 1;
}

void norm_slightly_off(const grad::PlanView& plan, const Tensor& out_norm, double norm_type, const Tensor* found_inf,
                       comm::Communicator* comm, const dispatch::Context&) {
  grad::norm(plan, out_norm, norm_type, found_inf, comm);
  static_cast<float*>(out_norm.data)[0] *= 1.0f + 64 * 1.2e-7f;  // 64 ulp: beyond the declared 8
}

TEST(Conformance, ADeliberatelyBrokenImplementationIsCaught) {
  const std::vector<uint64_t> seeds = {testing::test_seed()};
  auto& unpermute = ops::moe_unpermute_op();
  unpermute.install("broken_for_test", &off_by_one_bit);
  const std::vector<std::string> found = disagreements(moe_cases("moe.unpermute"), seeds);
  unpermute.uninstall("broken_for_test");
  ASSERT_FALSE(found.empty());
  for (const std::string& d : found) {
    EXPECT_NE(d.find("moe.unpermute / broken_for_test / "), std::string::npos) << d;
    EXPECT_NE(d.find("bits differ"), std::string::npos) << d;
  }
  EXPECT_TRUE(disagreements(moe_cases("moe.unpermute"), seeds).empty());  // uninstalled: clean again

  auto& norm = ops::grad_norm_op();
  norm.install("broken_for_test", &norm_slightly_off);
  const std::vector<std::string> norm_found = disagreements(grad_cases("grad.norm"), seeds);
  norm.uninstall("broken_for_test");
  ASSERT_FALSE(norm_found.empty());
  EXPECT_NE(norm_found.front().find("outside the declared bound"), std::string::npos) << norm_found.front();
}

}  // namespace
}  // namespace leanstep
