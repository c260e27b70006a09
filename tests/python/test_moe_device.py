"""The torch-op MoE backend (leanstep.backends.torch_moe) against the C++ path.

backend="torch" forces the device backend on CPU tensors, so its numerics are
compared here with the C++ kernels (backend default): bitwise wherever the
arithmetic is the same (every gather, the fp32 scatter-add, the casts), within
a stated bound against a float64 oracle for the one reduction whose order
differs (the float64 dot product of unpermute_backward's dprobs). Meta tensors
check that no entry point reads a device value on the host (a host read raises
there), and a dispatch mode counts the aten ops of a permute."""

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import leanstep
import leanstep.torch as lt
from helpers import FLOAT_DTYPES, UNIT_ROUNDOFF, assert_within_ulps, randn, to_f64

pytestmark = pytest.mark.skipif("moe" not in leanstep.areas, reason="moe not built")

_SAME_SIZE_INT = {torch.float32: torch.int32, torch.float16: torch.int16,
                  torch.bfloat16: torch.int16, torch.float64: torch.int64}


def assert_bitwise(actual, expected):
    """Same dtype, shape and bits (-0.0 and +0.0 differ here)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        (actual.dtype, actual.shape, expected.dtype, expected.shape)
    as_int = _SAME_SIZE_INT.get(actual.dtype)
    a, e = actual.contiguous(), expected.contiguous()
    if as_int is not None:
        a, e = a.view(as_int), e.view(as_int)
    bad = a != e
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements differ"


def random_routing(num_tokens, num_experts, topk, gen):
    """A top-k routing map [T, E] and fp32 probs (zero where not routed), with
    the last expert left empty and ~10% of the tokens routed nowhere."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    if num_tokens:
        routing_map.scatter_(1, logits.topk(topk, dim=1).indices, True)
        if num_experts > 1:
            routing_map[:, -1] = False
        routing_map[torch.rand(num_tokens, generator=gen) < 0.1] = False
    probs = torch.softmax(logits, dim=1) * routing_map
    return routing_map, probs


def random_tokens(shape, dtype, gen):
    tokens = randn(shape, dtype, gen)
    tokens[::5, 0] = -0.0  # a byte copy keeps the sign of zero
    return tokens


CASES = [(37, 7, 2, 24), (64, 16, 5, 3), (5, 8, 1, 1), (1, 1, 1, 33), (0, 4, 2, 5),
         (193, 12, 8, 40)]


# ---------------------------------------------------------------- permute


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,E,k,H", CASES)
@pytest.mark.parametrize("method", ["sort", "fused"])
def test_permute_matches_cpu_path_bitwise(dtype, T, E, k, H, method, torch_gen):
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = random_tokens((T, H), dtype, torch_gen)
    routed = int(routing_map.sum())
    for num_out_tokens in (None, routed, routed + 7):
        for p in (None, probs, probs.to(dtype)):
            expected = leanstep.moe_permute(tokens, routing_map, p, num_out_tokens)
            actual = leanstep.moe_permute(tokens, routing_map, p, num_out_tokens, method=method,
                                          backend="torch")
            for a, e in zip(actual, expected):
                if e is None:
                    assert a is None
                else:
                    assert_bitwise(a, e)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("method", ["sort", "fused"])
def test_permute_drop_and_pad_matches_cpu_path_bitwise(dtype, method, torch_gen):
    T, E, k, H = 40, 8, 3, 16
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = random_tokens((T, H), dtype, torch_gen)
    for capacity in (0, 1, 7, 19, T):  # 19: more than any expert's routed count
        for p in (None, probs):
            expected = leanstep.moe_permute(tokens, routing_map, p, E * capacity, True)
            actual = leanstep.moe_permute(tokens, routing_map, p, E * capacity, True,
                                          method=method, backend="torch")
            for a, e in zip(actual, expected):
                if e is None:
                    assert a is None
                else:
                    assert_bitwise(a, e)


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_sort_and_fused_orderings_are_bit_identical(drop_and_pad, torch_gen):
    T, E, k, H = 301, 32, 6, 8
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = random_tokens((T, H), torch.bfloat16, torch_gen)
    rows = E * 50 if drop_and_pad else int(routing_map.sum()) + 3
    by_sort = leanstep.moe_permute(tokens, routing_map, probs, rows, drop_and_pad, method="sort",
                                   backend="torch")
    fused = leanstep.moe_permute(tokens, routing_map, probs, rows, drop_and_pad, method="fused",
                                 backend="torch")
    for a, b in zip(by_sort, fused):
        assert_bitwise(a, b)


def test_rows_beyond_the_routed_pairs_are_zero_with_index_minus_one(torch_gen):
    routing_map, probs = random_routing(10, 4, 2, torch_gen)
    tokens = torch.randn(10, 8, generator=torch_gen)
    routed = int(routing_map.sum())
    for method in ("sort", "fused"):
        permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, routed + 3,
                                                     method=method, backend="torch")
        assert idx[routed:].tolist() == [-1, -1, -1]
        assert_bitwise(permuted[routed:], torch.zeros(3, 8))
        assert_bitwise(pprobs[routed:], torch.zeros(3))
    # More rows than the [E, T + 1] layout holds codes for.
    by_sort = leanstep.moe_permute(tokens, routing_map, probs, 60, method="sort", backend="torch")
    for a, e in zip(by_sort, leanstep.moe_permute(tokens, routing_map, probs, 60)):
        assert_bitwise(a, e)


@pytest.mark.parametrize("method", ["sort", "fused"])
def test_num_out_tokens_below_the_routed_count_fails_the_async_assertion(method, torch_gen):
    routing_map, probs = random_routing(10, 4, 2, torch_gen)
    tokens = torch.randn(10, 8, generator=torch_gen)
    routed = int(routing_map.sum())
    with pytest.raises(leanstep.Error, match="num_out_tokens"):
        leanstep.moe_permute(tokens, routing_map, probs, routed - 1)
    # "sort" checks with torch._assert_async, "fused" through its scatter's bounds
    # check: both raise at once on CPU tensors (asynchronously on a device).
    error = (RuntimeError, "num_out_tokens") if method == "sort" else (IndexError, "out of bounds")
    with pytest.raises(error[0], match=error[1]):
        leanstep.moe_permute(tokens, routing_map, probs, routed - 1, method=method,
                             backend="torch")


# ---------------------------------------------------------------- unpermute and backward


def _probs_forms(pprobs, probs, routing_map):
    return {"none": {}, "permuted": {"probs": pprobs},
            "map": {"probs": probs, "routing_map": routing_map},
            "map_bf16": {"probs": probs.to(torch.bfloat16), "routing_map": routing_map}}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,E,k,H", CASES)
def test_unpermute_matches_cpu_path_bitwise(dtype, T, E, k, H, torch_gen):
    # Both paths add fp32 products into an fp32 row from +0 in increasing
    # slot order and cast once (torch's CPU index_add_ adds the source rows in
    # index order), so the bits agree.
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = random_tokens((T, H), dtype, torch_gen)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs,
                                                 int(routing_map.sum()) + 2)
    for kwargs in _probs_forms(pprobs, probs, routing_map).values():
        for indices in (idx, idx.to(torch.int32)):
            expected = leanstep.moe_unpermute(permuted, indices, (T, H), **kwargs)
            actual = leanstep.moe_unpermute(permuted, indices, (T, H), backend="torch", **kwargs)
            assert_bitwise(actual, expected)
    assert_bitwise(leanstep.moe_permute_backward(permuted, idx, T, backend="torch"),
                   leanstep.moe_permute_backward(permuted, idx, T))
    assert_bitwise(leanstep.moe_permute_probs_backward(pprobs, idx, routing_map, backend="torch"),
                   leanstep.moe_permute_probs_backward(pprobs, idx, routing_map))
    out = torch.empty(T, H, dtype=dtype)
    assert leanstep.moe_unpermute(permuted, idx, (T, H), out=out, backend="torch") is out
    assert_bitwise(out, leanstep.moe_unpermute(permuted, idx, (T, H)))


def test_unpermute_drop_and_pad_matches_cpu_path_bitwise(torch_gen):
    T, E, capacity, H = 20, 4, 6, 8
    routing_map, probs = random_routing(T, E, 2, torch_gen)
    tokens = torch.randn(T, H, generator=torch_gen)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, E * capacity, True)
    kwargs = {"probs": probs, "routing_map": routing_map, "drop_and_pad": True}
    assert_bitwise(leanstep.moe_unpermute(permuted, idx, (T, H), backend="torch", **kwargs),
                   leanstep.moe_unpermute(permuted, idx, (T, H), **kwargs))
    assert_bitwise(leanstep.moe_permute_probs_backward(pprobs, idx, routing_map, True,
                                                       backend="torch"),
                   leanstep.moe_permute_probs_backward(pprobs, idx, routing_map, True))
    dout = torch.randn(T, H, generator=torch_gen)
    a = leanstep.moe_unpermute_backward(dout, permuted, idx, backend="torch", **kwargs)
    e = leanstep.moe_unpermute_backward(dout, permuted, idx, **kwargs)
    assert_bitwise(a[0], e[0])
    # dprobs: float64 dot products summed in different orders (bound below).
    _, mags = exact_dots(dout, permuted, idx)
    assert_within_ulps(a[1], to_f64(e[1]), torch.float32, ulps=1,
                       atol=2 * H * UNIT_ROUNDOFF[torch.float64] * mags.max())


def exact_dots(dout, permuted, idx):
    """dot(dout[t_i], permuted[i]) for every slot, correctly rounded to
    float64 (products of fp32 values are exact in float64; fsum is exact),
    with the sum of |terms|; 0 for slots with no source."""
    dy, x = to_f64(dout), to_f64(permuted)
    dots, mags = np.zeros(len(idx)), np.zeros(len(idx))
    for i, t in enumerate(idx.tolist()):
        if t >= 0:
            terms = dy[t] * x[i]
            dots[i], mags[i] = math.fsum(terms), np.abs(terms).sum()
    return dots, mags


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("probs_form", ["none", "permuted", "map", "map_bf16"])
def test_unpermute_backward_against_cpu_path_and_float64_oracle(dtype, probs_form, torch_gen):
    T, E, k, H = 45, 6, 3, 40
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = random_tokens((T, H), dtype, torch_gen)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs,
                                                 int(routing_map.sum()) + 2)
    kwargs = _probs_forms(pprobs, probs, routing_map)[probs_form]
    dout = randn((T, H), dtype, torch_gen)
    dpermuted, dprobs = leanstep.moe_unpermute_backward(dout, permuted, idx, backend="torch",
                                                        **kwargs)
    cpu_dpermuted, cpu_dprobs = leanstep.moe_unpermute_backward(dout, permuted, idx, **kwargs)
    # dpermuted[i] = cast(float(dout[t_i]) * prob_i): the same two roundings.
    assert_bitwise(dpermuted, cpu_dpermuted)
    if probs_form == "none":
        assert dprobs is None and cpu_dprobs is None
        return
    # dprob_i: a float64 sum over H (torch's reduction order, not the CPU
    # path's serial one) of exact products, rounded once to probs' dtype:
    # |got - exact| <= u_dtype * |exact| + (H - 1) * u64 * sum|terms|.
    # Both paths meet it; they may then differ by one ulp of probs' dtype.
    probs_dtype = kwargs["probs"].dtype
    dots, mags = exact_dots(dout, permuted, idx)
    atol = H * UNIT_ROUNDOFF[torch.float64] * mags
    if "routing_map" in kwargs:
        experts = np.repeat(np.arange(E), routing_map.sum(0).numpy())
        expected, tol = np.zeros((T, E)), np.zeros((T, E))
        for i, t in enumerate(idx.tolist()[:len(experts)]):
            expected[t, experts[i]] += dots[i]
            tol[t, experts[i]] += atol[i]
        dots, atol = expected, tol
    assert_within_ulps(dprobs, dots, probs_dtype, ulps=0.5, atol=atol)
    assert_within_ulps(dprobs, to_f64(cpu_dprobs), probs_dtype, ulps=1, atol=2 * atol)


# ---------------------------------------------------------------- pad_routing_map, sort_chunks


@pytest.mark.parametrize("T,E", [(30, 5), (1, 1), (0, 3), (100, 16)])
@pytest.mark.parametrize("multiple", [1, 3, 16])
def test_pad_routing_map_matches_cpu_path_bitwise(T, E, multiple, torch_gen):
    routing_map = torch.rand(T, E, generator=torch_gen) < 0.3
    before = routing_map.clone()
    padded = leanstep.pad_routing_map(routing_map, multiple, backend="torch")
    assert torch.equal(routing_map, before)  # not mutated
    assert torch.equal(padded, leanstep.pad_routing_map(routing_map, multiple))
    in_place = routing_map.clone()
    assert leanstep.pad_routing_map(in_place, multiple, out=in_place, backend="torch") is in_place
    assert torch.equal(in_place, padded)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("R,C", [(20, 4), (50, 9), (5, 3), (7, 0), (0, 0)])
def test_sort_chunks_by_idxs_matches_cpu_path_bitwise(index_dtype, R, C, torch_gen):
    rows = randn((R, 3), torch.bfloat16, torch_gen)
    probs = torch.rand(R, generator=torch_gen)
    for _ in range(5):  # random cuts: empty chunks and a tail that keeps its place
        cuts = torch.randint(0, R + 1, (C,), generator=torch_gen).sort().values
        sizes = torch.diff(cuts, prepend=torch.zeros(1, dtype=torch.int64)).to(index_dtype)
        order = torch.randperm(C, generator=torch_gen).to(index_dtype)
        expected = leanstep.sort_chunks_by_idxs(rows, sizes, order, probs)
        actual = leanstep.sort_chunks_by_idxs(rows, sizes, order, probs, backend="torch")
        assert_bitwise(actual[0], expected[0])
        assert_bitwise(actual[1], expected[1])
    if C >= 2:  # a repeated chunk: the asynchronous check raises at once on CPU tensors
        with pytest.raises(RuntimeError, match="permutation"):
            leanstep.sort_chunks_by_idxs(rows, sizes, torch.zeros(C, dtype=index_dtype),
                                         backend="torch")


# ---------------------------------------------------------------- meta tensors: no host reads


def _meta_inputs(T=20, E=4, H=8, dtype=torch.bfloat16):
    meta = torch.device("meta")
    return (torch.empty(T, H, dtype=dtype, device=meta),
            torch.empty(T, E, dtype=torch.bool, device=meta),
            torch.empty(T, E, dtype=torch.float32, device=meta))


@pytest.mark.parametrize("method", ["sort", "fused"])
def test_every_entry_point_runs_on_meta(method):
    tokens, routing_map, probs = _meta_inputs()
    T, H = tokens.shape
    E = routing_map.shape[1]
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, 50, method=method)
    assert permuted.shape == (50, H) and pprobs.shape == (50,) and idx.dtype == torch.int64
    assert permuted.device.type == "meta"
    dp = leanstep.moe_permute(tokens, routing_map, None, E * 3, True, method=method)
    assert dp[0].shape == (E * 3, H) and dp[1] is None
    for kwargs in ({}, {"probs": pprobs}, {"probs": probs, "routing_map": routing_map}):
        assert leanstep.moe_unpermute(permuted, idx, (T, H), **kwargs).shape == (T, H)
        dpermuted, dprobs = leanstep.moe_unpermute_backward(tokens, permuted, idx, **kwargs)
        assert dpermuted.shape == permuted.shape
        assert (dprobs is None) == ("probs" not in kwargs)
    assert leanstep.moe_unpermute(dp[0], dp[2], (T, H), probs, routing_map, True).shape == (T, H)
    assert leanstep.moe_permute_backward(permuted, idx, T).shape == (T, H)
    assert leanstep.moe_permute_probs_backward(pprobs, idx, routing_map).shape == (T, E)
    assert leanstep.pad_routing_map(routing_map, 4).shape == (T, E)
    assert leanstep.pad_routing_map(routing_map, 4, out=routing_map) is routing_map
    sizes = torch.empty(4, dtype=torch.int64, device="meta")
    out, out_probs = leanstep.sort_chunks_by_idxs(permuted, sizes, sizes.clone(), pprobs)
    assert out.shape == permuted.shape and out_probs.shape == pprobs.shape


def test_permute_without_num_out_tokens_is_the_one_host_read():
    tokens, routing_map, probs = _meta_inputs()
    with pytest.raises(RuntimeError):  # the routed count is the row count
        leanstep.moe_permute(tokens, routing_map, probs)


class _AtenOps(TorchDispatchMode):
    """Records the name of every aten op that reaches dispatch."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


# Ops whose output shape or result needs a device value on the host.
_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2",
            "unique_consecutive", "item"}

# The fused plain permute with probs, op by op: lay out and count the mask
# (t, constant_pad_nd, view, cumsum); scatter the codes (mul, full, arange,
# index_put_, slice); gather the outputs (fmod, constant_pad_nd + index for the
# rows, t + constant_pad_nd + take for the probs): 15 aten ops, 4 of them views
# (t, view, slice, t), which launch nothing. The "sort" reference path adds its
# explicit asynchronous check of num_out_tokens (select, eq, _assert_async).
PERMUTE_KERNEL_BUDGET = {"fused": 12, "sort": 15}
PERMUTE_OP_BUDGET = {"fused": 15, "sort": 18}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("method", ["fused", "sort"])
def test_permute_op_and_sync_counts(device, method, torch_gen):
    routing_map, probs = random_routing(64, 8, 2, torch_gen)
    tokens = torch.randn(64, 16, generator=torch_gen)
    rows = int(routing_map.sum())
    tokens, routing_map, probs = tokens.to(device), routing_map.to(device), probs.to(device)
    with leanstep.audit() as a:
        leanstep.moe_permute(tokens, routing_map, probs, rows, method=method, backend="torch")
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    assert a.num_ops <= PERMUTE_OP_BUDGET[method], a.format_table()
    assert a.num_ops - a.num_view_ops <= PERMUTE_KERNEL_BUDGET[method], a.format_table()


def test_no_entry_point_syncs_on_meta():
    tokens, routing_map, probs = _meta_inputs()
    T, H = tokens.shape
    with _AtenOps() as ops:
        permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, 50)
        leanstep.moe_permute(tokens, routing_map, probs, 12, True)
        leanstep.moe_unpermute(permuted, idx, (T, H), probs, routing_map)
        leanstep.moe_unpermute_backward(tokens, permuted, idx, probs, routing_map)
        leanstep.moe_permute_probs_backward(pprobs, idx, routing_map)
        leanstep.pad_routing_map(routing_map, 8)
        sizes = torch.empty(4, dtype=torch.int64, device="meta")
        leanstep.sort_chunks_by_idxs(permuted, sizes, sizes.clone(), pprobs)
    assert ops.names and not _SYNCING & set(ops.names), f"host syncs in {ops.names}"


# ---------------------------------------------------------------- autograd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_with_the_torch_backend_matches_the_cpu_path(dtype, torch_gen):
    T, E, k, H = 25, 6, 2, 16
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = randn((T, H), dtype, torch_gen)
    w = randn((T, H), dtype, torch_gen)
    grads = {}
    for backend in (None, "torch"):
        t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        q = probs.clone().requires_grad_()
        permuted, pprobs, idx = lt.permute(t, routing_map, p, int(routing_map.sum()) + 2,
                                           backend=backend)
        out = lt.unpermute(permuted * 2, idx, (T, H), probs=q, routing_map=routing_map,
                           backend=backend)
        ((out.float() * w.float()).sum() + (pprobs * pprobs).sum()).backward()
        grads[backend] = (t.grad, p.grad, q.grad)
    cpu, device = grads[None], grads["torch"]
    assert_bitwise(device[0], cpu[0])  # scatter-adds of cast products: same bits
    assert_bitwise(device[1], cpu[1])  # a scatter
    # dprobs of unpermute: float64 dot products over H (see the bound above).
    scale = (np.abs(to_f64(w)) @ np.abs(2 * to_f64(tokens)).T).max()
    assert_within_ulps(device[2], to_f64(cpu[2]), torch.float32, ulps=1,
                       atol=2 * H * UNIT_ROUNDOFF[torch.float64] * scale)


def test_autograd_runs_on_meta():
    tokens, routing_map, probs = _meta_inputs()
    T, H = tokens.shape
    t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    permuted, pprobs, idx = lt.permute(t, routing_map, p, 50)
    out = lt.unpermute(permuted, idx, (T, H), probs=pprobs)
    out.float().sum().backward()
    assert t.grad.shape == t.shape and p.grad.shape == p.shape


def test_sort_chunks_autograd_with_the_torch_backend(torch_gen):
    rows = torch.randn(12, 4, generator=torch_gen)
    split_sizes, order = torch.tensor([3, 5, 4]), torch.tensor([1, 2, 0])
    w = torch.randn(12, 4, generator=torch_gen)
    grads = []
    for backend in (None, "torch"):
        r = rows.clone().requires_grad_()
        out, _ = lt.sort_chunks_by_idxs(r, split_sizes, order, backend=backend)
        (out * w).sum().backward()
        grads.append(r.grad)
    assert_bitwise(grads[1], grads[0])


# ---------------------------------------------------------------- routing and bad input


def test_calls_are_recorded_per_backend_and_device(torch_gen):
    routing_map, probs = random_routing(8, 4, 2, torch_gen)
    tokens = torch.randn(8, 3, generator=torch_gen)

    def count(backend, device):
        return leanstep._backend.calls().get("moe.permute", {}).get(backend, {}).get(device, 0)

    before = (count("cpu", "cpu"), count("torch", "cpu"), count("torch", "meta"))
    leanstep.moe_permute(tokens, routing_map, probs)
    leanstep.moe_permute(tokens, routing_map, probs, backend="torch")
    leanstep.moe_permute(*_meta_inputs(), 40)
    after = (count("cpu", "cpu"), count("torch", "cpu"), count("torch", "meta"))
    assert [b - a for a, b in zip(before, after)] == [1, 1, 1]


def test_mixed_devices_are_an_error_naming_both_arguments():
    tokens, routing_map, probs = _meta_inputs()
    with pytest.raises(leanstep.Error, match=r"moe_permute: all tensors must be on one device "
                                             r"\(got 'tokens' on meta and 'routing_map' on cpu\)"):
        leanstep.moe_permute(tokens, torch.zeros(20, 4, dtype=torch.bool), probs, 40)
    with pytest.raises(leanstep.Error, match=r"'permuted' on cpu and 'sorted_indices' on meta"):
        leanstep.moe_unpermute(torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64, device="meta"),
                               (20, 8))
    with pytest.raises(leanstep.Error, match=r"'rows' on meta and 'split_sizes' on cpu"):
        leanstep.sort_chunks_by_idxs(tokens, torch.tensor([2, 3]), torch.tensor([1, 0]))
    with pytest.raises(leanstep.Error, match=r"'routing_map' on cpu and 'out' on meta"):
        leanstep.pad_routing_map(torch.zeros(20, 4, dtype=torch.bool), 2, out=routing_map)
    with pytest.raises(leanstep.Error, match=r"backend='cpu' needs CPU tensors"):
        leanstep.moe_permute(tokens, routing_map, probs, 40, backend="cpu")


def test_bad_input_on_the_torch_backend_names_the_argument(rng):
    tokens, routing_map, probs = _meta_inputs()
    with pytest.raises(leanstep.Error, match=r"permute: argument 'tokens' must have T=20 rows"):
        leanstep.moe_permute(tokens[:5], routing_map, probs, 40)
    with pytest.raises(leanstep.Error, match=r"argument 'routing_map' must have dtype in \{bool\}"):
        leanstep.moe_permute(tokens, probs, None, 40)
    with pytest.raises(leanstep.Error, match=r"argument 'method' must be \"sort\" or \"fused\""):
        leanstep.moe_permute(tokens, routing_map, probs, 40, method="magic")
    with pytest.raises(leanstep.Error,
                       match=r"argument 'num_out_tokens' must be a multiple of E=4"):
        leanstep.moe_permute(tokens, routing_map, probs, 41, True)
    with pytest.raises(leanstep.Error, match=r"argument 'num_out_tokens' is required"):
        leanstep.moe_permute(tokens, routing_map, probs, None, True)
    with pytest.raises(leanstep.Error, match=r"argument 'restore_shape' must be \(T >= 0, H=8\)"):
        leanstep.moe_unpermute(tokens, torch.empty(20, dtype=torch.int64, device="meta"), (20, 9))
    with pytest.raises(leanstep.Error, match=r"argument 'sorted_idxs' must have shape \[2\]"):
        leanstep.sort_chunks_by_idxs(tokens, torch.empty(2, dtype=torch.int64, device="meta"),
                                     torch.empty(3, dtype=torch.int64, device="meta"))
    with pytest.raises(leanstep.Error, match=r"backend='torch' needs torch tensors \(argument "
                                             r"'tokens' is ndarray\)"):
        leanstep.moe_permute(rng.standard_normal((4, 3)).astype(np.float32),
                             np.ones((4, 2), dtype=bool), backend="torch")
    with pytest.raises(leanstep.Error, match=r"moe_route: argument 'logits' must be a CPU tensor"):
        leanstep.moe_route(torch.empty(4, 8, device="meta"), 2)
