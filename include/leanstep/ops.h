// leanstep ops: the dispatched entry points. The training step and the Python
// package call these; each one calls through its op's slot in the process-wide
// registry (leanstep/dispatch.h), so the active preset and any installed
// implementation decide what runs, and every decision is counted.
//
//   op name                   reference                          fast path (guard)
//   grad.norm                 grad::reference::norm (per tensor)  fused over the plan (plan has regions)
//   grad.unscale_norm         per tensor                          fused (plan has regions)
//   grad.clip                 per tensor                          fused (plan has regions)
//   grad.norm_clip            per tensor                          fused (plan has regions)
//   grad.scale                per tensor                          fused (plan has regions)
//   grad.count_zeros          per tensor                          fused (plan has regions)
//   grad.multi_tensor_scale   per tensor                          fused (none)
//   rmsnorm.forward           rmsnorm::forward_reference          fused (no delegated feature)
//   rmsnorm.backward          rmsnorm::backward_reference         frozen_fused (frozen weight, no
//                                                                 delegated feature), then fused
//                                                                 (trainable, no delegated feature)
//   moe.permute               "sort" method                       "fused" method (none)
//   moe.unpermute             "sort"                              "fused" (none)
//   moe.permute_backward      "sort"                              "fused" (none)
//   moe.unpermute_backward    "sort"                              "fused" (none)
//
// The arguments and semantics are those of the area functions named above
// (see grad.h, rmsnorm.h, moe.h); the reference and the fast paths give the
// same results within the tolerances those areas document (bit-identical for
// moe and rmsnorm).
#pragma once

#include <optional>
#include <span>

#include "leanstep/core.h"
#include "leanstep/dispatch.h"
#include "leanstep/grad.h"
#include "leanstep/moe.h"
#include "leanstep/rmsnorm.h"

// Canonical names of the area types that appear in op signatures.
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::grad::Plan, "grad::Plan");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::comm::Communicator, "comm::Communicator");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::rmsnorm::Options, "rmsnorm::Options");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::rmsnorm::CallContext, "rmsnorm::CallContext");

namespace leanstep::ops {

// ---------------------------------------------------------------- signatures

using GradNormSig = void(const grad::Plan& plan, const Tensor& out_norm, double norm_type,
                         const Tensor* found_inf, comm::Communicator* comm);
using GradUnscaleNormSig = void(const grad::Plan& plan, const Tensor& inv_scale, const Tensor& out_norm,
                                const Tensor& found_inf, double norm_type, comm::Communicator* comm);
using GradClipSig = void(const grad::Plan& plan, const Tensor& total_norm, double max_norm,
                         const Tensor* out_coeff);
using GradNormClipSig = void(const grad::Plan& plan, double max_norm, const Tensor& out_norm,
                             double norm_type, const Tensor* found_inf, const Tensor* out_coeff,
                             comm::Communicator* comm);
using GradScaleSig = void(const grad::Plan& plan, const Tensor& scale);
using GradCountZerosSig = void(const grad::Plan& plan, const Tensor& out_count, comm::Communicator* comm);
using GradMultiTensorScaleSig = void(std::span<const Tensor> in, std::span<const Tensor> out,
                                     const Tensor& scale, const Tensor& found_inf);

using RmsnormForwardSig = void(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                               const rmsnorm::Options& options, const rmsnorm::CallContext& context);
using RmsnormBackwardSig = void(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                                const Tensor& dx, const Tensor* dgamma, const rmsnorm::Options& options,
                                const rmsnorm::CallContext& context);

using MoePermuteSig = void(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
                           std::optional<int64_t> num_out_tokens, bool drop_and_pad, const Tensor& permuted,
                           const Tensor* permuted_probs, const Tensor& sorted_indices);
using MoeUnpermuteSig = void(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
                             const Tensor* probs, const Tensor* routing_map, bool drop_and_pad);
using MoePermuteBackwardSig = void(const Tensor& dpermuted, const Tensor& sorted_indices,
                                   const Tensor& dtokens);
using MoeUnpermuteBackwardSig = void(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                                     const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                                     const Tensor& dpermuted, const Tensor* dprobs);

// ---------------------------------------------------------------- slots
// The typed slots, for installing implementations with compile-time checked
// signatures (e.g. `ops::grad_norm_op().install("mine", &my_norm)`).

dispatch::Op<GradNormSig>& grad_norm_op();
dispatch::Op<GradUnscaleNormSig>& grad_unscale_norm_op();
dispatch::Op<GradClipSig>& grad_clip_op();
dispatch::Op<GradNormClipSig>& grad_norm_clip_op();
dispatch::Op<GradScaleSig>& grad_scale_op();
dispatch::Op<GradCountZerosSig>& grad_count_zeros_op();
dispatch::Op<GradMultiTensorScaleSig>& grad_multi_tensor_scale_op();
dispatch::Op<RmsnormForwardSig>& rmsnorm_forward_op();
dispatch::Op<RmsnormBackwardSig>& rmsnorm_backward_op();
dispatch::Op<MoePermuteSig>& moe_permute_op();
dispatch::Op<MoeUnpermuteSig>& moe_unpermute_op();
dispatch::Op<MoePermuteBackwardSig>& moe_permute_backward_op();
dispatch::Op<MoeUnpermuteBackwardSig>& moe_unpermute_backward_op();

// ---------------------------------------------------------------- entry points

void grad_norm(const grad::Plan& plan, const Tensor& out_norm, double norm_type = 2.0,
               const Tensor* found_inf = nullptr, comm::Communicator* comm = nullptr);
void grad_unscale_norm(const grad::Plan& plan, const Tensor& inv_scale, const Tensor& out_norm,
                       const Tensor& found_inf, double norm_type = 2.0, comm::Communicator* comm = nullptr);
void grad_clip(const grad::Plan& plan, const Tensor& total_norm, double max_norm,
               const Tensor* out_coeff = nullptr);
void grad_norm_clip(const grad::Plan& plan, double max_norm, const Tensor& out_norm, double norm_type = 2.0,
                    const Tensor* found_inf = nullptr, const Tensor* out_coeff = nullptr,
                    comm::Communicator* comm = nullptr);
void grad_scale(const grad::Plan& plan, const Tensor& scale);
void grad_count_zeros(const grad::Plan& plan, const Tensor& out_count, comm::Communicator* comm = nullptr);
void grad_multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, const Tensor& scale,
                             const Tensor& found_inf);

// dgamma must be given exactly when context.weight_requires_grad (checked here,
// before dispatch, so every implementation sees consistent arguments).
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                     const rmsnorm::Options& options = {}, const rmsnorm::CallContext& context = {});
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      const Tensor& dx, const Tensor* dgamma, const rmsnorm::Options& options = {},
                      const rmsnorm::CallContext& context = {});

void moe_permute(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
                 std::optional<int64_t> num_out_tokens, bool drop_and_pad, const Tensor& permuted,
                 const Tensor* permuted_probs, const Tensor& sorted_indices);
void moe_unpermute(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
                   const Tensor* probs = nullptr, const Tensor* routing_map = nullptr,
                   bool drop_and_pad = false);
void moe_permute_backward(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens);
void moe_unpermute_backward(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                            const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                            const Tensor& dpermuted, const Tensor* dprobs);

}  // namespace leanstep::ops
