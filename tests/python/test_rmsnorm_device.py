"""RMSNorm's torch-op device backend: what the conformance harness
(test_conformance.py) does not hold. The harness holds the values of
leanstep.rms_norm / rms_norm_backward with backend="torch" on CPU tensors
and their shapes with no host read on meta tensors; here: the
leanstep.torch module and function on that backend (the path each call
takes, the frozen weight without a gradient, delegation to torch, the
checkpoint layout), the frozen forward + backward's op count on meta, and
the errors. Values are held to the harness's float64 oracle with the
tolerance table's bounds (rmsnorm.y, rmsnorm.dx).
"""

import pytest
import torch

import leanstep
import leanstep.torch as lt
from test_conformance import FLOATS, NORM_DTYPES, assert_rmsnorm_backward, \
    assert_rmsnorm_forward, rmsnorm_inputs

DTYPES = [FLOATS[d] for d in NORM_DTYPES]


def saved_rstd(x, w, eps, backend):
    """The rstd the forward of `backend` saves (its dx's input)."""
    return leanstep.rms_norm(x, w, eps, backend=backend)[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["scale_then_cast", "cast_then_scale"])
def test_module_device_path_agrees_with_the_cpu_kernels(dtype, rounding, torch_gen):
    x, w, dy = rmsnorm_inputs((6, 96), dtype, torch_gen, scale=1.0)
    m = lt.RMSNorm(96, eps=1e-5, dtype=dtype, rounding=rounding)
    with torch.no_grad():
        m.weight.copy_(w)
    m.weight.requires_grad_(False)
    for backend in (None, "torch"):
        m.backend = backend
        xi = x.clone().requires_grad_(True)
        y = m(xi)
        y.backward(dy)
        assert m.last_decision["path"] == "frozen_fused"
        assert m.last_decision["backend"] == ("torch" if backend else "cpu")
        assert m.weight.grad is None  # frozen: no weight gradient at all
        assert_rmsnorm_forward(y.detach(), x, m.weight, 1e-5, rounding=rounding)
        rstd = saved_rstd(x, m.weight, 1e-5, backend or "cpu")
        assert_rmsnorm_backward(xi.grad, dy, x, rstd, m.weight)


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
    w = m.weight.detach()
    assert_rmsnorm_forward(y.detach(), x.detach(), w, 1e-6)
    assert_rmsnorm_backward(x.grad, torch.ones(4, 32), x.detach(),
                            saved_rstd(x.detach(), w, 1e-6, "torch"), w, dweight=m.weight.grad,
                            trainable=True)
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
    x, w, _ = rmsnorm_inputs((3, 8), torch.float32, torch_gen, scale=1.0)
    for backend in (None, "torch"):
        assert_rmsnorm_forward(lt.rms_norm(x, w, 1e-6, backend=backend), x, w, 1e-6)
    with pytest.raises(leanstep.Error, match=r"one device.*'x' on cpu and 'weight' on meta"):
        lt.rms_norm(x, w.to("meta"))
    with pytest.raises(leanstep.Error, match=r"backend='cpu' needs CPU tensors"):
        lt.rms_norm(x.to("meta"), w.to("meta"), backend="cpu")


@pytest.mark.parametrize("dtype", DTYPES)
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
    # Both dx from the rstd of torch's forward (the one both save).
    rstd = torch.ops.aten._fused_rms_norm(x, [320], ref.weight, 1e-6)[1]
    assert_rmsnorm_backward(x2.grad, dy, x, rstd, ref.weight)
    assert_rmsnorm_backward(x1.grad, dy, x, rstd, ref.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_device_with_native_fused_autograd_runs_torchs_op_decided_once(dtype, monkeypatch):
    """Where torch's fused op has the device's own kernels and derivative
    (CUDA), the frozen call is that op under autograd: no Python autograd
    Function, dx only. Forced here on meta (whose forward is a composite).
    The module decides once: the second call takes the cached path, counted
    and explained the same way; a hook sends a call back to the full path."""
    from leanstep.backends import torch_rmsnorm

    monkeypatch.setattr(torch_rmsnorm, "fused_has_native_autograd", lambda device_type: True)
    m = lt.RMSNorm(256, eps=1e-6, device="meta", dtype=dtype).requires_grad_(False)
    x = torch.empty(8, 256, device="meta", dtype=dtype, requires_grad=True)
    dy = torch.empty(8, 256, device="meta", dtype=dtype)
    before = leanstep.paths()["ops"]["rmsnorm.forward"].get("calls", {}).get("torch", {})
    decided = None
    for call in range(2):
        with leanstep.audit() as a:
            y = m(x)
            assert y.grad_fn is not None and "Backward" in type(y.grad_fn).__name__
            assert not isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)
            y.backward(dy)
        assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
        assert m.weight.grad is None and x.grad.shape == x.shape
        assert m.last_decision["backend"] == "torch"
        # decided by the first call, taken (not made again) by the second
        assert decided is None or m.__dict__["_lean"] is decided
        decided = m.__dict__["_lean"]
    after = leanstep.paths()["ops"]["rmsnorm.forward"]["calls"]["torch"]
    assert after.get("meta", 0) - before.get("meta", 0) == 2
    assert decided.run(m, x) is not None
    handle = m.register_forward_pre_hook(lambda mod, args: None)
    try:
        assert decided.run(m, x) is None  # a hook: the full path decides
    finally:
        handle.remove()
    # What an automatic device choice also depends on: LEANSTEP_TRITON and the preset.
    monkeypatch.setenv("LEANSTEP_TRITON", "off")
    assert decided.run(m, x) is None
    monkeypatch.delenv("LEANSTEP_TRITON")
    previous = leanstep.preset()
    leanstep.set_preset("baseline")
    try:
        assert decided.run(m, x) is None
    finally:
        leanstep.set_preset(previous)
    assert decided.run(m, x) is not None


def test_exact_forward_modules_take_torchs_op_decided_once_on_such_a_device(monkeypatch):
    """The modules leanstep.megatron converts norms into (exact_forward): on a
    device with torch's native fused autograd, torch's op itself (its forward
    is the promise), decided once; no Python autograd Function."""
    from leanstep.backends import torch_rmsnorm

    monkeypatch.setattr(torch_rmsnorm, "fused_has_native_autograd", lambda device_type: True)
    m = lt.RMSNorm(128, eps=1e-6, device="meta", exact_forward=True).requires_grad_(False)
    x = torch.empty(4, 128, device="meta", requires_grad=True)
    decided = None
    for _ in range(2):
        y = m(x)
        assert not isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)
        y.backward(torch.empty(4, 128, device="meta"))
        assert m.weight.grad is None and m.last_decision["forward"] == "torch_order"
        assert decided is None or m.__dict__["_lean"] is decided
        decided = m.__dict__["_lean"]


def test_the_automatic_choice_prefers_torchs_fused_kernels_to_triton(monkeypatch):
    """Measured on an H200: torch's fused CUDA RMSNorm beats leanstep's Triton
    kernels (see _TORCH_FUSED_WHY). Where the automatic choice would be
    Triton and torch has native fused kernels for the call, torch's run;
    conventions torch has no kernel for, and a forced backend, keep Triton."""
    from leanstep import _registry
    from leanstep.backends import torch_rmsnorm

    monkeypatch.setattr(torch_rmsnorm, "fused_has_native_autograd", lambda device_type: True)
    monkeypatch.setattr(lt, "_fused_measured_faster", lambda device_type: True)  # meta as CUDA
    asked = []

    def choose(op, tensors, names, backend, where, **kw):
        asked.append(backend)
        return (backend, "forced") if backend else ("triton", "auto")

    monkeypatch.setattr(_registry, "choose", choose)
    monkeypatch.setattr(_registry, "module", lambda op, backend: backend)
    x = torch.empty(4, 64, device="meta", dtype=torch.bfloat16)
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    route = lt._route_rmsnorm
    assert route(x, w, False, "scale_then_cast", None, "t")[:2] == ("torch", lt._TORCH_FUSED_WHY)
    assert asked == ["torch"]  # the arguments checked, no automatic choice (no self-check)
    monkeypatch.setenv("LEANSTEP_TRITON", "off")
    assert route(x, w, False, "scale_then_cast", None, "t")[0] == "triton"  # the choice's own
    monkeypatch.delenv("LEANSTEP_TRITON")
    assert route(x, w, True, "scale_then_cast", None, "t")[0] == "triton"  # zero-centered
    assert route(x, w, False, "cast_then_scale", None, "t")[0] == "triton"
    assert route(x, w.float(), False, "scale_then_cast", None, "t")[0] == "triton"
    assert route(x, w, False, "scale_then_cast", "triton", "t")[0] == "triton"  # forced
