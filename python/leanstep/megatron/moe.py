"""MoE patches: ``transformer.moe.moe_utils`` permute, unpermute,
sort_chunks_by_idxs and pad_routing_map, for 0.16 (3-tuple permute) and
0.19 (tokens_per_expert/align_size, a 5-tuple; unpermute's pad_offsets).

CPU tensors run the C++ kernels; tensors on another device the torch-op
backend, with no host read when the number of output rows is known on the
host. Semantics that differ from the original's only for inputs Megatron
never produces (an output row count that is not the routed count) are
checked: on the CPU by delegating such calls, on a device by an
asynchronous assertion (it raises at the next synchronisation, with no
host read on the way).
"""

import functools
import inspect
import os
import sys

import torch

from .. import _backend, _leanstep, _registry
from .. import torch as lt
from . import _patching
from ._patching import EMPTY, Spec, Variant

if "moe" in _leanstep.areas:  # a build without the moe area has no MoE patches to make
    from .._moe import moe_permute, moe_unpermute
    from .._moe import pad_routing_map as ls_pad
    from .._moe import sort_chunks_by_idxs as ls_sort_chunks

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
ALIAS_MODULES = ("megatron.core.transformer.moe.token_dispatcher",)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BOOL = (torch.bool,)
_INDICES = (torch.int64, torch.int32)
_ROWS_MESSAGE = "leanstep permute: num_out_tokens must equal the routed count"
_PLAIN = (torch.Tensor, torch.nn.Parameter)


# On CPU tensors the patches run leanstep's permute and hand unpermute and
# sort_chunks_by_idxs (where it moves rows) back to Megatron's own functions by
# default. Megatron's unpermute (no probs) is three aten ops with C++ autograd
# nodes; leanstep's is one native call each way behind a Python autograd
# Function, whose own cost (about 20 us forward + backward) is more than the
# kernels'. Measured (one thread, 2-core VM, torch 2.15, megatron-core 0.16.1,
# 64 tokens, hidden 64, 16 experts, top-8, bf16, forward + backward, 60
# alternating rounds; `bench/host_overhead.py` times the job's pattern of these
# calls through the patches): Megatron's permute 1.49x leanstep's time [1.40,
# 1.59], Megatron's unpermute 0.90x [0.82, 0.96]. Megatron's permute builds the
# row order with masked_select over the transposed map and gathers with
# index_select; leanstep's is one pass over the map and the rows. The two are
# drop-ins for each other (the same row order): a leanstep permute feeds a
# Megatron unpermute exactly.
#
# An earlier measurement (the main job, 256 tokens per rank, hidden 256, 8
# experts, fp32) had every leanstep call slower inside a training step than in
# a loop (11-13 ms a step against Megatron's 8-9 ms), before the patches took
# the usual CPU call in one pass (about 20 us less per call) and before
# leanstep's kernels' lean entry.
#
# Device tensors take leanstep's path where Megatron's permute syncs: 0.16's
# selects the routed tokens with masked_select, whose output size the host must
# wait for; leanstep's reads nothing. From the release whose permute is an
# argsort of fixed shape (0.19), Megatron's path is sync-free too, and faster:
# measured on an H200 (torch 2.11, megatron-core 0.19.2, scripts/gpu-check.sh,
# 2026-12-04), host time per permute + unpermute forward + backward 1.05 ms
# against leanstep's 3.5 ms (128 tokens, hidden 256, 8 experts, top-2) and
# 1.9 against 4.6 ms (4096, 2048, 16, top-8); device time at 4096 tokens, 128
# experts, top-8, hidden 2048: permute 0.26 against 0.41 ms, unpermute 0.70
# against 0.99 ms (that unpermute given probs, whose masked_select syncs).
# There the patches hand device permutes back to Megatron, and unpermutes too
# unless they carry probs (0.19's unpermute selects them with masked_select).
_CPU_ENV = "LEANSTEP_MEGATRON_MOE_CPU"
# None until first needed: then the caller's setting, or the environment's,
# read once (a per-call read of os.environ cost more than the rest of the path
# that hands the call back).
_cpu_kernels = None
AUTO = "auto"
# What each setting hands back to Megatron on the CPU (patch names).
_CPU_DELEGATIONS = {AUTO: frozenset({"unpermute", "sort_chunks_by_idxs"}),
                    True: frozenset(),
                    False: frozenset({"permute", "unpermute", "sort_chunks_by_idxs"})}


def cpu_kernels(enabled=None):
    """Which MoE patches run leanstep's C++ kernels on CPU tensors. ``"auto"``
    (the default): permute on leanstep's, unpermute and sort_chunks_by_idxs on
    Megatron's own functions, whichever measured faster there (see above and
    docs/megatron-cpu.md). ``True`` (or ``LEANSTEP_MEGATRON_MOE_CPU=leanstep``)
    runs leanstep's kernels in all three (tests, benchmarks), ``False`` (or
    ``=megatron``) none. The environment is read once, when the patches are
    installed or first called. Returns the setting in force before the call."""
    global _cpu_kernels
    previous = _cpu_kernels_enabled()
    if enabled is not None:
        if not (isinstance(enabled, bool) or enabled == AUTO):
            raise TypeError(f"cpu_kernels: argument 'enabled' must be True, False, 'auto' or "
                            f"None (got {enabled!r})")
        _cpu_kernels = enabled
    return previous


def _cpu_kernels_enabled():
    if _cpu_kernels is None:
        _cpu_kernels_from_environment()
    return _cpu_kernels


def _cpu_kernels_from_environment():
    """The setting of LEANSTEP_MEGATRON_MOE_CPU; also makes it the one in force
    (used on install, and by tests that change the environment)."""
    global _cpu_kernels
    value = os.environ.get(_CPU_ENV, "").strip().lower()
    settings = {"": AUTO, AUTO: AUTO, "megatron": False, "leanstep": True}
    if value not in settings:
        raise _leanstep.Error(f"{_CPU_ENV} must be 'auto' (the default), 'megatron' or "
                              f"'leanstep' (got {value!r})")
    _cpu_kernels = settings[value]
    return _cpu_kernels


CPU_DELEGATED = "cpu_megatron_faster"  # the reason counted when a CPU call is handed back
DEVICE_DELEGATED = "device_megatron_sync_free_and_faster"

# None: automatic (leanstep where Megatron's function syncs, see above); True or
# False: set by device_kernels().
_device_kernels = None
_megatron_syncs = {}  # function name -> whether the installed Megatron's version syncs


def device_kernels(enabled=None):
    """Whether the MoE patches run leanstep's path on device tensors. ``None``
    (the default): where the installed Megatron-Core's function would sync
    (``masked_select``: 0.16's permute, and 0.19's unpermute given probs),
    not where it is sync-free (0.19's permute, and its unpermute without
    probs: Megatron's is faster there). ``True`` or ``False`` forces it
    (tests, benchmarks). Returns the setting in force before the call (None:
    automatic)."""
    global _device_kernels
    previous = _device_kernels
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"device_kernels: argument 'enabled' must be True, False or None "
                        f"(got {enabled!r})")
    _device_kernels = enabled
    return previous


def _megatron_syncs_in(name):
    """Whether the installed Megatron-Core's ``moe_utils.<name>`` calls
    ``masked_select`` (a host wait for its output size on a device), read
    from its source once; True when the source cannot be read (leanstep's
    sync-free path then runs)."""
    hit = _megatron_syncs.get(name)
    if hit is None:
        try:
            original = inspect.unwrap(getattr(sys.modules[MOE_UTILS], name))
            hit = ".masked_select(" in inspect.getsource(original)  # a call, not a comment
        except (KeyError, AttributeError, OSError, TypeError):
            hit = True
        _megatron_syncs[name] = hit
    return hit


def _device_delegated(tensor, with_probs=False):
    """Whether this device call goes back to Megatron (see device_kernels):
    a permute, or an unpermute (``with_probs``: given probs to apply)."""
    if tensor.is_cpu:
        return False
    if _device_kernels is not None:
        return not _device_kernels
    if _megatron_syncs_in("permute"):
        return False  # leanstep's permute and unpermute, as a pair
    return not (with_probs and _megatron_syncs_in("unpermute"))


def _cpu_delegated(tensor, name):
    """Whether this call of patch `name` goes back to Megatron as a CPU call,
    checked first and cheaply (the call's other checks would only add to
    Megatron's own time)."""
    setting = _cpu_kernels if _cpu_kernels is not None else _cpu_kernels_from_environment()
    return name in _CPU_DELEGATIONS[setting] and type(tensor) in _PLAIN and tensor.is_cpu


def _why_not(tensors):
    """Why leanstep cannot take these tensors (None if it can)."""
    device = None
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN:
            return "tensor_subclass"
        if device is None:
            device = t.device
            if _backend.device_usable(device) is not None:
                return "device_unusable"
        elif t.device != device:
            return "mixed_devices"
    return None


def _device_type(t):
    return t.device.type


def _backend_of(tensors, op):
    """The backend leanstep's entry point will choose for `op` (reported per
    call): the registry's choice, not counted (the entry point counts it)."""
    return _registry.choose(f"moe.{op}", tensors, None, None, op)[0]


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _host_rows(num_out_tokens, device):
    """num_out_tokens as a host int if that costs no device read, else None."""
    if num_out_tokens is None:
        return None
    if isinstance(num_out_tokens, torch.Tensor):
        if num_out_tokens.device.type != "cpu":
            return None
        return int(num_out_tokens)  # host memory: no device synchronisation
    return int(num_out_tokens)


def _assert_routed_rows(routing_map, rows):
    """0.19's permute emits `rows` rows, truncating or filling with unrouted
    tokens where that is not the routed count; leanstep's does not, so the two
    must agree. The same asynchronous check on every device: a CPU run reads no
    more than a device run."""
    torch._assert_async(routing_map.sum() == rows, _ROWS_MESSAGE)


def _cpu_call(tensor, dtypes=_DTYPES):
    """A plain CPU tensor of one of `dtypes`: what the CPU kernels take as is."""
    return type(tensor) in _PLAIN and tensor.is_cpu and tensor.dtype in dtypes


def _make_permute(original, spec, five_tuple=False):
    def run(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad, call_original):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return None, call_original()
        if _cpu_delegated(tokens, spec.name):
            _patching.count(spec.name, reason=CPU_DELEGATED)
            return None, call_original()
        if (not fused and not drop_and_pad and _cpu_call(tokens) and tokens.dim() == 2
                and _cpu_call(routing_map, _BOOL) and (probs is None or _cpu_call(probs))):
            # The usual call (plain CPU tensors, a boolean map, no padding), decided in one
            # pass: the checks below, each of which it passes, cost as much again as
            # leanstep's forward. 0.16's plain path emits every routed pair (no row count);
            # 0.19's emits num_out_tokens rows, which must be the routed count.
            rows = _host_rows(num_out_tokens, tokens.device) if five_tuple else None
            if not five_tuple or rows is not None:
                _patching.count(spec.name, "cpu", "cpu")
                if rows is not None:
                    _assert_routed_rows(routing_map, rows)
                return lt.permute(tokens, routing_map, probs, rows, False), None
        if not fused and _device_delegated(tokens):
            _patching.count(spec.name, reason=DEVICE_DELEGATED)
            return None, call_original()
        reason = "fused" if fused else _why_not([tokens, routing_map, probs])
        if reason is None and (tokens.dim() != 2 or tokens.dtype not in _DTYPES
                               or (probs is not None and probs.dtype not in _DTYPES)):
            reason = "dtype_or_shape"
        on_cpu = reason is None and tokens.device.type == "cpu"
        rows = _host_rows(num_out_tokens, tokens.device) if reason is None else None
        if reason is None and five_tuple and not (drop_and_pad and num_out_tokens is not None):
            if num_out_tokens is None:
                reason = "num_out_tokens_missing"  # the original asserts
        if reason is not None:
            _patching.count(spec.name, reason=reason)
            return None, call_original()
        _patching.count(spec.name, _device_type(tokens),
                        "cpu" if on_cpu else _backend_of([tokens, routing_map, probs], "permute"))
        if routing_map.dtype != torch.bool:
            routing_map = routing_map.bool()  # the original accepts 0/1 integer maps
        if drop_and_pad and num_out_tokens is not None:
            rows = rows if rows is not None else int(num_out_tokens)
            dp = True
        else:
            dp = False
            if not five_tuple and on_cpu:
                rows = None  # 0.16's plain path emits every routed pair
            elif rows is None and num_out_tokens is not None:
                rows = int(num_out_tokens)  # a device count: the one read the original pays too
            if rows is not None:
                _assert_routed_rows(routing_map, rows)
        tokens = tokens if tokens.is_contiguous() else tokens.contiguous()
        routing_map = routing_map if routing_map.is_contiguous() else routing_map.contiguous()
        if probs is not None and not probs.is_contiguous():
            probs = probs.contiguous()
        if _wants_grad(tokens, probs):
            return lt.permute(tokens, routing_map, probs, rows, dp), None
        return moe_permute(tokens, routing_map, probs, rows, dp), None

    if five_tuple:
        @functools.wraps(original)
        def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                    drop_and_pad=False, tokens_per_expert=None, align_size=0):
            out, fallback = run(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad,
                                lambda: original(tokens, routing_map, probs, num_out_tokens, fused,
                                                 drop_and_pad, tokens_per_expert, align_size))
            if out is None:
                return fallback
            permuted, permuted_probs, sorted_indices = out
            # The non-fused path of 0.19: no pad offsets; tokens_per_expert as given.
            return permuted, permuted_probs, sorted_indices, None, tokens_per_expert
    else:
        @functools.wraps(original)
        def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                    drop_and_pad=False):
            out, fallback = run(tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad,
                                lambda: original(tokens, routing_map, probs, num_out_tokens, fused,
                                                 drop_and_pad))
            return fallback if out is None else out
    return permute


def _make_unpermute(original, spec, with_pad_offsets=False):
    def run(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused,
            drop_and_pad, pad_offsets, call_original):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return call_original()
        if _cpu_delegated(permuted_tokens, spec.name):
            _patching.count(spec.name, reason=CPU_DELEGATED)
            return call_original()
        if (not fused and pad_offsets is None and probs is None and _cpu_call(permuted_tokens)
                and permuted_tokens.dim() == 2 and _cpu_call(sorted_indices, _INDICES)):
            # The usual call (plain CPU tensors, probs applied by the experts), decided in
            # one pass, as permute's.
            _patching.count(spec.name, "cpu", "cpu")
            return lt.unpermute(permuted_tokens, sorted_indices, tuple(restore_shape))
        if not fused and _device_delegated(permuted_tokens, probs is not None):
            _patching.count(spec.name, reason=DEVICE_DELEGATED)
            return call_original()
        reason = "fused" if fused else _why_not([permuted_tokens, sorted_indices, probs,
                                                 routing_map])
        if reason is None and pad_offsets is not None:
            reason = "pad_offsets"
        if reason is None and (permuted_tokens.dim() != 2
                               or permuted_tokens.dtype not in _DTYPES
                               or (probs is not None and probs.dtype not in _DTYPES)):
            reason = "dtype_or_shape"
        if reason is None and probs is not None and routing_map is None:
            reason = "probs_without_routing_map"  # the original asserts
        if reason is not None:
            _patching.count(spec.name, reason=reason)
            return call_original()
        on_cpu = permuted_tokens.device.type == "cpu"
        _patching.count(spec.name, _device_type(permuted_tokens),
                        "cpu" if on_cpu else _backend_of([permuted_tokens, sorted_indices],
                                                         "unpermute"))
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

    if with_pad_offsets:
        @functools.wraps(original)
        def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None,
                      routing_map=None, fused=False, drop_and_pad=False, pad_offsets=None):
            return run(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused,
                       drop_and_pad, pad_offsets,
                       lambda: original(permuted_tokens, sorted_indices, restore_shape, probs,
                                        routing_map, fused, drop_and_pad, pad_offsets))
    else:
        @functools.wraps(original)
        def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None,
                      routing_map=None, fused=False, drop_and_pad=False):
            return run(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused,
                       drop_and_pad, None,
                       lambda: original(permuted_tokens, sorted_indices, restore_shape, probs,
                                        routing_map, fused, drop_and_pad))
    return unpermute


def _host_indices(t):
    return (type(t) in _PLAIN and t.is_cpu and t.dim() == 1
            and t.dtype in (torch.int64, torch.int32))


def _moves_nothing(rows, split_sizes, order):
    """Whether sort_chunks leaves every row where it is: the chunk order is 0, 1,
    ..., C-1 and the C split sizes (none negative) cover the rows exactly, as
    Megatron's own function requires (it raises otherwise, and so does the
    call this answer sends on). Both are read only where they are host memory
    (Megatron keeps them there unless its fused permute is on: then they are
    device memory, never read here)."""
    if not (_host_indices(order) and _host_indices(split_sizes)
            and split_sizes.shape[0] == order.shape[0]):
        return False
    n = order.shape[0]
    if n <= 64:  # the usual count (experts x TP): a list compare, under a microsecond
        if order.tolist() != list(range(n)):
            return False
    elif not torch.equal(order, torch.arange(n, dtype=order.dtype)):
        return False
    sizes = split_sizes.tolist()
    return min(sizes, default=0) >= 0 and sum(sizes) == rows.shape[0]


def _make_sort_chunks_by_idxs(original, spec):
    @functools.wraps(original)
    def sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(input, split_sizes, sorted_idxs, probs, fused)
        if (not fused and type(input) in _PLAIN and input.is_cpu and input.dim() >= 1
                and (probs is None or type(probs) in _PLAIN)
                and _moves_nothing(input, split_sizes, sorted_idxs)):
            # With one expert-parallel and one tensor-parallel rank the all-to-all
            # dispatcher's chunk order (by local expert) is the identity: nothing moves.
            # A copy (one per tensor, and its C++ gradient node) stands for Megatron's
            # split into C chunks and concatenation, keeping its result a tensor of its
            # own. Measured (one thread, 476 rows, H 64, 16 chunks, bf16 with fp32 probs,
            # forward + backward): about 100 us less than Megatron's. CPU calls only,
            # which read the host order as Megatron's own function does (it reads it and
            # the split sizes); a device call reads nothing on the host, so its kernel
            # moves the rows whatever the order.
            _patching.count(spec.name, input.device.type, "identity_order")
            return (input.clone(memory_format=torch.contiguous_format),
                    None if probs is None else probs.clone(memory_format=torch.contiguous_format))
        if _cpu_delegated(input, spec.name):
            _patching.count(spec.name, reason=CPU_DELEGATED)
            return original(input, split_sizes, sorted_idxs, probs, fused)
        reason = "fused" if fused else None
        if reason is None and not (isinstance(split_sizes, torch.Tensor)
                                   and isinstance(sorted_idxs, torch.Tensor)):
            reason = "non_tensor_sizes"
        if reason is None:
            reason = _why_not([input, probs])
        if reason is None and input.dtype not in _DTYPES + (torch.float64,):
            reason = "dtype"
        if reason is not None:
            _patching.count(spec.name, reason=reason)
            return original(input, split_sizes, sorted_idxs, probs, fused)
        device = input.device
        # Megatron keeps split sizes on the host; a device run needs them on
        # the device (a host-to-device copy, never a read back).
        split_sizes = split_sizes.to(device, non_blocking=True).contiguous()
        sorted_idxs = sorted_idxs.to(device, non_blocking=True).contiguous()
        _patching.count(spec.name, device.type, "cpu" if device.type == "cpu" else "torch")
        input = input.contiguous()
        probs = probs.contiguous() if probs is not None else None
        if _wants_grad(input, probs):
            return lt.sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs)
        return ls_sort_chunks(input, split_sizes, sorted_idxs, probs)

    return sort_chunks_by_idxs


def _make_pad_routing_map(original, spec):
    @functools.wraps(original)
    def pad_routing_map(routing_map, pad_multiple):
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(routing_map, pad_multiple)
        reason = _why_not([routing_map])
        if reason is None and (routing_map.dtype != torch.bool or not routing_map.is_contiguous()):
            reason = "non_bool_or_strided_map"
        if reason is not None:
            _patching.count(spec.name, reason=reason)
            return original(routing_map, pad_multiple)
        on_cpu = routing_map.device.type == "cpu"
        _patching.count(spec.name, routing_map.device.type, "cpu" if on_cpu else "torch")
        # The installed version mutates the caller's map (through a transposed
        # view) and returns it: do the same, in place.
        ls_pad(routing_map, int(pad_multiple), out=routing_map)
        return routing_map

    return pad_routing_map


_PERMUTE_016 = [("tokens", EMPTY), ("routing_map", EMPTY), ("probs", None), ("num_out_tokens", None),
                ("fused", False), ("drop_and_pad", False)]
_UNPERMUTE_016 = [("permuted_tokens", EMPTY), ("sorted_indices", EMPTY), ("restore_shape", EMPTY),
                  ("probs", None), ("routing_map", None), ("fused", False), ("drop_and_pad", False)]

SPECS = [
    Spec("permute", "moe.permute", MOE_UTILS, "permute",
         [Variant("0.16", _PERMUTE_016, _make_permute),
          Variant("0.19", _PERMUTE_016 + [("tokens_per_expert", None), ("align_size", 0)],
                  functools.partial(_make_permute, five_tuple=True))],
         ALIAS_MODULES, requires_area="moe"),
    Spec("unpermute", "moe.unpermute", MOE_UTILS, "unpermute",
         [Variant("0.16", _UNPERMUTE_016, _make_unpermute),
          Variant("0.19", _UNPERMUTE_016 + [("pad_offsets", None)],
                  functools.partial(_make_unpermute, with_pad_offsets=True))],
         ALIAS_MODULES, requires_area="moe"),
    Spec("sort_chunks_by_idxs", "moe.sort_chunks_by_idxs", MOE_UTILS, "sort_chunks_by_idxs",
         [Variant("0.16-0.19", [("input", EMPTY), ("split_sizes", EMPTY), ("sorted_idxs", EMPTY),
                                ("probs", None), ("fused", False)], _make_sort_chunks_by_idxs)],
         ALIAS_MODULES, requires_area="moe"),
    Spec("pad_routing_map", "moe.pad_routing_map", MOE_UTILS, "pad_routing_map",
         [Variant("0.16-0.19", [("routing_map", EMPTY), ("pad_multiple", EMPTY)],
                  _make_pad_routing_map)],
         ALIAS_MODULES, requires_area="moe"),
]
