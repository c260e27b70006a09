// The gradient engine's ops: per-tensor reference, fused plan-based fast path.
#include "dispatch/builtin.h"
#include "leanstep/grad.h"

namespace leanstep::ops {
namespace {

// The fused path works on the plan's coalesced regions; a plan made only of
// generic views (strided, scattered) gains nothing from it. The guard of a
// plan op takes that op's arguments: its type follows from the signature.
template <class Sig>
struct NeedsRegions;
template <class... Rest>
struct NeedsRegions<void(const grad::PlanView&, Rest...)> {
  static const char* guard(const grad::PlanView& plan, Rest...) {
    return plan.num_regions() == 0 && plan.num_generic() > 0 ? "plan has no coalesced region (every view is generic)"
                                                             : nullptr;
  }
};
constexpr const char* kRegionsGuardDoc = "plans with at least one coalesced region (or empty plans)";

// The in-place plan ops refuse a plan that lists a self-overlapping view
// before any implementation is chosen, so every preset and forced
// implementation refuses it alike (the area functions check it too).
template <class Sig>
struct InPlace;
template <class... Rest>
struct InPlace<void(const grad::PlanView&, Rest...)> {
  template <const char* kWhere>
  static void precondition(const grad::PlanView& plan, Rest...) {
    grad::check_in_place(plan, kWhere);
  }
};
constexpr char kUnscaleNorm[] = "grad.unscale_norm";
constexpr char kUnscale[] = "grad.unscale";
constexpr char kClip[] = "grad.clip";
constexpr char kNormClip[] = "grad.norm_clip";
constexpr char kScale[] = "grad.scale";

// ---- references: the per-tensor loop over the plan's listed views

void norm_reference(const grad::PlanView& plan, const Tensor& out_norm, double norm_type, const Tensor* found_inf,
                    comm::Communicator* comm, const dispatch::Context&) {
  grad::reference::norm(plan.views(), out_norm, norm_type, found_inf, comm);
}
void unscale_norm_reference(const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm,
                            const Tensor& found_inf, double norm_type, comm::Communicator* comm,
                            const dispatch::Context&) {
  grad::reference::unscale_norm(plan.views(), inv_scale, out_norm, found_inf, norm_type, comm);
}
// unscale is unscale_norm whose norm nobody reads: the same pass, the same
// grads and found_inf, the norm left in a local scratch value.
void unscale_reference(const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& found_inf,
                       const dispatch::Context&) {
  float unused = 0.0f;
  grad::reference::unscale_norm(plan.views(), inv_scale, Tensor(&unused, DType::kFloat32, {1}), found_inf);
}
void clip_reference(const grad::PlanView& plan, const Tensor& total_norm, double max_norm, const Tensor* out_coeff,
                    const dispatch::Context&) {
  grad::reference::clip(plan.views(), total_norm, max_norm, out_coeff);
}
void norm_clip_reference(const grad::PlanView& plan, double max_norm, const Tensor& out_norm, double norm_type,
                         const Tensor* found_inf, const Tensor* out_coeff, comm::Communicator* comm,
                         const dispatch::Context&) {
  grad::reference::norm_clip(plan.views(), max_norm, out_norm, norm_type, found_inf, out_coeff, comm);
}
// Like the frameworks' fallback: the scale is read on the host, then each view
// is scaled in place in list order (a view listed twice is scaled twice).
void scale_reference(const grad::PlanView& plan, const Tensor& scale, const dispatch::Context&) {
  // Not through multi_tensor_scale's reference: that one computes in fp32 for
  // every dtype (its semantics), which rounded fp64 grads to fp32.
  grad::reference::scale(plan.views(), static_cast<float>(read_scalar(scale)));
}
void count_zeros_reference(const grad::PlanView& plan, const Tensor& out_count, comm::Communicator* comm,
                           const dispatch::Context&) {
  grad::reference::count_zeros(plan.views(), out_count, comm);
}
void multi_tensor_scale_reference(TensorList in, TensorList out, const Tensor& scale,
                                  const Tensor& found_inf, const dispatch::Context&) {
  grad::reference::multi_tensor_scale(in, out, static_cast<float>(read_scalar(scale)), found_inf);
}

// ---- fast paths (thin adapters: the area functions have default arguments)

void norm_fused(const grad::PlanView& plan, const Tensor& out_norm, double norm_type, const Tensor* found_inf,
                comm::Communicator* comm, const dispatch::Context&) {
  grad::norm(plan, out_norm, norm_type, found_inf, comm);
}
void unscale_norm_fused(const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm,
                        const Tensor& found_inf, double norm_type, comm::Communicator* comm,
                        const dispatch::Context&) {
  grad::unscale_norm(plan, inv_scale, out_norm, found_inf, norm_type, comm);
}
void unscale_fused(const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& found_inf,
                   const dispatch::Context&) {
  float unused = 0.0f;
  grad::unscale_norm(plan, inv_scale, Tensor(&unused, DType::kFloat32, {1}), found_inf);
}
void clip_fused(const grad::PlanView& plan, const Tensor& total_norm, double max_norm, const Tensor* out_coeff,
                const dispatch::Context&) {
  grad::clip(plan, total_norm, max_norm, out_coeff);
}
void norm_clip_fused(const grad::PlanView& plan, double max_norm, const Tensor& out_norm, double norm_type,
                     const Tensor* found_inf, const Tensor* out_coeff, comm::Communicator* comm,
                     const dispatch::Context&) {
  grad::norm_clip(plan, max_norm, out_norm, norm_type, found_inf, out_coeff, comm);
}
void scale_fused(const grad::PlanView& plan, const Tensor& scale, const dispatch::Context&) {
  grad::scale(plan, scale);
}
void count_zeros_fused(const grad::PlanView& plan, const Tensor& out_count, comm::Communicator* comm,
                       const dispatch::Context&) {
  grad::count_zeros(plan, out_count, comm);
}
void multi_tensor_scale_fused(TensorList in, TensorList out, const Tensor& scale,
                              const Tensor& found_inf, const dispatch::Context&) {
  grad::multi_tensor_scale(in, out, scale, found_inf);
}

// Reference plus the built-in fused implementation, guarded by NeedsRegions
// for plan ops.
template <class Sig, bool kPlanOp = true>
dispatch::Op<Sig>* make_op(const char* name, typename dispatch::Op<Sig>::Fn reference,
                           typename dispatch::Op<Sig>::Fn fused,
                           typename dispatch::Op<Sig>::Fn precondition = nullptr) {
  auto* op = new dispatch::Op<Sig>(name, "reference", reference, precondition);
  if constexpr (kPlanOp) op->install("fused", fused, &NeedsRegions<Sig>::guard, kRegionsGuardDoc, "built-in");
  else op->install("fused", fused, "", "built-in");
  return op;
}

}  // namespace

namespace builtin {

dispatch::Op<GradNormSig>* grad_norm(const char* name) {
  return make_op<GradNormSig>(name, &norm_reference, &norm_fused);
}
dispatch::Op<GradUnscaleNormSig>* grad_unscale_norm(const char* name) {
  return make_op<GradUnscaleNormSig>(name, &unscale_norm_reference, &unscale_norm_fused,
                                     &InPlace<GradUnscaleNormSig>::precondition<kUnscaleNorm>);
}
dispatch::Op<GradUnscaleSig>* grad_unscale(const char* name) {
  return make_op<GradUnscaleSig>(name, &unscale_reference, &unscale_fused,
                                 &InPlace<GradUnscaleSig>::precondition<kUnscale>);
}
dispatch::Op<GradClipSig>* grad_clip(const char* name) {
  return make_op<GradClipSig>(name, &clip_reference, &clip_fused, &InPlace<GradClipSig>::precondition<kClip>);
}
dispatch::Op<GradNormClipSig>* grad_norm_clip(const char* name) {
  return make_op<GradNormClipSig>(name, &norm_clip_reference, &norm_clip_fused,
                                 &InPlace<GradNormClipSig>::precondition<kNormClip>);
}
dispatch::Op<GradScaleSig>* grad_scale(const char* name) {
  return make_op<GradScaleSig>(name, &scale_reference, &scale_fused, &InPlace<GradScaleSig>::precondition<kScale>);
}
dispatch::Op<GradCountZerosSig>* grad_count_zeros(const char* name) {
  return make_op<GradCountZerosSig>(name, &count_zeros_reference, &count_zeros_fused);
}
dispatch::Op<GradMultiTensorScaleSig>* grad_multi_tensor_scale(const char* name) {
  return make_op<GradMultiTensorScaleSig, false>(name, &multi_tensor_scale_reference, &multi_tensor_scale_fused);
}

}  // namespace builtin
}  // namespace leanstep::ops
