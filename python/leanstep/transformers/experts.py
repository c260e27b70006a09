"""A "leanstep" experts backend for Transformers 5's ``ExpertsInterface``:
the tokens routed in the stable expert-major order by leanstep's permute (no
sort), the expert GEMMs as "grouped_mm" does them (Transformers' own grouped
linear over the per-expert offsets), and leanstep's unpermute with the
routing weights (fp32 sums in a fixed slot order, one rounding). Nothing is
read on the host: the group offsets are a cumsum on the device.

Where it differs from "grouped_mm": grouped_mm rounds each weighted expert
output to the activations' dtype, then sums a token's top-k rows; leanstep
sums them in fp32 and rounds once (no less exact; tests/python/
test_transformers_experts.py states the bound). Calls it does not take go to
"grouped_mm" unchanged: expert parallelism (sentinel expert ids), inputs
that are not one row per token.
"""

import torch
from transformers.integrations import moe as _hf_moe

from .. import torch as _lt

__all__ = ["NAME", "register", "experts_forward", "is_experts_module", "supports", "select",
           "restore"]

NAME = "leanstep"


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' forward under ``experts_implementation="leanstep"``."""
    if (self._is_expert_parallel or hidden_states.dim() != 2 or top_k_index.dim() != 2
            or getattr(self, "is_concatenated", True) is False):
        return _hf_moe.grouped_mm_experts_forward(self, hidden_states, top_k_index,
                                                  top_k_weights)
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    experts = self.num_experts
    device = hidden_states.device
    # The top-k ids of a token are distinct (a top-k): one routing_map entry each.
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool, device=device)
    routing_map.scatter_(1, top_k_index, True)
    probs = torch.zeros(tokens, experts, dtype=top_k_weights.dtype, device=device)
    probs = probs.scatter(1, top_k_index, top_k_weights)
    permuted, _, sorted_indices = _lt.permute(hidden_states, routing_map,
                                              num_out_tokens=tokens * top_k)
    tokens_per_expert = routing_map.sum(0)
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    expert_ids = None
    if self.has_bias:
        expert_ids = torch.repeat_interleave(torch.arange(experts, device=device),
                                             tokens_per_expert, output_size=tokens * top_k)
    if self.has_gate:
        weights, bias = self.gate_up_proj, getattr(self, "gate_up_proj_bias", None)
    else:
        weights, bias = self.up_proj, getattr(self, "up_proj_bias", None)
    rows = _hf_moe._grouped_linear(permuted, weights, offsets,
                                   bias=None if expert_ids is None else bias[expert_ids],
                                   is_transposed=self.is_transposed)
    rows = self._apply_gate(rows) if self.has_gate else self.act_fn(rows)
    down_bias = getattr(self, "down_proj_bias", None)
    rows = _hf_moe._grouped_linear(rows, self.down_proj, offsets,
                                   bias=None if expert_ids is None else down_bias[expert_ids],
                                   is_transposed=self.is_transposed)
    if rows.dtype != hidden_states.dtype:
        rows = rows.to(hidden_states.dtype)
    out = _lt.unpermute(rows, sorted_indices, (tokens, hidden), probs=probs,
                        routing_map=routing_map)
    return out


def register():
    """Adds "leanstep" to Transformers' experts backends (idempotent)."""
    _hf_moe.ExpertsInterface.register(NAME, experts_forward)


def is_experts_module(module):
    """Whether ``module`` is an experts module of the ExpertsInterface (its class
    decorated by Transformers' ``use_experts_implementation``)."""
    return getattr(module, "_is_expert_parallel", None) is not None and \
        hasattr(module, "num_experts")


def supports(model):
    """Whether ``model`` runs its experts through the ExpertsInterface."""
    config = getattr(model, "config", None)
    return (config is not None and hasattr(config, "_experts_implementation")
            and hasattr(model, "set_experts_implementation")
            and any(map(is_experts_module, model.modules())))


def select(model):
    """Sets ``model``'s experts implementation to "leanstep"; returns the one
    it had (for :func:`restore`), or None when the model has no experts
    backend to set."""
    if not supports(model):
        return None
    register()
    previous = model.config._experts_implementation
    model.set_experts_implementation(NAME)
    return previous or "eager"


def restore(model, previous):
    if previous is not None:
        model.set_experts_implementation(previous)
