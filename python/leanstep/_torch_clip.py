"""torch's gradient clipping, on leanstep's grad plans: ``clip_grad_norm_``,
``get_total_norm`` and ``clip_grads_with_norm_`` with torch's signatures and
semantics (``torch/nn/utils/clip_grad.py``), and :class:`GradBuffer`, which
lays a model's trainable grads out in one flat buffer so that they coalesce
into one region (one pass over all of them).

What equals torch's and what does not:
- the clip itself is torch's arithmetic: the coefficient is
  ``clamp(max_norm / (total_norm + 1e-6), max=1)`` computed by the same torch
  ops in ``total_norm``'s dtype (for an fp32 norm on the CPU kernels, the same
  roundings in the native call that scales: grad::torch_clip_coefficient), and
  every grad is multiplied by it once (fp32 math, one rounding: what
  ``_foreach_mul_`` does). Given the same norm, the clipped grads are
  bit-identical to torch's;
- the norm is accumulated in fp32 in one order of leanstep's (torch sums each
  tensor, then the per-tensor norms, in the grads' dtype), then rounded once to
  the dtype torch returns (the promotion of the grads' dtypes). It differs from
  torch's in the last bits: ``tests/python/test_torch_clip.py`` states the
  bound against a float64 oracle;
- nothing is read on the host unless ``error_if_nonfinite`` asks (as torch).

Calls leanstep does not plan go to torch's own functions, unchanged: norm types
other than p > 0 and inf (0, negative), float64 or non-float grads, grads on
several devices, tensor subclasses, a device leanstep cannot use. DTensor
grads are refused with an error: clipping a sharded model needs the norm over
every shard, which this local function cannot give.
"""

import math
import types
import warnings

import torch
from torch.nn.utils import clip_grad as _torch_clip_grad

from ._leanstep import Error
from ._plans import PlanCache, as_list, grads_with_key

__all__ = ["clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_", "GradBuffer"]

# torch's own functions, captured before anything patches torch.nn.utils (a
# delegated call must never reach a patched name again).
_torch_get_total_norm = _torch_clip_grad._get_total_norm
_torch_clip_grads_with_norm_ = _torch_clip_grad._clip_grads_with_norm_

# The grads leanstep's fp32 accumulation serves: float64 grads keep torch's
# float64 norm.
_PLANNED_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))

plans = PlanCache()

_FP32_MAX = float(torch.finfo(torch.float32).max)

#: The path and reason of the latest call of each function (what ran and why).
last_decision = {}


def _decide(op, path, reason):
    last_decision[op] = {"path": path, "reason": reason}


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor  # lazy: distributed may be absent
    except (ImportError, RuntimeError):
        return None
    return DTensor


def _refuse_dtensor(grads, where, arg):
    dtensor = _dtensor_type()
    if dtensor is None:
        return
    for i, g in enumerate(grads):
        if isinstance(g, dtensor):
            raise Error(f"{where}: argument '{arg}' holds a DTensor grad ({arg}[{i}], placements "
                        f"{tuple(g.placements)}); leanstep clips local tensors only, and the "
                        f"norm of a sharded model needs every shard: use "
                        f"torch.nn.utils.{where.split('.')[-1]} for DTensor grads")


#: Whether DTensor grads raise (the drop-ins, called by name) or go to torch's
#: own function (while :func:`install` has torch.nn.utils call leanstep: FSDP2's
#: clipping through accelerate keeps working).
_refuse_dtensors = True


def _plan_for(grads, key, op, in_place):
    """(plan, None) or (None, reason): the reason sends the call to torch."""
    plan, reason = plans.get(grads, in_place=in_place, key=key)
    if reason is None and not plan.dtypes <= _PLANNED_DTYPES:
        reason = "dtype"
    if reason == "tensor_subclass" and _refuse_dtensors:
        _refuse_dtensor(grads, f"leanstep.torch.{op}", "tensors" if op == "get_total_norm"
                        else "parameters")
    return plan, reason


def _result_dtype(dtypes):
    result = None
    for dtype in dtypes:
        result = dtype if result is None else torch.promote_types(result, dtype)
    return result


def _nonfinite_error(norm_type):
    return RuntimeError(
        f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so "
        "it cannot be clipped. To disable this error and scale the gradients by the non-finite "
        "norm anyway, set `error_if_nonfinite=False`")


def _total_norm(grads, key, norm_type, error_if_nonfinite, foreach, op):
    norm_type = float(norm_type)
    if not grads:
        _decide(op, "torch", "empty")
        return torch.tensor(0.0)
    if not (norm_type > 0):  # 0 counts non-zero norms, negative p: torch's own
        _decide(op, "torch", "norm_type")
        return _torch_get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    plan, reason = _plan_for(grads, key, op, in_place=False)
    if reason is None and foreach and not _torch_clip_grad._device_has_foreach_support(
            grads[0].device):
        reason = "foreach_unsupported"  # torch raises its own error
    if reason is None and norm_type == math.inf and plan.num_empty:
        reason = "empty_grad_inf_norm"  # torch raises: a max over no element has no identity
    if reason is not None:
        _decide(op, "torch", reason)
        return _torch_get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    _decide(op, "leanstep", plan.backend)
    norm = plan.total_norm(norm_type)
    total = norm.view(())
    dtype = _result_dtype(plan.dtypes)
    if dtype != torch.float32:
        total = total.to(dtype)
    if error_if_nonfinite and not math.isfinite(total):  # a host read, as torch's
        raise _nonfinite_error(norm_type)
    return total


def _clip_with_norm(grads, key, max_norm, total_norm, foreach, op):
    max_norm = float(max_norm)
    if not grads:
        return
    plan, reason = _plan_for(grads, key, op, in_place=True)
    if reason is None and foreach and not _torch_clip_grad._device_has_foreach_support(
            grads[0].device):
        reason = "foreach_unsupported"
    if reason is None and not isinstance(total_norm, torch.Tensor):
        reason = "total_norm_not_a_tensor"  # torch's arithmetic on it decides
    if reason is not None:
        _decide(op, "torch", reason)
        # torch takes the parameters; a stand-in per grad carries it as .grad.
        _torch_clip_grads_with_norm_([_Holder(g) for g in grads], max_norm, total_norm, foreach)
        return
    _decide(op, "leanstep", plan.backend)
    if (plan.backend == "cpu" and type(total_norm) is torch.Tensor and total_norm.is_cpu
            and total_norm.dtype == torch.float32 and total_norm.dim() == 0
            and 0.0 <= max_norm <= _FP32_MAX):
        # torch's coefficient and multiply in one native call (the ops' own arithmetic:
        # grad::torch_clip_coefficient), the norm read where the kernels run.
        plan.torch_rule_clip_(max_norm, total_norm)
        return
    # torch's coefficient, by torch's own ops, in total_norm's dtype.
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    device = grads[0].device
    if coefficient.dtype != torch.float32 or coefficient.device != device:
        coefficient = coefficient.to(device=device, dtype=torch.float32)
    plan.scale_(coefficient.reshape(1))


class _Holder:
    __slots__ = ("grad",)

    def __init__(self, grad):
        self.grad = grad


def _as_list(parameters):
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = as_list(parameters)
    if is_generator and not parameters:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                      stacklevel=3)
    return parameters


def get_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.get_total_norm``: the norm of the tensors viewed as one
    vector, a 0-dim tensor of torch's dtype on the first tensor's device."""
    with torch.no_grad():
        tensors = as_list(tensors)
        return _total_norm(tensors, None, norm_type, error_if_nonfinite, foreach,
                           "get_total_norm")


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
    """``torch.nn.utils.clip_grads_with_norm_``: every grad of ``parameters``
    multiplied in place by ``min(max_norm / (total_norm + 1e-6), 1)``."""
    with torch.no_grad():
        params = _as_list(parameters)
        grads, key = grads_with_key(params)
        _clip_with_norm(grads, key, max_norm, total_norm, foreach, "clip_grads_with_norm_")


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False,
                    foreach=None):
    """``torch.nn.utils.clip_grad_norm_``: the total norm of the parameters'
    grads (returned, as torch does), then every grad clipped by it in place.
    The grads are found once, in one C pass; no host read."""
    with torch.no_grad():
        params = _as_list(parameters)
        grads, key = grads_with_key(params)
        total = _total_norm(grads, key, norm_type, error_if_nonfinite, foreach,
                            "clip_grad_norm_")
        _clip_with_norm(grads, key, max_norm, total, foreach, "clip_grad_norm_")
        return total


# ---------------------------------------------------------------- torch.nn.utils


_TORCH_NAMES = ("clip_grad_norm_", "get_total_norm", "clip_grads_with_norm_")
_installed = []  # torch's functions while installed (a count of nested installs)


def install():
    """Makes ``torch.nn.utils.clip_grad_norm_``, ``get_total_norm`` and
    ``clip_grads_with_norm_`` leanstep's, for code that calls them by name
    (accelerate, and through it the HF Trainer); DTensor grads then go to
    torch's own functions. Nested installs count; :func:`uninstall` undoes one."""
    global _refuse_dtensors
    utils = torch.nn.utils
    if not _installed:
        originals = {name: getattr(utils, name) for name in _TORCH_NAMES}
        for name in _TORCH_NAMES:
            setattr(utils, name, globals()[name])
        _installed.append(originals)
        _refuse_dtensors = False
    else:
        _installed.append(None)


def uninstall():
    global _refuse_dtensors
    if not _installed:
        return
    originals = _installed.pop()
    if originals is None:
        return
    for name, function in originals.items():
        setattr(torch.nn.utils, name, function)
    _refuse_dtensors = True


def installed():
    return bool(_installed)


# ---------------------------------------------------------------- one buffer


class GradBuffer:
    """The trainable parameters' grads laid out in one flat buffer per device
    and dtype, in parameter order (as DDP's buckets and Megatron's grad
    buffers do): each ``param.grad`` is a view into it, autograd accumulates
    into the views in place, and leanstep's plans see one region, one pass.

    Semantics as under DDP's buckets: a parameter in the buffer always has a
    grad; one that no loss reached has zeros, where ``zero_grad(set_to_none=
    True)`` would have left None. An optimizer then steps it (weight decay,
    Adam's moments), where None would have skipped it. Models whose every
    trainable parameter gets a grad each step (LoRA on dense layers) train
    identically; where some don't (experts no token reached), pass them over
    or leave the buffer out.

    ``zero_grad()`` zeroes the buffer (views kept) and re-attaches any grad
    that something replaced; :meth:`install` makes a module's own
    ``zero_grad`` do that (the HF Trainer calls ``model.zero_grad()``)."""

    def __init__(self, params):
        seen = set()
        self._params = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._params.append(p)
        groups = {}
        for p in self._params:
            if p.dtype not in _PLANNED_DTYPES:
                raise Error(f"GradBuffer: argument 'params' holds a {p.dtype} parameter of "
                            f"shape {list(p.shape)}; the buffer takes float32, float16 and "
                            f"bfloat16 parameters")
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.buffers = []
        self._views = {}
        for (device, dtype), members in groups.items():
            total = sum(p.numel() for p in members)
            flat = torch.zeros(total, dtype=dtype, device=device)
            self.buffers.append(flat)
            offset = 0
            for p in members:
                self._views[id(p)] = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()
        self._installed = {}
        with torch.no_grad():
            for p in self._params:
                if p.grad is not None:
                    self._views[id(p)].copy_(p.grad)
        self._attach()
        self._key = grads_with_key(self._params)[1]

    @property
    def params(self):
        return list(self._params)

    def _attach(self):
        for p in self._params:
            view = self._views[id(p)]
            if p.grad is not view:
                p.grad = view

    def attached(self):
        """Whether every parameter's grad is still its view (one C pass)."""
        key = grads_with_key(self._params)[1]
        return key is not None and key == self._key

    def zero_grad(self, set_to_none=True):
        """Zeroes every grad in the buffer (one fill per buffer) and re-attaches
        the views where a grad was replaced. ``set_to_none`` is accepted for
        ``Module.zero_grad``'s signature: the grads stay, as zeros (see the
        class's note)."""
        with torch.no_grad():
            for flat in self.buffers:
                flat.zero_()
        if not self.attached():
            self._attach()

    def install(self, module):
        """``module.zero_grad`` becomes :meth:`zero_grad` for the buffer's
        parameters (the rest of the module's grads as its own zero_grad does);
        :meth:`uninstall` restores it."""
        own = set(map(id, self._params))
        others = [p for p in module.parameters() if id(p) not in own]
        original = module.__dict__.get("zero_grad")

        def zero_grad(set_to_none=True):
            self.zero_grad()
            if not grads_with_key(others)[0]:  # one C pass: frozen params have no grads
                return
            for p in others:  # Module.zero_grad's own treatment
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

        module.zero_grad = zero_grad
        self._installed[id(module)] = (module, original)

    def uninstall(self):
        for module, original in self._installed.values():
            if original is None:
                module.__dict__.pop("zero_grad", None)
            else:
                module.zero_grad = original
        self._installed.clear()

    def release(self):
        """Gives the grads back as separate tensors (copies) and stops using the
        buffer."""
        self.uninstall()
        with torch.no_grad():
            for p in self._params:
                if p.grad is self._views[id(p)]:
                    p.grad = p.grad.clone()
        self.buffers = []
        self._views = {}
        self._params = []

    def __repr__(self):
        sizes = ", ".join(f"{b.dtype} x {b.numel()} on {b.device}" for b in self.buffers)
        return f"GradBuffer({len(self._params)} params: {sizes})"
