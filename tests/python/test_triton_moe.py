"""MoE permute / unpermute Triton kernels, run on CPU tensors by Triton's
interpreter, against the C++ path (leanstep.moe_permute / moe_unpermute on
CPU tensors): every result is compared bit for bit (the same counting-sort
order; unpermute's fp32 sums in increasing slot order, products rounded
before each add, one cast). Also: launches (3 for permute, 1 for unpermute),
no host syncs when num_out_tokens is given, experts with no tokens, a rank
with nothing routed, rows past the routed pairs, drop-and-pad, arbitrary
sorted_indices (duplicates, -1) for unpermute.

Interpreter set-up as in test_triton_grad.py.
"""


import pytest
import torch

import leanstep
from leanstep import _backend

from helpers import moe_hostile_calls
import triton_harness  # noqa: E402 (tests/python is on sys.path under pytest)


_SETUP = triton_harness.load("triton_common", "triton_moe")
DEVICE, NATIVE, IN_PROCESS = _SETUP.device, _SETUP.native, _SETUP.in_process
triton = _SETUP.triton
triton_common, triton_moe = _SETUP.modules["triton_common"], _SETUP.modules["triton_moe"]
_interpreter = triton_harness.interpreter_fixture(_SETUP)
test_in_a_fresh_interpreter_process = triton_harness.fresh_process_test(__file__, _SETUP)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def dev(t):
    return t.to(DEVICE) if NATIVE and t is not None else t


def assert_bitwise(actual, expected):
    if expected is None:
        assert actual is None
        return
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype.is_floating_point:
        view = INT_VIEW[actual.element_size()]
        assert torch.equal(actual.view(view), expected.view(view))
    else:
        assert torch.equal(actual, expected)


def routing(gen, T, E, k, empty_expert=True):
    routing_map, probs, _ = leanstep.moe_route(torch.randn(T, E, generator=gen), k)
    if empty_expert and E > 2:  # an expert no token is routed to
        routing_map[:, 1] = False
        probs[:, 1] = 0.0
    return routing_map, probs


CASES = [(None, False), ("exact", False), ("more", False), ("capacity", True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,drop_and_pad", CASES)
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
def test_permute_is_bitwise_the_cpu_path(dtype, rows, drop_and_pad, probs_dtype, torch_gen):
    T, E, k, H = 53, 7, 2, 19
    routing_map, probs = routing(torch_gen, T, E, k)
    probs = None if probs_dtype is None else probs.to(probs_dtype)
    tokens = torch.randn(T, H, generator=torch_gen).to(dtype)
    routed = int(routing_map.sum())
    n = {None: None, "exact": routed, "more": routed + 9, "capacity": E * 5}[rows]
    with triton_common.count_launches() as launches:
        out = triton_moe.permute(dev(tokens), dev(routing_map), dev(probs), n, drop_and_pad)
    assert sum(launches.values()) == 3
    ref = leanstep.moe_permute(tokens, routing_map, probs, n, drop_and_pad)
    for a, b in zip(out, ref):
        assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("probs_form", ["map", "slots", None])
def test_unpermute_is_bitwise_the_cpu_path(dtype, drop_and_pad, probs_form, torch_gen):
    T, E, k, H = 41, 6, 3, 23
    routing_map, probs = routing(torch_gen, T, E, k)
    tokens = torch.randn(T, H, generator=torch_gen).to(dtype)
    n = E * 9 if drop_and_pad else int(routing_map.sum()) + 4  # + rows with no source
    permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, n, drop_and_pad)
    permuted = (permuted.float() * 1.7).to(dtype)  # not exactly the tokens
    kwargs = {"map": dict(probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad),
              "slots": dict(probs=pprobs), None: {}}[probs_form]
    with triton_common.count_launches() as launches:
        out = triton_moe.unpermute(dev(permuted), dev(idx), (T, H),
                                   **{key: dev(v) if isinstance(v, torch.Tensor) else v
                                      for key, v in kwargs.items()})
    assert sum(launches.values()) == 1
    assert_bitwise(out, leanstep.moe_unpermute(permuted, idx, (T, H), **kwargs))


def test_unpermute_any_indices_sums_in_slot_order(torch_gen):
    T, H, N = 9, 33, 40
    idx = torch.randint(-1, T, (N,), generator=torch_gen)  # duplicates, -1, tokens never hit
    rows = (torch.randn(N, H, generator=torch_gen) * 1e3).to(torch.bfloat16)
    weights = torch.rand(N, generator=torch_gen)
    for probs in (None, weights):
        out = triton_moe.unpermute(dev(rows), dev(idx), (T, H), probs=dev(probs))
        assert_bitwise(out, leanstep.moe_unpermute(rows, idx, (T, H), probs=probs))


def test_nothing_routed_and_no_tokens(torch_gen):
    T, E, H = 12, 4, 8
    tokens = torch.randn(T, H, generator=torch_gen)
    nothing = torch.zeros(T, E, dtype=torch.bool)
    out = triton_moe.permute(dev(tokens), dev(nothing), dev(torch.zeros(T, E)), 5)
    ref = leanstep.moe_permute(tokens, nothing, torch.zeros(T, E), 5)
    for a, b in zip(out, ref):
        assert_bitwise(a, b)
    assert (out[2] == -1).all()
    empty = triton_moe.permute(dev(tokens[:0]), dev(nothing[:0]), None, 3)
    assert_bitwise(empty[0], torch.zeros(3, H)) and (empty[2] == -1).all()
    assert_bitwise(triton_moe.unpermute(dev(out[0]), dev(out[2]), (T, H)), torch.zeros(T, H))


def test_sync_free_with_num_out_tokens_and_the_row_check(torch_gen):
    T, E, k, H = 32, 8, 2, 16
    routing_map, probs = routing(torch_gen, T, E, k, empty_expert=False)
    tokens = dev(torch.randn(T, H, generator=torch_gen))
    routing_map, probs = dev(routing_map), dev(probs)
    with leanstep.audit() as audit:
        permuted, pprobs, idx = triton_moe.permute(tokens, routing_map, probs, T * k)
        triton_moe.unpermute(permuted, idx, (T, H), probs=probs, routing_map=routing_map)
    assert audit.num_syncs == 0 and audit.num_device_reads == 0, audit.format_table()
    if not NATIVE:  # on a device the assertion fires asynchronously
        with pytest.raises(RuntimeError, match="num_out_tokens"):
            triton_moe.permute(tokens, routing_map, probs, T * k - 1)
    with pytest.raises(leanstep.Error, match="argument 'method'"):
        triton_moe.permute(tokens, routing_map, probs, T * k, method="radix")


def test_entry_points_route_to_the_kernels_with_autograd(torch_gen):
    """leanstep.moe_* and the autograd functions with backend="triton": the
    kernels run (recorded with the reason) and forward and backward keep the
    C++ path's bits; the backward ops without Triton kernels run the torch-op
    backend."""
    import leanstep.torch as lt

    T, E, k, H = 29, 5, 2, 24
    routing_map, probs = routing(torch_gen, T, E, k)
    tokens = torch.randn(T, H, generator=torch_gen).to(torch.bfloat16)
    n = int(routing_map.sum()) + 2
    _backend.reset_calls()
    mine = leanstep.moe_permute(dev(tokens), dev(routing_map), dev(probs), n, backend="triton")
    ref = leanstep.moe_permute(tokens, routing_map, probs, n)
    for a, b in zip(mine, ref):
        assert_bitwise(a, b)
    (why,) = _backend.reasons()["moe.permute"]["triton"][DEVICE.type]
    assert why.startswith("forced")

    def run(backend, device_of):
        x = device_of(tokens.clone()).requires_grad_(True)
        p = device_of(probs.clone()).requires_grad_(True)
        rmap = device_of(routing_map)
        permuted, _, idx = lt.permute(x, rmap, None, n, backend=backend)
        out = lt.unpermute(permuted * 1.5, idx, (T, H), p, rmap, backend=backend)
        out.float().square().sum().backward()
        return out, x.grad, p.grad

    for a, b in zip(run("triton", dev), run(None, lambda t: t)):
        assert_bitwise(a.detach(), b)
    calls = _backend.calls()
    kind = DEVICE.type
    for op in ("moe.unpermute", "moe.permute_backward"):
        assert calls[op]["triton"][kind] >= 1, calls[op]
    assert calls["moe.unpermute_backward"]["torch"][kind] == 1  # no Triton kernel for it
    report = leanstep.paths()["ops"]["moe.permute"]
    assert "triton" in report["implementations"] and report["calls"]["triton"][kind] == 2
    assert all(w.startswith("forced") for w in report["reasons"]["triton"][kind])
    assert f"triton on {kind}, 2x: forced" in leanstep.format_paths()


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_backward_is_bitwise_the_cpu_path(dtype, torch_gen):
    N, T, H = 45, 11, 37
    idx = torch.randint(-1, T, (N,), generator=torch_gen)
    d = (torch.randn(N, H, generator=torch_gen) * 100).to(dtype)
    out = leanstep.moe_permute_backward(dev(d), dev(idx), T, backend="triton")
    assert_bitwise(out, leanstep.moe_permute_backward(d, idx, T))
    with pytest.raises(leanstep.Error, match="argument 'num_tokens' must be >= 0"):
        triton_moe.permute_backward(dev(d), dev(idx), -1)


def test_the_kernels_refuse_what_the_cpu_path_refuses(torch_gen):
    """The Triton entry points check with the C++ rules on metadata too
    (tests/python/test_paths.py runs the same list on cpu, torch and meta)."""
    device = DEVICE if NATIVE else "cpu"
    tried = 0
    for name, call, message in moe_hostile_calls(torch_gen, device=device):
        if name.startswith(("permute_probs_backward", "unpermute_backward", "pad_routing_map",
                            "sort_chunks")):
            continue  # no Triton kernels: the torch-op backend runs them
        with pytest.raises(leanstep.Error, match=message):
            call("triton")
            pytest.fail(f"{name}: accepted")
        tried += 1
    assert tried >= 20


def test_self_check_passes_and_catches_a_broken_kernel(monkeypatch):
    """The first-use gate of the automatic choice (triton_selfcheck): it
    passes for the real kernels and names a kernel whose result is off by
    one bit."""
    from leanstep.backends import triton_selfcheck

    assert triton_selfcheck.check("moe", DEVICE) is None
    real = triton_moe.unpermute

    def off_by_one_bit(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(torch.int16)[3, 5] ^= 1
        return out

    monkeypatch.setattr(triton_moe, "unpermute", off_by_one_bit)
    why = triton_selfcheck.check("moe", DEVICE)
    assert why == ("the moe self-check failed: unpermute differs from the torch-op backend")
    monkeypatch.setattr(triton_moe, "permute", lambda *a, **k: 1 / 0)
    assert "raised ZeroDivisionError" in triton_selfcheck.check("moe", DEVICE)
