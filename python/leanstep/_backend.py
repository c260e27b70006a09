"""Which backend runs a call: chosen from the tensors' device, forced only by
``backend=`` (tests and benchmarks).

- ``"cpu"``: the C++ kernels over DLPack views (CPU memory only).
- ``"torch"``: the device backend, written with PyTorch ops, for tensors on
  any torch device (cuda, npu through torch_npu, xpu, mps, and meta for
  tests); it can be forced on CPU tensors so its numerics are tested here.
  It never reads a device value on the host.

Every routed call is counted per (op, backend, device type); :func:`calls`
returns the counts and :func:`reset_calls` clears them.
"""

import collections
import sys
import threading

from ._leanstep import Error

BACKENDS = ("cpu", "torch")

_lock = threading.Lock()
_calls = collections.Counter()


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
    first = first_name = None
    for i, t in enumerate(tensors):
        if t is None:
            continue
        name = names[i] if names else f"tensors[{i}]"
        if first is None:
            first, first_name = t.device, name
            reason = device_usable(first)
            if reason is not None:
                raise Error(f"{where}: argument '{name}' is on device {first}, which cannot run "
                            f"here: {reason}")
        elif t.device != first:
            raise Error(f"{where}: all tensors must be on one device (got '{first_name}' on "
                        f"{first} and '{name}' on {t.device})")
    return first


def choose(tensors, backend, where, names=None):
    """The backend for a call over `tensors`: "cpu" for plain CPU tensors,
    "torch" for any other device; `backend` forces one ("cpu" refuses
    non-CPU tensors)."""
    if backend is not None and backend not in BACKENDS:
        raise Error(f"{where}: argument 'backend' must be one of {', '.join(BACKENDS)} or None "
                    f"(got {backend!r})")
    torch = _torch()
    if torch is None:
        if backend == "torch":
            raise Error(f"{where}: backend='torch' needs torch tensors")
        return "cpu"
    device = device_of([t if isinstance(t, torch.Tensor) else None for t in tensors], where, names)
    on_cpu = device is None or device.type == "cpu"
    if backend is None:
        return "cpu" if on_cpu else "torch"
    if backend == "cpu" and not on_cpu:
        raise Error(f"{where}: backend='cpu' needs CPU tensors (got {device}); the device "
                    f"backend is backend='torch'")
    return backend


def record(op, backend, device_type):
    with _lock:
        _calls[(op, backend, device_type)] += 1


def calls():
    """``{op: {backend: {device_type: count}}}`` of routed calls so far."""
    out = {}
    with _lock:
        items = sorted(_calls.items())
    for (op, backend, device), n in items:
        out.setdefault(op, {}).setdefault(backend, {})[device] = n
    return out


def reset_calls():
    with _lock:
        _calls.clear()
