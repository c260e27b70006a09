"""leanstep as an ms-swift Megatron callback.

    import leanstep.megatron.swift
    leanstep.megatron.swift.register()   # adds "leanstep" to megatron_callbacks_map

then ``megatron sft ... --external_plugins examples/swift/leanstep_plugin.py
--callbacks leanstep``. The callback installs the patches
(:func:`leanstep.megatron.install`) in ``on_train_begin``, and ms-swift's own
(:data:`SPECS`): ``BaseMegatronTrainer.train_step`` reduces the step's success
flag and grad norm across the model-parallel group with
``logical_and_across_model_parallel_group`` and
``reduce_max_stat_across_model_parallel_group``, each a device tensor read back
with ``.item()``; here they stay on the device (the flag a
:class:`leanstep.megatron.step.DeviceBool`, the norm a one-element tensor, which
ms-swift's log reads when it logs). What stays: ``if update_successful:`` before
the learning-rate schedule's step, one read per step (:data:`HOST_READS`). It
logs :func:`leanstep.megatron.format_report` there and again in ``on_train_end``
(with the call counts of the run).

Nothing is patched when this module is imported or when :func:`register`
runs: ms-swift imports ``--external_plugins`` files while it parses the
arguments, before the model, the optimizer and (on NPU stacks) MindSpeed's
own patches exist, and a patch applied that early can be overwritten. ms-swift
builds its callbacks after the optimizer and the checkpoint load, and fires
``on_train_begin`` at the end of the trainer's set-up, right before the first
step.

ms-swift is imported inside :func:`register` only (``swift.megatron.callbacks``
is where ``megatron_callbacks_map`` and ``MegatronCallback`` live); this module
itself imports without it.
"""

import functools
import importlib.util
import logging
import sys
import threading

import torch

from . import _patching, convert_norms, format_report, install
from ._patching import EMPTY, Spec, Variant
from .step import DeviceBool, keep_results_on_device

__all__ = ["NAME", "register", "registered", "callback_class", "SPECS", "HOST_READS"]

#: The name under which the callback is registered (``--callbacks leanstep``).
NAME = "leanstep"

_lock = threading.Lock()
_class = None


def _swift_installed():
    if "swift" in sys.modules:
        return sys.modules["swift"] is not None
    try:
        return importlib.util.find_spec("swift") is not None
    except (ImportError, ValueError):
        return False


def _swift_callbacks():
    """ms-swift's ``swift.megatron.callbacks`` module, or an ImportError that
    names the package that is missing."""
    try:
        import swift.megatron.callbacks as callbacks
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        if not _swift_installed():
            why = "ms-swift is not installed; install it with: pip install 'ms-swift[megatron]'"
        elif missing.startswith("swift."):
            why = (f"the installed ms-swift has no module {missing!r} (the Megatron callbacks "
                   "are in ms-swift 4.x: pip install 'ms-swift[megatron]')")
        else:
            why = (f"ms-swift's Megatron callbacks (swift.megatron.callbacks) could not be "
                   f"imported: missing package {missing!r}. ms-swift's Megatron path needs "
                   "the [megatron] extra (it brings mcore-bridge, which imports "
                   "transformer_engine)")
        raise ImportError(f"leanstep.megatron.swift: {why}", name=missing) from e
    return callbacks


def _logger():
    """ms-swift's logger (INFO on the local master rank only) if it imports,
    else this module's logging logger."""
    try:
        from swift.utils import get_logger
    except ImportError:
        return logging.getLogger(__name__)
    return get_logger()


# ---------------------------------------------------------------- train_step's reductions

PARALLEL_UTILS = "swift.megatron.utils.parallel_utils"
#: Modules that import the two reductions by name (ms-swift 4.x).
ALIASES = ("swift.megatron.utils", "swift.megatron.trainers.base", "swift.megatron.callbacks.print")


def _model_parallel_group():
    from megatron.core import mpu

    return mpu.get_model_parallel_group()


def _make_logical_and(original, spec):
    @functools.wraps(original)
    def logical_and_across_model_parallel_group(input):
        # ms-swift: int(bool(input)) into a device tensor, MIN-reduced, read back. Here the
        # flag stays a device tensor (the step's DeviceBool, or a host bool put there).
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(input)
        if isinstance(input, DeviceBool):
            flag = input.tensor.reshape(1).to(torch.int32)
        elif isinstance(input, torch.Tensor) and input.numel() == 1:
            flag = (input.reshape(1) != 0).to(torch.int32)
        else:
            flag = torch.tensor([int(bool(input))], dtype=torch.int32,
                                device=torch.cuda.current_device())
        _patching.count(spec.name, flag.device.type, "torch")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN,
                                     group=_model_parallel_group())
        return DeviceBool(flag[0] != 0)

    return logical_and_across_model_parallel_group


def _make_reduce_max_stat(original, spec):
    @functools.wraps(original)
    def reduce_max_stat_across_model_parallel_group(stat):
        # ms-swift: the stat into an fp32 device tensor, MAX-reduced, read back. A stat
        # that is already a device tensor (the step's norm) stays one: ms-swift's log
        # reads one-element tensors when it logs (BaseMegatronTrainer._log_callback).
        if not _patching.is_active(spec):
            _patching.count(spec.name, reason="switched_off")
            return original(stat)
        if not isinstance(stat, torch.Tensor) or stat.numel() != 1:
            _patching.count(spec.name, reason="host_value")
            return original(stat)
        value = stat.detach().reshape(1).to(torch.float32, copy=True)
        _patching.count(spec.name, value.device.type, "torch")
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX,
                                     group=_model_parallel_group())
        return value

    return reduce_max_stat_across_model_parallel_group


SPECS = [
    Spec("swift_logical_and", "grad.norm", PARALLEL_UTILS, "logical_and_across_model_parallel_group",
         [Variant("4.x", [("input", EMPTY)], _make_logical_and)], ALIASES,
         host_read="ms-swift's train_step steps the learning-rate schedule after "
                   "`if update_successful:`, a host branch: one read of the step's flag per "
                   "step (the first iteration's check reuses it)"),
    Spec("swift_reduce_max_stat", "grad.norm", PARALLEL_UTILS,
         "reduce_max_stat_across_model_parallel_group",
         [Variant("4.x", [("stat", EMPTY)], _make_reduce_max_stat)], ALIASES),
]

#: What ms-swift's training loop still reads per step with the plugin, and why.
HOST_READS = {spec.name: spec.host_read for spec in SPECS if spec.host_read}


def install_train_step_patches():
    """Keeps ms-swift's train_step reductions on the device (:data:`SPECS`);
    idempotent. Needs ms-swift's Megatron modules imported (the trainer's own
    import does it). ms-swift's train_step then takes the step's device values
    (its two reductions are these patches), so the patched optimizer steps of
    this process return them (:func:`leanstep.megatron.step.keep_results_on_device`)."""
    _patching.install(SPECS)
    keep_results_on_device(None, True)


def _build_class(base):
    class LeanstepCallback(base):
        """Installs leanstep's Megatron-Core patches when training begins
        (idempotent) and logs the report at the beginning and the end."""

        def on_train_begin(self):
            install()
            install_train_step_patches()
            # ms-swift builds the model before callbacks exist: its RMSNorms
            # are converted in place (same Parameters), as the patch would have.
            models = getattr(getattr(self, "trainer", None), "unwrapped_models", None) or []
            converted = sum(convert_norms(m) for m in models)
            _logger().info("leanstep: patches installed at train begin (%d RMSNorm modules "
                           "converted)\n%s\n%s", converted, format_report(), _format_swift())

        def on_train_end(self):
            _logger().info("leanstep: report at train end (calls during the run)\n%s\n%s",
                           format_report(), _format_swift())

    LeanstepCallback.__module__ = __name__
    LeanstepCallback.__qualname__ = "LeanstepCallback"
    return LeanstepCallback


def _format_swift():
    """The ms-swift patches' lines of the report."""
    return _patching.format_report(SPECS).split("\n", 1)[1]


def callback_class():
    """The callback class (a subclass of ms-swift's ``MegatronCallback``),
    built on first use; imports ms-swift."""
    global _class
    with _lock:
        if _class is None:
            _class = _build_class(_swift_callbacks().MegatronCallback)
        return _class


def _is_ours(obj):
    return (isinstance(obj, type) and obj.__module__ == __name__
            and obj.__qualname__ == "LeanstepCallback")


def register():
    """Adds the callback to ms-swift's ``megatron_callbacks_map`` under
    :data:`NAME`; returns its class. Calling it again changes nothing. A
    different callback already registered under that name is an error (it
    is left in place). Patches nothing: the callback installs at on_train_begin."""
    cls = callback_class()
    mapping = _swift_callbacks().megatron_callbacks_map
    with _lock:
        current = mapping.get(NAME)
        if current is not None and current is not cls and not _is_ours(current):
            raise ValueError(f"leanstep.megatron.swift: megatron_callbacks_map[{NAME!r}] already "
                             f"holds {current!r}, not leanstep's callback")
        mapping[NAME] = cls
    return cls


def registered():
    """True when ms-swift's ``megatron_callbacks_map`` holds this module's
    callback under :data:`NAME` (False too when ms-swift does not import)."""
    try:
        mapping = _swift_callbacks().megatron_callbacks_map
    except ImportError:
        return False
    return _is_ours(mapping.get(NAME))
