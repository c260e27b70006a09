"""RMSNorm over the last dimension (see docs/rmsnorm.md for the semantics).

    rstd = 1 / sqrt(mean(x^2) + eps)   per row, fp32
    y    = cast(x * rstd * g)          rounding="scale_then_cast" (torch, TE)
    y    = g * cast(x * rstd)          rounding="cast_then_scale" (HF Llama/Qwen3)
    g    = weight, or 1 + weight with zero_centered_gamma
"""

from . import _leanstep
from ._arrays import dtype_name, result, view

__all__ = ["rms_norm", "rms_norm_backward"]


def rms_norm(x, weight, eps, zero_centered_gamma=False, rounding="scale_then_cast", *,
             out=None, rstd_out=None, impl="fused"):
    """Returns ``(y, rstd)``: y of x's shape and dtype, rstd fp32 of shape
    ``x.shape[:-1]``. ``out=`` may be x itself for an in-place norm.
    ``impl="reference"`` runs the per-element oracle instead of the fused kernel."""
    x, weight = view(x), view(weight)
    y = result(x.shape, dtype_name(x), x, out, "rms_norm", "out")
    rstd = result(x.shape[:-1], "float32", x, rstd_out, "rms_norm", "rstd_out")
    _leanstep.rmsnorm_forward(x, weight, y, rstd, float(eps), zero_centered_gamma, rounding, impl)
    return y, rstd


def rms_norm_backward(dy, x, rstd, weight, zero_centered_gamma=False, weight_requires_grad=True,
                      *, dx_out=None, dweight_out=None, impl="fused"):
    """Returns ``(dx, dweight)``: dx in x's dtype; dweight in the weight's dtype,
    or None when the weight is frozen (``weight_requires_grad=False``), in which
    case no cross-row reduction runs at all."""
    dy, x, rstd, weight = view(dy), view(x), view(rstd), view(weight)
    dx = result(x.shape, dtype_name(x), x, dx_out, "rms_norm_backward", "dx_out")
    dweight = None
    if weight_requires_grad:
        dweight = result(weight.shape, dtype_name(weight), weight, dweight_out,
                         "rms_norm_backward", "dweight_out")
    # eps only enters through rstd, which the forward saved.
    _leanstep.rmsnorm_backward(dy, x, rstd, weight, dx, dweight, 0.0, zero_centered_gamma, impl)
    return dx, dweight
