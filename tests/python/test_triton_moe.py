"""MoE permute / unpermute Triton kernels, run on CPU tensors by Triton's
interpreter: what the conformance harness (test_conformance.py) does not
hold. The harness holds their results bit for bit against the C++ path
(the same counting-sort order; unpermute's fp32 sums in increasing slot
order, products rounded before each add, one cast) on every case of its
list (experts with no tokens, nothing routed, no tokens, rows past the
routed pairs, drop-and-pad, any sorted_indices with duplicates and -1) and
their refusals with the C++ rule; here: the launches (3 for permute, 1 for
unpermute and permute_backward), no host syncs when num_out_tokens is
given, the entry points and autograd functions reaching the kernels, and
the self-check.

Interpreter set-up as in test_triton_grad.py.
"""


import pytest
import torch

import leanstep
from leanstep import _backend
from leanstep._tolerances import tolerance

import triton_harness  # noqa: E402 (tests/python is on sys.path under pytest)
from helpers import assert_within


_SETUP = triton_harness.load("triton_common", "triton_moe")
DEVICE, NATIVE, IN_PROCESS = _SETUP.device, _SETUP.native, _SETUP.in_process
triton = _SETUP.triton
triton_common, triton_moe = _SETUP.modules["triton_common"], _SETUP.modules["triton_moe"]
_interpreter = triton_harness.interpreter_fixture(_SETUP)
test_in_a_fresh_interpreter_process = triton_harness.fresh_process_test(__file__, _SETUP)

from test_conformance import CASES, case_inputs, conform  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def dev(t):
    return t.to(DEVICE) if NATIVE and t is not None else t


PERMUTE = {"_rank_kernel": 1, "_scatter_kernel": 1, "_gather_kernel": 1}
UNPERMUTE = {"_unpermute_kernel": 1}
#: The harness's fp32 cases with tokens and rows (the largest left to the
#: harness: the interpreter runs it slowly), with their launches: permute
#: ranks, scatters and gathers; unpermute and permute_backward sum in one.
LAUNCH_CASES = [
    (c, PERMUTE if c.op == "moe.permute" else UNPERMUTE) for c in CASES
    if c.op in ("moe.permute", "moe.unpermute", "moe.permute_backward")
    and c.dtype == torch.float32 and 0 < c.get("tokens") < 347 and c.get("capacity") != 0]


@pytest.mark.parametrize("case,launches", LAUNCH_CASES, ids=[c.id for c, _ in LAUNCH_CASES])
def test_launches_of_each_op(case, launches):
    with triton_common.count_launches() as counted:
        conform(case, "triton")  # and the bits, against the C++ path
    assert dict(counted) == launches


def permute_inputs(gen, name="fp32-t17"):
    """(tokens, routing_map, probs) of a harness permute case: T=17, E=5 (one
    expert with no token), k=2 (every token routed twice), H=3."""
    inputs = case_inputs("moe.permute", name, gen)
    return inputs["tokens"], inputs["routing_map"], inputs["probs"]


def test_sync_free_with_num_out_tokens_and_the_row_check(torch_gen):
    tokens, routing_map, probs = (dev(t) for t in permute_inputs(torch_gen))
    (T, H), k = tokens.shape, 2
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
    C++ path's results (bits where the table says exact, dprobs within its
    bound); the backward ops without Triton kernels run the torch-op backend."""
    import leanstep.torch as lt

    tokens, routing_map, probs = permute_inputs(torch_gen, "bf16-t17")
    (T, H), E = tokens.shape, routing_map.shape[1]
    n = int(routing_map.sum()) + 2
    _backend.reset_calls()
    mine = leanstep.moe_permute(dev(tokens), dev(routing_map), dev(probs), n, backend="triton")
    ref = leanstep.moe_permute(tokens, routing_map, probs, n)
    for a, b in zip(mine, ref):
        assert_within(a, b, ("moe", "permute"))
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

    (out, dx, dp), (ref_out, ref_dx, ref_dp) = run("triton", dev), run(None, lambda t: t)
    assert_within(out, ref_out, ("moe", "unpermute"))
    assert_within(dx, ref_dx, ("moe", "permute_backward"))
    # dprobs[t, e]: a float64 dot product over H of dout = cast(2 out) and the
    # slot's row, cast(1.5 tokens[t]), in another order on each side: the
    # table's bound, doubled, over the sum of |terms|.
    dout = (2 * ref_out.detach().float()).to(tokens.dtype).double()
    rows = (tokens * 1.5).double()
    terms = (dout.abs() * rows.abs()).sum(1, keepdim=True).expand(T, E)
    assert_within(dp.double(), ref_dp.double(),
                  tolerance("moe", "unpermute_backward_dprobs").doubled(), dtype=torch.float32,
                  scale=terms, terms=H)
    calls = _backend.calls()
    kind = DEVICE.type
    for op in ("moe.unpermute", "moe.permute_backward"):
        assert calls[op]["triton"][kind] >= 1, calls[op]
    assert calls["moe.unpermute_backward"]["torch"][kind] == 1  # no Triton kernel for it
    report = leanstep.paths()["ops"]["moe.permute"]
    assert "triton" in report["implementations"] and report["calls"]["triton"][kind] == 2
    assert all(w.startswith("forced") for w in report["reasons"]["triton"][kind])
    assert f"triton on {kind}, 2x: forced" in leanstep.format_paths()


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
