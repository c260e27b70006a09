"""leanstep as an ms-swift Megatron callback.

    import leanstep.megatron.swift
    leanstep.megatron.swift.register()   # adds "leanstep" to megatron_callbacks_map

then ``megatron sft ... --external_plugins examples/swift/leanstep_plugin.py
--callbacks leanstep``. The callback installs the patches
(:func:`leanstep.megatron.install`) in ``on_train_begin`` and logs
:func:`leanstep.megatron.format_report` there and again in ``on_train_end``
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

import importlib.util
import logging
import sys
import threading

from . import convert_norms, format_report, install

__all__ = ["NAME", "register", "registered", "callback_class"]

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


def _build_class(base):
    class LeanstepCallback(base):
        """Installs leanstep's Megatron-Core patches when training begins
        (idempotent) and logs the report at the beginning and the end."""

        def on_train_begin(self):
            install()
            # ms-swift builds the model before callbacks exist: its RMSNorms
            # are converted in place (same Parameters), as the patch would have.
            models = getattr(getattr(self, "trainer", None), "unwrapped_models", None) or []
            converted = sum(convert_norms(m) for m in models)
            _logger().info("leanstep: patches installed at train begin (%d RMSNorm modules "
                           "converted)\n%s", converted, format_report())

        def on_train_end(self):
            _logger().info("leanstep: report at train end (calls during the run)\n%s",
                           format_report())

    LeanstepCallback.__module__ = __name__
    LeanstepCallback.__qualname__ = "LeanstepCallback"
    return LeanstepCallback


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
