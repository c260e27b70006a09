"""Which backend runs a call: chosen from the tensors' device, forced only by
``backend=`` (tests and benchmarks).

- ``"cpu"``: the C++ kernels over DLPack views (CPU memory only).
- ``"torch"``: the device backend, written with PyTorch ops, for tensors on
  any torch device (cuda, npu through torch_npu, xpu, mps, and meta for
  tests); it can be forced on CPU tensors so its numerics are tested here.
  It never reads a device value on the host.
- ``"triton"``: Triton kernels over region tables (python/leanstep/backends/
  triton_*.py), for the op families that have them (``choose(...,
  triton="grad" | "rmsnorm" | "moe")``). Chosen automatically for cuda, xpu
  and npu tensors when ``import triton`` works, a Triton driver for that
  device is active and the family's first-use self-check passed on that
  device (:mod:`leanstep.backends.triton_selfcheck`: the kernels against the
  torch-op backend, once per family and device); ``LEANSTEP_TRITON=off``
  turns the automatic choice off. Forced with ``backend="triton"``, also on
  CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, tests).
  Elsewhere the torch-op backend runs, and the reason is recorded.
  triton is imported only when a call on such a device (or a forced one)
  asks for it: ``import leanstep`` never imports it.

Every routed call is counted per (op, backend, device type); :func:`calls`
returns the counts and :func:`reset_calls` clears them.
"""

import collections
import itertools
import os
import sys
import threading

from ._arrays import SUPPORTED_DTYPES, dtype_name
from . import _leanstep
from ._leanstep import Error

BACKENDS = ("cpu", "torch", "triton")
#: The op vocabulary: the C++ op table's rows (leanstep/ops.h), in order, each
#: with the backends that implement it ("cpu", the C++ registry, first).
OPS = {name: ("cpu",) + tuple(b for b in devices.split(",") if b)
       for name, devices in _leanstep.dispatch_op_table()}
#: torch device types with Triton kernels -> the Triton driver backends that run them.
TRITON_TARGETS = {"cuda": ("cuda", "hip"), "xpu": ("xpu",), "npu": ("npu", "ascend")}

_lock = threading.Lock()
_calls = collections.Counter()
_reasons = collections.Counter()
# (op, backend, device type, reason) -> [itertools.count, its value at the last reset]:
# the counters of hot paths that decided once (see tally).
_tallies = {}
_triton_drivers = {}  # device type -> None (usable) or why not, once per process
_self_checks = {}  # (family, device) -> None (passed) or why not, once per process


def _torch():
    return sys.modules.get("torch")


def device_usable(device):
    """None if this torch build can run tensors on `device`, else why not."""
    torch = _torch()
    kind = device.type
    if kind in ("cpu", "meta"):
        return None
    if kind == "cuda":
        return None if torch.cuda.is_available() else "this torch build has no usable CUDA device"
    if kind == "npu":
        return None if hasattr(torch, "npu") else "torch_npu is not imported (npu tensors need it)"
    if kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        return None if xpu is not None and xpu.is_available() else "no usable XPU device"
    if kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        return None if mps is not None and mps.is_available() else "no usable MPS device"
    return None  # another PrivateUse1 device: torch itself will say if it cannot run


def device_of(tensors, where, names=None):
    """The one device of `tensors` (None entries skipped). Mixed devices are an
    error naming both tensors; so is a device this torch build cannot run."""
    def name(i):  # made for a message only
        return names[i] if names else f"tensors[{i}]"

    first = first_index = None
    for i, t in enumerate(tensors):
        if t is None:
            continue
        if first is None:
            first, first_index = t.device, i
            reason = device_usable(first)
            if reason is not None:
                raise Error(f"{where}: argument '{name(i)}' is on device {first}, which cannot "
                            f"run here: {reason}")
        elif t.device != first:
            raise Error(f"{where}: all tensors must be on one device (got '{name(first_index)}' "
                        f"on {first} and '{name(i)}' on {t.device})")
    return first


def _interpret_requested():
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def triton_unusable(device):
    """None if leanstep's Triton kernels can run on tensors of `device`, else
    why not. CPU tensors: only in Triton's interpreter (TRITON_INTERPRET=1
    set before the kernels are imported); cuda/xpu/npu tensors: triton
    importable, a driver for the device active, the interpreter off."""
    kind = device.type
    kernels = sys.modules.get("leanstep.backends.triton_common")
    if kind == "cpu":
        if not _interpret_requested():
            return "TRITON_INTERPRET=1 is not set"
        if kernels is not None and not kernels.INTERPRETED:
            return "leanstep's Triton kernels were imported without TRITON_INTERPRET=1"
        try:
            import triton  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure is a reason
            return f"triton is not importable ({type(e).__name__}: {e})"
        return None
    if kind not in TRITON_TARGETS:
        return f"Triton kernels do not run {kind} tensors"
    if _interpret_requested() or (kernels is not None and kernels.INTERPRETED):
        return "TRITON_INTERPRET is set: the interpreter runs CPU tensors only"
    if kind not in _triton_drivers:
        why = None
        try:
            from triton.runtime import driver

            target = driver.active.get_current_target().backend
            if target not in TRITON_TARGETS[kind]:
                why = f"the active Triton driver is for {target}, not {kind}"
        except Exception as e:  # noqa: BLE001 - no triton, no driver, no device
            why = f"no active Triton driver ({type(e).__name__}: {e})"
        _triton_drivers[kind] = why
    return _triton_drivers[kind]


def check_dtypes(tensors, where, names=None):
    """Every array of a call has a dtype leanstep has a name for, before any
    output is allocated (fp8, complex, uint16, ...: an error naming the
    argument); each op's own dtype rules come after."""
    for i, t in enumerate(tensors):
        if t is not None and dtype_name(t) not in SUPPORTED_DTYPES:
            name = names[i] if names else f"tensors[{i}]"
            raise Error(f"{where}: argument '{name}' must have one of the dtypes "
                        f"{', '.join(SUPPORTED_DTYPES)} (got {dtype_name(t)})")


_cpu_dtypes = None  # the torch dtypes leanstep names, once torch is imported


def torch_ops_only():
    """Why a call must be made of torch ops, or None. ``torch.jit.trace`` and
    ``make_fx`` record torch ops, a functorch transform (vmap, grad, jvp)
    batches or differentiates them, forward-mode AD carries their tangents: a
    call into the C++ kernels would be missing from the graph (which would
    return what its outputs held), unbatched, or without its tangent. Such
    calls run the torch-op backend."""
    torch = _torch()
    if torch is None:
        return None
    C = torch._C
    if C._get_tracing_state() is not None:
        return "torch.jit.trace"
    if C._are_functorch_transforms_active():
        return "a functorch transform"
    forward_ad = sys.modules.get("torch.autograd.forward_ad")
    if forward_ad is not None and forward_ad._current_level >= 0:
        return "forward-mode AD"
    if C._len_torch_dispatch_stack():
        proxy = sys.modules.get("torch.fx.experimental.proxy_tensor")
        if proxy is not None and proxy.get_proxy_mode() is not None:
            return "make_fx"
    return None


#: What a caller that :func:`torch_ops_only` names does, and the end of a
#: choice's reason when it made the choice.
SEES_TORCH_OPS_ONLY = "sees torch ops only"
ONLY_TORCH_OPS = f"{SEES_TORCH_OPS_ONLY}: the torch-op code"


def cpu_dtypes():
    """The torch dtypes leanstep's CPU kernels take (SUPPORTED_DTYPES), as a set;
    call only once torch is imported."""
    global _cpu_dtypes
    if _cpu_dtypes is None:
        torch = _torch()
        _cpu_dtypes = frozenset(getattr(torch, name) for name in SUPPORTED_DTYPES)
    return _cpu_dtypes


def _all_plain_cpu(tensors):
    """Whether every array given is a plain torch CPU tensor (or Parameter)
    of a supported dtype: the common call, which needs none of the checks of
    :func:`choose`."""
    torch = _torch()
    if torch is None:
        return False
    dtypes = cpu_dtypes()
    plain = (torch.Tensor, torch.nn.Parameter)
    for t in tensors:
        if t is not None and (type(t) not in plain or not t.is_cpu or t.dtype not in dtypes):
            return False
    return True


#: The reason of the choice for plain CPU tensors, automatic.
CPU_TENSORS = "CPU tensors"


def choose(tensors, backend, where, names=None, *, triton=False, op=None, enabled=True):
    """(backend, why) for a call over `tensors`: "cpu" for plain CPU tensors,
    "triton" for cuda/xpu/npu tensors when the op has Triton kernels and
    Triton runs there, "torch" for any other device; `backend` forces one
    ("cpu" refuses non-CPU tensors). `triton`: the op's
    Triton family ("grad", "rmsnorm", "moe"), or False for an op without
    Triton kernels. `enabled`: whether the preset enables `op` (the op's
    name in the vocabulary, "moe.permute"); a disabled op keeps the automatic
    choice off Triton before any Triton check or self-check runs (the
    torch-op backend is the device path's reference). leanstep._registry
    passes both; this module knows nothing of the preset."""
    only_torch_ops = torch_ops_only()
    if backend is None and only_torch_ops is None and _all_plain_cpu(tensors):
        return "cpu", CPU_TENSORS  # what the checks below conclude, without their cost
    if backend is not None and backend not in BACKENDS:
        raise Error(f"{where}: argument 'backend' must be one of {', '.join(BACKENDS)} or None "
                    f"(got {backend!r})")
    if backend in ("cpu", "triton") and only_torch_ops is not None:
        raise Error(f"{where}: backend='{backend}' cannot run under {only_torch_ops}, which "
                    f"{SEES_TORCH_OPS_ONLY} (the kernels' outputs would be missing or "
                    f"wrong); leave backend unset or use backend='torch'")
    check_dtypes(tensors, where, names)
    torch = _torch()
    if torch is None:
        if backend in ("torch", "triton"):
            raise Error(f"{where}: backend='{backend}' needs torch tensors")
        return "cpu", "no torch tensors: the C++ kernels"
    device = device_of([t if isinstance(t, torch.Tensor) else None for t in tensors], where, names)
    on_cpu = device is None or device.type == "cpu"
    if backend == "triton":
        if not triton:
            raise Error(f"{where}: argument 'backend' is 'triton', but this op has no Triton "
                        f"kernels (use 'torch' or None)")
        why = triton_unusable(device if device is not None else torch.device("cpu"))
        if why is not None and on_cpu:
            raise Error(f"{where}: argument 'backend' is 'triton' for CPU tensors, which run only "
                        f"in Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
                        f"imported ({why})")
        if why is not None:
            raise Error(f"{where}: argument 'backend' is 'triton', but Triton cannot run the "
                        f"{device.type} tensors here: {why}")
        return "triton", ("forced, Triton interpreter" if on_cpu else "forced")
    if backend is None:
        if only_torch_ops is not None:
            return "torch", f"{only_torch_ops} {ONLY_TORCH_OPS}"
        if on_cpu:
            return "cpu", "CPU tensors"
        if not triton:
            return "torch", f"{device.type} tensors; the op has no Triton kernels"
        if not triton_automatic():
            return "torch", f"{device.type} tensors; Triton kernels switched off (LEANSTEP_TRITON)"
        if not enabled:
            return "torch", f"{device.type} tensors; the preset switches {op} off"
        why = triton_unusable(device)
        if why is None and isinstance(triton, str):
            why = triton_self_check(triton, device)
        if why is None:
            return "triton", f"{device.type} tensors, Triton driver active, self-check passed"
        return "torch", f"{device.type} tensors; Triton: {why}"
    if backend == "cpu" and not on_cpu:
        raise Error(f"{where}: backend='cpu' needs CPU tensors (got {device}); the device "
                    f"backend is backend='torch'")
    return backend, "forced"


def triton_automatic():
    """Whether cuda/xpu/npu calls pick the Triton kernels by themselves (after
    the first-use self-check): yes unless ``LEANSTEP_TRITON`` is ``off``
    (or ``0``, ``false``, ``no``)."""
    value = os.environ.get("LEANSTEP_TRITON", "").strip().lower()
    if value in ("", "auto", "on", "1", "true", "yes"):
        return True
    if value in ("off", "0", "false", "no"):
        return False
    raise Error(f"LEANSTEP_TRITON must be 'auto' (the default) or 'off' (got {value!r})")


def triton_self_check(family, device):
    """None if `family`'s Triton kernels passed their first-use check on
    `device` (run once per process, family and device), else why not."""
    key = (family, str(device))
    with _lock:
        if key in _self_checks:
            return _self_checks[key]
    from .backends import triton_selfcheck  # here: it imports triton, only when a call needs it

    why = triton_selfcheck.check(family, device)  # outside the lock: it compiles and runs
    with _lock:
        return _self_checks.setdefault(key, why)


def _check_counted_op(op):
    if op not in OPS:  # every counted op is a row of the table (the report is keyed by it)
        raise Error(f"internal: op {op!r} is not in the op table (leanstep.ops())")


def record(op, backend, device_type, reason=None):
    """Counts one routed call; `reason` (why that backend ran) is kept too."""
    _check_counted_op(op)
    with _lock:
        _calls[(op, backend, device_type)] += 1
        if reason is not None:
            _reasons[(op, backend, device_type, reason)] += 1


def tally(op, backend, device_type, reason=None):
    """A counter of calls of `op` on `backend` for `reason`, counted as
    :func:`record` counts them, for a hot path that decided once: each
    ``next(counter)`` counts one call. ``next`` on an ``itertools.count`` is
    one C call, atomic under the GIL, without the lock and the key tuples a
    :func:`record` builds (about 0.8 us a call, measured on a 2-core
    Sapphire Rapids VM; ``next`` about 40 ns). The same key gives the same
    counter."""
    _check_counted_op(op)
    key = (op, backend, device_type, reason)
    with _lock:
        entry = _tallies.get(key)
        if entry is None:
            entry = _tallies[key] = [itertools.count(), 0]
        return entry[0]


def counted(counter):
    """How many times ``next`` has been called on a fresh ``itertools.count()``: it
    shows its next value only in its repr, "count(N)"."""
    return int(repr(counter)[6:-1])


def _tallied():
    """{(op, backend, device type, reason): calls counted since the last reset}."""
    with _lock:
        return {key: counted(counter) - base for key, (counter, base) in _tallies.items()}


def reasons():
    """``{op: {backend: {device_type: {reason: count}}}}`` of the recorded reasons."""
    out = {}
    merged = collections.Counter({k: n for k, n in _tallied().items() if k[3] is not None and n})
    with _lock:
        merged.update(_reasons)
    for (op, backend, device, reason), n in sorted(merged.items()):
        out.setdefault(op, {}).setdefault(backend, {}).setdefault(device, {})[reason] = n
    return out


def calls():
    """``{op: {backend: {device_type: count}}}`` of routed calls so far."""
    out = {}
    merged = collections.Counter()
    for (op, backend, device, _), n in _tallied().items():
        if n:
            merged[(op, backend, device)] += n
    with _lock:
        merged.update(_calls)
    for (op, backend, device), n in sorted(merged.items()):
        out.setdefault(op, {}).setdefault(backend, {})[device] = n
    return out


def reset_calls():
    counts = _tallied()
    with _lock:
        _calls.clear()
        _reasons.clear()
        for key, n in counts.items():  # a tally's zero moves up to its count now
            _tallies[key][1] += n
