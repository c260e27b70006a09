// leanstep ops: the dispatched entry points. The training step and the Python
// package call these; each one calls through its op's slot in the process-wide
// registry (leanstep/dispatch.h), so the active preset and any installed
// implementation decide what runs, and every decision is counted. `leanstep
// paths` lists every op with its reference, fast paths and their guards.
#pragma once

#include <array>
#include <cstddef>

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
LEANSTEP_DISPATCH_TYPE_NAME(leanstep::moe::RoutingConfig, "moe::RoutingConfig");

namespace leanstep::ops {

// ---------------------------------------------------------------- the op table
// Every op, declared once:
//   X(slot, Signature, "name", (parameters, with defaults), (arguments), "device backends")
// From this table come the signature types, the entry points (`ops::<slot>(...)`,
// which call through the slot), the typed slots (`<slot>_op()`), the
// registration of the built-in ops, the op count the conformance harness checks
// (tests/cpp/test_dispatch_conformance.cpp) and `leanstep paths`. The built-in
// implementations of op <slot> are installed by `builtin::<slot>` beside their
// adapters in src/dispatch/ops_<area>.cpp. The backend context comes last
// (default: host memory, no stream, no workspace; see dispatch::Context).
// "device backends" are the Python package's implementations for tensors on a
// device (torch ops, Triton kernels: python/leanstep/backends/).
//
// The arguments and semantics are those of the area functions the built-in
// implementations call (grad.h, rmsnorm.h, moe.h). Reference and fast paths
// agree within the tolerances those areas document (an op without a fast path,
// such as moe.route, has its reference alone): bit-identical for moe;
// for rmsnorm and the grad norms within the bounds the conformance harness
// declares, the SIMD sums being ordered differently from the reference's one
// accumulator. Only plain data crosses these signatures (no std::vector,
// std::string, std::span or std::optional): TensorList and OptionalInt64 (and
// option structs of trivially copyable fields, such as moe::RoutingConfig).
#define LEANSTEP_OPS(X)                                                                                        \
  X(grad_norm, GradNormSig, "grad.norm",                                                                       \
    (const grad::PlanView& plan, const Tensor& out_norm, double norm_type = 2.0,                               \
     const Tensor* found_inf = nullptr, comm::Communicator* comm = nullptr, const dispatch::Context& ctx = {}), \
    (plan, out_norm, norm_type, found_inf, comm, ctx), "torch,triton")                                        \
  X(grad_unscale_norm, GradUnscaleNormSig, "grad.unscale_norm",                                                \
    (const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& out_norm, const Tensor& found_inf,     \
     double norm_type = 2.0, comm::Communicator* comm = nullptr, const dispatch::Context& ctx = {}),           \
    (plan, inv_scale, out_norm, found_inf, norm_type, comm, ctx), "torch,triton")                             \
  /* unscale_norm without the norm: the optimizer's unscale + found_inf (no norm is returned). */              \
  X(grad_unscale, GradUnscaleSig, "grad.unscale",                                                              \
    (const grad::PlanView& plan, const Tensor& inv_scale, const Tensor& found_inf,                             \
     const dispatch::Context& ctx = {}),                                                                       \
    (plan, inv_scale, found_inf, ctx), "torch,triton")                                                        \
  X(grad_clip, GradClipSig, "grad.clip",                                                                       \
    (const grad::PlanView& plan, const Tensor& total_norm, double max_norm, const Tensor* out_coeff = nullptr, \
     const dispatch::Context& ctx = {}),                                                                       \
    (plan, total_norm, max_norm, out_coeff, ctx), "torch,triton")                                             \
  X(grad_norm_clip, GradNormClipSig, "grad.norm_clip",                                                         \
    (const grad::PlanView& plan, double max_norm, const Tensor& out_norm, double norm_type = 2.0,              \
     const Tensor* found_inf = nullptr, const Tensor* out_coeff = nullptr, comm::Communicator* comm = nullptr, \
     const dispatch::Context& ctx = {}),                                                                       \
    (plan, max_norm, out_norm, norm_type, found_inf, out_coeff, comm, ctx), "torch,triton")                   \
  X(grad_scale, GradScaleSig, "grad.scale",                                                                    \
    (const grad::PlanView& plan, const Tensor& scale, const dispatch::Context& ctx = {}), (plan, scale, ctx),  \
    "torch,triton")                                                                                            \
  X(grad_count_zeros, GradCountZerosSig, "grad.count_zeros",                                                   \
    (const grad::PlanView& plan, const Tensor& out_count, comm::Communicator* comm = nullptr,                  \
     const dispatch::Context& ctx = {}),                                                                       \
    (plan, out_count, comm, ctx), "torch,triton")                                                             \
  X(grad_multi_tensor_scale, GradMultiTensorScaleSig, "grad.multi_tensor_scale",                               \
    (TensorList in, TensorList out, const Tensor& scale, const Tensor& found_inf,                              \
     const dispatch::Context& ctx = {}),                                                                       \
    (in, out, scale, found_inf, ctx), "torch,triton")                                                         \
  X(rmsnorm_forward, RmsnormForwardSig, "rmsnorm.forward",                                                     \
    (const Tensor& x, const Tensor& gamma, const Tensor& y, const Tensor& rstd,                                \
     const rmsnorm::Options& options = {}, const rmsnorm::CallContext& context = {},                          \
     const dispatch::Context& ctx = {}),                                                                       \
    (x, gamma, y, rstd, options, context, ctx), "torch,triton")                                               \
  /* dgamma is given exactly when context.weight_requires_grad (the slot checks it before any choice). */      \
  X(rmsnorm_backward, RmsnormBackwardSig, "rmsnorm.backward",                                                  \
    (const Tensor& dy, const Tensor& x, const Tensor& rstd, const Tensor& gamma, const Tensor& dx,             \
     const Tensor* dgamma, const rmsnorm::Options& options = {}, const rmsnorm::CallContext& context = {},     \
     const dispatch::Context& ctx = {}),                                                                       \
    (dy, x, rstd, gamma, dx, dgamma, options, context, ctx), "torch,triton")                                  \
  X(moe_permute, MoePermuteSig, "moe.permute",                                                                 \
    (const Tensor& tokens, const Tensor& routing_map, const Tensor* probs, OptionalInt64 num_out_tokens,       \
     bool drop_and_pad, const Tensor& permuted, const Tensor* permuted_probs, const Tensor& sorted_indices,    \
     const dispatch::Context& ctx = {}),                                                                       \
    (tokens, routing_map, probs, num_out_tokens, drop_and_pad, permuted, permuted_probs, sorted_indices, ctx), \
    "torch,triton")                                                                                            \
  X(moe_unpermute, MoeUnpermuteSig, "moe.unpermute",                                                           \
    (const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out, const Tensor* probs = nullptr,   \
     const Tensor* routing_map = nullptr, bool drop_and_pad = false, const dispatch::Context& ctx = {}),       \
    (permuted, sorted_indices, out, probs, routing_map, drop_and_pad, ctx), "torch,triton")                   \
  X(moe_permute_backward, MoePermuteBackwardSig, "moe.permute_backward",                                       \
    (const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens,                             \
     const dispatch::Context& ctx = {}),                                                                       \
    (dpermuted, sorted_indices, dtokens, ctx), "torch,triton")                                                \
  X(moe_unpermute_backward, MoeUnpermuteBackwardSig, "moe.unpermute_backward",                                 \
    (const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices, const Tensor* probs,            \
     const Tensor* routing_map, bool drop_and_pad, const Tensor& dpermuted, const Tensor* dprobs,              \
     const dispatch::Context& ctx = {}),                                                                       \
    (dout, permuted, sorted_indices, probs, routing_map, drop_and_pad, dpermuted, dprobs, ctx), "torch")       \
  X(moe_permute_probs_backward, MoePermuteProbsBackwardSig, "moe.permute_probs_backward",                      \
    (const Tensor& dpermuted_probs, const Tensor& sorted_indices, const Tensor& routing_map, bool drop_and_pad, \
     const Tensor& dprobs, const dispatch::Context& ctx = {}),                                                 \
    (dpermuted_probs, sorted_indices, routing_map, drop_and_pad, dprobs, ctx), "torch")                       \
  X(moe_pad_routing_map, MoePadRoutingMapSig, "moe.pad_routing_map",                                           \
    (const Tensor& routing_map, int64_t multiple, const Tensor& out, const dispatch::Context& ctx = {}),       \
    (routing_map, multiple, out, ctx), "torch")                                                               \
  X(moe_sort_chunks_by_idxs, MoeSortChunksByIdxsSig, "moe.sort_chunks_by_idxs",                                \
    (const Tensor& rows, const Tensor& split_sizes, const Tensor& sorted_idxs, const Tensor& out,              \
     const Tensor* probs = nullptr, const Tensor* out_probs = nullptr, const dispatch::Context& ctx = {}),     \
    (rows, split_sizes, sorted_idxs, out, probs, out_probs, ctx), "torch")                                    \
  /* RoutingConfig's optional fields are std::optional of bool and double (trivially copyable). */            \
  X(moe_route, MoeRouteSig, "moe.route",                                                                       \
    (const Tensor& logits, const moe::RoutingConfig& config, const Tensor* expert_bias,                        \
     const Tensor& routing_map, const Tensor& probs, const Tensor& tokens_per_expert,                          \
     const dispatch::Context& ctx = {}),                                                                       \
    (logits, config, expert_bias, routing_map, probs, tokens_per_expert, ctx), "")

// The signature types: each op's parameter list is declared once, as a
// function in namespace `signatures` that is never defined; its type is the
// op's signature (default arguments are not part of a function type).
namespace signatures {
#define LEANSTEP_DECLARE_OP_SIGNATURE(slot, Sig, name, params, args, devices) void slot params;
LEANSTEP_OPS(LEANSTEP_DECLARE_OP_SIGNATURE)
#undef LEANSTEP_DECLARE_OP_SIGNATURE
}  // namespace signatures

// The typed slots, for installing implementations with compile-time checked
// signatures (e.g. `ops::grad_norm_op().install("mine", &my_norm)`), and the
// entry points, which call through them.
#define LEANSTEP_DECLARE_OP(slot, Sig, name, params, args, devices) \
  using Sig = decltype(signatures::slot);                          \
  dispatch::Op<Sig>& slot##_op();                                  \
  inline void slot params { slot##_op() args; }
LEANSTEP_OPS(LEANSTEP_DECLARE_OP)
#undef LEANSTEP_DECLARE_OP

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

}  // namespace leanstep::ops
