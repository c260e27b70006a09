"""RMSNorm's Triton kernels, run on CPU tensors by Triton's interpreter
(backend="triton"): what the conformance harness (test_conformance.py) does
not hold. The harness holds their values against a float64 oracle and the
C++ path (every dtype, odd and wide rows, no rows, zero-centered gamma, both
roundings, a wider weight, eps = 0 with a zero row) with the tolerance
table's bounds; here: the launches of each (the frozen backward one launch
with no weight-gradient memory, the trainable one two), the trainable dx
being the frozen one's bits, dweight's bits for any grid, the leanstep.torch
wiring (module, function, exact_forward) on Triton, the errors and the
self-check. Values here are held to the harness's oracle with the same
bounds.

Interpreter set-up as in test_triton_grad.py: TRITON_INTERPRET is set only
around the first import of triton (or the module reruns itself in a fresh
process when triton was imported for a device).
"""


import pytest
import torch

import leanstep
import leanstep.torch as lt
from leanstep import _backend

import triton_harness  # noqa: E402 (tests/python is on sys.path under pytest)
from helpers import assert_bitwise


_SETUP = triton_harness.load("triton_common", "triton_rmsnorm")
DEVICE, NATIVE, IN_PROCESS = _SETUP.device, _SETUP.native, _SETUP.in_process
triton = _SETUP.triton
triton_common, triton_rmsnorm = _SETUP.modules["triton_common"], _SETUP.modules["triton_rmsnorm"]
_interpreter = triton_harness.interpreter_fixture(_SETUP)
test_in_a_fresh_interpreter_process = triton_harness.fresh_process_test(__file__, _SETUP)

from test_conformance import (FLOATS, NORM_DTYPES, RMSNORM_WIDE,  # noqa: E402
                              assert_rmsnorm_backward, assert_rmsnorm_forward, conform,
                              named_case, rmsnorm_inputs)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


DTYPES = [FLOATS[d] for d in NORM_DTYPES]


def dev(t):
    return t.to(DEVICE) if NATIVE else t


def t_forward(x, w, *args):
    """The Triton forward on the test device (inputs made on the CPU)."""
    return triton_rmsnorm.forward(dev(x), dev(w), *args)


def t_backward(dy, x, rstd, w, *args):
    return triton_rmsnorm.backward(dev(dy), dev(x), dev(rstd), dev(w), *args)


# ---------------------------------------------------------------- launches and bits

FORWARD, FROZEN, TRAINABLE = ({"_forward_kernel": 1}, {"_backward_kernel": 1},
                              {"_backward_kernel": 1, "_dgamma_kernel": 1})
#: (op, case name without the dtype, launches): one per pass, none without rows.
LAUNCHES = [("rmsnorm.forward", name, FORWARD)
            for name in ("h1", "h1037", "wide", "3d", "zero-centered", "cast-then-scale")]
LAUNCHES += [("rmsnorm.backward", f"{name}-frozen", FROZEN)
             for name in ("h1", "h1037", "wide", "3d", "zero-centered")]
LAUNCHES += [("rmsnorm.backward", f"{name}-trainable", TRAINABLE)
             for name in ("h3", "rows37", "wide", "zero-centered")]
LAUNCHES += [("rmsnorm.forward", "rows0", {}), ("rmsnorm.backward", "rows0-frozen", {}),
             ("rmsnorm.backward", "rows0-trainable", {})]


@pytest.mark.parametrize("dname", NORM_DTYPES)
@pytest.mark.parametrize("op,name,launches", LAUNCHES,
                         ids=[f"{op.split('.')[1]}-{name}" for op, name, _ in LAUNCHES])
def test_launches_of_each_pass(op, name, launches, dname):
    case = named_case(op, f"{dname}-{name}")
    with triton_common.count_launches() as counted:
        conform(case, "triton")  # and the values, against the oracle and the C++ path
    assert dict(counted) == launches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (37, 64), RMSNORM_WIDE])
def test_the_trainable_backward_gives_the_frozen_dx(dtype, shape, torch_gen):
    x, w, dy = rmsnorm_inputs(shape, dtype, torch_gen, scale=1.0)
    _, rstd = t_forward(x, w, 1e-5)
    dx, dw = t_backward(dy, x, rstd, w, False, True)
    dx_frozen, no_dw = t_backward(dy, x, rstd, w, False, False)
    assert dw is not None and no_dw is None
    assert_bitwise(dx, dx_frozen)


def test_dweight_has_the_same_bits_for_any_grid(monkeypatch, torch_gen):
    x, w, dy = rmsnorm_inputs((70, 48), torch.float32, torch_gen, scale=1.0)
    _, rstd = t_forward(x, w, 1e-5)
    results = []
    for programs in (1, 3, 10_000):
        monkeypatch.setattr(triton_rmsnorm.tc, "max_programs", lambda device, n=programs: n)
        results.append(t_backward(dy, x, rstd, w, False, True))
    for dx, dw in results[1:]:
        assert_bitwise(dx, results[0][0])
        assert_bitwise(dw, results[0][1])


# ---------------------------------------------------------------- leanstep.torch wiring


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["scale_then_cast", "cast_then_scale"])
def test_module_frozen_path_on_triton(dtype, rounding, torch_gen):
    x, w, dy = rmsnorm_inputs((6, 96), dtype, torch_gen, scale=1.0)
    m = lt.RMSNorm(96, eps=1e-5, dtype=dtype, rounding=rounding, backend="triton",
                   device=DEVICE)
    with torch.no_grad():
        m.weight.copy_(dev(w))
    m.weight.requires_grad_(False)
    xi = dev(x).requires_grad_(True)
    _backend.reset_calls()
    with triton_common.count_launches() as launches:
        y = m(xi)
        y.backward(dev(dy))
    assert dict(launches) == {"_forward_kernel": 1, "_backward_kernel": 1}
    assert m.last_decision["path"] == "frozen_fused" and m.last_decision["backend"] == "triton"
    assert m.weight.grad is None
    assert_rmsnorm_forward(y.detach(), x, w, 1e-5, rounding=rounding)
    rstd = leanstep.rms_norm(dev(x), dev(w), 1e-5, False, rounding, backend="triton")[1]
    assert_rmsnorm_backward(xi.grad, dy, x, rstd, w)
    reasons = _backend.reasons()
    (forward_reason,) = reasons["rmsnorm.forward"]["triton"][DEVICE.type]
    assert forward_reason == ("forced" if NATIVE else "forced, Triton interpreter")
    assert list(reasons["rmsnorm.backward"]["triton"][DEVICE.type]) == ["frozen: dx only"]


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_function_trainable_weight_gets_its_gradient(zero_centered_gamma, torch_gen):
    x, w, dy = rmsnorm_inputs((5, 40), torch.bfloat16, torch_gen, scale=1.0)
    xi, wi = dev(x).requires_grad_(True), dev(w).requires_grad_(True)
    y = lt.rms_norm(xi, wi, 1e-5, zero_centered_gamma, backend="triton")
    y.backward(dev(dy))
    assert_rmsnorm_forward(y.detach(), x, w, 1e-5, zero_centered_gamma)
    rstd = leanstep.rms_norm(dev(x), dev(w), 1e-5, zero_centered_gamma, backend="triton")[1]
    assert_rmsnorm_backward(xi.grad, dy, x, rstd, w, zero_centered_gamma, dweight=wi.grad,
                            trainable=True)
    with torch.no_grad():  # no autograd: the forward kernel alone
        y2 = lt.rms_norm(dev(x), dev(w), 1e-5, zero_centered_gamma, backend="triton")
    assert_bitwise(y2, y.detach())


def test_both_entry_points_reach_the_kernels(torch_gen):
    """leanstep.rms_norm / rms_norm_backward with backend="triton" run the same
    kernels as leanstep.torch.rms_norm (it used to refuse: "this op has no
    Triton kernels"): the same bits, counted under triton."""
    x, w, dy = rmsnorm_inputs((6, 72), torch.bfloat16, torch_gen, scale=1.0)
    _backend.reset_calls()
    y, rstd = leanstep.rms_norm(dev(x), dev(w), 1e-5, backend="triton")
    with torch.no_grad():
        assert_bitwise(y, lt.rms_norm(dev(x), dev(w), 1e-5, backend="triton"))
    dx, dweight = leanstep.rms_norm_backward(dev(dy), dev(x), rstd, dev(w), backend="triton")
    expected = triton_rmsnorm.backward(dev(dy), dev(x), rstd, dev(w))
    assert_bitwise(dx, expected[0])
    assert_bitwise(dweight, expected[1])
    calls = _backend.calls()
    assert calls["rmsnorm.forward"]["triton"][DEVICE.type] == 2
    assert calls["rmsnorm.backward"]["triton"][DEVICE.type] == 1


def test_exact_forward_keeps_torch_forward_and_takes_triton_dx(torch_gen):
    ref = torch.nn.RMSNorm(320, eps=1e-6, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        ref.weight.copy_(dev(torch.rand(320, generator=torch_gen) + 0.5))
    ref.weight.requires_grad_(False)
    m = lt.RMSNorm.from_torch(ref, frozen_only=True, exact_forward=True, backend="triton")
    x = torch.randn(7, 5, 320, generator=torch_gen).to(torch.bfloat16)
    x1, x2 = dev(x).requires_grad_(), dev(x).requires_grad_()
    y1, y2 = ref(x1), m(x2)
    assert torch.equal(y1, y2) and m.last_decision["forward"] == "torch_order"
    dy = torch.randn(7, 5, 320, generator=torch_gen).to(torch.bfloat16)
    with triton_common.count_launches() as launches:
        y2.backward(dev(dy))
    assert dict(launches) == {"_backward_kernel": 1}
    # dx from the rstd of torch's forward, the one saved for it
    rstd = torch.ops.aten._fused_rms_norm(dev(x), [320], ref.weight, 1e-6)[1]
    assert_rmsnorm_backward(x2.grad, dy, x, rstd, ref.weight)
    assert list(m.state_dict()) == list(ref.state_dict())


@pytest.mark.skipif(NATIVE, reason="the interpreter's errors")
def test_errors_name_the_argument(monkeypatch):
    x, w = torch.randn(2, 8), torch.ones(8)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(leanstep.Error, match=r"rms_norm: argument 'backend' is 'triton' for CPU "
                                             r"tensors.*set TRITON_INTERPRET=1"):
        lt.rms_norm(x, w, backend="triton")
    with pytest.raises(leanstep.Error, match=r"RMSNorm: argument 'backend'.*TRITON_INTERPRET=1"):
        lt.RMSNorm(8, backend="triton").requires_grad_(False)(x)


def test_self_check_passes_and_catches_a_broken_kernel(monkeypatch):
    """The first-use gate of the automatic choice: it passes for the real
    kernels and catches a forward that ignores eps."""
    from leanstep.backends import triton_selfcheck

    assert triton_selfcheck.check("rmsnorm", DEVICE) is None
    real = triton_rmsnorm.forward
    monkeypatch.setattr(triton_rmsnorm, "forward", lambda x, w, eps, *a: real(x, w, 0.5, *a))
    assert triton_selfcheck.check("rmsnorm", DEVICE) == (
        "the rmsnorm self-check failed: torch.float32 forward is outside the stated bound of "
        "the torch-op backend's")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_where_torch_has_native_fused_kernels_is_torchs_own(dtype, torch_gen):
    """On CUDA, leanstep's RMSNorm runs torch's fused kernels by default (faster
    than its Triton kernels there, with a native backward): the module's
    output and dx are torch.nn.RMSNorm's bits, the frozen weight gets no
    gradient, and the report names the choice. Runs on a device with those
    kernels (scripts/gpu-check.sh); the interpreter run has none."""
    from leanstep.backends import torch_rmsnorm

    if not NATIVE or not torch_rmsnorm.fused_has_native_autograd(DEVICE.type):
        pytest.skip(f"torch has no native fused RMSNorm autograd on {DEVICE.type}")
    x, w, dy = rmsnorm_inputs((37, 320), dtype, torch_gen, scale=1.0)
    x, w, dy = dev(x), dev(w), dev(dy)
    ours = lt.RMSNorm(320, eps=1e-6, dtype=dtype, device=DEVICE).requires_grad_(False)
    peer = torch.nn.RMSNorm(320, eps=1e-6, dtype=dtype, device=DEVICE).requires_grad_(False)
    with torch.no_grad():
        ours.weight.copy_(w)
        peer.weight.copy_(w)
    for _ in range(2):  # the deciding call, then the cached one
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = ours(xa), peer(xb)
        ya.backward(dy)
        yb.backward(dy)
        assert_bitwise(ya, yb)
        assert_bitwise(xa.grad, xb.grad)
        assert ours.weight.grad is None
        assert ours.last_decision["backend"] == "torch"
