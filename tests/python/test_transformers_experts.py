"""The "leanstep" experts backend against Transformers' "grouped_mm" and
"eager", forward and backward (hidden states, routing weights, expert
weights), on random routings: odd token counts, top-1 to top-4, experts no
token reaches, no token at all.

Bound: the GEMMs are grouped_mm's own, so the expert rows are equal; the one
difference is the top-k sum (grouped_mm rounds each weighted row to the
activations' dtype, then sums; leanstep sums in fp32 and rounds once).
Against a float64 eager oracle, leanstep's error is at most grouped_mm's plus
one ulp of the dtype at the output's scale (fp32: plus 4 ulps, the GEMMs'
own summation order through the backward). The routing weights' gradient is a
dot over the hidden size, dy . out, with dy and the expert rows rounded to the
dtype: its scale is the sum of its terms' magnitudes, not the result's, which
cancellation can make many times smaller (top-1 with dy a ramp: 19x on one
routing)."""

import pytest
import torch

import leanstep

pytest.importorskip("transformers")
pytest.importorskip("peft")

import leanstep.transformers as lst  # noqa: E402
from leanstep.transformers import experts as lx  # noqa: E402
import hf_models  # noqa: E402

pytestmark = pytest.mark.skipif("moe" not in leanstep.areas, reason="moe not built")


def experts_module(dtype, top_k=2, seed=0):
    model, _ = hf_models.tiny_model("qwen3_moe", layers=1, dtype=dtype, seed=seed)
    module = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    return model, module


def routing(tokens, experts, top_k, gen, dtype):
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] -= 100.0  # expert 0 is never chosen: an empty group
    weights, index = logits.softmax(-1).topk(top_k)
    return (weights / weights.sum(-1, keepdim=True)).to(dtype), index


def ramp_like(y):
    """The output gradient of every run: a ramp from -1 to 1 over y's elements."""
    return torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype)


def run(model, module, impl, hidden, index, weights):
    model.config._experts_implementation_internal = impl
    h = hidden.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    y = module(h, index, w)
    dy = ramp_like(y)
    params = [module.gate_up_proj, module.down_proj]
    if y.numel() == 0:
        return [y.detach(), h, w, *[torch.zeros_like(p) for p in params]]
    return [y.detach(), *torch.autograd.grad(y, [h, w, *params], dy)]


def weight_grad_terms(module, hidden, index, output):
    """The largest sum over h of |dy[t, h] * out_e[t, h]|, over the routed
    (token t, expert e) pairs: the magnitude of the terms of the routing
    weights' gradient dy . out_e, each expert's row taken as the (float64)
    module computes it alone (expert e, weight 1)."""
    if output.numel() == 0:
        return 0.0
    dy = ramp_like(output)
    largest = 0.0
    with torch.no_grad():
        for t in range(index.shape[0]):
            for e in index[t].tolist():
                row = module(hidden[t:t + 1], torch.tensor([[e]]),
                             torch.ones(1, 1, dtype=torch.float64))
                largest = max(largest, (dy[t] * row[0]).abs().sum().item())
    return largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,top_k", [(37, 2), (1, 1), (19, 4), (64, 3)])
def test_forward_and_backward_match_grouped_mm_and_eager(dtype, tokens, top_k, torch_gen):
    model, module = experts_module(dtype)
    lx.register()
    hidden = torch.randn(tokens, module.gate_up_proj.shape[-1], generator=torch_gen).to(dtype)
    weights, index = routing(tokens, module.num_experts, top_k, torch_gen, dtype)
    ours = run(model, module, "leanstep", hidden, index, weights)
    grouped = run(model, module, "grouped_mm", hidden, index, weights)
    eager = run(model, module, "eager", hidden, index, weights)
    oracle = run(model.double(), module, "eager", hidden.double(), index, weights.double())
    terms = weight_grad_terms(module, hidden.double(), index, oracle[0])
    model.to(dtype)
    eps = torch.finfo(dtype).eps
    extra = 4 if dtype == torch.float32 else 1
    names = ["output", "d hidden", "d weights", "d gate_up_proj", "d down_proj"]
    for name, a, b, e, o in zip(names, ours, grouped, eager, oracle):
        scale = terms if name == "d weights" else o.abs().max().item()
        mine = (a.double() - o).abs().max().item()
        theirs = max((b.double() - o).abs().max().item(), (e.double() - o).abs().max().item())
        assert mine <= theirs + extra * eps * scale, name


def test_no_token_and_no_host_read():
    model, module = experts_module(torch.float32)
    lx.register()
    model.config._experts_implementation_internal = "leanstep"
    hidden = torch.empty(0, module.gate_up_proj.shape[-1])
    index = torch.empty(0, 2, dtype=torch.long)
    weights = torch.empty(0, 2)
    assert module(hidden, index, weights).shape == (0, hidden.shape[1])
    # On meta tensors a host read raises: the whole forward runs on them.
    meta = module.to("meta")
    y = meta(torch.empty(9, hidden.shape[1], device="meta"),
             torch.zeros(9, 2, dtype=torch.long, device="meta"),
             torch.empty(9, 2, device="meta"))
    assert y.device.type == "meta" and y.shape == (9, hidden.shape[1])


def test_apply_selects_the_backend_and_undo_restores_it():
    model, _ = hf_models.tiny_model("qwen3_moe", layers=1)
    model = hf_models.lora(model)
    base = model.get_base_model()
    before = base.config._experts_implementation
    report = lst.apply(model)
    assert report.experts == ("leanstep", before)
    assert base.config._experts_implementation == "leanstep"
    assert "experts: 'leanstep'" in str(report)
    lst.undo(model)
    assert base.config._experts_implementation == before
    dense, _ = hf_models.tiny_model("qwen3", layers=1)
    assert lst.apply(dense).experts is None
