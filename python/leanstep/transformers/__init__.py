"""leanstep for Hugging Face Transformers, PEFT and TRL.

- :func:`apply` / :func:`undo`: swap every RMSNorm of a loaded model (PEFT-
  wrapped or not) for leanstep's, with that class's exact arithmetic (see
  :mod:`leanstep.transformers.rmsnorm`); weights shared, state_dict keys
  unchanged. Frozen weights (LoRA) take the frozen path: dx only. Models
  whose experts run through Transformers' ExpertsInterface get the "leanstep"
  experts backend (:mod:`leanstep.transformers.experts`).
- :class:`Callback`: one line for the HF Trainer and TRL's SFTTrainer,
  ``Trainer(..., callbacks=[leanstep.transformers.Callback()])``: applies the
  swap when training begins, clips with leanstep's ``clip_grad_norm_`` (torch's
  semantics) while it runs, and undoes both when it ends.
- torch's clipping functions themselves are in :mod:`leanstep.torch`
  (``clip_grad_norm_``, ``get_total_norm``, ``clip_grads_with_norm_``,
  ``GradBuffer``).
"""

import weakref

from . import rmsnorm as _rmsnorm

__all__ = ["apply", "undo", "Report", "Callback"]

# model -> the swaps apply() made: (parent, attribute name, original, swapped)
_swaps = weakref.WeakKeyDictionary()


class Report:
    """What :func:`apply` did: ``swapped`` {class name: count}, ``left_alone``
    {class name: count} of norm-like modules leanstep does not know (run by
    their own code), ``conventions`` {class name: "llama" | "gemma"}."""

    def __init__(self):
        self.swapped = {}
        self.left_alone = {}
        self.conventions = {}
        self.experts = None  # (the experts implementation set, the one it replaced)

    @property
    def num_swapped(self):
        return sum(self.swapped.values())

    def as_dict(self):
        return {"swapped": dict(self.swapped), "left_alone": dict(self.left_alone),
                "conventions": dict(self.conventions), "num_swapped": self.num_swapped,
                "experts": self.experts}

    def __str__(self):
        lines = [f"leanstep.transformers: {self.num_swapped} RMSNorm modules swapped"]
        for name, n in sorted(self.swapped.items()):
            lines.append(f"  {name} x{n} ({self.conventions[name]} arithmetic)")
        for name, n in sorted(self.left_alone.items()):
            lines.append(f"  left alone: {name} x{n} (not in leanstep's table)")
        if self.experts is not None:
            lines.append(f"  experts: {self.experts[0]!r} (was {self.experts[1]!r})")
        return "\n".join(lines)

    __repr__ = __str__


# model -> the experts implementation apply() replaced
_experts = weakref.WeakKeyDictionary()


def _base_model(model):
    """The transformers model under a PEFT wrapper (the one whose config holds
    the experts implementation); the model itself otherwise."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def apply(model, *, rms_norm=True, experts=True):
    """Swaps ``model``'s RMSNorm modules for leanstep's, in place, and selects
    the "leanstep" experts backend where the model has one to set; returns a
    :class:`Report`. Applying twice swaps nothing new; :func:`undo` restores
    the original modules and experts implementation."""
    report = Report()
    base = _base_model(model)
    if experts and base not in _experts and hasattr(base, "set_experts_implementation"):
        from . import experts as _experts_backend  # imports transformers: an HF model has it

        previous = _experts_backend.select(base)
        if previous is not None:
            _experts[base] = previous
            report.experts = (_experts_backend.NAME, previous)
    if not rms_norm:
        return report
    done = _swaps.setdefault(model, [])
    made = {}  # a module shared by several parents gets one replacement
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            cls = type(child).__name__
            new = made.get(id(child)) or _rmsnorm.swap(child)
            if new is None:
                if _rmsnorm.unknown_norm(child):
                    report.left_alone[cls] = report.left_alone.get(cls, 0) + 1
                continue
            made[id(child)] = new
            setattr(parent, name, new)
            done.append((parent, name, child, new))
            report.swapped[cls] = report.swapped.get(cls, 0) + 1
            report.conventions[cls] = new.convention
    return report


def undo(model):
    """Puts back every module :func:`apply` swapped in ``model`` and the experts
    implementation it replaced; returns how many modules. A swapped module that
    something replaced since is left as it is."""
    restored = 0
    base = _base_model(model)
    if base in _experts:
        from . import experts as _experts_backend

        _experts_backend.restore(base, _experts.pop(base))
    for parent, name, original, swapped in reversed(_swaps.pop(model, [])):
        if getattr(parent, name, None) is swapped:
            if original.weight is not swapped.weight:
                original.weight = swapped.weight
            setattr(parent, name, original)
            restored += 1
    return restored


def __getattr__(name):  # the Trainer callback imports transformers: on first use
    if name == "Callback":
        from .trainer import Callback
        return Callback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
