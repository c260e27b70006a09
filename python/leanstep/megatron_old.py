"""Install leanstep's fast paths into the Megatron-Core you already run.

    import leanstep.megatron
    leanstep.megatron.install()      # patch in place (idempotent)
    print(leanstep.megatron.format_report())
    leanstep.megatron.uninstall()    # restore the originals exactly

What is patched (each a "patch" with its own signature check):

- ``optimizer.clip_grads``: ``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
  ``count_zeros_fp32``, in the home module and in every loaded module that
  imported them by name (``optimizer.optimizer``, ``optimizer.layer_wise_optimizer``,
  user code, ...).
- ``transformer.moe.moe_utils``: ``permute``, ``unpermute``, ``sort_chunks_by_idxs``,
  ``pad_routing_map``, likewise with their aliases (``token_dispatcher``, ...).
- ``transformer.torch_norm.WrappedTorchNorm.__new__``: an RMSNorm it constructs
  becomes a :class:`leanstep.torch.RMSNorm` sharing the same weight Parameter,
  which takes leanstep's frozen direct path when the weight does not require a
  gradient (LoRA) and runs torch's own forward otherwise.

Before a patch is applied, the target's signature is compared with the one the
patch was written for (parameter names, kinds and defaults). A mismatch skips
that patch, with the reason in :func:`report`, and leaves every alias of that
function untouched: a module is never half-patched. Installing twice changes
nothing; :func:`uninstall` puts back the original objects (identity).

Each replacement follows the installed version's semantics (the norm and the
zero count are returned as Python floats, as 0.16 does; clipping computes the
coefficient as the installed code does, on the host when the norm is a float,
from the array when it is a tensor) and delegates to the original function for
anything leanstep does not run: non-CPU tensors, tensor subclasses (DTensor),
unsupported dtypes, Transformer Engine ``fused=True`` paths, Megatron-FSDP
params. :func:`report` counts calls per path and delegation reason.

Collectives: when ``torch.distributed`` is initialised, the same all-reduces
as the original run on the same groups (SUM of the p-th power sum, MAX for the
inf-norm, SUM of zero counts). Without an initialised process group a single
process is assumed (the originals would raise).
"""

import collections
import functools
import importlib
import inspect
import math
import sys
import threading

import torch

from . import _leanstep

__all__ = ["install", "uninstall", "report", "format_report", "installed", "PATCHES"]

_EMPTY = inspect.Parameter.empty
_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD

_CLIP_GRADS = "megatron.core.optimizer.clip_grads"
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_TORCH_NORM = "megatron.core.transformer.torch_norm"

# Modules known to import the patched functions by name: imported before
# patching so their aliases exist and are patched too. Any other loaded module
# holding the same object under the same name is found by a scan.
_GRAD_ALIAS_MODULES = ("megatron.core.optimizer.optimizer",
                       "megatron.core.optimizer.layer_wise_optimizer")
_MOE_ALIAS_MODULES = ("megatron.core.transformer.moe.token_dispatcher",)


class _Spec:
    """One patch: a function `attr` of module `home` (or, with `class_attr`,
    a method of a class there), the signature it was written for, and a
    factory making the replacement from the original."""

    def __init__(self, name, home, attr, params, factory, alias_modules=(), class_attr=None,
                 requires_area=None):
        self.name = name
        self.home = home
        self.attr = attr
        self.params = params  # [(name, default or _EMPTY)], all POSITIONAL_OR_KEYWORD
        self.factory = factory
        self.alias_modules = alias_modules
        self.class_attr = class_attr
        self.requires_area = requires_area

    def expected_signature(self):
        return "(" + ", ".join(n if d is _EMPTY else f"{n}={d!r}" for n, d in self.params) + ")"


def _signature_mismatch(func, spec):
    """None if func's parameters are exactly the expected ones, else why not."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as e:
        return f"cannot read the signature ({e})"
    found = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
    expected = [(n, _POS, d) for n, d in spec.params]
    if found == expected:
        return None
    shown = "(" + ", ".join(
        (n if d is _EMPTY else f"{n}={d!r}") + ("" if k == _POS else f" [{k.description}]")
        for n, k, d in found) + ")"
    return f"signature mismatch: expected {spec.expected_signature()}, found {shown}"


# ---------------------------------------------------------------- call statistics

_lock = threading.RLock()
_calls = collections.defaultdict(lambda: {"leanstep": 0, "delegated": collections.Counter()})


def _count(name, reason=None):
    with _lock:
        entry = _calls[name]
        if reason is None:
            entry["leanstep"] += 1
        else:
            entry["delegated"][reason] += 1


# ---------------------------------------------------------------- shared helpers

_LEANSTEP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _cpu_plain(tensors):
    """Why leanstep cannot take these tensors (None if it can)."""
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return "tensor_subclass"
        if t.device.type != "cpu":
            return "device"
    return None


class _PlanCache:
    """GradPlans keyed by the exact (address, dtype, shape, strides) of every
    grad: the same list every step reuses its plan; any change makes a new one.
    A plan describes memory only, so a key match is a valid plan even if the
    tensor objects are new."""

    def __init__(self, size=8):
        self._size = size
        self._plans = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, grads):
        from ._grad import GradPlan

        key = tuple([(g.data_ptr(), g.dtype, g.shape, g.stride()) for g in grads])
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = GradPlan(grads, like=_TORCH_LIKE)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._size:
                self._plans.popitem(last=False)
        return plan

    def clear(self):
        with self._lock:
            self._plans.clear()


_plans = _PlanCache()
_TORCH_LIKE = torch.empty(0)  # results of an empty grad list are torch tensors too


def _dist_ready():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _returns_tensor(original):
    """Whether the installed version returns a tensor (newer style) or a
    Python float (0.16), read from its return annotation."""
    try:
        ann = inspect.signature(original).return_annotation
    except (TypeError, ValueError):
        return False
    return ann is torch.Tensor or ann == "torch.Tensor"


# ---------------------------------------------------------------- gradient functions


def _make_get_grad_norm_fp32(original):
    returns_tensor = _returns_tensor(original)

    @functools.wraps(original)
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else list(grads_for_norm)
        reason = _cpu_plain(grads)
        if reason is None and any(g.dtype not in _LEANSTEP_DTYPES + (torch.float64,) for g in grads):
            reason = "dtype"
        if reason is not None:
            _count("get_grad_norm_fp32", reason)
            return original(grads_for_norm, norm_type, grad_stats_parallel_group)
        _count("get_grad_norm_fp32")
        p = float(norm_type)
        norm, _ = _plans.get(grads).norm(norm_type=p)
        if p == math.inf:
            total = norm
            if _dist_ready():
                torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX,
                                             group=grad_stats_parallel_group)
            return total[0] if returns_tensor else total[0].item()
        # As the original: the p-th power (fp32) is what ranks SUM-reduce.
        total = norm ** p
        if _dist_ready():
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM,
                                         group=grad_stats_parallel_group)
        if returns_tensor:
            return total[0] ** (1.0 / p)
        return total.item() ** (1.0 / p)

    get_grad_norm_fp32.__leanstep_original__ = original
    return get_grad_norm_fp32


def _param_grads(parameters, use_decoupled_grad):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    return [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]


def _make_clip_grad_by_total_norm_fp32(original):
    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        grads = _param_grads(params, use_decoupled_grad)
        reason = _cpu_plain(grads)
        allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        if reason is None and any(g.dtype not in allowed for g in grads):
            reason = "dtype"  # the original asserts on these
        if reason is None and isinstance(total_norm, torch.Tensor) and total_norm.device.type != "cpu":
            reason = "device"
        if reason is not None:
            _count("clip_grad_by_total_norm_fp32", reason)
            return original(params, max_norm, total_norm, use_decoupled_grad)
        _count("clip_grad_by_total_norm_fp32")
        if not grads:
            return None
        plan = _plans.get(grads)
        if isinstance(total_norm, torch.Tensor):
            # A norm that stayed on the device: coefficient from the array, no host read.
            plan.clip_(float(max_norm), total_norm.detach().reshape(1).to(torch.float32))
            return None
        # As the installed code: coefficient in double on the host, applied
        # only when < 1, as an fp32 multiply.
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0:
            plan.scale_(float(clip_coeff))
        return None

    clip_grad_by_total_norm_fp32.__leanstep_original__ = original
    return clip_grad_by_total_norm_fp32


def _make_count_zeros_fp32(original):
    module = sys.modules[original.__module__]

    @functools.wraps(original)
    def count_zeros_fp32(parameters, grad_stats_parallel_group, use_decoupled_grad=False,
                         tp_group=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        reason = None
        selected = []
        for param in params:
            if getattr(param, "__fsdp_param__", False) and param.grad is not None:
                reason = "megatron_fsdp"
                break
            grad = getattr(param, attr, None)
            if grad is None:
                continue
            # The installed version's own filters (shared params, TP duplicates).
            if module.param_is_not_shared(param) and module.param_is_not_tensor_parallel_duplicate(
                    param, tp_group=tp_group):
                selected.append(grad)
        if reason is None:
            reason = _cpu_plain(selected)
        if reason is None and any(g.dtype not in _LEANSTEP_DTYPES + (torch.float64,) for g in selected):
            reason = "dtype"
        if reason is not None:
            _count("count_zeros_fp32", reason)
            return original(params, grad_stats_parallel_group, use_decoupled_grad, tp_group)
        _count("count_zeros_fp32")
        count = _plans.get(selected).count_zeros()
        # The original accumulates into an fp32 tensor and SUM-reduces it.
        total = count.to(torch.float32)
        if _dist_ready():
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM,
                                         group=grad_stats_parallel_group)
        return total.item()

    count_zeros_fp32.__leanstep_original__ = original
    return count_zeros_fp32


# ---------------------------------------------------------------- MoE functions


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _make_permute(original):
    from . import torch as lt
    from ._moe import moe_permute

    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                drop_and_pad=False):
        reason = "fused" if fused else _cpu_plain([tokens, routing_map, probs])
        if reason is None and (tokens.dim() != 2 or tokens.dtype not in _LEANSTEP_DTYPES
                               or (probs is not None and probs.dtype not in _LEANSTEP_DTYPES)):
            reason = "dtype_or_shape"
        if reason is not None:
            _count("permute", reason)
            return original(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
        _count("permute")
        if routing_map.dtype != torch.bool:
            routing_map = routing_map.bool()  # the original accepts 0/1 integer maps
        if drop_and_pad and num_out_tokens is not None:
            rows, dp = int(num_out_tokens), True
        else:
            rows, dp = None, False  # the original's plain path emits every routed pair
        tokens, routing_map = tokens.contiguous(), routing_map.contiguous()
        probs = probs.contiguous() if probs is not None else None
        if _wants_grad(tokens, probs):
            return lt.permute(tokens, routing_map, probs, rows, dp)
        return moe_permute(tokens, routing_map, probs, rows, dp)

    permute.__leanstep_original__ = original
    return permute


def _make_unpermute(original):
    from . import torch as lt
    from ._moe import moe_unpermute

    @functools.wraps(original)
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None,
                  fused=False, drop_and_pad=False):
        reason = "fused" if fused else _cpu_plain([permuted_tokens, sorted_indices, probs,
                                                  routing_map])
        if reason is None and (permuted_tokens.dim() != 2
                               or permuted_tokens.dtype not in _LEANSTEP_DTYPES
                               or (probs is not None and probs.dtype not in _LEANSTEP_DTYPES)):
            reason = "dtype_or_shape"
        if reason is None and probs is not None and routing_map is None:
            reason = "probs_without_routing_map"  # the original asserts
        if reason is not None:
            _count("unpermute", reason)
            return original(permuted_tokens, sorted_indices, restore_shape, probs, routing_map,
                             fused, drop_and_pad)
        _count("unpermute")
        if routing_map is not None and routing_map.dtype != torch.bool:
            routing_map = routing_map.bool()
        permuted_tokens = permuted_tokens.contiguous()
        sorted_indices = sorted_indices.contiguous()
        if probs is not None:
            probs, routing_map = probs.contiguous(), routing_map.contiguous()
        else:
            routing_map = None  # only used to place probs
        dp = bool(drop_and_pad) and probs is not None
        if _wants_grad(permuted_tokens, probs):
            return lt.unpermute(permuted_tokens, sorted_indices, tuple(restore_shape), probs,
                                routing_map, dp)
        return moe_unpermute(permuted_tokens, sorted_indices, tuple(restore_shape), probs,
                             routing_map, dp)

    unpermute.__leanstep_original__ = original
    return unpermute


def _make_sort_chunks_by_idxs(original):
    from . import torch as lt
    from ._moe import sort_chunks_by_idxs as ls_sort_chunks

    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        reason = "fused" if fused else None
        if reason is None and not (isinstance(split_sizes, torch.Tensor)
                                   and isinstance(sorted_idxs, torch.Tensor)):
            reason = "non_tensor_sizes"
        if reason is None:
            reason = _cpu_plain([input, split_sizes, sorted_idxs, probs])
        if reason is None and input.dtype not in _LEANSTEP_DTYPES + (torch.float64,):
            reason = "dtype"
        if reason is not None:
            _count("sort_chunks_by_idxs", reason)
            return original(input, split_sizes, sorted_idxs, probs, fused)
        _count("sort_chunks_by_idxs")
        input = input.contiguous()
        split_sizes, sorted_idxs = split_sizes.contiguous(), sorted_idxs.contiguous()
        probs = probs.contiguous() if probs is not None else None
        if _wants_grad(input, probs):
            return lt.sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs)
        return ls_sort_chunks(input, split_sizes, sorted_idxs, probs)

    sort_chunks_by_idxs.__leanstep_original__ = original
    return sort_chunks_by_idxs


def _make_pad_routing_map(original):
    from ._moe import pad_routing_map as ls_pad

    @functools.wraps(original)
    def pad_routing_map(routing_map, pad_multiple):
        reason = _cpu_plain([routing_map])
        if reason is None and (routing_map.dtype != torch.bool or not routing_map.is_contiguous()):
            reason = "non_bool_or_strided_map"
        if reason is not None:
            _count("pad_routing_map", reason)
            return original(routing_map, pad_multiple)
        _count("pad_routing_map")
        # The installed version mutates the caller's map (through a transposed
        # view) and returns it: do the same, in place.
        ls_pad(routing_map, int(pad_multiple), out=routing_map)
        return routing_map

    pad_routing_map.__leanstep_original__ = original
    return pad_routing_map


# ---------------------------------------------------------------- RMSNorm construction


def _make_wrapped_torch_norm_new(original):
    from . import torch as lt

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        module = original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                          normalization)
        if type(module) is not torch.nn.RMSNorm:
            _count("WrappedTorchNorm", "not_rmsnorm")
            return module
        _count("WrappedTorchNorm")
        # Same Parameter, eps and shape; frozen weights take the fast path,
        # trainable ones run torch's forward exactly as before.
        return lt.RMSNorm.from_torch(module, frozen_only=True)

    __new__.__leanstep_original__ = original
    __new__.__wrapped__ = original
    __new__.__doc__ = original.__doc__
    return __new__


# ---------------------------------------------------------------- the patch table

PATCHES = [
    _Spec("get_grad_norm_fp32", _CLIP_GRADS, "get_grad_norm_fp32",
          [("grads_for_norm", _EMPTY), ("norm_type", 2), ("grad_stats_parallel_group", None)],
          _make_get_grad_norm_fp32, _GRAD_ALIAS_MODULES, requires_area="grad"),
    _Spec("clip_grad_by_total_norm_fp32", _CLIP_GRADS, "clip_grad_by_total_norm_fp32",
          [("parameters", _EMPTY), ("max_norm", _EMPTY), ("total_norm", _EMPTY),
           ("use_decoupled_grad", False)],
          _make_clip_grad_by_total_norm_fp32, _GRAD_ALIAS_MODULES, requires_area="grad"),
    _Spec("count_zeros_fp32", _CLIP_GRADS, "count_zeros_fp32",
          [("parameters", _EMPTY), ("grad_stats_parallel_group", _EMPTY),
           ("use_decoupled_grad", False), ("tp_group", None)],
          _make_count_zeros_fp32, _GRAD_ALIAS_MODULES, requires_area="grad"),
    _Spec("permute", _MOE_UTILS, "permute",
          [("tokens", _EMPTY), ("routing_map", _EMPTY), ("probs", None), ("num_out_tokens", None),
           ("fused", False), ("drop_and_pad", False)],
          _make_permute, _MOE_ALIAS_MODULES, requires_area="moe"),
    _Spec("unpermute", _MOE_UTILS, "unpermute",
          [("permuted_tokens", _EMPTY), ("sorted_indices", _EMPTY), ("restore_shape", _EMPTY),
           ("probs", None), ("routing_map", None), ("fused", False), ("drop_and_pad", False)],
          _make_unpermute, _MOE_ALIAS_MODULES, requires_area="moe"),
    _Spec("sort_chunks_by_idxs", _MOE_UTILS, "sort_chunks_by_idxs",
          [("input", _EMPTY), ("split_sizes", _EMPTY), ("sorted_idxs", _EMPTY), ("probs", None),
           ("fused", False)],
          _make_sort_chunks_by_idxs, _MOE_ALIAS_MODULES, requires_area="moe"),
    _Spec("pad_routing_map", _MOE_UTILS, "pad_routing_map",
          [("routing_map", _EMPTY), ("pad_multiple", _EMPTY)],
          _make_pad_routing_map, _MOE_ALIAS_MODULES, requires_area="moe"),
    _Spec("WrappedTorchNorm", _TORCH_NORM, "__new__",
          [("cls", _EMPTY), ("config", _EMPTY), ("hidden_size", _EMPTY), ("eps", 1e-5),
           ("persist_layer_norm", False), ("zero_centered_gamma", False),
           ("normalization", "LayerNorm")],
          _make_wrapped_torch_norm_new, class_attr="WrappedTorchNorm", requires_area="rmsnorm"),
]


# ---------------------------------------------------------------- install / uninstall


class _Installed:
    """An applied patch: the original, its replacement, and every
    (namespace, attribute name, original stored value) that was set."""

    def __init__(self, spec, original, replacement, targets):
        self.spec = spec
        self.original = original
        self.replacement = replacement
        self.targets = targets  # [(owner object, attr, stored original, label)]


_installed = {}   # name -> _Installed
_skipped = {}     # name -> reason
_alias_notes = {}  # name -> [alias modules that could not be imported]


def _import(name):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, f"{type(e).__name__}: {e}"


def _find_aliases(original, attr, home_module):
    """Every loaded module other than home that holds `original` under `attr`."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is home_module:
            continue
        try:  # sys.modules may hold odd objects (lazy loaders, proxies)
            namespace = vars(mod)
            holds = isinstance(namespace, dict) and namespace.get(attr) is original
        except Exception:  # noqa: BLE001
            continue
        if holds:
            found.append((mod, mod_name))
    found.sort(key=lambda item: item[1])
    return found


def _prepare(spec):
    """The targets a patch would set, or (None, reason)."""
    if spec.requires_area and spec.requires_area not in _leanstep.areas:
        return None, f"leanstep was built without the '{spec.requires_area}' area"
    home, err = _import(spec.home)
    if home is None:
        return None, f"cannot import {spec.home} ({err})"
    if spec.class_attr:
        owner = getattr(home, spec.class_attr, None)
        if owner is None:
            return None, f"{spec.home} has no {spec.class_attr}"
        stored = owner.__dict__.get(spec.attr)
        if stored is None:
            return None, f"{spec.class_attr} defines no {spec.attr}"
        original = stored.__func__ if isinstance(stored, (staticmethod, classmethod)) else stored
        mismatch = _signature_mismatch(original, spec)
        if mismatch:
            return None, mismatch
        label = f"{spec.home}.{spec.class_attr}.{spec.attr}"
        return (original, [(owner, spec.attr, stored, label)]), None
    original = getattr(home, spec.attr, None)
    if original is None:
        return None, f"{spec.home} has no {spec.attr}"
    if getattr(original, "__leanstep_original__", None) is not None:
        return None, "already patched by another copy of leanstep"
    mismatch = _signature_mismatch(original, spec)
    if mismatch:
        return None, mismatch
    notes = []
    for alias_module in spec.alias_modules:
        mod, err = _import(alias_module)
        if mod is None:
            notes.append(f"{alias_module} not importable ({err})")
    _alias_notes[spec.name] = notes
    targets = [(home, spec.attr, original, f"{spec.home}.{spec.attr}")]
    for mod, mod_name in _find_aliases(original, spec.attr, home):
        targets.append((mod, spec.attr, original, f"{mod_name}.{spec.attr}"))
    return (original, targets), None


def _set(owner, attr, value):
    if isinstance(owner, type):
        setattr(owner, attr, value)
    else:
        owner.__dict__[attr] = value


def install(patches=None):
    """Applies the patches (all, or those named in `patches`). Returns
    :func:`report`. Safe to call again: an installed patch is left as it is,
    except that modules loaded since then that imported the original by name
    are patched as well."""
    wanted = [s for s in PATCHES if patches is None or s.name in patches]
    with _lock:
        for spec in wanted:
            done = _installed.get(spec.name)
            if done is not None:
                _patch_new_aliases(done)
                continue
            prepared, reason = _prepare(spec)
            if prepared is None:
                _skipped[spec.name] = reason
                continue
            original, targets = prepared
            replacement = spec.factory(original)
            stored_replacement = staticmethod(replacement) if spec.class_attr else replacement
            applied = []
            try:
                for owner, attr, stored, label in targets:
                    _set(owner, attr, stored_replacement)
                    applied.append((owner, attr, stored, label))
            except Exception as e:  # noqa: BLE001 - roll back: never half-patched
                for owner, attr, stored, _ in applied:
                    _set(owner, attr, stored)
                _skipped[spec.name] = f"could not set {attr} ({e}); rolled back"
                continue
            _skipped.pop(spec.name, None)
            _installed[spec.name] = _Installed(spec, original, stored_replacement, applied)
    return report()


def _patch_new_aliases(done):
    if done.spec.class_attr:
        return
    home = sys.modules.get(done.spec.home)
    known = {id(owner) for owner, *_ in done.targets}
    for mod, mod_name in _find_aliases(done.original, done.spec.attr, home):
        if id(mod) not in known:
            _set(mod, done.spec.attr, done.replacement)
            done.targets.append((mod, done.spec.attr, done.original, f"{mod_name}.{done.spec.attr}"))


def uninstall(patches=None):
    """Restores the original objects wherever a patch set its replacement.
    Returns :func:`report`."""
    with _lock:
        for name in list(_installed):
            if patches is not None and name not in patches:
                continue
            done = _installed.pop(name)
            for owner, attr, stored, _ in done.targets:
                _set(owner, attr, stored)
        if not _installed:
            _plans.clear()
        for name in list(_skipped):
            if patches is None or name in patches:
                _skipped.pop(name)
    return report()


def installed():
    """Names of the patches currently installed."""
    with _lock:
        return sorted(_installed)


def report():
    """What is installed where, what was skipped and why, and how calls went:
    ``{"megatron_core_version", "installed": {name: [targets]}, "skipped":
    {name: reason}, "notes": {name: [..]}, "calls": {name: {"leanstep": n,
    "delegated": {reason: n}}}}``."""
    try:
        import megatron.core as mcore

        version = getattr(mcore, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        version = None
    with _lock:
        return {
            "megatron_core_version": version,
            "installed": {n: [label for *_, label in d.targets] for n, d in _installed.items()},
            "skipped": dict(_skipped),
            "notes": {n: list(v) for n, v in _alias_notes.items() if v},
            "calls": {n: {"leanstep": c["leanstep"], "delegated": dict(c["delegated"])}
                      for n, c in _calls.items()},
        }


def format_report():
    """:func:`report` as readable lines."""
    r = report()
    lines = [f"leanstep.megatron on megatron-core {r['megatron_core_version']}"]
    for name in [s.name for s in PATCHES]:
        if name in r["installed"]:
            targets = r["installed"][name]
            lines.append(f"  installed {name}: {len(targets)} target(s)")
            lines += [f"      {t}" for t in targets]
        elif name in r["skipped"]:
            lines.append(f"  skipped   {name}: {r['skipped'][name]}")
        else:
            lines.append(f"  not installed {name}")
        for note in r["notes"].get(name, []):
            lines.append(f"      note: {note}")
        calls = r["calls"].get(name)
        if calls:
            delegated = ", ".join(f"{k} {v}" for k, v in sorted(calls["delegated"].items()))
            lines.append(f"      calls: leanstep {calls['leanstep']}"
                         + (f"; delegated: {delegated}" if delegated else ""))
    return "\n".join(lines)


def reset_call_counts():
    with _lock:
        _calls.clear()
