"""leanstep.GradPlan and multi_tensor_scale against float64 oracles and torch,
on Megatron-style flat buffers (torch fp32/fp16/bf16 and NumPy)."""

import math

import numpy as np
import pytest
import torch

import leanstep
from helpers import FLOAT_DTYPES, UNIT_ROUNDOFF, assert_within_ulps, randn, to_f64

pytestmark = pytest.mark.skipif("grad" not in leanstep.areas, reason="grad not built")

# A small model in registration order (odd sizes, a zero-size param).
PARAMS = [("embedding", (97, 13)), ("layer0.qkv", (39, 13)), ("layer0.bias", (39,)),
          ("layer0.proj", (13, 13)), ("empty", (0, 5)), ("layer1.fc1", (52, 13)),
          ("layer1.fc2", (13, 52)), ("final_norm", (13,))]


def flat_grads(dtype, gen, distributed_optimizer=True, scale=1.0):
    """Grad views into one Megatron DDP buffer, in registration order."""
    name = str(dtype).removeprefix("torch.")
    params = [(n, s, "bfloat16") for n, s in PARAMS]
    buffers, grads, layouts = leanstep.ddp_grad_buffers(
        params, distributed_optimizer=distributed_optimizer, dp_size=2, grad_dtype=name)
    for g in grads:
        g.copy_(randn(g.shape, dtype, gen, scale=scale))
    return buffers, grads, layouts


def oracle_norm(grads, p):
    vals = np.concatenate([to_f64(g).ravel() for g in grads]) if grads else np.zeros(0)
    if p == math.inf:
        return np.abs(vals).max() if vals.size else 0.0
    return (np.abs(vals) ** p).sum() ** (1.0 / p)


def test_plan_coalesces_a_megatron_buffer(torch_gen):
    buffers, grads, layouts = flat_grads(torch.float32, torch_gen, distributed_optimizer=False)
    plan = leanstep.GradPlan(grads)
    assert plan.num_tensors == len(PARAMS)
    assert plan.num_regions == 1 and plan.num_generic == 0  # back to back, reverse order
    assert "1 regions" in plan.summary()
    # With the distributed optimizer, 64-element padding separates params:
    # padding is never read, so more regions.
    _, grads_do, _ = flat_grads(torch.float32, torch_gen, distributed_optimizer=True)
    plan_do = leanstep.GradPlan(grads_do)
    assert plan_do.num_regions > 1 and plan_do.num_generic == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("p", [2.0, math.inf, 1.0, 3.0])
def test_norm_matches_float64_oracle(dtype, p, torch_gen):
    buffers, grads, _ = flat_grads(dtype, torch_gen)
    pad = torch.ones_like(buffers[0], dtype=torch.bool)
    for g in grads:
        if g.numel():
            start = (g.data_ptr() - buffers[0].data_ptr()) // buffers[0].element_size()
            pad[start:start + g.numel()] = False
    assert pad.any()  # the layout has padding, so the garbage below is a real check
    buffers[0][pad] = 1e4  # padding must never be read as gradient
    norm, found_inf = leanstep.GradPlan(grads).norm(norm_type=p)
    assert norm.dtype == torch.float32 and norm.shape == (1,)
    assert found_inf.item() == 0.0
    # Sums of p-th powers in double, one rounding to fp32 at the end (plus
    # the root): a few fp32 ulps.
    assert_within_ulps(norm, np.array([oracle_norm(grads, p)]), torch.float32, ulps=4)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_found_inf_and_nan_propagation(where, bad, torch_gen):
    _, grads, _ = flat_grads(torch.float16, torch_gen)
    nonempty = [g for g in grads if g.numel()]
    target = {"first": nonempty[0].view(-1)[0:1], "middle": nonempty[len(nonempty) // 2].view(-1)[3:4],
              "last": nonempty[-1].view(-1)[-1:]}[where]
    target.fill_(bad)
    plan = leanstep.GradPlan(grads)
    _, found_inf = plan.norm()
    assert found_inf.item() == 1.0
    inf_norm, _ = plan.norm(norm_type=math.inf)
    if math.isnan(bad):
        assert math.isnan(inf_norm.item())  # a NaN is never dropped by the max
    else:
        assert inf_norm.item() == math.inf


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unscale_in_the_same_pass(dtype, torch_gen):
    _, grads, _ = flat_grads(dtype, torch_gen, scale=64.0)
    before = [g.clone() for g in grads]
    inv_scale = 1.0 / 1024
    # The oracle is computed from copies taken BEFORE the call (the call unscales in place):
    # cast(float(x) * inv_scale), fp32 math, one rounding, as torch does.
    expected = [(b.float() * inv_scale).to(dtype) for b in before]
    norm, found_inf = leanstep.GradPlan(grads).norm(inv_scale=torch.tensor([inv_scale]))
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)
    assert found_inf.item() == 0.0
    assert_within_ulps(norm, np.array([oracle_norm(expected, 2.0)]), torch.float32, ulps=4)
    # A Python number works as well: the grads are unscaled in place once more (x 2).
    again = [(e.float() * 2.0).to(dtype) for e in expected]
    norm2, _ = leanstep.GradPlan(grads).norm(inv_scale=2.0)
    for g, a in zip(grads, again):
        assert torch.equal(g, a)
    assert_within_ulps(norm2, np.array([oracle_norm(again, 2.0)]), torch.float32, ulps=4)
    # The norm is the norm of the unscaled values, not of the inputs.
    assert not math.isclose(norm2.item(), oracle_norm(before, 2.0), rel_tol=0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_in_place_matches_megatron_formula(dtype, max_norm, torch_gen):
    buffers, grads, _ = flat_grads(dtype, torch_gen)
    ptr = buffers[0].data_ptr()
    before = [g.clone() for g in grads]
    plan = leanstep.GradPlan(grads)
    norm, _ = plan.norm()
    coeff = plan.clip_(max_norm, norm)
    expected = min(1.0, float(np.float32(max_norm) / (norm.float() + np.float32(1e-6)).item()))
    assert coeff.item() == pytest.approx(expected, rel=2 * UNIT_ROUNDOFF[torch.float32])
    for g, b in zip(grads, before):
        assert torch.equal(g, (b.float() * coeff).to(dtype))  # fp32 math, one rounding
    if max_norm > norm.item():
        assert coeff.item() == 1.0
        for g, b in zip(grads, before):
            assert torch.equal(g, b)  # scaling by exactly 1 is bit-identical
    assert buffers[0].data_ptr() == ptr  # the caller's buffer, no copy


def test_norm_clip_and_count_zeros(torch_gen):
    _, grads, _ = flat_grads(torch.float32, torch_gen)
    grads[1].view(-1)[:10] = 0
    grads[5].view(-1)[::3] = 0
    plan = leanstep.GradPlan(grads)
    zeros = plan.count_zeros()
    assert zeros.dtype == torch.int64
    assert zeros.item() == sum(g.numel() - torch.count_nonzero(g).item() for g in grads)
    norm, found_inf, coeff = plan.norm_clip_(0.1)
    assert found_inf.item() == 0 and coeff.item() < 1
    assert_within_ulps(leanstep.GradPlan(grads).norm()[0], np.array([0.1]), torch.float32, ulps=8)


def test_numpy_grads_and_scalars(rng):
    buf = rng.standard_normal(1000).astype(np.float32)
    grads = [buf[600:], buf[:600].reshape(20, 30)]
    plan = leanstep.GradPlan(grads)
    norm, found_inf = plan.norm()
    assert isinstance(norm, np.ndarray) and norm.dtype == np.float32
    assert_within_ulps(norm, np.array([np.linalg.norm(buf.astype(np.float64))]), torch.float32, ulps=4)
    plan.clip_(1.0, norm)
    assert abs(np.linalg.norm(buf.astype(np.float64)) - 1.0) < 1e-5


def test_empty_list_and_empty_tensors():
    plan = leanstep.GradPlan([])
    norm, found_inf = plan.norm()
    assert norm.item() == 0.0 and found_inf.item() == 0.0
    assert plan.count_zeros().item() == 0
    plan = leanstep.GradPlan([torch.empty(0), torch.empty(0, 3, dtype=torch.bfloat16)])
    assert plan.norm()[0].item() == 0.0


def test_multi_tensor_scale_mixed_dtypes_round_once(torch_gen):
    src = [torch.tensor([1e5, -3.0, 7.5]), randn((33,), torch.float16, torch_gen),
           randn((17,), torch.bfloat16, torch_gen), torch.empty(0)]
    dst = [torch.empty(3, dtype=torch.float16), torch.empty(33), torch.empty(17, dtype=torch.float16),
           torch.empty(0, dtype=torch.bfloat16)]
    found_inf = leanstep.multi_tensor_scale(src, dst, 0.01)
    assert found_inf.item() == 0.0
    assert dst[0][0].item() == pytest.approx(1000.0, rel=1e-3)  # no overflow through fp16
    for s, d in zip(src, dst):
        expected = (s.double() * np.float32(0.01)).float().to(d.dtype)
        # fp32 product (one fp32 rounding) then one rounding to the destination.
        assert_within_ulps(d, to_f64(expected), d.dtype, ulps=1)
    src[1][5] = math.nan
    assert leanstep.multi_tensor_scale(src, dst, 0.5).item() == 1.0
    # In place: the same list as input and output.
    x = torch.tensor([2.0, 4.0])
    leanstep.multi_tensor_scale([x], [x], torch.tensor([0.25]))
    assert x.tolist() == [0.5, 1.0]


def test_errors_surface_as_leanstep_errors():
    with pytest.raises(leanstep.Error, match="grads\\[1\\]"):
        leanstep.GradPlan([torch.zeros(3), torch.zeros(3, dtype=torch.int32)])
    plan = leanstep.GradPlan([torch.ones(4)])
    with pytest.raises(leanstep.Error, match="'norm_type' must be > 0"):
        plan.norm(norm_type=-1)
    with pytest.raises(leanstep.Error, match="'max_norm' must be finite and >= 0"):
        plan.clip_(-1.0, plan.norm()[0])
    with pytest.raises(leanstep.Error, match="must have exactly 1 element"):
        plan.clip_(1.0, torch.ones(2))
    with pytest.raises(leanstep.Error, match="out"):
        leanstep.multi_tensor_scale([torch.ones(3)], [torch.ones(2)], 1.0)
    with pytest.raises(leanstep.Error, match="model"):
        leanstep.model_params("gpt5")


def test_benchmark_layouts_are_available():
    params = leanstep.model_params("qwen3_omni_lora")
    assert len(params) > 100 and any(p[3] for p in params)  # expert params present
    buffers, grads, layouts = leanstep.ddp_grad_buffers(params, distributed_optimizer=True, dp_size=8)
    assert len(grads) == len(params) and len(layouts) == 2  # dense + expert buffers
    assert sum(g.numel() for g in grads) == sum(math.prod(p[1]) for p in params)
