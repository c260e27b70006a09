"""RMSNorm in PyTorch ops, for tensors on any torch device.

The frozen path (weight without a gradient, LoRA) computes dx only:

- ``aten._fused_rms_norm`` / ``aten._fused_rms_norm_backward`` with
  output_mask ``[True, False]`` where this torch build has kernels for the
  device (CUDA, and meta for tests): one launch forward, one backward, no
  weight-gradient reduction;
- ``torch_npu.npu_rms_norm`` forward on npu tensors when torch_npu is
  imported (it returns rstd too), with the composite dx below;
- otherwise a composite formula in fp32:
  ``dx = r * (g*dy - xhat * mean(g*dy*xhat))``, ``xhat = x*r``.

Semantics are the CPU path's (docs/rmsnorm.md): rstd fp32 per row,
``y = cast(x * r * g)`` ("scale_then_cast") or ``cast(g * cast(x * r))``
("cast_then_scale"), ``g = 1 + weight`` with zero_centered_gamma. Nothing is
read back to the host.
"""

import sys

import torch

from .._rules import check_rms_norm, check_rms_norm_backward

_FUSED_FORWARD = "aten::_fused_rms_norm"
_FUSED_BACKWARD = "aten::_fused_rms_norm_backward"
_DISPATCH_KEYS = {"cuda": "CUDA", "meta": "Meta", "xpu": "XPU", "mps": "MPS", "cpu": "CPU",
                  "npu": "PrivateUse1"}
_fused_cache = {}


def fused_available(device_type):
    """Whether this torch build has both fused RMSNorm kernels for the device."""
    hit = _fused_cache.get(device_type)
    if hit is None:
        key = _DISPATCH_KEYS.get(device_type)
        has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
        # The forward may be a composite (it then decomposes on that device,
        # still without a host read); the backward needs a kernel of its own.
        hit = bool(key and has and hasattr(torch.ops.aten, "_fused_rms_norm_backward")
                   and (has(_FUSED_FORWARD, key)
                        or has(_FUSED_FORWARD, "CompositeImplicitAutograd"))
                   and has(_FUSED_BACKWARD, key))
        _fused_cache[device_type] = hit
    return hit


_native_autograd_cache = {}


def fused_has_native_autograd(device_type):
    """Whether ``aten._fused_rms_norm`` called under autograd on this device
    runs the device's own forward kernel and, through its derivative, the
    fused backward (CUDA): then it needs no Python autograd Function, and a
    frozen weight gets dx only (autograd's output mask). Where the forward is
    a composite (the CPU, meta), autograd differentiates its decomposition
    instead, so the dx-only Function stays."""
    hit = _native_autograd_cache.get(device_type)
    if hit is None:
        key = _DISPATCH_KEYS.get(device_type)
        has = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
        hit = bool(key and has and fused_available(device_type) and has(_FUSED_FORWARD, key))
        _native_autograd_cache[device_type] = hit
    return hit


def _npu_rms_norm():
    torch_npu = sys.modules.get("torch_npu")
    return getattr(torch_npu, "npu_rms_norm", None) if torch_npu is not None else None


def implementation(x, weight, zero_centered_gamma, rounding, force_composite=False):
    """Which kernel the frozen path runs for these arguments: "fused", "npu"
    or "composite"."""
    if force_composite or rounding != "scale_then_cast":
        return "composite"
    if x.device.type == "npu" and _npu_rms_norm() is not None and weight.dtype == x.dtype:
        return "npu"
    if fused_available(x.device.type) and weight.dtype == x.dtype and not zero_centered_gamma:
        return "fused"
    return "composite"


def _gamma(weight, zero_centered_gamma):
    g = weight.float()
    return g + 1.0 if zero_centered_gamma else g


def forward(x, weight, eps, zero_centered_gamma=False, rounding="scale_then_cast", impl=None):
    """Returns ``(y, rstd)``: y in x's dtype and shape, rstd fp32 of shape
    ``x.shape[:-1]``."""
    y, rstd = forward_keepdim(x, weight, eps, zero_centered_gamma, rounding, impl)
    return y, rstd.squeeze(-1)


def forward_keepdim(x, weight, eps, zero_centered_gamma=False, rounding="scale_then_cast",
                    impl=None):
    """As :func:`forward`, with rstd of shape ``x.shape[:-1] + (1,)`` (the
    fused kernels' own layout, so no reshape runs between forward and backward)."""
    check_rms_norm(x, weight, eps, zero_centered_gamma, rounding)
    impl = impl or implementation(x, weight, zero_centered_gamma, rounding)
    hidden = x.shape[-1]
    if impl == "fused":
        return torch.ops.aten._fused_rms_norm(x, [hidden], weight, eps)
    if impl == "npu":
        y, rstd = _npu_rms_norm()(x, weight, epsilon=eps)
        return y, rstd.reshape(*x.shape[:-1], 1).float()
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    g = _gamma(weight, zero_centered_gamma)
    if rounding == "cast_then_scale":
        y = (g * (xf * rstd).to(x.dtype).float()).to(x.dtype)
    else:
        y = (xf * rstd * g).to(x.dtype)
    return y, rstd


def backward_dx(dy, x, rstd, weight, zero_centered_gamma=False, impl=None):
    """dx only (the frozen weight gets no gradient, and no cross-row work
    runs). rstd has shape ``x.shape[:-1]`` or ``x.shape[:-1] + (1,)``."""
    if rstd.dim() < x.dim():
        rstd = rstd.unsqueeze(-1)
    if impl == "fused":
        dx, _ = torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, weight,
                                                         [True, False])
        return dx
    xf = x.float()
    r = rstd
    xhat = xf * r
    gdy = dy.float() * _gamma(weight, zero_centered_gamma)
    dx = r * (gdy - xhat * (gdy * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype)


def backward(dy, x, rstd, weight, zero_centered_gamma=False, weight_requires_grad=True):
    """Returns ``(dx, dweight)``, dweight None when the weight is frozen; the
    trainable case reduces dweight in fp32 over all rows."""
    check_rms_norm_backward(dy, x, rstd, weight, weight_requires_grad)
    if not weight_requires_grad:
        impl = "fused" if (fused_available(x.device.type) and weight.dtype == x.dtype
                           and not zero_centered_gamma) else "composite"
        return backward_dx(dy, x, rstd, weight, zero_centered_gamma, impl), None
    xhat = x.float() * (rstd.unsqueeze(-1) if rstd.dim() < x.dim() else rstd)
    dweight = (dy.float() * xhat).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    return backward_dx(dy, x, rstd, weight, zero_centered_gamma, "composite"), dweight


class FrozenRMSNorm(torch.autograd.Function):
    """y = rms_norm(x, weight) with a frozen weight: backward gives dx only."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, rounding):
        impl = implementation(x, weight, zero_centered_gamma, rounding)
        y, rstd = forward_keepdim(x, weight, eps, zero_centered_gamma, rounding, impl)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        # The fused backward pairs with the fused forward's rstd; an npu or
        # composite forward uses the composite dx.
        ctx.impl = "fused" if impl == "fused" else "composite"
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx = backward_dx(dy if dy.is_contiguous() else dy.contiguous(), x, rstd, weight, ctx.zero_centered_gamma, ctx.impl)
        return dx, None, None, None, None
