"""The sync-free optimizer step: ``MixedPrecisionOptimizer.step`` and
``ChainedOptimizer.step`` without a host read of device memory, fp16 and bf16,
0.16 and 0.19.

Megatron's step reads the device in three places; leanstep keeps each on it:

- **found_inf** (fp16, with a grad scaler): ``_unscale_main_grads_and_check_for_nan``
  ends in ``found_inf.item() > 0`` and ``step()`` returns early on it. Here the
  unscale leaves the all-reduced flag on the device
  (:func:`leanstep.megatron.grad.unscale_and_check_on_device`), the step goes on,
  and the skip happens on the device: the inner optimizer's update is masked by
  the flag (:func:`masked_adam_step`), so parameters, moments and step counters
  are bit-for-bit unchanged on a skipped step, as Megatron's own skip leaves
  them. Clipping and the zero count run on a skipped step too (on grads that are
  thrown away), and the main parameters are copied to the model parameters
  unchanged (the same bits again).
- **the loss scale**: ``DynamicGradScaler.update`` keeps its growth and
  hysteresis trackers as Python ints; here they live on the device and are
  updated there (:func:`update_scaler_on_device`), with the same trajectory.
  The scaler becomes a :class:`DeviceTrackedDynamicGradScaler` (its class is
  swapped, nothing else), whose ``_growth_tracker`` and ``_hysteresis_tracker``
  read the device values when Python code asks (``state_dict``, Megatron's own
  ``update`` when the preset switches the patch off): a read then, never per step.
- **ChainedOptimizer** (dense and expert optimizers): each sub-optimizer keeps
  its own flag and scaler, as Megatron does; the skip is their OR, on the device,
  for all of them. Where the sub-optimizers' grad-stats groups differ, the
  combined norm ``sqrt(sum(norm_i ** 2))`` is taken on the device in double,
  as Megatron takes it in Python floats.

The grad norm and zero count stay on the device through the ``grad.norm`` and
``grad.count_zeros`` patches (:mod:`leanstep.megatron.grad`). The step returns
``(update_successful, grad_norm, num_zeros)`` as a :class:`DeviceBool`, a 0-d
device tensor and a 0-d device tensor (or the installed version's constants when
nothing was computed). ``bool(update_successful)``, ``float(grad_norm)`` read
the device: the training loop does it when it logs. On a skipped step Megatron
returns ``(False, None, None)``; here ``update_successful`` is false and
``grad_norm`` is the norm of the overflowed grads (inf or NaN).

The inner optimizers whose update can be masked: ``torch.optim.Adam`` and
``AdamW`` (Megatron's optimizer without Transformer Engine or apex) with
``fused=True`` (torch's kernel takes ``found_inf`` and skips on the device), or
with the for-loop or foreach implementation (:func:`masked_adam_step`: torch's
arithmetic, bit-for-bit where the device's float64 ``pow`` is the C library's,
as on the CPU). Other inner optimizers (Transformer Engine's or apex's
FusedAdam, SGD, CPU offloading), ``amsgrad``, ``maximize``, ``capturable``,
``differentiable`` or a tensor ``lr`` go to Megatron's step, with the reason
counted; so does a grad scaler that is not Megatron's ``DynamicGradScaler`` or
``ConstantGradScaler``, and 0.19's ``grad_norm_skip_threshold`` (a host
comparison of the norm).
"""

import contextlib
import copyreg
import functools
import math
import threading
import weakref

import torch

from .. import _dispatch
from . import _patching
from ._patching import EMPTY, Spec, Variant
from .grad import unscale_and_check_on_device

OPTIMIZER = "megatron.core.optimizer.optimizer"
STEP = "optimizer_step"
CHAINED_STEP = "chained_optimizer_step"

__all__ = ["DeviceBool", "DeviceTrackedDynamicGradScaler", "keep_results_on_device",
           "masked_adam_step", "update_scaler_on_device", "SPECS"]


class DeviceBool:
    """A boolean that stays on the device until asked: the first ``bool(flag)``
    reads it (one host read), later ones reuse that value. ``flag.tensor`` is
    the 0-d bool tensor."""

    __slots__ = ("tensor", "_value")

    def __init__(self, tensor):
        self.tensor = tensor
        self._value = None

    def __bool__(self):
        if self._value is None:
            self._value = bool(self.tensor)
        return self._value

    # What a loop that takes device values may still do with the flag: each of
    # these reads it (once). ``flag is True`` and ``json.dumps(flag)`` cannot be
    # made to work on an object that is not a bool: loops that do those get a
    # real bool (see keep_results_on_device).
    def __int__(self):
        return int(bool(self))

    __index__ = __int__

    def __eq__(self, other):
        if isinstance(other, DeviceBool):
            other = bool(other)
        return bool(self) == other

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(bool(self))

    def __add__(self, other):
        return int(self) + other

    def __radd__(self, other):
        return other + int(self)

    def __sub__(self, other):
        return int(self) - other

    def __rsub__(self, other):
        return other - int(self)

    def __str__(self):
        return str(bool(self))

    def __format__(self, spec):
        return format(bool(self), spec)

    def __repr__(self):
        state = "unread" if self._value is None else self._value
        return f"DeviceBool({state}, on {self.tensor.device})"


# ---------------------------------------------------------------- the loss scale on the device


class DeviceTrackedDynamicGradScaler:
    """Mixed into Megatron's ``DynamicGradScaler`` (see :func:`track_on_device`):
    the growth and hysteresis trackers are one int64 device tensor of two,
    ``_leanstep_trackers``; the Python attributes read (and write) it."""

    __slots__ = ()  # a mixin: the instance layout stays Megatron's (its class can be swapped)

    @property
    def _growth_tracker(self):
        return int(self._leanstep_trackers[0])

    @_growth_tracker.setter
    def _growth_tracker(self, value):
        self._leanstep_trackers[0] = int(value)

    @property
    def _hysteresis_tracker(self):
        return int(self._leanstep_trackers[1])

    @_hysteresis_tracker.setter
    def _hysteresis_tracker(self, value):
        self._leanstep_trackers[1] = int(value)

    def __reduce_ex__(self, protocol):
        # Pickled (torch.save of a scaler, a deepcopy) as Megatron's own class with
        # Python-int trackers (one read): the swapped class is leanstep's run-time
        # detail and cannot be found by name.
        state = dict(vars(self))
        trackers = state.pop("_leanstep_trackers")
        state["_growth_tracker"], state["_hysteresis_tracker"] = (int(v) for v in
                                                                  trackers.tolist())
        base = type(self)._leanstep_base
        # copyreg's own reconstructor: the pickle names Megatron's class and nothing of
        # leanstep's, so it loads where leanstep is not installed.
        return (copyreg._reconstructor, (base, object, None), state)


_tracked_classes = {}
_tracked_lock = threading.Lock()
_tracked_scalers = weakref.WeakSet()  # what uninstall() gives Megatron's class back


def track_on_device(scaler):
    """Moves a ``DynamicGradScaler``'s trackers to the device (its class
    becomes a subclass of its own class and :class:`DeviceTrackedDynamicGradScaler`;
    idempotent). Writes the device (no read)."""
    cls = type(scaler)
    if isinstance(scaler, DeviceTrackedDynamicGradScaler):
        return scaler
    with _tracked_lock:
        tracked = _tracked_classes.get(cls)
        if tracked is None:
            # Megatron's class first: the layout test of __class__ assignment wants it;
            # the properties still win (the class defines no such attributes).
            tracked = type(cls.__name__, (cls, DeviceTrackedDynamicGradScaler),
                           {"__slots__": (), "__module__": cls.__module__,
                            "__qualname__": cls.__qualname__,
                            "_leanstep_base": cls})
            _tracked_classes[cls] = tracked
    values = [vars(scaler).pop("_growth_tracker"), vars(scaler).pop("_hysteresis_tracker")]
    scaler._leanstep_trackers = torch.tensor(values, dtype=torch.int64,
                                             device=scaler._scale.device)
    scaler.__class__ = tracked
    _tracked_scalers.add(scaler)
    return scaler


def untrack(scaler):
    """Back to Megatron's class with Python-int trackers (one read)."""
    if not isinstance(scaler, DeviceTrackedDynamicGradScaler):
        return scaler
    growth, hysteresis = (int(v) for v in scaler._leanstep_trackers.tolist())
    scaler.__class__ = type(scaler)._leanstep_base
    del scaler._leanstep_trackers
    scaler._growth_tracker = growth
    scaler._hysteresis_tracker = hysteresis
    _tracked_scalers.discard(scaler)
    return scaler


def untrack_all():
    """Every scaler leanstep moved to the device gets Megatron's class and
    Python-int trackers back (uninstall: nothing of leanstep's stays behind)."""
    for scaler in list(_tracked_scalers):
        untrack(scaler)


def update_scaler_on_device(scaler, found_inf):
    """``DynamicGradScaler.update(found_inf)`` with the flag on the device:
    the same trajectory (Megatron: on an overflow the growth tracker resets and
    the hysteresis tracker counts down, the scale backs off, not below
    ``min_scale``, when it reaches 0; otherwise the growth tracker counts up and
    at ``growth_interval`` resets, restores the hysteresis and grows the scale).
    ``_scale`` is rebound to a new tensor, as Megatron does."""
    track_on_device(scaler)
    found = (found_inf.reshape(()) > 0)
    growth, hysteresis = scaler._leanstep_trackers.unbind(0)
    zero = torch.zeros_like(growth)
    growth = torch.where(found, zero, growth + 1)
    hysteresis = torch.where(found, hysteresis - 1, hysteresis)
    back_off = found & (hysteresis <= 0)
    grow = ~found & (growth == scaler.growth_interval)
    growth = torch.where(grow, zero, growth)
    hysteresis = torch.where(grow, torch.full_like(hysteresis, scaler.hysteresis), hysteresis)
    scale = scaler._scale
    scale = torch.where(back_off, torch.max(scale * scaler.backoff_factor, scaler.min_scale), scale)
    scale = torch.where(grow, scaler._scale * scaler.growth_factor, scale)
    scaler._leanstep_trackers = torch.stack((growth, hysteresis))
    scaler._scale = scale


def _scaler_reason(scaler):
    if scaler is None:
        return None
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if type(scaler) is ConstantGradScaler:
        return None
    base = getattr(type(scaler), "_leanstep_base", type(scaler))
    if base is DynamicGradScaler:
        return None
    return "grad_scaler_type"


def _update_scaler(scaler, found_inf):
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler

    if type(scaler) is not ConstantGradScaler:
        update_scaler_on_device(scaler, found_inf)


# ---------------------------------------------------------------- the masked inner update


_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


def _inner_reason(inner):
    """Why leanstep cannot mask this inner optimizer's update (None if it can)."""
    if type(inner) not in _ADAM_CLASSES:
        return "inner_optimizer"
    for group in inner.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                return f"adam_{key}"
        if isinstance(group["lr"], torch.Tensor) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return "adam_tensor_hyperparameter"
        if group["params"] and any(torch.is_complex(p) for p in group["params"]):
            return "adam_complex"
        if (group.get("foreach") is False and not group.get("fused")
                and any(p.is_cuda for p in group["params"])):
            # torch's for-loop on CUDA rounds as neither the CPU's for-loop nor CUDA's
            # foreach (its divisions by a Python float run as multiplications by the
            # reciprocal there): the masked update would not be its bits.
            return "adam_for_loop_on_cuda"
    fused = {bool(g.get("fused")) for g in inner.param_groups}
    if len(fused) > 1:
        return "adam_fused_mixed"
    return None


@torch.no_grad()
def masked_adam_step(inner, found_inf):
    """One step of ``torch.optim.Adam`` / ``AdamW`` ``inner`` that leaves
    parameters, moments and step counters bit-for-bit unchanged where the
    device flag ``found_inf`` (fp32, > 0: skip) is set, without reading it.

    ``fused=True``: torch's fused kernel given ``found_inf`` (it skips and takes
    the step counters back), through the class's own ``step`` (its hooks run
    once; an instance-level shadow of ``step`` is not re-entered). Otherwise
    the arithmetic of torch's default for the device (the for-loop on the CPU;
    on CUDA the foreach implementation, whose update rounds differently), with
    the step counters moved to the device (they count only taken steps) and
    the bias corrections computed there in float64, as torch computes them in
    Python floats from its host counters; the new moments and parameters are
    committed with ``torch.where`` on the flag. Low-precision params (fp16,
    bf16) take torch's roundings: the ops torch runs with a Python-float
    scalar compute in fp32 and round once.
    Where a group's counters are known to be equal and distinct (every
    parameter has had a grad at every step since they moved to the device,
    checked on the host), the bias corrections are computed once for the group
    and the arithmetic runs as foreach ops (on the CPU torch's foreach ops run
    its per-tensor kernels: the same bits). Otherwise each param is stepped in
    list order, its counter incremented just before its own update, as torch's
    for-loop does: counters that are one shared tensor (as Megatron's
    distributed optimizer leaves them after loading a checkpoint) then advance
    and are read exactly as torch advances and reads them."""
    groups = inner.param_groups
    if groups and groups[0].get("fused"):
        inner.found_inf = found_inf.reshape(())
        try:
            type(inner).step(inner)
        finally:
            del inner.found_inf
        return
    skip = found_inf.reshape(()) > 0
    keep = torch.where(skip, 0.0, 1.0).to(torch.float32)
    _watch_state_loads(inner)
    first = not getattr(inner, "_leanstep_device_steps", False)
    uniform = inner.__dict__.setdefault("_leanstep_uniform_steps", {})
    for index, group in enumerate(groups):
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        inner._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        if not params:
            continue
        if first:
            # The counters are torch's, on the host: their values are read there (host
            # memory, no wait for the device), once, before they move to the device.
            # One tensor shared by several params is not uniform: each param's update
            # reads it after its own increment.
            distinct = len({id(t) for t in steps}) == len(steps)
            uniform[index] = distinct and len({float(t) for t in steps}) == 1
        # Equal counters stay equal while all of the group's params step together (a
        # param without a grad is not stepped: its counter falls behind).
        if len(params) != len(group["params"]):
            uniform[index] = False
        steps = _steps_on_device(inner, params)
        is_adamw = isinstance(inner, torch.optim.AdamW)
        if uniform.get(index):
            _foreach_scalar("add_", steps, keep.to(steps[0].dtype))
            _masked_group_foreach(group, params, grads, exp_avgs, exp_avg_sqs, steps[0], skip,
                                  is_adamw)
        else:
            # Each param with its own counter, in torch's order: the increment, then the
            # same ops over one-element lists (on the CPU torch's foreach ops run the
            # per-tensor kernels of its for-loop).
            for one in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
                step_t = one[4]
                step_t.add_(keep.to(step_t.dtype))
                _masked_group_foreach(group, *([t] for t in one[:4]), step_t, skip, is_adamw)


def _forget_device_steps(inner, *args):
    """After ``load_state_dict``: the counters are the checkpoint's, on the host
    again and maybe unequal or shared; the next step looks at them afresh."""
    inner.__dict__.pop("_leanstep_device_steps", None)
    inner.__dict__.pop("_leanstep_uniform_steps", None)


def _watch_state_loads(inner):
    if not inner.__dict__.get("_leanstep_watches_loads"):
        inner.register_load_state_dict_post_hook(_forget_device_steps)
        inner._leanstep_watches_loads = True


def _steps_on_device(inner, params):
    """The params' step counters, moved where the params are (torch keeps a
    for-loop counter on the host)."""
    steps = []
    for param in params:
        state = inner.state[param]
        step_t = state["step"]
        on_device = step_t.to(param.device)
        if on_device is not step_t:
            state["step"] = on_device
        steps.append(on_device)
    inner._leanstep_device_steps = True
    return steps


def _foreach_scalar(op, tensors, scalar):
    """``torch._foreach_<op>(tensors, scalar)`` for a 0-d device tensor
    ``scalar``, without a host read: CUDA's foreach kernels take the tensor;
    elsewhere (the CPU, meta, other devices) the one-tensor overload reads it
    with ``.item()``, so each tensor gets it as a list entry (torch's per-tensor
    kernels, broadcast). On CUDA the ``.Tensor`` overload is named outright:
    through ``torch._foreach_<op>`` Python's argument parser may match a 0-d
    tensor to the ``.Scalar`` overload first, and that reads it on the host
    (seen on an H200: one sync per step from the counters' increment). Meta
    tensors take CUDA's form (their kernels read nothing): the tests prove it
    sync-free there."""
    if scalar.device.type in ("cuda", "meta"):
        return getattr(torch.ops.aten, "_foreach_" + op).Tensor(tensors, scalar)
    return getattr(torch, "_foreach_" + op)(tensors, [scalar] * len(tensors))


def _bias_corrections(group, step_t):
    """(step_size, bias_correction2_sqrt) as 0-d float64 device tensors: torch's
    Python-float arithmetic from the counter, with the C library's ``pow``
    (tensor exponents: a scalar 0.5 would become ``sqrt``)."""
    f64 = torch.float64
    beta1, beta2 = group["betas"]
    step = step_t.to(f64)
    # torch.full fills on the device: torch.tensor(x, device=...) would copy from
    # the host, a copy that waits for the device.
    b1 = torch.full((), beta1, dtype=f64, device=step.device)
    b2 = torch.full((), beta2, dtype=f64, device=step.device)
    half = torch.full((), 0.5, dtype=f64, device=step.device)
    # lr / x as one division (a Python number over a tensor would be lr * (1 / x):
    # two roundings).
    step_size = torch.full((), group["lr"], dtype=f64, device=step.device).div_(
        1 - torch.pow(b1, step))
    return step_size, torch.pow(1 - torch.pow(b2, step), half)


def _foreach_reference(device_type):
    """Whether the masked update copies the roundings of torch's foreach Adam
    on CUDA (``foreach=None`` picks it there; measured on an H200, the default
    equals ``foreach=True`` bit for bit) rather than those of the CPU's
    for-loop. They differ in the update: CUDA's ``addcdiv`` kernels compute
    ``p + value * (m / d)`` in one fma, the CPU's ``p + value * m / d``. A
    for-loop AdamW on CUDA (``foreach=False``) rounds as neither and is not
    masked (``_inner_reason``)."""
    return device_type == "cuda"


def _apply_update(params, exp_avgs, denoms, step_size, dtype, math_dtype, foreach_reference):
    """params + (-step_size) * exp_avgs / denoms, rounded as torch's Adam on
    the device rounds it (see :func:`_foreach_reference`); ``step_size`` a 0-d
    float64 device tensor, ``denoms`` already in the params' dtype."""
    low_precision = math_dtype is not dtype
    if foreach_reference:
        # addcdiv on CUDA: p + s * (m / d), the quotient rounded in the op-math
        # type and the product-sum one fused multiply-add; addcmul(p, q, s) is
        # that same fma (measured equal to addcdiv on an H200).
        value = (-step_size).to(math_dtype)
        if low_precision:
            quotients = [m.to(math_dtype) / d.to(math_dtype) for m, d in zip(exp_avgs, denoms)]
            return [torch.addcmul(p.to(math_dtype), q, value).to(dtype)
                    for p, q in zip(params, quotients)]
        quotients = torch._foreach_div(exp_avgs, denoms)
        return [torch.addcmul(p, q, value) for p, q in zip(params, quotients)]
    if low_precision:
        updates = _foreach_scalar("mul", [e.to(math_dtype) for e in exp_avgs],
                                  (-step_size).to(math_dtype))
        torch._foreach_div_(updates, [d.to(math_dtype) for d in denoms])
        return [(p.to(math_dtype) + u).to(dtype) for p, u in zip(params, updates)]
    updates = _foreach_scalar("mul", exp_avgs, (-step_size).to(dtype))
    torch._foreach_div_(updates, denoms)
    return torch._foreach_add(params, updates)


def _masked_group_foreach(group, params, grads, exp_avgs, exp_avg_sqs, step_t, skip, is_adamw):
    """torch's ``_single_tensor_adam`` (non-capturable), masked by ``skip``,
    for params whose step counters all equal ``step_t``: the bias corrections
    once, the elementwise ops as foreach ops. ``param.addcdiv_(exp_avg, denom,
    value=-step_size)`` computes ``self + value * t1 / t2``: the same roundings
    here, with the step-dependent value from the device. Where torch passes a
    Python float (``denom / bias_correction2_sqrt``, ``addcdiv_``'s value), its
    kernels compute in the op-math type (fp32 for fp16 and bf16 params) and
    round once: low-precision params are computed here in fp32 and rounded once,
    likewise."""
    beta1, beta2 = group["betas"]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    decoupled = group.get("decoupled_weight_decay", is_adamw)
    step_size, bias_correction2_sqrt = _bias_corrections(group, step_t)
    dtype = params[0].dtype
    math_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    low_precision = math_dtype is not dtype
    new_params = params
    if weight_decay != 0:
        if decoupled:
            new_params = torch._foreach_mul(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    new_exp_avgs = torch._foreach_lerp(exp_avgs, grads, 1 - beta1)
    new_exp_avg_sqs = torch._foreach_mul(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(new_exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_sqrt(new_exp_avg_sqs)
    if low_precision:
        wide = [d.to(math_dtype) for d in denoms]
        _foreach_scalar("div_", wide, bias_correction2_sqrt.to(math_dtype))
        denoms = [d.to(dtype) for d in wide]
        denoms = [(d.to(math_dtype) + eps).to(dtype) for d in denoms]
    else:
        _foreach_scalar("div_", denoms, bias_correction2_sqrt.to(dtype))
        torch._foreach_add_(denoms, eps)
    new_params = _apply_update(new_params, new_exp_avgs, denoms, step_size, dtype, math_dtype,
                               _foreach_reference(params[0].device.type))
    for old, new in zip(exp_avgs, new_exp_avgs):
        torch.where(skip, old, new, out=old)
    for old, new in zip(exp_avg_sqs, new_exp_avg_sqs):
        torch.where(skip, old, new, out=old)
    for old, new in zip(params, new_params):
        torch.where(skip, old, new, out=old)


def restore_host_state(optimizers):
    """Before Megatron's own step runs again (the preset switched the patch
    off, or a reason sent it there): the step counters that
    :func:`masked_adam_step` moved to the device go back to the host, where
    torch's for-loop reads them, and the scalers get Python-int trackers. One
    read each, once, at the switch: never per step."""
    for opt in optimizers:
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            untrack(scaler)
        inner = getattr(opt, "optimizer", None)
        if inner is not None and getattr(inner, "_leanstep_device_steps", False):
            for state in inner.state.values():
                step_t = state.get("step")
                if isinstance(step_t, torch.Tensor):
                    state["step"] = step_t.to("cpu")
            del inner._leanstep_device_steps
            inner.__dict__.pop("_leanstep_uniform_steps", None)


# ---------------------------------------------------------------- the step


class _Step:
    """The shadows of one sync-free step: each mixed-precision sub-optimizer's
    unscale returns False after leaving its flag on the device, its scaler's
    update takes that flag, and its inner optimizer's step is masked by the OR
    of all flags."""

    def __init__(self, optimizers):
        self.optimizers = optimizers
        self.flags = []
        self._combined = None

    def combined(self):
        if self._combined is None:
            flags = self.flags
            self._combined = flags[0].clone() if len(flags) == 1 else \
                torch.stack([f.reshape(()) for f in flags]).amax().reshape(1)
        return self._combined

    @contextlib.contextmanager
    def shadows(self):
        shadowed = []

        def shadow(obj, name, value):
            obj.__dict__[name] = value
            shadowed.append((obj, name))

        try:
            for opt in self.optimizers:
                if getattr(opt, "grad_scaler", None) is None:
                    continue
                shadow(opt, "_unscale_main_grads_and_check_for_nan",
                       functools.partial(self._unscale, opt))
                shadow(opt.grad_scaler, "update", functools.partial(self._update, opt))
                if not getattr(opt, "is_stub_optimizer", False) and opt.optimizer is not None:
                    shadow(opt.optimizer, "step", functools.partial(self._inner_step, opt))
            yield
        finally:
            for obj, name in reversed(shadowed):
                obj.__dict__.pop(name, None)

    def _unscale(self, opt):
        found = unscale_and_check_on_device(opt)
        opt._leanstep_found = found.clone()  # found_inf is refilled by the next step
        self.flags.append(opt._leanstep_found)
        return False  # the step goes on; the flag masks the update on the device

    def _update(self, opt, found_inf_flag):
        _update_scaler(opt.grad_scaler, opt._leanstep_found)

    def _inner_step(self, opt, closure=None):
        inner = opt.optimizer
        if inner.param_groups and inner.param_groups[0].get("fused"):
            # The class's own step (hooked by torch) takes found_inf: hooks run once.
            return masked_adam_step(inner, self.combined())
        # Through torch's hook wrapper, as Optimizer.step: its pre- and post-step
        # hooks run and it records the step for the profiler.
        run = torch.optim.Optimizer.profile_hook_step(
            lambda inner, *args, **kwargs: masked_adam_step(inner, self.combined()))
        return run(inner)


def _sub_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _reason(optimizers):
    """Why this step goes to Megatron's own (None when leanstep runs it)."""
    for opt in optimizers:
        config = getattr(opt, "config", None)
        threshold = getattr(config, "grad_norm_skip_threshold", math.inf)
        if threshold is not None and math.isfinite(threshold):
            return "grad_norm_skip_threshold"
        if getattr(opt, "grad_scaler", None) is None:
            continue
        if not _dispatch.op_enabled("grad.unscale"):
            return "unscale_switched_off"
        reason = _scaler_reason(opt.grad_scaler)
        if reason is not None:
            return reason
        if not getattr(opt, "is_stub_optimizer", False) and opt.optimizer is not None:
            reason = _inner_reason(opt.optimizer)
            if reason is not None:
                return reason
    return None


def _device_of(optimizers):
    for opt in optimizers:
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None:
            return scaler.scale.device.type
        for group in getattr(getattr(opt, "optimizer", None), "param_groups", ()):
            for p in group["params"]:
                return p.device.type
    return "cpu"


_running = threading.local()  # .step: the sync-free step this thread is inside, if any


def _make_step(original, spec, chained=False):
    @functools.wraps(original)
    def step(self):
        if getattr(_running, "step", None) is not None:
            # A step called from inside one (a chained optimizer's own code calling a
            # sub-optimizer's step): the outer step's shadows already cover it.
            return original(self)
        optimizers = _sub_optimizers(self)
        reason = "switched_off" if not _patching.is_active(spec) else _reason(optimizers)
        if reason is not None:
            _patching.count(spec.name, reason=reason)
            restore_host_state(optimizers)
            results = original(self)  # the norm may still be a patched device value
            return results if _results_on_device(self) else _host_results(*results)
        _patching.count(spec.name, _device_of(optimizers), "torch")
        run = _Step(optimizers)
        _running.step = run
        try:
            with run.shadows(), _chained_norm(self) if chained else contextlib.nullcontext():
                success, grad_norm, num_zeros = original(self)
        finally:
            _running.step = None
        if run.flags:
            ok = run.combined().reshape(()) == 0
            success = DeviceBool(ok if success else torch.zeros_like(ok))
        if _results_on_device(self):
            return success, grad_norm, num_zeros
        return _host_results(success, grad_norm, num_zeros)

    return step


_device_results = {"default": False}


def keep_results_on_device(optimizer=None, enabled=True):
    """Lets ``optimizer.step()`` (or, with ``optimizer=None``, every patched
    step of this process that has no setting of its own) return its results
    on the device: ``update_successful`` as a :class:`DeviceBool`, the grad
    norm and the zero count as 0-d device tensors, so the step reads nothing.

    Only for a loop known to take such values: leanstep's main job, and
    ms-swift's train_step with the plugin (its reductions take them). By
    default the step returns what Megatron's step returns (a Python bool, the
    installed version's norm and zero-count types, ``(False, None, None)`` on a
    skipped step), because Megatron-LM's ``train_step`` and its copies in
    ms-swift and Megatron-Bridge test ``update_successful is True``: a device
    value there would count every step as skipped and never step the
    learning-rate schedule. That costs the one read of the flag Megatron's own
    step makes (and, where the installed code returns a float, of the norm)."""
    if optimizer is None:
        _device_results["default"] = bool(enabled)
        return
    optimizer.__dict__["_leanstep_device_results"] = bool(enabled)


def _results_on_device(optimizer):
    return optimizer.__dict__.get("_leanstep_device_results", _device_results["default"])


def _host_results(success, grad_norm, num_zeros):
    """The step's results as Megatron's step returns them: a Python bool (one
    read of the device flag, as Megatron's ``found_inf.item()``), and on a
    skipped step ``(False, None, None)``. Where leanstep kept a value on the
    device that the installed code returns as a Python number, it is read
    (one read each, as the installed code's own ``.item()``): a float64 norm
    (the installed float path's double) becomes a float, a 0-d zero count a
    float (fp32 count, 0.16) or an int (int64 count, 0.17+)."""
    if isinstance(success, DeviceBool):
        success = bool(success)
        if not success:
            return False, None, None
    if isinstance(grad_norm, torch.Tensor) and grad_norm.dtype == torch.float64 \
            and grad_norm.dim() == 0:
        grad_norm = grad_norm.item()
    if isinstance(num_zeros, torch.Tensor) and num_zeros.dim() == 0:
        num_zeros = num_zeros.item()
    return success, grad_norm, num_zeros


@contextlib.contextmanager
def _chained_norm(chained):
    """ChainedOptimizer.get_grad_norm where the sub-optimizers' grad-stats
    groups differ: ``math.sqrt(sum(norm ** 2))`` over their norms (floats in
    Megatron) on the device, in double."""
    if len(chained.chained_optimizers) < 2 or chained.grads_states_parallel_group_is_shared():
        yield
        return

    def get_grad_norm():
        total = None
        for opt in chained.chained_optimizers:
            norm = opt.get_grad_norm()
            if isinstance(norm, torch.Tensor):
                norm = norm.to(torch.float64).reshape(())
                square = norm * norm
            elif norm:
                square = float(norm) ** 2
            else:
                square = 0.0
            total = square if total is None else total + square
        if isinstance(total, torch.Tensor):
            return torch.sqrt(total)
        return math.sqrt(total or 0.0)

    chained.__dict__["get_grad_norm"] = get_grad_norm
    try:
        yield
    finally:
        chained.__dict__.pop("get_grad_norm", None)


SPECS = [
    Spec(STEP, "grad.norm", OPTIMIZER, "step",
         [Variant("0.16-0.19", [("self", EMPTY)], _make_step)],
         class_attr="MixedPrecisionOptimizer", requires_area="grad",
         host_read=None),
    Spec(CHAINED_STEP, "grad.norm", OPTIMIZER, "step",
         [Variant("0.16-0.19", [("self", EMPTY)],
                  functools.partial(_make_step, chained=True))],
         class_attr="ChainedOptimizer", requires_area="grad", host_read=None),
]
