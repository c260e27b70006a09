"""One preset switch and one report, for C++, the CLI, Python and the
Megatron patches alike.

The C++ registry (``leanstep paths``) holds the op vocabulary (grad.norm,
grad.clip, rmsnorm.forward, moe.permute, ...) and, per op, its CPU
implementations (reference, fused); the Python entry points on CPU tensors
call through it, so its preset and counts cover them. The device backends
(``torch``) add their calls per device to the same report. The preset also
switches the Megatron-Core patches: a patch whose op the preset disables
calls Megatron's original; and the device backends' automatic choice: a
disabled op runs the torch-op backend, not the Triton kernels.

Presets: ``"all"`` (every fast path), ``"baseline"`` (none: CPU calls run
the reference kernels and the Megatron patches delegate), or a
comma-separated list of op names and groups (``"rmsnorm,grad.clip"``).
"""

import json
import threading

from . import _backend, _leanstep
from ._leanstep import Error

_lock = threading.Lock()
_state = {"preset": "all", "items": None}  # items None: every op enabled


#: The Python entry point of every op of the vocabulary (a GradPlan method, or a
#: function of the package); tests/python/test_paths.py holds it to the table.
ENTRY_POINTS = {
    "grad.norm": "GradPlan.norm",
    "grad.unscale_norm": "GradPlan.norm",  # given inv_scale
    "grad.unscale": "GradPlan.unscale_",
    "grad.clip": "GradPlan.clip_",
    "grad.norm_clip": "GradPlan.norm_clip_",
    "grad.scale": "GradPlan.scale_",
    "grad.count_zeros": "GradPlan.count_zeros",
    "grad.multi_tensor_scale": "multi_tensor_scale",
    "rmsnorm.forward": "rms_norm",
    "rmsnorm.backward": "rms_norm_backward",
    "moe.permute": "moe_permute",
    "moe.unpermute": "moe_unpermute",
    "moe.permute_backward": "moe_permute_backward",
    "moe.unpermute_backward": "moe_unpermute_backward",
    "moe.permute_probs_backward": "moe_permute_probs_backward",
    "moe.pad_routing_map": "pad_routing_map",
    "moe.sort_chunks_by_idxs": "sort_chunks_by_idxs",
    "moe.route": "moe_route",
}


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
    if "dispatch_set_preset" in dir(_leanstep):
        _leanstep.dispatch_set_preset(preset)  # validates the names, or raises
    with _lock:
        _state["preset"] = preset
        _state["items"] = _parse(preset)


def preset():
    with _lock:
        return _state["preset"]


def op_enabled(op):
    """Whether the preset enables `op` ("grad.norm", ...): by name or group."""
    items = _state["items"]
    return items is None or op in items or op.split(".", 1)[0] in items


_backend.set_preset_filter(op_enabled)  # the device backends' automatic choice follows the preset


def group_enabled(group):
    """Whether the preset enables the group or any op in it."""
    items = _state["items"]
    return items is None or group in items or any(i.split(".", 1)[0] == group for i in items)


def paths():
    """``{"preset", "ops": {op: {"fast_paths_enabled", "cpu": {...C++ report...},
    "implementations": {backend: how}, "calls": {backend: {device_type: n}},
    "reasons": {backend: {device_type: {why: n}}}, "megatron": {patch: {...}}}}}``:
    every op of the vocabulary with its CPU implementations (installed,
    active, guards, calls and reasons), the device backends' implementations,
    the calls each backend ran per device and why, and the Megatron-Core
    patches' calls (run by leanstep per backend:device, or delegated with the
    reason) when leanstep.megatron is in use."""
    report = {"preset": preset(), "ops": {}}
    if "dispatch_paths_json" in dir(_leanstep):
        cpp = json.loads(_leanstep.dispatch_paths_json())
        for op in cpp["ops"]:
            name = op.pop("op")
            report["ops"][name] = {"fast_paths_enabled": op_enabled(name), "cpu": op}
    from .backends import IMPLEMENTATIONS

    for backend, ops in IMPLEMENTATIONS.items():
        for name, how in ops.items():
            entry = report["ops"].setdefault(name, {"fast_paths_enabled": op_enabled(name)})
            entry.setdefault("implementations", {})[backend] = how
    for name, backends in _backend.calls().items():
        entry = report["ops"].setdefault(name, {"fast_paths_enabled": op_enabled(name)})
        for backend, devices in backends.items():
            entry.setdefault("calls", {})[backend] = dict(devices)
    for name, backends in _backend.reasons().items():
        entry = report["ops"].setdefault(name, {"fast_paths_enabled": op_enabled(name)})
        entry["reasons"] = backends
    for op, patches in _megatron_calls().items():
        entry = report["ops"].setdefault(op, {"fast_paths_enabled": op_enabled(op)})
        entry["megatron"] = patches
    return report


def _megatron_calls():
    """``{op: {patch: {"leanstep": {backend:device: n}, "delegated": {reason: n}}}}``
    of the Megatron-Core patches that ran, when leanstep.megatron is in use
    (never imported from here)."""
    import sys

    package = sys.modules.get("leanstep.megatron")
    if package is None:
        return {}
    ops = {spec.name: spec.op for spec in package.PATCHES}
    out = {}
    for name, calls in package._patching.call_counts().items():
        out.setdefault(ops.get(name, name), {})[name] = {"leanstep": dict(calls["paths"]),
                                                       "delegated": dict(calls["delegated"])}
    return out


def format_paths():
    """:func:`paths` as readable lines."""
    r = paths()
    lines = [f"preset: {r['preset']}"]
    for name in sorted(r["ops"]):
        op = r["ops"][name]
        state = "enabled" if op["fast_paths_enabled"] else "disabled (reference / original)"
        lines.append(f"{name}: fast paths {state}")
        cpu = op.get("cpu")
        if cpu:
            impls = ", ".join(i["name"] + ("" if i["active"] else " (inactive)")
                              for i in cpu["implementations"])
            lines.append(f"  cpu: {impls}; reference {cpu['reference']}")
            for stat in cpu["stats"]:
                if stat["calls"]:
                    lines.append(f"    {stat['impl']}: {stat['calls']} calls")
        for backend, how in sorted(op.get("implementations", {}).items()):
            lines.append(f"  {backend}: {how}")
        for backend, devices in sorted(op.get("calls", {}).items()):
            shown = ", ".join(f"{d} {n}" for d, n in sorted(devices.items()))
            lines.append(f"  routed to {backend}: {shown}")
        for backend, devices in sorted(op.get("reasons", {}).items()):
            for device, whys in sorted(devices.items()):
                for why, n in sorted(whys.items()):
                    lines.append(f"    {backend} on {device}, {n}x: {why}")
        for patch, calls in sorted(op.get("megatron", {}).items()):
            ran = ", ".join(f"{k} {v}" for k, v in sorted(calls["leanstep"].items())) or "0"
            delegated = ", ".join(f"{k} {v}" for k, v in sorted(calls["delegated"].items()))
            lines.append(f"  megatron patch {patch}: leanstep {ran}"
                         + (f"; delegated: {delegated}" if delegated else ""))
    return "\n".join(lines)


def reset_paths():
    """Clears every call count (C++ registry, device backends, Megatron patches)."""
    import sys

    if "dispatch_reset_stats" in dir(_leanstep):
        _leanstep.dispatch_reset_stats()
    _backend.reset_calls()
    patching = sys.modules.get("leanstep.megatron._patching")
    if patching is not None:
        patching.reset_call_counts()
