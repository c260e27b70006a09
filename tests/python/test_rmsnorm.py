"""leanstep.rms_norm / rms_norm_backward and leanstep.torch.RMSNorm against a
float64 oracle and against torch, on torch (fp32/fp16/bf16) and NumPy inputs."""

import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt
from helpers import FLOAT_DTYPES, UNIT_ROUNDOFF, assert_within_ulps, randn, to_f64

pytestmark = pytest.mark.skipif("rmsnorm" not in leanstep.areas, reason="rmsnorm not built")


def oracle_forward(x, w, eps, zero_centered):
    x64, w64 = to_f64(x), to_f64(w)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1) + eps)
    g = 1.0 + w64 if zero_centered else w64
    return x64 * r[..., None] * g, r


def oracle_backward(dy, x, w, eps, zero_centered):
    x64, dy64, w64 = to_f64(x), to_f64(dy), to_f64(w)
    r = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    g = 1.0 + w64 if zero_centered else w64
    xhat = x64 * r
    gdy = g * dy64
    dx = r * (gdy - xhat * np.mean(gdy * xhat, axis=-1, keepdims=True))
    dw = (dy64 * xhat).reshape(-1, x64.shape[-1]).sum(axis=0)
    return dx, dw


# Shapes: odd sizes, a 3-D batch, a single row, a hidden size above one SIMD
# vector and not a multiple of it.
SHAPES = [(7, 29), (3, 5, 67), (1, 8), (16, 541)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_forward_matches_float64_oracle(dtype, shape, zero_centered, torch_gen):
    x = randn(shape, dtype, torch_gen, scale=3.0)
    w = randn(shape[-1:], dtype, torch_gen, scale=0.5) + (0 if zero_centered else 1)
    eps = 1e-5
    y, rstd = leanstep.rms_norm(x, w, eps, zero_centered_gamma=zero_centered)
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == x.shape[:-1]
    y64, r64 = oracle_forward(x, w, eps, zero_centered)
    # rstd: fp32 sum of H squares (error <= ~H * u32 worst case, far less with
    # pairwise/SIMD sums) then rsqrt; 64 * u32 covers H <= 541 comfortably.
    assert_within_ulps(rstd, r64, torch.float32, ulps=32)
    if dtype == torch.float32:
        # Same fp32 statistics error, plus two fp32 products.
        assert_within_ulps(y, y64, dtype, ulps=40, atol=1e-30)
    else:
        # "scale then cast": computed in fp32, rounded once -> within 1 ulp of
        # the correctly rounded value (the fp32 error is ~1e-6 relative, far
        # below half an ulp of fp16/bf16). atol covers fp16 subnormal outputs.
        assert_within_ulps(y, y64, dtype, ulps=1, atol=2.0**-24)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_eps_is_applied(dtype, zero_centered, torch_gen):
    """Inputs whose mean square is comparable to eps: an implementation that ignored
    eps (or used another value) is off by far more than the tolerance. With x ~ N(0, 1)
    an eps of 1e-5 is below an fp16/bf16 ulp, so the other tests cannot see it."""
    shape = (9, 67)
    x = randn(shape, dtype, torch_gen, scale=3e-3)  # mean(x^2) ~ 1e-5
    w = randn(shape[-1:], dtype, torch_gen, scale=0.5) + (0 if zero_centered else 1)
    eps = 1e-5
    y, rstd = leanstep.rms_norm(x, w, eps, zero_centered_gamma=zero_centered)
    y64, r64 = oracle_forward(x, w, eps, zero_centered)
    y_no_eps, r_no_eps = oracle_forward(x, w, 0.0, zero_centered)
    assert_within_ulps(rstd, r64, torch.float32, ulps=4)
    ulps = 40 if dtype == torch.float32 else 1
    atol = 1e-30 if dtype == torch.float32 else 2.0**-24
    assert_within_ulps(y, y64, dtype, ulps=ulps, atol=atol)
    # The same check against eps = 0 must fail: eps changes rstd by a factor ~sqrt(2).
    assert np.abs(r_no_eps / r64 - 1).min() > 0.05
    with pytest.raises(AssertionError):
        assert_within_ulps(y, y_no_eps, dtype, ulps=ulps, atol=atol)
    # Backward through rstd: dx against the eps oracle, not the eps = 0 one.
    dy = randn(shape, dtype, torch_gen)
    dx, _ = leanstep.rms_norm_backward(dy, x, rstd, w, zero_centered_gamma=zero_centered)
    dx64, _ = oracle_backward(dy, x, w, eps, zero_centered)
    dx_no_eps, _ = oracle_backward(dy, x, w, 0.0, zero_centered)
    scale_dx = np.abs(dx64).max()
    dx_atol = (67 * UNIT_ROUNDOFF[torch.float32] * scale_dx
               + (0 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype] * scale_dx))
    assert_within_ulps(dx, dx64, dtype, ulps=1, atol=dx_atol)
    with pytest.raises(AssertionError):
        assert_within_ulps(dx, dx_no_eps, dtype, ulps=1, atol=dx_atol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_then_scale_matches_hf_llama_composite(dtype, torch_gen):
    x = randn((9, 131), dtype, torch_gen, scale=2.0)
    w = randn((131,), dtype, torch_gen, scale=0.3) + 1
    eps = 1e-6
    y, _ = leanstep.rms_norm(x, w, eps, rounding="cast_then_scale")
    # HF LlamaRMSNorm: normalise in fp32, cast to the input dtype, then multiply
    # by the weight in the weight's dtype (two roundings).
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    # The inner fp32 normalisation may differ by a few fp32 ulps (rsqrt vs
    # 1/sqrt), which can flip the first rounding: allow 1 ulp of that rounding
    # propagated through the product, plus 1 ulp of the product's rounding.
    assert_within_ulps(y, to_f64(hf), dtype, ulps=2)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_forward_matches_torch_rms_norm(dtype, torch_gen):
    x = randn((33, 257), dtype, torch_gen)
    w = randn((257,), dtype, torch_gen, scale=0.1) + 1
    y, _ = leanstep.rms_norm(x, w, 1e-6)
    ref = torch.nn.functional.rms_norm(x, (257,), w, 1e-6)
    # torch's CPU kernel also computes in fp32 and rounds once; both are within
    # 1 ulp of the exact value, so they differ by at most 2 ulps (fp32: both
    # carry a few fp32 ulps of statistics error).
    ulps = 64 if dtype == torch.float32 else 2
    assert_within_ulps(y, to_f64(ref), dtype, ulps=ulps, atol=1e-30)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_backward_matches_float64_oracle(dtype, zero_centered, torch_gen):
    shape = (13, 97)
    x = randn(shape, dtype, torch_gen)
    w = randn(shape[-1:], dtype, torch_gen, scale=0.5) + (0 if zero_centered else 1)
    dy = randn(shape, dtype, torch_gen)
    eps = 1e-6
    _, rstd = leanstep.rms_norm(x, w, eps, zero_centered_gamma=zero_centered)
    dx, dw = leanstep.rms_norm_backward(dy, x, rstd, w, zero_centered_gamma=zero_centered)
    dx64, dw64 = oracle_backward(dy, x, w, eps, zero_centered)
    assert dx.dtype == dtype and dw.dtype == dtype
    # dx: fp32 math with one cancellation (g*dy - xhat*mean): absolute error
    # ~ H * u32 * max|dx|, then one rounding to the dtype.
    scale_dx = np.abs(dx64).max()
    assert_within_ulps(dx, dx64, dtype, ulps=1, atol=97 * UNIT_ROUNDOFF[torch.float32] * scale_dx
                       + (0 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype] * scale_dx))
    # dweight: sum over 13 rows in fp32, then one rounding.
    scale_dw = np.abs(to_f64(dy) * to_f64(x)).sum(axis=0).max() * np.abs(to_f64(rstd)).max()
    assert_within_ulps(dw, dw64, dtype, ulps=1, atol=16 * UNIT_ROUNDOFF[torch.float32] * scale_dw)

    # Frozen weight: no dweight, and dx bit-identical to the trainable dx.
    dx_frozen, dw_frozen = leanstep.rms_norm_backward(dy, x, rstd, w, zero_centered_gamma=zero_centered,
                                                      weight_requires_grad=False)
    assert dw_frozen is None
    assert torch.equal(dx_frozen, dx)


def test_reference_impl_agrees_with_fused(torch_gen):
    x = randn((11, 203), torch.bfloat16, torch_gen)
    w = randn((203,), torch.bfloat16, torch_gen) + 1
    y_fast, r_fast = leanstep.rms_norm(x, w, 1e-5)
    y_ref, r_ref = leanstep.rms_norm(x, w, 1e-5, impl="reference")
    # Different summation orders of the fp32 statistics (a few fp32 ulps) can
    # flip one bf16 rounding: 1 bf16 ulp.
    assert_within_ulps(r_fast, to_f64(r_ref), torch.float32, ulps=32)
    assert_within_ulps(y_fast, to_f64(y_ref), torch.bfloat16, ulps=1)


def test_numpy_inputs_give_numpy_outputs(rng):
    x = rng.standard_normal((6, 40)).astype(np.float32)
    w = (rng.standard_normal(40) * 0.1 + 1).astype(np.float32)
    y, rstd = leanstep.rms_norm(x, w, 1e-6)
    assert isinstance(y, np.ndarray) and isinstance(rstd, np.ndarray)
    y64, r64 = oracle_forward(x, w, 1e-6, False)
    assert_within_ulps(y, y64, torch.float32, ulps=40)
    dy = rng.standard_normal((6, 40)).astype(np.float16)
    x16 = x.astype(np.float16)
    _, r16 = leanstep.rms_norm(x16, w, 1e-6)
    dx, dw = leanstep.rms_norm_backward(dy, x16, r16, w)
    assert isinstance(dx, np.ndarray) and dx.dtype == np.float16 and dw.dtype == np.float32


def test_out_and_in_place_write_the_callers_memory(torch_gen):
    x = randn((5, 64), torch.float32, torch_gen)
    w = torch.ones(64)
    expected, _ = leanstep.rms_norm(x, w, 1e-6)
    out = torch.empty_like(x)
    y, _ = leanstep.rms_norm(x, w, 1e-6, out=out)
    assert y.data_ptr() == out.data_ptr() and torch.equal(out, expected)
    ptr = x.data_ptr()
    y, _ = leanstep.rms_norm(x, w, 1e-6, out=x)  # in place
    assert y.data_ptr() == ptr and torch.equal(x, expected)


def test_empty_rows(torch_gen):
    x = torch.empty((0, 16), dtype=torch.bfloat16)
    y, rstd = leanstep.rms_norm(x, torch.ones(16), 1e-6)
    assert y.shape == (0, 16) and rstd.shape == (0,)


def test_errors_are_leanstep_errors_with_the_rule():
    x = torch.randn(4, 8)
    with pytest.raises(leanstep.Error, match="'eps' must be finite and >= 0"):
        leanstep.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(leanstep.Error, match="'gamma' must have shape \\[8\\]"):
        leanstep.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(leanstep.Error, match="must be contiguous"):
        leanstep.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(leanstep.Error, match="out"):
        leanstep.rms_norm(x, torch.ones(8), 1e-6, out=torch.empty(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError):  # leanstep.Error is a ValueError
        leanstep.rms_norm(x, torch.ones(8), 1e-6, rounding="sideways")


# ---------------------------------------------------------------- leanstep.torch.RMSNorm


def make_pair(hidden, dtype, gen, eps=1e-6):
    ref = torch.nn.RMSNorm(hidden, eps=eps, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(randn((hidden,), dtype, gen, scale=0.2) + 1)
    ours = lt.RMSNorm(hidden, eps=eps, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_module_is_a_drop_in():
    ours = lt.RMSNorm(32, eps=1e-5)
    assert isinstance(ours, torch.nn.RMSNorm)
    assert list(ours.state_dict()) == list(torch.nn.RMSNorm(32).state_dict())
    assert ours.normalized_shape == (32,) and ours.eps == 1e-5


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("frozen", [True, False])
def test_module_forward_backward_match_torch(dtype, frozen, torch_gen):
    ref, ours = make_pair(96, dtype, torch_gen)
    for m in (ref, ours):
        m.weight.requires_grad_(not frozen)
    x = randn((4, 7, 96), dtype, torch_gen)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr, yo = ref(xr), ours(xo)
    assert ours.last_decision["path"] == ("frozen_fused" if frozen else "general")
    ulps = 64 if dtype == torch.float32 else 2
    assert_within_ulps(yo, to_f64(yr), dtype, ulps=ulps, atol=1e-30)
    dy = randn(x.shape, dtype, torch_gen)
    yr.backward(dy)
    yo.backward(dy)
    gscale = np.abs(to_f64(xr.grad)).max()
    # torch's backward (fp32 math for narrow dtypes) and ours agree to the fp32
    # cancellation error plus one rounding of each.
    assert_within_ulps(xo.grad, to_f64(xr.grad), dtype, ulps=2,
                       atol=96 * UNIT_ROUNDOFF[torch.float32] * gscale
                       + (0 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype] * gscale))
    if frozen:
        assert ours.weight.grad is None
    else:
        # dweight[j] = sum over the 28 rows of dy * xhat: each side's fp32 sum is within
        # (28 + 2) u32 * sum |dy * xhat| of the exact value (per element, not the global
        # max), so the two differ by at most twice that; then one rounding each to the dtype.
        x64 = to_f64(x).reshape(-1, 96)
        xhat = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + ours.eps)
        abs_sum = np.abs(to_f64(dy).reshape(-1, 96) * xhat).sum(axis=0)
        wgrad = to_f64(ref.weight.grad)
        assert_within_ulps(ours.weight.grad, wgrad, dtype, ulps=2,
                           atol=2 * 30 * UNIT_ROUNDOFF[torch.float32] * abs_sum
                           + (0 if dtype == torch.float32 else 2 * UNIT_ROUNDOFF[dtype] * np.abs(wgrad)))


def test_module_frozen_path_skips_weight_grad_and_records_stats(torch_gen):
    _, ours = make_pair(64, torch.bfloat16, torch_gen)
    ours.weight.requires_grad_(False)
    leanstep.reset_paths()
    x = randn((8, 64), torch.bfloat16, torch_gen).requires_grad_()
    ours(x).sum().backward()
    # Counted by the dispatch registry, as C++ callers are.
    ops = leanstep.paths()["ops"]
    forward = {s["impl"]: s["calls"] for s in ops["rmsnorm.forward"]["cpu"]["stats"]}
    backward = {s["impl"]: s["calls"] for s in ops["rmsnorm.backward"]["cpu"]["stats"]}
    assert forward == {"fused": 1, "reference": 0}, forward
    assert backward == {"frozen_fused": 1, "reference": 0}, backward
    assert x.grad is not None


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_module_delegates_features_to_torch(torch_gen):
    ref, ours = make_pair(48, torch.float32, torch_gen)
    ours.weight.requires_grad_(False)
    x = randn((3, 48), torch.float32, torch_gen)
    handle = ours.register_forward_hook(lambda *a: None)
    y = ours(x)
    handle.remove()
    assert ours.last_decision["path"] == "torch" and "debug_hooks" in ours.last_decision["reason"]
    assert torch.equal(y, ref(x))  # exactly torch's own forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours(x)
    assert ours.last_decision["path"] == "torch" and "autocast" in ours.last_decision["reason"]
    ours(x.double())  # a dtype leanstep does not take
    assert ours.last_decision == {"path": "torch", "reason": "dtype"}
    ours(x)
    assert ours.last_decision["path"] == "frozen_fused"


def test_module_zero_centered_gamma(torch_gen):
    m = lt.RMSNorm(40, eps=1e-6, zero_centered_gamma=True)
    assert torch.equal(m.weight, torch.zeros(40))  # g = 1 + 0
    with torch.no_grad():
        m.weight.copy_(randn((40,), torch.float32, torch_gen, scale=0.1))
    x = randn((5, 40), torch.float32, torch_gen)
    y64, _ = oracle_forward(x, m.weight, 1e-6, True)
    assert_within_ulps(m(x), y64, torch.float32, ulps=40)


def test_functional_rms_norm_gradients(torch_gen):
    x = randn((6, 33), torch.float32, torch_gen).requires_grad_()
    w = (randn((33,), torch.float32, torch_gen, scale=0.1) + 1).requires_grad_()
    dy = randn((6, 33), torch.float32, torch_gen)
    lt.rms_norm(x, w, 1e-6).backward(dy)
    dx64, dw64 = oracle_backward(dy, x, w, 1e-6, False)
    assert_within_ulps(x.grad, dx64, torch.float32, ulps=1, atol=33 * 2**-24 * np.abs(dx64).max())
    assert_within_ulps(w.grad, dw64, torch.float32, ulps=1, atol=8 * 2**-24 * np.abs(dw64).max() * 6)
