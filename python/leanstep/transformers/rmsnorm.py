"""The RMSNorm classes of Hugging Face Transformers that leanstep swaps, each
with its exact arithmetic, and the swap itself.

Two conventions cover the classes below (read in transformers 5.19's
``modeling_*.py``; tests/python/test_transformers.py checks each class
against its own forward):

- "llama": ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``:
  normalised in fp32, cast to the input's dtype, then scaled (a product of two
  input-dtype values, rounded once): leanstep's ``rounding="cast_then_scale"``.
  eps is ``variance_epsilon``; the weight starts at ones. A weight of another
  dtype than the input promotes the output: such a call runs the class's own
  forward.
- "gemma": ``(x.float() * rsqrt(mean(x^2) + eps) * (1 + weight.float())).type_as(x)``:
  a zero-centered gamma, scaled in fp32 and cast last: leanstep's
  ``zero_centered_gamma=True``. eps is ``eps``; the weight starts at zeros.

Any other class is left alone and named in the report, never guessed at: the
gated norms of Qwen3-Next and Qwen3.5 (``forward(x, gate)``) among them.
"""

import types

import torch

from .. import torch as _lt

__all__ = ["CONVENTIONS", "CLASSES", "swap", "unknown_norm"]

#: convention -> (RMSNorm options, the eps attribute)
CONVENTIONS = {
    "llama": (dict(zero_centered_gamma=False, rounding="cast_then_scale"), "variance_epsilon"),
    "gemma": (dict(zero_centered_gamma=True, rounding="scale_then_cast"), "eps"),
}


def _models(names, convention):
    return {(f"transformers.models.{module}.modeling_{module}", cls): convention
            for module, cls in names}


#: (defining module, class name) -> convention, for the classes read and tested.
CLASSES = {
    **_models([("llama", "LlamaRMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen3", "Qwen3RMSNorm"),
               ("mistral", "MistralRMSNorm"), ("qwen3_moe", "Qwen3MoeRMSNorm"),
               ("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextRMSNorm"),
               ("qwen3_omni_moe", "Qwen3OmniMoeTextRMSNorm"),
               ("qwen3_omni_moe", "Qwen3OmniMoeRMSNorm"),
               ("qwen3_omni_moe", "Qwen3OmniMoeCode2WavRMSNorm")], "llama"),
    **_models([("gemma3", "Gemma3RMSNorm"), ("qwen3_next", "Qwen3NextRMSNorm"),
               ("qwen3_5_moe", "Qwen3_5MoeRMSNorm")], "gemma"),
}


def class_key(module):
    cls = type(module)
    return cls.__module__, cls.__qualname__


def unknown_norm(module):
    """Whether ``module`` looks like a norm leanstep does not know (reported,
    left alone): an RMSNorm by name that is not in :data:`CLASSES`."""
    cls = type(module)
    if isinstance(module, _lt.RMSNorm) or class_key(module) in CLASSES:
        return False
    return "rmsnorm" in cls.__name__.lower() or isinstance(module, torch.nn.RMSNorm)


class _Delegate:
    """The original module's own forward, for the calls leanstep does not take
    (autocast, hooks, compile, offload, a weight of another dtype...). It
    follows the swapped module's weight if that is ever re-assigned."""

    __slots__ = ("original", "swapped")

    def __init__(self, original, swapped):
        self.original = original
        self.swapped = swapped

    def __call__(self, x):
        weight = self.swapped.weight
        if self.original.weight is not weight:
            self.original.weight = weight
        return self.original.forward(x)


def swap(module):
    """A leanstep :class:`leanstep.torch.RMSNorm` with ``module``'s exact
    arithmetic, sharing its weight Parameter (no copy; state_dict keys
    unchanged), or None when ``module``'s class is not in :data:`CLASSES` or
    its weight is not one vector."""
    convention = CLASSES.get(class_key(module))
    if convention is None:
        return None
    options, eps_attr = CONVENTIONS[convention]
    weight = getattr(module, "weight", None)
    eps = getattr(module, eps_attr, None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or eps is None:
        return None
    shim = types.SimpleNamespace(normalized_shape=(weight.shape[0],), eps=float(eps),
                                 elementwise_affine=True, weight=weight)
    new = _lt.RMSNorm.from_torch(shim, **options)
    new.__dict__["delegate"] = _Delegate(module, new)
    new.__dict__["original"] = module
    new.__dict__["convention"] = convention
    new.__dict__[eps_attr] = float(eps)  # code that reads the model's own attribute
    return new
