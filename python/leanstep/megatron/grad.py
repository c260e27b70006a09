"""Gradient patches: ``optimizer.clip_grads`` (norm, clip, zero count) and
the mixed-precision optimizer's unscale + found_inf check.

Grads on the CPU run the C++ kernels; grads on any other device run the
torch-op backend (sync-free). Each call finds its plan in a cache: the same
list objects hit at once (an identity check in C), other lists by their
addresses, sizes and dtypes. The device, dtype and subclass checks run once
per plan, not once per grad per call.
"""

import atexit
import functools
import math
import struct
import sys
import threading
import weakref

import torch

from .. import _arrays, _dispatch, _leanstep
from .._leanstep import grads_and_key, selected_grads_and_key
from .._plans import PlanCache, as_list, grads_with_key
from . import _patching
from ._patching import EMPTY, Spec, Variant

CLIP_GRADS = "megatron.core.optimizer.clip_grads"
UNSCALE = "unscale_and_check_for_nan"
OPTIMIZER = "megatron.core.optimizer.optimizer"
ALIAS_MODULES = (OPTIMIZER, "megatron.core.optimizer.layer_wise_optimizer",
                 "megatron.core.models.mimo.optimizer")

_CPU = torch.device("cpu")
_GRAD_DTYPES = frozenset((torch.float32,))  # what clip_grad_by_total_norm_fp32 takes
_DECOUPLED_DTYPES = frozenset((torch.float32, torch.bfloat16))


plans = PlanCache()
# The cached plans hold native objects: freed before the interpreter tears the
# extension module down (nanobind reports instances that outlive it as leaks).
atexit.register(plans.clear)


def dist_ready():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def all_reduce(tensor, op, group):
    """``torch.distributed.all_reduce`` of `tensor` over `group` (None: the
    default group), as the patched functions' originals do it; skipped where
    the group holds this rank alone (a reduction over one rank is the identity:
    the same value without a collective, a device launch or, on gloo, a
    round trip through its transport, which costs more than the kernels of a
    grad call at the sizes of a real step)."""
    if dist_ready() and torch.distributed.get_world_size(group) != 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)


def _sites(spec):
    """{grad attribute: the plan cache's call site of patch `spec`} (PlanCache.recall)."""
    return {attr: f"{spec.name}:{attr}" for attr in ("grad", "decoupled_grad")}


# ---------------------------------------------------------------- get_grad_norm_fp32


def _make_get_grad_norm_fp32(original, spec):
    home = sys.modules[original.__module__]
    site = spec.name  # the plan cache's call site (recall)

    @functools.wraps(original)
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        grads = as_list(grads_for_norm)
        # The plan this call used last, where the grads are exactly its grads' memory
        # (Megatron's fresh list of fresh views, each step; see the clip below).
        plan = plans.recall(site, grads, None)
        if plan is None:
            key = plans.key(grads)
            plan, reason = plans.get(grads, key=key)
            if reason is not None:
                _patching.count(spec.name, reason=reason)
                # `grads`, not the argument: a generator was consumed making the list.
                return original(grads, norm_type, grad_stats_parallel_group)
            plans.remember(site, key, grads)
        _patching.count(spec.name, plan.device_type, plan.backend)
        p = float(norm_type)
        norm = plan.total_norm(p)
        if p == math.inf:
            all_reduce(norm, torch.distributed.ReduceOp.MAX, grad_stats_parallel_group)
            # Both versions return the inf-norm as a float (of the fp32 max): the
            # same value, kept on the device.
            return norm[0].to(torch.float64)
        # As the original: the p-th power (fp32) is what ranks SUM-reduce.
        # (For p = 2 torch's pow is x * x, the same fp32 rounding as this one multiply,
        # which costs a third of it on the CPU.)
        total = norm if p == 1.0 else norm * norm if p == 2.0 else norm ** p
        all_reduce(total, torch.distributed.ReduceOp.SUM, grad_stats_parallel_group)
        # Newer versions keep the norm on the device when Transformer Engine's
        # multi_tensor_scale_tensor is importable (fp32, as they compute it).
        if getattr(home, "multi_tensor_scale_tensor_impl", None) is not None:
            return total.pow(1.0 / p)
        # Otherwise the installed code returns total.item() ** (1 / p), a Python
        # float: the same double, computed on the device (see host_float_pow); on the
        # CPU kernels by one native call (torch's three ops cost 20-70 us there).
        if plan.backend == "cpu":
            # Made like `total` (_arrays.empty): where the CPU stands in for a device,
            # leanstep.audit.DeviceMemory counts this output, written outside torch's
            # dispatcher, as the device memory it would be there.
            out = _arrays.empty((), "float64", total)
            _leanstep.grad_float_path_norm(total, 1.0 / p, out)
            return out
        return host_float_pow(total, 1.0 / p)

    return get_grad_norm_fp32


def host_float_pow(value, exponent):
    """``float(value) ** exponent`` of a 1-element tensor, as a 0-d float64
    tensor on value's device, without a host read: the double Megatron's
    float path computes. The exponent goes in as a tensor so that the C
    library's ``pow`` runs, as in Python, on the CPU (a scalar 0.5 would
    become ``sqrt``); that tensor is made once per exponent and device (a
    fresh one costs a host-to-device copy, and several microseconds on the
    CPU, each step)."""
    base = value.reshape(())
    if exponent == 1.0:
        return base.to(torch.float64)
    # The fp32 base is promoted to double inside pow (exactly), as float() does: one
    # op fewer than casting it first (two cold ops, not three, right after a step).
    return torch.pow(base, _exponent_tensor(exponent, base.device))


@functools.lru_cache(maxsize=16)
def _exponent_tensor(exponent, device):
    return torch.tensor(exponent, dtype=torch.float64, device=device)


def host_float_clip_scale(max_norm, total_norm):
    """The factor the installed float path scales the grads by, on the device:
    ``max_norm / (total_norm + 1e-6)`` in double, applied (as fp32) only when
    it is below 1 (a NaN is not: 1.0, a multiply by one changes no grad). The
    quotient is a true division: ``max_norm / tensor`` would be torch's
    reciprocal then a multiply, two roundings, which differ from Python's one
    in a quarter of doubles and, near an fp32 rounding boundary, in the fp32
    factor itself. ``torch.div`` takes the Python float as the numerator by value
    (a double here: no device scalar made or kept per max_norm)."""
    denominator = total_norm + 1.0e-6
    coeff = torch.div(max_norm, denominator)
    return torch.where(coeff < 1.0, coeff, 1.0).to(torch.float32).reshape(1)


# ---------------------------------------------------------------- clip_grad_by_total_norm_fp32


def _make_clip_grad_by_total_norm_fp32(original, spec):
    sites = _sites(spec)

    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(parameters, max_norm, total_norm, use_decoupled_grad)
        params = as_list(parameters)
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        # The plan this call used last, where the grads are exactly its grads' memory
        # (Megatron's fresh views of its buffer each step): found for the cost of
        # reading them; its checks below held when it was remembered. A norm on
        # another device takes the general path, which decides.
        plan = plans.recall(sites[attr], params, attr)
        if plan is not None and isinstance(total_norm, torch.Tensor) and \
                total_norm.device != (plan._device or _CPU):
            plan = None
        if plan is None:
            grads, key = grads_with_key(params, attr)
            allowed = _DECOUPLED_DTYPES if use_decoupled_grad else _GRAD_DTYPES
            plan, reason = plans.get(grads, in_place=True, key=key)
            if reason is None and grads and not plan.dtypes <= allowed:
                reason = "dtype"  # the original asserts on these
            if reason is None and isinstance(total_norm, torch.Tensor) and grads and \
                    total_norm.device != grads[0].device:
                reason = "norm_on_another_device"
            if reason is not None:
                _patching.count(spec.name, reason=reason)
                return original(params, max_norm, total_norm, use_decoupled_grad)
            if not grads:
                _patching.count(spec.name, plan.device_type, plan.backend)
                return None
            plans.remember(sites[attr], key, grads)
        _patching.count(spec.name, plan.device_type, plan.backend)
        if isinstance(total_norm, torch.Tensor) and total_norm.dtype == torch.float64:
            # leanstep's norm in place of the installed version's float (a double):
            # the float path's arithmetic, on the device (on the CPU kernels in the
            # native call that scales, for a max_norm the library takes).
            max_norm = float(max_norm)
            if plan.backend == "cpu" and total_norm.numel() == 1 and 0.0 <= max_norm < math.inf:
                plan.float_path_clip_(max_norm, total_norm.detach())
            else:
                plan.scale_(host_float_clip_scale(max_norm, total_norm.detach()))
            return None
        if isinstance(total_norm, torch.Tensor):
            # A norm that stayed on the device: coefficient from it, no host read.
            norm = total_norm.detach() if total_norm.requires_grad else total_norm
            if norm.shape != (1,):
                norm = norm.reshape(1)
            if norm.dtype != torch.float32:
                norm = norm.to(torch.float32)
            plan.clip_(float(max_norm), norm)
            return None
        # As the installed code: coefficient in double on the host, applied
        # only when < 1, as an fp32 multiply.
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            plan.scale_(float(clip_coeff))
        return None

    return clip_grad_by_total_norm_fp32


# ---------------------------------------------------------------- count_zeros_fp32


#: The attribute on a param that caches whether count_zeros_fp32 counts it: a
#: per-context sentinel (see _ZeroCountContext), so the installed version's
#: filters run once per param, not once per param per step.
ZERO_COUNT_FLAG = "_leanstep_zero_count"


class _ZeroCountContext:
    """The filter context of count_zeros_fp32: its process groups. Its two
    sentinels mark a param as counted or skipped under these groups; a param
    marked under other groups is evaluated again. The groups are held (their
    ids cannot be reused while a mark may name them). ``selections``: the
    marks of the lists of params seen under these groups (:class:`_Selection`),
    found by the list's length and its ends."""

    __slots__ = ("groups", "counted", "skipped", "selections")

    def __init__(self, groups):
        self.groups = groups
        self.counted, self.skipped = object(), object()
        self.selections = {}


#: Lists of params remembered per filter context (a chained optimizer passes one
#: per sub-optimizer); the oldest is dropped past this.
_SELECTIONS_PER_CONTEXT = 4


class _Selection:
    """The marks of one list of params, by position: which params count, read
    once, so that the next call with the same list reads no attribute of any
    param (the C pass checks each position's identity as it reads the grads).
    Each param is held weakly; when one dies the selection is dropped, so an
    address in ``ids`` always names the object that was marked. A param's marks
    are what its attributes said when it was first seen, as with the marks
    themselves."""

    __slots__ = ("ids", "counted", "alive", "_refs")

    def __init__(self, params, context):
        alive = [True]

        def dropped(_ref, alive=alive):
            alive[0] = False

        self._refs = [weakref.ref(p, dropped) for p in params]  # TypeError: not weakly referable
        self.alive = alive
        self.ids = struct.pack(f"{len(params)}P", *map(id, params))
        self.counted = bytes(vars(p).get(ZERO_COUNT_FLAG) is context.counted for p in params)

    @staticmethod
    def key(params):
        return (len(params), id(params[0]), id(params[-1])) if params else (0,)


def _remember_selection(context, params):
    """Keeps a selection of `params` (all marked under `context`) for the next
    call; none where a param cannot be held weakly (the marks serve each call)."""
    try:
        selection = _Selection(params, context)
    except TypeError:
        return
    with _zero_count_lock:
        selections = context.selections
        selections.pop(_Selection.key(params), None)
        selections[_Selection.key(params)] = selection
        while len(selections) > _SELECTIONS_PER_CONTEXT:
            selections.pop(next(iter(selections)))


_zero_count_contexts = {}
_zero_count_lock = threading.Lock()


def _zero_count_context(tp_group, expert_tp_group, with_expert_tp):
    key = (id(tp_group), id(expert_tp_group), with_expert_tp)
    context = _zero_count_contexts.get(key)
    if context is None or context.groups != (tp_group, expert_tp_group, with_expert_tp):
        with _zero_count_lock:
            context = _zero_count_contexts[key] = _ZeroCountContext(
                (tp_group, expert_tp_group, with_expert_tp))
    return context


def _make_count_zeros_fp32(original, spec, with_expert_tp=False):
    home = sys.modules[original.__module__]
    gtp_filter = getattr(home, "param_is_not_gtp_duplicate", None) if with_expert_tp else None

    def counted(param, tp_group, expert_tp_group):
        """The installed version's own filters (shared params, TP duplicates):
        they read attributes Megatron sets when it builds the model, and the
        groups' ranks."""
        if not home.param_is_not_shared(param):
            return False
        if with_expert_tp:
            if not home.param_is_not_tensor_parallel_duplicate(
                    param, tp_group=tp_group, expert_tp_group=expert_tp_group):
                return False
            return gtp_filter is None or bool(gtp_filter(param))
        return bool(home.param_is_not_tensor_parallel_duplicate(param, tp_group=tp_group))

    def mark(params, context, tp_group, expert_tp_group):
        """Evaluates the filters once per param and marks each; a reason when
        leanstep cannot take these params (Megatron-FSDP params are never marked)."""
        if any(getattr(p, "__fsdp_param__", False) for p in params):
            return "megatron_fsdp"
        for param in params:
            if vars(param).get(ZERO_COUNT_FLAG) not in (context.counted, context.skipped):
                vars(param)[ZERO_COUNT_FLAG] = context.counted if counted(
                    param, tp_group, expert_tp_group) else context.skipped
        return None

    def select(params, attr, tp_group, expert_tp_group):
        """(grads to count, their key or None, reason)."""
        context = _zero_count_context(tp_group, expert_tp_group, with_expert_tp)
        selection = context.selections.get(_Selection.key(params))
        if selection is not None and selection.alive[0]:
            keyed = selected_grads_and_key(params, attr, selection.ids, selection.counted)
            # A param that died during the pass (a getter's own code) voids the answer.
            if keyed is not False and selection.alive[0]:
                return selected(params, attr, context, keyed)
        keyed = grads_and_key(params, attr, ZERO_COUNT_FLAG, context.counted, context.skipped)
        if keyed is False:  # some param not marked under this context yet
            reason = mark(params, context, tp_group, expert_tp_group)
            if reason is not None:
                return None, None, reason
            keyed = grads_and_key(params, attr, ZERO_COUNT_FLAG, context.counted,
                                  context.skipped)
        _remember_selection(context, params)
        return selected(params, attr, context, keyed)

    def selected(params, attr, context, keyed):
        if keyed is not None:
            grads, hash_, key = keyed
            return grads, (hash_, key), None
        # Some grad without DLPack's exchange table (meta): the marks, in Python.
        grads = [g for g in (getattr(p, attr, None) for p in params
                             if vars(p).get(ZERO_COUNT_FLAG) is context.counted)
                 if g is not None]
        return grads, None, None

    sites = _sites(spec)

    def recall(params, attr, tp_group, expert_tp_group):
        """The plan this call used last, where `params` is a list whose selection
        is remembered and its counted params' grads are exactly that plan's
        memory (see the clip); None otherwise."""
        context = _zero_count_context(tp_group, expert_tp_group, with_expert_tp)
        selection = context.selections.get(_Selection.key(params))
        if selection is None or not selection.alive[0]:
            return None
        plan = plans.recall(sites[attr], params, attr, selection.ids, selection.counted)
        # A param that died during the pass (a getter's own code) voids the answer.
        return plan if selection.alive[0] else None

    def run(params, group, attr, tp_group, expert_tp_group, call_original):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return call_original()
        plan = recall(params, attr, tp_group, expert_tp_group)
        if plan is None:
            selected, key, reason = select(params, attr, tp_group, expert_tp_group)
            if reason is None:
                plan, reason = plans.get(selected, key=key)
            if reason is not None:
                _patching.count(spec.name, reason=reason)
                return call_original()
            plans.remember(sites[attr], key, selected)
        _patching.count(spec.name, plan.device_type, plan.backend)
        count = plan.count_zeros()
        # The count stays on the device, a 0-d tensor (the installed version returns a
        # Python number): read it when it is logged.
        if with_expert_tp:
            # Newer versions accumulate in int64 and return a Python int.
            all_reduce(count, torch.distributed.ReduceOp.SUM, group)
            return count[0]
        # 0.16 accumulates into an fp32 tensor, SUM-reduces it, returns a float.
        total = count.to(torch.float32)
        all_reduce(total, torch.distributed.ReduceOp.SUM, group)
        return total[0]

    if with_expert_tp:
        @functools.wraps(original)
        def count_zeros_fp32(parameters, grad_stats_parallel_group, use_decoupled_grad=False,
                             tp_group=None, expert_tp_group=None):
            params = as_list(parameters)
            attr = "decoupled_grad" if use_decoupled_grad else "grad"
            return run(params, grad_stats_parallel_group, attr, tp_group, expert_tp_group,
                       lambda: original(params, grad_stats_parallel_group, use_decoupled_grad,
                                        tp_group, expert_tp_group))
    else:
        @functools.wraps(original)
        def count_zeros_fp32(parameters, grad_stats_parallel_group, use_decoupled_grad=False,
                             tp_group=None):
            params = as_list(parameters)
            attr = "decoupled_grad" if use_decoupled_grad else "grad"
            return run(params, grad_stats_parallel_group, attr, tp_group, None,
                       lambda: original(params, grad_stats_parallel_group, use_decoupled_grad,
                                        tp_group))
    return count_zeros_fp32


# ---------------------------------------------------------------- unscale + found_inf


def _unscale_plan(optimizer):
    """(main grads, inv_scale, plan, reason) of one unscale: the plan leanstep
    runs it with, or None and the reason it cannot take these grads."""
    stub = getattr(optimizer, "is_stub_optimizer", False)
    main_grads = [] if stub else optimizer._collect_main_grad_data_for_unscaling()
    inv_scale = optimizer.grad_scaler.inv_scale
    plan, reason = plans.get(main_grads, in_place=True)
    if reason is None and main_grads and (
            not isinstance(inv_scale, torch.Tensor) or inv_scale.device != main_grads[0].device
            or inv_scale.dtype != torch.float32 or inv_scale.numel() != 1):
        plan, reason = None, "inv_scale"
    return main_grads, inv_scale, plan, reason


def unscale_and_check_on_device(optimizer, spec_name=UNSCALE, prepared=None):
    """The mixed-precision optimizer's unscale and non-finite check, leaving
    the result in ``optimizer.found_inf`` (all-reduced, on the device) without
    reading it: leanstep's one pass when it can take the grads and the preset
    enables ``grad.unscale``, else the installed version's own ops
    (``torch._amp_foreach_non_finite_check_and_unscale_``, as Megatron calls
    them). Counts the call under ``spec_name``. ``prepared``: what
    :func:`_unscale_plan` found, if the caller has it. Returns ``optimizer.found_inf``."""
    if _dispatch.op_enabled("grad.unscale"):
        main_grads, inv_scale, plan, reason = prepared or _unscale_plan(optimizer)
    else:
        stub = getattr(optimizer, "is_stub_optimizer", False)
        main_grads = [] if stub else optimizer._collect_main_grad_data_for_unscaling()
        inv_scale, plan, reason = optimizer.grad_scaler.inv_scale, None, "switched_off"
    optimizer.found_inf.fill_(0.0)
    if reason is not None:
        _patching.count(spec_name, reason=reason)
        if main_grads:
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, optimizer.found_inf,
                                                             inv_scale)
    else:
        _patching.count(spec_name, plan.device_type, plan.backend)
        if main_grads:
            # Unscale and non-finite check in one pass over the coalesced
            # regions, OR-ed into the optimizer's own found_inf.
            plan.unscale_(inv_scale.reshape(1), found_inf=optimizer.found_inf)
    group = optimizer.get_grad_stats_parallel_group()
    if not dist_ready():  # the original's call, and its error without a process group
        torch.distributed.all_reduce(optimizer.found_inf, op=torch.distributed.ReduceOp.MAX,
                                     group=group)
    all_reduce(optimizer.found_inf, torch.distributed.ReduceOp.MAX, group)
    return optimizer.found_inf


def _make_unscale_and_check(original, spec):
    @functools.wraps(original)
    def _unscale_main_grads_and_check_for_nan(self):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(self)
        prepared = _unscale_plan(self)
        if prepared[3] is not None:
            _patching.count(spec.name, reason=prepared[3])
            return original(self)
        found_inf = unscale_and_check_on_device(self, spec.name, prepared)
        # The installed API: the optimizer's step branches on a Python bool. The
        # sync-free step (leanstep.megatron.step) calls unscale_and_check_on_device.
        return found_inf.item() > 0

    return _unscale_main_grads_and_check_for_nan


SPECS = [
    Spec("get_grad_norm_fp32", "grad.norm", CLIP_GRADS, "get_grad_norm_fp32",
         [Variant("0.16-0.19", [("grads_for_norm", EMPTY), ("norm_type", 2),
                                ("grad_stats_parallel_group", None)],
                  _make_get_grad_norm_fp32)],
         ALIAS_MODULES, requires_area="grad"),
    Spec("clip_grad_by_total_norm_fp32", "grad.clip", CLIP_GRADS, "clip_grad_by_total_norm_fp32",
         [Variant("0.16-0.19", [("parameters", EMPTY), ("max_norm", EMPTY),
                                ("total_norm", EMPTY), ("use_decoupled_grad", False)],
                  _make_clip_grad_by_total_norm_fp32)],
         ALIAS_MODULES, requires_area="grad"),
    Spec("count_zeros_fp32", "grad.count_zeros", CLIP_GRADS, "count_zeros_fp32",
         [Variant("0.16", [("parameters", EMPTY), ("grad_stats_parallel_group", EMPTY),
                           ("use_decoupled_grad", False), ("tp_group", None)],
                  _make_count_zeros_fp32),
          Variant("0.19", [("parameters", EMPTY), ("grad_stats_parallel_group", EMPTY),
                           ("use_decoupled_grad", False), ("tp_group", None),
                           ("expert_tp_group", None)],
                  functools.partial(_make_count_zeros_fp32, with_expert_tp=True))],
         ALIAS_MODULES, requires_area="grad"),
    Spec(UNSCALE, "grad.unscale", OPTIMIZER, "_unscale_main_grads_and_check_for_nan",
         [Variant("0.16-0.19", [("self", EMPTY)], _make_unscale_and_check)],
         class_attr="MixedPrecisionOptimizer", requires_area="grad",
         host_read="found_inf as a Python bool, when Megatron's own step calls it (the step "
                   "patch delegated or switched off); leanstep's step keeps it on the device"),
]
