// RMSNorm numerics: fused and reference against a float64 oracle (per-element
// error bounds derived in rmsnorm_util.h) and against the anchors' tolerances;
// fused against reference; rounding orders, zero-centered gamma, tiny and huge
// variance rows, odd and multi-dimensional shapes, in-place use, empty inputs.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/rmsnorm.h"
#include "rmsnorm_util.h"
#include "bf16_rounding_util.h"
#include "test_util.h"

namespace leanstep {
namespace {

using namespace leanstep::testing;
using namespace leanstep::testing::rmsnorm_util;
namespace rn = leanstep::rmsnorm;

struct Shape {
  std::vector<int64_t> dims;
  int64_t hidden() const { return dims.back(); }
  int64_t rows() const {
    int64_t r = 1;
    for (size_t i = 0; i + 1 < dims.size(); ++i) r *= dims[i];
    return r;
  }
};

// The anchors' shapes (71,229), (29,541), plus H = 128, 2048, 4097, a 3-D shape,
// tiny ones, and a width that is not a multiple of any vector length.
const std::vector<Shape>& shapes() {
  static const std::vector<Shape> k = {{{71, 229}}, {{29, 541}}, {{2, 3, 128}}, {{6, 2048}},
                                       {{3, 4097}}, {{1, 1}},    {{5, 7}},       {{2, 2, 2, 33}}};
  return k;
}
const double kEps[] = {1e-1, 1e-3, 1e-5, 1e-7};

// x rows with per-row scales spanning tiny to huge variance (kept within each
// dtype's range: fp16 tops out at 65504 and its squares must fit fp32 sums).
void fill_rows(const Tensor& x, int64_t rows, int64_t h, std::mt19937_64& rng) {
  const bool half = x.dtype == DType::kFloat16;
  const double scales[] = {1.0, half ? 1e-3 : 1e-6, half ? 1e3 : 1e4, 0.05, 30.0};
  std::normal_distribution<double> dist(0.0, 1.0);
  for (int64_t r = 0; r < rows; ++r) {
    const double s = scales[r % 5];
    for (int64_t i = 0; i < h; ++i) store_from_double(x.data, x.dtype, r * h + i, s * dist(rng));
  }
}

void fill_gamma(const Tensor& gamma, bool zero_centered, std::mt19937_64& rng) {
  fill_normal(gamma, rng, zero_centered ? 0.0 : 1.0, 0.5);
}

struct Case {
  Shape shape;
  DType x_dtype, gamma_dtype, y_dtype;
  Options options;
  std::string name() const {
    return fmt::format("[{}] x={} gamma={} y={} eps={:g}{} {}", fmt::join(shape.dims, ","), dtype_name(x_dtype),
                       dtype_name(gamma_dtype), dtype_name(y_dtype), options.eps,
                       options.zero_centered_gamma ? " zero_centered" : "", rn::rounding_name(options.rounding));
  }
};

// All combinations the forward/backward tests sweep: every float dtype for x,
// gamma in x's dtype or fp32, y in x's dtype or fp32, both gamma conventions,
// both rounding orders, eps cycling through 1e-1 .. 1e-7.
std::vector<Case> cases() {
  std::vector<Case> out;
  int k = 0;
  for (const Shape& s : shapes())
    for (DType xd : float_dtypes())
      for (DType gd : {xd, DType::kFloat32})
        for (DType yd : {xd, DType::kFloat32})
          for (bool zc : {false, true})
            for (auto ro : {RoundingOrder::kScaleThenCast, RoundingOrder::kCastThenScale}) {
              if (xd == DType::kFloat32 && (gd != xd || yd != xd) ) continue;  // duplicates
              Options o;
              o.eps = kEps[k++ % 4];
              o.zero_centered_gamma = zc;
              o.rounding = ro;
              out.push_back({s, xd, gd, yd, o});
            }
  return out;
}

// A case's random inputs and the fused and reference forwards' outputs.
struct ForwardRun {
  Buffer x, gamma, y_fused, y_ref, r_fused, r_ref;
};

ForwardRun run_forward(const Case& c, std::mt19937_64& rng) {
  const int64_t rows = c.shape.rows(), h = c.shape.hidden();
  ForwardRun run{Buffer(c.x_dtype, c.shape.dims),  Buffer(c.gamma_dtype, {h}),
                 Buffer(c.y_dtype, c.shape.dims),  Buffer(c.y_dtype, c.shape.dims),
                 Buffer(DType::kFloat32, {rows}), Buffer(DType::kFloat32, {rows})};
  fill_rows(run.x, rows, h, rng);
  fill_gamma(run.gamma, c.options.zero_centered_gamma, rng);
  rn::forward_fused(run.x, run.gamma, run.y_fused, run.r_fused, c.options);
  rn::forward_reference(run.x, run.gamma, run.y_ref, run.r_ref, c.options);
  return run;
}

TEST(RmsNormForward, FusedAndReferenceMatchFloat64OracleAndAnchors) {
  std::mt19937_64 rng(test_seed());
  int checked = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name());
    const int64_t h = c.shape.hidden();
    const auto [x, gamma, y_fused, y_ref, r_fused, r_ref] = run_forward(c, rng);

    const ForwardOracle oracle = forward_oracle(x, gamma, c.options);
    const std::vector<double> g = effective_gamma64(gamma, c.options.zero_centered_gamma);
    std::vector<double> y_bound_v(oracle.y.size()), r_bound(oracle.rstd.size());
    for (size_t i = 0; i < oracle.y.size(); ++i)
      y_bound_v[i] = y_bound(oracle.y[i], g[i % h], h, c.x_dtype, c.y_dtype, c.options);
    for (size_t i = 0; i < r_bound.size(); ++i) r_bound[i] = rstd_rel_bound(h) * oracle.rstd[i];

    EXPECT_EQ(count_violations(to_doubles(r_fused), oracle.rstd, r_bound, "rstd fused vs oracle"), 0);
    EXPECT_EQ(count_violations(to_doubles(r_ref), oracle.rstd, r_bound, "rstd reference vs oracle"), 0);
    EXPECT_EQ(count_violations(to_doubles(y_fused), oracle.y, y_bound_v, "y fused vs oracle"), 0);
    EXPECT_EQ(count_violations(to_doubles(y_ref), oracle.y, y_bound_v, "y reference vs oracle"), 0);
    // The anchors compare against an fp32 implementation of the same rounding
    // order; ours is the reference (fp32 math, fp64-accumulated statistics).
    // Cast-then-scale rounds x*r to x's dtype first, so a last-bit difference in
    // rstd can flip that intermediate by one ulp of x's dtype: its tolerance is
    // the coarser of x's and y's.
    const DType tol_dtype = c.options.rounding == RoundingOrder::kCastThenScale &&
                                    unit_roundoff(c.x_dtype) > unit_roundoff(c.y_dtype)
                                ? c.x_dtype
                                : c.y_dtype;
    EXPECT_EQ(count_violations(to_doubles(y_fused), to_doubles(y_ref), anchor_bounds(to_doubles(y_ref), anchor_y(tol_dtype)),
                               "y fused vs reference (anchor tolerance)"),
              0);
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

TEST(RmsNormForward, RoundingOrdersDifferOnlyByTheExtraCast) {
  // For bf16 the two orders must actually differ on some elements (else the
  // option would be ignored), and cast-then-scale must equal g * cast_x(x*r)
  // computed from the saved rstd.
  std::mt19937_64 rng(test_seed());
  const int64_t rows = 16, h = 1000;
  Buffer x(DType::kBFloat16, {rows, h}), gamma(DType::kBFloat16, {h});
  fill_normal(x, rng);
  fill_normal(gamma, rng, 1.0, 0.5);
  Buffer y1(DType::kBFloat16, {rows, h}), y2(DType::kBFloat16, {rows, h}), r(DType::kFloat32, {rows});
  Options o;
  rn::forward_fused(x, gamma, y1, r, o);
  o.rounding = RoundingOrder::kCastThenScale;
  rn::forward_fused(x, gamma, y2, r, o);
  int64_t differ = 0, mismatch = 0;
  for (int64_t k = 0; k < rows * h; ++k) {
    const float xv = bf16_to_float(x.data_as<uint16_t>()[k]);
    const float gv = bf16_to_float(gamma.data_as<uint16_t>()[k % h]);
    const float t = bf16_to_float(float_to_bf16(xv * r.data_as<float>()[k / h]));
    const uint16_t expect = float_to_bf16(gv * t);
    mismatch += expect != y2.data_as<uint16_t>()[k];
    differ += y1.data_as<uint16_t>()[k] != y2.data_as<uint16_t>()[k];
  }
  EXPECT_EQ(mismatch, 0);
  EXPECT_GT(differ, 0);
}

TEST(RmsNormBackward, FusedAndReferenceMatchFloat64OracleAndAnchors) {
  std::mt19937_64 rng(test_seed());
  int checked = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name());
    const int64_t rows = c.shape.rows(), h = c.shape.hidden();
    // dy in the output's dtype, dx in x's dtype, dgamma in gamma's dtype.
    Buffer x(c.x_dtype, c.shape.dims), gamma(c.gamma_dtype, {h}), dy(c.y_dtype, c.shape.dims);
    fill_rows(x, rows, h, rng);
    fill_gamma(gamma, c.options.zero_centered_gamma, rng);
    fill_normal(dy, rng);
    Buffer y(c.y_dtype, c.shape.dims), rstd(DType::kFloat32, {rows});
    rn::forward_fused(x, gamma, y, rstd, c.options);

    Buffer dx_fused(c.x_dtype, c.shape.dims), dx_frozen(c.x_dtype, c.shape.dims), dx_ref(c.x_dtype, c.shape.dims);
    Buffer dg_fused(c.gamma_dtype, {h}), dg_ref(c.gamma_dtype, {h});
    rn::backward_fused(dy, x, rstd, gamma, dx_fused, &dg_fused.view(), c.options);
    rn::backward_fused(dy, x, rstd, gamma, dx_frozen, nullptr, c.options);
    rn::backward_reference(dy, x, rstd, gamma, dx_ref, &dg_ref.view(), c.options);

    const BackwardOracle b = backward_oracle(dy, x, rstd, gamma, c.x_dtype, c.gamma_dtype, c.options);
    EXPECT_EQ(count_violations(to_doubles(dx_fused), b.dx, b.dx_bound, "dx fused vs oracle"), 0);
    EXPECT_EQ(count_violations(to_doubles(dx_ref), b.dx, b.dx_bound, "dx reference vs oracle"), 0);
    EXPECT_EQ(count_violations(to_doubles(dg_fused), b.dgamma, b.dgamma_bound, "dgamma fused vs oracle"), 0);
    EXPECT_EQ(count_violations(to_doubles(dg_ref), b.dgamma, b.dgamma_bound, "dgamma reference vs oracle"), 0);
    EXPECT_TRUE(bitwise_equal(dx_fused, dx_frozen)) << "frozen dx differs from trainable dx";
    // Anchors against the float64 oracle, relative to the size of the row's
    // largest contribution (dx is a difference of two terms and can cancel to
    // ~0, where a pure relative tolerance means nothing): atol scales with
    // max|r*g*dy| of the row, which is 1 for the unit-scale rows anchors use.
    const Tol tdx = anchor_grad(c.x_dtype);
    std::vector<double> dx_anchor(b.dx.size());
    const std::vector<double> dyv = to_doubles(dy), rv = to_doubles(rstd);
    const std::vector<double> g = effective_gamma64(gamma, c.options.zero_centered_gamma);
    for (int64_t r = 0; r < rows; ++r) {
      double scale = 0;
      for (int64_t i = 0; i < h; ++i) scale = std::max(scale, std::abs(rv[r] * g[i] * dyv[r * h + i]));
      for (int64_t i = 0; i < h; ++i)
        dx_anchor[r * h + i] = tdx.atol * std::max(scale, 1e-30) + tdx.rtol * std::abs(b.dx[r * h + i]);
    }
    EXPECT_EQ(count_violations(to_doubles(dx_fused), b.dx, dx_anchor, "dx fused vs oracle (anchor tolerance)"), 0);
    const Tol tdg = anchor_grad(c.gamma_dtype);
    EXPECT_EQ(count_violations(to_doubles(dg_fused), b.dgamma, anchor_bounds(b.dgamma, tdg),
                               "dgamma fused vs oracle (anchor tolerance)"),
              0);
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

TEST(RmsNormBackward, ZeroCenteredGammaGivesTheSameGradientsAsPlainOnePlusGamma) {
  // d(1+gamma) = dgamma: a zero-centered gamma must give exactly the dx/dgamma
  // of a plain gamma holding 1+gamma (formed in fp32).
  std::mt19937_64 rng(test_seed());
  const int64_t rows = 37, h = 300;
  Buffer x(DType::kFloat32, {rows, h}), dy(DType::kFloat32, {rows, h});
  Buffer gamma(DType::kFloat32, {h}), one_plus(DType::kFloat32, {h});
  fill_normal(x, rng);
  fill_normal(dy, rng);
  fill_normal(gamma, rng, 0.0, 0.3);
  for (int64_t i = 0; i < h; ++i) one_plus.data_as<float>()[i] = 1.0f + gamma.data_as<float>()[i];
  Options zc;
  zc.zero_centered_gamma = true;
  Buffer y1(DType::kFloat32, {rows, h}), y2(DType::kFloat32, {rows, h}), r1(DType::kFloat32, {rows}),
      r2(DType::kFloat32, {rows});
  rn::forward_fused(x, gamma, y1, r1, zc);
  rn::forward_fused(x, one_plus, y2, r2, {});
  EXPECT_TRUE(bitwise_equal(y1, y2));
  Buffer dx1(DType::kFloat32, {rows, h}), dx2(DType::kFloat32, {rows, h}), dg1(DType::kFloat32, {h}),
      dg2(DType::kFloat32, {h});
  rn::backward_fused(dy, x, r1, gamma, dx1, &dg1.view(), zc);
  rn::backward_fused(dy, x, r2, one_plus, dx2, &dg2.view(), {});
  EXPECT_TRUE(bitwise_equal(dx1, dx2));
  EXPECT_TRUE(bitwise_equal(dg1, dg2));
  // gamma itself is never rewritten.
  for (int64_t i = 0; i < h; ++i) ASSERT_EQ(one_plus.data_as<float>()[i], 1.0f + gamma.data_as<float>()[i]);
}

TEST(RmsNormFused, DirectBf16RowsMatchTheWidenedScratchPathBitwise) {
  // bf16 rows are read and written in place by typed kernels; mixed-dtype calls
  // widen rows into fp32 scratch. Both run the same fp32 arithmetic, so the bf16
  // outputs must equal the fp32 outputs rounded once to bf16. Widths of up to 2048
  // in whole vector pairs keep g*dy and x*r of the dot pass for the dx pass (128,
  // 2048), the others compute them again (1, 7, 229, 4097): the same bits either way,
  // for a trainable and a frozen weight.
  std::mt19937_64 rng(test_seed());
  for (int64_t h : {1, 7, 128, 229, 2048, 4097}) {
    SCOPED_TRACE(h);
    const int64_t rows = 13;
    Buffer x(DType::kBFloat16, {rows, h}), gamma(DType::kBFloat16, {h}), dy(DType::kBFloat16, {rows, h});
    fill_normal(x, rng);
    fill_normal(gamma, rng, 1.0, 0.5);
    fill_normal(dy, rng);
    Buffer y16(DType::kBFloat16, {rows, h}), y32(DType::kFloat32, {rows, h}), r16(DType::kFloat32, {rows}),
        r32(DType::kFloat32, {rows});
    rn::forward_fused(x, gamma, y16, r16, {});
    rn::forward_fused(x, gamma, y32, r32, {});
    EXPECT_TRUE(bitwise_equal(r16, r32));
    Buffer y32_rounded(DType::kBFloat16, {rows, h});
    convert_from_f32(y32.data_as<float>(), y32_rounded.data(), DType::kBFloat16, rows * h);
    EXPECT_TRUE(bitwise_equal(y16, y32_rounded));

    Buffer dy32(DType::kFloat32, {rows, h}), dx16(DType::kBFloat16, {rows, h}), dx32(DType::kFloat32, {rows, h});
    convert_to_f32(dy.data(), DType::kBFloat16, dy32.data_as<float>(), rows * h);
    Buffer dg_direct(DType::kFloat32, {h}), dg_scratch(DType::kFloat32, {h});
    rn::backward_fused(dy, x, r16, gamma, dx16, &dg_direct.view(), {});
    rn::backward_fused(dy32, x, r16, gamma, dx32, &dg_scratch.view(), {});
    Buffer dx32_rounded(DType::kBFloat16, {rows, h});
    convert_from_f32(dx32.data_as<float>(), dx32_rounded.data(), DType::kBFloat16, rows * h);
    EXPECT_TRUE(bitwise_equal(dx16, dx32_rounded));
    EXPECT_TRUE(bitwise_equal(dg_direct, dg_scratch));
    Buffer dx16_frozen(DType::kBFloat16, {rows, h}), dx32_frozen(DType::kFloat32, {rows, h});
    rn::backward_fused(dy, x, r16, gamma, dx16_frozen, nullptr, {});
    rn::backward_fused(dy32, x, r16, gamma, dx32_frozen, nullptr, {});
    EXPECT_TRUE(bitwise_equal(dx16_frozen, dx16));
    EXPECT_TRUE(bitwise_equal(dx32_frozen, dx32));
  }
}

// rstd as torch forms it from a sum of squares: mean = sum / n, + eps, 1 / sqrt, in fp32.
float torch_rstd(float sum_squares, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

TEST(RmsNormForward, TorchOrderSumsInTorchsCascade) {
  // Rows whose sum of squares differs between torch's order and a plain one, each
  // derived by hand from the order (src/rmsnorm/torch_order.cpp) and checked against
  // torch's own rms_norm when written. Squares of 2^-12 are 2^-24: half an ulp of 1.
  struct Row {
    int64_t n;
    std::vector<std::pair<int64_t, float>> values;  // (from index, value) runs; the rest 2^-12
    float torch_sum, plain_sum;
  };
  const float tiny = std::ldexp(1.0f, -12);
  const std::vector<Row> rows = {
      // 8 lanes of 2^-24, a tail of 1: the tail first (1), each lane then a tie to even.
      {9, {{8, 1.0f}}, 1.0f, 1.0f + std::ldexp(1.0f, -21)},
      // n < 8: x[4..6] go into stream 0 with x[0] before stream 1 (2^24) joins it.
      {7, {{0, 1.0f}, {1, 4096.0f}, {2, 1.0f}}, 16777220.0f, 16777216.0f},
      // 1024 = 32 groups of 4 vectors: two runs of 16 in the cascade, each summed from 0;
      // the first group's squares are 1, so the second run (16 * 2^-24) is not lost.
      {1024, {{0, 1.0f}, {32, tiny}}, 32.0f + std::ldexp(1.0f, -15), 32.0f},
  };
  for (const Row& row : rows) {
    SCOPED_TRACE(row.n);
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      SCOPED_TRACE(dtype_name(dt));
      Buffer x(dt, {1, row.n}), gamma(dt, {row.n}), y(dt, {1, row.n}), r(DType::kFloat32, {1});
      for (int64_t i = 0; i < row.n; ++i) {
        float v = tiny;
        for (const auto& [from, value] : row.values)
          if (i >= from) v = value;
        store_from_double(x.data(), dt, i, v);
        store_from_double(gamma.data(), dt, i, 1.0);
      }
      Options o;
      o.eps = 1e-6;
      o.sum_order = rn::SumOrder::kTorchCpu;
      const float expected = torch_rstd(row.torch_sum, row.n, 1e-6f);
      ASSERT_NE(expected, torch_rstd(row.plain_sum, row.n, 1e-6f));  // the row tells the orders apart
      for (auto* forward : {&rn::forward_fused, &rn::forward_reference}) {
        forward(x, gamma, y, r, o);
        EXPECT_EQ(r.data_as<float>()[0], expected);
      }
    }
  }
}

TEST(RmsNormForward, TorchOrderFusedEqualsReferenceBitwise) {
  // Every case of the sweep in torch's order, with row counts that cross the fused
  // path's blocks and chunks: the fused path (direct bf16/fp32 rows, fp32 scratch rows
  // for fp16 and mixed dtypes) forms the reference's y and rstd bit for bit, and
  // stays within the float64 oracle's bounds.
  std::mt19937_64 rng(test_seed());
  int checked = 0;
  for (Case c : cases()) {
    c.options.sum_order = rn::SumOrder::kTorchCpu;
    SCOPED_TRACE(c.name());
    const int64_t h = c.shape.hidden();
    const auto [x, gamma, y_fused, y_ref, r_fused, r_ref] = run_forward(c, rng);
    EXPECT_TRUE(bitwise_equal(r_fused, r_ref));
    EXPECT_TRUE(bitwise_equal(y_fused, y_ref));
    const ForwardOracle oracle = forward_oracle(x, gamma, c.options);
    std::vector<double> r_bound(oracle.rstd.size());
    for (size_t i = 0; i < r_bound.size(); ++i) r_bound[i] = rstd_rel_bound(h) * oracle.rstd[i];
    EXPECT_EQ(count_violations(to_doubles(r_fused), oracle.rstd, r_bound, "rstd torch order vs oracle"), 0);
    ++checked;
  }
  EXPECT_GT(checked, 100);
}

TEST(RmsNormForward, InPlaceEqualsOutOfPlace) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : float_dtypes()) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t rows = 9, h = 333;
    Buffer x(dt, {rows, h}), gamma(dt, {h}), y(dt, {rows, h}), r(DType::kFloat32, {rows});
    fill_normal(x, rng);
    fill_normal(gamma, rng, 1.0, 0.5);
    for (auto ro : {RoundingOrder::kScaleThenCast, RoundingOrder::kCastThenScale}) {
      Options o;
      o.rounding = ro;
      Buffer x2(dt, {rows, h});
      std::memcpy(x2.data(), x.data(), x.nbytes());
      rn::forward_fused(x, gamma, y, r, o);
      rn::forward_fused(x2, gamma, x2, r, o);
      EXPECT_TRUE(bitwise_equal(y, x2));
      // backward with dx aliasing dy
      Buffer dy(dt, {rows, h}), dx(dt, {rows, h}), dg(dt, {h}), dg2(dt, {h});
      fill_normal(dy, rng);
      rn::backward_fused(dy, x, r, gamma, dx, &dg.view(), o);
      rn::backward_fused(dy, x, r, gamma, dy, &dg2.view(), o);
      EXPECT_TRUE(bitwise_equal(dx, dy));
      EXPECT_TRUE(bitwise_equal(dg, dg2));
    }
  }
}

TEST(RmsNormEmpty, ZeroRowsJustWorkAndDgammaIsAnEmptySum) {
  for (DType dt : float_dtypes()) {
    Buffer x(dt, {0, 64}), gamma(dt, {64}), y(dt, {0, 64}), r(DType::kFloat32, {0});
    Buffer dgamma(dt, {64});
    for (int64_t i = 0; i < 64; ++i) store_from_double(dgamma.data(), dt, i, 7.0);
    for (auto* fwd : {&rn::forward_fused, &rn::forward_reference}) EXPECT_NO_THROW(fwd(x, gamma, y, r, {}));
    rn::backward_fused(x, x, r, gamma, y, &dgamma.view(), {});
    for (double v : to_doubles(dgamma)) EXPECT_EQ(v, 0.0);
    for (int64_t i = 0; i < 64; ++i) store_from_double(dgamma.data(), dt, i, 7.0);
    rn::backward_reference(x, x, r, gamma, y, &dgamma.view(), {});
    for (double v : to_doubles(dgamma)) EXPECT_EQ(v, 0.0);
    // Leading dims of size zero in a 3-D shape, and null data for zero elements.
    Tensor x3(nullptr, dt, {4, 0, 16}), y3(nullptr, dt, {4, 0, 16}), r3(nullptr, DType::kFloat32, {0});
    Buffer g16(dt, {16});
    EXPECT_NO_THROW(rn::forward_fused(x3, g16, y3, r3, {}));
    EXPECT_NO_THROW(rn::backward_fused(x3, x3, r3, g16, y3, nullptr, {}));
  }
}

TEST(RmsNorm, HardwareBF16RoundingKeepsTheBits) {
  if (!leanstep::detail::cpu_has_avx512_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  std::mt19937_64 rng(test_seed());
  std::normal_distribution<float> normal;
  // Widths with and without a tail; a weight of tiny values makes subnormal outputs.
  for (int64_t h : {32, 256, 257, 2048}) {
    for (float scale : {1.0f, 1e-37f}) {
      const int64_t rows = 37;
      std::vector<float> xf(static_cast<size_t>(rows * h)), gf(static_cast<size_t>(h)), dyf(xf.size());
      for (auto& v : xf) v = normal(rng);
      for (auto& v : dyf) v = normal(rng);
      for (auto& v : gf) v = normal(rng) * scale;
      Buffer x(DType::kBFloat16, {rows, h}), dy(DType::kBFloat16, {rows, h}), gamma(DType::kBFloat16, {h});
      convert_from_f32(xf.data(), x.data(), DType::kBFloat16, rows * h);
      convert_from_f32(dyf.data(), dy.data(), DType::kBFloat16, rows * h);
      convert_from_f32(gf.data(), gamma.data(), DType::kBFloat16, h);
      std::vector<uint16_t> y[2], dx[2];
      for (int on = 0; on < 2; ++on) {
        HardwareBF16Rounding rounding(on == 1);
        Buffer yb(DType::kBFloat16, {rows, h}), dxb(DType::kBFloat16, {rows, h}), rstd(DType::kFloat32, {rows});
        rn::forward_fused(x, gamma, yb, rstd, {});
        rn::backward_fused(dy, x, rstd, gamma, dxb, nullptr, {});
        const auto* yp = static_cast<const uint16_t*>(yb.data());
        const auto* dxp = static_cast<const uint16_t*>(dxb.data());
        y[static_cast<size_t>(on)].assign(yp, yp + rows * h);
        dx[static_cast<size_t>(on)].assign(dxp, dxp + rows * h);
      }
      EXPECT_EQ(y[0], y[1]) << "h=" << h << " scale " << scale;
      EXPECT_EQ(dx[0], dx[1]) << "h=" << h << " scale " << scale;
      if (scale < 1.0f) {  // the tiny weight did make subnormal outputs: the fallback ran
        const bool subnormal = std::any_of(y[1].begin(), y[1].end(), [](uint16_t b) {
          return (b & 0x7F80u) == 0 && (b & 0x007Fu) != 0;
        });
        EXPECT_TRUE(subnormal) << "h=" << h;
      }
    }
  }
}

}  // namespace
}  // namespace leanstep
