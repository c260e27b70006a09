"""The torch-op MoE backend (leanstep.backends.torch_moe): what the
conformance harness (test_conformance.py) does not hold. The harness holds
its values on CPU tensors (backend="torch", both permute methods) against
the C++ path and float64, and its shapes with no host read on meta tensors,
for every op; here: the asynchronous checks, the out= arguments, the one
host read by design, the aten op count of a permute, the autograd
functions on the backend, the calls recorded per backend and device, and
the errors. Inputs are the harness's cases; bounds are the tolerance
table's."""

import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt
from helpers import assert_bitwise, assert_within
from leanstep._tolerances import tolerance
from test_conformance import case_inputs, place

pytestmark = pytest.mark.skipif("moe" not in leanstep.areas, reason="moe not built")


def permute_inputs(gen, name="fp32-t17"):
    """(tokens, routing_map, probs) of a harness permute case: T=17, E=5 (one
    expert with no token), k=2, H=3."""
    inputs = case_inputs("moe.permute", name, gen)
    return inputs["tokens"], inputs["routing_map"], inputs["probs"]


def meta_inputs(gen):
    return tuple(place(t, "meta") for t in permute_inputs(gen))


# ---------------------------------------------------------------- asynchronous checks, out=


@pytest.mark.parametrize("method", ["sort", "fused"])
def test_num_out_tokens_below_the_routed_count_fails_the_async_assertion(method, torch_gen):
    tokens, routing_map, probs = permute_inputs(torch_gen)
    routed = int(routing_map.sum())
    with pytest.raises(leanstep.Error, match="num_out_tokens"):
        leanstep.moe_permute(tokens, routing_map, probs, routed - 1)
    # "sort" checks with torch._assert_async, "fused" through its scatter's bounds
    # check: both raise at once on CPU tensors (asynchronously on a device).
    error = (RuntimeError, "num_out_tokens") if method == "sort" else (IndexError, "out of bounds")
    with pytest.raises(error[0], match=error[1]):
        leanstep.moe_permute(tokens, routing_map, probs, routed - 1, method=method,
                             backend="torch")


def test_unpermute_writes_into_out(torch_gen):
    inputs = case_inputs("moe.unpermute", "bf16-t17", torch_gen)
    permuted, idx = inputs["permuted"], inputs["sorted_indices"]
    out = torch.empty(17, 3, dtype=torch.bfloat16)
    assert leanstep.moe_unpermute(permuted, idx, (17, 3), out=out, backend="torch") is out
    assert_within(out, leanstep.moe_unpermute(permuted, idx, (17, 3)), ("moe", "unpermute"))


@pytest.mark.parametrize("multiple", [1, 3, 16])
def test_pad_routing_map_leaves_its_input_and_writes_out(multiple, torch_gen):
    routing_map = case_inputs("moe.pad_routing_map", "t17-multiple3", torch_gen)["routing_map"]
    before = routing_map.clone()
    padded = leanstep.pad_routing_map(routing_map, multiple, backend="torch")
    assert_bitwise(routing_map, before)  # not mutated
    in_place = routing_map.clone()
    assert leanstep.pad_routing_map(in_place, multiple, out=in_place, backend="torch") is in_place
    assert_within(in_place, padded, ("moe", "pad_routing_map"))


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_sort_chunks_by_idxs_refuses_a_repeated_chunk(index_dtype, torch_gen):
    inputs = case_inputs("moe.sort_chunks_by_idxs", "fp32-tail-rows", torch_gen)
    sizes = inputs["split_sizes"].to(index_dtype)
    # The asynchronous check raises at once on CPU tensors.
    with pytest.raises(RuntimeError, match="permutation"):
        leanstep.sort_chunks_by_idxs(inputs["rows"], sizes, torch.zeros(4, dtype=index_dtype),
                                     backend="torch")


# ---------------------------------------------------------------- host reads and op counts


def test_permute_without_num_out_tokens_is_the_one_host_read(torch_gen):
    tokens, routing_map, probs = meta_inputs(torch_gen)
    with pytest.raises(RuntimeError):  # the routed count is the row count
        leanstep.moe_permute(tokens, routing_map, probs)


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
    tokens, routing_map, probs = permute_inputs(torch_gen, "fp32-t347")
    rows = int(routing_map.sum())
    tokens, routing_map, probs = tokens.to(device), routing_map.to(device), probs.to(device)
    with leanstep.audit() as a:
        leanstep.moe_permute(tokens, routing_map, probs, rows, method=method, backend="torch")
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    assert a.num_ops <= PERMUTE_OP_BUDGET[method], a.format_table()
    assert a.num_ops - a.num_view_ops <= PERMUTE_KERNEL_BUDGET[method], a.format_table()


# ---------------------------------------------------------------- autograd


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
def test_autograd_with_the_torch_backend_matches_the_cpu_path(dname, torch_gen):
    tokens, routing_map, probs = permute_inputs(torch_gen, f"{dname}-t17")
    (T, H), dtype = tokens.shape, tokens.dtype
    w = torch.randn(T, H, generator=torch_gen).to(dtype)
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
    # tokens: permute_backward of unpermute_backward's cast products; probs: a scatter
    assert_within(device[0], cpu[0], ("moe", "permute_backward"))
    assert_within(device[1], cpu[1], ("moe", "permute_probs_backward"))
    # unpermute's dprobs[t, e]: a dot product over H of dout = w and the slot's
    # row, 2 * tokens[t] (orders differ between backends: the bound doubled).
    terms = (w.double().abs() * 2 * tokens.double().abs()).sum(1, keepdim=True)
    assert_within(device[2].double(), cpu[2].double(),
                  tolerance("moe", "unpermute_backward_dprobs").doubled(), dtype=torch.float32,
                  scale=terms.expand(routing_map.shape), terms=H)


def test_autograd_runs_on_meta(torch_gen):
    tokens, routing_map, probs = meta_inputs(torch_gen)
    T, H = tokens.shape
    t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    permuted, pprobs, idx = lt.permute(t, routing_map, p, 50)
    out = lt.unpermute(permuted, idx, (T, H), probs=pprobs)
    out.float().sum().backward()
    assert t.grad.shape == t.shape and p.grad.shape == p.shape


def test_sort_chunks_autograd_with_the_torch_backend(torch_gen):
    inputs = case_inputs("moe.sort_chunks_by_idxs", "fp32-tail-rows", torch_gen)
    rows, split_sizes, order = inputs["rows"], inputs["split_sizes"], inputs["sorted_idxs"]
    w = torch.randn(rows.shape, generator=torch_gen)
    grads = []
    for backend in (None, "torch"):
        r = rows.clone().requires_grad_()
        out, _ = lt.sort_chunks_by_idxs(r, split_sizes, order, backend=backend)
        (out * w).sum().backward()
        grads.append(r.grad)
    assert_within(grads[1], grads[0], ("moe", "sort_chunks_by_idxs"))


# ---------------------------------------------------------------- routing and bad input


def test_calls_are_recorded_per_backend_and_device(torch_gen):
    tokens, routing_map, probs = permute_inputs(torch_gen)

    def count(backend, device):
        return leanstep._backend.calls().get("moe.permute", {}).get(backend, {}).get(device, 0)

    before = (count("cpu", "cpu"), count("torch", "cpu"), count("torch", "meta"))
    leanstep.moe_permute(tokens, routing_map, probs)
    leanstep.moe_permute(tokens, routing_map, probs, backend="torch")
    leanstep.moe_permute(*meta_inputs(torch_gen), 40)
    after = (count("cpu", "cpu"), count("torch", "cpu"), count("torch", "meta"))
    assert [b - a for a, b in zip(before, after)] == [1, 1, 1]


def test_mixed_devices_are_an_error_naming_both_arguments(torch_gen):
    tokens, routing_map, probs = meta_inputs(torch_gen)
    T, E = routing_map.shape
    with pytest.raises(leanstep.Error, match=r"moe_permute: all tensors must be on one device "
                                             r"\(got 'tokens' on meta and 'routing_map' on cpu\)"):
        leanstep.moe_permute(tokens, torch.zeros(T, E, dtype=torch.bool), probs, 40)
    with pytest.raises(leanstep.Error, match=r"'permuted' on cpu and 'sorted_indices' on meta"):
        leanstep.moe_unpermute(torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64, device="meta"),
                               (20, 8))
    with pytest.raises(leanstep.Error, match=r"'rows' on meta and 'split_sizes' on cpu"):
        leanstep.sort_chunks_by_idxs(tokens, torch.tensor([2, 3]), torch.tensor([1, 0]))
    with pytest.raises(leanstep.Error, match=r"'routing_map' on cpu and 'out' on meta"):
        leanstep.pad_routing_map(torch.zeros(T, E, dtype=torch.bool), 2, out=routing_map)
    with pytest.raises(leanstep.Error, match=r"backend='cpu' needs CPU tensors"):
        leanstep.moe_permute(tokens, routing_map, probs, 40, backend="cpu")


def test_bad_input_on_the_torch_backend_names_the_argument(rng, torch_gen):
    # The arguments every backend refuses with the C++ rule are the harness's
    # (test_every_backend_refuses_bad_arguments_with_the_cpp_rule); these are
    # the Python layer's own.
    tokens, routing_map, probs = meta_inputs(torch_gen)
    with pytest.raises(leanstep.Error, match=r"argument 'method' must be \"sort\" or \"fused\""):
        leanstep.moe_permute(tokens, routing_map, probs, 40, method="magic")
    with pytest.raises(leanstep.Error, match=r"backend='torch' needs torch tensors \(argument "
                                             r"'tokens' is ndarray\)"):
        leanstep.moe_permute(rng.standard_normal((4, 3)).astype(np.float32),
                             np.ones((4, 2), dtype=bool), backend="torch")
    with pytest.raises(leanstep.Error, match=r"moe_route: argument 'logits' must be a CPU tensor"):
        leanstep.moe_route(torch.empty(4, 8, device="meta"), 2)
