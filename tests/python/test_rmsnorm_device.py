"""RMSNorm's torch-op device backend: numerics on CPU tensors (forced with
backend="torch") against a float64 oracle and the C++ path; the frozen
forward + backward on meta tensors (no host read, dx only, op count); the
same delegation rules and checkpoint layout as on the CPU.

Bounds. rstd is computed in fp32 from an fp32 mean of squares: its error is
a few units of fp32 roundoff u = 2^-24 times log2(H) for the blocked sums
torch uses; 64 u covers H up to 2^10 with margin. y is then one rounding to
its dtype: bound = 1 ulp of y's dtype + 64 u relative. dx subtracts two
terms of the row's scale, so its error is bounded relative to the row's
largest |dx| (64 u), plus 1 ulp of dx's dtype for the final rounding.
"""

import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt
from helpers import FLOAT_DTYPES, UNIT_ROUNDOFF, to_f64
from leanstep.backends import torch_rmsnorm

U = 2.0**-24


def oracle(x, w, dy, eps, zero_centered_gamma=False):
    x64, w64, dy64 = to_f64(x), to_f64(w), to_f64(dy)
    g = 1.0 + w64 if zero_centered_gamma else w64
    r = 1.0 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    xhat = x64 * r
    y = xhat * g
    gdy = g * dy64
    dx = r * (gdy - xhat * (gdy * xhat).mean(-1, keepdims=True))
    return y, r[..., 0], dx


def assert_close(actual, expected, dtype, rel_rows=64 * U, ulps=1.0):
    a = to_f64(actual)
    row_scale = np.abs(expected).max(-1, keepdims=True) if expected.size else expected
    bound = ulps * 2 * UNIT_ROUNDOFF[dtype] * np.abs(expected) + rel_rows * row_scale
    err = np.abs(a - expected)
    assert (err <= bound).all(), f"max err {err.max()} vs bound {bound[err > bound].min()}"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 64), (0, 16), (1, 1000)])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("impl", ["auto", "composite"])
def test_frozen_forward_backward_vs_oracle(dtype, shape, zero_centered_gamma, impl, torch_gen):
    # Small inputs and a large eps: an ignored eps would fail the bounds.
    x = (torch.randn(shape, generator=torch_gen, dtype=torch.float64) * 1e-2).to(dtype)
    w = (torch.rand(shape[-1], generator=torch_gen, dtype=torch.float64) + 0.5).to(dtype)
    dy = torch.randn(shape, generator=torch_gen, dtype=torch.float64).to(dtype)
    eps = 1e-4
    chosen = torch_rmsnorm.implementation(x, w, zero_centered_gamma, "scale_then_cast",
                                          force_composite=impl == "composite")
    y, rstd = torch_rmsnorm.forward(x, w, eps, zero_centered_gamma, impl=chosen)
    dx = torch_rmsnorm.backward_dx(dy, x, rstd, w, zero_centered_gamma,
                                   impl="fused" if chosen == "fused" else "composite")
    y64, r64, dx64 = oracle(x, w, dy, eps, zero_centered_gamma)
    assert y.dtype == dx.dtype == dtype and rstd.dtype == torch.float32
    assert rstd.shape == x.shape[:-1]
    assert_close(rstd, r64, torch.float32, rel_rows=0, ulps=64)
    assert_close(y, y64, dtype)
    assert_close(dx, dx64, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("rounding", ["scale_then_cast", "cast_then_scale"])
def test_module_device_path_agrees_with_the_cpu_kernels(dtype, rounding, torch_gen):
    x = torch.randn(6, 96, generator=torch_gen).to(dtype)
    m = lt.RMSNorm(96, eps=1e-5, dtype=dtype, rounding=rounding)
    with torch.no_grad():
        m.weight.copy_(torch.rand(96, generator=torch_gen) + 0.5)
    m.weight.requires_grad_(False)
    dy = torch.randn(6, 96, generator=torch_gen).to(dtype)
    results = {}
    for backend in (None, "torch"):
        m.backend = backend
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(dy)
        assert m.last_decision["path"] == "frozen_fused"
        assert m.last_decision["backend"] == ("torch" if backend else "cpu")
        assert m.weight.grad is None  # frozen: no weight gradient at all
        results[backend] = (y.detach(), xi.grad)
    y64, _, dx64 = oracle(x, m.weight, dy, 1e-5)
    for y, dx in results.values():
        if rounding == "scale_then_cast":
            assert_close(y, y64, dtype)
        assert_close(dx, dx64, dtype)
    # The two backends differ by at most one rounding of each dtype.
    diff = (results[None][0].double() - results["torch"][0].double()).abs()
    assert (diff <= 2 * 2 * UNIT_ROUNDOFF[dtype] * results[None][0].double().abs()
            + 64 * U).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_forward_backward_on_meta_is_sync_free_dx_only(dtype):
    m = lt.RMSNorm(2048, eps=1e-6, device="meta", dtype=dtype)
    m.weight.requires_grad_(False)
    x = torch.empty(64, 2048, device="meta", dtype=dtype, requires_grad=True)
    dy = torch.empty(64, 2048, device="meta", dtype=dtype)
    with leanstep.audit() as a:
        y = m(x)
        y.backward(dy)
    assert m.last_decision == {"path": "frozen_fused", "reason": "taken", "backend": "torch"}
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    assert a.ops["aten._fused_rms_norm_backward.default"] == 1, a.format_table()
    # On meta torch decomposes the fused forward (one kernel on CUDA): 6 ops
    # in fp32, plus the two casts of its decomposition in bf16.
    limit = 8 if dtype == torch.float32 else 10
    assert a.num_ops <= limit, f"{a.num_ops} ops:\n{a.format_table()}"
    assert x.grad.shape == x.shape


def test_trainable_weight_on_device_delegates_or_gets_its_gradient(torch_gen):
    x = torch.randn(4, 32, generator=torch_gen, requires_grad=True)
    m = lt.RMSNorm(32, eps=1e-6, backend="torch")
    y = m(x)
    y.sum().backward()
    assert m.weight.grad is not None and m.last_decision["backend"] == "torch"
    ref = torch.nn.functional.rms_norm(x.detach(), (32,), torch.ones(32), 1e-6)
    assert torch.allclose(y.detach(), ref, rtol=64 * U, atol=64 * U)
    frozen_only = lt.RMSNorm(32, eps=1e-6, frozen_only=True, device="meta")
    frozen_only(torch.empty(4, 32, device="meta"))
    assert frozen_only.last_decision["path"] == "torch"  # torch's own forward


def test_delegation_rules_are_the_cpu_ones_on_device():
    m = lt.RMSNorm(32, device="meta")
    m.weight.requires_grad_(False)
    handle = m.register_forward_hook(lambda *args: None)
    m(torch.empty(2, 32, device="meta"))
    assert m.last_decision["path"] == "torch"
    assert "debug" in m.last_decision["reason"] or "hook" in m.last_decision["reason"]
    handle.remove()
    m(torch.empty(2, 32, device="meta"))
    assert m.last_decision["path"] == "frozen_fused"


def test_runtime_switch_and_checkpoint_layout():
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    state = {"on": True}
    m = lt.RMSNorm.from_torch(norm, frozen_only=True, enabled=lambda: state["on"])
    assert m.weight is norm.weight
    assert list(m.state_dict()) == list(norm.state_dict())
    m.weight.requires_grad_(False)
    m(torch.randn(2, 16))
    assert m.last_decision["path"] == "frozen_fused"
    state["on"] = False
    m(torch.randn(2, 16))
    assert m.last_decision == {"path": "torch", "reason": "switched_off"}


def test_function_entry_point_and_errors(torch_gen):
    x = torch.randn(3, 8, generator=torch_gen)
    w = torch.rand(8, generator=torch_gen) + 0.5
    y_cpu = lt.rms_norm(x, w, 1e-6)
    y_dev = lt.rms_norm(x, w, 1e-6, backend="torch")
    assert torch.allclose(y_cpu, y_dev, rtol=64 * U, atol=0)
    with pytest.raises(leanstep.Error, match=r"one device.*'x' on cpu and 'weight' on meta"):
        lt.rms_norm(x, w.to("meta"))
    with pytest.raises(leanstep.Error, match=r"backend='cpu' needs CPU tensors"):
        lt.rms_norm(x.to("meta"), w.to("meta"), backend="cpu")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("backend", [None, "torch"])
def test_exact_forward_is_bit_identical_to_torch_rmsnorm(dtype, backend, torch_gen):
    # The Megatron patch builds drop-ins with exact_forward: a frozen norm's
    # forward changes no bit; only the backward (dx only) is leanstep's.
    ref = torch.nn.RMSNorm(320, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(320, generator=torch_gen) + 0.5)
    ref.weight.requires_grad_(False)
    m = lt.RMSNorm.from_torch(ref, frozen_only=True, exact_forward=True, backend=backend)
    x = torch.randn(7, 5, 320, generator=torch_gen).to(dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = ref(x1), m(x2)
    assert torch.equal(y1, y2)
    assert m.last_decision["forward"] == "torch_order"
    dy = torch.randn(7, 5, 320, generator=torch_gen).to(dtype)
    y1.backward(dy)
    y2.backward(dy)
    _, _, dx64 = oracle(x, ref.weight, dy, 1e-6)
    assert_close(x2.grad, dx64, dtype)
    assert_close(x1.grad, dx64, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weight_requires_grad", [False, True])
def test_functional_entry_points_take_the_device_backend(dtype, weight_requires_grad, torch_gen):
    x = torch.randn(5, 40, generator=torch_gen).to(dtype)
    w = (torch.rand(40, generator=torch_gen) + 0.5).to(dtype)
    dy = torch.randn(5, 40, generator=torch_gen).to(dtype)
    y_cpu, r_cpu = leanstep.rms_norm(x, w, 1e-5)
    y_dev, r_dev = leanstep.rms_norm(x, w, 1e-5, backend="torch")
    y64, r64, dx64 = oracle(x, w, dy, 1e-5)
    assert_close(y_dev, y64, dtype)
    assert_close(r_dev, r64, torch.float32, rel_rows=0, ulps=64)
    dx, dw = leanstep.rms_norm_backward(dy, x, r_dev, w, weight_requires_grad=weight_requires_grad,
                                        backend="torch")
    assert_close(dx, dx64, dtype)
    dx_cpu, dw_cpu = leanstep.rms_norm_backward(dy, x, r_cpu, w,
                                                weight_requires_grad=weight_requires_grad)
    if weight_requires_grad:
        dw64 = (to_f64(dy) * to_f64(x) * r64[..., None]).sum(0)
        assert_close(dw, dw64[None, :], dtype, rel_rows=64 * U * 5)
    else:
        assert dw is None and dw_cpu is None
    # On meta every entry point completes with no host read.
    with leanstep.audit() as a:
        ym, rm = leanstep.rms_norm(x.to("meta"), w.to("meta"), 1e-5)
        leanstep.rms_norm_backward(dy.to("meta"), x.to("meta"), rm, w.to("meta"),
                                   weight_requires_grad=weight_requires_grad)
    assert a.num_syncs == 0 and ym.device.type == "meta"
