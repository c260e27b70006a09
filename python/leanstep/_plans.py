"""Grad plans found again each call: the cache behind every patched or
drop-in gradient function (Megatron's clip_grads, leanstep.torch's
clip_grad_norm_). A plan is keyed by what decides the memory it covers, read
in one C pass over the list; it never holds grad memory between calls."""

import operator
import threading

import torch

from . import _backend, _leanstep
from ._leanstep import grads_and_key, grads_match_key, key_facts, tensor_list_key
from .backends.torch_grad import PLAN_DTYPES

if "grad" in _leanstep.areas:  # a build without the grad area plans nothing
    from ._grad import GradPlan, fingerprint

__all__ = ["PlanCache", "as_list", "grads_with_key", "EMPTY_LIKE"]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPE_SET = frozenset(_PLAIN_TYPES)
_PLAN_DTYPE_SET = frozenset(PLAN_DTYPES)
_dtype = operator.attrgetter("dtype")
_is_cpu = operator.attrgetter("is_cpu")
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16, "float64": torch.float64}  # key_facts' names
_device = operator.attrgetter("device")
_grad_of = operator.attrgetter("grad")
EMPTY_LIKE = torch.empty(0)  # results of an empty grad list are torch tensors too
_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def as_list(tensors):
    """The caller's list itself (the gradient functions read it and keep
    nothing of it past the call: no copy of thousands of entries per call), a
    single tensor as a list, any other iterable copied (a generator is read
    once, here)."""
    if type(tensors) is list:
        return tensors
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def grads_with_key(params, attr="grad"):
    """(the params' non-None ``attr`` grads in order, their plan-cache key or
    None): one C pass over the list where every grad has DLPack's exchange
    table, else Python (the cache then keys the list itself)."""
    keyed = grads_and_key(params, attr)
    if keyed is not None:
        grads, hash_, key = keyed
        return grads, (hash_, key)
    if attr == "grad":
        return [g for g in map(_grad_of, params) if g is not None], None
    return [g for g in (getattr(p, attr, None) for p in params) if g is not None], None


class PlanCache:
    """GradPlans for the grad lists a training loop passes each step
    (Megatron's clip_grads, the HF Trainer's clip through accelerate).

    A plan is found by what decides the memory it covers: every grad's
    address, shape, strides and dtype, and the device. The cache keeps plans
    without their grads (:meth:`GradPlan._unbound`): it holds no grad memory
    past the call that used it, however many lists it has seen (fresh main
    grads each step, as fp16 without ``grad_reduce_in_fp32`` makes them, cost
    one small template each, the oldest dropped past ``size``). A hit binds the
    template to the caller's own tensors, the ones whose metadata matched:
    never to tensors an earlier call passed, which may since have been
    re-pointed."""

    def __init__(self, size=8):
        #: The backend plans are built for: None chooses from the grads' device;
        #: "torch" / "triton" force one (tests and benchmarks only).
        self.backend = None
        self._size = size
        self._by_key = {}
        self._order = []
        self._lock = threading.Lock()
        #: {site: (exact key, backend, template, index)}: the plan a call site used
        #: last and the list index of the grad that binds it (see :meth:`recall`).
        self._last = {}

    @staticmethod
    def key(grads):
        """(dict key, exact key) of a grad list: everything that decides which
        memory each view covers (two views with one address and numel may
        still differ in strides, buf[0:8] and buf[0:16:2], or shape). Read from
        C through DLPack's exchange table (tens of nanoseconds a view: a 64-bit
        hash and the bytes it hashes); in Python where a tensor has no table
        (meta)."""
        native = tensor_list_key(grads)
        if native is not None:
            return native
        key = fingerprint(grads)  # the same facts, read in Python
        return key, key

    def get(self, grads, in_place=False, key=None):
        """(plan, None), or (None, reason) when leanstep cannot take these grads.
        ``in_place``: the caller writes the grads, so a self-overlapping one
        (expand(), stride 0) goes to Megatron's own code, which decides.
        ``key``: :meth:`key` of ``grads``, where the caller has it."""
        plan, reason = self._get(grads, key or self.key(grads))
        if in_place and plan is not None and plan.first_self_overlapping >= 0:
            return None, "self_overlapping_grad"
        return plan, reason

    def _get(self, grads, key):
        dict_key, exact = (key[0], self.backend), key[1]
        with self._lock:
            entry = self._by_key.get(dict_key)
        if entry is not None and entry[0] == exact:  # the bytes compared: never a stale plan
            _, template, reason = entry
            if template is None:
                return None, reason
            plan = template._bound(grads, EMPTY_LIKE)
            if plan is not None:
                return plan, None
        plan, reason = self._build(grads, exact)
        with self._lock:
            if dict_key not in self._by_key:
                self._order.append(dict_key)
            self._by_key[dict_key] = (exact, None if plan is None else plan._unbound(), reason)
            while len(self._order) > self._size:
                self._by_key.pop(self._order.pop(0), None)
        if plan is not None:
            # For this call, as a bound template: the grads were read just now, so the
            # plan's operations need not read them again (a key pass each, otherwise).
            plan._fingerprint = None
        return plan, reason

    def remember(self, site, key, grads):
        """Keeps the plan cached under ``key`` (a key read from C) for ``grads``
        as the one ``site`` (a call site: one patched function and grad
        attribute) used last, for :meth:`recall`; where it cannot be recalled
        (see GradPlan._recall_index), the site keeps none, so that its next
        call makes no pass in vain."""
        with self._lock:
            entry = None if key is None or type(key[1]) is not bytes else \
                self._by_key.get((key[0], self.backend))
            template = entry[1] if entry is not None and entry[0] == key[1] else None
            index = None if template is None else template._recall_index(grads)
            if index is None:
                self._last.pop(site, None)
            else:
                self._last[site] = (key[1], self.backend, template, index)

    def recall(self, site, params, attr="grad", ids=None, counted=None):
        """The plan ``site`` used last, bound for this call, where the ``attr``
        grads of ``params`` (a list or tuple; ``attr`` None: the grads
        themselves) have exactly its key, else None. One C pass that makes no
        list and no key and stops at the first difference: a training loop that
        passes a fresh
        list of fresh views of the same memory each step finds its plan for the
        cost of reading the grads alone. The key compared is the plan cache's
        own (every grad's address, shape, strides, dtype and device), so a
        template found here names exactly the memory the grads cover now, which
        the caller holds for the call: its native plan's pointers are those
        grads'. A device plan is recalled where it views one region through
        one grad's base (Megatron's grad buffer): the pass returns that grad.
        ``ids`` and ``counted``: a cached selection of the params (see
        grads_match_key), whose counted params' grads are compared."""
        last = self._last.get(site)
        if last is None or last[1] != self.backend or _torch_function_mode_enabled():
            return None  # under a torch function mode a grad's read runs Python
        exact, _, template, index = last
        found = grads_match_key(params, attr, exact, index, ids, counted)
        if found is None:
            return None
        # Bound for this call without the list (none was made).
        plan = template._bound_base(None if index < 0 else found, EMPTY_LIKE)
        if plan is None:  # the region is no longer that grad's base: not again
            with self._lock:
                if self._last.get(site) is last:
                    del self._last[site]
        return plan

    def __len__(self):
        with self._lock:
            return len(self._by_key)

    def _build(self, grads, exact=None):
        """``exact``: the key's exact part, where the caller read it (the plan's
        fingerprint). Fresh grads each step (the HF Trainer's zero_grad) build a
        plan every call: its checks read the key (key_facts), or make one pass in C
        (map) each where there is none, never Python per grad."""
        if type(exact) is bytes:
            # A key read from C (every grad a plain torch tensor: the only ones it reads)
            # says where they live and their dtypes: no pass over the grads here.
            on_cpu, names = key_facts(exact)
            if "other" in names:
                return None, "dtype"
            dtypes = frozenset(map(_TORCH_DTYPES.__getitem__, names))
        else:
            if not set(map(type, grads)) <= _PLAIN_TYPE_SET:
                return None, "tensor_subclass"
            dtypes = frozenset(map(_dtype, grads))
            on_cpu = all(map(_is_cpu, grads))
        # The grads' dtypes, also for the callers' own dtype rules: the cache key includes
        # every grad's dtype, so a plan found for a list has that list's dtypes.
        if not dtypes <= _PLAN_DTYPE_SET:
            return None, "dtype"
        if grads and not on_cpu and len(set(map(_device, grads))) > 1:
            return None, "mixed_devices"
        if grads and _backend.device_usable(grads[0].device) is not None:
            return None, "device_unusable"
        plan = GradPlan(grads, like=EMPTY_LIKE, backend=self.backend, _key=exact,
                        _plain_cpu=on_cpu and dtypes <= _backend.cpu_dtypes())
        plan.dtypes = dtypes
        return plan, None

    def clear(self):
        with self._lock:
            self._by_key.clear()
            self._order.clear()
            self._last.clear()
