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
// same results within the tolerances those areas document: bit-identical for
// moe; for rmsnorm and the grad norms within the bounds the conformance harness
// declares (tests/cpp/test_dispatch_conformance.cpp), the SIMD sums being
// ordered differently from the reference's one accumulator.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <span>

#include "leanstep/core.h"
#include "leanstep/dispatch.h"
#include "leanstep/grad.h"
#include "leanstep/moe.h"
#include "leanstep/rmsnorm.h"

// Canonical names of the area types that appear in op signatures.
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::grad::PlanView, "grad::PlanView");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::comm::Communicator, "comm::Communicator");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::rmsnorm::Options, "rmsnorm::Options");
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::rmsnorm::CallContext, "rmsnorm::CallContext");

namespace leanstep::ops {

// ---------------------------------------------------------------- signatures

using GradNormSig = void(const grad::PlanView& plan, const Tensor& out_norm, double norm_type,
                         const Tensor* found_inf, comm::Communicator* comm, const dispatch::Context& ctx);
using GradUnscaleNormSig = void(const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm,
                                const Tensor& found_inf, double norm_type, comm::Communicator* comm,
                                const dispatch::Context& ctx);
using GradClipSig = void(const grad::PlanView& plan, const Tensor& total_norm, double max_norm,
                         const Tensor* out_coeff, const dispatch::Context& ctx);
using GradNormClipSig = void(const grad::PlanView& plan, double max_norm, const Tensor& out_norm,
                             double norm_type, const Tensor* found_inf, const Tensor* out_coeff,
                             comm::Communicator* comm, const dispatch::Context& ctx);
using GradScaleSig = void(const grad::PlanView& plan, const Tensor& scale, const dispatch::Context& ctx);
using GradCountZerosSig = void(const grad::PlanView& plan, const Tensor& out_count, comm::Communicator* comm,
                               const dispatch::Context& ctx);
using GradMultiTensorScaleSig = void(std::span<const Tensor> in, std::span<const Tensor> out,
                                     const Tensor& scale, const Tensor& found_inf, const dispatch::Context& ctx);

using RmsnormForwardSig = void(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                               const rmsnorm::Options& options, const rmsnorm::CallContext& context,
                               const dispatch::Context& ctx);
using RmsnormBackwardSig = void(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                                const Tensor& dx, const Tensor* dgamma, const rmsnorm::Options& options,
                                const rmsnorm::CallContext& context, const dispatch::Context& ctx);

using MoePermuteSig = void(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
                           std::optional<int64_t> num_out_tokens, bool drop_and_pad, const Tensor& permuted,
                           const Tensor* permuted_probs, const Tensor& sorted_indices, const dispatch::Context& ctx);
using MoeUnpermuteSig = void(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
                             const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                             const dispatch::Context& ctx);
using MoePermuteBackwardSig = void(const Tensor& dpermuted, const Tensor& sorted_indices,
                                   const Tensor& dtokens, const dispatch::Context& ctx);
using MoeUnpermuteBackwardSig = void(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                                     const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                                     const Tensor& dpermuted, const Tensor* dprobs, const dispatch::Context& ctx);

// ---------------------------------------------------------------- the op table
// Every op, declared once: X(slot, "name", signature, "device backends").
// The slots (`<slot>_op()`), the registration of the built-in ops, the count
// checked by the conformance harness (tests/cpp/test_dispatch_conformance.cpp)
// and `leanstep paths` all come from this table. "device backends" are the
// Python package's implementations for tensors on a device (torch ops,
// Triton kernels: python/leanstep/backends/), listed by `leanstep paths`.
#define LEANSTEP_OPS(X)                                                                        \
  X(grad_norm, "grad.norm", GradNormSig, "torch,triton")                                       \
  X(grad_unscale_norm, "grad.unscale_norm", GradUnscaleNormSig, "torch,triton")                \
  X(grad_clip, "grad.clip", GradClipSig, "torch,triton")                                       \
  X(grad_norm_clip, "grad.norm_clip", GradNormClipSig, "torch,triton")                         \
  X(grad_scale, "grad.scale", GradScaleSig, "torch,triton")                                    \
  X(grad_count_zeros, "grad.count_zeros", GradCountZerosSig, "torch,triton")                   \
  X(grad_multi_tensor_scale, "grad.multi_tensor_scale", GradMultiTensorScaleSig, "torch,triton") \
  X(rmsnorm_forward, "rmsnorm.forward", RmsnormForwardSig, "torch,triton")                     \
  X(rmsnorm_backward, "rmsnorm.backward", RmsnormBackwardSig, "torch,triton")                  \
  X(moe_permute, "moe.permute", MoePermuteSig, "torch,triton")                                 \
  X(moe_unpermute, "moe.unpermute", MoeUnpermuteSig, "torch,triton")                           \
  X(moe_permute_backward, "moe.permute_backward", MoePermuteBackwardSig, "torch,triton")       \
  X(moe_unpermute_backward, "moe.unpermute_backward", MoeUnpermuteBackwardSig, "torch")

// The typed slots, for installing implementations with compile-time checked
// signatures (e.g. `ops::grad_norm_op().install("mine", &my_norm)`).
#define LEANSTEP_DECLARE_OP_SLOT(slot, name, Sig, devices) dispatch::Op<Sig>& slot##_op();
LEANSTEP_OPS(LEANSTEP_DECLARE_OP_SLOT)
#undef LEANSTEP_DECLARE_OP_SLOT

#define LEANSTEP_COUNT_OP(...) +1
inline constexpr size_t kNumOps = 0 LEANSTEP_OPS(LEANSTEP_COUNT_OP);
#undef LEANSTEP_COUNT_OP

struct OpEntry {
  const char* name;             // "grad.norm"
  const char* device_backends;  // "torch,triton": the Python package's device implementations
  dispatch::OpBase& (*slot)();  // the slot (created on first use)
};
// The table's rows, in table order.
const std::array<OpEntry, kNumOps>& op_table();

// ---------------------------------------------------------------- entry points
// Each takes the backend context last (default: host memory, no stream, no
// workspace; see dispatch::Context).

void grad_norm(const grad::PlanView& plan, const Tensor& out_norm, double norm_type = 2.0,
               const Tensor* found_inf = nullptr, comm::Communicator* comm = nullptr,
               const dispatch::Context& ctx = {});
void grad_unscale_norm(const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm,
                       const Tensor& found_inf, double norm_type = 2.0, comm::Communicator* comm = nullptr,
                       const dispatch::Context& ctx = {});
void grad_clip(const grad::PlanView& plan, const Tensor& total_norm, double max_norm,
               const Tensor* out_coeff = nullptr, const dispatch::Context& ctx = {});
void grad_norm_clip(const grad::PlanView& plan, double max_norm, const Tensor& out_norm, double norm_type = 2.0,
                    const Tensor* found_inf = nullptr, const Tensor* out_coeff = nullptr,
                    comm::Communicator* comm = nullptr, const dispatch::Context& ctx = {});
void grad_scale(const grad::PlanView& plan, const Tensor& scale, const dispatch::Context& ctx = {});
void grad_count_zeros(const grad::PlanView& plan, const Tensor& out_count, comm::Communicator* comm = nullptr,
                      const dispatch::Context& ctx = {});
void grad_multi_tensor_scale(std::span<const Tensor> in, std::span<const Tensor> out, const Tensor& scale,
                             const Tensor& found_inf, const dispatch::Context& ctx = {});

// dgamma must be given exactly when context.weight_requires_grad (checked here,
// before dispatch, so every implementation sees consistent arguments).
void rmsnorm_forward(const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,
                     const rmsnorm::Options& options = {}, const rmsnorm::CallContext& context = {},
                     const dispatch::Context& ctx = {});
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma,
                      const Tensor& dx, const Tensor* dgamma, const rmsnorm::Options& options = {},
                      const rmsnorm::CallContext& context = {}, const dispatch::Context& ctx = {});

void moe_permute(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
                 std::optional<int64_t> num_out_tokens, bool drop_and_pad, const Tensor& permuted,
                 const Tensor* permuted_probs, const Tensor& sorted_indices, const dispatch::Context& ctx = {});
void moe_unpermute(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out,
                   const Tensor* probs = nullptr, const Tensor* routing_map = nullptr,
                   bool drop_and_pad = false, const dispatch::Context& ctx = {});
void moe_permute_backward(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens,
                          const dispatch::Context& ctx = {});
void moe_unpermute_backward(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                            const Tensor* probs, const Tensor* routing_map, bool drop_and_pad,
                            const Tensor& dpermuted, const Tensor* dprobs, const dispatch::Context& ctx = {});

}  // namespace leanstep::ops
