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
import importlib.metadata
import inspect
import itertools
import os
import sys
import threading

from .. import _backend, _dispatch, _leanstep
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
    import it by name, and its op in the vocabulary (the preset switches it).
    ``requires``: the name of a patch installed before it that it cannot work
    without (it is skipped, with the reason, when that one is not installed)."""

    def __init__(self, name, op, home, attr, variants, alias_modules=(), class_attr=None,
                 requires_area=None, host_read=None, requires=None):
        self.name = name
        self.op = op  # its name in the op vocabulary: the preset switches it
        self.home = home
        self.attr = attr
        self.variants = variants
        self.alias_modules = alias_modules
        self.class_attr = class_attr
        self.requires_area = requires_area
        self.host_read = host_read  # what host read the installed API itself needs, if any
        self.requires = requires


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
#: {(patch, device type, backend, reason): itertools.count}: each call counted by
#: one ``next``, lock-free (atomic under the GIL, as leanstep._backend.tally). Right
#: after Megatron's own clip over 3168 fresh views, the lock, the nested Counters and
#: the formatted key cost about 30 us a call (one thread, median of 200): the patched
#: functions count every call.
_counters = {}


def count(name, device_type=None, backend=None, reason=None):
    """One call of patch `name`: run by leanstep (on `backend`, tensors on
    `device_type`) or delegated to the original for `reason`."""
    key = (name, device_type, backend, reason)
    counter = _counters.get(key)
    if counter is None:
        with _lock:
            counter = _counters.setdefault(key, itertools.count())
    next(counter)


def call_counts():
    """``{patch: {"leanstep": n, "paths": {"backend:device": n}, "delegated": {reason: n}}}``."""
    with _lock:
        counted = [(key, _backend.counted(counter)) for key, counter in _counters.items()]
    out = {}
    for (name, device_type, backend, reason), n in counted:
        if not n:
            continue
        entry = out.setdefault(name, {"leanstep": 0, "paths": {}, "delegated": {}})
        if reason is None:
            path = f"{backend}:{device_type}"
            entry["paths"][path] = entry["paths"].get(path, 0) + n
            entry["leanstep"] += n
        else:
            entry["delegated"][reason] = entry["delegated"].get(reason, 0) + n
    return out


def is_active(spec):
    """Whether the preset enables this patch's op (else the original runs)."""
    return _dispatch.op_enabled(spec.op)


def active():
    """The families whose ops the preset enables (all of them or some). The
    switch is the process-wide preset: ``leanstep.set_preset("grad,moe")``."""
    return [f for f in FAMILIES if _dispatch.group_enabled(f)]


# ---------------------------------------------------------------- install / uninstall


class _Target:
    """One place a patch set its replacement: `owner.attr` held `stored`
    (restored on uninstall) and was set to `replacement`; `owner` is module
    `module_name` or its class `class_attr`."""

    def __init__(self, owner, attr, stored, replacement, module_name, class_attr=None):
        self.owner = owner
        self.attr = attr
        self.stored = stored
        self.replacement = replacement
        self.module_name = module_name
        self.class_attr = class_attr

    @property
    def label(self):
        where = ".".join(filter(None, (self.module_name, self.class_attr, self.attr)))
        current = sys.modules.get(self.module_name)
        if self.class_attr:
            current = getattr(current, self.class_attr, None)
        # A reload binds the name to a new object; this one lives on (in
        # references taken before, subclasses defined elsewhere).
        return where if current is self.owner else where + " (superseded by a reload)"

    def live(self):
        """Whether it still holds the replacement: the report and uninstall go
        by what is there, not by what was set."""
        return _stored(self.owner, self.attr) is self.replacement


class _Installed:
    def __init__(self, spec, variant, original, replacement, targets, home=None):
        self.spec = spec
        self.variant = variant
        self.original = original
        self.replacement = replacement
        self.targets = targets  # [_Target]: the home first, then the aliases
        self.home = home  # the home target; None when the last re-apply failed


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


def _find_aliases(values, attr, exclude=()):
    """[(module, name, value)] for each loaded module (but those in `exclude`)
    whose `attr` is one of `values` (compared by identity)."""
    wanted = {id(v) for v in values}
    skip = {id(m) for m in exclude}
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or id(mod) in skip:
            continue
        try:  # sys.modules may hold odd objects (lazy loaders, proxies)
            namespace = vars(mod)
            value = namespace.get(attr) if isinstance(namespace, dict) else None
        except Exception:  # noqa: BLE001
            continue
        if value is not None and id(value) in wanted:
            found.append((mod, mod_name, value))
    found.sort(key=lambda item: item[1])
    return found


def _stored(owner, attr):
    return owner.__dict__.get(attr) if isinstance(owner, type) else vars(owner).get(attr)


def _home_owner(spec):
    """The object the home target lives on now: the module in sys.modules, or
    its class (a reload of the module makes a new class object)."""
    home = sys.modules.get(spec.home)
    if home is None or not spec.class_attr:
        return home
    return getattr(home, spec.class_attr, None)


def _prepare(spec):
    if spec.requires_area and spec.requires_area not in _leanstep.areas:
        return None, f"leanstep was built without the '{spec.requires_area}' area"
    if spec.requires:
        needed = _installed.get(spec.requires)
        if needed is None or not _still_ours(needed):
            why = _skipped.get(spec.requires)
            return None, f"needs patch {spec.requires}, which is not installed" + (
                f" ({why})" if why else "")
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
        return (variant, original, [(owner, stored, spec.home)]), None
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
    targets = [(home, original, spec.home)]
    for mod, mod_name, _ in _find_aliases([original], spec.attr, exclude=[home]):
        targets.append((mod, original, mod_name))
    return (variant, original, targets), None


def _set(owner, attr, value):
    if isinstance(owner, type):
        setattr(owner, attr, value)
    else:
        owner.__dict__[attr] = value


def _still_ours(done):
    """Whether the home target is still the live home and holds our
    replacement (a reload of the module puts the original back behind our
    back, or makes a new class)."""
    return (done.home is not None and _home_owner(done.spec) is done.home.owner
            and done.home.live())


def _carry_over(done):
    """The targets of a stale record that still hold their replacement (the
    aliases of a reloaded home, the class from before a reload that
    subclasses elsewhere still derive from): they stay patched and are
    restored by uninstall, not forgotten."""
    return [target for target in done.targets if target.live()]


def _apply(spec, carried=()):
    prepared, reason = _prepare(spec)
    if prepared is None:
        _skipped[spec.name] = reason
        return None
    variant, original, places = prepared
    replacement = variant.factory(original, spec)
    replacement.__leanstep_original__ = original
    stored_replacement = staticmethod(replacement) if spec.class_attr and isinstance(
        places[0][1], staticmethod) else replacement
    applied = []
    try:
        for owner, stored, module_name in places:
            _set(owner, spec.attr, stored_replacement)
            applied.append(_Target(owner, spec.attr, stored, stored_replacement, module_name,
                                   spec.class_attr))
    except Exception as e:  # noqa: BLE001 - roll back: never half-patched
        for target in applied:
            _set(target.owner, target.attr, target.stored)
        _skipped[spec.name] = f"could not set {spec.attr} ({e}); rolled back"
        return None
    _skipped.pop(spec.name, None)
    done = _Installed(spec, variant, original, stored_replacement, applied + list(carried),
                      home=applied[0])
    _installed[spec.name] = done
    return done


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
            if done is not None and _still_ours(done):
                _patch_new_aliases(done)
                continue
            carried = []
            if done is not None:
                # The home module was reloaded (or the target replaced): patch
                # what is there now, keeping the places still patched.
                carried = _carry_over(done)
                _note(spec.name, "re-applied: the target no longer held the replacement "
                                 "(module reloaded or replaced)")
            new = _apply(spec, carried)
            if new is None and carried:
                # Refused this time: the places still patched stay on record
                # so that the report lists them and uninstall restores them.
                _installed[spec.name] = _Installed(spec, done.variant, done.original,
                                                   done.replacement, carried)
            elif new is None:
                _installed.pop(spec.name, None)
            else:
                _patch_new_aliases(new)


def _patch_new_aliases(done):
    """Modules loaded since install that imported the original by name get
    the replacement."""
    if done.spec.class_attr:
        return
    attr = done.spec.attr
    for mod, mod_name, _ in _find_aliases([done.original], attr,
                                          exclude=[t.owner for t in done.targets]):
        _set(mod, attr, done.replacement)
        done.targets.append(_Target(mod, attr, done.original, done.replacement, mod_name))
    _adopt_new_holders(done)


def _adopt_new_holders(done):
    """Modules that imported a replacement of ours by name after install are
    aliases too: on record as they are, restored to that replacement's
    original by uninstall."""
    if done.spec.class_attr:
        return
    attr = done.spec.attr
    ours = {id(t.replacement): t.replacement for t in done.targets}
    ours[id(done.replacement)] = done.replacement
    for mod, mod_name, value in _find_aliases(list(ours.values()), attr,
                                              exclude=[t.owner for t in done.targets]):
        done.targets.append(_Target(mod, attr, value.__leanstep_original__, value, mod_name))


def uninstall(patches_table, patches=None):
    names = check_names(patches, patches_table, "uninstall")
    with _lock:
        for name in list(_installed):
            if names is not None and name not in names:
                continue
            done = _installed.pop(name)
            _adopt_new_holders(done)  # no module may keep a wrapper of ours
            for target in done.targets:
                if target.live():
                    _set(target.owner, target.attr, target.stored)
                else:
                    # Someone patched over us after install (theirs stays), or
                    # a reload put an original back.
                    _note(name, f"left {target.label} as is: it no longer held the "
                                "replacement (replaced by another patch, or reloaded)")
        for name in list(_skipped):
            if names is None or name in names:
                _skipped.pop(name)


def _live_targets():
    return {n: [t.label for t in d.targets if t.live()] for n, d in _installed.items()}


def installed():
    """The patches whose replacement some target holds now."""
    with _lock:
        return sorted(n for n, labels in _live_targets().items() if labels)


def installed_variant(name):
    with _lock:
        done = _installed.get(name)
        if done is None or not any(t.live() for t in done.targets):
            return None
        return done.variant.label


def _stale_notes():
    notes = {}
    for name, done in _installed.items():
        if not _still_ours(done):
            spec = done.spec
            where = ".".join(filter(None, (spec.home, spec.class_attr, spec.attr)))
            notes[name] = [f"{where} does not hold the replacement now (module reloaded or "
                           "replaced): install() again patches it"]
    return notes


_INSTALL_DIRS = frozenset(("site-packages", "dist-packages"))


def megatron_core_version(mcore=None):
    """megatron-core's version as installed, for reports.

    From 0.19, ``megatron.core.__version__`` appends ``+<commit>`` from ``git
    rev-parse --short HEAD`` run in the package's own directory (package_info,
    unless NO_VCS_VERSION=1). For a pip install that names no Megatron commit:
    the command answers for whatever git tree holds the environment (a venv
    under a project's checkout gives that project's commit). So where the
    package lives in site-packages and the installed distribution has the
    version without the suffix, that version is returned; a source checkout,
    where the commit is Megatron's own, keeps it. ``mcore``: the imported
    ``megatron.core`` (imported here when None); None when it cannot be."""
    if mcore is None:
        try:
            import megatron.core as mcore
        except Exception:  # noqa: BLE001
            return None
    version = str(getattr(mcore, "__version__", "unknown"))
    base, plus, _ = version.partition("+")
    if not plus:
        return version
    where = os.path.normpath(os.path.dirname(os.path.abspath(getattr(mcore, "__file__", "") or "")))
    if not _INSTALL_DIRS.intersection(where.split(os.sep)):
        return version
    try:
        installed = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return version
    return base if installed == base else version


def report(patches_table):
    version = megatron_core_version()
    with _lock:
        live = {n: labels for n, labels in _live_targets().items() if labels}
        stale = _stale_notes()
        notes = {n: list(_alias_notes.get(n, [])) + list(_notes.get(n, [])) + stale.get(n, [])
                 for n in set(_notes) | set(_alias_notes) | set(stale)}
        return {
            "megatron_core_version": version,
            "preset": _dispatch.preset(),
            "active_families": active(),
            "installed": live,
            "variants": {n: _installed[n].variant.label for n in live},
            "skipped": dict(_skipped),
            "notes": {n: v for n, v in notes.items() if v},
            "host_reads": {s.name: s.host_read for s in patches_table
                           if s.host_read and s.name in live},
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
        _counters.clear()
