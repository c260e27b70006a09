"""Per-phase wall time of a training step, for the phases leanstep changes.

    with PhaseTimers(model) as timers:
        for step in ...:
            timers.reset()
            ... one training step ...
            phases = timers.totals()   # {"grad_norm_clip_s": ..., "rmsnorm_s": ..., ...}

The timers sit at the call sites, around whatever is installed there, so a
baseline step (Megatron's own functions, or the patches switched off by the
preset) and a leanstep step are timed by the same clocks at the same places:

- ``grad_norm_clip_s``: ``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
  ``count_zeros_fp32`` where the optimizer modules call them, and
  ``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan`` (unscale and
  found_inf, with a loss scaler), and leanstep's step's own unscale where it runs
  (``unscale_and_check_on_device``, which that step puts in the method's place);
- ``rmsnorm_s``: forward and backward of every RMSNorm module of the model
  (``torch.nn.RMSNorm`` or leanstep's drop-in), its ``forward`` wrapped per instance
  (not module hooks: leanstep's RMSNorm hands a hooked module to torch);
- ``moe_permute_s``: forward and backward of ``permute``, ``unpermute`` and
  ``sort_chunks_by_idxs`` where the token dispatchers call them.

Backward time is the time from the moment autograd hands the gradient of a
call's outputs to the moment it has the gradient of the call's inputs, taken by
hooks on the autograd nodes of its outputs and of views of its inputs (a few
microseconds a call; identity autograd Functions, the mechanism of
``register_full_backward_hook``, cost tens). A nested call (``clip_grad_norm`` inside a
timed function, say) is counted once, by the outermost timer. The optimizer
step as a whole is timed by the caller (:mod:`leanstep.megatron.train`).

With ``barrier`` (``PhaseTimers(model, barrier=torch.distributed.barrier)``, as the
main job runs them), the calls with an all-reduce inside (``get_grad_norm_fp32``,
``count_zeros_fp32``, the unscale) start their timers after it, as Megatron's
level-1 timers do with ``barrier_with_L1_time`` (Megatron-LM's default): the time a
rank would wait there for another one, late from anything earlier in the step, is
then not counted as this phase's. The barrier's own time lies outside every phase,
inside the step.

Install the timers after :func:`leanstep.megatron.install` and leave them before
:func:`leanstep.megatron.uninstall`: they wrap the installed functions and put
them back exactly on exit.
"""

import sys

from .. import _phase_timers
from . import grad as _grad
from . import moe as _moe

GRAD_PHASE = "grad_norm_clip_s"
RMSNORM_PHASE = _phase_timers.RMSNORM_PHASE
MOE_PHASE = "moe_permute_s"
PHASES = (GRAD_PHASE, RMSNORM_PHASE, MOE_PHASE)

_GRAD_FUNCTIONS = ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32")
# The calls with an all-reduce inside, each the first of a Megatron level-1 timer
# (optimizer-clip-main-grad, optimizer-count-zeros, optimizer-unscale-and-check-inf):
# with a barrier, timed from it as Megatron's timers are (module docstring).
_SYNCED_GRAD_FUNCTIONS = ("get_grad_norm_fp32", "count_zeros_fp32")
_STEP = "leanstep.megatron.step"  # leanstep's optimizer step, where loaded
_STEP_UNSCALE = ("unscale_and_check_on_device",)
_MOE_FUNCTIONS = ("permute", "unpermute", "sort_chunks_by_idxs")
_MOE_CALL_SITES = ("megatron.core.transformer.moe.token_dispatcher",
                   "megatron.core.transformer.moe.moe_utils")


class PhaseTimers(_phase_timers.PhaseTimers):
    """Timers around the phases leanstep changes (module docstring)."""

    PHASES = PHASES

    def __enter__(self):
        optimizer_modules = tuple(m for m in _grad.ALIAS_MODULES if m != _grad.CLIP_GRADS)
        self._wrap_functions(_GRAD_FUNCTIONS, optimizer_modules, GRAD_PHASE, autograd=False,
                             synced=_SYNCED_GRAD_FUNCTIONS)
        opt = sys.modules.get(_grad.OPTIMIZER)
        if opt is not None and hasattr(opt, "MixedPrecisionOptimizer"):
            self._wrap(opt.MixedPrecisionOptimizer, "_unscale_main_grads_and_check_for_nan",
                       GRAD_PHASE, False, "MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan",
                       synced=True)
        # leanstep's own step (fp16: a loss scaler) shadows that method on each optimizer
        # instance with its sync-free unscale: timed at its call site as well, so that
        # every condition's unscale is in the phase (a nested call counts once).
        self._wrap_functions(_STEP_UNSCALE, (_STEP,), GRAD_PHASE, autograd=False,
                             synced=_STEP_UNSCALE)
        sites = tuple(dict.fromkeys(_MOE_CALL_SITES + tuple(_moe.ALIAS_MODULES)))
        self._wrap_functions(_MOE_FUNCTIONS, sites, MOE_PHASE, autograd=True)
        if self.model is not None:
            self._wrap_norms(self.model)
        return self
