// RMSNorm ops: the reference kernels, the fused kernels, and the frozen-weight
// backward, with the rmsnorm area's decision function as guard input.
#include <fmt/format.h>

#include "dispatch/builtin.h"

namespace leanstep::ops {
namespace {

constexpr uint32_t kWeightBit = 1u << static_cast<int>(rmsnorm::Reason::kWeightRequiresGrad);

// The decline reasons in `mask`, joined ("autocast, debug_hooks"), interned so
// they can be counted per text.
const char* reasons_text(uint32_t mask) {
  std::string text;
  for (int r = 1; r < rmsnorm::kNumReasons; ++r)
    if (mask & (1u << r)) text += fmt::format("{}{}", text.empty() ? "" : ", ", rmsnorm::reason_name(static_cast<rmsnorm::Reason>(r)));
  return dispatch::intern_reason(text);
}

// Fused kernels take any call without a delegated feature (fp8 output,
// autocast, offload, hooks, compile/capture, user subclass): those belong to
// the framework's general path, the reference here.
const char* no_delegated_feature(const rmsnorm::CallContext& context) {
  const uint32_t features = rmsnorm::decide(context).decline_mask & ~kWeightBit;
  return features ? reasons_text(features) : nullptr;
}

const char* forward_guard(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const rmsnorm::Options&,
                          const rmsnorm::CallContext& context, const dispatch::Context&) {
  return no_delegated_feature(context);
}
const char* backward_guard(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor*,
                           const rmsnorm::Options&, const rmsnorm::CallContext& context, const dispatch::Context&) {
  return no_delegated_feature(context);
}
// The frozen direct path: rmsnorm::decide is the guard.
const char* frozen_guard(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor*,
                         const rmsnorm::Options&, const rmsnorm::CallContext& context, const dispatch::Context&) {
  const rmsnorm::Decision d = rmsnorm::decide(context);
  return d.path == rmsnorm::Path::kFrozenFused ? nullptr : reasons_text(d.decline_mask);
}

void forward_reference(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                       const rmsnorm::Options& options, const rmsnorm::CallContext&, const dispatch::Context&) {
  rmsnorm::forward_reference(x, gamma, y, rstd, options);
}
void forward_fused(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                   const rmsnorm::Options& options, const rmsnorm::CallContext&, const dispatch::Context&) {
  rmsnorm::forward_fused(x, gamma, y, rstd, options);
}
void backward_reference(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma, const Tensor& dx,
                        const Tensor* dgamma, const rmsnorm::Options& options, const rmsnorm::CallContext&,
                        const dispatch::Context&) {
  rmsnorm::backward_reference(dy, x, rstd, gamma, dx, dgamma, options);
}
void backward_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma, const Tensor& dx,
                    const Tensor* dgamma, const rmsnorm::Options& options, const rmsnorm::CallContext&,
                    const dispatch::Context& ctx) {
  rmsnorm::backward_fused(dy, x, rstd, gamma, dx, dgamma, options, ctx.workspace.data, ctx.workspace.bytes);
}
// The trainable kernel's dgamma partial rows (the workspace query).
size_t backward_workspace(const Tensor&, const Tensor& x, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor* dgamma, const rmsnorm::Options&, const rmsnorm::CallContext&,
                          const dispatch::Context&) {
  return rmsnorm::backward_fused_workspace_bytes(x, dgamma != nullptr);
}
// Only reached for frozen weights (dgamma is null, checked by the precondition).
void backward_frozen_fused(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                           const Tensor& dx, const Tensor*, const rmsnorm::Options& options,
                           const rmsnorm::CallContext&, const dispatch::Context&) {
  rmsnorm::backward_fused(dy, x, rstd, gamma, dx, nullptr, options);
}

// Every implementation may rely on dgamma being given exactly when the weight
// requires grad.
void backward_precondition(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor* dgamma, const rmsnorm::Options&, const rmsnorm::CallContext& context,
                           const dispatch::Context&) {
  constexpr const char* where = "rmsnorm.backward";
  if (context.weight_requires_grad)
    LEANSTEP_CHECK_ARG(dgamma != nullptr, where, "dgamma", "must be given when the weight requires grad");
  else
    LEANSTEP_CHECK_ARG(dgamma == nullptr, where, "dgamma",
                       "must be null when the weight is frozen (context.weight_requires_grad is false)");
}

constexpr const char* kFeatureGuardDoc =
    "no delegated feature (fp8 output, autocast, activation offload, debug hooks, compile/capture, user subclass)";

}  // namespace

namespace builtin {

dispatch::Op<RmsnormForwardSig>* rmsnorm_forward(const char* name) {
  auto* op = new dispatch::Op<RmsnormForwardSig>(name, "reference", &forward_reference);
  op->install("fused", &forward_fused, &forward_guard, kFeatureGuardDoc, "built-in");
  return op;
}

dispatch::Op<RmsnormBackwardSig>* rmsnorm_backward(const char* name) {
  auto* op = new dispatch::Op<RmsnormBackwardSig>(name, "reference", &backward_reference, &backward_precondition);
  // Tried newest first: the frozen path, then the trainable fused kernel.
  op->install_on(DeviceType::kCPU, "fused", &backward_fused, &backward_guard, kFeatureGuardDoc, &backward_workspace,
                 "built-in");
  op->install("frozen_fused", &backward_frozen_fused, &frozen_guard,
              "rmsnorm::decide: weight frozen and no delegated feature (skips dgamma entirely)", "built-in");
  return op;
}

}  // namespace builtin
}  // namespace leanstep::ops
