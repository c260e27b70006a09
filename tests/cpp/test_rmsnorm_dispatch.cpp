// RMSNorm guarantees: feature delegation (decide, the guard of the dispatch
// registry), the frozen path's bit-identity with the trainable one and its lack
// of cross-row work, thread-count independence of dgamma, and bad input.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "leanstep/buffer.h"
#include "leanstep/rmsnorm.h"
#include "test_util.h"

namespace leanstep {
namespace {

using namespace leanstep::testing;
namespace rn = leanstep::rmsnorm;

rn::CallContext frozen() {
  rn::CallContext c;
  c.weight_requires_grad = false;
  return c;
}

TEST(RmsNormDelegation, FrozenWithNoFeatureTakesTheFusedPath) {
  const rn::Decision d = rn::decide(frozen());
  EXPECT_EQ(d.path, rn::Path::kFrozenFused);
  EXPECT_EQ(d.reason, rn::Reason::kTaken);
  EXPECT_EQ(d.decline_mask, 0u);
  EXPECT_NE(d.explain().find("frozen_fused"), std::string::npos);
}

TEST(RmsNormDelegation, EveryFeatureFlagSendsTheCallToTheGeneralPath) {
  using Flag = bool rn::CallContext::*;
  struct Feature {
    Flag flag;
    rn::Reason reason;
  };
  const Feature features[] = {
      {&rn::CallContext::weight_requires_grad, rn::Reason::kWeightRequiresGrad},
      {&rn::CallContext::fp8_output, rn::Reason::kFp8Output},
      {&rn::CallContext::autocast, rn::Reason::kAutocast},
      {&rn::CallContext::activation_offload, rn::Reason::kActivationOffload},
      {&rn::CallContext::debug_hooks, rn::Reason::kDebugHooks},
      {&rn::CallContext::compiled_or_captured, rn::Reason::kCompiledOrCaptured},
      {&rn::CallContext::user_subclass, rn::Reason::kUserSubclass},
  };
  for (const Feature& f : features) {
    SCOPED_TRACE(rn::reason_name(f.reason));
    rn::CallContext c = frozen();
    c.*f.flag = true;
    const rn::Decision d = rn::decide(c);
    EXPECT_EQ(d.path, rn::Path::kGeneral);
    EXPECT_EQ(d.reason, f.reason);
    EXPECT_EQ(d.decline_mask, 1u << static_cast<int>(f.reason));
    EXPECT_NE(d.explain().find(rn::reason_name(f.reason)), std::string::npos) << d.explain();
  }
  // Several features at once: every reason is in the mask, the first is reported.
  rn::CallContext c;  // weight requires grad
  c.autocast = true;
  c.debug_hooks = true;
  const rn::Decision d = rn::decide(c);
  EXPECT_EQ(d.reason, rn::Reason::kWeightRequiresGrad);
  EXPECT_EQ(d.decline_mask, (1u << static_cast<int>(rn::Reason::kWeightRequiresGrad)) |
                                (1u << static_cast<int>(rn::Reason::kAutocast)) |
                                (1u << static_cast<int>(rn::Reason::kDebugHooks)));
  EXPECT_NE(d.explain().find("autocast"), std::string::npos);
  // (The dispatched calls and their per-reason counts: test_dispatch_ops.cpp.)
}

TEST(RmsNormFrozen, YAndDxAreBitIdenticalToTheTrainablePath) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : float_dtypes())
    for (int64_t h : {128, 229, 2048, 4097}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " H=" + std::to_string(h));
      const int64_t rows = 70;
      Buffer x(dt, {2, rows / 2, h}), gamma(dt, {h}), dy(dt, {2, rows / 2, h});
      fill_normal(x, rng);
      fill_normal(gamma, rng, 0.0, 0.5);
      fill_normal(dy, rng);
      rn::Options o;
      o.zero_centered_gamma = h % 2 == 1;
      o.eps = 1e-5;
      Buffer y(dt, {2, rows / 2, h}), r(DType::kFloat32, {2, rows / 2});
      Buffer dx_frozen(dt, {2, rows / 2, h}), dx_train(dt, {2, rows / 2, h}), dgamma(dt, {h});
      rn::forward_fused(x, gamma, y, r, o);
      rn::backward_fused(dy, x, r, gamma, dx_frozen, nullptr, o);         // frozen: dx only
      rn::backward_fused(dy, x, r, gamma, dx_train, &dgamma.view(), o);   // trainable
      EXPECT_TRUE(bitwise_equal(dx_frozen, dx_train));
    }
}

TEST(RmsNormFrozen, BackwardIsOneParallelRegionWithNoCrossRowReduction) {
  // The frozen backward is a single pass over independent rows (one dispatch);
  // the trainable one adds the dgamma finalize reduction (a second dispatch).
  const int64_t rows = 600, h = 1024;  // several row chunks
  Buffer x(DType::kFloat32, {rows, h}), gamma(DType::kFloat32, {h}), dy(DType::kFloat32, {rows, h});
  Buffer r(DType::kFloat32, {rows}), dx(DType::kFloat32, {rows, h}), dgamma(DType::kFloat32, {h});
  std::mt19937_64 rng(test_seed());
  fill_normal(x, rng);
  fill_normal(gamma, rng, 1.0, 0.1);
  fill_normal(dy, rng);
  rn::forward_fused(x, gamma, dx, r, {});
  reset_counters();
  rn::backward_fused(dy, x, r, gamma, dx, nullptr, {});
  EXPECT_EQ(counters().dispatches, 1u);
  reset_counters();
  rn::backward_fused(dy, x, r, gamma, dx, &dgamma.view(), {});
  EXPECT_EQ(counters().dispatches, 2u);
  EXPECT_EQ(counters().host_reads, 0u);
}

TEST(RmsNormTrainable, DgammaAndDxAreBitwiseIndependentOfThreadCount) {
  std::mt19937_64 rng(test_seed());
  const int saved = num_threads();
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t rows = 300, h = 4097;  // 63 rows per chunk: 5 chunks, a ragged last one
    Buffer x(dt, {rows, h}), gamma(dt, {h}), dy(dt, {rows, h}), r(DType::kFloat32, {rows});
    fill_normal(x, rng);
    fill_normal(gamma, rng, 1.0, 0.5);
    fill_normal(dy, rng);
    rn::forward_fused(x, gamma, dy, r, {});  // r from a real forward; dy overwritten below
    fill_normal(dy, rng);
    Buffer dx1(dt, {rows, h}), dg1(dt, {h});
    set_num_threads(1);
    rn::backward_fused(dy, x, r, gamma, dx1, &dg1.view(), {});
    for (int t = 2; t <= 4; ++t) {
      set_num_threads(t);
      Buffer dx(dt, {rows, h}), dg(dt, {h});
      rn::backward_fused(dy, x, r, gamma, dx, &dg.view(), {});
      EXPECT_TRUE(bitwise_equal(dg, dg1)) << "threads " << t;
      EXPECT_TRUE(bitwise_equal(dx, dx1)) << "threads " << t;
    }
  }
  set_num_threads(saved);
}

TEST(RmsNormBadInput, RejectedWithAnErrorNamingTheArgumentAndRule) {
  Buffer x(DType::kFloat32, {4, 8}), gamma(DType::kFloat32, {8}), y(DType::kFloat32, {4, 8});
  Buffer r(DType::kFloat32, {4}), dy(DType::kFloat32, {4, 8}), dx(DType::kFloat32, {4, 8});
  Buffer dg(DType::kFloat32, {8});
  Buffer gamma7(DType::kFloat32, {7}), r5(DType::kFloat32, {5}), y_bad(DType::kFloat32, {4, 9});
  Buffer x64(DType::kFloat64, {4, 8}), gi32(DType::kInt32, {8}), r16(DType::kFloat16, {4});
  Buffer x_h0(DType::kFloat32, {4, 0}), g0(DType::kFloat32, {0});
  for (auto* fwd : {&rn::forward_fused, &rn::forward_reference}) {
    EXPECT_LEANSTEP_ERROR(fwd(x, gamma7, y, r, {}), "'gamma' must have shape [8]");
    EXPECT_LEANSTEP_ERROR(fwd(x, gamma, y_bad, r, {}), "'y' must have the shape of x");
    EXPECT_LEANSTEP_ERROR(fwd(x, gamma, y, r5, {}), "'rstd' must have one element per row");
    EXPECT_LEANSTEP_ERROR(fwd(x, gamma, y, r16, {}), "'rstd' must have dtype in {float32}");
    EXPECT_LEANSTEP_ERROR(fwd(x64, gamma, y, r, {}), "'x' must have dtype in");
    EXPECT_LEANSTEP_ERROR(fwd(x, gi32, y, r, {}), "'gamma' must have dtype in");
    EXPECT_LEANSTEP_ERROR(fwd(x_h0, g0, x_h0, r, {}), "'x' must have a hidden size H > 0");
    EXPECT_LEANSTEP_ERROR(fwd(x, gamma, y, r, {.eps = -1e-6}), "'eps' must be finite and >= 0");
    EXPECT_LEANSTEP_ERROR(fwd(x, gamma, y, r, {.eps = std::nan("")}), "'eps' must be finite and >= 0");
  }
  for (auto* bwd : {&rn::backward_fused, &rn::backward_reference}) {
    EXPECT_LEANSTEP_ERROR(bwd(y_bad, x, r, gamma, dx, nullptr, {}), "'dy' must have the shape of x");
    EXPECT_LEANSTEP_ERROR(bwd(dy, x, r5, gamma, dx, nullptr, {}), "'rstd' must have one element per row");
    EXPECT_LEANSTEP_ERROR(bwd(dy, x, r, gamma7, dx, nullptr, {}), "'gamma' must have shape [8]");
    EXPECT_LEANSTEP_ERROR(bwd(dy, x, r, gamma, y_bad, nullptr, {}), "'dx' must have the shape of x");
    EXPECT_LEANSTEP_ERROR(bwd(dy, x, r, gamma, dx, &gamma7.view(), {}), "'dgamma' must have shape [8]");
    EXPECT_LEANSTEP_ERROR(bwd(dy, x, r, gamma, dx, nullptr, {.eps = -1.0}), "'eps' must be finite");
    EXPECT_LEANSTEP_ERROR(bwd(dy, x, r, gamma, dx, &gi32.view(), {}), "'dgamma' must have dtype in");
  }
  // Strided (non-contiguous) rows: a transposed view.
  Tensor xt = x.view();
  std::swap(xt.shape[0], xt.shape[1]);
  std::swap(xt.strides[0], xt.strides[1]);
  Buffer yt(DType::kFloat32, {8, 4}), rt(DType::kFloat32, {8}), g4(DType::kFloat32, {4});
  EXPECT_LEANSTEP_ERROR(rn::forward_fused(xt, g4, yt, rt, {}), "'x' must be contiguous");
  // Accelerator tensors in a CPU-only build.
  Tensor xc = x.view();
  xc.device.type = DeviceType::kCUDA;
  EXPECT_LEANSTEP_ERROR(rn::forward_fused(xc, gamma, y, r, {}), "lives on");
  // 0-dim x.
  float scalar = 1;
  Tensor x0(&scalar, DType::kFloat32, {});
  EXPECT_LEANSTEP_ERROR(rn::forward_fused(x0, gamma, y, r, {}), "'x' must have at least 1 dim");
  // Overlaps other than an exact in-place alias.
  Buffer big(DType::kFloat32, {5, 8});
  Tensor shifted(big.data_as<float>() + 8, DType::kFloat32, {4, 8});
  Tensor base(big.data(), DType::kFloat32, {4, 8});
  EXPECT_LEANSTEP_ERROR(rn::forward_fused(base, gamma, shifted, r, {}), "'y' must not overlap 'x'");
  EXPECT_LEANSTEP_ERROR(rn::forward_fused(x, gamma, y, Tensor(x.data(), DType::kFloat32, {4}), {}),
                        "'rstd' must not overlap 'x'");
  const Tensor dg_in_dx(dx.data(), DType::kFloat32, {8});
  EXPECT_LEANSTEP_ERROR(rn::backward_fused(dy, x, r, gamma, dx, &dg_in_dx, {}), "'dgamma' must not overlap");
  // (dgamma iff the weight requires grad is the rmsnorm.backward slot's precondition: test_dispatch_ops.cpp.)
  EXPECT_LEANSTEP_ERROR(rn::rounding_from_name("scale"), "must be scale_then_cast or cast_then_scale");
}

}  // namespace
}  // namespace leanstep
