"""leanstep MoE permutation against explicit oracles (token loops, float64
sums) and against the autograd of torch composites, on torch and NumPy inputs."""

import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt
from helpers import FLOAT_DTYPES, UNIT_ROUNDOFF, assert_within_ulps, randn, to_f64

pytestmark = pytest.mark.skipif("moe" not in leanstep.areas, reason="moe not built")


def random_routing(num_tokens, num_experts, topk, gen):
    """A top-k routing map [T, E] and fp32 probs (zero where not routed)."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    if num_tokens:
        top = logits.topk(topk, dim=1).indices
        routing_map.scatter_(1, top, True)
    probs = torch.softmax(logits, dim=1) * routing_map
    return routing_map, probs


def oracle_slots(routing_map, capacity=None):
    """(token, expert) of each permuted row: expert-major, increasing token;
    with a capacity, routed tokens then unrouted ones, the first `capacity`."""
    m = np.asarray(routing_map, dtype=bool)
    slots = []
    for e in range(m.shape[1]):
        routed = [t for t in range(m.shape[0]) if m[t, e]]
        if capacity is None:
            slots += [(t, e) for t in routed]
        else:
            unrouted = [t for t in range(m.shape[0]) if not m[t, e]]
            slots += [(t, e) for t in (routed + unrouted)[:capacity]]
    return slots


CASES = [(37, 7, 2), (64, 16, 5), (5, 8, 1), (0, 4, 2)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("T,E,k", CASES)
def test_permute_is_an_exact_gather_in_expert_major_order(dtype, T, E, k, torch_gen):
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = randn((T, 24), dtype, torch_gen)
    permuted, pprobs, sorted_indices = leanstep.moe_permute(tokens, routing_map, probs)
    slots = oracle_slots(routing_map)
    assert sorted_indices.dtype == torch.int64
    assert sorted_indices.tolist() == [t for t, _ in slots]
    assert torch.equal(permuted, tokens[[t for t, _ in slots]])  # bit-exact gather
    assert torch.equal(pprobs, torch.tensor([probs[t, e].item() for t, e in slots],
                                            dtype=torch.float32))
    # The reference method gives bit-identical results.
    p2, pp2, s2 = leanstep.moe_permute(tokens, routing_map, probs, method="sort")
    assert torch.equal(p2, permuted) and torch.equal(pp2, pprobs) and torch.equal(s2, sorted_indices)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_permute_drop_and_pad(dtype, torch_gen):
    T, E, k, capacity = 40, 8, 2, 7
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = randn((T, 16), dtype, torch_gen)
    permuted, pprobs, sorted_indices = leanstep.moe_permute(
        tokens, routing_map, probs, num_out_tokens=E * capacity, drop_and_pad=True)
    slots = oracle_slots(routing_map, capacity)
    assert sorted_indices.tolist() == [t for t, _ in slots]
    assert torch.equal(permuted, tokens[[t for t, _ in slots]])
    assert torch.equal(pprobs, torch.tensor([probs[t, e].item() for t, e in slots]))


def test_num_out_tokens_bounds_are_enforced(torch_gen):
    routing_map, probs = random_routing(10, 4, 2, torch_gen)
    tokens = torch.randn(10, 8, generator=torch_gen)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, num_out_tokens=23)
    assert permuted.shape == (23, 8)
    assert idx[20:].tolist() == [-1, -1, -1] and not permuted[20:].any() and not pprobs[20:].any()
    with pytest.raises(leanstep.Error, match="num_out_tokens"):
        leanstep.moe_permute(tokens, routing_map, probs, num_out_tokens=19)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("probs_form", ["none", "permuted", "map"])
def test_unpermute_matches_float64_oracle(dtype, probs_form, torch_gen):
    T, E, k, H = 31, 6, 3, 40
    routing_map, probs = random_routing(T, E, k, torch_gen)
    routing_map[3] = False  # a token routed nowhere comes back as zeros
    probs[3] = 0
    tokens = randn((T, H), dtype, torch_gen)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs)
    kwargs = {"none": {}, "permuted": {"probs": pprobs},
              "map": {"probs": probs, "routing_map": routing_map}}[probs_form]
    out = leanstep.moe_unpermute(permuted, idx, (T, H), **kwargs)
    assert out.dtype == dtype and out.shape == (T, H)
    # float64 oracle: out[t] = sum_i permuted[i] * prob_i over slots of t.
    p64 = to_f64(permuted)
    w = np.ones(len(idx)) if probs_form == "none" else to_f64(pprobs)
    expected = np.zeros((T, H))
    for i, t in enumerate(idx.tolist()):
        expected[t] += p64[i] * w[i]
    # fp32 accumulation of <= k products (k * u32 relative to sum|terms|), then
    # one rounding to the dtype: 1 ulp plus the fp32 error.
    mags = np.zeros((T, H))
    for i, t in enumerate(idx.tolist()):
        mags[t] += np.abs(p64[i] * w[i])
    assert_within_ulps(out, expected, dtype, ulps=1, atol=4 * k * UNIT_ROUNDOFF[torch.float32] * mags)
    assert not out[3].any()
    same = leanstep.moe_unpermute(permuted, idx, (T, H), method="sort", **kwargs)
    assert torch.equal(same, out)


def test_unpermute_drop_and_pad_with_map_probs(torch_gen):
    T, E, capacity, H = 20, 4, 6, 8
    routing_map, probs = random_routing(T, E, 2, torch_gen)
    tokens = torch.randn(T, H, generator=torch_gen)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs,
                                                 num_out_tokens=E * capacity, drop_and_pad=True)
    a = leanstep.moe_unpermute(permuted, idx, (T, H), probs=probs, routing_map=routing_map,
                               drop_and_pad=True)
    b = leanstep.moe_unpermute(permuted, idx, (T, H), probs=pprobs)
    assert torch.equal(a, b)


def test_numpy_inputs(rng):
    T, E, H = 12, 3, 5
    routing_map = rng.random((T, E)) < 0.5
    tokens = rng.standard_normal((T, H)).astype(np.float32)
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map)
    assert isinstance(permuted, np.ndarray) and pprobs is None
    slots = oracle_slots(routing_map)
    assert idx.tolist() == [t for t, _ in slots]
    np.testing.assert_array_equal(permuted, tokens[[t for t, _ in slots]])
    out = leanstep.moe_unpermute(permuted, idx, (T, H))
    counts = routing_map.sum(axis=1)
    np.testing.assert_allclose(out, tokens * counts[:, None], rtol=4 * 2**-24 * E)


def test_pad_routing_map_returns_a_new_map_and_out_in_place(torch_gen):
    routing_map, _ = random_routing(30, 5, 2, torch_gen)
    before = routing_map.clone()
    padded = leanstep.pad_routing_map(routing_map, 4)
    assert torch.equal(routing_map, before)  # not mutated
    m = before.numpy()
    expected = m.copy()
    for e in range(m.shape[1]):
        need = (-int(m[:, e].sum())) % 4
        for t in range(m.shape[0]):
            if need and not m[t, e]:
                expected[t, e] = True
                need -= 1
    assert np.array_equal(padded.numpy(), expected)
    assert (padded.sum(0) % 4 == 0).all()
    leanstep.pad_routing_map(routing_map, 4, out=routing_map)
    assert torch.equal(routing_map, padded)


def test_sort_chunks_by_idxs(torch_gen):
    rows = torch.randn(20, 3, generator=torch_gen)
    probs = torch.rand(20, generator=torch_gen)
    split_sizes = torch.tensor([4, 0, 7, 5])  # 16 rows: the last 4 keep their place
    order = torch.tensor([2, 0, 3, 1])
    out, out_probs = leanstep.sort_chunks_by_idxs(rows, split_sizes, order, probs)
    chunks = torch.split(rows[:16], split_sizes.tolist())
    pchunks = torch.split(probs[:16], split_sizes.tolist())
    assert torch.equal(out, torch.cat([chunks[i] for i in order.tolist()] + [rows[16:]]))
    assert torch.equal(out_probs, torch.cat([pchunks[i] for i in order.tolist()] + [probs[16:]]))


def test_errors():
    tokens = torch.randn(4, 3)
    with pytest.raises(leanstep.Error, match="routing_map"):
        leanstep.moe_permute(tokens, torch.ones(4, 2))  # float map
    with pytest.raises(leanstep.Error, match="method"):
        leanstep.moe_permute(tokens, torch.ones(4, 2, dtype=torch.bool), method="magic")
    with pytest.raises(leanstep.Error,
                       match=r"sort_chunks_by_idxs: argument 'sorted_idxs' must be a permutation of 0\.\.1 \(got 0 at position 1\)"):
        leanstep.sort_chunks_by_idxs(tokens, torch.tensor([2, 2]), torch.tensor([0, 0]))


# ---------------------------------------------------------------- autograd


def composite_permute(tokens, routing_map, probs):
    """Megatron-Core's unfused permute, written with differentiable torch ops."""
    T, E = routing_map.shape
    rm = routing_map.T.contiguous()
    idx = torch.arange(T).unsqueeze(0).expand(E, -1).masked_select(rm)
    return tokens.index_select(0, idx), probs.T.contiguous().masked_select(rm), idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_unpermute_autograd_matches_torch_composite(dtype, torch_gen):
    T, E, k, H = 25, 6, 2, 16
    routing_map, probs = random_routing(T, E, k, torch_gen)
    tokens = randn((T, H), dtype, torch_gen)
    t1, p1 = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    t2, p2 = tokens.clone().requires_grad_(), probs.clone().requires_grad_()

    perm1, pp1, idx1 = lt.permute(t1, routing_map, p1)
    perm2, pp2, idx2 = composite_permute(t2, routing_map, p2)
    assert torch.equal(perm1, perm2) and torch.equal(pp1, pp2) and torch.equal(idx1, idx2)
    w = randn(perm1.shape, dtype, torch_gen)
    u = torch.randn(pp1.shape, generator=torch_gen)
    ((perm1.float() * w.float()).sum() + (pp1 * u).sum()).backward()
    ((perm2.float() * w.float()).sum() + (pp2 * u).sum()).backward()
    # dtokens: a sum of <= k copies of w, fp32 accumulate then one rounding.
    assert_within_ulps(t1.grad, to_f64(t2.grad), dtype, ulps=1)
    assert torch.equal(p1.grad, p2.grad)  # a pure scatter

    # unpermute with [T, E] probs: gradients to the permuted rows and probs.
    x1 = perm1.detach().clone().requires_grad_()
    x2 = perm1.detach().clone().requires_grad_()
    q1, q2 = probs.clone().requires_grad_(), probs.clone().requires_grad_()
    out1 = lt.unpermute(x1, idx1, (T, H), probs=q1, routing_map=routing_map)
    pp = q2.T.contiguous().masked_select(routing_map.T.contiguous())
    out2 = torch.zeros(T, H, dtype=torch.float32).index_add(0, idx1, x2.float() * pp.unsqueeze(-1))
    assert_within_ulps(out1, to_f64(out2), dtype, ulps=1, atol=k * 4 * 2**-24 * np.abs(to_f64(out2)).max())
    dy = randn((T, H), dtype, torch_gen)
    (out1.float() * dy.float()).sum().backward()
    (out2 * dy.float()).sum().backward()
    # dpermuted[i] = cast(dy[t_i] * prob_i): one product, one rounding each way.
    assert_within_ulps(x1.grad, to_f64(x2.grad), dtype, ulps=1, atol=1e-30)
    # dprobs: a dot product over H in float64 (leanstep) vs fp32 (torch).
    pscale = (np.abs(to_f64(dy)) @ np.abs(to_f64(x2.detach())).T).max()
    assert_within_ulps(q1.grad, to_f64(q2.grad), torch.float32, ulps=1,
                       atol=H * 2**-24 * pscale)


def test_sort_chunks_autograd(torch_gen):
    rows = torch.randn(12, 4, generator=torch_gen, requires_grad=True)
    split_sizes = torch.tensor([3, 5, 4])
    order = torch.tensor([1, 2, 0])
    out, _ = lt.sort_chunks_by_idxs(rows, split_sizes, order)
    w = torch.randn(12, 4, generator=torch_gen)
    (out * w).sum().backward()
    ref_rows = rows.detach().clone().requires_grad_()
    chunks = torch.split(ref_rows, split_sizes.tolist())
    (torch.cat([chunks[i] for i in order.tolist()]) * w).sum().backward()
    assert torch.equal(rows.grad, ref_rows.grad)
