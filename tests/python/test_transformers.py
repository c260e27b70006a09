"""leanstep.transformers: every RMSNorm class of the table against its own
forward and a float64 oracle, and each architecture (tiny random models built
from fixtures/hf, PEFT LoRA on) before and after apply().

Bounds, and why (eps = the dtype's machine epsilon):
- fp32: leanstep's rstd sums the squares in another order than torch's mean:
  a few ulps in rstd, so outputs within 16 eps of the oracle elementwise (y is
  a product of x, rstd and g: no cancellation), dx within 16 eps of the row's
  largest |dx| (dx has a cancelling mean term);
- bf16 / fp16: computed in fp32, then rounded: "gemma" rounds once (within
  1 eps of the oracle elementwise), "llama" twice, once to the input's dtype
  before the scale (within 2 eps); dx within 2 eps of the row's largest |dx|;
- whole models (fixed seeds): fp32 logits within 1e-5 of the original's
  largest, LoRA grads within 1e-4 of each tensor's largest (the per-norm fp32
  differences above through four layers; the backward through q/k norms
  cancels, which grows them: at most 3.3e-5 measured, Qwen3-Next); in bf16 the
  original's own rounding dominates, so leanstep's error against the float64
  oracle of the same model is bounded by 2x the original's own error plus
  4 eps of the scale.
"""

import importlib

import pytest
import torch

import leanstep

pytest.importorskip("transformers")
pytest.importorskip("peft")

import leanstep.torch as lt  # noqa: E402
import leanstep.transformers as lst  # noqa: E402
from leanstep.transformers import rmsnorm as hf_rmsnorm  # noqa: E402
import hf_models  # noqa: E402
from helpers import FLOAT_DTYPES  # noqa: E402

pytestmark = pytest.mark.skipif("rmsnorm" not in leanstep.areas, reason="rmsnorm not built")


def norm_class(key):
    return getattr(importlib.import_module(key[0]), key[1])


def oracle(x, w, eps, convention):
    """The class's formula in float64, without its intermediate rounding."""
    x64, w64 = x.detach().double(), w.detach().double()
    r = torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)
    g = 1.0 + w64 if convention == "gemma" else w64
    return x64 * r * g


@pytest.mark.parametrize("key", sorted(hf_rmsnorm.CLASSES))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("frozen", [True, False])
def test_each_class_matches_its_own_forward_and_the_oracle(key, dtype, frozen, torch_gen):
    convention = hf_rmsnorm.CLASSES[key]
    width = 37
    original = norm_class(key)(width, eps=1e-5).to(dtype)
    with torch.no_grad():
        center = 0.0 if convention == "gemma" else 1.0
        original.weight.copy_(torch.randn(width, generator=torch_gen) * 0.5 + center)
    original.weight.requires_grad_(not frozen)
    swapped = hf_rmsnorm.swap(original)
    assert swapped.weight is original.weight
    x = (torch.randn(3, 21, width, generator=torch_gen) * 3).to(dtype).requires_grad_()
    y = swapped(x)
    assert swapped.last_decision["path"] == ("frozen_fused" if frozen else "general")
    y_own = original(x)
    assert y.dtype == y_own.dtype and y.shape == y_own.shape
    eps = torch.finfo(dtype).eps
    out_ulps = 16 if dtype == torch.float32 else (2 if convention == "llama" else 1)
    expected = oracle(x, original.weight, 1e-5, convention)
    err = (y.double() - expected).abs()
    assert (err <= out_ulps * eps * expected.abs() + torch.finfo(dtype).tiny).all()
    # dx (and dweight when trainable) against float64 autograd of the formula.
    dy = torch.randn(y.shape, generator=torch_gen).to(dtype)
    grads = torch.autograd.grad(y, [x] + ([] if frozen else [original.weight]), dy)
    x64 = x.detach().double().requires_grad_()
    w64 = original.weight.detach().double().requires_grad_()
    r = torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5)
    y64 = x64 * r * ((1.0 + w64) if convention == "gemma" else w64)
    dx64, dw64 = torch.autograd.grad(y64, [x64, w64], dy.double())
    dx_ulps = 16 if dtype == torch.float32 else 2
    row = dx64.abs().amax(-1, keepdim=True)
    assert ((grads[0].double() - dx64).abs() <= dx_ulps * eps * row).all()
    if not frozen:
        # dweight sums 63 rows: the rows' products rounded, summed in fp32.
        scale = (dy.double().abs() * (x64 * r).abs()).sum((0, 1))
        assert ((grads[1].double() - dw64).abs() <= 4 * eps * scale + 1e-30).all()


@pytest.mark.parametrize("key", sorted(hf_rmsnorm.CLASSES))
def test_zero_rows_strided_inputs_and_mixed_weight_dtype_as_the_class(key, torch_gen):
    convention = hf_rmsnorm.CLASSES[key]
    original = norm_class(key)(16, eps=1e-6)
    with torch.no_grad():
        original.weight.normal_(generator=torch_gen)
    original.weight.requires_grad_(False)
    swapped = hf_rmsnorm.swap(original)
    empty = torch.empty(0, 16)
    assert swapped(empty).shape == (0, 16)
    wide = torch.randn(5, 40, generator=torch_gen)
    strided = wide[:, 3:19]  # q/k-style views of a fused projection
    assert not strided.is_contiguous()
    assert torch.allclose(swapped(strided), original(strided), rtol=1e-5, atol=1e-6)
    # A weight of another dtype than the input: the class's own forward (its dtype rules).
    x = torch.randn(4, 16, generator=torch_gen).to(torch.bfloat16)
    y, y_own = swapped(x), original(x)
    assert y.dtype == y_own.dtype and torch.equal(y, y_own)
    if convention == "llama":
        assert swapped.last_decision["path"] == "torch"
        assert swapped.last_decision["reason"] == "weight_dtype"


def test_unknown_norms_are_named_and_left_alone():
    class MyRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.weight

    model = torch.nn.Sequential(MyRMSNorm(), torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    report = lst.apply(model)
    assert report.num_swapped == 0
    assert report.left_alone == {"MyRMSNorm": 1, "RMSNorm": 1}
    assert type(model[0]).__name__ == "MyRMSNorm" and type(model[2]) is torch.nn.RMSNorm
    assert "left alone: MyRMSNorm x1" in str(report)


def forward_and_lora_grads(model, ids, returns_logits):
    out = model(input_ids=ids)
    y = out.logits if returns_logits else out.last_hidden_state
    loss = y.float().square().mean()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return y.detach(), dict(zip(names, grads))


@pytest.mark.parametrize("arch", hf_models.ARCHITECTURES)
def test_architecture_with_lora_equals_the_original(arch, capsys):
    model, returns_logits = hf_models.tiny_model(arch)
    model = hf_models.lora(model)
    ids = torch.randint(0, hf_models.TINY["vocab_size"], (2, 11),
                        generator=torch.Generator().manual_seed(3))
    keys = list(model.state_dict())
    y0, g0 = forward_and_lora_grads(model, ids, returns_logits)
    report = lst.apply(model)
    with capsys.disabled():
        print(f"\n{arch}: {report}")
    assert report.num_swapped >= 3  # two per layer at least, and the final norm
    assert list(model.state_dict()) == keys
    leanstep.reset_paths()
    y1, g1 = forward_and_lora_grads(model, ids, returns_logits)
    counted = leanstep.paths()["ops"]["rmsnorm.forward"]["calls"]["cpu"]["cpu"]
    assert counted >= report.num_swapped  # every swapped norm ran leanstep's path
    scale = y0.abs().max().item()
    assert (y1 - y0).abs().max().item() <= 1e-5 * scale
    assert g0.keys() == g1.keys() and g0
    worst = max((g1[n] - g0[n]).abs().max().item() / g0[n].abs().max().item() for n in g0)
    with capsys.disabled():
        print(f"  logits {(y1 - y0).abs().max().item() / scale:.2e}, LoRA grads {worst:.2e} "
              f"(relative to each tensor's largest)")
    assert worst <= 1e-4
    assert lst.undo(model) == report.num_swapped
    y2, _ = forward_and_lora_grads(model, ids, returns_logits)
    assert torch.equal(y2, y0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gemma3"])
def test_bf16_model_error_bounded_by_the_originals_own(arch):
    model, returns_logits = hf_models.tiny_model(arch, layers=2)
    model = hf_models.lora(model)
    ids = torch.randint(0, hf_models.TINY["vocab_size"], (2, 7),
                        generator=torch.Generator().manual_seed(4))
    base = model.get_base_model()
    default_experts = getattr(base.config, "_experts_implementation", None)
    if default_experts is not None:
        base.set_experts_implementation("eager")  # grouped_mm takes no float64
    y64, g64 = forward_and_lora_grads(model.double(), ids, returns_logits)
    if default_experts is not None:
        base.set_experts_implementation(default_experts)
    model = model.to(torch.bfloat16)
    y0, g0 = forward_and_lora_grads(model, ids, returns_logits)
    lst.apply(model)
    y1, g1 = forward_and_lora_grads(model, ids, returns_logits)
    eps = torch.finfo(torch.bfloat16).eps

    def err(a, b):
        return (a.double() - b).abs().max().item()

    scale = y64.abs().max().item()
    assert err(y1, y64) <= 2 * err(y0, y64) + 4 * eps * scale
    for name in g64:
        gscale = g64[name].abs().max().item()
        assert err(g1[name], g64[name]) <= 2 * err(g0[name], g64[name]) + 4 * eps * gscale, name


def test_apply_twice_swaps_nothing_new_and_frozen_norms_take_the_frozen_path():
    model, _ = hf_models.tiny_model("qwen3", layers=1)
    model = hf_models.lora(model)
    first = lst.apply(model)
    assert lst.apply(model).num_swapped == 0
    norms = [m for m in model.modules() if isinstance(m, lt.RMSNorm)]
    assert len(norms) == first.num_swapped
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert all(not m.weight.requires_grad for m in norms)
    assert {m.last_decision["path"] for m in norms} == {"frozen_fused"}
    assert lst.undo(model) == first.num_swapped
    assert not any(isinstance(m, lt.RMSNorm) for m in model.modules())
