"""The patch machinery: signature checks, every alias, idempotent install,
exact restore, a runtime switch per family, and one report.

A patch (:class:`Spec`) names a function of a Megatron-Core module (or a
method of a class there) and the signatures it supports, each a
:class:`Variant` with its own replacement factory, so one patch reproduces
each supported version's semantics. A target whose signature matches no
variant is skipped with the reason; a module is never half-patched.
"""

import collections
import importlib
import inspect
import sys
import threading

from .. import _dispatch, _leanstep
from .._leanstep import Error

EMPTY = inspect.Parameter.empty
_POS = inspect.Parameter.POSITIONAL_OR_KEYWORD

FAMILIES = ("grad", "moe", "rmsnorm")


class Variant:
    """One supported signature: [(name, default or EMPTY)] (all
    positional-or-keyword) and ``factory(original, spec) -> replacement``."""

    def __init__(self, label, params, factory):
        self.label = label
        self.params = params
        self.factory = factory

    def text(self):
        return "(" + ", ".join(n if d is EMPTY else f"{n}={d!r}" for n, d in self.params) + ")"


class Spec:
    """One patch: function `attr` of module `home` (or, with `class_attr`, a
    method of that class), the variants it supports, the modules known to
    import it by name, and its op in the vocabulary (the preset switches it)."""

    def __init__(self, name, op, home, attr, variants, alias_modules=(), class_attr=None,
                 requires_area=None, host_read=None):
        self.name = name
        self.op = op  # its name in the op vocabulary: the preset switches it
        self.home = home
        self.attr = attr
        self.variants = variants
        self.alias_modules = alias_modules
        self.class_attr = class_attr
        self.requires_area = requires_area
        self.host_read = host_read  # what host read the installed API itself needs, if any


def match_variant(func, spec):
    """(variant, None) for the variant whose parameters are exactly func's,
    else (None, why not)."""
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError) as e:
        return None, f"cannot read the signature ({e})"
    found = [(p.name, p.kind, p.default) for p in sig.parameters.values()]
    for variant in spec.variants:
        if found == [(n, _POS, d) for n, d in variant.params]:
            return variant, None
    shown = "(" + ", ".join(
        (n if d is EMPTY else f"{n}={d!r}") + ("" if k == _POS else f" [{k.description}]")
        for n, k, d in found) + ")"
    expected = " or ".join(f"{v.label} {v.text()}" for v in spec.variants)
    return None, f"signature mismatch: expected {expected}, found {shown}"


# ---------------------------------------------------------------- call statistics and switch

_lock = threading.RLock()
_calls = collections.defaultdict(lambda: {"leanstep": collections.Counter(),
                                          "delegated": collections.Counter()})


def count(name, device_type=None, backend=None, reason=None):
    """One call of patch `name`: run by leanstep (on `backend`, tensors on
    `device_type`) or delegated to the original for `reason`."""
    with _lock:
        entry = _calls[name]
        if reason is None:
            entry["leanstep"][f"{backend}:{device_type}"] += 1
        else:
            entry["delegated"][reason] += 1


def call_counts():
    """``{patch: {"leanstep": n, "paths": {"backend:device": n}, "delegated": {reason: n}}}``."""
    with _lock:
        return {n: {"leanstep": sum(c["leanstep"].values()), "paths": dict(c["leanstep"]),
                    "delegated": dict(c["delegated"])}
                for n, c in _calls.items()}


def is_active(spec):
    """Whether the preset enables this patch's op (else the original runs)."""
    return _dispatch.op_enabled(spec.op)


def set_active(families):
    """Switches patch families on or off at run time, without reinstalling:
    ``set_active(["grad"])`` runs leanstep for the gradient functions only;
    an inactive patch calls the original (counted as delegated, reason
    "switched_off"). ``None`` or ``"all"``: every family; ``[]`` or
    ``"baseline"``: none. This IS the process-wide preset
    (:func:`leanstep.set_preset`), which also switches the CPU kernels."""
    if families is None or families == "all":
        _dispatch.set_preset("all")
        return
    if families == "baseline":
        _dispatch.set_preset("baseline")
        return
    if isinstance(families, str):
        families = [families]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise Error(f"leanstep.megatron.set_active: argument 'families' must name "
                    f"{', '.join(FAMILIES)} (got unknown {', '.join(unknown)})")
    _dispatch.set_preset(",".join(sorted(set(families))) or "baseline")


def active():
    """The families whose ops the preset enables (all of them or some)."""
    return [f for f in FAMILIES if _dispatch.group_enabled(f)]


# ---------------------------------------------------------------- install / uninstall


class _Installed:
    def __init__(self, spec, variant, original, replacement, targets):
        self.spec = spec
        self.variant = variant
        self.original = original
        self.replacement = replacement
        self.targets = targets  # [(owner, attr, stored original, label)]


_installed = {}
_skipped = {}
_notes = collections.defaultdict(list)  # events: reloads, third-party patches
_alias_notes = {}


def _note(name, text):
    if text not in _notes[name]:
        _notes[name].append(text)


def _import(name):
    try:
        return importlib.import_module(name), None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
        return None, f"{type(e).__name__}: {e}"


def _find_aliases(original, attr, home_module):
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


def _stored(owner, attr):
    return owner.__dict__.get(attr) if isinstance(owner, type) else vars(owner).get(attr)


def _prepare(spec):
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
        variant, mismatch = match_variant(original, spec)
        if mismatch:
            return None, mismatch
        return (variant, original, [(owner, spec.attr, stored,
                                     f"{spec.home}.{spec.class_attr}.{spec.attr}")]), None
    original = getattr(home, spec.attr, None)
    if original is None:
        return None, f"{spec.home} has no {spec.attr}"
    if getattr(original, "__leanstep_original__", None) is not None:
        return None, "already patched by another copy of leanstep"
    variant, mismatch = match_variant(original, spec)
    if mismatch:
        return None, mismatch
    alias_notes = []
    for alias_module in spec.alias_modules:
        mod, err = _import(alias_module)
        if mod is None and not err.startswith("ModuleNotFoundError"):
            # A module of this version that failed to import (a module that
            # does not exist in this version is no news).
            alias_notes.append(f"{alias_module} not importable ({err})")
    _alias_notes[spec.name] = alias_notes
    targets = [(home, spec.attr, original, f"{spec.home}.{spec.attr}")]
    for mod, mod_name in _find_aliases(original, spec.attr, home):
        targets.append((mod, spec.attr, original, f"{mod_name}.{spec.attr}"))
    return (variant, original, targets), None


def _set(owner, attr, value):
    if isinstance(owner, type):
        setattr(owner, attr, value)
    else:
        owner.__dict__[attr] = value


def _still_ours(done):
    """Whether the home target still holds our replacement (a reload of the
    module puts the original back behind our back)."""
    owner, attr, _, _ = done.targets[0]
    if not done.spec.class_attr:
        home = sys.modules.get(done.spec.home)
        if home is None or home is not owner:
            return False
    return _stored(owner, attr) is done.replacement


def _apply(spec, patches_table):
    prepared, reason = _prepare(spec)
    if prepared is None:
        _skipped[spec.name] = reason
        return
    variant, original, targets = prepared
    replacement = variant.factory(original, spec)
    replacement.__leanstep_original__ = original
    stored_replacement = staticmethod(replacement) if spec.class_attr and isinstance(
        targets[0][2], staticmethod) else replacement
    applied = []
    try:
        for owner, attr, stored, label in targets:
            _set(owner, attr, stored_replacement)
            applied.append((owner, attr, stored, label))
    except Exception as e:  # noqa: BLE001 - roll back: never half-patched
        for owner, attr, stored, _ in applied:
            _set(owner, attr, stored)
        _skipped[spec.name] = f"could not set {attr} ({e}); rolled back"
        return
    _skipped.pop(spec.name, None)
    _installed[spec.name] = _Installed(spec, variant, original, stored_replacement, applied)


def check_names(names, patches_table, where):
    known = [s.name for s in patches_table]
    if names is None:
        return None
    if isinstance(names, str):
        names = [names]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise Error(f"leanstep.megatron.{where}: argument 'patches' names unknown patches "
                    f"{', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    return list(names)


def install(patches_table, patches=None):
    names = check_names(patches, patches_table, "install")
    with _lock:
        for spec in patches_table:
            if names is not None and spec.name not in names:
                continue
            done = _installed.get(spec.name)
            if done is not None:
                if _still_ours(done):
                    _patch_new_aliases(done)
                    continue
                # The home module was reloaded (or the target replaced): the
                # recorded state is stale; patch what is there now.
                _installed.pop(spec.name)
                _note(spec.name, "re-applied: the target no longer held the replacement "
                                 "(module reloaded or replaced)")
            _apply(spec, patches_table)


def _patch_new_aliases(done):
    if done.spec.class_attr:
        return
    home = sys.modules.get(done.spec.home)
    known = {id(owner) for owner, *_ in done.targets}
    for mod, mod_name in _find_aliases(done.original, done.spec.attr, home):
        if id(mod) not in known:
            _set(mod, done.spec.attr, done.replacement)
            done.targets.append((mod, done.spec.attr, done.original, f"{mod_name}.{done.spec.attr}"))


def uninstall(patches_table, patches=None):
    names = check_names(patches, patches_table, "uninstall")
    with _lock:
        for name in list(_installed):
            if names is not None and name not in names:
                continue
            done = _installed.pop(name)
            for owner, attr, stored, label in done.targets:
                current = _stored(owner, attr)
                if current is done.replacement:
                    _set(owner, attr, stored)
                else:
                    # Someone patched over us after install: theirs stays.
                    _note(name, f"left {label} as is: replaced by another patch after install")
        for name in list(_skipped):
            if names is None or name in names:
                _skipped.pop(name)


def installed():
    with _lock:
        return sorted(_installed)


def installed_variant(name):
    with _lock:
        done = _installed.get(name)
        return None if done is None else done.variant.label


def report(patches_table):
    try:
        import megatron.core as mcore

        version = getattr(mcore, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        version = None
    with _lock:
        return {
            "megatron_core_version": version,
            "preset": _dispatch.preset(),
            "active_families": active(),
            "installed": {n: [label for *_, label in d.targets] for n, d in _installed.items()},
            "variants": {n: d.variant.label for n, d in _installed.items()},
            "skipped": dict(_skipped),
            "notes": {n: list(_alias_notes.get(n, [])) + list(_notes.get(n, []))
                      for n in set(_notes) | set(_alias_notes)
                      if _alias_notes.get(n) or _notes.get(n)},
            "host_reads": {s.name: s.host_read for s in patches_table
                           if s.host_read and s.name in _installed},
            "calls": call_counts(),
        }


def format_report(patches_table):
    r = report(patches_table)
    lines = [f"leanstep.megatron on megatron-core {r['megatron_core_version']} "
             f"(preset {r['preset']})"]
    for spec in patches_table:
        name = spec.name
        if name in r["installed"]:
            targets = r["installed"][name]
            lines.append(f"  installed {name} [{r['variants'][name]}]: {len(targets)} target(s)")
            lines += [f"      {t}" for t in targets]
        elif name in r["skipped"]:
            lines.append(f"  skipped   {name}: {r['skipped'][name]}")
        else:
            lines.append(f"  not installed {name}")
        for note in r["notes"].get(name, []):
            lines.append(f"      note: {note}")
        if name in r["host_reads"]:
            lines.append(f"      host read kept: {r['host_reads'][name]}")
        calls = r["calls"].get(name)
        if calls:
            ran = ", ".join(f"{k} {v}" for k, v in sorted(calls["paths"].items()))
            delegated = ", ".join(f"{k} {v}" for k, v in sorted(calls["delegated"].items()))
            lines.append(f"      calls: leanstep {ran or 0}"
                         + (f"; delegated: {delegated}" if delegated else ""))
    return "\n".join(lines)


def reset_call_counts():
    with _lock:
        _calls.clear()
