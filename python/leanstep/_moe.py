"""MoE token permutation (see docs/moe.md for the semantics).

Permuted order is expert-major and, within one expert, increasing token index
(Megatron-Core's masked_select / stable-argsort order). ``sorted_indices[i]``
is the source token of permuted row i (-1: a padding row with no source).
``method="fused"`` is the parallel counting-sort path; ``method="sort"`` the
reference (stable sort of fp32 keys); both give bit-identical results.
"""

from . import _leanstep
from ._arrays import dtype_name, empty, opt_view, result, view

__all__ = [
    "moe_permute",
    "moe_unpermute",
    "moe_permute_backward",
    "moe_permute_probs_backward",
    "moe_unpermute_backward",
    "moe_route",
    "moe_expert_capacity",
    "pad_routing_map",
    "sort_chunks_by_idxs",
]

moe_expert_capacity = _leanstep.moe_expert_capacity


def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False,
                method="fused"):
    """Returns ``(permuted, permuted_probs, sorted_indices)``. permuted is
    ``[N, H]`` in tokens' dtype, permuted_probs ``[N]`` in probs' dtype (None
    without probs), sorted_indices int64 ``[N]``. N is the routed count, or
    ``num_out_tokens`` (extra rows are zero with index -1; fewer than routed is
    an error); with ``drop_and_pad`` N = num_out_tokens = E * capacity."""
    tokens, routing_map, probs = view(tokens), view(routing_map), opt_view(probs)
    if num_out_tokens is not None:
        num_out_tokens = int(num_out_tokens)
    rows = _leanstep.moe_permute_output_rows(routing_map, num_out_tokens, drop_and_pad)
    permuted = empty((rows,) + tuple(tokens.shape[1:]), dtype_name(tokens), tokens)
    permuted_probs = None if probs is None else empty((rows,), dtype_name(probs), tokens)
    sorted_indices = empty((rows,), "int64", tokens)
    _leanstep.moe_permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad, method,
                          permuted, permuted_probs, sorted_indices)
    return permuted, permuted_probs, sorted_indices


def moe_unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
                  drop_and_pad=False, method="fused", *, out=None):
    """``out[t] = sum over slots i with sorted_indices[i] == t of permuted[i] * prob_i``,
    accumulated in fp32 in increasing i and cast once to permuted's dtype.
    probs is ``[N]`` (permuted probs) or ``[T, E]`` together with routing_map
    (Megatron-Core's form)."""
    permuted, sorted_indices = view(permuted), view(sorted_indices)
    probs, routing_map = opt_view(probs), opt_view(routing_map)
    out = result(tuple(restore_shape), dtype_name(permuted), permuted, out, "moe_unpermute", "out")
    _leanstep.moe_unpermute(permuted, sorted_indices, out, probs, routing_map, drop_and_pad, method)
    return out


def moe_permute_backward(dpermuted, sorted_indices, num_tokens, method="fused"):
    """Gradient of permute w.r.t. tokens: ``[num_tokens, H]`` in dpermuted's dtype."""
    dpermuted, sorted_indices = view(dpermuted), view(sorted_indices)
    dtokens = empty((num_tokens, dpermuted.shape[-1]), dtype_name(dpermuted), dpermuted)
    _leanstep.moe_permute_backward(dpermuted, sorted_indices, dtokens, method)
    return dtokens


def moe_permute_probs_backward(dpermuted_probs, sorted_indices, routing_map, drop_and_pad=False):
    """Gradient of permute w.r.t. probs: ``[T, E]``, zero except at the slots'
    (token, expert) entries."""
    dpermuted_probs, sorted_indices = view(dpermuted_probs), view(sorted_indices)
    routing_map = view(routing_map)
    dprobs = empty(tuple(routing_map.shape), dtype_name(dpermuted_probs), dpermuted_probs)
    _leanstep.moe_permute_probs_backward(dpermuted_probs, sorted_indices, routing_map,
                                         drop_and_pad, dprobs)
    return dprobs


def moe_unpermute_backward(dout, permuted, sorted_indices, probs=None, routing_map=None,
                           drop_and_pad=False, method="fused"):
    """Returns ``(dpermuted, dprobs)``; dprobs is None without probs and shaped
    like probs otherwise."""
    dout, permuted, sorted_indices = view(dout), view(permuted), view(sorted_indices)
    probs, routing_map = opt_view(probs), opt_view(routing_map)
    dpermuted = empty(tuple(permuted.shape), dtype_name(permuted), permuted)
    dprobs = None if probs is None else empty(tuple(probs.shape), dtype_name(probs), probs)
    _leanstep.moe_unpermute_backward(dout, permuted, sorted_indices, probs, routing_map,
                                     drop_and_pad, method, dpermuted, dprobs)
    return dpermuted, dprobs


def moe_route(logits, topk, score_function="softmax", pre_softmax=False, normalize=None,
              scaling_factor=None, capacity_factor=None, drop_policy="probs",
              pad_to_capacity=False, expert_bias=None):
    """Top-k routing with optional capacity. Returns ``(routing_map, probs,
    tokens_per_expert)``: bool ``[T, E]``, fp32 ``[T, E]`` (0 where not routed),
    int64 ``[E]`` (counted before capacity dropping)."""
    logits, expert_bias = view(logits), opt_view(expert_bias)
    num_tokens, num_experts = (int(s) for s in logits.shape)
    routing_map = empty((num_tokens, num_experts), "bool", logits)
    probs = empty((num_tokens, num_experts), "float32", logits)
    tokens_per_expert = empty((num_experts,), "int64", logits)
    _leanstep.moe_route(logits, int(topk), score_function, pre_softmax, normalize,
                        scaling_factor, capacity_factor, drop_policy, pad_to_capacity,
                        expert_bias, routing_map=routing_map, probs=probs,
                        tokens_per_expert=tokens_per_expert)
    return routing_map, probs, tokens_per_expert


def pad_routing_map(routing_map, multiple, *, out=None):
    """Returns a NEW map in which each expert's routed count is padded up to a
    multiple of ``multiple`` by switching on its first unrouted tokens in token
    order (an expert with too few unrouted tokens stays short). The caller's map
    is not mutated unless ``out=routing_map`` is passed (unlike Megatron-Core's
    pad_routing_map, which mutates its argument through a transposed view)."""
    routing_map = view(routing_map)
    out = result(tuple(routing_map.shape), dtype_name(routing_map), routing_map, out,
                 "pad_routing_map", "out")
    _leanstep.moe_pad_routing_map(routing_map, int(multiple), out)
    return out


def sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs=None):
    """Splits rows into consecutive chunks of ``split_sizes`` and concatenates
    them in the order ``sorted_idxs``; rows beyond ``sum(split_sizes)`` keep
    their place. Returns ``(output, permuted_probs)`` (None without probs)."""
    rows, split_sizes, sorted_idxs, probs = (view(rows), view(split_sizes), view(sorted_idxs),
                                             opt_view(probs))
    out = empty(tuple(rows.shape), dtype_name(rows), rows)
    out_probs = None if probs is None else empty(tuple(probs.shape), dtype_name(probs), probs)
    _leanstep.moe_sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, out, probs, out_probs)
    return out, out_probs
