"""One preset switch, for C++, the CLI, Python and the Megatron patches
alike (the one report is :func:`leanstep._registry.paths`).

The C++ registry (``leanstep paths``) holds the op vocabulary (grad.norm,
grad.clip, rmsnorm.forward, moe.permute, ...) and, per op, its CPU
implementations (reference, fused); the Python entry points on CPU tensors
call through it, so its preset and counts cover them. The device backends
(``torch``, ``triton``) add their calls per device to the same report. The
preset also switches the Megatron-Core patches: a patch whose op the preset
disables calls Megatron's original; and the device backends (through the
registry): a disabled op runs the torch-op backend, not the Triton kernels.

Presets: ``"all"`` (every fast path), ``"baseline"`` (none: CPU calls run
the reference kernels and the Megatron patches delegate), or a
comma-separated list of op names and groups (``"rmsnorm,grad.clip"``).
"""

import threading

from . import _backend, _leanstep
from ._leanstep import Error

_lock = threading.Lock()
_state = {"preset": "all", "items": None}  # items None: every op enabled


def ops():
    """The op vocabulary, from the C++ op table: ``{name: backends}``, in table
    order, the backends that implement each op (``"cpu"``, the C++ kernels,
    first; then the device backends, ``"torch"``, ``"triton"``). Presets name
    these ops or their groups (the part before the dot)."""
    return dict(_backend.OPS)


def _parse(preset):
    if preset == "all":
        return None
    if preset == "baseline":
        return frozenset()
    return frozenset(item.strip() for item in preset.split(",") if item.strip())


def set_preset(preset):
    """Switches fast paths at run time (between steps), everywhere at once.
    An unknown op or group name raises and changes nothing."""
    if not isinstance(preset, str) or not preset.strip():
        raise Error(f"leanstep.set_preset: argument 'preset' must be 'all', 'baseline' or a "
                    f"comma-separated list of op names / groups (got {preset!r})")
    preset = ",".join(p.strip() for p in preset.split(",") if p.strip())
    # One lock around both halves: two concurrent calls must leave the C++ and
    # the Python preset the same (the last call wins in both).
    with _lock:
        if "dispatch_set_preset" in dir(_leanstep):
            _leanstep.dispatch_set_preset(preset)  # validates the names, or raises
        _state["preset"] = preset
        _state["items"] = _parse(preset)


def preset():
    with _lock:
        return _state["preset"]


def op_enabled(op):
    """Whether the preset enables `op` ("grad.norm", ...): by name or group."""
    items = _state["items"]
    return items is None or op in items or op.split(".", 1)[0] in items


def group_enabled(group):
    """Whether the preset enables the group or any op in it."""
    items = _state["items"]
    return items is None or group in items or any(i.split(".", 1)[0] == group for i in items)
