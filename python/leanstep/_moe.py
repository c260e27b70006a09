"""MoE token permutation (see docs/moe.md for the semantics).

Permuted order is expert-major and, within one expert, increasing token index
(Megatron-Core's masked_select / stable-argsort order). ``sorted_indices[i]``
is the source token of permuted row i (-1: a padding row with no source).
``method=None`` (default) lets the dispatch registry choose (the preset:
"fused" normally, the "sort" reference under "baseline"); ``method="fused"``
forces the parallel counting-sort path and ``method="sort"`` the reference
(stable sort of fp32 keys); all give bit-identical results.

``backend``: None chooses from the tensors' device (CPU tensors and NumPy
arrays: the C++ kernels; any other torch device: the torch-op backend in
:mod:`leanstep.backends.torch_moe`, which reads no device value on the host
except the routed count of a permute without ``num_out_tokens``; on cuda,
xpu and npu, permute, unpermute and permute's backward run the Triton
kernels of :mod:`leanstep.backends.triton_moe` where Triton works); "torch"
forces the torch-op backend on CPU tensors, "triton" the Triton kernels
(CPU tensors: under TRITON_INTERPRET=1, tests).
"""

from . import _leanstep, _registry
from ._arrays import dtype_name, empty, is_torch, native, opt_view, result, view
from ._leanstep import Error
from ._rules import host_count, host_int, restore_rows

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


def _route(op, tensors, names, backend, where):
    """What runs one call (the registry chooses, counts and explains): a
    Route whose module is the device backend's (None: the C++ kernels)."""
    return _registry.route(op, tensors, names, backend, where)


def _cpu_method(method):
    """None: the dispatch registry chooses (preset, guards, counted in
    leanstep.paths()); "sort" / "fused" force one (tests, benchmarks)."""
    return "auto" if method is None else method


def _check_method(method, where):
    """The device backend has one unpermute; the method is still checked."""
    if method not in (None, "sort", "fused"):
        raise Error(f'{where}: argument \'method\' must be None, "sort" or "fused" '
                    f'(got {method!r})')


def _into(out, value, op):
    """`value` written into the caller's `out` (device path), checked first."""
    if out is None:
        return value
    if not is_torch(out) or out.shape != value.shape or out.dtype != value.dtype \
            or out.device != value.device:
        got = (f"{out.dtype}{list(out.shape)} on {out.device}" if is_torch(out)
               else type(out).__name__)
        raise Error(f"{op}: argument 'out' must be {value.dtype}{list(value.shape)} on "
                    f"{value.device} (got {got})")
    return out.copy_(value)


def moe_permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False,
                method=None, *, backend=None):
    """Returns ``(permuted, permuted_probs, sorted_indices)``. permuted is
    ``[N, H]`` in tokens' dtype, permuted_probs ``[N]`` in probs' dtype (None
    without probs), sorted_indices int64 ``[N]``. N is the routed count, or
    ``num_out_tokens`` (extra rows are zero with index -1; fewer than routed is
    an error); with ``drop_and_pad`` N = num_out_tokens = E * capacity."""
    tokens, routing_map, probs = view(tokens), view(routing_map), opt_view(probs)
    route = _route("moe.permute", [tokens, routing_map, probs],
                   ["tokens", "routing_map", "probs"], backend, "moe_permute")
    if route.module is not None:
        return route.module.permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad,
                                    (method or "fused"))
    if num_out_tokens is not None:
        num_out_tokens = host_int(num_out_tokens, "permute", "num_out_tokens")
    rows = native.moe_permute_output_rows(routing_map, num_out_tokens, drop_and_pad)
    permuted = empty((rows,) + tuple(tokens.shape[1:]), dtype_name(tokens), tokens)
    permuted_probs = None if probs is None else empty((rows,), dtype_name(probs), tokens)
    sorted_indices = empty((rows,), "int64", tokens)
    native.moe_permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad,
                       _cpu_method(method), permuted, permuted_probs, sorted_indices)
    return permuted, permuted_probs, sorted_indices


def moe_unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
                  drop_and_pad=False, method=None, *, out=None, backend=None):
    """``out[t] = sum over slots i with sorted_indices[i] == t of permuted[i] * prob_i``,
    accumulated in fp32 in increasing i and cast once to permuted's dtype.
    probs is ``[N]`` (permuted probs) or ``[T, E]`` together with routing_map
    (Megatron-Core's form)."""
    permuted, sorted_indices = view(permuted), view(sorted_indices)
    probs, routing_map = opt_view(probs), opt_view(routing_map)
    route = _route("moe.unpermute", [permuted, sorted_indices, probs, routing_map, out],
                   ["permuted", "sorted_indices", "probs", "routing_map", "out"], backend,
                   "moe_unpermute")
    if route.module is not None:
        _check_method(method, "unpermute")
        return _into(out, route.module.unpermute(permuted, sorted_indices, restore_shape, probs,
                                                 routing_map, drop_and_pad), "moe_unpermute")
    hidden = permuted.shape[1] if len(permuted.shape) == 2 else None
    shape = (tuple(restore_shape) if hidden is None  # the C++ check names permuted's rank
             else (restore_rows(restore_shape, "unpermute", hidden), hidden))
    out = result(shape, dtype_name(permuted), permuted, out, "moe_unpermute", "out")
    native.moe_unpermute(permuted, sorted_indices, out, probs, routing_map, drop_and_pad,
                         _cpu_method(method))
    return out


def moe_permute_backward(dpermuted, sorted_indices, num_tokens, method=None, *, backend=None):
    """Gradient of permute w.r.t. tokens: ``[num_tokens, H]`` in dpermuted's dtype."""
    dpermuted, sorted_indices = view(dpermuted), view(sorted_indices)
    route = _route("moe.permute_backward", [dpermuted, sorted_indices],
                   ["dpermuted", "sorted_indices"], backend, "moe_permute_backward")
    if route.module is not None:
        _check_method(method, "permute_backward")
        return route.module.permute_backward(dpermuted, sorted_indices, num_tokens)
    num_tokens = host_count(num_tokens, "permute_backward", "num_tokens")
    dtokens = empty((num_tokens, dpermuted.shape[-1]), dtype_name(dpermuted), dpermuted)
    native.moe_permute_backward(dpermuted, sorted_indices, dtokens, _cpu_method(method))
    return dtokens


def moe_permute_probs_backward(dpermuted_probs, sorted_indices, routing_map, drop_and_pad=False,
                               *, backend=None):
    """Gradient of permute w.r.t. probs: ``[T, E]``, zero except at the slots'
    (token, expert) entries."""
    dpermuted_probs, sorted_indices = view(dpermuted_probs), view(sorted_indices)
    routing_map = view(routing_map)
    route = _route("moe.permute_probs_backward", [dpermuted_probs, sorted_indices, routing_map],
                   ["dpermuted_probs", "sorted_indices", "routing_map"], backend,
                   "moe_permute_probs_backward")
    if route.module is not None:
        return route.module.permute_probs_backward(dpermuted_probs, sorted_indices, routing_map,
                                                   drop_and_pad)
    dprobs = empty(tuple(routing_map.shape), dtype_name(dpermuted_probs), dpermuted_probs)
    native.moe_permute_probs_backward(dpermuted_probs, sorted_indices, routing_map,
                                      drop_and_pad, dprobs)
    return dprobs


def moe_unpermute_backward(dout, permuted, sorted_indices, probs=None, routing_map=None,
                           drop_and_pad=False, method=None, *, backend=None):
    """Returns ``(dpermuted, dprobs)``; dprobs is None without probs and shaped
    like probs otherwise."""
    dout, permuted, sorted_indices = view(dout), view(permuted), view(sorted_indices)
    probs, routing_map = opt_view(probs), opt_view(routing_map)
    route = _route("moe.unpermute_backward", [dout, permuted, sorted_indices, probs, routing_map],
                   ["dout", "permuted", "sorted_indices", "probs", "routing_map"], backend,
                   "moe_unpermute_backward")
    if route.module is not None:
        _check_method(method, "unpermute_backward")
        return route.module.unpermute_backward(dout, permuted, sorted_indices, probs, routing_map,
                                               drop_and_pad)
    dpermuted = empty(tuple(permuted.shape), dtype_name(permuted), permuted)
    dprobs = None if probs is None else empty(tuple(probs.shape), dtype_name(probs), probs)
    native.moe_unpermute_backward(dout, permuted, sorted_indices, probs, routing_map,
                                  drop_and_pad, _cpu_method(method), dpermuted, dprobs)
    return dpermuted, dprobs


def moe_route(logits, topk, score_function="softmax", pre_softmax=False, normalize=None,
              scaling_factor=None, capacity_factor=None, drop_policy="probs",
              pad_to_capacity=False, expert_bias=None, *, backend=None):
    """Top-k routing with optional capacity. Returns ``(routing_map, probs,
    tokens_per_expert)``: bool ``[T, E]``, fp32 ``[T, E]`` (0 where not routed),
    int64 ``[E]`` (counted before capacity dropping). CPU only: there is no
    torch-op routing yet, so device tensors (or backend="torch") are an error."""
    logits, expert_bias = view(logits), opt_view(expert_bias)
    chosen, _ = _registry.choose("moe.route", [logits, expert_bias], ["logits", "expert_bias"],
                                 backend, "moe_route")
    if chosen != "cpu":
        device = logits.device if is_torch(logits) else "cpu"
        raise Error(f"moe_route: argument 'logits' must be a CPU tensor: routing has no torch-op "
                    f"backend (got logits on {device}, backend={backend!r})")
    _registry.record("moe.route", "cpu", "cpu", "CPU tensors")
    num_tokens, num_experts = (int(s) for s in logits.shape)
    routing_map = empty((num_tokens, num_experts), "bool", logits)
    probs = empty((num_tokens, num_experts), "float32", logits)
    tokens_per_expert = empty((num_experts,), "int64", logits)
    native.moe_route(logits, int(topk), score_function, pre_softmax, normalize,
                     scaling_factor, capacity_factor, drop_policy, pad_to_capacity,
                     expert_bias, routing_map=routing_map, probs=probs,
                     tokens_per_expert=tokens_per_expert)
    return routing_map, probs, tokens_per_expert


def pad_routing_map(routing_map, multiple, *, out=None, backend=None):
    """Returns a NEW map in which each expert's routed count is padded up to a
    multiple of ``multiple`` by switching on its first unrouted tokens in token
    order (an expert with too few unrouted tokens stays short). The caller's map
    is not mutated unless ``out=routing_map`` is passed (unlike Megatron-Core's
    pad_routing_map, which mutates its argument through a transposed view)."""
    routing_map = view(routing_map)
    route = _route("moe.pad_routing_map", [routing_map, out], ["routing_map", "out"], backend,
                   "pad_routing_map")
    if route.module is not None:
        return route.module.pad_routing_map(routing_map, multiple, out)
    out = result(tuple(routing_map.shape), dtype_name(routing_map), routing_map, out,
                 "pad_routing_map", "out")
    native.moe_pad_routing_map(routing_map, host_int(multiple, "pad_routing_map", "multiple"), out)
    return out


def sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs=None, *, backend=None):
    """Splits rows into consecutive chunks of ``split_sizes`` and concatenates
    them in the order ``sorted_idxs``; rows beyond ``sum(split_sizes)`` keep
    their place. Returns ``(output, permuted_probs)`` (None without probs).
    On a device, split_sizes and sorted_idxs are device tensors too."""
    rows, split_sizes, sorted_idxs, probs = (view(rows), view(split_sizes), view(sorted_idxs),
                                             opt_view(probs))
    route = _route("moe.sort_chunks_by_idxs", [rows, split_sizes, sorted_idxs, probs],
                   ["rows", "split_sizes", "sorted_idxs", "probs"], backend, "sort_chunks_by_idxs")
    if route.module is not None:
        return route.module.sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs)
    out = empty(tuple(rows.shape), dtype_name(rows), rows)
    out_probs = None if probs is None else empty(tuple(probs.shape), dtype_name(probs), probs)
    native.moe_sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, out, probs, out_probs)
    return out, out_probs

