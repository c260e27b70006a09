"""RMSNorm over the last dimension (see docs/rmsnorm.md for the semantics).

    rstd = 1 / sqrt(mean(x^2) + eps)   per row, fp32
    y    = cast(x * rstd * g)          rounding="scale_then_cast" (torch, TE)
    y    = g * cast(x * rstd)          rounding="cast_then_scale" (HF Llama/Qwen3)
    g    = weight, or 1 + weight with zero_centered_gamma
"""

from . import _registry
from ._arrays import dtype_name, native, result, view

__all__ = ["rms_norm", "rms_norm_backward"]


def rms_norm(x, weight, eps, zero_centered_gamma=False, rounding="scale_then_cast", *,
             out=None, rstd_out=None, impl=None, backend=None):
    """Returns ``(y, rstd)``: y of x's shape and dtype, rstd fp32 of shape
    ``x.shape[:-1]``. ``out=`` may be x itself for an in-place norm.
    ``impl=None`` lets the dispatch registry choose (the preset); ``"fused"``
    or ``"reference"`` (the per-element oracle) force one.
    Tensors on a device other than the CPU (or ``backend="torch"``) run the
    torch-op backend (no host read); on cuda, xpu and npu the Triton kernels
    when Triton runs there (as :func:`leanstep.torch.rms_norm`).
    ``impl="reference"`` on a device: the torch-op composite."""
    x, weight = view(x), view(weight)
    route = _registry.route("rmsnorm.forward", [x, weight, out, rstd_out],
                            ["x", "weight", "out", "rstd_out"], backend, "rms_norm",
                            reference=impl == "reference")
    if route.backend == "triton":
        y, rstd = route.module.forward(x, weight, float(eps), zero_centered_gamma, rounding)
    elif route.backend == "torch":
        y, rstd = route.module.forward(x, weight, float(eps), zero_centered_gamma, rounding,
                                       impl="composite" if impl == "reference" else None)
    if route.module is not None:
        if out is not None:
            y = result(x.shape, dtype_name(x), x, out, "rms_norm", "out").copy_(y)
        if rstd_out is not None:
            rstd = result(x.shape[:-1], "float32", x, rstd_out, "rms_norm", "rstd_out").copy_(rstd)
        return y, rstd
    y = result(x.shape, dtype_name(x), x, out, "rms_norm", "out")
    rstd = result(x.shape[:-1], "float32", x, rstd_out, "rms_norm", "rstd_out")
    if impl is None:  # the dispatch registry chooses (preset, guards, counts)
        native.rmsnorm_forward_routed(x, weight, y, rstd, float(eps), zero_centered_gamma,
                                      rounding, weight_requires_grad=False)
    else:
        native.rmsnorm_forward(x, weight, y, rstd, float(eps), zero_centered_gamma, rounding,
                               impl)
    return y, rstd


def rms_norm_backward(dy, x, rstd, weight, zero_centered_gamma=False, weight_requires_grad=True,
                      *, dx_out=None, dweight_out=None, impl=None, backend=None):
    """Returns ``(dx, dweight)``: dx in x's dtype; dweight in the weight's dtype,
    or None when the weight is frozen (``weight_requires_grad=False``), in which
    case no cross-row reduction runs at all."""
    dy, x, rstd, weight = view(dy), view(x), view(rstd), view(weight)
    route = _registry.route("rmsnorm.backward", [dy, x, rstd, weight, dx_out, dweight_out],
                            ["dy", "x", "rstd", "weight", "dx_out", "dweight_out"], backend,
                            "rms_norm_backward", reference=impl == "reference")
    if route.module is not None:
        dx, dweight = route.module.backward(dy, x, rstd, weight, zero_centered_gamma,
                                            weight_requires_grad)
        if dx_out is not None:
            dx = result(x.shape, dtype_name(x), x, dx_out, "rms_norm_backward", "dx_out").copy_(dx)
        if dweight_out is not None and dweight is not None:
            dweight = result(weight.shape, dtype_name(weight), weight, dweight_out,
                             "rms_norm_backward", "dweight_out").copy_(dweight)
        return dx, dweight
    dx = result(x.shape, dtype_name(x), x, dx_out, "rms_norm_backward", "dx_out")
    dweight = None
    if weight_requires_grad:
        dweight = result(weight.shape, dtype_name(weight), weight, dweight_out,
                         "rms_norm_backward", "dweight_out")
    # eps only enters through rstd, which the forward saved.
    if impl is None:  # the dispatch registry chooses (the frozen path when dweight is None)
        native.rmsnorm_backward_routed(dy, x, rstd, weight, dx, dweight, 0.0,
                                       zero_centered_gamma,
                                       weight_requires_grad=bool(weight_requires_grad))
    else:
        native.rmsnorm_backward(dy, x, rstd, weight, dx, dweight, 0.0, zero_centered_gamma,
                                impl)
    return dx, dweight
