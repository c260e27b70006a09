"""RMSNorm patch: ``transformer.torch_norm.WrappedTorchNorm.__new__``.

An RMSNorm it constructs becomes a :class:`leanstep.torch.RMSNorm` sharing
the same weight Parameter (same state_dict keys and values: the checkpoint
layout does not change). It takes leanstep's frozen path when the weight
does not require a gradient (LoRA), on the CPU kernels or, on a device, the
torch-op backend (dx only); a trainable weight runs torch's own forward.
The module obeys the runtime switch: with the "rmsnorm" family inactive it
runs torch's forward.
"""

import torch

from .. import _dispatch
from .. import torch as lt
from . import _patching
from ._patching import EMPTY, Spec, Variant

TORCH_NORM = "megatron.core.transformer.torch_norm"


def _rmsnorm_active():
    return _dispatch.op_enabled("rmsnorm.forward")


def _make_wrapped_torch_norm_new(original, spec):
    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        module = original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                          normalization)
        if type(module) is not torch.nn.RMSNorm:
            _patching.count(spec.name, reason="not_rmsnorm")
            return module
        _patching.count(spec.name, module.weight.device.type if module.weight is not None
                        else "cpu", "leanstep.torch.RMSNorm")
        return lt.RMSNorm.from_torch(module, frozen_only=True, enabled=_rmsnorm_active,
                                     exact_forward=True)

    __new__.__wrapped__ = original
    __new__.__doc__ = original.__doc__
    return __new__


def convert_norms(model):
    """Replaces, in an already built model, every plain ``torch.nn.RMSNorm``
    submodule by a :class:`leanstep.torch.RMSNorm` sharing its weight
    Parameter (the object itself: optimizers, DDP grad buffers and
    checkpoints keep working), as the patch does for models built after
    :func:`leanstep.megatron.install`. For frameworks that build the model
    before patches can be installed (ms-swift's callbacks). A module with
    hooks of its own is left as it is (a replacement would drop them).
    Returns the number of modules replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.RMSNorm:
                continue
            if (child._forward_hooks or child._forward_pre_hooks or child._backward_hooks
                    or child._backward_pre_hooks):
                continue
            new = lt.RMSNorm.from_torch(child, frozen_only=True, enabled=_rmsnorm_active,
                                        exact_forward=True)
            new.train(child.training)
            setattr(parent, name, new)
            replaced += 1
    return replaced


SPECS = [
    Spec("WrappedTorchNorm", "rmsnorm.forward", TORCH_NORM, "__new__",
         [Variant("0.16-0.19", [("cls", EMPTY), ("config", EMPTY), ("hidden_size", EMPTY),
                                ("eps", 1e-5), ("persist_layer_norm", False),
                                ("zero_centered_gamma", False), ("normalization", "LayerNorm")],
                  _make_wrapped_torch_norm_new)],
         class_attr="WrappedTorchNorm", requires_area="rmsnorm"),
]
