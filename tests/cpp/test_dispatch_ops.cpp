// The built-in ops behind leanstep/ops.h: every entry point runs exactly the
// implementation the preset and the guards select. Each dispatched result is
// compared BITWISE with a direct call of the implementation that should have
// run (so no tolerance is involved: routing is either right or wrong), and the
// counters must name it. Numerical agreement of the fast paths with the
// references and with float64 oracles is tested by each area's own tests
// (test_grad*, test_rmsnorm*, test_moe*); here one float64 check per area guards
// against a slot wired to the wrong function.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <string>

#include "leanstep/grad.h"
#include "leanstep/buffer.h"
#include "leanstep/ops.h"
#include "moe_util.h"
#include "test_util.h"

namespace ld = leanstep::dispatch;
using namespace leanstep;
using leanstep::testing::bitwise_equal;
using leanstep::testing::fill_normal;
using leanstep::testing::float_dtypes;
using leanstep::testing::test_seed;
using leanstep::testing::to_doubles;

namespace {

class DispatchOps : public ::testing::Test {
 protected:
  void SetUp() override {
    ld::registry().set_preset("all");
    ld::registry().reset_stats();
  }
  void TearDown() override { ld::registry().set_preset("all"); }

  static uint64_t calls(const std::string& op, const std::string& impl) {
    for (const auto& s : ld::registry().op(op).report().stats)
      if (s.name == impl) return s.calls;
    return 0;
  }
  static uint64_t reason_count(const std::string& op, const std::string& impl, const std::string& reason) {
    for (const auto& s : ld::registry().op(op).report().stats)
      if (s.name == impl) {
        auto it = s.reasons.find(reason);
        return it == s.reasons.end() ? 0 : it->second;
      }
    return 0;
  }
};

Buffer copy_of(const Tensor& t) {
  Buffer b(t.dtype, std::vector<int64_t>(t.shape, t.shape + t.ndim));
  if (t.nbytes()) std::memcpy(b.data(), t.data, t.nbytes());
  return b;
}

bool same_bits(const Buffer& a, const Buffer& b) { return bitwise_equal(a.view(), b.view()); }

}  // namespace

TEST_F(DispatchOps, EveryBuiltinOpIsRegisteredWithItsImplementations) {
  std::vector<std::string> names;
  for (ld::OpBase* op : ld::registry().ops()) names.push_back(op->name());
  std::vector<std::string> expected;  // the table's names (the registry lists them sorted)
  for (const ops::OpEntry& entry : ops::op_table()) expected.push_back(entry.name);
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(expected.size(), ops::kNumOps);
  EXPECT_EQ(names, expected);
  // The ops with one implementation (nothing to fuse): their reference alone.
  const std::set<std::string> reference_only = {"moe.permute_probs_backward", "moe.pad_routing_map",
                                                "moe.sort_chunks_by_idxs", "moe.route"};
  for (ld::OpBase* op : ld::registry().ops()) {
    if (op->name() == "rmsnorm.backward") {
      EXPECT_EQ(op->installed(), (std::vector<std::string>{"frozen_fused", "fused"}));
    } else if (reference_only.count(op->name())) {
      EXPECT_TRUE(op->installed().empty()) << op->name();
      EXPECT_EQ(op->reference_name(), "reference");
      continue;
    } else {
      EXPECT_EQ(op->installed(), std::vector<std::string>{"fused"}) << op->name();
    }
    EXPECT_EQ(op->reference_name(), op->name().rfind("moe.", 0) == 0 ? "sort" : "reference");
  }
  EXPECT_EQ(ops::rmsnorm_forward_op().signature(),
            "void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const rmsnorm::Options&, "
            "const rmsnorm::CallContext&, const dispatch::Context&)");
  EXPECT_EQ(ops::moe_permute_op().signature(),
            "void(const Tensor&, const Tensor&, const Tensor*, OptionalInt64, bool, const Tensor&, "
            "const Tensor*, const Tensor&, const dispatch::Context&)");
  EXPECT_EQ(ops::grad_multi_tensor_scale_op().signature(),
            "void(TensorList, TensorList, const Tensor&, const Tensor&, const dispatch::Context&)");
  const std::string text = ld::paths_text();
  for (const auto& n : expected) EXPECT_NE(text.find(n), std::string::npos) << n;
}

// ---------------------------------------------------------------- rmsnorm

TEST_F(DispatchOps, RmsnormRoutesByContextAndPreset) {
  std::mt19937_64 rng(test_seed());
  for (DType dtype : float_dtypes()) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t rows = 5, h = 37;  // odd hidden size: SIMD tails
    Buffer x(dtype, {rows, h}), gamma(dtype, {h}), dy(dtype, {rows, h});
    fill_normal(x, rng);
    fill_normal(gamma, rng, 1.0, 0.1);
    fill_normal(dy, rng);
    rmsnorm::Options opt;
    opt.eps = 1e-5;
    auto fresh = [&] { return std::pair{Buffer(dtype, {rows, h}), Buffer(DType::kFloat32, {rows})}; };
    ld::registry().reset_stats();

    // Forward, trainable weight, no feature: fused.
    auto [y, rstd] = fresh();
    auto [y_direct, rstd_direct] = fresh();
    // The fused kernels run parallel regions (counted), the single-threaded
    // reference none: evidence of which one ran beyond equal results.
    uint64_t before = counters().dispatches;
    ops::rmsnorm_forward(x, gamma, y, rstd, opt, {});
    EXPECT_GT(counters().dispatches, before);
    rmsnorm::forward_fused(x, gamma, y_direct, rstd_direct, opt);
    EXPECT_TRUE(same_bits(y, y_direct) && same_bits(rstd, rstd_direct));
    EXPECT_EQ(calls("rmsnorm.forward", "fused"), 1u);

    // The float64 oracle, once: y = x / sqrt(mean x^2 + eps) * gamma, within a few
    // roundings of the output dtype (fp32 statistics, one rounding of y).
    {
      const auto xv = to_doubles(x), gv = to_doubles(gamma), yv = to_doubles(y);
      const double u = leanstep::testing::unit_roundoff(dtype);
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < h; ++i) ss += xv[r * h + i] * xv[r * h + i];
        const double inv = 1.0 / std::sqrt(ss / h + opt.eps);
        for (int64_t i = 0; i < h; ++i) {
          const double want = xv[r * h + i] * inv * gv[i];
          EXPECT_NEAR(yv[r * h + i], want, 4 * u * std::abs(want) + 1e-6) << r << "," << i;
        }
      }
    }

    // Forward under "baseline": the reference kernel, with the preset as reason.
    ld::registry().set_preset("baseline");
    auto [y2, rstd2] = fresh();
    auto [y2_direct, rstd2_direct] = fresh();
    before = counters().dispatches;
    ops::rmsnorm_forward(x, gamma, y2, rstd2, opt, {});
    EXPECT_EQ(counters().dispatches, before);
    rmsnorm::forward_reference(x, gamma, y2_direct, rstd2_direct, opt);
    EXPECT_TRUE(same_bits(y2, y2_direct) && same_bits(rstd2, rstd2_direct));
    EXPECT_EQ(reason_count("rmsnorm.forward", "reference", "preset 'baseline' disables this op's fast paths"), 1u);
    ld::registry().set_preset("all");

    // Forward with a delegated feature: the guard declines, the reference runs.
    rmsnorm::CallContext autocast;
    autocast.autocast = true;
    auto [y3, rstd3] = fresh();
    ops::rmsnorm_forward(x, gamma, y3, rstd3, opt, autocast);
    EXPECT_TRUE(same_bits(y3, y2_direct));
    EXPECT_EQ(reason_count("rmsnorm.forward", "fused", "autocast"), 1u);

    // Backward, frozen weight: the frozen path, no dgamma.
    rmsnorm::CallContext frozen;
    frozen.weight_requires_grad = false;
    Buffer dx(dtype, {rows, h}), dx_direct(dtype, {rows, h});
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx, nullptr, opt, frozen);
    rmsnorm::backward_fused(dy, x, rstd, gamma, dx_direct, nullptr, opt);
    EXPECT_TRUE(same_bits(dx, dx_direct));
    EXPECT_EQ(calls("rmsnorm.backward", "frozen_fused"), 1u);

    // Backward, trainable: the frozen path declines, the trainable fused kernel runs.
    Buffer dx2(dtype, {rows, h}), dg(dtype, {h}), dg_direct(dtype, {h});
    const Tensor dg_view = dg.view(), dg_direct_view = dg_direct.view();
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx2, &dg_view, opt, {});
    rmsnorm::backward_fused(dy, x, rstd, gamma, dx_direct, &dg_direct_view, opt);
    EXPECT_TRUE(same_bits(dx2, dx_direct) && same_bits(dg, dg_direct));
    EXPECT_EQ(calls("rmsnorm.backward", "fused"), 1u);
    EXPECT_EQ(reason_count("rmsnorm.backward", "frozen_fused", "weight_requires_grad"), 1u);

    // Backward with hooks: both decline (each with its reason), the reference runs.
    rmsnorm::CallContext hooks;
    hooks.debug_hooks = true;
    ops::rmsnorm_backward(dy, x, rstd, gamma, dx2, &dg_view, opt, hooks);
    rmsnorm::backward_reference(dy, x, rstd, gamma, dx_direct, &dg_direct_view, opt);
    EXPECT_TRUE(same_bits(dx2, dx_direct) && same_bits(dg, dg_direct));
    EXPECT_EQ(reason_count("rmsnorm.backward", "frozen_fused", "weight_requires_grad, debug_hooks"), 1u);
    EXPECT_EQ(reason_count("rmsnorm.backward", "fused", "debug_hooks"), 1u);
    EXPECT_EQ(reason_count("rmsnorm.backward", "reference", "every installed implementation declined"), 1u);
  }
}

TEST_F(DispatchOps, RmsnormBackwardChecksDgammaAgainstTheContext) {
  Buffer x(DType::kFloat32, {2, 8}), gamma(DType::kFloat32, {8}), rstd(DType::kFloat32, {2}),
      dx(DType::kFloat32, {2, 8}), dg(DType::kFloat32, {8});
  const Tensor dg_view = dg.view();
  rmsnorm::CallContext frozen;
  frozen.weight_requires_grad = false;
  EXPECT_LEANSTEP_ERROR(ops::rmsnorm_backward(x, x, rstd, gamma, dx, &dg_view, {}, frozen),
                        "argument 'dgamma' must be null when the weight is frozen");
  EXPECT_LEANSTEP_ERROR(ops::rmsnorm_backward(x, x, rstd, gamma, dx, nullptr, {}, {}),
                        "argument 'dgamma' must be given");
  // The slot's precondition: it holds before any choice, for a forced one too.
  for (const char* impl : {"reference", "fused", "frozen_fused"}) {
    EXPECT_LEANSTEP_ERROR(ops::rmsnorm_backward_op().call_impl(impl, x, x, rstd, gamma, dx, &dg_view, {}, frozen, {}),
                          "argument 'dgamma' must be null when the weight is frozen");
  }
  // Bad views are refused by whichever implementation runs, under any preset.
  for (const char* preset : {"all", "baseline"}) {
    ld::registry().set_preset(preset);
    Buffer y(DType::kFloat32, {2, 7});
    EXPECT_THROW(ops::rmsnorm_forward(x, gamma, y, rstd), Error) << preset;
  }
}

// ---------------------------------------------------------------- moe

TEST_F(DispatchOps, MoeRoutesByPreset) {
  std::mt19937_64 rng(test_seed());
  const int64_t T = 13, E = 5, H = 7;
  for (DType dtype : float_dtypes()) {
    SCOPED_TRACE(dtype_name(dtype));
    ld::registry().reset_stats();
    Buffer tokens(dtype, {T, H}), map(DType::kBool, {T, E}), probs(DType::kFloat32, {T, E});
    fill_normal(tokens, rng);
    std::bernoulli_distribution coin(0.4);
    int64_t routed = 0;
    for (int64_t i = 0; i < T * E; ++i) {
      const bool on = coin(rng);
      map.data_as<uint8_t>()[i] = on;
      probs.data_as<float>()[i] = on ? 0.5f + 0.1f * static_cast<float>(i % 5) : 0.0f;
      routed += on;
    }
    const Tensor probs_view = probs.view();
    auto run_permute = [&](const std::string& preset, moe::Method direct) {
      ld::registry().set_preset(preset);
      Buffer out(dtype, {routed, H}), out_probs(DType::kFloat32, {routed}), idx(DType::kInt64, {routed});
      Buffer d_out(dtype, {routed, H}), d_probs(DType::kFloat32, {routed}), d_idx(DType::kInt64, {routed});
      const Tensor op_view = out_probs.view(), dp_view = d_probs.view();
      // Besides the bitwise checks (sort and fused are bit-identical by
      // contract, so outputs alone cannot tell them apart): the fused method
      // runs parallel regions (counted dispatches), the serial sort method none.
      const bool fused = direct == moe::Method::kFused;
      uint64_t before = counters().dispatches;
      ops::moe_permute(tokens, map, &probs_view, std::nullopt, false, out, &op_view, idx);
      EXPECT_EQ(counters().dispatches > before, fused) << "permute ran the wrong method";
      moe::permute(tokens, map, &probs_view, std::nullopt, false, direct, d_out, &dp_view, d_idx);
      EXPECT_TRUE(same_bits(out, d_out) && same_bits(out_probs, d_probs) && same_bits(idx, d_idx));
      // Round trip: unpermute(permute(x)) without probs gives x back times the
      // number of experts each token went to (exact in fp32 accumulation for
      // small counts, then one rounding).
      Buffer back(dtype, {T, H}), d_back(dtype, {T, H});
      before = counters().dispatches;
      ops::moe_unpermute(out, idx, back);
      EXPECT_EQ(counters().dispatches > before, fused) << "unpermute ran the wrong method";
      moe::unpermute(out, idx, d_back, nullptr, nullptr, false, direct);
      EXPECT_TRUE(same_bits(back, d_back));
      const auto tv = to_doubles(tokens), bv = to_doubles(back);
      for (int64_t t = 0; t < T; ++t) {
        int64_t k = 0;
        for (int64_t e = 0; e < E; ++e) k += map.data_as<uint8_t>()[t * E + e];
        for (int64_t i = 0; i < H; ++i)
          EXPECT_NEAR(bv[t * H + i], tv[t * H + i] * k,
                      2 * leanstep::testing::unit_roundoff(dtype) * std::abs(tv[t * H + i] * k));
      }
      Buffer dtok(dtype, {T, H}), d_dtok(dtype, {T, H});
      ops::moe_permute_backward(out, idx, dtok);
      moe::permute_backward(out, idx, d_dtok, direct);
      EXPECT_TRUE(same_bits(dtok, d_dtok));
      Buffer dperm(dtype, {routed, H}), d_dperm(dtype, {routed, H});
      Buffer dprobs(DType::kFloat32, {routed}), d_dprobs(DType::kFloat32, {routed});
      const Tensor dprobs_view = dprobs.view(), d_dprobs_view = d_dprobs.view();
      ops::moe_unpermute_backward(back, out, idx, &op_view, nullptr, false, dperm, &dprobs_view);
      moe::unpermute_backward(back, out, idx, &op_view, nullptr, false, direct, d_dperm, &d_dprobs_view);
      EXPECT_TRUE(same_bits(dperm, d_dperm) && same_bits(dprobs, d_dprobs));
    };
    run_permute("all", moe::Method::kFused);
    run_permute("baseline", moe::Method::kSort);
    // Only permute/unpermute fast: the "direct" method checks those two calls.
    run_permute("moe.permute,moe.unpermute", moe::Method::kFused);
    for (const char* op : {"moe.permute", "moe.unpermute", "moe.permute_backward", "moe.unpermute_backward"}) {
      const bool in_subset = std::string(op) == "moe.permute" || std::string(op) == "moe.unpermute";
      EXPECT_EQ(calls(op, "fused"), in_subset ? 2u : 1u) << op;
      EXPECT_EQ(calls(op, "sort"), in_subset ? 1u : 2u) << op;
    }
  }
}

// ---------------------------------------------------------------- grad

namespace {

// Five params packed back to back in one flat fp32 buffer (one region), in
// reverse registration order like a DDP buffer.
struct GradBuffer {
  Buffer storage{DType::kFloat32, {1 + 64 + 3 * 17 + 1000 + 5}};
  std::vector<Tensor> views;
  explicit GradBuffer(std::mt19937_64& rng) {
    fill_normal(storage, rng);
    float* p = storage.data_as<float>();
    for (int64_t n : {int64_t{5}, int64_t{1000}, int64_t{51}, int64_t{64}, int64_t{1}}) {
      views.push_back(Tensor(p, DType::kFloat32, {n}));
      p += n;
    }
    std::reverse(views.begin(), views.end());
  }
};

float scalar_f32(const Buffer& b) { return b.data_as<float>()[0]; }

}  // namespace

TEST_F(DispatchOps, GradRoutesByPresetAndGuard) {
  std::mt19937_64 rng(test_seed());
  for (const char* preset : {"all", "baseline"}) {
    SCOPED_TRACE(preset);
    ld::registry().set_preset(preset);
    ld::registry().reset_stats();
    const bool fast = std::string(preset) == "all";
    GradBuffer a(rng);
    Buffer copy = copy_of(a.storage.view());
    const grad::Plan plan(a.views);
    ASSERT_EQ(plan.num_regions(), 1u);

    Buffer norm(DType::kFloat32, {1}), norm_direct(DType::kFloat32, {1});
    // The per-tensor reference reads partials on the host (counted), the fused
    // path never does: evidence of which one ran beyond equal results.
    const uint64_t reads_before = counters().host_reads;
    ops::grad_norm(plan, norm);
    EXPECT_EQ(counters().host_reads == reads_before, fast);
    if (fast) grad::norm(plan, norm_direct);
    else grad::reference::norm(plan.views(), norm_direct);
    EXPECT_EQ(scalar_f32(norm), scalar_f32(norm_direct));
    // The float64 oracle: sqrt of the sum of squares, within fp32 rounding of the result.
    double ss = 0;
    for (double v : to_doubles(a.storage)) ss += v * v;
    EXPECT_NEAR(scalar_f32(norm), std::sqrt(ss), 2e-7 * std::sqrt(ss));

    Buffer zeros(DType::kInt64, {1}), zeros_direct(DType::kInt64, {1});
    a.storage.data_as<float>()[7] = 0.0f;
    ops::grad_count_zeros(plan, zeros);
    if (fast) grad::count_zeros(plan, zeros_direct);
    else grad::reference::count_zeros(plan.views(), zeros_direct);
    EXPECT_EQ(zeros.data_as<int64_t>()[0], 1);
    EXPECT_EQ(zeros_direct.data_as<int64_t>()[0], 1);

    // In-place ops: run the dispatched call on the buffer and the direct call
    // on a copy laid out the same way, then compare bitwise.
    auto in_place = [&](auto&& dispatched, auto&& direct_fast, auto&& direct_reference) {
      std::memcpy(copy.data(), a.storage.data(), a.storage.nbytes());
      std::vector<Tensor> copy_views;
      for (const Tensor& v : a.views) {
        Tensor c = v;
        c.data = copy.data_as<char>() + (static_cast<char*>(v.data) - a.storage.data_as<char>());
        copy_views.push_back(c);
      }
      const grad::Plan copy_plan(copy_views);
      dispatched(plan);
      if (fast) direct_fast(copy_plan);
      else direct_reference(copy_views);
      EXPECT_TRUE(same_bits(a.storage, copy));
    };
    Buffer coeff(DType::kFloat32, {1});
    const Tensor coeff_view = coeff.view();
    Buffer small_norm(DType::kFloat32, {1});
    small_norm.data_as<float>()[0] = 4 * scalar_f32(norm);  // clip by 0.25 * max
    in_place([&](const grad::Plan& p) { ops::grad_clip(p, small_norm, 1.0, &coeff_view); },
             [&](const grad::Plan& p) { grad::clip(p, small_norm, 1.0); },
             [&](std::span<const Tensor> v) { grad::reference::clip(v, small_norm, 1.0); });
    EXPECT_LT(scalar_f32(coeff), 1.0f);
    Buffer half(DType::kFloat32, {1});
    half.data_as<float>()[0] = 0.5f;
    in_place([&](const grad::Plan& p) { ops::grad_scale(p, half); },
             [&](const grad::Plan& p) { grad::scale(p, half); },
             [&](std::span<const Tensor> v) {
               Buffer found(DType::kFloat32, {1});
               grad::reference::multi_tensor_scale(v, v, 0.5f, found);
             });
    Buffer found(DType::kFloat32, {1}), found_direct(DType::kFloat32, {1});
    in_place([&](const grad::Plan& p) { ops::grad_unscale_norm(p, half, norm, found); },
             [&](const grad::Plan& p) { grad::unscale_norm(p, half, norm_direct, found_direct); },
             [&](std::span<const Tensor> v) { grad::reference::unscale_norm(v, half, norm_direct, found_direct); });
    EXPECT_EQ(scalar_f32(norm), scalar_f32(norm_direct));
    in_place([&](const grad::Plan& p) { ops::grad_norm_clip(p, 1.0, norm); },
             [&](const grad::Plan& p) { grad::norm_clip(p, 1.0, norm_direct); },
             [&](std::span<const Tensor> v) { grad::reference::norm_clip(v, 1.0, norm_direct); });
    EXPECT_EQ(scalar_f32(norm), scalar_f32(norm_direct));
    in_place([&](const grad::Plan&) { ops::grad_multi_tensor_scale(a.views, a.views, half, found); },
             [&](const grad::Plan& p) { grad::multi_tensor_scale(p.views(), p.views(), half, found_direct); },
             [&](std::span<const Tensor> v) { grad::reference::multi_tensor_scale(v, v, 0.5f, found_direct); });

    for (const char* op : {"grad.norm", "grad.count_zeros", "grad.clip", "grad.scale", "grad.unscale_norm",
                           "grad.norm_clip", "grad.multi_tensor_scale"}) {
      EXPECT_EQ(calls(op, "fused"), fast ? 1u : 0u) << op;
      EXPECT_EQ(calls(op, "reference"), fast ? 0u : 1u) << op;
    }
  }
}

TEST_F(DispatchOps, GradFastPathDeclinesPlansWithoutRegions) {
  std::mt19937_64 rng(test_seed());
  // Strided views (every other element): nothing coalesces.
  Buffer storage(DType::kFloat32, {2 * 301});
  fill_normal(storage, rng);
  Tensor strided(storage.data(), DType::kFloat32, {301});
  strided.strides[0] = 2;
  Tensor strided2 = strided;
  strided2.data = storage.data_as<float>() + 1;
  strided2.shape[0] = 300;
  const std::vector<Tensor> views = {strided, strided2};
  const grad::Plan plan(views);
  ASSERT_EQ(plan.num_regions(), 0u);
  ASSERT_EQ(plan.num_generic(), 2u);
  Buffer norm(DType::kFloat32, {1}), norm_direct(DType::kFloat32, {1});
  ops::grad_norm(plan, norm);
  grad::reference::norm(views, norm_direct);
  EXPECT_EQ(scalar_f32(norm), scalar_f32(norm_direct));
  EXPECT_EQ(reason_count("grad.norm", "fused", "plan has no coalesced region (every view is generic)"), 1u);
  EXPECT_EQ(calls("grad.norm", "reference"), 1u);
  // An empty plan is not "without regions": the fast path takes it.
  const grad::Plan empty(std::vector<Tensor>{});
  ops::grad_norm(empty, norm);
  EXPECT_EQ(scalar_f32(norm), 0.0f);
  EXPECT_EQ(calls("grad.norm", "fused"), 1u);
}

// ---------------------------------------------------------------- presets and backends

TEST_F(DispatchOps, SubsetPresetsSwitchBetweenSteps) {
  auto active = [] {
    std::string s;
    for (ld::OpBase* op : ld::registry().ops())
      if (!op->active().empty()) s += op->name() + " ";
    return s;
  };
  ld::registry().set_preset("rmsnorm,grad.clip");
  EXPECT_EQ(active(), "grad.clip rmsnorm.backward rmsnorm.forward ");
  ld::registry().set_preset("moe");
  EXPECT_EQ(active(), "moe.permute moe.permute_backward moe.unpermute moe.unpermute_backward ");
  ld::registry().set_preset("baseline");
  EXPECT_EQ(active(), "");
  EXPECT_LEANSTEP_ERROR(ld::registry().set_preset("rmsnorm,attention"), "'attention' names none");
  EXPECT_EQ(ld::registry().preset(), "baseline");
}

namespace {
int backend_calls = 0;
void backend_count_zeros(const grad::PlanView& plan, const Tensor& out, comm::Communicator*, const ld::Context&) {
  ++backend_calls;
  out.data_as<int64_t>()[0] = -1;  // recognisable
}
}  // namespace

TEST_F(DispatchOps, BackendDescriptorInstallsIntoABuiltinOp) {
  const std::string sig = ops::grad_count_zeros_op().signature();
  EXPECT_EQ(sig, "void(const grad::PlanView&, const Tensor&, comm::Communicator*, const dispatch::Context&)");
  const ld::ImplDescriptor desc =
      ld::make_descriptor<ops::GradCountZerosSig>("grad.count_zeros", "backend", sig, &backend_count_zeros);
  EXPECT_TRUE(ld::registry().install(desc).changed);
  EXPECT_FALSE(ld::registry().install(desc).changed);
  Buffer out(DType::kInt64, {1});
  const grad::Plan empty(std::vector<Tensor>{});
  ops::grad_count_zeros(empty, out);
  EXPECT_EQ(out.data_as<int64_t>()[0], -1);
  EXPECT_EQ(backend_calls, 1);
  // A descriptor built for another op's signature is refused, naming both.
  const std::string other = ops::grad_scale_op().signature();
  const ld::ImplDescriptor wrong = ld::make_descriptor<ops::GradScaleSig>(
      "grad.count_zeros", "backend_wrong", other, +[](const grad::PlanView&, const Tensor&, const ld::Context&) {});
  EXPECT_LEANSTEP_ERROR(ld::registry().install(wrong),
                        "it has signature 'void(const grad::PlanView&, const Tensor&, const dispatch::Context&)' but the "
                        "op requires 'void(const grad::PlanView&, const Tensor&, comm::Communicator*, const "
                        "dispatch::Context&)'");
  // Uninstall restores the built-in fused path.
  ld::registry().uninstall("grad.count_zeros", "backend");
  EXPECT_EQ(ops::grad_count_zeros_op().active(), "fused");
  ops::grad_count_zeros(empty, out);
  EXPECT_EQ(out.data_as<int64_t>()[0], 0);
  EXPECT_EQ(backend_calls, 1);
}

namespace {
int device_calls = 0;
void cuda_unpermute(const Tensor&, const Tensor&, const Tensor&, const Tensor*, const Tensor*, bool,
                    const ld::Context& ctx) {
  ++device_calls;
  EXPECT_EQ(ctx.device.type, DeviceType::kCUDA);
  EXPECT_EQ(ctx.stream, reinterpret_cast<void*>(0x1234));  // handed through untouched
}
}  // namespace

// Candidates are kept per device: a context on a device with no implementation
// is an Error naming it (the reference runs host memory only), one installed
// for that device runs there, and CPU calls never see it.
TEST_F(DispatchOps, CandidatesArePerDeviceAndAMissingOneIsAnError) {
  Buffer permuted(DType::kFloat32, {2, 3}), out(DType::kFloat32, {2, 3});
  Buffer idx = leanstep::testing::index_buffer({1, 0});
  ld::Context cuda;
  cuda.device.type = DeviceType::kCUDA;
  cuda.stream = reinterpret_cast<void*>(0x1234);
  EXPECT_LEANSTEP_ERROR(ops::moe_unpermute(permuted, idx, out, nullptr, nullptr, false, cuda),
                        "moe.unpermute: no implementation for cuda tensors");
  auto& op = ops::moe_unpermute_op();
  op.install_on(DeviceType::kCUDA, "fake_cuda", &cuda_unpermute);
  ops::moe_unpermute(permuted, idx, out, nullptr, nullptr, false, cuda);
  EXPECT_EQ(device_calls, 1);
  const uint64_t fused_before = calls("moe.unpermute", "fused");
  ops::moe_unpermute(permuted, idx, out);  // host: the CPU candidates only
  EXPECT_EQ(device_calls, 1);
  EXPECT_EQ(calls("moe.unpermute", "fused"), fused_before + 1);
  bool listed = false;
  for (const auto& i : op.report().impls) listed |= i.name == "fake_cuda" && i.device == "cuda";
  EXPECT_TRUE(listed);
  op.uninstall("fake_cuda");
  EXPECT_THROW(ops::moe_unpermute(permuted, idx, out, nullptr, nullptr, false, cuda), Error);
}

// The workspace protocol: the query names the bytes the implementation that
// would run uses; given that much, the call works in it (same bits).
TEST_F(DispatchOps, RmsnormBackwardWorksInTheCallersWorkspace) {
  std::mt19937_64 rng(test_seed());
  const int64_t rows = 300, h = 1000;
  Buffer x(DType::kFloat32, {rows, h}), dy(DType::kFloat32, {rows, h}), g(DType::kFloat32, {h});
  Buffer rstd(DType::kFloat32, {rows}), dx_own(DType::kFloat32, {rows, h}), dx_ws(DType::kFloat32, {rows, h});
  Buffer dg_own(DType::kFloat32, {h}), dg_ws(DType::kFloat32, {h});
  fill_normal(x.view(), rng);
  fill_normal(dy.view(), rng);
  fill_normal(g.view(), rng, 1.0, 0.1);
  for (int64_t r = 0; r < rows; ++r) rstd.data_as<float>()[r] = 1.0f;
  rmsnorm::CallContext trainable;
  const size_t need = ops::rmsnorm_backward_op().workspace_bytes(dy, x, rstd, g, dx_ws, &dg_ws.view(), {}, trainable,
                                                                  ld::Context{});
  EXPECT_EQ(need, rmsnorm::backward_fused_workspace_bytes(x, true));
  EXPECT_GT(need, 0u);
  rmsnorm::CallContext frozen;
  frozen.weight_requires_grad = false;
  EXPECT_EQ(ops::rmsnorm_backward_op().workspace_bytes(dy, x, rstd, g, dx_ws, nullptr, {}, frozen, ld::Context{}), 0u);
  // The query checks the arguments as a call would (trainable weight, no dgamma).
  EXPECT_LEANSTEP_ERROR(
      ops::rmsnorm_backward_op().workspace_bytes(dy, x, rstd, g, dx_ws, nullptr, {}, trainable, ld::Context{}),
      "argument 'dgamma' must be given");
  std::vector<float> scratch(need / sizeof(float), 12345.0f);  // stale contents must not matter
  ld::Context with;
  with.workspace = {scratch.data(), need};
  ops::rmsnorm_backward(dy, x, rstd, g, dx_own, &dg_own.view(), {}, trainable);
  ops::rmsnorm_backward(dy, x, rstd, g, dx_ws, &dg_ws.view(), {}, trainable, with);
  EXPECT_TRUE(same_bits(dx_own, dx_ws));
  EXPECT_TRUE(same_bits(dg_own, dg_ws));
  EXPECT_NE(scratch[0], 12345.0f);  // it was used
}

// ---------------------------------------------------------------- in-place grad ops

TEST_F(DispatchOps, InPlaceGradOpsRefuseASelfOverlappingViewUnderEveryPresetAndImplementation) {
  float values[4] = {1, 2, 3, 4};
  float one = 1.0f;
  Tensor dense(values, DType::kFloat32, {3});
  Tensor expanded(&values[3], DType::kFloat32, {6});
  expanded.strides[0] = 0;  // torch's expand(): six indices, one element
  const std::vector<Tensor> views{dense, expanded};
  const grad::Plan plan(views);
  ASSERT_EQ(plan.first_self_overlapping(), 1);
  Buffer out(DType::kFloat32, {1}), found(DType::kFloat32, {1}), coeff(DType::kFloat32, {1});
  const Tensor scalar(&one, DType::kFloat32, {1}), found_view = found.view(), coeff_view = coeff.view();
  const char* kRule = "argument 'grads[1]' must not overlap itself";
  auto expect_untouched = [&] {
    EXPECT_EQ(values[0], 1);
    EXPECT_EQ(values[3], 4);
  };
  for (const char* preset : {"all", "baseline"}) {
    SCOPED_TRACE(preset);
    ld::registry().set_preset(preset);
    EXPECT_LEANSTEP_ERROR(ops::grad_unscale_norm(plan, scalar, out, found), kRule);
    EXPECT_LEANSTEP_ERROR(ops::grad_clip(plan, scalar, 1.0, &coeff_view), kRule);
    EXPECT_LEANSTEP_ERROR(ops::grad_norm_clip(plan, 1.0, out, 2.0, &found_view, &coeff_view), kRule);
    EXPECT_LEANSTEP_ERROR(ops::grad_scale(plan, scalar), kRule);
    expect_untouched();
    EXPECT_NO_THROW(ops::grad_norm(plan, out));  // reading is fine
  }
  for (const char* impl : {"reference", "fused"}) {
    SCOPED_TRACE(impl);
    EXPECT_LEANSTEP_ERROR(ops::grad_unscale_norm_op().call_impl(impl, plan, scalar, out, found, 2.0, nullptr, {}), kRule);
    EXPECT_LEANSTEP_ERROR(ops::grad_clip_op().call_impl(impl, plan, scalar, 1.0, &coeff_view, {}), kRule);
    EXPECT_LEANSTEP_ERROR(ops::grad_scale_op().call_impl(impl, plan, scalar, {}), kRule);
    expect_untouched();
  }
  // The area functions refuse it too (direct C++ callers bypass the slot).
  EXPECT_LEANSTEP_ERROR(grad::scale(plan, scalar), kRule);
  EXPECT_LEANSTEP_ERROR(grad::reference::clip(views, scalar, 1.0, nullptr), kRule);
  const std::vector<Tensor> in{dense}, out_views{expanded};
  Buffer src(DType::kFloat32, {6});
  const std::vector<Tensor> src6{src.view()};
  for (const char* impl : {"reference", "fused"})
    EXPECT_LEANSTEP_ERROR(ops::grad_multi_tensor_scale_op().call_impl(impl, TensorList(src6), TensorList(out_views),
                                                                      scalar, found, {}),
                          "argument 'out[0]' must not overlap itself");
  expect_untouched();
}
