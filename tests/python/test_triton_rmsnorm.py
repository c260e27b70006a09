"""RMSNorm's Triton kernels, run on CPU tensors by Triton's interpreter
(backend="triton"), against a float64 oracle and the C++ path.

Nothing here is bitwise against the C++ path: both sum a row's squares in
fp32 in an order of their own (the C++ one depends on the SIMD width). The
bounds are those of tests/python/test_rmsnorm_device.py, u = 2^-24:

- rstd: 64 u relative (fp32 blocked sums of H <= 2^14 terms, a division, a
  square root and a reciprocal, each correctly rounded);
- y: 1 ulp of y's dtype + 64 u of the row's largest |y| (scale_then_cast:
  fp32 products, one rounding); cast_then_scale rounds x * r to x's dtype
  first, which a few-ulp difference in r can move by one ulp: 3 ulp;
- dx: the C++ kernels' derived bound (docs/rmsnorm.md), which follows the
  terms r |g dy| and |xhat| |mean| rather than dx, since they cancel (H = 1);
  64 u of the row's largest |dx| + 1 ulp where rows are long;
- dweight: 1.5 ((rows + 4) u sum|dy xhat| + 1 ulp of its dtype), the C++
  kernels' own bound (fp32 sums over rows in chunk order).

The frozen backward is one launch with no weight-gradient memory; the
trainable one is two, and its dweight has the same bits for any grid.

Interpreter set-up as in test_triton_grad.py: TRITON_INTERPRET is set only
around the first import of triton (or the module reruns itself in a fresh
process when triton was imported for a device).
"""


import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt
from leanstep import _backend

import triton_harness  # noqa: E402 (tests/python is on sys.path under pytest)


_SETUP = triton_harness.load("triton_common", "triton_rmsnorm")
DEVICE, NATIVE, IN_PROCESS = _SETUP.device, _SETUP.native, _SETUP.in_process
triton = _SETUP.triton
triton_common, triton_rmsnorm = _SETUP.modules["triton_common"], _SETUP.modules["triton_rmsnorm"]
_interpreter = triton_harness.interpreter_fixture(_SETUP)
test_in_a_fresh_interpreter_process = triton_harness.fresh_process_test(__file__, _SETUP)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
U = 2.0**-24
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def to_f64(t):
    return t.detach().cpu().to(torch.float64).numpy()


def dev(t):
    return t.to(DEVICE) if NATIVE else t


def t_forward(x, w, *args):
    """The Triton forward on the test device (inputs made on the CPU)."""
    return triton_rmsnorm.forward(dev(x), dev(w), *args)


def t_backward(dy, x, rstd, w, *args):
    return triton_rmsnorm.backward(dev(dy), dev(x), dev(rstd), dev(w), *args)


def round_to(values, dtype):
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype).to(torch.float64).numpy()


def oracle(x, w, dy, eps, zero_centered_gamma=False, rounding="scale_then_cast"):
    x64, w64, dy64 = to_f64(x), to_f64(w), to_f64(dy)
    g = 1.0 + w64 if zero_centered_gamma else w64
    r = 1.0 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    xhat = x64 * r
    y = g * round_to(xhat, x.dtype) if rounding == "cast_then_scale" else xhat * g
    gdy = g * dy64
    dx = r * (gdy - xhat * (gdy * xhat).mean(-1, keepdims=True))
    dw = (dy64 * xhat).reshape(-1, x.shape[-1]).sum(0)
    return y, r[..., 0], dx, dw, np.abs(dy64 * xhat).reshape(-1, x.shape[-1]).sum(0)


def assert_close(actual, expected, dtype, rel_rows=64 * U, ulps=1.0):
    a = to_f64(actual)
    row_scale = np.abs(expected).max(-1, keepdims=True) if expected.size else expected
    bound = ulps * 2 * UNIT[dtype] * np.abs(expected) + rel_rows * row_scale
    err = np.abs(a - expected)
    assert (err <= bound).all(), f"max err {err.max()} vs bound {bound[err > bound].min()}"


def assert_dx_close(dx, x, w, dy, rstd, dtype, zero_centered_gamma=False):
    """The C++ kernels' derived dx bound (docs/rmsnorm.md), from the saved
    fp32 rstd: r (2u |g dy| + |xhat| (3u |m| + (H/4 + 16) u mean|g dy xhat|))
    + (2u + u_dx) |dx64|, times 1.5. Rows where x r is close to +-1 for
    every element (H = 1) cancel: the bound follows the terms, not dx."""
    x64, w64, dy64 = to_f64(x), to_f64(w), to_f64(dy)
    r = to_f64(rstd).reshape(x64.shape[:-1] + (1,))
    g = 1.0 + w64 if zero_centered_gamma else w64
    xhat = x64 * r
    gdy = g * dy64
    m = (gdy * xhat).mean(-1, keepdims=True)
    dx64 = r * (gdy - xhat * m)
    h = x64.shape[-1]
    bound = 1.5 * (r * (2 * U * np.abs(gdy) + np.abs(xhat) * (
        3 * U * np.abs(m) + (h / 4 + 16) * U * np.abs(gdy * xhat).mean(-1, keepdims=True)))
        + (2 * U + 2 * UNIT[dtype]) * np.abs(dx64))
    err = np.abs(to_f64(dx) - dx64)
    assert (err <= bound).all(), f"max err {err.max()} vs bound {bound[err > bound].min()}"


def inputs(shape, dtype, gen, w_dtype=None, scale=1.0):
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    w = (torch.rand(shape[-1], generator=gen, dtype=torch.float64) + 0.5).to(w_dtype or dtype)
    dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return x, w, dy


SHAPES = [(3, 7), (2, 5, 64), (0, 16), (1, 1), (4, 1000), (2, 9000)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_forward_vs_oracle_and_cpu_path(dtype, shape, zero_centered_gamma, torch_gen):
    # Small inputs and a large eps: an ignored eps would fail the bounds.
    x, w, dy = inputs(shape, dtype, torch_gen, scale=1e-2)
    eps = 1e-4
    with triton_common.count_launches() as launches:
        y, rstd = t_forward(x, w, eps, zero_centered_gamma)
    assert sum(launches.values()) == (1 if x.numel() else 0)
    y64, r64, *_ = oracle(x, w, dy, eps, zero_centered_gamma)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == x.shape[:-1]
    assert_close(rstd, r64, torch.float32, rel_rows=0, ulps=64)
    assert_close(y, y64, dtype)
    y_cpu, _ = leanstep.rms_norm(x, w, eps, zero_centered_gamma)
    assert_close(y_cpu, y64, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 9000)])
def test_cast_then_scale_and_mixed_weight_dtype(dtype, shape, torch_gen):
    x, w, dy = inputs(shape, dtype, torch_gen, w_dtype=torch.float32)
    for rounding in ("cast_then_scale", "scale_then_cast"):
        y, _ = t_forward(x, w, 1e-6, False, rounding)
        y64, *_ = oracle(x, w, dy, 1e-6, False, rounding)
        assert_close(y, y64, dtype, ulps=3.0 if rounding == "cast_then_scale" else 1.0)
        y_cpu, _ = leanstep.rms_norm(x, w, 1e-6, False, rounding)
        assert_close(y_cpu, y64, dtype, ulps=3.0 if rounding == "cast_then_scale" else 1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 64), (1, 1), (4, 1000), (2, 9000)])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_frozen_backward_is_dx_only_in_one_launch(dtype, shape, zero_centered_gamma, torch_gen):
    x, w, dy = inputs(shape, dtype, torch_gen)
    _, rstd = t_forward(x, w, 1e-5, zero_centered_gamma)
    with triton_common.count_launches() as launches:
        dx, dw = t_backward(dy, x, rstd, w, zero_centered_gamma, False)
    assert dw is None and dict(launches) == {"_backward_kernel": 1}
    assert dx.dtype == dtype
    assert_dx_close(dx, x, w, dy, rstd, dtype, zero_centered_gamma)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (37, 64), (2, 9000), (0, 8)])
def test_trainable_backward_dweight_two_stages(dtype, shape, torch_gen):
    x, w, dy = inputs(shape, dtype, torch_gen)
    _, rstd = t_forward(x, w, 1e-5)
    with triton_common.count_launches() as launches:
        dx, dw = t_backward(dy, x, rstd, w, False, True)
    rows = x.numel() // shape[-1]
    assert sum(launches.values()) == (2 if rows else 0)
    _, _, dx64, dw64, abs_sum = oracle(x, w, dy, 1e-5)
    assert_dx_close(dx, x, w, dy, rstd, dtype)
    bound = 1.5 * ((rows + 4) * U * abs_sum + 2 * UNIT[dtype] * np.abs(dw64))
    assert (np.abs(to_f64(dw) - dw64) <= bound).all()
    # dx is the frozen path's, bit for bit.
    dx_frozen, _ = t_backward(dy, x, rstd, w, False, False)
    assert torch.equal(dx, dx_frozen)


def test_dweight_has_the_same_bits_for_any_grid(monkeypatch, torch_gen):
    x, w, dy = inputs((70, 48), torch.float32, torch_gen)
    _, rstd = t_forward(x, w, 1e-5)
    results = []
    for programs in (1, 3, 10_000):
        monkeypatch.setattr(triton_rmsnorm.tc, "max_programs", lambda device, n=programs: n)
        results.append(t_backward(dy, x, rstd, w, False, True))
    for dx, dw in results[1:]:
        assert torch.equal(dx, results[0][0]) and torch.equal(dw, results[0][1])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning",
                            "ignore:invalid value:RuntimeWarning")
def test_eps_zero_and_a_zero_row_give_nan_as_torch():
    x = torch.zeros(2, 8)
    x[1] = 1.0
    y, rstd = t_forward(x, torch.ones(8), 0.0)
    y, rstd = y.cpu(), rstd.cpu()
    assert torch.isinf(rstd[0]) and torch.isnan(y[0]).all() and torch.equal(y[1], torch.ones(8))


# ---------------------------------------------------------------- leanstep.torch wiring


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["scale_then_cast", "cast_then_scale"])
def test_module_frozen_path_on_triton(dtype, rounding, torch_gen):
    x, _, dy = inputs((6, 96), dtype, torch_gen)
    m = lt.RMSNorm(96, eps=1e-5, dtype=dtype, rounding=rounding, backend="triton",
                   device=DEVICE)
    with torch.no_grad():
        m.weight.copy_(dev(torch.rand(96, generator=torch_gen) + 0.5))
    m.weight.requires_grad_(False)
    xi = dev(x).requires_grad_(True)
    _backend.reset_calls()
    with triton_common.count_launches() as launches:
        y = m(xi)
        y.backward(dev(dy))
    assert dict(launches) == {"_forward_kernel": 1, "_backward_kernel": 1}
    assert m.last_decision["path"] == "frozen_fused" and m.last_decision["backend"] == "triton"
    assert m.weight.grad is None
    y64, _, dx64, _, _ = oracle(x, m.weight, dy, 1e-5, False, rounding)
    assert_close(y.detach(), y64, dtype, ulps=3.0 if rounding == "cast_then_scale" else 1.0)
    assert_close(xi.grad, dx64, dtype)
    reasons = _backend.reasons()
    (forward_reason,) = reasons["rmsnorm.forward"]["triton"][DEVICE.type]
    assert forward_reason == ("forced" if NATIVE else "forced, Triton interpreter")
    assert list(reasons["rmsnorm.backward"]["triton"][DEVICE.type]) == ["frozen: dx only"]


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_function_trainable_weight_gets_its_gradient(zero_centered_gamma, torch_gen):
    x, w, dy = inputs((5, 40), torch.bfloat16, torch_gen)
    xi, wi = dev(x).requires_grad_(True), dev(w).requires_grad_(True)
    y = lt.rms_norm(xi, wi, 1e-5, zero_centered_gamma, backend="triton")
    y.backward(dev(dy))
    _, _, dx64, dw64, abs_sum = oracle(x, w, dy, 1e-5, zero_centered_gamma)
    assert_close(xi.grad, dx64, torch.bfloat16)
    bound = 1.5 * (9 * U * abs_sum + 2 * UNIT[torch.bfloat16] * np.abs(dw64))
    assert (np.abs(to_f64(wi.grad) - dw64) <= bound).all()
    with torch.no_grad():  # no autograd: the forward kernel alone
        y2 = lt.rms_norm(dev(x), dev(w), 1e-5, zero_centered_gamma, backend="triton")
    assert torch.equal(y2, y.detach())


def test_both_entry_points_reach_the_kernels(torch_gen):
    """leanstep.rms_norm / rms_norm_backward with backend="triton" run the same
    kernels as leanstep.torch.rms_norm (it used to refuse: "this op has no
    Triton kernels"): the same bits, counted under triton."""
    x, w, dy = inputs((6, 72), torch.bfloat16, torch_gen)
    _backend.reset_calls()
    y, rstd = leanstep.rms_norm(dev(x), dev(w), 1e-5, backend="triton")
    with torch.no_grad():
        assert torch.equal(y, lt.rms_norm(dev(x), dev(w), 1e-5, backend="triton"))
    dx, dweight = leanstep.rms_norm_backward(dev(dy), dev(x), rstd, dev(w), backend="triton")
    expected = triton_rmsnorm.backward(dev(dy), dev(x), rstd, dev(w))
    assert torch.equal(dx, expected[0]) and torch.equal(dweight, expected[1])
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
    _, _, dx64, _, _ = oracle(x, ref.weight, dy, 1e-6)
    assert_close(x2.grad, dx64, torch.bfloat16)
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
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(leanstep.Error, match=r"rms_norm: argument 'gamma' must have shape \[8\]"):
        triton_rmsnorm.forward(x, torch.ones(7), 1e-6)
    with pytest.raises(leanstep.Error, match=r"argument 'eps' must be finite and >= 0"):
        triton_rmsnorm.forward(x, w, -1.0)


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
