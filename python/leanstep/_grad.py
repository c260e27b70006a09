"""The gradient engine (see docs/grad.md for the semantics).

A :class:`GradPlan` is built once from the optimizer's list of grad views (any
order, mixed dtypes, views into flat buffers) and reused every step: it finds
the address-adjacent regions so one pass covers many tensors. Results are
1-element backend scalars (fp32 norm/flag/coefficient, int64 zero count) in
the framework of the grads; nothing is read back to the host.
"""

import numbers

from . import _leanstep
from ._arrays import dtype_name, is_torch, torch_module, view, zeros

__all__ = ["GradPlan", "multi_tensor_scale", "build_ddp_buffers", "ddp_grad_buffers", "model_params"]

INF = float("inf")


def _scalar(dtype, like):
    if like is None:
        import numpy as np

        return np.zeros(1, dtype=dtype)
    return zeros((1,), dtype, like)


def _as_scalar_array(value, like, arg):
    """A Python number becomes a 1-element fp32 array in like's framework; an
    array is passed through (the library checks it is 1-element fp32)."""
    if isinstance(value, numbers.Real):
        out = _scalar("float32", like)
        out[0] = float(value)
        return out
    return view(value)


class GradPlan:
    """``plan = GradPlan(grads)``; ``norm, found_inf = plan.norm()``;
    ``plan.clip_(max_norm, norm)``; ``plan.count_zeros()``.

    The plan keeps the grad arrays alive; it is valid as long as their memory
    is (reuse it every step: that is what it is for). ``buffers`` optionally
    declares the flat buffers every grad must lie in (checked). Results are
    arrays of the grads' framework; ``like=`` (an array) chooses it when the
    list is empty (default: NumPy)."""

    def __init__(self, grads, buffers=(), *, like=None):
        torch = torch_module()
        if torch is not None and isinstance(grads, torch.Tensor):
            grads = [grads]
        self._grads = [view(g) for g in grads]
        self._buffers = [view(b) for b in buffers]
        self._core = _leanstep.GradPlanCore(self._grads, self._buffers)
        self._like = self._grads[0] if self._grads else like

    # -- what the plan found
    num_tensors = property(lambda self: self._core.num_tensors)
    num_regions = property(lambda self: self._core.num_regions)
    num_generic = property(lambda self: self._core.num_generic)
    num_empty = property(lambda self: self._core.num_empty)
    listed_bytes = property(lambda self: self._core.listed_bytes)
    touched_bytes = property(lambda self: self._core.touched_bytes)
    regions = property(lambda self: self._core.regions)
    generic = property(lambda self: self._core.generic)

    def summary(self):
        return self._core.summary()

    def __repr__(self):
        return f"GradPlan({self.summary()})"

    @property
    def grads(self):
        return list(self._grads)

    # -- operations
    def norm(self, norm_type=2.0, inv_scale=None, *, out=None, found_inf=None):
        """Returns ``(norm, found_inf)``, 1-element fp32 arrays. norm_type is 2,
        ``inf`` or any p > 0. With ``inv_scale`` (a number or a 1-element fp32
        array) every grad is unscaled in place, ``x = cast(float(x) * inv_scale)``,
        in the same pass, and the norm is that of the unscaled grads. found_inf
        is 1 if any grad element (before unscaling) is non-finite. A
        ``found_inf=`` array is OR-ed into, not zeroed (accumulate over plans)."""
        out = _scalar("float32", self._like) if out is None else view(out)
        found_inf = _scalar("float32", self._like) if found_inf is None else view(found_inf)
        norm_type = float(norm_type)
        if inv_scale is None:
            self._core.norm(out, norm_type, found_inf)
        elif isinstance(inv_scale, numbers.Real):
            self._core.unscale_norm(float(inv_scale), out, found_inf, norm_type)
        else:
            self._core.unscale_norm(view(inv_scale), out, found_inf, norm_type)
        return out, found_inf

    def clip_(self, max_norm, norm, *, coeff_out=None):
        """Scales every grad in place by ``min(1, max_norm / (norm + 1e-6))``,
        the coefficient computed from the array ``norm`` without a host read
        (a NaN norm gives NaN grads, as the frameworks do). Returns the
        coefficient (1-element fp32)."""
        coeff = _scalar("float32", self._like) if coeff_out is None else view(coeff_out)
        self._core.clip(_as_scalar_array(norm, self._like, "norm"), float(max_norm), coeff)
        return coeff

    def norm_clip_(self, max_norm, norm_type=2.0):
        """norm then clip in place, the usual step: returns ``(norm, found_inf, coeff)``."""
        out = _scalar("float32", self._like)
        found_inf = _scalar("float32", self._like)
        coeff = _scalar("float32", self._like)
        self._core.norm_clip(float(max_norm), out, float(norm_type), found_inf, coeff)
        return out, found_inf, coeff

    def scale_(self, scale):
        """Every grad ``*= scale`` in place (fp32 math, one rounding)."""
        self._core.scale(_as_scalar_array(scale, self._like, "scale"))

    def count_zeros(self, *, out=None):
        """Sum over the grads of (numel - count_nonzero), a 1-element int64 array."""
        out = _scalar("int64", self._like) if out is None else view(out)
        self._core.count_zeros(out)
        return out


def multi_tensor_scale(src_list, dst_list, scale, *, found_inf=None):
    """``dst[i] = cast(float(src[i]) * scale)`` for every pair (dtypes may
    differ: fp32 -> fp16/bf16, fp16 -> fp32, ...; the product is rounded once,
    so 1e5 * 0.01 into fp16 does not overflow). In place when dst is src.
    Returns found_inf (1-element fp32): 1 if any SOURCE element is non-finite.
    A ``found_inf=`` array is OR-ed into, not zeroed."""
    src = [view(s) for s in src_list]
    dst = [view(d) for d in dst_list]
    like = src[0] if src else (dst[0] if dst else None)
    found_inf = _scalar("float32", like) if found_inf is None else view(found_inf)
    if isinstance(scale, numbers.Real):
        _leanstep.grad_multi_tensor_scale(src, dst, float(scale), found_inf)
    else:
        _leanstep.grad_multi_tensor_scale(src, dst, view(scale), found_inf)
    return found_inf


def build_ddp_buffers(params, *, distributed_optimizer=False, dp_size=1,
                      pad_for_high_busbw=False, bucket_size=0, grad_dtype="float32"):
    """Megatron-Core's param-and-grad buffer placement for ``params`` given in
    registration order as ``(name, shape, param_dtype[, is_expert[, own_bucket]])``
    tuples or dicts with those keys. Returns one dict per buffer:
    ``{grad_dtype, param_dtype, is_expert, numel, numel_unpadded,
    params: [{name, shape, param_index, offset, numel, bucket}], buckets, summary}``."""
    specs = []
    for p in params:
        if isinstance(p, dict):
            p = (p["name"], p["shape"], p.get("dtype", "bfloat16"), p.get("is_expert", False),
                 p.get("own_bucket", False))
        name, shape, dtype, *rest = p
        is_expert = bool(rest[0]) if len(rest) > 0 else False
        own_bucket = bool(rest[1]) if len(rest) > 1 else False
        if not isinstance(dtype, str):
            dtype = str(dtype).removeprefix("torch.")
        specs.append((str(name), [int(s) for s in shape], dtype, is_expert, own_bucket))
    return _leanstep.layout_build_ddp_buffers(specs, distributed_optimizer, int(dp_size),
                                              pad_for_high_busbw, int(bucket_size), grad_dtype)


def model_params(model, lora_rank=8, expert_parallel=8):
    """The parameter lists the C++ benchmarks use, registration order:
    ``"qwen3_omni_lora"`` (one EP rank of Qwen3-Omni-30B-A3B LoRA fine-tuning)
    or ``"dense_100m"`` (a ~101M-parameter dense GPT)."""
    return _leanstep.grad_model_params(model, lora_rank, expert_parallel)


def ddp_grad_buffers(params, framework="torch", **layout_options):
    """Allocates zeroed flat gradient buffers laid out as Megatron-Core's DDP
    does (see :func:`build_ddp_buffers`) and returns ``(buffers, grads,
    layouts)``: the flat buffers, every param's grad view (in registration
    order over all buffers, as an optimizer lists them) and the layouts."""
    layouts = build_ddp_buffers(params, **layout_options)
    buffers, indexed = [], []
    for layout in layouts:
        dtype = layout["grad_dtype"]
        if framework == "torch":
            import torch

            buf = torch.zeros(layout["numel"], dtype=getattr(torch, dtype))
        else:
            import numpy as np

            buf = np.zeros(layout["numel"], dtype=dtype)
        buffers.append(buf)
        for slot in layout["params"]:
            view_ = buf[slot["offset"]:slot["offset"] + slot["numel"]].reshape(slot["shape"])
            indexed.append((slot["param_index"], view_))
    indexed.sort(key=lambda item: item[0])
    return buffers, [v for _, v in indexed], layouts
