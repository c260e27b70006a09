"""The DDP NaN/Inf gradient check with one host read per gradient sync, not
two per bucket.

With ``ddp_config.check_for_nan_in_grad`` (Megatron's training default,
``--check-for-nan-in-loss-and-grad``), ``_ParamAndGradBucketGroup.start_grad_sync``
calls ``check_grads`` before the data-parallel collective; for every bucket it
computes the grad norm and calls ``validate_result`` with ``torch.isnan`` and
``torch.isinf``, and with reruns disabled each call is a ``bool()`` of a device
tensor: 2 x (number of buckets) device syncs a step.

The patched ``check_grads`` computes every bucket's norm on the device (one
``torch._foreach_norm``), before the collective as Megatron does, so the norms
describe the local grads before reduction; it queues them with one device
flag "all finite". The patched ``DistributedDataParallel.finish_grad_sync``
(called once per model chunk per step, after every bucket group started its
sync; with ``overlap_grad_reduce=False`` the syncs start inside it) reads that
flag once for everything queued. Only when some norm is NaN or Inf does it
replay Megatron's own ``validate_result`` calls with the saved norms, in call
and bucket order, with Megatron's messages, tolerance and ``fatal=True``, so
the error raised and logged is Megatron's own.

The deferred check raises after the collectives of the step ran, where
Megatron raises before the failing bucket's collective: the flag is still the
local, pre-reduction one, so the same rank and bucket are named.

Delegated to Megatron's check: reruns enabled (the rerun machinery validates
each call), ``check_for_large`` (it keeps a history per call), no NaN/Inf
check asked, the op switched off by the preset, and ``finish_grad_sync`` not
patched (nothing would read the flag).
"""

import functools
import importlib
import sys
import threading

import torch

from . import _patching
from ._patching import EMPTY, Spec, Variant

BUFFER = "megatron.core.distributed.param_and_grad_buffer"
DDP = "megatron.core.distributed.distributed_data_parallel"
CHECK = "ddp_check_grads"
FINISH = "ddp_finish_grad_sync"

_lock = threading.Lock()
_pending = []  # [(bucket group, per-bucket norms, all-finite flag)] in call order
_pending_groups = set()  # ids of the queued bucket groups


def _queue(group, norms, all_finite):
    with _lock:
        _pending.append((group, norms, all_finite))
        _pending_groups.add(id(group))


def take_pending():
    """Takes the queued checks off the queue (for :func:`check_pending`)."""
    with _lock:
        taken = list(_pending)
        _pending.clear()
        _pending_groups.clear()
    return taken


def _is_queued(group):
    with _lock:
        return id(group) in _pending_groups


def drop_pending():
    """Forgets the queued checks (their step failed before its flush)."""
    take_pending()


def check_pending(pending=None):
    """Reads the one flag of the queued checks (``pending``, or everything
    queued) and, when a norm is NaN or Inf, raises Megatron's own error.
    Returns whether there was anything to check."""
    if pending is None:
        pending = take_pending()
    if not pending:
        return False
    flags = [flag for _, _, flag in pending]
    all_finite = flags[0] if len(flags) == 1 else torch.stack(flags).all()
    if bool(all_finite):  # the one host read
        return True
    home = sys.modules[BUFFER]
    state = home.get_rerun_state_machine()
    for _, norms, _ in pending:
        # Megatron's check_grads, call for call (check_for_large excluded: delegated).
        for i, grad_norm in enumerate(norms):
            for rejection_func, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
                state.validate_result(
                    result=grad_norm,
                    rejection_func=rejection_func,
                    message=f"found {what} in local grad norm for bucket #{i} "
                    f"in backward pass before data-parallel communication collective",
                    tolerance=0.001,  # Megatron's: non-deterministic FA backward
                    fatal=True,
                )
    return True


# ---------------------------------------------------------------- check_grads


def _make_check_grads(original, spec):
    home = sys.modules[original.__module__]
    disabled = importlib.import_module("megatron.core.rerun_state_machine").RerunMode.DISABLED

    @functools.wraps(original)
    def check_grads(self, check_for_nan_or_inf, check_for_large):
        reason = None
        if not _patching.is_active(spec):
            reason = "switched_off"
        elif check_for_large:
            reason = "check_for_large"
        elif not check_for_nan_or_inf:
            reason = "nothing_to_check"
        elif home.get_rerun_state_machine().mode != disabled:
            reason = "rerun_mode_enabled"
        elif _patching.installed_variant(FINISH) is None:
            reason = "finish_grad_sync_not_patched"
        else:
            grads = [bucket.grad_data for bucket in self.buckets]
            if not grads:
                reason = "no_buckets"
            elif not all(type(g) in (torch.Tensor, torch.nn.Parameter) for g in grads):
                reason = "grad_data"
        if reason is not None:
            _patching.count(spec.name, reason=reason)
            return original(self, check_for_nan_or_inf, check_for_large)
        _patching.count(spec.name, grads[0].device.type, "torch")
        if _is_queued(self):
            # Queued twice: no finish_grad_sync read the last step's flag (a
            # loop that drives the bucket groups itself); read it now.
            check_pending()
        norms = torch._foreach_norm(grads, 2)
        all_finite = (norms[0] if len(norms) == 1 else torch.stack(norms)).isfinite().all()
        _queue(self, norms, all_finite)
        return None

    return check_grads


# ---------------------------------------------------------------- finish_grad_sync


def _make_finish_grad_sync(original, spec):
    @functools.wraps(original)
    def finish_grad_sync(self, force_all_reduce=False):
        try:
            result = original(self, force_all_reduce)
        except BaseException:
            drop_pending()  # the step failed; its error is the one to see
            raise
        pending = take_pending()
        if not pending:
            _patching.count(spec.name, reason="switched_off" if not _patching.is_active(spec)
                            else "nothing_deferred")
            return result
        # Checks queued before a preset switch are still read: none is lost.
        _patching.count(spec.name, pending[0][2].device.type, "torch")
        check_pending(pending)
        return result

    return finish_grad_sync


SPECS = [
    # finish_grad_sync first: check_grads requires it.
    Spec(FINISH, "grad.norm", DDP, "finish_grad_sync",
         [Variant("0.16-0.19", [("self", EMPTY), ("force_all_reduce", False)],
                  _make_finish_grad_sync)],
         class_attr="DistributedDataParallel",
         host_read="one bool of the combined NaN/Inf flag of the bucket norms check_grads "
                   "queued: once per model chunk per step (Megatron raises a Python error)"),
    Spec(CHECK, "grad.norm", BUFFER, "check_grads",
         [Variant("0.16-0.19", [("self", EMPTY), ("check_for_nan_or_inf", EMPTY),
                                ("check_for_large", EMPTY)],
                  _make_check_grads)],
         class_attr="_ParamAndGradBucketGroup", requires=FINISH),
]
