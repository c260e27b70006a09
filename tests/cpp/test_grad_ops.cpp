// Fused ops against the float64 oracle and the per-tensor reference path.
//
// Tolerances: the engine and the reference accumulate |x|^p in double
// (relative error <= n * 2^-53, about 1e-10 here) and round the norm once to
// fp32 (2^-24). So both are within 2^-23 (relative) of the long-double oracle,
// and within 2^-22 of each other. Scaled values are compared bitwise: the
// per-element arithmetic (fp32 multiply, one rounding to the dtype) is exact
// and identical in both paths.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "fixtures/model_layouts.h"
#include "leanstep/grad.h"
#include "grad_util.h"
#include "leanstep/grad.h"
#include "leanstep/layout.h"

namespace leanstep {
namespace {
using grad::Plan;
using namespace leanstep::testing;

constexpr double kNormTol = 0x1p-23;
const double kNaN = std::numeric_limits<double>::quiet_NaN();
const double kInf = std::numeric_limits<double>::infinity();

// A realistic, messy grad list over one padded buffer of `dtype`:
// shuffled params (one larger than a work chunk), a duplicate, a sub-view,
// a view straddling two params, an empty view, and a strided view of a
// separate buffer (or, with `alias_strided`, of the grad buffer itself).
struct MessyGrads {
  layout::BufferLayout layout;
  Buffer storage;
  Buffer side;
  std::vector<Tensor> list;

  MessyGrads(DType dtype, std::mt19937_64& rng, bool alias_strided = false, int params = 24) {
    std::vector<layout::ParamSpec> specs;
    std::uniform_int_distribution<int64_t> dim(1, 97);
    for (int i = 0; i < params; ++i) specs.push_back({"p" + std::to_string(i), {dim(rng), dim(rng)}});
    specs.push_back({"big", {70001}});  // crosses a work-chunk boundary
    layout::LayoutOptions o;
    o.distributed_optimizer = true;
    o.dp_size = 3;
    o.bucket_size = 30000;
    o.grad_dtype = dtype;
    layout = layout::build_buffer_layout(specs, o);
    storage = Buffer(dtype, {layout.numel});
    side = Buffer(dtype, {40, 9});
    fill_normal(storage.view(), rng);
    fill_normal(side.view(), rng);
    list = layout.views(storage.data());
    std::shuffle(list.begin(), list.end(), rng);
    const auto& s0 = layout.params[0];
    const auto& s1 = layout.params[1];
    list.push_back(list[3]);                                                  // duplicate
    list.push_back(sub_view(storage.view(), s0.offset + s0.numel / 3, {s0.numel / 2 + 1}));  // sub-view
    // straddles the end of one param and the start of the next in address order
    const auto& lo = s1.offset < s0.offset ? s1 : s0;
    list.push_back(sub_view(storage.view(), lo.offset + lo.numel - 1, {2}));
    list.push_back(sub_view(storage.view(), 7, {0}));                          // empty
    if (alias_strided) list.push_back(strided_view(storage.data(), dtype, 5, 7, 13, 2));
    else list.push_back(strided_view(side.data(), dtype, 20, 4, 18, 2));
    std::shuffle(list.begin() + static_cast<long>(list.size()) / 2, list.end(), rng);
  }
  std::vector<char> save() const { return snapshot(storage.view()); }
  void load(const std::vector<char>& s) const { restore(storage.view(), s); }
  std::vector<char> save_side() const { return snapshot(side.view()); }
  void load_side(const std::vector<char>& s) const { restore(side.view(), s); }
};

double rel_diff(double a, double b) { return std::fabs(a - b) / std::max(std::fabs(b), 1e-300); }

TEST(GradOps, NormMatchesFloat64OracleAndReference) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    MessyGrads g(dtype, rng);
    const Plan plan(g.list);
    for (double p : {2.0, grad::kInfNorm, 1.0, 3.5, 0.5}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " p=" + std::to_string(p));
      Scalar fused, ref, flag, ref_flag;
      grad::norm(plan, fused.t(), p, flag.p());
      grad::reference::norm(g.list, ref.t(), p, ref_flag.p());
      const double oracle = oracle_norm(g.list, p);
      EXPECT_LE(rel_diff(fused.get(), oracle), kNormTol);
      EXPECT_LE(rel_diff(ref.get(), oracle), kNormTol);
      if (std::isinf(p)) {
        EXPECT_EQ(fused.get(), ref.get());  // max is exact
      }
      EXPECT_EQ(flag.get(), 0.0);
      EXPECT_EQ(ref_flag.get(), 0.0);
    }
  }
}

TEST(GradOps, AccumulationCannotOverflowInFp32Squares) {
  Buffer buf(DType::kFloat32, {1000});
  for (int i = 0; i < 1000; ++i) buf.data_as<float>()[i] = 3e30f;  // squares 9e60 > fp32 max
  const Plan plan(std::vector<Tensor>{buf.view()});
  Scalar n, flag;
  grad::norm(plan, n.t(), 2.0, flag.p());
  EXPECT_LE(rel_diff(n.get(), 3e30 * std::sqrt(1000.0)), kNormTol);
  EXPECT_EQ(flag.get(), 0.0);
}

TEST(GradOps, NonFiniteAtFirstLastAndMiddleElement) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    MessyGrads g(dtype, rng, false, 8);
    std::vector<Tensor> nonempty;
    for (const Tensor& v : g.list)
      if (!v.empty()) nonempty.push_back(v);
    const Plan plan(g.list);
    for (int where = 0; where < 3; ++where) {
      // first element of the first listed tensor, last of the last, middle of a middle one
      const Tensor& t = where == 0 ? nonempty.front() : where == 1 ? nonempty.back() : nonempty[nonempty.size() / 2];
      const auto offs = offsets_of(t);
      const int64_t off = where == 0 ? offs.front() : where == 1 ? offs.back() : offs[offs.size() / 2];
      const double original = load_as_double(t.data, t.dtype, off);
      for (double bad : {kNaN, kInf, -kInf}) {
        SCOPED_TRACE(std::string(dtype_name(dtype)) + " where=" + std::to_string(where) + " bad=" + std::to_string(bad));
        store_from_double(t.data, t.dtype, off, bad);
        for (double p : {2.0, grad::kInfNorm, 3.0}) {
          Scalar fused, ref, flag, ref_flag;
          grad::norm(plan, fused.t(), p, flag.p());
          grad::reference::norm(g.list, ref.t(), p, ref_flag.p());
          EXPECT_EQ(flag.get(), 1.0);
          EXPECT_EQ(ref_flag.get(), 1.0);
          if (std::isnan(bad)) {
            EXPECT_TRUE(std::isnan(fused.get())) << p;  // never dropped, also not by the max
            EXPECT_TRUE(std::isnan(ref.get())) << p;
          } else {
            EXPECT_EQ(fused.get(), kInf) << p;
            EXPECT_EQ(ref.get(), kInf) << p;
          }
        }
      }
      store_from_double(t.data, t.dtype, off, original);
      Scalar clean_flag, n;
      grad::norm(plan, n.t(), 2.0, clean_flag.p());
      EXPECT_EQ(clean_flag.get(), 0.0);
    }
  }
  // NaN and inf together: the inf-norm is NaN.
  Buffer buf(DType::kFloat32, {300});
  buf.data_as<float>()[0] = INFINITY;
  buf.data_as<float>()[299] = NAN;
  Scalar n;
  grad::norm(Plan(std::vector<Tensor>{buf.view()}), n.t(), grad::kInfNorm);
  EXPECT_TRUE(std::isnan(n.get()));
}

// Expected values after scaling every listed view in place (per-tensor loop):
// each element is scaled once per listed view covering it.
std::map<uintptr_t, int> coverage(const std::vector<Tensor>& list) {
  std::map<uintptr_t, int> cover;
  for (const Tensor& t : list)
    for (int64_t off : offsets_of(t)) ++cover[reinterpret_cast<uintptr_t>(t.data) + off * t.element_size()];
  return cover;
}

void expect_scaled_like_loop(const std::vector<Tensor>& list, const std::map<uintptr_t, double>& before, float s,
                             bool skip_unit = false) {
  const auto cover = coverage(list);
  const DType dtype = list.front().dtype;
  int checked = 0;
  for (const auto& [address, count] : cover) {
    double v = before.at(address);
    for (int k = 0; k < count && !(skip_unit && s == 1.0f); ++k) {
      const float prod = static_cast<float>(v) * s;  // fp32 multiply, one rounding to the dtype
      uint64_t tmp = 0;
      store_from_double(&tmp, dtype, 0, prod);
      v = load_as_double(&tmp, dtype, 0);
    }
    const double got = load_as_double(reinterpret_cast<void*>(address), dtype, 0);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_EQ(got, v) << "covered " << count << " times";
    }
    if (++checked > 5000) break;  // enough, keeps the test fast
  }
}

std::map<uintptr_t, double> values_by_address(const std::vector<Tensor>& list) {
  std::map<uintptr_t, double> out;
  for (const Tensor& t : list)
    for (int64_t off : offsets_of(t))
      out[reinterpret_cast<uintptr_t>(t.data) + off * t.element_size()] = load_as_double(t.data, t.dtype, off);
  return out;
}

TEST(GradOps, UnscaleNormEqualsThePerTensorLoop) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    for (bool alias : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (alias ? " strided alias" : ""));
      MessyGrads g(dtype, rng, alias);
      const Plan plan(g.list);
      EXPECT_EQ(plan.generic_aliases(), alias);
      const auto before = g.save();
      const auto side_before = g.save_side();
      const auto values = values_by_address(g.list);
      const float inv_scale = 1.0f / 1000.0f;
      Scalar fused, flag;
      grad::unscale_norm(plan, inv_scale, fused.t(), flag.t());
      expect_scaled_like_loop(g.list, values, inv_scale);
      const double fused_norm = fused.get();
      EXPECT_LE(rel_diff(fused_norm, oracle_norm(g.list, 2.0)), kNormTol);
      const auto after = g.save();
      const auto side_after = g.save_side();

      g.load(before);
      g.load_side(side_before);
      Scalar ref, ref_flag, inv(DType::kFloat32, inv_scale);
      grad::reference::unscale_norm(g.list, inv.t(), ref.t(), ref_flag.t());
      EXPECT_TRUE(after == g.save()) << "fused and per-tensor results differ";
      EXPECT_TRUE(side_after == g.save_side());
      EXPECT_LE(rel_diff(fused_norm, ref.get()), 2 * kNormTol);
      EXPECT_EQ(flag.get(), 0.0);
      EXPECT_EQ(ref_flag.get(), 0.0);
    }
  }
}

TEST(GradOps, UnscaleFlagsNonFiniteInputsAndSkipsUnitScale) {
  std::mt19937_64 rng(test_seed());
  MessyGrads g(DType::kFloat16, rng);
  const Plan plan(g.list);
  const auto before = g.save();
  Scalar n, flag;
  grad::unscale_norm(plan, 1.0f, n.t(), flag.t());
  EXPECT_TRUE(before == g.save());  // inv_scale == 1: untouched
  EXPECT_EQ(flag.get(), 0.0);
  store_from_double(g.list[2].data, g.list[2].dtype, 0, kInf);
  grad::unscale_norm(plan, 0.5f, n.t(), flag.t());
  EXPECT_EQ(flag.get(), 1.0);
  EXPECT_TRUE(std::isinf(n.get()));
}

TEST(GradOps, ClipEqualsThePerTensorLoop) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    for (bool alias : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (alias ? " strided alias" : ""));
      MessyGrads g(dtype, rng, alias);
      const Plan plan(g.list);
      const auto before = g.save();
      const auto side_before = g.save_side();
      const auto values = values_by_address(g.list);
      Scalar total, coeff;
      grad::norm(plan, total.t());
      const double max_norm = total.get() / 3.0;
      grad::clip(plan, total.t(), max_norm, coeff.p());
      const float expected_coeff = static_cast<float>(max_norm) / (static_cast<float>(total.get()) + 1e-6f);
      EXPECT_EQ(coeff.get(), expected_coeff);
      expect_scaled_like_loop(g.list, values, expected_coeff);
      const auto after = g.save();
      const auto side_after = g.save_side();
      g.load(before);
      g.load_side(side_before);
      Scalar ref_total, ref_coeff;
      grad::reference::norm_clip(g.list, max_norm, ref_total.t(), 2.0, nullptr, ref_coeff.p());
      EXPECT_EQ(ref_total.get(), total.get());
      EXPECT_EQ(ref_coeff.get(), coeff.get());
      EXPECT_TRUE(after == g.save());
      EXPECT_TRUE(side_after == g.save_side());
    }
  }
}

TEST(GradOps, ClipByOneIsBitIdenticalAndNanNormPropagates) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    MessyGrads g(dtype, rng);
    const Plan plan(g.list);
    const auto before = g.save();
    Scalar total, coeff, flag;
    grad::norm_clip(plan, 1e30, total.t(), 2.0, flag.p(), coeff.p());
    EXPECT_EQ(coeff.get(), 1.0);
    EXPECT_TRUE(before == g.save());
    Scalar nan_norm(DType::kFloat32, kNaN);
    grad::clip(plan, nan_norm.t(), 1.0, coeff.p());
    EXPECT_TRUE(std::isnan(coeff.get()));
    EXPECT_TRUE(std::isnan(load_as_double(g.list[0].data, dtype, 0)));
  }
}

// Megatron's float path in double: the norm is pow(double(total), 1/p) (Python's
// float ** is the C library's pow) and the coefficient max_norm / (norm + 1e-6) in
// double, rounded once to fp32 where below 1, else 1 (NaN included). Compared
// bitwise with those expressions on fresh random values over many binades and the
// edges; a quotient just below 1 that rounds to 1.0f gives 1 (scaling by it is the
// identity either way).
TEST(GradOps, FloatPathNormAndClipCoefficientAreTheDoubleArithmetic) {
  std::mt19937_64 rng(test_seed());
  std::uniform_real_distribution<double> exponent10(-40.0, 38.0), unit(0.0, 1.0);
  std::vector<float> totals = {0.0f, 1e-45f, std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::quiet_NaN()};
  for (int i = 0; i < 300; ++i) totals.push_back(static_cast<float>(std::pow(10.0, exponent10(rng))));
  for (double p : {2.0, 1.0, 3.0, 0.5, 1.7}) {
    for (float total : totals) {
      Scalar t(DType::kFloat32, total), out(DType::kFloat64);
      grad::float_path_norm(t.t(), 1.0 / p, out.t());
      const double expected = std::pow(static_cast<double>(total), 1.0 / p);
      if (std::isnan(expected)) EXPECT_TRUE(std::isnan(out.get()));
      else EXPECT_EQ(out.get(), expected) << "p " << p << " total " << total;
    }
  }
  std::vector<double> norms = {0.0, 1e-300, kInf, kNaN, 14.820119090219713, 0.999999};
  for (int i = 0; i < 300; ++i) norms.push_back(std::pow(10.0, 16.0 * unit(rng) - 8.0));
  for (double max_norm : {0.0, 0.559911975193751, 1.0, 5.0 * unit(rng), 1e30}) {
    for (double norm : norms) {
      const double quotient = max_norm / (norm + 1.0e-6);
      const float expected = quotient < 1.0 ? static_cast<float>(quotient) : 1.0f;
      EXPECT_EQ(grad::float_path_clip_coefficient(norm, max_norm), expected) << max_norm << " " << norm;
      Scalar n(DType::kFloat64, norm), coeff;
      EXPECT_EQ(grad::float_path_clip_coefficient(n.t(), max_norm, coeff.t()), expected < 1.0f);
      EXPECT_EQ(coeff.get(), static_cast<double>(expected));
    }
  }
  Scalar f32, f64(DType::kFloat64);
  Buffer two(DType::kFloat64, {2});
  EXPECT_LEANSTEP_ERROR(grad::float_path_norm(f64.t(), 0.5, f64.t()), "'total'");
  EXPECT_LEANSTEP_ERROR(grad::float_path_norm(f32.t(), 0.5, f32.t()), "'out_norm'");
  EXPECT_LEANSTEP_ERROR(grad::float_path_norm(f32.t(), 0.0, f64.t()), "'exponent' must be finite and > 0");
  EXPECT_LEANSTEP_ERROR(grad::float_path_norm(f32.t(), kInf, f64.t()), "'exponent'");
  EXPECT_LEANSTEP_ERROR(grad::float_path_clip_coefficient(f64.t(), kNaN, f32.t()), "'max_norm'");
  EXPECT_LEANSTEP_ERROR(grad::float_path_clip_coefficient(f32.t(), 1.0, f32.t()), "'total_norm'");
  EXPECT_LEANSTEP_ERROR(grad::float_path_clip_coefficient(two.view(), 1.0, f32.t()), "'total_norm'");
  EXPECT_LEANSTEP_ERROR(grad::float_path_clip_coefficient(f64.t(), 1.0, f64.t()), "'out_coeff'");
}

TEST(GradOps, TorchClipCoefficientIsTorchsReciprocalThenMultiply) {
  // torch's clamp(max_norm / (norm + 1e-6), max=1): the add, the fp32 reciprocal, the
  // multiply by fp32(max_norm) (torch's Tensor.__rtruediv__), each rounded; the bits
  // against torch's own ops are tested in tests/python/test_torch_clip.py. Here: the
  // special values, the clamp, and that the rule is not one division (two roundings).
  constexpr float kInfF = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(grad::torch_clip_coefficient(std::numeric_limits<float>::quiet_NaN(), 1.0)));
  EXPECT_EQ(grad::torch_clip_coefficient(kInfF, 1.0), 0.0f);
  EXPECT_EQ(grad::torch_clip_coefficient(0.0f, 1.0), 1.0f);  // 1e6 clamped
  EXPECT_EQ(grad::torch_clip_coefficient(0.5f, 0.0), 0.0f);
  std::mt19937_64 rng(20261206);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  int differs_from_division = 0;
  for (int i = 0; i < 20000; ++i) {
    const float norm = static_cast<float>(std::pow(10.0, 4.0 * unit(rng) - 1.0));
    const double max_norm = 4.0 * unit(rng);
    const float shifted = norm + 1.0e-6f;
    const float expected = std::min((1.0f / shifted) * static_cast<float>(max_norm), 1.0f);
    const float got = grad::torch_clip_coefficient(norm, max_norm);
    ASSERT_EQ(got, expected) << norm << " " << max_norm;
    if (got < 1.0f && got != static_cast<float>(max_norm) / shifted) ++differs_from_division;
  }
  EXPECT_GT(differs_from_division, 0);
  Scalar n(DType::kFloat32, 3.0f), coeff, f64(DType::kFloat64);
  grad::torch_clip_coefficient(n.t(), 1.5, coeff.t());
  EXPECT_EQ(coeff.get(), static_cast<double>(grad::torch_clip_coefficient(3.0f, 1.5)));
  EXPECT_LEANSTEP_ERROR(grad::torch_clip_coefficient(n.t(), -1.0, coeff.t()), "'max_norm'");
  EXPECT_LEANSTEP_ERROR(grad::torch_clip_coefficient(n.t(), 1e39, coeff.t()), "'max_norm' must be at most the largest fp32");
  EXPECT_LEANSTEP_ERROR(grad::torch_clip_coefficient(f64.t(), 1.0, coeff.t()), "'total_norm'");
  EXPECT_LEANSTEP_ERROR(grad::torch_clip_coefficient(n.t(), 1.0, f64.t()), "'out_coeff'");
}

TEST(GradOps, CountZerosCountsEachListing) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    MessyGrads g(dtype, rng, true);
    std::uniform_int_distribution<int64_t> pos(0, g.storage.numel() - 1);
    for (int i = 0; i < 500; ++i) store_from_double(g.storage.data(), dtype, pos(rng), i % 2 ? 0.0 : -0.0);
    int64_t expected = 0;
    for (const Tensor& t : g.list)
      for (double v : values_of(t)) expected += v == 0.0;
    Scalar count(DType::kInt64), ref(DType::kInt64);
    grad::count_zeros(Plan(g.list), count.t());
    grad::reference::count_zeros(g.list, ref.t());
    EXPECT_EQ(count.get(), static_cast<double>(expected));
    EXPECT_EQ(ref.get(), static_cast<double>(expected));
  }
}

TEST(GradOps, EmptyPlansJustWork) {
  const Plan empty(std::vector<Tensor>{});
  Buffer zero_size(DType::kFloat32, {0, 5});
  const Plan only_empty(std::vector<Tensor>{zero_size.view(), zero_size.view()});
  for (const Plan* plan : {&empty, &only_empty}) {
    Scalar n(DType::kFloat32, 123), flag, coeff, count(DType::kInt64, 9);
    grad::norm(*plan, n.t(), 2.0, flag.p());
    EXPECT_EQ(n.get(), 0.0);
    EXPECT_EQ(flag.get(), 0.0);
    grad::unscale_norm(*plan, 0.5f, n.t(), flag.t(), grad::kInfNorm);
    EXPECT_EQ(n.get(), 0.0);
    grad::clip(*plan, n.t(), 1.0, coeff.p());
    EXPECT_EQ(coeff.get(), 1.0);
    grad::count_zeros(*plan, count.t());
    EXPECT_EQ(count.get(), 0.0);
  }
  Scalar flag;
  grad::multi_tensor_scale(std::vector<Tensor>{}, std::vector<Tensor>{}, 2.0f, flag.t());
  EXPECT_EQ(flag.get(), 0.0);
}

TEST(GradOps, DeterministicForAnyThreadCount) {
  std::mt19937_64 rng(test_seed());
  const int saved = num_threads();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    MessyGrads g(dtype, rng, false, 60);
    const Plan plan(g.list);
    const auto before = g.save();
    const auto side_before = g.save_side();
    std::vector<float> norms;
    std::vector<std::vector<char>> results;
    for (int threads = 1; threads <= 4; ++threads) {
      set_num_threads(threads);
      g.load(before);
      g.load_side(side_before);
      Scalar n, n_inf, flag;
      grad::norm(plan, n.t());
      grad::unscale_norm(plan, 0.37f, n_inf.t(), flag.t(), 3.0);
      norms.push_back(static_cast<float>(n.get()));
      norms.push_back(static_cast<float>(n_inf.get()));
      results.push_back(g.save());
    }
    for (int k = 1; k < 4; ++k) {
      EXPECT_EQ(std::memcmp(&norms[0], &norms[2 * k], 2 * sizeof(float)), 0) << "threads " << k + 1;
      EXPECT_TRUE(results[0] == results[static_cast<size_t>(k)]);
    }
  }
  set_num_threads(saved);
}

TEST(GradOps, NormAndClipOn3000TensorsMakeFewDispatchesAndNoHostReads) {
  layout::LayoutOptions o;
  o.distributed_optimizer = true;
  const auto buffers = layout::build_ddp_buffers(fixtures::qwen3_omni_lora_rank_params(/*lora_rank=*/1), o);
  std::vector<Buffer> storage;
  std::vector<Tensor> views;
  std::mt19937_64 rng(test_seed());
  for (const auto& b : buffers) {
    storage.emplace_back(DType::kFloat32, std::vector<int64_t>{b.numel});
    fill_uniform(storage.back().view(), rng, -1, 1);
    for (const Tensor& v : b.views(storage.back().data())) views.push_back(v);
  }
  ASSERT_GE(views.size(), 3000u);
  const Plan plan(views);
  Scalar total, flag, coeff;
  reset_counters();
  grad::norm_clip(plan, 1.0, total.t(), 2.0, flag.p(), coeff.p());
  const Counters fused = counters();
  EXPECT_EQ(fused.host_reads, 0u);
  EXPECT_LE(fused.dispatches, 2 * plan.num_regions() + 2);  // one pass for the norm, one for the clip
  EXPECT_LE(plan.num_regions(), 4u);

  reset_counters();
  Scalar ref_total;
  grad::reference::norm_clip(views, 1.0, ref_total.t());
  const Counters ref = counters();
  EXPECT_GE(ref.dispatches, 2 * views.size());  // the per-tensor path: a dispatch per tensor and op
  EXPECT_GE(ref.host_reads, views.size());
}

TEST(GradOps, MultiTensorScaleMixedDtypesNeverOverflowsANarrowDestination) {
  std::mt19937_64 rng(test_seed());
  Buffer in32(DType::kFloat32, {1001}), out16(DType::kFloat16, {1001});
  Buffer in16(DType::kFloat16, {777}), out32(DType::kFloat32, {777});
  Buffer inout_bf(DType::kBFloat16, {555});
  Buffer in32b(DType::kFloat32, {60}), out_bf_strided(DType::kBFloat16, {120});
  Buffer in64(DType::kFloat64, {33}), out64(DType::kFloat64, {33});
  fill_normal(in32.view(), rng, 0, 1e5);  // 1e5 does not fit fp16; 1e5 * 0.01 does
  in32.data_as<float>()[0] = 1e5f;
  fill_normal(in16.view(), rng);
  fill_normal(inout_bf.view(), rng);
  fill_normal(in32b.view(), rng);
  fill_normal(in64.view(), rng);
  const Tensor strided_out = strided_view(out_bf_strided.data(), DType::kBFloat16, 6, 10, 20, 2);
  const Tensor empty(in32.data(), DType::kFloat32, {0});
  const std::vector<Tensor> in = {in32.view(), in16.view(), inout_bf.view(), in32b.view().reshaped({6, 10}),
                                  empty, in64.view()};
  const std::vector<Tensor> out = {out16.view(), out32.view(), inout_bf.view(), strided_out, empty, out64.view()};
  std::vector<std::vector<double>> inputs;
  for (const Tensor& t : in) inputs.push_back(values_of(t));
  Scalar flag;
  const float s = 0.01f;
  grad::multi_tensor_scale(in, out, s, flag.t());
  EXPECT_EQ(flag.get(), 0.0);
  EXPECT_EQ(half_to_float(out16.data_as<uint16_t>()[0]), half_to_float(float_to_half(1e5f * 0.01f)));
  for (size_t i = 0; i < in.size(); ++i) {
    const auto got = values_of(out[i]);
    for (size_t e = 0; e < got.size(); ++e) {
      Buffer tmp(out[i].dtype, {1});
      store_from_double(tmp.data(), out[i].dtype, 0, static_cast<float>(inputs[i][e]) * s);
      ASSERT_EQ(got[e], load_as_double(tmp.data(), out[i].dtype, 0)) << "pair " << i << " element " << e;
      ASSERT_TRUE(std::isfinite(got[e]));
    }
  }
  in32.data_as<float>()[500] = NAN;
  grad::multi_tensor_scale(std::vector<Tensor>{in32.view()}, std::vector<Tensor>{out16.view()}, s, flag.t());
  EXPECT_EQ(flag.get(), 1.0);
}

TEST(GradOps, MultiTensorScaleReadsAllThenWritesOnPartialOverlap) {
  std::mt19937_64 rng(test_seed());
  for (int64_t shift : {int64_t{3}, int64_t{-5}, int64_t{40000}}) {
    Buffer buf(DType::kFloat32, {200000});
    fill_normal(buf.view(), rng);
    const int64_t n = 100000;
    const Tensor in = sub_view(buf.view(), 50000, {n});
    const Tensor out = sub_view(buf.view(), 50000 + shift, {n});
    const auto original = values_of(in);
    Scalar flag;
    grad::multi_tensor_scale(std::vector<Tensor>{in}, std::vector<Tensor>{out}, 2.5f, flag.t());
    const auto got = values_of(out);
    for (int64_t e = 0; e < n; ++e)
      ASSERT_EQ(got[static_cast<size_t>(e)], static_cast<float>(original[static_cast<size_t>(e)]) * 2.5f) << shift;
  }
  // bf16 output aliasing the first half of an fp32 input
  Buffer mixed(DType::kFloat32, {64});
  fill_normal(mixed.view(), rng);
  const auto original = values_of(mixed.view());
  const Tensor out_bf(mixed.data(), DType::kBFloat16, {64});
  Scalar flag;
  grad::multi_tensor_scale(std::vector<Tensor>{mixed.view()}, std::vector<Tensor>{out_bf}, 0.5f, flag.t());
  const auto got = values_of(out_bf);
  for (size_t e = 0; e < 64; ++e) EXPECT_EQ(got[e], bf16_to_float(float_to_bf16(static_cast<float>(original[e]) * 0.5f)));
}

TEST(GradOps, MultiTensorScalePairsSharingMemoryRunInListOrder) {
  std::mt19937_64 rng(test_seed());
  Buffer a(DType::kFloat32, {3000}), b(DType::kFloat16, {3000});
  fill_normal(a.view(), rng);
  // pair 0 writes b, pair 1 reads b (must see pair 0's result) and writes a's tail
  const std::vector<Tensor> in = {a.view(), b.view(), sub_view(a.view(), 0, {1000})};
  const std::vector<Tensor> out = {b.view(), sub_view(a.view(), 0, {3000}), sub_view(a.view(), 2000, {1000})};
  const auto before_a = snapshot(a.view());
  Scalar flag, ref_flag;
  grad::multi_tensor_scale(in, out, 3.0f, flag.t());
  const auto fused_a = snapshot(a.view()), fused_b = snapshot(b.view());
  restore(a.view(), before_a);
  std::memset(b.data(), 0, b.nbytes());
  grad::reference::multi_tensor_scale(in, out, 3.0f, ref_flag.t());
  EXPECT_TRUE(fused_a == snapshot(a.view()));
  EXPECT_TRUE(fused_b == snapshot(b.view()));
}

TEST(GradOps, BadInputIsAnError) {
  Buffer buf(DType::kFloat32, {10});
  const Plan plan(std::vector<Tensor>{buf.view()});
  Scalar n, flag, i64(DType::kInt64);
  Buffer two(DType::kFloat32, {2});
  EXPECT_LEANSTEP_ERROR(grad::norm(plan, n.t(), 0.0), "norm_type");
  EXPECT_LEANSTEP_ERROR(grad::norm(plan, n.t(), -2.0), "must be > 0");
  EXPECT_LEANSTEP_ERROR(grad::norm(plan, n.t(), kNaN), "norm_type");
  EXPECT_LEANSTEP_ERROR(grad::norm(plan, two.view()), "out_norm");
  EXPECT_LEANSTEP_ERROR(grad::norm(plan, i64.t()), "out_norm");
  EXPECT_LEANSTEP_ERROR(grad::clip(plan, n.t(), -1.0), "clip: argument 'max_norm' must be finite and >= 0 (got -1)");
  EXPECT_LEANSTEP_ERROR(grad::clip(plan, n.t(), kNaN), "max_norm");
  EXPECT_LEANSTEP_ERROR(grad::norm_clip(plan, kInf, n.t()), "max_norm");
  EXPECT_LEANSTEP_ERROR(grad::unscale_norm(plan, two.view(), n.t(), flag.t()), "inv_scale");
  EXPECT_LEANSTEP_ERROR(grad::count_zeros(plan, n.t()), "out_count");
  const std::vector<Tensor> one = {buf.view()}, none = {};
  EXPECT_LEANSTEP_ERROR(grad::multi_tensor_scale(one, none, 1.0f, flag.t()), "'out' must have as many tensors");
  Buffer small(DType::kFloat32, {9});
  EXPECT_LEANSTEP_ERROR(grad::multi_tensor_scale(one, std::vector<Tensor>{small.view()}, 1.0f, flag.t()), "out[0]");
  Buffer ints(DType::kInt32, {10});
  EXPECT_LEANSTEP_ERROR(grad::multi_tensor_scale(one, std::vector<Tensor>{ints.view()}, 1.0f, flag.t()), "out[0]");
  Tensor null_in(nullptr, DType::kFloat32, {10});
  EXPECT_LEANSTEP_ERROR(grad::multi_tensor_scale(std::vector<Tensor>{null_in}, one, 1.0f, flag.t()), "in[0]");
}

}  // namespace
}  // namespace leanstep
