"""MoE token permutation in PyTorch ops, for tensors on any torch device.

Same semantics and argument order as :mod:`leanstep._moe` (docs/moe.md):
expert-major output, increasing token within an expert; rows beyond the
routed pairs are zero with index -1; unpermute accumulates in fp32 in
increasing slot order and casts once.

No function reads a device value on the host. The one exception is
:func:`permute` without ``num_out_tokens``: the routed count is then the
output's row count, a shape, and costs one synchronisation. Every other
shape comes from shapes and host ints. Rules on values that the CPU path
checks before writing (``num_out_tokens`` >= routed pairs, index ranges,
split sizes, permutations) are checked with ``torch._assert_async``: on
CPU tensors it raises ``RuntimeError`` at once; on an accelerator the error
surfaces asynchronously, at a later synchronisation.

Permute layout: every output row is described by a *code*, the position of
its (token, expert) pair in the transposed routing map, padded with one
unrouted column per expert ([E, T + 1], flattened), or -1 for a row with no
source. Both methods compute the same codes; one gather stage turns them
into outputs: ``fmod(code, T + 1)`` is the token (-1 stays -1, fmod rounds
toward zero), the probs come from ``probs.t()`` with the same padding column
(code -1 reads its last, zero entry), and token rows from ``tokens`` with one
zero row appended (index -1 reads it). The appended row costs one copy of
``tokens``; zeroing the rows afterwards would cost a pass over the output,
which top-k routing makes k times larger.
"""

import torch
import torch.nn.functional as F

from .._rules import (check_method, check_moe_permute, check_moe_permute_probs_backward,
                      check_moe_unpermute, check_moe_unpermute_backward, check_pad_routing_map,
                      check_sort_chunks_by_idxs, host_count, host_int, restore_rows)


# ---------------------------------------------------------------- checks
# The rules on metadata and host arguments are the C++ kernels' (leanstep._rules
# check_moe_*, one copy for every backend); the rules on values run here, on the
# device (torch._assert_async).


def _assert_indices_in_range(sorted_indices, where, num_tokens):
    """sorted_indices in [-1, T), on the device (shape and dtype: the C++ rules)."""
    if sorted_indices.shape[0]:
        in_range = ((sorted_indices >= -1) & (sorted_indices < num_tokens)).all()
        torch._assert_async(in_range, f"{where}: argument 'sorted_indices' must hold token indices "
                                      f"in [-1, T={num_tokens})")


def _wide_dtype(device):
    """float64 for the float64 sums of the CPU path; MPS has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def output_rows(tokens, routing_map, probs, num_out_tokens, drop_and_pad, method, where="permute"):
    """permute's rules, then (rows, capacity): host ints; only
    num_out_tokens=None reads the device (the routed count is the row count)."""
    check_method(method, where)
    if num_out_tokens is not None:
        num_out_tokens = host_int(num_out_tokens, where, "num_out_tokens")
    check_moe_permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    if drop_and_pad:
        return num_out_tokens, num_out_tokens // routing_map.shape[1]
    if num_out_tokens is None:
        return int(routing_map.sum()), None  # the one host read here
    return num_out_tokens, None


def assert_rows_cover_routed(routed_fits, rows):
    torch._assert_async(routed_fits, f"permute: argument 'num_out_tokens' must be >= the number of "
                                     f"routed (token, expert) pairs (got {rows})")


# ---------------------------------------------------------------- permute


def _plain_codes_fused(routing_map, rows):
    """Codes by index arithmetic: the inclusive cumsum over the flattened
    [E, T + 1] mask is each routed pair's row + 1; the pairs scatter their
    position into a fixed-size array whose entry 0 is a dump slot for the
    unrouted ones, so no shape depends on the data."""
    num_tokens, num_experts = routing_map.shape
    mask = F.pad(routing_map.t(), (0, 1)).view(-1)
    routed_upto = mask.cumsum(0)
    # More routed pairs than rows put a slot past the end of `codes`: the
    # scatter's own bounds check rejects it (a device-side assertion on an
    # accelerator, an IndexError on the CPU), so no separate check runs.
    slot = routed_upto * mask
    codes = torch.full((rows + 1,), -1, dtype=torch.int64, device=routing_map.device)
    codes.index_put_((slot,), torch.arange(mask.numel(), device=routing_map.device))
    return codes[1:]


def _plain_codes_sort(routing_map, rows):
    """Codes by the reference order: a STABLE descending sort of the same
    mask as FP32 keys (FP32 holds 0 and 1 exactly; stability keeps
    increasing position among equal keys) puts the routed pairs first."""
    num_tokens, num_experts = routing_map.shape
    keys = F.pad(routing_map.t(), (0, 1)).view(-1).to(torch.float32)
    keys, order = torch.sort(keys, descending=True, stable=True)
    if rows < num_tokens * num_experts:
        # At most `rows` pairs are routed iff the key after the first `rows` is 0.
        assert_rows_cover_routed(keys[rows] == 0, rows)
    if rows <= keys.numel():
        keys, order = keys[:rows], order[:rows]
    else:
        keys, order = F.pad(keys, (0, rows - keys.numel())), F.pad(order, (0, rows - keys.numel()))
    return order.masked_fill(keys == 0, -1)


def _drop_and_pad_codes_fused(routing_map, capacity):
    """Codes e * T + t: per expert its routed tokens, then its unrouted ones,
    each in token order, the first `capacity` kept (the others go to the dump
    slot 0 of the scatter target)."""
    num_tokens, num_experts = routing_map.shape
    device = routing_map.device
    mask = routing_map.t()
    routed_upto = mask.cumsum(1)
    routed_count = routed_upto[:, -1:]
    token = torch.arange(num_tokens, device=device)
    rank = torch.where(mask, routed_upto - 1, routed_count + token - routed_upto)
    first_row = torch.arange(num_experts, device=device).unsqueeze(1) * capacity
    slot = torch.where(rank < capacity, first_row + rank + 1, 0)
    codes = torch.full((num_experts * capacity + 1,), -1, dtype=torch.int64, device=device)
    codes.index_put_((slot,), torch.arange(num_experts * num_tokens, device=device)
                     .view(num_experts, num_tokens))
    return codes[1:]


def _drop_and_pad_codes_sort(routing_map, capacity):
    num_tokens, num_experts = routing_map.shape
    keys = routing_map.t().to(torch.float32)
    kept = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :capacity]
    first_code = torch.arange(num_experts, device=routing_map.device).unsqueeze(1) * num_tokens
    return (kept + first_code).reshape(-1)


def _gather(tokens, probs, codes, width, may_lack_source):
    sorted_indices = torch.fmod(codes, width)
    if may_lack_source:  # code -1: the appended zero row / zero column
        permuted = F.pad(tokens, (0, 0, 0, 1))[sorted_indices]
        permuted_probs = None if probs is None else F.pad(probs.t(), (0, 1)).take(codes)
    else:
        permuted = tokens.index_select(0, sorted_indices)
        permuted_probs = None if probs is None else probs.t().take(codes)
    return permuted, permuted_probs, sorted_indices


def permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False,
            method="fused"):
    """``(permuted, permuted_probs, sorted_indices)`` as :func:`leanstep.moe_permute`.

    Host reads: none when ``num_out_tokens`` is given; without it, one (the
    routed count is the output's row count). ``num_out_tokens`` smaller than
    the routed count is reported by ``torch._assert_async`` (asynchronously
    on an accelerator)."""
    rows, capacity = output_rows(tokens, routing_map, probs, num_out_tokens, drop_and_pad, method)
    num_tokens = routing_map.shape[0]
    device = tokens.device
    if num_tokens == 0:  # nothing routed: every row has no source
        permuted = torch.zeros((rows, tokens.shape[1]), dtype=tokens.dtype, device=device)
        permuted_probs = None if probs is None else torch.zeros(rows, dtype=probs.dtype,
                                                                device=device)
        return permuted, permuted_probs, torch.full((rows,), -1, dtype=torch.int64, device=device)
    if drop_and_pad:
        codes = (_drop_and_pad_codes_sort if method == "sort"
                 else _drop_and_pad_codes_fused)(routing_map, capacity)
        return _gather(tokens, probs, codes, num_tokens, may_lack_source=False)
    codes = (_plain_codes_sort if method == "sort" else _plain_codes_fused)(routing_map, rows)
    return _gather(tokens, probs, codes, num_tokens + 1, may_lack_source=True)


# ---------------------------------------------------------------- unpermute and backward


def _slot_experts(where, sorted_indices, rows, routing_map, drop_and_pad):
    """Expert of every slot: i // capacity (drop_and_pad), else from the map's
    per-expert counts; slots beyond the routed pairs get E (a zero column of
    the padded probs). The rules on metadata are checked already."""
    num_experts = routing_map.shape[1]
    device = sorted_indices.device
    slots = torch.arange(rows, device=device)
    if drop_and_pad:
        return slots // max(rows // num_experts, 1)
    ends = routing_map.sum(0).cumsum(0)
    torch._assert_async(ends[-1] <= rows, f"{where}: argument 'sorted_indices' must have at least "
                                          f"one entry per routed pair of routing_map (got {rows})")
    experts = torch.searchsorted(ends, slots, right=True)
    torch._assert_async(((experts < num_experts) | (sorted_indices == -1)).all(),
                        f"{where}: argument 'sorted_indices' must be -1 beyond the routed pairs "
                        f"of routing_map")
    return experts


def slot_probs(where, sorted_indices, rows, num_tokens, probs, routing_map, drop_and_pad):
    """(fp32 prob of every slot, expert of every slot): [N] probs give no
    experts; [T, E] probs with routing_map give prob 0 to slots with no
    source. (None, None) without probs."""
    if probs is None:
        return None, None
    if routing_map is None:
        return probs.float(), None
    experts = _slot_experts(where, sorted_indices, rows, routing_map, drop_and_pad)
    # Token -1 reads the appended zero row, expert E the appended zero column.
    return F.pad(probs, (0, 1, 0, 1))[sorted_indices.long(), experts].float(), experts


def _scatter_add(rows_in, sorted_indices, num_tokens, weights):
    """out[t] = sum over slots i of t, in increasing i, of float(rows_in[i]) *
    weight_i, in fp32 from +0, cast once; slots of -1 go to a dump row.

    On CPU, index_add_ adds the source rows one after the other in index
    order, the order of the C++ path: the tests compare the bits. On CUDA
    torch lists index_add_ as nondeterministic (atomic adds) unless
    torch.use_deterministic_algorithms(True) is set, so the summation order,
    and with it the last bits, may change between runs there; that path has
    not been compared with the C++ one."""
    contributions = rows_in.float()
    if weights is not None:
        contributions = contributions * weights.unsqueeze(1)
    dest = torch.where(sorted_indices < 0, num_tokens, sorted_indices)
    acc = torch.zeros((num_tokens + 1, rows_in.shape[1]), dtype=torch.float32,
                      device=rows_in.device)
    acc.index_add_(0, dest, contributions)
    return acc[:num_tokens].to(rows_in.dtype)


def unpermute_rows(permuted, sorted_indices, restore_shape, probs, routing_map, drop_and_pad):
    """unpermute's rules (the values' on the device); returns T."""
    where = "unpermute"
    num_tokens = (restore_rows(restore_shape, where, permuted.shape[1]) if permuted.dim() == 2
                  else 0)
    check_moe_unpermute(permuted, sorted_indices, num_tokens, probs, routing_map, drop_and_pad)
    _assert_indices_in_range(sorted_indices, where, num_tokens)
    return num_tokens


def unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
              drop_and_pad=False):
    """As :func:`leanstep.moe_unpermute`: ``[T, H]`` in permuted's dtype."""
    where = "unpermute"
    num_tokens = unpermute_rows(permuted, sorted_indices, restore_shape, probs, routing_map,
                                drop_and_pad)
    rows = permuted.shape[0]
    weights, _ = slot_probs(where, sorted_indices, rows, num_tokens, probs, routing_map,
                             drop_and_pad)
    return _scatter_add(permuted, sorted_indices, num_tokens, weights)


def permute_backward(dpermuted, sorted_indices, num_tokens):
    """Gradient of permute w.r.t. tokens (unpermute without probs)."""
    where = "permute_backward"
    num_tokens = host_count(num_tokens, where, "num_tokens")
    check_moe_unpermute(dpermuted, sorted_indices, num_tokens, None, None, False, where)
    _assert_indices_in_range(sorted_indices, where, num_tokens)
    return _scatter_add(dpermuted, sorted_indices, num_tokens, None)


def _scatter_to_map(values, sorted_indices, experts, num_tokens, num_experts, dtype):
    """[T, E] zeros with values[i] added at (token_i, expert_i), summed in the
    wide dtype and cast once; token -1 and expert E land in a dump row/column."""
    wide = _wide_dtype(values.device)
    acc = torch.zeros((num_tokens + 1, num_experts + 1), dtype=wide, device=values.device)
    acc.index_put_((sorted_indices.long(), experts), values.to(wide), accumulate=True)
    return acc[:num_tokens, :num_experts].to(dtype).contiguous()


def permute_probs_backward(dpermuted_probs, sorted_indices, routing_map, drop_and_pad=False):
    """Gradient of permute w.r.t. probs: ``[T, E]`` in dpermuted_probs' dtype."""
    where = "permute_probs_backward"
    check_moe_permute_probs_backward(dpermuted_probs, sorted_indices, routing_map, drop_and_pad)
    num_tokens, num_experts = routing_map.shape
    rows = dpermuted_probs.shape[0]
    _assert_indices_in_range(sorted_indices, where, num_tokens)
    experts = _slot_experts(where, sorted_indices, rows, routing_map, drop_and_pad)
    return _scatter_to_map(dpermuted_probs, sorted_indices, experts, num_tokens, num_experts,
                           dpermuted_probs.dtype)


def unpermute_backward(dout, permuted, sorted_indices, probs=None, routing_map=None,
                       drop_and_pad=False):
    """``(dpermuted, dprobs)`` as :func:`leanstep.moe_unpermute_backward`:
    ``dpermuted[i] = cast(float(dout[t_i]) * prob_i)`` (zero rows for -1);
    ``dprob_i`` = the float64 dot product of ``dout[t_i]`` and
    ``permuted[i]``. The dot product is torch's float64 sum, not the CPU
    path's serial one: the two can differ in the last bit after the cast to
    probs' dtype (see the tests for the bound)."""
    where = "unpermute_backward"
    check_moe_unpermute_backward(dout, permuted, sorted_indices, probs, routing_map, drop_and_pad)
    rows = permuted.shape[0]
    num_tokens = dout.shape[0]
    _assert_indices_in_range(sorted_indices, where, num_tokens)
    weights, experts = slot_probs(where, sorted_indices, rows, num_tokens, probs, routing_map,
                                   drop_and_pad)
    token = sorted_indices.long()
    has_source = token >= 0
    dy = F.pad(dout, (0, 0, 0, 1))[token]  # token -1 reads the appended zero row
    if weights is None:
        return dy, None
    # Rows with no source are +0 whatever their prob (the CPU path writes zeros).
    weights = torch.where(has_source, weights, 0)
    dpermuted = (dy.float() * weights.unsqueeze(1)).to(permuted.dtype)
    wide = _wide_dtype(dout.device)
    dot = (dy.to(wide) * permuted.to(wide)).sum(1)
    dot = torch.where(has_source, dot, 0)
    if routing_map is None:
        return dpermuted, dot.to(probs.dtype)
    num_experts = routing_map.shape[1]
    return dpermuted, _scatter_to_map(dot, sorted_indices, experts, num_tokens, num_experts,
                                      probs.dtype)


# ---------------------------------------------------------------- padding and chunk sorting


def pad_routing_map(routing_map, multiple, out=None):
    """As :func:`leanstep.pad_routing_map`: a new map (or `out`, which may be
    routing_map itself) where each expert's count is padded up to a multiple
    of `multiple` by switching on its first unrouted tokens in token order."""
    multiple = host_int(multiple, "pad_routing_map", "multiple")
    check_pad_routing_map(routing_map, multiple, out)
    missing = torch.remainder(-routing_map.sum(0), multiple)
    unrouted = ~routing_map
    unrouted_upto = unrouted.cumsum(0)
    padded = routing_map | (unrouted & (unrouted_upto <= missing))
    if out is None:
        return padded
    # The whole map is computed before writing, so out may be (or overlap) the input.
    return out.copy_(padded)


def sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs=None):
    """As :func:`leanstep.sort_chunks_by_idxs`, with split sizes and order as
    device tensors: every output row's source row is found by index
    arithmetic (no host read): output chunk k = searchsorted of the output
    row in the cumulative output chunk sizes; source = row + (source start -
    output start) of that chunk; rows past the chunks map to themselves."""
    where = "sort_chunks_by_idxs"
    check_sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs)
    num_rows, num_chunks = rows.shape[0], split_sizes.shape[0]
    device = rows.device
    sizes = split_sizes.long()
    order = sorted_idxs.long()
    if num_chunks:
        # Each size is bounded first: the int64 sum of sizes near 2^62 would wrap
        # and pass a sum check alone (C sizes <= R sum to at most C * R, no wrap).
        in_range = (sizes >= 0).all() & (sizes <= num_rows).all()
        total = torch.where(in_range, sizes.sum(), torch.full_like(sizes[0], num_rows + 1))
        torch._assert_async(in_range & (total <= num_rows),
                            f"{where}: argument 'split_sizes' must be >= 0 and sum to at most the "
                            f"{num_rows} rows")
        is_permutation = (torch.sort(order).values == torch.arange(num_chunks, device=device)).all()
        torch._assert_async(is_permutation, f"{where}: argument 'sorted_idxs' must be a "
                                            f"permutation of 0..{num_chunks - 1}")
    source_end = sizes.cumsum(0)
    out_sizes = sizes[order]
    out_end = out_sizes.cumsum(0)
    # Per output chunk: source row - output row; one more entry (0) for the tail.
    shift = F.pad((source_end - sizes)[order] - (out_end - out_sizes), (0, 1))
    out_row = torch.arange(num_rows, device=device)
    source = out_row + shift[torch.searchsorted(out_end, out_row, right=True)]
    out = rows.index_select(0, source)
    out_probs = None if probs is None else probs.index_select(0, source)
    return out, out_probs
