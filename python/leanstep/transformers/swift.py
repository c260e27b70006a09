"""leanstep as a callback of ms-swift's transformers backend (``swift sft``,
ms-swift 4.6)::

    swift sft ... --external_plugins examples/swift/leanstep_hf_plugin.py --callbacks leanstep

The plugin file calls :func:`register`, which adds :class:`SwiftCallback`
(:class:`leanstep.transformers.Callback` built the way ms-swift builds its
callbacks, ``cls(args, trainer)``) to ``swift.callbacks.callbacks_map``.
Nothing is swapped or installed before training begins. ms-swift is imported
inside :func:`register` only.
"""

import threading

from .trainer import Callback

__all__ = ["NAME", "register", "SwiftCallback"]

#: The name under which the callback is registered (``--callbacks leanstep``).
NAME = "leanstep"

_lock = threading.Lock()


class SwiftCallback(Callback):
    """:class:`leanstep.transformers.Callback` with ms-swift's constructor."""

    def __init__(self, args=None, trainer=None, **options):
        super().__init__(**options)
        self.args = args
        self.trainer = trainer


def register():
    """Adds "leanstep" to ms-swift's ``callbacks_map`` (idempotent); returns
    the class. An entry of another class under that name is an error, not
    overwritten."""
    from swift.callbacks import callbacks_map

    with _lock:
        present = callbacks_map.get(NAME)
        if present is not None and present is not SwiftCallback:
            raise RuntimeError(f"leanstep.transformers.swift.register: ms-swift's callbacks_map "
                               f"already holds {NAME!r} -> {present!r}; leanstep does not "
                               f"overwrite another callback")
        callbacks_map[NAME] = SwiftCallback
    return SwiftCallback
