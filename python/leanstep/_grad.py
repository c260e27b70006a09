"""The gradient engine (see docs/grad.md for the semantics).

A :class:`GradPlan` is built once from the optimizer's list of grad views (any
order, mixed dtypes, views into flat buffers) and reused every step: it finds
the address-adjacent regions so one pass covers many tensors. Results are
1-element backend scalars (fp32 norm/flag/coefficient, int64 zero count) in
the framework of the grads; nothing is read back to the host.
"""

import copy
import math
import numbers
import operator

import numpy as np

from . import _backend, _leanstep, _registry
from ._leanstep import Error
from ._rules import check_scalar
from ._arrays import Native, dtype_name, empty, is_torch, native, torch_module, view, zeros

__all__ = ["GradPlan", "multi_tensor_scale", "build_ddp_buffers", "ddp_grad_buffers", "model_params"]

INF = float("inf")


#: {(op, backend, device type, reason): counter} of the calls a plan runs where its
#: choice stands (the CPU kernels, the torch-op backend): each call counted by one
#: ``next``, without record's lock and key tuples (see _backend.tally).
_counters = {}


def _counter(op, backend, device_type, reason):
    key = (op, backend, device_type, reason)
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = _backend.tally(op, backend, device_type, reason)
    return counter


def _scalar(dtype, like, zeroed=True):
    """A 1-element array in like's framework; ``zeroed=False`` for an output the
    kernel writes whole (a norm): no zero fill, one framework op fewer a call."""
    if like is None:
        return np.zeros(1, dtype=dtype)
    return zeros((1,), dtype, like) if zeroed else empty((1,), dtype, like)


def _as_scalar_array(value, like, arg):
    """A Python number becomes a 1-element fp32 array in like's framework; an
    array is passed through (the library checks it is 1-element fp32)."""
    if isinstance(value, numbers.Real):
        out = _scalar("float32", like)
        out[0] = float(value)
        return out
    return view(value)


_requires_grad = operator.attrgetter("requires_grad")


def _detached(grads):
    """view() of each grad: the list itself copied where none requires grad
    (one C pass, not a Python call per grad); arrays without the attribute
    (NumPy) pass as they are."""
    grads = list(grads)
    try:
        if not any(map(_requires_grad, grads)):
            return grads
    except AttributeError:
        pass
    return [g.detach() if getattr(g, "requires_grad", False) else g for g in grads]


class _ArgNames:
    """The arguments' names, ``grads[i]``, ``buffers[j]``, then ``like``, made
    only when an error message reads one (a list of thousands of f-strings
    cost more than the plan's own C++ build)."""

    __slots__ = ("grads", "buffers", "like")

    def __init__(self, grads, buffers, like):
        self.grads, self.buffers, self.like = grads, buffers, like

    def __len__(self):
        return self.grads + self.buffers + self.like

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < self.grads:
            return f"grads[{i}]"
        if i < self.grads + self.buffers:
            return f"buffers[{i - self.grads}]"
        return "like"


class GradPlan:
    """``plan = GradPlan(grads)``; ``norm, found_inf = plan.norm()``;
    ``plan.clip_(max_norm, norm)``; ``plan.count_zeros()``.

    The plan keeps the grad arrays alive; it is valid as long as their memory
    is (reuse it every step: that is what it is for). Every operation checks,
    cheaply, that no grad was re-pointed or resized since the plan was built
    (``set_``, ``resize_``, a storage resized to 0): such a plan raises
    instead of reading memory it no longer describes. ``buffers`` optionally
    declares the flat buffers every grad must lie in (checked, CPU). Results
    are arrays of the grads' framework and device; ``like=`` (an array)
    chooses it when the list is empty (default: NumPy).

    ``backend``: ``None`` chooses from the grads' device (CPU tensors: the C++
    kernels; any other torch device: the torch-op backend, which never reads
    a device value on the host; on cuda, xpu and npu the Triton kernels when
    Triton runs there); ``"torch"`` forces the torch-op backend on CPU
    tensors (tests, benchmarks); ``"triton"`` forces the Triton kernels (CPU
    tensors: under TRITON_INTERPRET=1, tests)."""

    def __init__(self, grads, buffers=(), *, like=None, backend=None, _key=None,
                 _plain_cpu=False):
        torch = torch_module()
        if torch is not None and isinstance(grads, torch.Tensor):
            grads = [grads]
        # A plan over thousands of grads is built whenever their addresses change (fresh
        # grads each step, as the HF Trainer's zero_grad leaves them): its per-grad
        # Python work is what such a step pays, so each pass below runs in C (map).
        self._grads = _detached(grads)
        self._buffers = [view(b) for b in buffers]
        self._like = self._grads[0] if self._grads else like
        like_arg = [like] if not self._grads and is_torch(like) else []  # an empty list's device
        if (_plain_cpu and self._grads and not self._buffers and backend is None
                and _backend.torch_ops_only() is None):
            # `_plain_cpu`: the caller (leanstep._plans.PlanCache) checked that every grad
            # is a plain torch CPU tensor of a kernel dtype: what choose() concludes then,
            # without its pass over thousands of grads.
            self.backend, self._reason = "cpu", _backend.CPU_TENSORS
        else:
            self.backend, self._reason = _registry.choose(
                "grad", self._grads + self._buffers + like_arg,
                _ArgNames(len(self._grads), len(self._buffers), len(like_arg)), backend,
                "GradPlan")
        self._device = None
        self._tallies = {}  # {op: its call counter} (see _settle)
        if self.backend in ("torch", "triton"):
            device = self._grads[0].device if self._grads else (
                like.device if is_torch(like) else torch.device("cpu"))
            self._device = device
            plan_module = _registry.module("grad.norm", self.backend)
            plan_class = plan_module.TritonGradPlan if self.backend == "triton" \
                else plan_module.TorchGradPlan
            self._torch_plan = plan_class(self._grads, device)
            self._core = self._torch_plan.core
        elif isinstance(_key, bytes) and _plain_cpu and not self._buffers:
            # The key (read from C just now, exact) describes these grads: the plan is
            # built from it, without describing thousands of fresh grads a second time.
            self._core = Native(_leanstep.GradPlanCore.from_key(_key))
        else:
            self._core = Native(native.GradPlanCore(self._grads, self._buffers))
        # Where the plan's tensors live, as its calls are counted (read once: a device's
        # type is a torch call each time).
        self.device_type = "cpu" if self._device is None else self._device.type
        # Read once: what no later call changes. The CPU kernels' core is wrapped
        # (Native: a tensor argument the extension refuses goes again as a capsule); a
        # call that passes no tensor goes to the extension's own object, without the
        # wrapper's attribute lookup and closure per call (several microseconds each
        # in the cold state a step leaves behind: measured right after a fresh list
        # of 3168 views).
        core = self._core
        self._plain_core = core._target if isinstance(core, Native) else core
        self.first_self_overlapping = self._plain_core.first_self_overlapping
        # `_key`: the exact key (tensor_list_key's bytes) of `grads`, where the caller
        # (leanstep._plans.PlanCache) read it already: the same bytes fingerprint() reads.
        # (fingerprint() of an empty list is None, whatever its key.)
        known = _key is not None and self._grads
        self._fingerprint = ((_key if known else fingerprint(self._grads))
                             if is_torch(self._like) else None)

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

    def _unbound(self):
        """This plan without its grads (no memory kept alive): what a cache
        keeps between calls. The native plan holds raw pointers only; the
        device plans give up their region views (see TorchGradPlan.unbound)."""
        template = copy.copy(self)
        template._grads, template._buffers, template._like = None, [], None
        template._fingerprint = None
        if self.backend in ("torch", "triton"):
            template._torch_plan = self._torch_plan.unbound()
        return template

    def _bound(self, grads, like):
        """A template (:meth:`_unbound`) over ``grads``, whose addresses, dtypes,
        shapes and strides the caller has checked equal the list it was built
        from: the grads' memory is then alive (the caller holds it) and is the
        memory the native plan's pointers name. For one call: the result holds
        the grads and does not re-check them (nothing runs in between). None
        when a device plan's region lies in another storage now."""
        return self._bound_with(grads, grads[0] if grads else like, "bind", grads)

    def _bound_with(self, grads, like, bind, bind_arg):
        """The template bound: a device plan by its method ``bind`` of ``bind_arg``."""
        # A shallow copy without copy.copy's reduce protocol (about 7 us against 1 us,
        # measured right after a fresh list of 3168 views is made, as Megatron makes it).
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._grads = grads
        bound._like = like
        if self.backend in ("torch", "triton"):
            plan = getattr(self._torch_plan, bind)(bind_arg)
            if plan is None:
                return None
            bound._torch_plan = plan
        return bound

    def _recall_index(self, grads):
        """For a plan to be found again from its key alone (PlanCache.recall) over
        lists like ``grads`` (the list it was just found for): the list index of
        the one grad binding it takes, -1 for an empty list, None where it cannot
        be bound from one grad (a device plan of several regions, or whose region
        is not that grad's base). The CPU kernels read the memory through the
        native plan; they take the first grad to make outputs like it (where the
        CPU stands in for a device, leanstep.audit.DeviceMemory counts outputs
        made like a grad as that device's memory)."""
        if not grads:
            return -1
        if self.backend == "cpu":
            return 0
        index = self._torch_plan.base_index
        if index is None or not self._torch_plan.region_is_base(grads[index]):
            return None
        return index

    def _bound_base(self, grad, like):
        """A template (:meth:`_unbound`) bound for one call over a list whose key
        the caller matched with the plan's, of which it holds ``grad``, the one
        at its :meth:`_recall_index` (None for an empty list); ``like`` makes the
        outputs where there is no grad. None where a device plan's region is not
        that grad's base now."""
        return self._bound_with(() if grad is None else (grad,), like if grad is None else grad,
                                "bind_base", grad)

    def is_current(self):
        """Whether every grad still has the memory and size it had when the
        plan was built (one C-level pass over the list)."""
        if self._fingerprint is None:
            return True
        return fingerprint(self._grads) == self._fingerprint

    def _check_current(self, op):
        if self._fingerprint is not None and fingerprint(self._grads) != self._fingerprint:
            raise Error(f"GradPlan.{op}: a grad was re-pointed or resized since the plan was "
                        f"built (set_, resize_ or a resized storage); build a new GradPlan")

    def _check_in_place(self, op):
        """In-place ops refuse a self-overlapping grad (expand(), stride 0) on
        every backend alike: the planner found it once, when the plan was built."""
        self._check_current(op)
        index = self.first_self_overlapping
        if index >= 0:
            raise _self_overlap_error(self._grads[index], f"GradPlan.{op}", f"grads[{index}]")

    def _settle(self, op, norm_type=None):
        """(backend, device plan) of one call of grad.<op>, counted with its
        reason: the registry settles the plan's choice for the call (a plan
        built on Triton runs the torch-op plan inside it when the preset
        switches the op off or its kernels do not take the call). The device
        plan is None for the CPU kernels."""
        if self.backend in ("cpu", "torch"):  # the registry settles only a Triton choice
            # The op's counter, found once per plan (a template and the plans bound from
            # it share the dict): right after Megatron's own clip over 3168 fresh views,
            # the op name, the device's type and the key tuple cost about 20 us a call.
            tally = self._tallies.get(op)
            if tally is None:
                tally = self._tallies[op] = _counter(f"grad.{op}", self.backend, self.device_type,
                                                     self._reason)
            next(tally)
            return (self.backend, None) if self.backend == "cpu" else ("torch", self._torch_plan)
        name = f"grad.{op}"
        backend, why = _registry.settle(name, self.backend, self._reason,
                                        args={"plan": self._torch_plan, "norm_type": norm_type})
        plan = self._torch_plan
        if backend == "triton":
            why = f"{why}; {plan.detail()}"
        elif self.backend == "triton":
            plan = plan.torch_plan  # the device path's reference
        _registry.record(name, backend, self._device.type, why)
        return backend, plan

    def _new_scalar(self, dtype, zeroed=True):
        if self.backend != "cpu":
            return self._torch_plan.scalar(getattr(torch_module(), dtype))
        return _scalar(dtype, self._like, zeroed)

    # -- operations
    def norm(self, norm_type=2.0, inv_scale=None, *, out=None, found_inf=None):
        """Returns ``(norm, found_inf)``, 1-element fp32 arrays. norm_type is 2,
        ``inf`` or any p > 0. With ``inv_scale`` (a number or a 1-element fp32
        array) every grad is unscaled in place, ``x = cast(float(x) * inv_scale)``,
        in the same pass, and the norm is that of the unscaled grads. found_inf
        is 1 if any grad element (before unscaling) is non-finite. A
        ``found_inf=`` array is OR-ed into, not zeroed (accumulate over plans)."""
        if inv_scale is None:
            self._check_current("norm")
        else:
            self._check_in_place("norm")
        return self._norm(norm_type, inv_scale, out, found_inf)

    def total_norm(self, norm_type=2.0, *, out=None):
        """The norm alone, a 1-element fp32 array (``out`` if given): what
        :meth:`norm` returns first, for callers that drop its flag (Megatron's
        get_grad_norm_fp32, torch's clip_grad_norm_). The torch-op backend then
        makes no flag (four ops fewer: its zeroed scalar and the non-finite
        test); the CPU kernels and Triton find it in the same pass anyway."""
        self._check_current("norm")
        return self._norm(norm_type, None, out, None, want_found_inf=False)[0]

    def _norm(self, norm_type, inv_scale, out, found_inf, want_found_inf=True):
        norm_type = float(norm_type)
        if not (norm_type > 0):
            raise Error(f"GradPlan.norm: argument 'norm_type' must be > 0 or inf (got {norm_type})")
        # Each test only where its argument is given: the common call (Megatron's norm,
        # every step) passes none, and right after a step's fresh views each skipped
        # call is microseconds (see _settle).
        if inv_scale is not None and _is_number(inv_scale) and not math.isfinite(float(inv_scale)):
            raise Error(f"GradPlan.norm: argument 'inv_scale' must be finite (got {inv_scale})")
        if self.backend != "cpu":  # given outputs: the CPU kernels' rule
            if out is not None:
                check_scalar(out, "float32", "GradPlan.norm", "out")
            if found_inf is not None:
                check_scalar(found_inf, "float32", "GradPlan.norm", "found_inf")
        op = "unscale_norm" if inv_scale is not None else "norm"
        backend, plan = self._settle(op, norm_type)
        if backend == "triton":  # a new found_inf is assigned by the kernel: no zero fill
            return plan.norm(norm_type, None if out is None else view(out),
                             None if found_inf is None else view(found_inf),
                             None if inv_scale is None else _maybe_view(inv_scale))
        if found_inf is not None:
            found_inf = view(found_inf)
        elif want_found_inf:
            found_inf = self._new_scalar("float32")
        if backend == "torch":
            out = plan.norm(norm_type, None if out is None else view(out), found_inf,
                            None if inv_scale is None else _maybe_view(inv_scale))
            return out, found_inf
        out = self._new_scalar("float32", zeroed=False) if out is None else view(out)
        if inv_scale is None:
            self._core.norm(out, norm_type, found_inf)
        elif _is_number(inv_scale):
            self._core.unscale_norm(float(inv_scale), out, found_inf, norm_type)
        else:
            self._core.unscale_norm(view(inv_scale), out, found_inf, norm_type)
        return out, found_inf

    def unscale_(self, inv_scale, *, found_inf=None):
        """Every grad ``x = cast(float(x) * inv_scale)`` in place, and
        found_inf (OR-ed into, 1-element fp32) set if any value before
        unscaling is non-finite: one pass. Returns found_inf."""
        self._check_in_place("unscale_")
        found_inf = self._new_scalar("float32") if found_inf is None else view(found_inf)
        if self.backend in ("torch", "triton"):
            check_scalar(found_inf, "float32", "GradPlan.unscale_", "found_inf")
        _, plan = self._settle("unscale")
        if plan is not None:
            plan.unscale(_maybe_view(inv_scale), found_inf)
            return found_inf
        if _is_number(inv_scale):
            self._core.unscale(float(inv_scale), found_inf)
        else:
            self._core.unscale(view(inv_scale), found_inf)
        return found_inf

    def clip_(self, max_norm, norm, *, coeff_out=None):
        """Scales every grad in place by ``min(1, max_norm / (norm + 1e-6))``,
        the coefficient computed from the array ``norm`` without a host read
        (a NaN norm gives NaN grads, as the frameworks do). Returns the
        coefficient (1-element fp32)."""
        self._check_in_place("clip_")
        return self._clip(max_norm, norm, coeff_out)

    def _clip(self, max_norm, norm, coeff_out):
        _check_max_norm(max_norm, "clip")
        if self.backend in ("torch", "triton"):
            check_scalar(coeff_out, "float32", "GradPlan.clip_", "coeff_out")
        _, plan = self._settle("clip")
        if plan is not None:
            return plan.clip(
                _maybe_view(norm), float(max_norm), None if coeff_out is None else view(coeff_out))
        coeff = self._new_scalar("float32") if coeff_out is None else view(coeff_out)
        self._core.clip(_as_scalar_array(norm, self._like, "norm"), float(max_norm), coeff)
        return coeff

    def norm_clip_(self, max_norm, norm_type=2.0):
        """norm then clip in place, the usual step: returns ``(norm, found_inf, coeff)``."""
        self._check_in_place("norm_clip_")
        _check_max_norm(max_norm, "norm_clip")
        if self.backend in ("torch", "triton"):  # the grads checked once, above
            out, found_inf = self._norm(norm_type, None, None, None)
            return out, found_inf, self._clip(max_norm, out, None)
        out = self._new_scalar("float32")
        found_inf = self._new_scalar("float32")
        coeff = self._new_scalar("float32")
        self._settle("norm_clip")
        self._core.norm_clip(float(max_norm), out, float(norm_type), found_inf, coeff)
        return out, found_inf, coeff

    def scale_(self, scale):
        """Every grad ``*= scale`` in place (fp32 math, one rounding)."""
        self._check_in_place("scale_")
        _, plan = self._settle("scale")
        if plan is not None:
            plan.scale(_maybe_view(scale))
            return
        if _is_number(scale):
            self._plain_core.scale_by(float(scale))
            return
        self._core.scale(view(scale))

    def torch_rule_clip_(self, max_norm, total_norm):
        """torch's clip given its norm (``torch.nn.utils.clip_grads_with_norm_``):
        every grad ``*= clamp(max_norm / (norm + 1e-6), max=1)``, the coefficient
        computed as torch's ops compute it on a 1-element fp32 ``total_norm``
        (grad::torch_clip_coefficient), in one native call. The CPU kernels only,
        as :meth:`float_path_clip_`."""
        self._check_in_place("torch_rule_clip_")
        if self.backend != "cpu":
            raise Error(f"GradPlan.torch_rule_clip_: the CPU kernels' op (this plan is on the "
                        f"{self.backend!r} backend)")
        self._core.torch_rule_clip(view(total_norm), float(max_norm))
        self._settle("scale")

    def float_path_clip_(self, max_norm, total_norm):
        """Megatron's float-path clip with its norm in backend memory: every grad
        ``*= fp32(max_norm / (norm + 1e-6))`` where that double is below 1, nothing
        otherwise (a NaN norm too), ``total_norm`` a 1-element fp64 array
        (grad::float_path_clip_coefficient). The CPU kernels only: there the
        coefficient is read from memory by the calling thread, which plays the
        device (a device plan computes it with its own ops)."""
        self._check_in_place("float_path_clip_")
        if self.backend != "cpu":
            raise Error(f"GradPlan.float_path_clip_: the CPU kernels' op (this plan is on the "
                        f"{self.backend!r} backend)")
        if self._core.float_path_clip(view(total_norm), float(max_norm)):
            self._settle("scale")  # counted where a scale ran: a coefficient of 1 scales nothing

    def count_zeros(self, *, out=None):
        """Sum over the grads of (numel - count_nonzero), a 1-element int64 array."""
        self._check_current("count_zeros")
        if self.backend in ("torch", "triton"):
            check_scalar(out, "int64", "GradPlan.count_zeros", "out")
        _, plan = self._settle("count_zeros")
        if plan is not None:
            return plan.count_zeros(None if out is None else view(out))
        out = self._new_scalar("int64") if out is None else view(out)
        self._core.count_zeros(out)
        return out


def _element_strides(t):
    """Strides in elements (NumPy gives bytes)."""
    return list(t.stride()) if is_torch(t) else [s // t.itemsize for s in t.strides]


def _self_overlap_error(t, where, arg):
    """The error of the in-place rule (``Tensor::may_self_overlap`` in C++)."""
    device = f" on {t.device}" if is_torch(t) else ""
    return Error(f"{where}: argument '{arg}' must not overlap itself, since this op writes it in "
                 f"place (got {dtype_name(t)}{list(t.shape)}{device} with strides "
                 f"{_element_strides(t)}: one element is reached by several indices, as after "
                 f"expand()); pass a view without self-overlap, e.g. clone() it")


def _check_writable(tensors, where, arg):
    for i, t in enumerate(tensors):
        if t.is_contiguous() if is_torch(t) else t.flags.c_contiguous:
            continue  # a dense view never overlaps itself (the common case: no C++ call)
        if _leanstep.may_self_overlap(list(t.shape), _element_strides(t)):
            raise _self_overlap_error(t, where, f"{arg}[{i}]")


def _is_number(x):
    """Whether `x` is a real number (not an array). A float, the common scale, is told
    by its type: the ABC isinstance costs microseconds in the cold state a step leaves
    (see GradPlan._settle)."""
    return type(x) is float or isinstance(x, numbers.Real)


def _maybe_view(x):
    return x if _is_number(x) else view(x)


def _check_max_norm(max_norm, where):
    """The C++ rule (grad::check_max_norm), for every backend: a real number,
    finite, >= 0."""
    if not isinstance(max_norm, numbers.Real) or isinstance(max_norm, bool):
        raise Error(f"{where}: argument 'max_norm' must be a real number (got "
                    f"{type(max_norm).__name__})")
    native.grad_check_max_norm(float(max_norm), where)


def fingerprint(grads):
    """Addresses, dtypes, devices, shapes and strides of the grads: what a
    re-pointed, resized or re-strided grad changes (a storage resized to 0
    moves its address to null; set_ and as_strided_ may keep the address and
    change the strides). Read in one C pass through DLPack's exchange table
    (the bytes of :func:`leanstep._leanstep.tensor_list_key`), in Python where
    a tensor has no table (meta). None for arrays that are not torch tensors."""
    torch = torch_module()
    if not grads or not isinstance(grads[0], torch.Tensor):
        return None
    keyed = _leanstep.tensor_list_key(grads)
    if keyed is not None:
        return keyed[1]
    return (tuple(map(torch.Tensor.data_ptr, grads)), tuple(map(torch.Tensor.size, grads)),
            tuple(map(torch.Tensor.stride, grads)), tuple(g.dtype for g in grads),
            tuple(g.device for g in grads))


def multi_tensor_scale(src_list, dst_list, scale, *, found_inf=None, backend=None):
    """``dst[i] = cast(float(src[i]) * scale)`` for every pair (dtypes may
    differ: fp32 -> fp16/bf16, fp16 -> fp32, ...; the product is rounded once,
    so 1e5 * 0.01 into fp16 does not overflow). In place when dst is src.
    Returns found_inf (1-element fp32): 1 if any SOURCE element is non-finite.
    A ``found_inf=`` array is OR-ed into, not zeroed. ``backend`` as for
    :class:`GradPlan`."""
    src = [view(s) for s in src_list]
    dst = [view(d) for d in dst_list]
    if len(src) != len(dst):
        raise Error(f"multi_tensor_scale: arguments 'src_list' and 'dst_list' must have the same "
                    f"length (got {len(src)} and {len(dst)})")
    _check_writable(dst, "multi_tensor_scale", "dst_list")
    like = src[0] if src else (dst[0] if dst else None)
    flag_arg = [view(found_inf)] if not src and found_inf is not None else []  # empty lists
    tensors = src + dst + flag_arg
    names = ([f"src_list[{i}]" for i in range(len(src))]
             + [f"dst_list[{i}]" for i in range(len(dst))] + ["found_inf"] * len(flag_arg))
    route = _registry.route("grad.multi_tensor_scale", tensors, names, backend,
                            "multi_tensor_scale", args={"src": src, "dst": dst})
    if route.module is not None:
        for i, (s, d) in enumerate(zip(src, dst)):
            if s.shape != d.shape:
                raise Error(f"multi_tensor_scale: argument 'dst_list[{i}]' must have the shape of "
                            f"src_list[{i}] (got {list(d.shape)} and {list(s.shape)})")
        torch = torch_module()
        device = like.device if like is not None else (
            found_inf.device if is_torch(found_inf) else torch.device("cpu"))
        found_inf = torch.zeros(1, dtype=torch.float32, device=device) if found_inf is None \
            else view(found_inf)
        if route.backend == "triton":  # every pair in one launch
            route.module.multi_tensor_scale(src, dst, _maybe_view(scale), found_inf, device,
                                            supported=True)
        else:
            route.module.multi_tensor_scale(src, dst, _maybe_view(scale), found_inf, device)
        return found_inf
    found_inf = _scalar("float32", like) if found_inf is None else view(found_inf)
    if isinstance(scale, numbers.Real):
        # Not through `native`: the array overload, tried first, would use up the
        # lists' capsules before it refuses the float.
        _leanstep.grad_multi_tensor_scale(src, dst, float(scale), found_inf)
    else:
        native.grad_multi_tensor_scale(src, dst, view(scale), found_inf)
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


def ddp_grad_buffers(params, framework="torch", *, device="cpu", **layout_options):
    """Allocates zeroed flat gradient buffers laid out as Megatron-Core's DDP
    does (see :func:`build_ddp_buffers`) and returns ``(buffers, grads,
    layouts)``: the flat buffers, every param's grad view (in registration
    order over all buffers, as an optimizer lists them) and the layouts.
    ``device`` places torch buffers (``"meta"`` for shape-only tests)."""
    layouts = build_ddp_buffers(params, **layout_options)
    buffers, indexed = [], []
    for layout in layouts:
        dtype = layout["grad_dtype"]
        if framework == "torch":
            import torch  # optional: asked for by name

            buf = torch.zeros(layout["numel"], dtype=getattr(torch, dtype), device=device)
        else:
            buf = np.zeros(layout["numel"], dtype=dtype)
        buffers.append(buf)
        for slot in layout["params"]:
            view_ = buf[slot["offset"]:slot["offset"] + slot["numel"]].reshape(slot["shape"])
            indexed.append((slot["param_index"], view_))
    indexed.sort(key=lambda item: item[0])
    return buffers, [v for _, v in indexed], layouts
