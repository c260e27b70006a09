"""Autograd-aware leanstep for PyTorch.

- :class:`RMSNorm`: a drop-in for ``torch.nn.RMSNorm`` (same constructor,
  parameters and state_dict). When its weight does not require a gradient and
  no feature needs the general path, it takes leanstep's frozen direct path
  (fused forward, backward computing dx only). A trainable weight runs the
  leanstep fused kernels with the weight gradient. Autocast, hooks,
  torch.compile, saved-tensor hooks (activation offload), a subclass that
  overrides forward, non-CPU tensors or unsupported dtypes delegate to
  ``torch.nn.RMSNorm.forward`` unchanged ("feature delegation").
- :func:`rms_norm`, :func:`permute`, :func:`unpermute`,
  :func:`sort_chunks_by_idxs`: autograd functions over the leanstep kernels.
- :func:`clip_grad_norm_`, :func:`get_total_norm`, :func:`clip_grads_with_norm_`:
  torch's clipping functions on leanstep's grad plans; :class:`GradBuffer`
  lays trainable grads out in one buffer (see ``_torch_clip``).
"""

import math

import torch

from . import _backend, _dispatch, _leanstep, _registry
from ._arrays import output_hooks as _output_hooks
from ._rules import restore_rows as _restore_rows
from ._arrays import dtype_name as _dtype_name
from ._arrays import empty as _empty
from ._arrays import native as _native
from .backends import torch_rmsnorm

if "rmsnorm" in _leanstep.areas:
    from ._leanstep import rmsnorm_backward_lean as _rmsnorm_backward_lean
    from ._leanstep import rmsnorm_forward_lean as _rmsnorm_forward_lean

from ._leanstep import lean_cpu_tensors as _lean_cpu_tensors

if "moe" in _leanstep.areas:
    from ._leanstep import moe_permute as _moe_permute_native
    from ._leanstep import moe_permute_backward as _moe_permute_backward_native
    from ._leanstep import moe_permute_output_rows as _moe_output_rows
    from ._leanstep import moe_permute_probs_backward as _moe_permute_probs_backward_native
    from ._leanstep import moe_unpermute as _moe_unpermute_native
    from ._leanstep import moe_sort_chunks_by_idxs as _moe_sort_chunks_native
    from ._leanstep import moe_unpermute_backward as _moe_unpermute_backward_native
    from ._moe import (
        moe_permute,
        moe_permute_backward,
        moe_permute_probs_backward,
        moe_unpermute,
        moe_unpermute_backward,
        sort_chunks_by_idxs as _sort_chunks_by_idxs,
    )

__all__ = ["RMSNorm", "rms_norm", "permute", "unpermute", "sort_chunks_by_idxs"]

if "grad" in _leanstep.areas:
    from ._torch_clip import GradBuffer, clip_grad_norm_, clip_grads_with_norm_, get_total_norm

    __all__ += ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_", "GradBuffer"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- RMSNorm


class _RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x, weight); backward gives dx, and dweight only when the
    weight needs a gradient (the frozen path does no cross-row reduction)."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, rounding, context):
        y = _fresh_like(x)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        _native.rmsnorm_forward_routed(x.detach(), weight.detach(), y, rstd, eps,
                                       zero_centered_gamma, rounding, **context)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.context = context
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        need_weight_grad = ctx.needs_input_grad[1]
        dx = _fresh_like(x)
        dweight = _fresh_like(weight) if need_weight_grad else None
        context = dict(ctx.context, weight_requires_grad=need_weight_grad)
        _native.rmsnorm_backward_routed(dy.detach().contiguous(), x.detach(), rstd,
                                        weight.detach(), dx, dweight, 0.0,
                                        ctx.zero_centered_gamma, **context)
        return dx, dweight, None, None, None, None


class _LeanRMSNorm(torch.autograd.Function):
    """The CPU kernels' RMSNorm with its decision made (:meth:`RMSNorm.forward`
    caches it): one native call each way, tensors handed over through DLPack's
    exchange table. dweight only when the weight needs a gradient (frozen: no
    cross-row reduction at all)."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, cast_then_scale):
        y = _output_like(x)
        rstd = _row_stats(x)
        _rmsnorm_forward_lean(x, weight, y, rstd, eps, zero_centered_gamma, cast_then_scale,
                              ctx.needs_input_grad[1], False)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = _lean_backward(dy, x, rstd, weight, ctx.zero_centered_gamma,
                                     ctx.needs_input_grad[1])
        return dx, dweight, None, None, None


_POOLED_BYTES = 2 << 20  # outputs from here up come from leanstep's pool (_arrays.empty)


def _output_like(t):
    """An uninitialised contiguous output like CPU tensor `t`: torch's allocator
    for the small ones (the common case), leanstep's pool / huge pages for large
    ones. A contiguous `t` (every lean caller's) keeps its layout under
    empty_like's default, which parses no memory_format keyword (0.35 us)."""
    if t.nbytes < _POOLED_BYTES:
        if t.is_contiguous():
            return torch.empty_like(t)
        return torch.empty_like(t, memory_format=torch.contiguous_format)
    return _fresh_like(t)


def _row_stats(x):
    """An uninitialised fp32 tensor of x's row shape (``x.shape[:-1]``), on the
    CPU. The sizes go in unpacked: torch parses a Size argument in about 1 us
    more."""
    if x.dim() > 1:
        return torch.empty(*x.shape[:-1], dtype=torch.float32)
    return torch.empty((), dtype=torch.float32)


def _dense(t):
    """A gradient as the kernels take it: contiguous and not a negated view."""
    if not t.is_contiguous() or t.is_neg():
        t = t.contiguous().resolve_neg()
    return t


def _lean_backward(dy, x, rstd, weight, zero_centered_gamma, weight_grad):
    """(dx, dweight or None) of the decided CPU path: one native call."""
    dx = _output_like(x)
    dweight = _output_like(weight) if weight_grad else None
    _rmsnorm_backward_lean(_dense(dy), x, rstd, weight, dx, dweight, zero_centered_gamma)
    return dx, dweight


class _LeanExactForwardRMSNorm(torch.autograd.Function):
    """:class:`_ExactForwardFrozenRMSNorm` with its decision made, on CPU
    tensors: torch's forward (leanstep's kernel in torch's order where it
    was checked to give torch's bits, :func:`_torch_order_kernel_matches`;
    else torch's own op), leanstep's dx-only backward, one native call."""

    @staticmethod
    def forward(ctx, x, weight, eps, torch_order):
        if not x.is_contiguous():
            x = x.contiguous()  # see _LeanPath.run
        if torch_order:
            y, rstd = _output_like(x), _row_stats(x)
            _rmsnorm_forward_lean(x, weight, y, rstd, eps, False, False, False, True)
        else:
            y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        return _lean_backward(dy, x, rstd, weight, False, False)[0], None, None, None


# torch forms rms_norm on CPU tensors from separate ops (x in fp32, pow, mean, + eps,
# rsqrt, two products), 18 us at [64, 64] where leanstep's kernel takes 2 us. The
# kernel in torch's order (its sum's cascade: src/rmsnorm/torch_order.cpp) gives the
# same bits where torch's sum runs the order it was written from; this checks that
# on a probe once per dtype and width, and the exact forward uses the kernel only
# where it holds. Rows wider than torch's grain size (32768 elements) keep torch's
# op: a single such row may be summed in parts by several threads.
_TORCH_GRAIN = 32768
_dispatch_modes = torch._C._len_torch_dispatch_stack
_torch_order_checks = {}


def _torch_order_kernel_matches(dtype, width, eps):
    key = (dtype, width, eps)
    found = _torch_order_checks.get(key)
    if found is None:
        if _dispatch_modes() or _function_modes() or _functorch_active():
            # A mode (an audit, an op counter, fake tensors, a default device) or a
            # transform would see or change the probe's ops: torch's op for now, the probe
            # on a later decision.
            return False
        found = width < _TORCH_GRAIN and _torch_order_probe(dtype, width, eps)
        _torch_order_checks[key] = found
    return found


def _torch_order_probe(dtype, width, eps):
    """Whether leanstep's kernel in torch's order gives torch's y and rstd on
    rows of `width`: random ones (scales from 1e-3 to 1e3, a random weight),
    and ones whose sum tells orders apart (squares of 1 and one of 2^24: a 1
    added to 2^24 is lost, 1s added together first are not; the 2^24 at
    positions that fall in different lanes, streams and runs)."""
    gen = torch.Generator(device="cpu").manual_seed(width)
    scales = torch.tensor([1.0, 1e-3, 1e3, 0.1, 7.0, 0.5], device="cpu").unsqueeze(1)
    random_rows = torch.randn(6, width, generator=gen, device="cpu") * scales
    positions = sorted({0, 1, 3, 5, 8, 13, 37, 300, width // 2, width - 1} & set(range(width)))
    ordered_rows = torch.ones(len(positions), width, device="cpu")
    for row, at in enumerate(positions):
        ordered_rows[row, at] = 4096.0  # its square is 2^24
    x = torch.cat([random_rows, ordered_rows]).to(dtype)
    weight = (torch.rand(width, generator=gen, device="cpu") + 0.5).to(dtype)
    rows = x.shape[0]
    with torch.no_grad():
        expected, expected_rstd = torch.ops.aten._fused_rms_norm(x, [width], weight, eps)
        y, rstd = torch.empty_like(x), torch.empty(rows, dtype=torch.float32, device="cpu")
        _rmsnorm_forward_lean(x, weight, y, rstd, eps, False, False, False, True)
    return torch.equal(y, expected) and torch.equal(rstd, expected_rstd.reshape(rows))


class _ExactForwardFrozenRMSNorm(torch.autograd.Function):
    """Frozen weight: torch's own forward (bit-identical to torch.nn.RMSNorm;
    it also returns rstd), leanstep's dx-only backward (the C++ kernel on
    CPU tensors, the device backend elsewhere)."""

    @staticmethod
    def forward(ctx, x, weight, eps, backend, context):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend = backend
        ctx.context = context
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dy = dy if dy.is_contiguous() else dy.contiguous()
        if ctx.backend == "torch":
            impl = "fused" if torch_rmsnorm.fused_available(x.device.type) else "composite"
            dx = torch_rmsnorm.backward_dx(dy, x, rstd, weight, False, impl)
        elif ctx.backend == "triton":
            _registry.record("rmsnorm.backward", "triton", x.device.type, "frozen: dx only")
            dx = _registry.module("rmsnorm.backward", "triton").backward_dx(dy, x, rstd, weight)
        else:
            dx = _fresh_like(x)
            context = dict(ctx.context, weight_requires_grad=False)
            _native.rmsnorm_backward_routed(dy.detach(), x.detach(),
                                            rstd.detach().reshape(x.shape[:-1]),
                                            weight.detach(), dx, None, 0.0, False, **context)
        return dx, None, None, None, None


_decisions = {}  # rmsnorm_decide is a pure function of the call's features: asked once each


def _count_triton_backward(device_type, reason):
    _registry.record("rmsnorm.backward", "triton", device_type, reason)


# Measured on an H200 (torch 2.11, scripts/gpu-check.sh, three runs on 2026-12-04): torch's
# fused CUDA kernels against leanstep's Triton ones at [8192, 2048] bf16, 0.04-0.05 vs
# 0.12-0.22 ms forward and 0.12-0.16 vs 0.69-0.87 ms forward + backward (dx), and their
# backward needs no Python. CUDA only: no other device was measured.
_TORCH_FUSED_WHY = ("torch's fused RMSNorm kernels for the device, with their native backward "
                    "(faster than leanstep's Triton kernels where torch has them)")


def _fused_measured_faster(device_type):
    """Where torch's fused RMSNorm was measured against leanstep's Triton kernels
    and won (above): CUDA."""
    return device_type == "cuda"


def _route_rmsnorm(x, weight, zero_centered_gamma, rounding, backend, where):
    """(backend, why, module) of an RMSNorm call over `x`, counted. Where the
    automatic choice is Triton but torch has fused kernels for the call (its
    convention, one dtype: a device's own RMSNorm), torch's kernels run:
    Triton keeps the conventions torch has no kernel for (zero-centered
    gamma, cast-then-scale, a weight of another dtype) and devices without
    them. ``backend="triton"`` still forces the Triton kernels."""
    if (backend is None and _fused_measured_faster(x.device.type) and all(_automatic_state())
            and _torch_fused_op(x, weight, zero_centered_gamma, rounding)):
        # Decided before the automatic choice, whose Triton self-check would compile and
        # run kernels this call does not use; the choice still checks the arguments.
        chosen, why = _registry.choose("rmsnorm.forward", [x, weight], ["x", "weight"], "torch",
                                       where)[0], _TORCH_FUSED_WHY
    else:
        chosen, why = _registry.choose("rmsnorm.forward", [x, weight], ["x", "weight"],
                                       backend, where)
    device_type = "cpu" if chosen == "cpu" else x.device.type
    _registry.record("rmsnorm.forward", chosen, device_type, why)
    return chosen, why, _registry.module("rmsnorm.forward", chosen)


def _decide(context):
    key = tuple(context.items())
    decision = _decisions.get(key)
    if decision is None:
        decision = _decisions.setdefault(key, _leanstep.rmsnorm_decide(**context))
    return decision


def _fresh_like(t):
    """An output like `t` that leanstep allocates (huge pages when large)."""
    return _empty(tuple(t.shape), _dtype_name(t), t)


def _no_features():
    return dict(fp8_output=False, autocast=False, activation_offload=False, debug_hooks=False,
                compiled_or_captured=False, user_subclass=False)


def rms_norm(x, weight, eps=1e-6, zero_centered_gamma=False, rounding="scale_then_cast", *,
             backend=None):
    """Autograd-aware leanstep RMSNorm over the last dim (fp32/fp16/bf16).
    The weight gradient is computed only if the weight requires grad. CPU
    tensors run the C++ kernels; tensors on any other device (or
    ``backend="torch"``) run the torch-op backend, which never reads a device
    value on the host; on cuda, xpu and npu the Triton kernels run when Triton
    works there (``backend="triton"`` forces them: CPU tensors under
    TRITON_INTERPRET=1)."""
    chosen, _, module = _route_rmsnorm(x, weight, zero_centered_gamma, rounding, backend,
                                       "rms_norm")
    if not x.is_contiguous():
        x = x.contiguous()
    if chosen == "torch":
        return _torch_rms_norm(x, weight, float(eps), zero_centered_gamma, rounding)
    if chosen == "triton":
        return module.rms_norm(x, weight, float(eps), zero_centered_gamma, rounding,
                               _count_triton_backward)
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    context = dict(_no_features(), weight_requires_grad=bool(
        torch.is_grad_enabled() and weight.requires_grad))
    if not wants_grad:
        y = _fresh_like(x)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        _native.rmsnorm_forward_routed(x.detach(), weight.detach(), y, rstd, float(eps),
                                       zero_centered_gamma, rounding, **context)
        return y
    return _RMSNormFunction.apply(x, weight, float(eps), zero_centered_gamma, rounding, context)


def _torch_fused_op(x, weight, zero_centered_gamma, rounding):
    """Whether the call is torch's own fused op under autograd (see _torch_rms_norm)."""
    return (torch_rmsnorm.fused_has_native_autograd(x.device.type)
            and torch_rmsnorm.implementation(x, weight, zero_centered_gamma, rounding) == "fused")


def _torch_rms_norm(x, weight, eps, zero_centered_gamma, rounding):
    """The device path: where torch has fused kernels for the call (its own
    convention, one dtype), ``aten._fused_rms_norm`` itself under autograd: its
    backward is native, and with a frozen weight autograd asks it for dx only
    (output mask [True, False]: no weight-gradient reduction), with no Python
    autograd Function between. Otherwise: frozen weight -> the dx-only
    autograd function; a trainable weight -> the composite formula in torch
    ops under autograd."""
    if _torch_fused_op(x, weight, zero_centered_gamma, rounding):
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]
    if torch.is_grad_enabled() and weight.requires_grad:
        return torch_rmsnorm.forward(x, weight, eps, zero_centered_gamma, rounding,
                                     impl="composite")[0]
    if torch.is_grad_enabled() and x.requires_grad:
        return torch_rmsnorm.FrozenRMSNorm.apply(x, weight, eps, zero_centered_gamma, rounding)
    return torch_rmsnorm.forward(x, weight, eps, zero_centered_gamma, rounding)[0]


def _saved_tensors_hooks_query():
    """torch's query for the innermost saved-tensor hooks, or one that answers
    None where this torch has no such query (or another signature)."""
    query = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        query(True)
    except TypeError:  # absent (None) or another signature in this torch
        return lambda ignore_is_tracing: None
    return query


_top_saved_tensors_hooks = _saved_tensors_hooks_query()


def _activation_offload_active():
    # Saved-tensor hooks (activation offload / checkpointing to host) would not
    # see what a custom Function saves the same way: delegate.
    return _top_saved_tensors_hooks(True) is not None


def _autocast_enabled(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type without autocast (meta)
        return False


_is_compiling = getattr(torch.compiler, "is_compiling", lambda: False)
_jit_tracing = torch._C._get_tracing_state
_functorch_active = torch._C._are_functorch_transforms_active
_function_modes = torch._C._len_torch_function_stack
_forward_ad = torch.autograd.forward_ad


def _torch_ops_only():
    """Whether a decided call must go back to the full path because what runs
    it sees or transforms torch ops only (_backend.torch_ops_only): jit
    tracing, a functorch transform, forward-mode AD (each query a C call or an
    attribute, about 20 ns), make_fx (asked only under a dispatch mode)."""
    return (_jit_tracing() is not None or _functorch_active()
            or _forward_ad._current_level >= 0
            or (_dispatch_modes() and _backend.torch_ops_only() is not None))


def _compiling():
    """torch.compile, or what sees torch ops only (torch.jit.trace, make_fx, a
    functorch transform, forward-mode AD: _backend.torch_ops_only): the C++
    kernels' outputs would be missing from the graph, unbatched or without
    their tangents."""
    return _is_compiling() or _backend.torch_ops_only() is not None


def default_eps(dtype):
    """torch.nn.RMSNorm's eps when given None: the machine epsilon of the type
    it accumulates in (fp32 for bf16/fp16 inputs, the input's own type
    otherwise), not of the input's type (which is 2^-7 for bf16, 65536x fp32's)."""
    return torch.finfo(torch.promote_types(dtype, torch.float32)).eps


class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for ``torch.nn.RMSNorm`` (same arguments, parameters and
    state_dict), computing ``y = cast(x * rstd * g)`` in fp32 like torch.

    Extra keyword-only arguments: ``zero_centered_gamma`` (g = 1 + weight, the
    Qwen3-Next / "layernorm 1p" convention; the weight itself is stored as is)
    and ``rounding`` ("scale_then_cast", torch's order, or "cast_then_scale",
    HF Llama's), ``exact_forward``: the frozen forward is torch's own
    (``aten._fused_rms_norm``: bit-identical to ``torch.nn.RMSNorm`` on every
    device, and it yields rstd) and only the backward is leanstep's, dx only
    (a drop-in that changes no number of the forward), and ``frozen_only``: run leanstep only on the frozen path
    (a trainable weight then runs torch's own forward, unchanged).
    ``last_decision`` holds the path of the latest call:
    ``{"path": "frozen_fused" | "general" | "torch", "reason": ...}``."""

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None, *, zero_centered_gamma=False, rounding="scale_then_cast",
                 frozen_only=False, backend=None, exact_forward=False):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         device=device, dtype=dtype)
        self.exact_forward = exact_forward
        self.zero_centered_gamma = zero_centered_gamma
        self.rounding = rounding
        self.frozen_only = frozen_only
        self.backend = backend
        self.enabled = None
        self.last_decision = None
        if zero_centered_gamma and self.weight is not None:
            with torch.no_grad():
                self.weight.zero_()  # g = 1 + 0: the identity scale, like ones for plain gamma

    @classmethod
    def from_torch(cls, norm, *, zero_centered_gamma=False, rounding="scale_then_cast",
                   frozen_only=False, backend=None, enabled=None, exact_forward=False):
        """A leanstep RMSNorm sharing ``norm``'s weight Parameter (no copy)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.normalized_shape = tuple(norm.normalized_shape)
        new.eps = norm.eps
        new.elementwise_affine = norm.elementwise_affine
        if norm.elementwise_affine:
            new.weight = norm.weight  # the same Parameter object
        else:
            new.register_parameter("weight", None)
        new.zero_centered_gamma = zero_centered_gamma
        new.rounding = rounding
        new.frozen_only = frozen_only
        new.backend = backend
        new.enabled = enabled
        new.exact_forward = exact_forward
        new.last_decision = None
        return new

    def extra_repr(self):
        extra = super().extra_repr()
        if self.zero_centered_gamma:
            extra += ", zero_centered_gamma=True"
        if self.rounding != "scale_then_cast":
            extra += f", rounding={self.rounding}"
        return extra

    def __getstate__(self):
        # A copy (deepcopy, pickle, torch.save) decides for itself: the cached decision
        # names this module's weight, holds a call counter and may hold a kernels module.
        state = super().__getstate__()
        state.pop("_lean", None)
        return state

    def __setattr__(self, name, value):
        # An attribute set (eps, rounding, backend, weight, ...) drops the cached
        # decision: the next call decides again (_LeanPath reads no option per call).
        # Not `training`: .train() / .eval() set it on every module, in some trainers
        # each step (the HF Trainer's training_step), and no decision depends on it.
        if name != "training":
            self.__dict__.pop("_lean", None)
        super().__setattr__(name, value)

    def __call__(self, *args, **kwargs):
        # A decided call skips nn.Module's call wrapper (0.7 us of 8.9 at the main job's
        # shape, measured under no_grad, one thread). It does so only where that wrapper
        # would call this class's forward directly: no hook and no jit trace (run checks
        # them), no compiled call (Module.compile), no forward set on the instance (a
        # timer's, accelerate's hooks) or patched into the class. Any other call is
        # nn.Module's own, looked up per call (torch.fx patches it while tracing).
        lean = self.__dict__.get("_lean")
        if (lean is not None and len(args) == 1 and not kwargs
                and self._compiled_call_impl is None and "forward" not in self.__dict__
                and type(self).forward is _OWN_FORWARD
                and (self.enabled is None or self.enabled())):
            y = lean.run(self, args[0])
            if y is not None:
                return y
        return torch.nn.Module.__call__(self, *args, **kwargs)

    def _delegate_forward(self, x):
        """The forward of a call leanstep does not take: torch.nn.RMSNorm's, or
        the ``delegate`` the module was given (a model's own RMSNorm forward,
        whose arithmetic this module's options describe)."""
        delegate = self.__dict__.get("delegate")
        return super().forward(x) if delegate is None else delegate(x)

    def _unsupported(self, x):
        """Why leanstep cannot run this call at all (None if it can)."""
        if "rmsnorm" not in _leanstep.areas:
            return "rmsnorm_not_built"
        w = self.weight
        if w is None:
            return "no_weight"
        if len(self.normalized_shape) != 1:
            return "multi_dim_normalized_shape"
        if x.device != w.device:
            return "device"  # torch raises its own error
        if x.dtype not in _FLOAT_DTYPES or w.dtype not in _FLOAT_DTYPES:
            return "dtype"
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape[0]:
            return "shape"  # torch raises its own error
        if (self.rounding == "cast_then_scale" and w.dtype != x.dtype
                and self.__dict__.get("delegate") is not None):
            # `weight * x.to(dtype)` promotes: the delegate's output dtype is not x's.
            return "weight_dtype"
        return None

    def _context(self, weight_requires_grad):
        # Compiling, the other queries are not asked: dynamo cannot trace the
        # saved-tensor hooks query (a graph break), and compiling decides alone.
        compiled = _compiling()
        return dict(
            weight_requires_grad=weight_requires_grad,
            fp8_output=False,
            autocast=_autocast_enabled(self.weight.device.type),
            activation_offload=not compiled and _activation_offload_active(),
            debug_hooks=_hooks_active(self),
            compiled_or_captured=compiled,
            user_subclass=type(self).forward is not RMSNorm.forward,
        )

    def forward(self, x):
        lean = self.__dict__.get("_lean")
        if lean is not None and (self.enabled is None or self.enabled()):
            y = lean.run(self, x)
            if y is not None:
                return y
        return self._forward(x)

    def _forward(self, x):
        # torch's own forward has neither convention: with them, leanstep must run,
        # unless the module was given the forward of its convention (`delegate`).
        torch_convention = not self.zero_centered_gamma and self.rounding == "scale_then_cast"
        delegate_ok = torch_convention or self.__dict__.get("delegate") is not None
        if self.enabled is not None and not self.enabled() and delegate_ok:
            # Switched off at run time (a crossover's baseline): torch's own path.
            self.__dict__["last_decision"] = {"path": "torch", "reason": "switched_off"}
            return self._delegate_forward(x)
        unsupported = self._unsupported(x)
        if unsupported is not None:
            if not delegate_ok:
                raise ValueError(f"leanstep RMSNorm with zero_centered_gamma/rounding options "
                                 f"cannot run this call ({unsupported})")
            self.__dict__["last_decision"] = {"path": "torch", "reason": unsupported}
            return self._delegate_forward(x)
        weight_requires_grad = bool(torch.is_grad_enabled() and self.weight.requires_grad)
        context = self._context(weight_requires_grad)
        decision = _decide(context)
        feature_declined = _decide(dict(context, weight_requires_grad=False))["path"] \
            != "frozen_fused"
        if self.frozen_only and context["weight_requires_grad"]:
            feature_declined = True
        if feature_declined and delegate_ok:
            # A feature leanstep does not model (autocast, hooks, compile,
            # offload, subclass): the original torch path runs.
            self.__dict__["last_decision"] = {"path": "torch", "reason": decision["explain"]}
            return self._delegate_forward(x)
        eps = self.eps if self.eps is not None else default_eps(x.dtype)
        chosen, why, module = _route_rmsnorm(x, self.weight, self.zero_centered_gamma,
                                             self.rounding, self.backend, "RMSNorm")
        self.__dict__["last_decision"] = {"path": decision["path"], "reason": decision["reason"],
                                          "backend": chosen}
        # The decision is keyed by the caller's layout; a strided one (q/k views out of a
        # fused qkv projection) is copied. Measured (one thread, bf16 [64, 1, 2, 16] k views,
        # frozen, forward + backward): torch on the view 123 us, leanstep with the copy
        # 75 us; under no_grad 32 and 13 us; 2-3x at [1024, 1, 4, 128] as well.
        caller_x = x
        if not x.is_contiguous():
            x = x.contiguous()
        if (getattr(self, "exact_forward", False) and torch_convention
                and decision["path"] == "frozen_fused" and x.dtype == self.weight.dtype):
            self.last_decision["forward"] = "torch_order"
            self.last_decision["forward_kernel"] = "torch"  # decided calls: see _LeanPath
            # torch's own op under autograd where its backward is native (CUDA): the
            # same forward, and its dx-only backward without a Python Function.
            native = chosen == "torch" and _torch_fused_op(x, self.weight, False,
                                                           "scale_then_cast")
            if ((chosen == "cpu" or native) and type(self).forward is RMSNorm.forward
                    and not context["compiled_or_captured"]):
                # Decided: later calls with the same signature take _LeanPath.run.
                self.__dict__["_lean"] = _LeanPath(self, caller_x, float(eps), why,
                                                   self.last_decision, exact=True,
                                                   backend=chosen)
            if native or not (torch.is_grad_enabled() and x.requires_grad):
                return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], self.weight,
                                                      float(eps))[0]
            return _ExactForwardFrozenRMSNorm.apply(x, self.weight, float(eps), chosen, context)
        if type(self).forward is RMSNorm.forward and not context["compiled_or_captured"]:
            # Decided: later calls with the same signature take _LeanPath.run (not a
            # call made while compiling or capturing: its choice is for that time only).
            self.__dict__["_lean"] = _LeanPath(self, caller_x, float(eps), why,
                                               self.last_decision, backend=chosen,
                                               kernels=module)
        if chosen == "torch":
            return _torch_rms_norm(x, self.weight, float(eps), self.zero_centered_gamma,
                                   self.rounding)
        if chosen == "triton":
            return module.rms_norm(x, self.weight, float(eps), self.zero_centered_gamma,
                                   self.rounding, _count_triton_backward)
        if not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            y = _fresh_like(x)
            rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
            _native.rmsnorm_forward_routed(x.detach(), self.weight.detach(), y, rstd, float(eps),
                                           self.zero_centered_gamma, self.rounding, **context)
            return y
        return _RMSNormFunction.apply(x, self.weight, float(eps), self.zero_centered_gamma,
                                      self.rounding, context)


_OWN_FORWARD = RMSNorm.forward  # a forward patched into the class later is not this one

# torch's global module hooks: dicts that registering and removing a hook change in place.
_global_forward_hooks = torch.nn.modules.module._global_forward_hooks
_global_forward_pre_hooks = torch.nn.modules.module._global_forward_pre_hooks
_global_backward_hooks = torch.nn.modules.module._global_backward_hooks
_global_backward_pre_hooks = torch.nn.modules.module._global_backward_pre_hooks
_global_hooks = (_global_forward_hooks, _global_forward_pre_hooks, _global_backward_hooks,
                 _global_backward_pre_hooks)


def _hooks_active(module):
    """Whether a hook (the module's own or a global one) would see this call:
    leanstep then hands it to torch, whose path the hooks were written for."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or any(_global_hooks))


def _automatic_state():
    """What an automatic device choice of RMSNorm depends on beyond the call."""
    return _backend.triton_automatic(), _dispatch.op_enabled("rmsnorm.forward")


# Whether any autocast is on: no device argument to parse (20-40 ns less a call than
# asking for one device, measured), and off in the common call. Where this torch has
# no such query, every call asks for its device.
_any_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _is_autocast_cpu():
    """Whether CPU autocast is on."""
    return _any_autocast_enabled() and torch.is_autocast_enabled("cpu")


class _LeanPath:
    """One RMSNorm module's decision, made once by the full path
    (:meth:`RMSNorm._forward`) and reused while a call has the same
    signature: the input's class, dtype, device, width and layout, the
    weight's identity, dtype and requires_grad, and the options. Each call
    still checks what can change from call to call: hooks (module and global),
    autocast, saved-tensor hooks (offload), compile, a negated view. Any
    difference sends the call back to the full path, which decides again.
    ``backend``: "cpu" (the C++ kernels, one native call each way), "torch"
    (torch's fused op under autograd where it has one, else the torch-op
    code) or "triton" (the Triton kernels' autograd entry)."""

    __slots__ = ("x_type", "x_dtype", "x_device", "x_on_cpu", "width", "x_contiguous", "weight",
                 "w_dtype", "w_requires_grad", "eps", "zero_centered_gamma", "cast_then_scale",
                 "why", "decision", "exact", "frozen_weight_only", "backend", "kernels",
                 "torch_fused", "device_type", "rounding", "automatic", "tally", "torch_order")

    def __init__(self, module, x, eps, why, decision, exact=False, backend="cpu", kernels=None):
        # The signature: the input's class, dtype, device, width and layout, the
        # weight's identity, dtype and requires_grad (see _matches).
        w = module.weight
        self.x_type, self.x_dtype, self.x_device = type(x), x.dtype, x.device
        self.x_on_cpu = x.device.type == "cpu"
        self.width, self.x_contiguous = x.shape[-1], x.is_contiguous()
        self.weight, self.w_dtype, self.w_requires_grad = w, w.dtype, w.requires_grad
        self.eps = eps
        self.zero_centered_gamma = module.zero_centered_gamma
        self.cast_then_scale = module.rounding == "cast_then_scale"
        self.why = why
        self.decision = dict(decision)
        # exact_forward: torch's own forward (aten._fused_rms_norm), leanstep's dx.
        self.exact = exact
        # A trainable weight under autograd is the full path's call (frozen_only: torch's
        # forward; exact: it holds for a frozen weight only).
        self.frozen_weight_only = exact or module.frozen_only
        self.backend = backend
        self.kernels = kernels
        self.rounding = module.rounding
        self.device_type = "cpu" if backend == "cpu" else x.device.type
        self.tally = _backend.tally("rmsnorm.forward", backend, self.device_type, why)
        self.torch_fused = backend == "torch" and _torch_fused_op(
            x, w, module.zero_centered_gamma, module.rounding)
        # exact on the CPU: torch's forward from leanstep's kernel where it gives torch's bits
        self.torch_order = (exact and backend == "cpu"
                            and _torch_order_kernel_matches(x.dtype, self.width, eps))
        if exact and backend == "cpu":
            self.decision["forward_kernel"] = "leanstep" if self.torch_order else "torch"
        # A device backend chosen automatically depends on LEANSTEP_TRITON and the
        # preset too: either changing sends the next call back to the full path.
        self.automatic = (_automatic_state() if backend != "cpu" and module.backend is None
                          else None)

    def run(self, module, x):
        """The output, or None when the full path must decide this call.

        First whether this call has the decided signature (the module's options
        are not read here: setting any attribute of the module drops its
        decision, :meth:`RMSNorm.__setattr__`; the weight is read from
        ``_parameters``, as ``module.weight`` goes through nn.Module's
        ``__getattr__``, about 0.5 us, so a Parameter put there directly is still
        seen), then what can change from call to call. The checks are written
        out here rather than called: a Python call costs 60-80 ns, and the
        decided call is 8 us at the main job's shape (measured, one thread)."""
        w = module._parameters.get("weight")
        if not (type(x) is self.x_type and x.dtype is self.x_dtype
                and (x.is_cpu if self.x_on_cpu else x.device == self.x_device)
                and x.dim() != 0 and x.shape[-1] == self.width
                and x.is_contiguous() is self.x_contiguous and w is self.weight
                and w.dtype is self.w_dtype and w.requires_grad is self.w_requires_grad) \
                or x.is_neg():
            return None
        if (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or _global_forward_hooks
                or _global_forward_pre_hooks or _global_backward_hooks
                or _global_backward_pre_hooks):
            return None  # as _hooks_active
        if (_is_autocast_cpu() if self.device_type == "cpu"
                else _autocast_enabled(self.device_type)):  # "any" does not cover every device
            return None
        if (_is_compiling() or _torch_ops_only()
                or _top_saved_tensors_hooks(True) is not None):  # offload
            return None
        if self.automatic is not None and _automatic_state() != self.automatic:
            return None
        grad = torch.is_grad_enabled()
        if self.frozen_weight_only and grad and w.requires_grad:
            return None
        next(self.tally)
        module.__dict__["last_decision"] = dict(self.decision)
        exact_cpu = self.backend == "cpu" and self.exact
        if exact_cpu:
            # Under a dispatch mode (an audit, an op counter) torch's op, which it sees,
            # as before the kernel took torch's order.
            torch_order = self.torch_order and not _dispatch_modes()
            if torch_order != self.torch_order:
                module.__dict__["last_decision"]["forward_kernel"] = "torch"
            if grad and x.requires_grad:
                # A strided input (a k view out of a fused qkv projection) is copied inside
                # the Function: no autograd node for the copy (its dx comes back compact, of
                # the input's shape, which autograd takes as the view's gradient): about
                # 2 us of 70 a call less, bf16 [64, 1, 2, 16] forward + backward, one thread.
                return _LeanExactForwardRMSNorm.apply(x, w, self.eps, torch_order)
        if not self.x_contiguous:  # a strided layout (q/k views) the full path decided to copy
            x = x.contiguous()
        if self.backend == "cpu":
            if exact_cpu:
                if not torch_order:
                    return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, self.eps)[0]
                y = torch.empty_like(x) if x.nbytes < _POOLED_BYTES else _fresh_like(x)
                _rmsnorm_forward_lean(x, w, y, None, self.eps, False, False, False, True)
                return y
            if grad and (x.requires_grad or w.requires_grad):
                return _LeanRMSNorm.apply(x, w, self.eps, self.zero_centered_gamma,
                                          self.cast_then_scale)
            y = torch.empty_like(x) if x.nbytes < _POOLED_BYTES else _fresh_like(x)
            _rmsnorm_forward_lean(x, w, y, None, self.eps, self.zero_centered_gamma,
                                  self.cast_then_scale, False, False)  # no rstd: no grad
            return y
        if self.torch_fused:
            return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, self.eps)[0]
        if self.backend == "torch":
            return _torch_rms_norm(x, w, self.eps, self.zero_centered_gamma, self.rounding)
        return self.kernels.rms_norm(x, w, self.eps, self.zero_centered_gamma, self.rounding,
                                     _count_triton_backward)  # triton


# ---------------------------------------------------------------- MoE


def _contiguous(*tensors):
    return tuple(t if t is None or t.is_contiguous() else t.contiguous() for t in tensors)


# The common call, decided without the router ("lean"): plain CPU tensors
# (contiguous, not negated views), backend and method left to leanstep, no
# output hook (the audit's). One native call per kernel, outputs from torch's
# allocator (leanstep's pool from 2 MiB up), each call counted as the router
# counts it. Anything else goes through the router: the same autograd Function
# (_PermuteFunction / _UnpermuteFunction), the same kernels, the same numbers.
_MOE_WHY = "CPU tensors"
# Each lean MoE call counted as the router counts it (one `next`, see _backend.tally).
_MOE_TALLY = {op: _backend.tally(op, "cpu", "cpu", _MOE_WHY)
              for op in ("moe.permute", "moe.permute_backward", "moe.permute_probs_backward",
                         "moe.unpermute", "moe.unpermute_backward", "moe.sort_chunks_by_idxs")}


def _lean_moe_call(*tensors):
    """Whether these tensors (None for an absent one) take the lean path: plain
    CPU tensors of a kernel dtype, contiguous and not negated views
    (``lean_cpu_tensors``: one C pass; this call 0.8 us for four tensors where
    the same checks in Python took 1.2), with no output hook and nothing that sees
    torch ops only. This runs on every permute, unpermute and sort_chunks call."""
    return not (_output_hooks or _torch_ops_only()) and _lean_cpu_tensors(*tensors)


def _new_output(shape, dtype, like):
    if math.prod(shape) * dtype.itemsize < _POOLED_BYTES:
        return torch.empty(*shape, dtype=dtype)  # unpacked: a tuple costs 0.4 us more to parse
    return _empty(shape, _dtype_name(like) if like.dtype == dtype else str(dtype)[6:], like)


def _new_rows(rows, width, dtype, like):
    """:func:`_new_output` of shape ``[rows, width]``: the common 2-d output,
    without building a shape tuple (about 0.5 us less a call)."""
    if rows * width * dtype.itemsize < _POOLED_BYTES:
        return torch.empty(rows, width, dtype=dtype)
    return _new_output((rows, width), dtype, like)


class _PermuteFunction(torch.autograd.Function):
    """permute and its gradients, on every backend. `lean`: plain CPU tensors
    decided without the router (:func:`_lean_moe_call`): one native call per
    kernel, each counted as the router counts it."""

    @staticmethod
    def forward(ctx, tokens, routing_map, probs, num_out_tokens, drop_and_pad, method, backend,
                lean):
        # A permuted row or prob the caller never uses gets no gradient (None, not
        # zeros): its backward kernel is skipped.
        ctx.set_materialize_grads(False)
        if lean:
            # A row count given without drop_and_pad is the count (the native call checks
            # it against the map); any other is the native rule's (capacity, routed count).
            rows = (num_out_tokens if num_out_tokens is not None and num_out_tokens >= 0
                    and not drop_and_pad
                    else _moe_output_rows(routing_map, num_out_tokens, drop_and_pad))
            if tokens.dim() == 2:
                permuted = _new_rows(rows, tokens.shape[1], tokens.dtype, tokens)
            else:
                permuted = _new_output((rows,) + tuple(tokens.shape[1:]), tokens.dtype, tokens)
            permuted_probs = (None if probs is None
                              else _new_output((rows,), probs.dtype, tokens))
            sorted_indices = torch.empty(rows, dtype=torch.int64)
            next(_MOE_TALLY["moe.permute"])
            _moe_permute_native(tokens, routing_map, probs, num_out_tokens, drop_and_pad, "auto",
                                permuted, permuted_probs, sorted_indices)
        else:
            # The kernels take contiguous inputs on every backend; the autograd layer takes any.
            tokens, routing_map, probs = _contiguous(tokens, routing_map, probs)
            permuted, permuted_probs, sorted_indices = moe_permute(
                tokens, routing_map, probs, num_out_tokens, drop_and_pad, method, backend=backend)
        ctx.save_for_backward(sorted_indices, routing_map)
        ctx.num_tokens = tokens.shape[0]
        ctx.drop_and_pad = drop_and_pad
        ctx.method, ctx.backend, ctx.lean = method, backend, lean
        ctx.mark_non_differentiable(sorted_indices)
        return permuted, permuted_probs, sorted_indices

    @staticmethod
    def backward(ctx, dpermuted, dpermuted_probs, _):
        sorted_indices, routing_map = ctx.saved_tensors
        dtokens = dprobs = None
        if dpermuted is not None and ctx.needs_input_grad[0]:
            dpermuted = _dense(dpermuted)
            if ctx.lean:
                dtokens = _new_rows(ctx.num_tokens, dpermuted.shape[1], dpermuted.dtype,
                                    dpermuted)
                next(_MOE_TALLY["moe.permute_backward"])
                _moe_permute_backward_native(dpermuted, sorted_indices, dtokens, "auto")
            else:
                dtokens = moe_permute_backward(dpermuted, sorted_indices, ctx.num_tokens,
                                               ctx.method, backend=ctx.backend)
        if dpermuted_probs is not None and ctx.needs_input_grad[2]:
            dpermuted_probs = _dense(dpermuted_probs)
            if ctx.lean:
                dprobs = torch.empty(*routing_map.shape, dtype=dpermuted_probs.dtype)
                next(_MOE_TALLY["moe.permute_probs_backward"])
                _moe_permute_probs_backward_native(dpermuted_probs, sorted_indices, routing_map,
                                                   ctx.drop_and_pad, dprobs)
            else:
                dprobs = moe_permute_probs_backward(
                    dpermuted_probs, sorted_indices, routing_map, ctx.drop_and_pad,
                    backend=_registry.without_triton("moe.permute_probs_backward", ctx.backend))
        return dtokens, None, dprobs, None, None, None, None, None


def permute(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False,
            method=None, *, backend=None):
    """Autograd-aware :func:`leanstep.moe_permute`: gradients flow to tokens
    and probs. Returns ``(permuted, permuted_probs, sorted_indices)``.
    ``backend`` as for :func:`leanstep.moe_permute` (the backward uses the same)."""
    lean = (backend is None and method is None and _lean_moe_call(tokens, routing_map, probs)
            and (num_out_tokens is None or type(num_out_tokens) is int))
    return _PermuteFunction.apply(tokens, routing_map, probs, num_out_tokens, drop_and_pad,
                                  method, backend, lean)


class _UnpermuteFunction(torch.autograd.Function):
    """unpermute and its gradients, on every backend; `lean` as for
    :class:`_PermuteFunction`."""

    @staticmethod
    def forward(ctx, permuted, sorted_indices, restore_shape, probs, routing_map, drop_and_pad,
                method, backend, lean):
        ctx.set_materialize_grads(False)
        if lean:
            rows = _restore_rows(restore_shape, "unpermute", permuted.shape[1])
            out = _new_rows(rows, permuted.shape[1], permuted.dtype, permuted)
            next(_MOE_TALLY["moe.unpermute"])
            _moe_unpermute_native(permuted, sorted_indices, out, probs, routing_map,
                                  drop_and_pad, "auto")
        else:
            permuted, sorted_indices, probs, routing_map = _contiguous(permuted, sorted_indices,
                                                                       probs, routing_map)
            out = moe_unpermute(permuted, sorted_indices, restore_shape, probs, routing_map,
                                drop_and_pad, method, backend=backend)
        ctx.save_for_backward(permuted, sorted_indices, probs, routing_map)
        ctx.drop_and_pad = drop_and_pad
        ctx.method, ctx.backend, ctx.lean = method, backend, lean
        return out

    @staticmethod
    def backward(ctx, dout):
        none = (None,) * 9
        if dout is None:
            return none
        permuted, sorted_indices, probs, routing_map = ctx.saved_tensors
        dout = _dense(dout)
        # dprobs only when probs needs it: its dot products are most of this kernel.
        need_probs = probs is not None and ctx.needs_input_grad[3]
        if ctx.lean:
            dpermuted = _output_like(permuted)  # contiguous, as every lean call's
            dprobs = torch.empty_like(probs) if need_probs else None
            next(_MOE_TALLY["moe.unpermute_backward"])
            _moe_unpermute_backward_native(dout, permuted, sorted_indices, probs, routing_map,
                                           ctx.drop_and_pad, "auto", dpermuted, dprobs)
        else:
            dpermuted, dprobs = moe_unpermute_backward(
                dout, permuted, sorted_indices, probs, routing_map, ctx.drop_and_pad, ctx.method,
                backend=_registry.without_triton("moe.unpermute_backward", ctx.backend))
        return (dpermuted if ctx.needs_input_grad[0] else None, None, None,
                dprobs if need_probs else None) + none[4:]


def unpermute(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
              drop_and_pad=False, method=None, *, backend=None):
    """Autograd-aware :func:`leanstep.moe_unpermute`: gradients flow to the
    permuted tokens and to probs. ``backend`` as for :func:`leanstep.moe_unpermute`."""
    lean = (backend is None and method is None
            and _lean_moe_call(permuted, sorted_indices, probs, routing_map)
            and permuted.dim() == 2)
    return _UnpermuteFunction.apply(permuted, sorted_indices, tuple(restore_shape), probs,
                                    routing_map, drop_and_pad, method, backend, lean)


class _SortChunksFunction(torch.autograd.Function):
    """sort_chunks_by_idxs and its gradient (the inverse move), on every backend;
    `lean` as for :class:`_PermuteFunction`: one native call each way, rows and
    probs moved together."""

    @staticmethod
    def forward(ctx, rows, split_sizes, sorted_idxs, probs, backend, lean):
        ctx.set_materialize_grads(False)
        if lean:
            out = _new_output(tuple(rows.shape), rows.dtype, rows)
            out_probs = None if probs is None else _new_output(tuple(probs.shape), probs.dtype,
                                                               probs)
            next(_MOE_TALLY["moe.sort_chunks_by_idxs"])
            _moe_sort_chunks_native(rows, split_sizes, sorted_idxs, out, probs, out_probs)
        else:
            rows, split_sizes, sorted_idxs, probs = _contiguous(rows, split_sizes, sorted_idxs,
                                                                probs)
            out, out_probs = _sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs,
                                                  backend=backend)
        ctx.save_for_backward(split_sizes, sorted_idxs)
        ctx.backend, ctx.lean = backend, lean
        return out, out_probs

    @staticmethod
    def backward(ctx, dout, dout_probs):
        want_rows = dout is not None and ctx.needs_input_grad[0]
        want_probs = dout_probs is not None and ctx.needs_input_grad[3]
        if not (want_rows or want_probs):
            return None, None, None, None, None, None
        split_sizes, sorted_idxs = ctx.saved_tensors
        # The inverse move: the output's chunks have sizes split_sizes[sorted_idxs];
        # putting them back in order is sorting by the inverse permutation.
        out_sizes = split_sizes.index_select(0, sorted_idxs.long())
        inverse = torch.argsort(sorted_idxs)
        drows = dprobs = None
        if ctx.lean:
            # One native call moves both (each alone where only one is wanted).
            first = _dense(dout) if want_rows else _dense(dout_probs)
            second = _dense(dout_probs) if want_rows and want_probs else None
            dfirst = _new_output(tuple(first.shape), first.dtype, first)
            dsecond = None if second is None else _new_output(tuple(second.shape),
                                                              second.dtype, second)
            next(_MOE_TALLY["moe.sort_chunks_by_idxs"])
            _moe_sort_chunks_native(first, out_sizes, inverse, dfirst, second, dsecond)
            drows, dprobs = (dfirst, dsecond) if want_rows else (None, dfirst)
            return drows, None, None, dprobs, None, None
        if want_rows:
            drows, _ = _sort_chunks_by_idxs(dout.contiguous(), out_sizes, inverse,
                                            backend=ctx.backend)
        if want_probs:
            dprobs, _ = _sort_chunks_by_idxs(dout_probs.contiguous(), out_sizes, inverse,
                                             backend=ctx.backend)
        return drows, None, None, dprobs, None, None


def sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs=None, *, backend=None):
    """Autograd-aware :func:`leanstep.sort_chunks_by_idxs`. Returns
    ``(output, permuted_probs)``. ``backend`` as for :func:`leanstep.sort_chunks_by_idxs`."""
    lean = (backend is None and _lean_moe_call(rows, split_sizes, sorted_idxs, probs)
            and rows.dim() >= 1 and (probs is None or probs.dim() >= 1))
    return _SortChunksFunction.apply(rows, split_sizes, sorted_idxs, probs, backend, lean)
