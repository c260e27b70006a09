"""The LoRA coverage planner (see docs/lora.md)."""

import json
import os

from . import _leanstep

__all__ = ["lora_plan"]


def lora_plan(config_path, targets=("all-linear",), lora_rank=32, *, tp=1, pp=1, ep=1,
              scope="language", dtype="bfloat16", numbering="global"):
    """Plans LoRA adapters for a Hugging Face ``config.json``: returns the
    plan as a dict ``{model_type, parallel, lora_rank, targets, ranks: [{pp_stage,
    tp_rank, ep_rank, modules, tensors, params, memory_bytes, layout: [{name,
    shape, dtype}]}]}`` (the ``leanstep lora plan --json`` object)."""
    if isinstance(targets, str):
        targets = [targets]
    text = _leanstep.lora_plan_json(os.fspath(config_path), list(targets), int(lora_rank), int(tp),
                                    int(pp), int(ep), scope, dtype, numbering)
    return json.loads(text)
