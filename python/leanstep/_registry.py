"""The op registry: one entry per op of the vocabulary (the C++ op table,
leanstep/ops.h), and the one place where a call's backend is chosen, switched
by the preset, explained and counted.

Each entry names the op's Python entry point and its implementations per
backend: ``cpu`` (the C++ dispatch registry: its fused and reference kernels),
``torch`` (the torch-op backend, any torch device) and ``triton`` (Triton
kernels on cuda, xpu and npu), each with how it works (for
:func:`leanstep.paths`) and, where the kernels take only some calls, a
``supports(op, args) -> reason or None``.

A call goes through :func:`route`:

1. the device backend from the tensors' device, or the forced ``backend=``
   (:func:`leanstep._backend.choose`);
2. on Triton: the preset (an op it switches off runs the torch-op code, the
   device path's reference, also when Triton was forced), ``impl="reference"``
   and the implementation's ``supports``; the reason for each fallback;
3. one count per call, with the reason, in the report.

Entry points (``leanstep.*``, ``leanstep.torch.*``, the Megatron-Core patches)
are thin calls into it. tests/python/test_paths.py holds the registry to the
C++ table: every row has an entry and every entry a row, with the same device
backends.
"""

import collections
import importlib
import json
import sys

from . import _backend, _dispatch, _leanstep
from ._leanstep import Error

Implementation = collections.namedtuple("Implementation", "how module supports",
                                        defaults=(None, None))
Implementation.__doc__ = """How one backend runs an op: `how` (for the report), the module
that holds it (imported on first use) and `supports(op, args)`: None if it
takes the call, else why the torch-op code runs it."""


class Op:
    """One op of the vocabulary: its entry point and implementations."""

    __slots__ = ("name", "entry", "implementations", "family")

    def __init__(self, name, entry, **implementations):
        self.name = name
        self.entry = entry  # the Python entry point ("GradPlan.norm", "moe_permute", ...)
        self.implementations = implementations  # backend -> Implementation
        # The Triton family whose self-check guards the kernels ("grad", "rmsnorm", "moe").
        self.family = name.split(".", 1)[0] if "triton" in implementations else False

    @property
    def backends(self):
        return tuple(self.implementations)


def _triton_grad_supports(op, args):
    """A Triton GradPlan says which calls its kernels take (a norm_type other
    than 1, 2 or inf runs the torch-op code)."""
    plan = args.get("plan")
    return None if plan is None else plan.unsupported(op.removeprefix("grad."),
                                                      args.get("norm_type"))


def _triton_mts_supports(op, args):
    return importlib.import_module("leanstep.backends.triton_grad").mts_route(args["src"],
                                                                              args["dst"])


_CPU = Implementation("the C++ dispatch registry (fused, reference; leanstep paths)")
_TORCH_GRAD = "leanstep.backends.torch_grad"
_TRITON_GRAD = "leanstep.backends.triton_grad"
_TORCH_RMSNORM = "leanstep.backends.torch_rmsnorm"
_TRITON_RMSNORM = "leanstep.backends.triton_rmsnorm"
_TORCH_MOE = "leanstep.backends.torch_moe"
_TRITON_MOE = "leanstep.backends.triton_moe"


def _grad_op(name, entry, torch_how, triton_how):
    return Op(name, entry, cpu=_CPU, torch=Implementation(torch_how, _TORCH_GRAD),
              triton=Implementation(triton_how, _TRITON_GRAD, _triton_grad_supports))


_ENTRIES = [
    _grad_op("grad.norm", "GradPlan.norm",
             "_foreach_norm per region (float64 accumulation) + one reduction",
             "one pass over the chunk table (partials in fixed slots) + a fixed-order finish: "
             "2 launches"),
    _grad_op("grad.unscale_norm", "GradPlan.norm",  # given inv_scale
             "_amp_foreach_non_finite_check_and_unscale_, then the norm",
             "unscale, found_inf and norm in the same single pass: 2 launches"),
    _grad_op("grad.unscale", "GradPlan.unscale_",
             "_amp_foreach_non_finite_check_and_unscale_ (one pass)",
             "one pass, found_inf stored directly: 1 launch"),
    _grad_op("grad.clip", "GradPlan.clip_",
             "coefficient on the device (one fp32 division, clamp), _foreach_mul_",
             "coefficient from the device norm in every program, scale in place: 1 launch"),
    _grad_op("grad.norm_clip", "GradPlan.norm_clip_", "norm, then clip",
             "norm, then clip: 3 launches"),
    _grad_op("grad.scale", "GradPlan.scale_", "_foreach_mul_ with a 0-dim fp32 scalar",
             "1 launch over the chunk table"),
    _grad_op("grad.count_zeros", "GradPlan.count_zeros", "count_nonzero per region, int64 sum",
             "per-chunk counts + a fixed-order finish: 2 launches"),
    Op("grad.multi_tensor_scale", "multi_tensor_scale", cpu=_CPU,
       torch=Implementation("fp32 _foreach_mul, _foreach_copy_ (pairs sharing memory in order)",
                            _TORCH_GRAD),
       triton=Implementation("fp32 math, one cast, every dtype pair in 1 launch", _TRITON_GRAD,
                             _triton_mts_supports)),
    Op("rmsnorm.forward", "rms_norm", cpu=_CPU,
       torch=Implementation("aten._fused_rms_norm where the build has a kernel, else composite",
                            _TORCH_RMSNORM),
       triton=Implementation("one launch, persistent over rows, fp32 rstd", _TRITON_RMSNORM)),
    Op("rmsnorm.backward", "rms_norm_backward", cpu=_CPU,
       torch=Implementation("aten._fused_rms_norm_backward with output_mask [True, False], "
                            "or the composite dx", _TORCH_RMSNORM),
       triton=Implementation("frozen: dx only, 1 launch; trainable: dx + per-chunk dgamma "
                             "partials, then a fixed-order sum: 2 launches", _TRITON_RMSNORM)),
    Op("moe.permute", "moe_permute", cpu=_CPU,
       torch=Implementation("cumsum index arithmetic (fused) or stable FP32-key sort (sort)",
                            _TORCH_MOE),
       triton=Implementation("per-expert rank scan, scatter of the slots, row gather: "
                             "3 launches", _TRITON_MOE)),
    Op("moe.unpermute", "moe_unpermute", cpu=_CPU,
       torch=Implementation("fp32 index_add_ in slot order, one cast", _TORCH_MOE),
       triton=Implementation("stable slot order per token (torch sort), fp32 sums in slot "
                             "order: 1 Triton launch", _TRITON_MOE)),
    Op("moe.permute_backward", "moe_permute_backward", cpu=_CPU,
       torch=Implementation("fp32 index_add_ in slot order", _TORCH_MOE),
       triton=Implementation("the unpermute kernel without probs", _TRITON_MOE)),
    Op("moe.unpermute_backward", "moe_unpermute_backward", cpu=_CPU,
       torch=Implementation("gather and per-slot dot products", _TORCH_MOE)),
    Op("moe.permute_probs_backward", "moe_permute_probs_backward", cpu=_CPU,
       torch=Implementation("scatter of the probs gradient", _TORCH_MOE)),
    Op("moe.pad_routing_map", "pad_routing_map", cpu=_CPU,
       torch=Implementation("per-expert ranks from cumsums", _TORCH_MOE)),
    Op("moe.sort_chunks_by_idxs", "sort_chunks_by_idxs", cpu=_CPU,
       torch=Implementation("source rows by index arithmetic on the split sizes", _TORCH_MOE)),
    Op("moe.route", "moe_route", cpu=_CPU),
]

#: op name -> :class:`Op`, in the C++ table's order where the build has the op.
REGISTRY = {op.name: op for op in _ENTRIES}


Route = collections.namedtuple("Route", "backend reason device_type module")
Route.__doc__ = """What runs one call: the backend, why, the device type counted, and the
backend's module (None for the C++ kernels)."""


def entry(op):
    try:
        return REGISTRY[op]
    except KeyError:
        raise Error(f"internal: op {op!r} has no registry entry") from None


def choose(op, tensors, names, backend, where, *, args=None, reference=False):
    """(backend, reason) for one call of `op`, not counted: the device choice
    (or the forced one), then on Triton the preset, `reference` (the caller's
    ``impl="reference"``) and the kernels' ``supports``. `op` may be a family
    ("grad"): the choice of a plan that serves several of its ops (a GradPlan,
    built once for many calls), the device choice alone; each call is then
    settled by :func:`settle` and counted by :func:`record`."""
    if "." not in op:
        return _backend.choose(tensors, backend, where, names, triton=op)
    spec = entry(op)
    enabled = _dispatch.op_enabled(op)
    chosen, why = _backend.choose(tensors, backend, where, names, triton=spec.family, op=op,
                                  enabled=enabled)
    if chosen not in spec.implementations and why.endswith(_backend.ONLY_TORCH_OPS):
        raise Error(f"{where}: {op} has only the C++ kernels, which "
                    f"{why[:-len(_backend.ONLY_TORCH_OPS)].strip()} cannot see; call it outside")
    return settle(op, chosen, why, enabled=enabled, args=args, reference=reference)


def settle(op, chosen, why, *, enabled=None, args=None, reference=False):
    """A choice for one call of `op` made earlier (a GradPlan's, when it was
    built), settled for this call: a Triton choice runs the torch-op code when
    the preset switches the op off, for ``impl="reference"`` and when the
    kernels do not take the call; each with its reason."""
    if chosen != "triton":
        return chosen, why
    if reference:
        return "torch", f"{why}; impl='reference': the torch-op code"
    if not (_dispatch.op_enabled(op) if enabled is None else enabled):
        return "torch", f"{why}; the preset switches {op} off"
    supports = entry(op).implementations["triton"].supports
    if supports is not None:
        unsupported = supports(op, args or {})
        if unsupported is not None:
            return "torch", f"{why}; {unsupported}"
    return "triton", why


def module(op, backend):
    """The module of `op`'s `backend` implementation (None for "cpu")."""
    spec = entry(op)
    impl = spec.implementations.get(backend)
    if impl is None:
        raise Error(f"internal: op {op} has no {backend} implementation")
    return None if impl.module is None else importlib.import_module(impl.module)


def _device_type(tensors, chosen, where, names):
    if chosen == "cpu":
        return "cpu"
    torch = sys.modules.get("torch")
    for i, t in enumerate(tensors):
        if t is not None and (torch is None or not isinstance(t, torch.Tensor)):
            name = names[i] if names else f"tensors[{i}]"
            raise Error(f"{where}: backend='{chosen}' needs torch tensors (argument '{name}' is "
                        f"{type(t).__name__})")
    return next((t.device.type for t in tensors if t is not None), "cpu")


def route(op, tensors, names, backend, where, *, args=None, reference=False):
    """:func:`choose`, then the call counted with its reason: a :data:`Route`."""
    chosen, why = choose(op, tensors, names, backend, where, args=args, reference=reference)
    device_type = _device_type(tensors, chosen, where, names)
    _backend.record(op, chosen, device_type, why)
    return Route(chosen, why, device_type, module(op, chosen))


def record(op, chosen, device_type, why):
    """Counts a call whose backend was settled outside :func:`route` (a GradPlan's)."""
    _backend.record(op, chosen, device_type, why)


def without_triton(op, backend):
    """`backend` for a call of `op` (a backward) whose forward was forced to
    Triton: the torch-op backend (the same numerics) if `op` has no kernels."""
    if backend == "triton" and "triton" not in entry(op).implementations:
        return "torch"
    return backend


# ---------------------------------------------------------------- the report


def paths():
    """``{"preset", "ops": {op: {"fast_paths_enabled", "entry", "cpu": {...C++ report...},
    "implementations": {backend: how}, "calls": {backend: {device_type: n}},
    "reasons": {backend: {device_type: {why: n}}}, "megatron": {patch: {...}}}}}``:
    every op of the vocabulary with its Python entry point, its CPU
    implementations (installed, active, guards, calls and reasons), the device
    backends' implementations, the calls each backend ran per device and why,
    and the Megatron-Core patches' calls (run by leanstep per backend:device,
    or delegated with the reason) when leanstep.megatron is in use."""
    enabled = _dispatch.op_enabled
    report = {"preset": _dispatch.preset(), "ops": {}}
    if "dispatch_paths_json" in dir(_leanstep):
        cpp = json.loads(_leanstep.dispatch_paths_json())
        for op in cpp["ops"]:
            name = op.pop("op")
            report["ops"][name] = {"fast_paths_enabled": enabled(name), "cpu": op}
    for name, spec in REGISTRY.items():
        if name not in _backend.OPS:
            continue  # an area this build leaves out
        op = report["ops"].setdefault(name, {"fast_paths_enabled": enabled(name)})
        op["entry"] = spec.entry
        devices = {b: impl.how for b, impl in spec.implementations.items() if b != "cpu"}
        if devices:
            op["implementations"] = devices
    for name, backends in _backend.calls().items():
        op = report["ops"].setdefault(name, {"fast_paths_enabled": enabled(name)})
        for backend, devices in backends.items():
            op.setdefault("calls", {})[backend] = dict(devices)
    for name, backends in _backend.reasons().items():
        op = report["ops"].setdefault(name, {"fast_paths_enabled": enabled(name)})
        op["reasons"] = backends
    for name, patches in _megatron_calls().items():
        op = report["ops"].setdefault(name, {"fast_paths_enabled": enabled(name)})
        op["megatron"] = patches
    return report


def _megatron_calls():
    """``{op: {patch: {"leanstep": {backend:device: n}, "delegated": {reason: n}}}}``
    of the Megatron-Core patches that ran, when leanstep.megatron is in use
    (read from sys.modules: this module never imports it)."""
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
    if "dispatch_reset_stats" in dir(_leanstep):
        _leanstep.dispatch_reset_stats()
    _backend.reset_calls()
    patching = sys.modules.get("leanstep.megatron._patching")
    if patching is not None:
        patching.reset_call_counts()
