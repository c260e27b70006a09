"""The HF Trainer callback: one line for ``transformers.Trainer`` and every
trainer built on it (TRL's SFTTrainer, ms-swift's ``swift sft``)::

    trainer = Trainer(..., callbacks=[leanstep.transformers.Callback()])

When training begins it swaps the model's RMSNorms (:func:`apply`) and has
``torch.nn.utils``'s clipping functions run leanstep's (the Trainer clips
through accelerate, which calls them by name); when it ends it undoes both.
The Trainer keeps the norm it returns on the device and reads it only on
logging steps (transformers 5's ``_maybe_log_save_evaluate``): nothing here
adds a host read.

``grad_buffer=True`` also lays the trainable grads out in one buffer
(:class:`leanstep.torch.GradBuffer`) so the clip is one pass over one region;
its note on zeros in place of None grads applies (off by default: an optimizer
steps a parameter whose grad is zeros, where it skips one whose grad is None).
"""

from transformers import TrainerCallback

from .. import _torch_clip
from ..torch import GradBuffer
from . import apply, undo

__all__ = ["Callback"]


class Callback(TrainerCallback):
    """``rms_norm``: swap the model's RMSNorms; ``clip``: leanstep's clipping
    under torch.nn.utils' names; ``grad_buffer``: one flat grad buffer.
    ``report`` holds what :func:`apply` did (also printed on the main process
    when training begins, with ``verbose``)."""

    def __init__(self, *, rms_norm=True, clip=True, grad_buffer=False, verbose=True):
        self.rms_norm = rms_norm
        self.clip = clip
        self.grad_buffer = grad_buffer
        self.verbose = verbose
        self.report = None
        self.buffer = None
        self._model = None
        self._clip_installed = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        self._model = model
        self.report = apply(model, rms_norm=self.rms_norm)
        if self.clip and not self._clip_installed:
            _torch_clip.install()
            self._clip_installed = True
        if self.grad_buffer and self.buffer is None:
            self.buffer = GradBuffer(p for p in model.parameters() if p.requires_grad)
            self.buffer.install(model)
        if self.verbose and state.is_world_process_zero:
            print(self.report)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self):
        """Undoes everything this callback did (also at the end of training)."""
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
        if self._clip_installed:
            _torch_clip.uninstall()
            self._clip_installed = False
        if self._model is not None:
            undo(self._model)
            self._model = None
