"""Timers around the phases of a training step, at their call sites: a
call's forward is timed where it runs, its backward from the moment autograd
hands the gradient of its outputs to the moment it has the gradient of its
inputs (hooks on the autograd nodes of its outputs and of views of its
inputs, see :func:`_mark_inputs`). A nested call is counted once, by the
outermost timer. The frameworks' timers (:mod:`leanstep.megatron.phases`,
:mod:`leanstep.transformers.train`) say which call sites each phase has."""

import sys
import time

import torch

from . import torch as lt

RMSNORM_PHASE = "rmsnorm_s"

_ABSENT = object()


def _mark_inputs(tensors, hook):
    """`tensors` with each one that requires a gradient replaced by a view of
    itself whose backward node calls `hook` once it has run: the call's
    gradient of that input is then complete, every use inside the call summed.
    None when none requires one or grad mode is off (nothing replaced).

    A view and a hook on its C++ node cost a few microseconds a call; an
    identity autograd.Function (what ``register_full_backward_hook`` uses)
    costs tens, forward and backward, and the timers would then weigh more
    than a small call they time."""
    if not torch.is_grad_enabled():
        return None
    marked = None
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if marked is None:
                marked = list(tensors)
            view = t.view_as(t)
            view.grad_fn.register_hook(hook)
            marked[i] = view
    return marked


def _mark_outputs(tensors, hook):
    """Calls `hook` when autograd is about to run a node that made one of
    `tensors`: the gradient of that output is then complete, every use after
    the call summed. A pre-hook on the node, not on the tensor: an in-place
    op on the output after the call moves the tensor to another node but
    leaves this one, the call's own, where it was. Outputs without a node (no
    gradient, or a leaf the call passed through) have no backward to time."""
    nodes = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            node = t.grad_fn
            if node is not None and not any(node is n for n in nodes):
                nodes.append(node)
                node.register_prehook(hook)


class _BackwardSpan:
    """One call's backward: starts when the first output gradient arrives, each
    input gradient extends it; the time is added to the phase as it grows."""

    def __init__(self, timers, phase):
        self.timers, self.phase, self.last = timers, phase, None

    def output_ready(self, *_grads):
        if self.last is None:
            self.last = time.perf_counter()

    def input_ready(self, *_grads):
        if self.last is None:  # no marked output reached (the outputs were unused)
            return
        now = time.perf_counter()
        self.timers._add(self.phase, now - self.last)
        self.last = now


class PhaseTimers:
    """Timers around ``phases`` (names of seconds totals); subclasses wrap the
    call sites in ``__enter__``; ``__exit__`` puts every wrapped function back."""

    PHASES = (RMSNORM_PHASE,)

    def __init__(self, model=None, barrier=None):
        self.model = model
        #: Called before the timer of a call that waits on other ranks starts (see
        #: _timed's ``synced``), or None.
        self.barrier = barrier
        self._totals = dict.fromkeys(self.PHASES, 0.0)
        self._depth = dict.fromkeys(self.PHASES, 0)
        self._restore = []  # (owner, attr, previous value)
        self._restore_instance = []  # (module, its own forward attribute or _ABSENT)
        self.sites = {phase: [] for phase in self.PHASES}  # what is timed, for the report

    # ------------------------------------------------------------ results

    def reset(self):
        for k in self._totals:
            self._totals[k] = 0.0

    def totals(self):
        return dict(self._totals)

    def _add(self, phase, seconds):
        self._totals[phase] += seconds

    # ------------------------------------------------------------ wrapping

    def _timed(self, fn, phase, autograd, synced=False):
        """``fn`` timed into ``phase``. ``synced``: a call with a collective inside
        (a norm's all-reduce) starts its timer after ``self.barrier`` (where set),
        as Megatron's level-1 timers do (``barrier_with_L1_time``): otherwise the
        time a rank waits there for a later one, the other ranks' lateness from
        anything before, is counted as this phase's own. Every rank must then make
        the same synced calls in the same order (a barrier per call, on the group
        ``self.barrier`` uses), as Megatron's optimizer does on every rank; a nested
        call takes none."""
        timers = self

        def timed(*args, **kwargs):
            if timers._depth[phase]:  # nested: the outer call times it
                return fn(*args, **kwargs)
            if synced and timers.barrier is not None:
                timers.barrier()
            span = _BackwardSpan(timers, phase) if autograd else None
            if span is not None:
                keys = list(kwargs)
                marked = _mark_inputs(list(args) + [kwargs[k] for k in keys],
                                      span.input_ready)
                if marked is not None:
                    args = tuple(marked[:len(args)])
                    kwargs = dict(zip(keys, marked[len(args):]))
            timers._depth[phase] += 1
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                timers._add(phase, time.perf_counter() - start)
                timers._depth[phase] -= 1
            if span is not None and torch.is_grad_enabled():
                _mark_outputs((out,) if isinstance(out, torch.Tensor) else
                              out if isinstance(out, tuple) else (), span.output_ready)
            return out

        timed.__wrapped__ = fn
        return timed

    def _wrap(self, owner, attr, phase, autograd, label, synced=False):
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None:
            return
        self._restore.append((owner, attr, fn))
        setattr(owner, attr, self._timed(fn, phase, autograd, synced))
        self.sites[phase].append(label)

    def _wrap_functions(self, names, module_names, phase, autograd, synced=()):
        """``synced``: the names whose calls wait on other ranks (see _timed)."""
        for module_name in module_names:
            module = sys.modules.get(module_name)  # call sites that are loaded; none imported here
            if module is None:
                continue
            for name in names:
                if callable(getattr(module, name, None)):
                    self._wrap(module, name, phase, autograd, f"{module_name}.{name}",
                               name in synced)

    def _wrap_norms(self, model):
        # The module's forward is wrapped per instance, not hooked: leanstep's RMSNorm
        # hands a module with hooks to torch (a feature it does not model), so hooks
        # would change what is timed.
        for name, module in model.named_modules():
            if isinstance(module, (torch.nn.RMSNorm, lt.RMSNorm)):
                self._wrap_instance(module, RMSNORM_PHASE, name)

    def _wrap_instance(self, module, phase, label):
        """``module.forward`` timed, forward and backward, for this instance."""
        previous = module.__dict__.get("forward", _ABSENT)
        self._restore_instance.append((module, previous))
        module.forward = self._timed(module.forward, phase, autograd=True)
        self.sites[phase].append(label or type(module).__name__)

    def __enter__(self):
        if self.model is not None:
            self._wrap_norms(self.model)
        return self

    def __exit__(self, *exc):
        for owner, attr, fn in reversed(self._restore):
            setattr(owner, attr, fn)
        self._restore.clear()
        for module, previous in reversed(self._restore_instance):
            if previous is _ABSENT:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._restore_instance.clear()
        return False
