// MoE ops. Permutation: the "sort" method is the reference, "fused" the fast
// path. Routing, routing-map padding, chunk sorting and the probs gradient of
// permute have one implementation each (single passes with nothing to fuse):
// their reference, in the table so that the preset, the counts and the
// report cover them like every other op.
#include "dispatch/builtin.h"

namespace leanstep::ops {
namespace {

template <moe::Method kMethod>
void permute(const Tensor& tokens, const Tensor& routing_map, const Tensor* probs,
             OptionalInt64 num_out_tokens, bool drop_and_pad, const Tensor& permuted,
             const Tensor* permuted_probs, const Tensor& sorted_indices, const dispatch::Context&) {
  moe::permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad, kMethod, permuted, permuted_probs,
               sorted_indices);
}
template <moe::Method kMethod>
void unpermute(const Tensor& permuted, const Tensor& sorted_indices, const Tensor& out, const Tensor* probs,
               const Tensor* routing_map, bool drop_and_pad, const dispatch::Context&) {
  moe::unpermute(permuted, sorted_indices, out, probs, routing_map, drop_and_pad, kMethod);
}
template <moe::Method kMethod>
void permute_backward(const Tensor& dpermuted, const Tensor& sorted_indices, const Tensor& dtokens,
                      const dispatch::Context&) {
  moe::permute_backward(dpermuted, sorted_indices, dtokens, kMethod);
}
template <moe::Method kMethod>
void unpermute_backward(const Tensor& dout, const Tensor& permuted, const Tensor& sorted_indices,
                        const Tensor* probs, const Tensor* routing_map, bool drop_and_pad, const Tensor& dpermuted,
                        const Tensor* dprobs, const dispatch::Context&) {
  moe::unpermute_backward(dout, permuted, sorted_indices, probs, routing_map, drop_and_pad, kMethod, dpermuted,
                          dprobs);
}

void permute_probs_backward(const Tensor& dpermuted_probs, const Tensor& sorted_indices, const Tensor& routing_map,
                            bool drop_and_pad, const Tensor& dprobs, const dispatch::Context&) {
  moe::permute_probs_backward(dpermuted_probs, sorted_indices, routing_map, drop_and_pad, dprobs);
}
void pad_routing_map(const Tensor& routing_map, int64_t multiple, const Tensor& out, const dispatch::Context&) {
  moe::pad_routing_map(routing_map, multiple, out);
}
void sort_chunks_by_idxs(const Tensor& rows, const Tensor& split_sizes, const Tensor& sorted_idxs, const Tensor& out,
                         const Tensor* probs, const Tensor* out_probs, const dispatch::Context&) {
  moe::sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, out, probs, out_probs);
}
void route(const Tensor& logits, const moe::RoutingConfig& config, const Tensor* expert_bias,
           const Tensor& routing_map, const Tensor& probs, const Tensor& tokens_per_expert, const dispatch::Context&) {
  moe::route(logits, config, expert_bias, routing_map, probs, tokens_per_expert);
}

// The fused method handles every input the sort method does (bit-identical
// outputs), so it has no guard.
template <class Sig>
dispatch::Op<Sig>* make_op(const char* name, typename dispatch::Op<Sig>::Fn sort,
                           typename dispatch::Op<Sig>::Fn fused) {
  auto* op = new dispatch::Op<Sig>(name, "sort", sort);
  op->install("fused", fused, "", "built-in");
  return op;
}

}  // namespace

namespace builtin {

dispatch::Op<MoePermuteSig>* moe_permute(const char* name) {
  return make_op<MoePermuteSig>(name, &permute<moe::Method::kSort>, &permute<moe::Method::kFused>);
}
dispatch::Op<MoeUnpermuteSig>* moe_unpermute(const char* name) {
  return make_op<MoeUnpermuteSig>(name, &unpermute<moe::Method::kSort>, &unpermute<moe::Method::kFused>);
}
dispatch::Op<MoePermuteBackwardSig>* moe_permute_backward(const char* name) {
  return make_op<MoePermuteBackwardSig>(name, &permute_backward<moe::Method::kSort>,
                                        &permute_backward<moe::Method::kFused>);
}
dispatch::Op<MoeUnpermuteBackwardSig>* moe_unpermute_backward(const char* name) {
  return make_op<MoeUnpermuteBackwardSig>(name, &unpermute_backward<moe::Method::kSort>,
                                          &unpermute_backward<moe::Method::kFused>);
}

dispatch::Op<MoePermuteProbsBackwardSig>* moe_permute_probs_backward(const char* name) {
  return new dispatch::Op<MoePermuteProbsBackwardSig>(name, "reference", &permute_probs_backward);
}
dispatch::Op<MoePadRoutingMapSig>* moe_pad_routing_map(const char* name) {
  return new dispatch::Op<MoePadRoutingMapSig>(name, "reference", &pad_routing_map);
}
dispatch::Op<MoeSortChunksByIdxsSig>* moe_sort_chunks_by_idxs(const char* name) {
  return new dispatch::Op<MoeSortChunksByIdxsSig>(name, "reference", &sort_chunks_by_idxs);
}
dispatch::Op<MoeRouteSig>* moe_route(const char* name) {
  return new dispatch::Op<MoeRouteSig>(name, "reference", &route);
}

}  // namespace builtin
}  // namespace leanstep::ops
