"""MoE token permutation in Triton kernels (docs/moe.md for the semantics).

Same arguments, results and order as :mod:`leanstep.backends.torch_moe`:
expert-major output, increasing token within an expert (the counting-sort
order of the reference); rows beyond the routed pairs are zero with index
-1; with ``drop_and_pad`` every expert has ``capacity`` rows, its routed
tokens then its unrouted ones, each in token order.

permute, three launches, no host read when ``num_out_tokens`` is given:

1. ``_rank_kernel`` (one program per expert): an exclusive scan of the
   expert's column of the routing map: ``rank[e, t]`` = routed tokens of e
   before t, and ``count[e]``;
2. ``_scatter_kernel`` (experts x token blocks): every kept (token, expert)
   pair writes its token and prob at ``slot = offset[e] + rank`` (offset:
   the sum of the counts before e, computed by each program; with
   drop_and_pad ``e * capacity``, unrouted tokens after the routed ones);
3. ``_gather_kernel`` (persistent over slots): copies each slot's token row
   (bits, any dtype) and fills the rows past the routed count with zeros
   and index -1.

unpermute: ``out[t] = cast(sum over slots i of t, in increasing i, of
float(permuted[i]) * prob_i)`` from +0 in fp32, the CPU path's order and
roundings (the product is rounded before the add: the kernel is compiled
without FMA contraction), so the result has the C++ path's bits. The slots
of each token come from a stable sort of ``sorted_indices`` (torch ops, no
host read); one Triton launch then accumulates each token's rows.
"""

import torch
import triton
import triton.language as tl

from .._rules import check_moe_unpermute, host_count
from . import torch_moe as tm
from . import triton_common as tc
from .triton_common import bf16_bits_to_f32, f32_to_bf16_bits

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rank_kernel(routing_map, ranks, counts, T, E, BLOCK_T: tl.constexpr):
    e = tl.program_id(0)
    carry = tl.zeros([], tl.int32)
    for s in range(0, T, BLOCK_T):
        t = s + tl.arange(0, BLOCK_T)
        m = t < T
        routed = tl.load(routing_map + tl.cast(t, tl.int64) * E + e, mask=m, other=0)
        routed = (routed != 0).to(tl.int32)
        inclusive = tl.cumsum(routed, 0)
        tl.store(ranks + tl.cast(e, tl.int64) * T + t, carry + inclusive - routed, mask=m)
        carry += tl.sum(routed, 0)
    tl.store(counts + e, carry)


@triton.jit
def _scatter_kernel(routing_map, ranks, counts, probs, indices, permuted_probs, T, E, rows,
                    capacity, DROP_AND_PAD: tl.constexpr, HAS_PROBS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    e = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = t < T
    routed = tl.load(routing_map + tl.cast(t, tl.int64) * E + e, mask=m, other=0) != 0
    rank = tl.load(ranks + tl.cast(e, tl.int64) * T + t, mask=m, other=0)
    if DROP_AND_PAD:
        count = tl.load(counts + e)
        rank = tl.where(routed, rank, count + t - rank)  # unrouted tokens after the routed
        keep = m & (rank < capacity)
        slot = tl.cast(e, tl.int64) * capacity + rank
    else:
        experts = tl.arange(0, BLOCK_E)
        before = tl.load(counts + experts, mask=experts < e, other=0)
        keep = m & routed
        slot = tl.sum(before.to(tl.int64), 0) + rank
        keep = keep & (slot < rows)  # more routed pairs than rows: checked by the caller
    tl.store(indices + slot, t.to(tl.int64), mask=keep)
    if HAS_PROBS:
        p = tl.load(probs + tl.cast(t, tl.int64) * E + e, mask=keep, other=0)
        tl.store(permuted_probs + slot, p, mask=keep)


@triton.jit
def _gather_kernel(tokens, indices, permuted_probs, permuted, counts, rows, H, E,
                   DROP_AND_PAD: tl.constexpr, HAS_PROBS: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if DROP_AND_PAD:
        routed_total = rows
    else:
        experts = tl.arange(0, BLOCK_E)
        routed_total = tl.sum(tl.load(counts + experts, mask=experts < E, other=0).to(tl.int64), 0)
    cols = tl.arange(0, BLOCK_H)
    for slot in range(pid, rows, nprog):
        out = permuted + tl.cast(slot, tl.int64) * H
        if slot < routed_total:
            src = tokens + tl.load(indices + slot) * H
            for s in range(0, H, BLOCK_H):
                mh = s + cols < H
                tl.store(out + s + cols, tl.load(src + s + cols, mask=mh), mask=mh)
        else:
            tl.store(indices + slot, -1)
            if HAS_PROBS:
                tl.store(permuted_probs + slot, tl.zeros([], permuted_probs.dtype.element_ty))
            for s in range(0, H, BLOCK_H):
                mh = s + cols < H
                tl.store(out + s + cols, tl.zeros([BLOCK_H], permuted.dtype.element_ty), mask=mh)


@triton.jit
def _load_f32(p, mask, CODE: tl.constexpr):
    if CODE == 2:
        v = bf16_bits_to_f32(tl.load(p.to(tl.pointer_type(tl.uint16), bitcast=True), mask=mask,
                                     other=0))
    else:
        v = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _unpermute_kernel(permuted, weights, order, starts, out, T, H, HAS_WEIGHTS: tl.constexpr,
                      CODE: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    for t in range(pid, T, nprog):
        first = tl.load(starts + t)
        last = tl.load(starts + t + 1)
        dst = out + tl.cast(t, tl.int64) * H
        for s in range(0, H, BLOCK_H):
            mh = s + cols < H
            acc = tl.zeros([BLOCK_H], tl.float32)
            for j in range(first, last):
                slot = tl.load(order + j)
                x = _load_f32(permuted + slot * H + s + cols, mh, CODE)
                if HAS_WEIGHTS:
                    x = x * tl.load(weights + slot)
                acc = acc + x
            if CODE == 2:
                tl.store(dst.to(tl.pointer_type(tl.uint16), bitcast=True) + s + cols,
                         f32_to_bf16_bits(acc), mask=mh)
            else:
                tl.store(dst + s + cols, acc.to(dst.dtype.element_ty), mask=mh)


# ---------------------------------------------------------------- host side


def _block(n, cap):
    return min(cap, triton.next_power_of_2(max(n, 1)))


def _grid(n, device):
    return (max(1, min(n, tc.max_programs(device))),)


def permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False,
            method="fused"):
    """``(permuted, permuted_probs, sorted_indices)`` as
    :func:`leanstep.moe_permute`. Host reads: none when ``num_out_tokens`` is
    given; without it, one (the routed count is the output's row count)."""
    where = "permute"
    rows, capacity = tm.output_rows(tokens, routing_map, probs, num_out_tokens, drop_and_pad, method)
    tc.check_device(tokens.device, where, f"argument 'tokens' is on {tokens.device}")
    num_tokens, num_experts = routing_map.shape
    device = tokens.device
    hidden = tokens.shape[1]
    if num_tokens == 0:
        return tm.permute(tokens, routing_map, probs, rows, drop_and_pad, method)
    tokens = tokens.contiguous()
    rmap = routing_map.contiguous().view(torch.uint8)
    probs_c = None if probs is None else probs.contiguous()
    ranks = torch.empty((num_experts, num_tokens), dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    indices = torch.empty(rows, dtype=torch.int64, device=device)
    permuted_probs = None if probs is None else torch.empty(rows, dtype=probs.dtype,
                                                            device=device)
    permuted = torch.empty((rows, hidden), dtype=tokens.dtype, device=device)
    block_t = _block(num_tokens, 1024)
    block_e = _block(num_experts, 1 << 16)
    _rank_kernel[(num_experts,)](rmap, ranks, counts, num_tokens, num_experts, BLOCK_T=block_t)
    if not drop_and_pad:
        # More routed pairs than rows is an error, as on the CPU (asynchronous on a device).
        tm.assert_rows_cover_routed(counts.sum() <= rows, rows)
    if rows:
        dummy = indices
        _scatter_kernel[(num_experts, triton.cdiv(num_tokens, block_t))](
            rmap, ranks, counts, probs_c if probs_c is not None else dummy, indices,
            permuted_probs if permuted_probs is not None else dummy, num_tokens, num_experts,
            rows, capacity or 0, DROP_AND_PAD=bool(drop_and_pad), HAS_PROBS=probs is not None,
            BLOCK_T=block_t, BLOCK_E=block_e)
        _gather_kernel[_grid(rows, device)](
            tokens, indices, permuted_probs if permuted_probs is not None else dummy, permuted,
            counts, rows, hidden, num_experts, DROP_AND_PAD=bool(drop_and_pad),
            HAS_PROBS=probs is not None, BLOCK_H=_block(hidden, 4096), BLOCK_E=block_e)
    return permuted, permuted_probs, indices


def unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
              drop_and_pad=False):
    """As :func:`leanstep.moe_unpermute`: ``[T, H]`` in permuted's dtype, the
    C++ path's bits (fp32 sums in increasing slot order, one cast)."""
    where = "unpermute"
    num_tokens = tm.unpermute_rows(permuted, sorted_indices, restore_shape, probs, routing_map,
                                   drop_and_pad)
    tc.check_device(permuted.device, where, f"argument 'permuted' is on {permuted.device}")
    rows, hidden = permuted.shape
    weights, _ = tm.slot_probs(where, sorted_indices, rows, num_tokens, probs, routing_map,
                               drop_and_pad)
    device = permuted.device
    out = torch.empty((num_tokens, hidden), dtype=permuted.dtype, device=device)
    if num_tokens == 0 or hidden == 0:
        return out
    # Each token's slots, in increasing slot order: a stable sort by token.
    values, order = torch.sort(sorted_indices.long(), stable=True)
    starts = torch.searchsorted(values, torch.arange(num_tokens + 1, device=device))
    permuted = permuted.contiguous()
    weights = None if weights is None else weights.contiguous()
    _unpermute_kernel[_grid(num_tokens, device)](
        permuted, weights if weights is not None else permuted, order, starts, out, num_tokens,
        hidden, HAS_WEIGHTS=weights is not None, CODE=tc.DTYPE_CODES[permuted.dtype],
        BLOCK_H=_block(hidden, 1024), enable_fp_fusion=False)
    return out


def permute_backward(dpermuted, sorted_indices, num_tokens):
    """As :func:`leanstep.moe_permute_backward`: ``dtokens[t]`` = the fp32 sum
    of the rows of t's slots in increasing slot order, cast once (the
    unpermute kernel without probs)."""
    where = "permute_backward"
    num_tokens = host_count(num_tokens, where, "num_tokens")
    check_moe_unpermute(dpermuted, sorted_indices, num_tokens, None, None, False, where)
    return unpermute(dpermuted, sorted_indices, (num_tokens, dpermuted.shape[1]))
