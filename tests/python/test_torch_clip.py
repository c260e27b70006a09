"""leanstep.torch.clip_grad_norm_ / get_total_norm / clip_grads_with_norm_
against torch's own functions on torch's own cases, and GradBuffer.

Bounds, and why:
- the total norm: leanstep accumulates in fp32 (each |x|^p, then the p-th
  root) and rounds once to torch's dtype. Against a float64 oracle its error is
  at most the fp32 accumulation's (n * 2^-24 relative for n summed terms, times
  1/p through the root) plus half an ulp of the result dtype;
- the clipped grads: given the same total_norm, torch's coefficient is
  computed by torch's ops and applied with one rounding, as _foreach_mul_
  does: bit-identical to torch's clip_grads_with_norm_.
"""

import math

import pytest
import torch

import leanstep
import leanstep.torch as lt
from leanstep import _torch_clip
from helpers import FLOAT_DTYPES

pytestmark = pytest.mark.skipif("grad" not in leanstep.areas, reason="grad not built")

NORM_TYPES = [0.5, 1.0, 2.0, 4.0, math.inf]
SIZES = [3, 17, 1, 100, 257]


def params_with_grads(sizes, dtype, gen, scale=1.0):
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.empty(n, dtype=dtype))
        p.grad = (torch.randn(n, generator=gen) * scale).to(dtype)
        ps.append(p)
    return ps


def twins(ps):
    """Parameters with copies of ps' grads, for torch's own function."""
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def oracle_norm(grads, p):
    flat = torch.cat([g.detach().double().reshape(-1) for g in grads])
    return flat.abs().max().item() if p == math.inf else flat.norm(p).item()


def norm_bound(grads, p, dtype):
    n = sum(g.numel() for g in grads)
    fp32 = n * 2.0**-24 * (1.0 if p == math.inf else max(1.0, 1.0 / p))
    return fp32 + 0.5 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_total_norm_within_bound_of_float64_and_torch_dtype(dtype, norm_type, torch_gen):
    ps = params_with_grads(SIZES, dtype, torch_gen, scale=3.0)
    grads = [p.grad for p in ps]
    ours = lt.get_total_norm(grads, norm_type)
    theirs = torch.nn.utils.get_total_norm(grads, norm_type)
    assert _torch_clip.last_decision["get_total_norm"]["path"] == "leanstep"
    assert ours.dtype == theirs.dtype and ours.device == theirs.device
    assert ours.shape == theirs.shape == ()
    exact = oracle_norm(grads, norm_type)
    if exact > torch.finfo(dtype).max:  # fp16's 0.5-norm of these: past 65504, inf as torch's
        assert math.isinf(ours.item()) and math.isinf(theirs.item())
        return
    assert abs(ours.item() - exact) <= norm_bound(grads, norm_type, dtype) * exact


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("foreach", [None, True, False])
def test_clip_grad_norm_matches_torch(dtype, norm_type, foreach, torch_gen):
    ps = params_with_grads(SIZES, dtype, torch_gen, scale=0.25)
    ps[2].grad = None  # a param without a grad is skipped
    qs = twins(ps)
    max_norm = 0.05
    ours = lt.clip_grad_norm_(ps, max_norm, norm_type, foreach=foreach)
    exact = oracle_norm([q.grad for q in qs if q.grad is not None], norm_type)
    assert exact < torch.finfo(dtype).max  # scale 0.25: finite in fp16 too
    assert abs(ours.item() - exact) <= norm_bound([q.grad for q in qs if q.grad is not None],
                                                  norm_type, dtype) * exact
    # Clipped by the same norm, the grads are torch's, bit for bit.
    torch.nn.utils.clip_grads_with_norm_(qs, max_norm, ours.clone(), foreach=foreach)
    for p, q in zip(ps, qs):
        if q.grad is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, q.grad)
    theirs = torch.nn.utils.clip_grad_norm_(twins(qs), max_norm, norm_type, foreach=foreach)
    assert ours.dtype == theirs.dtype


def test_the_native_coefficient_is_torchs_bit_for_bit(monkeypatch, torch_gen):
    # An fp32 norm on the CPU kernels: torch's coefficient and multiply in one native
    # call (grad::torch_clip_coefficient). Against torch's clip_grads_with_norm_ over
    # random norms and max_norms (the edge ones too), fp32 and bf16 grads of odd sizes
    # in one list: the same grads, bit for bit. max_norm past the largest fp32 (and a
    # negative one) take torch's own ops, as a bf16 norm does.
    from leanstep._grad import GradPlan

    calls = []
    native = GradPlan.torch_rule_clip_
    monkeypatch.setattr(GradPlan, "torch_rule_clip_",
                        lambda self, *a: (calls.append(a), native(self, *a))[1])
    norms = [0.0, 1e-45, 1e-7, 0.999999, 1.0, 3.5, 1e30, math.inf, math.nan]
    norms += (10.0 ** (torch.rand(40, generator=torch_gen, dtype=torch.float64) * 8 - 4)).tolist()
    max_norms = [0.0, 1e-3, 0.05, 1.0, 7.25, 3.0e38, 1e39, -1.0]
    expect_native = 0
    for i, norm in enumerate(norms):
        max_norm = max_norms[i % len(max_norms)]
        ps = params_with_grads([3, 17, 1, 100], torch.float32, torch_gen)
        ps += params_with_grads([5, 33], torch.bfloat16, torch_gen)
        qs = twins(ps)
        total = torch.tensor(norm, dtype=torch.float32)
        lt.clip_grads_with_norm_(ps, max_norm, total)
        torch.nn.utils.clip_grads_with_norm_(qs, max_norm, total.clone())
        for p, q in zip(ps, qs):
            assert torch.equal(p.grad, q.grad) or (p.grad.isnan().all() and q.grad.isnan().all()), \
                (norm, max_norm)
        expect_native += 0.0 <= max_norm <= torch.finfo(torch.float32).max
    assert len(calls) == expect_native > 0
    # A bf16 norm keeps torch's ops (bf16 arithmetic).
    ps = params_with_grads([9], torch.bfloat16, torch_gen)
    qs = twins(ps)
    lt.clip_grads_with_norm_(ps, 0.1, torch.tensor(2.0, dtype=torch.bfloat16))
    torch.nn.utils.clip_grads_with_norm_(qs, 0.1, torch.tensor(2.0, dtype=torch.bfloat16))
    assert torch.equal(ps[0].grad, qs[0].grad) and len(calls) == expect_native


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_small_grads_are_left_unchanged(dtype, torch_gen):
    ps = params_with_grads(SIZES, dtype, torch_gen, scale=1e-3)
    before = [p.grad.clone() for p in ps]
    lt.clip_grad_norm_(ps, 1.0)
    for p, b in zip(ps, before):
        assert torch.equal(p.grad, b)


def test_single_tensor_input(torch_gen):
    p = params_with_grads([41], torch.float32, torch_gen, scale=5.0)[0]
    q = twins([p])[0]
    ours = lt.clip_grad_norm_(p, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(q, 1.0)
    assert abs(ours.item() - theirs.item()) <= 41 * 2.0**-24 * theirs.item()
    assert torch.allclose(p.grad, q.grad, rtol=2.0**-22, atol=0)
    assert lt.get_total_norm(p.grad).shape == ()


def test_empty_and_no_grads():
    assert torch.equal(lt.get_total_norm([]), torch.tensor(0.0))
    p = torch.nn.Parameter(torch.ones(3))
    assert torch.equal(lt.clip_grad_norm_([p], 1.0), torch.tensor(0.0))
    with pytest.warns(UserWarning, match="empty generator"):
        lt.clip_grad_norm_((q for q in []), 1.0)
    lt.clip_grads_with_norm_([p], 1.0, torch.tensor(2.0))  # nothing to clip: no error
    assert p.grad is None


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_non_finite_as_torch(bad, norm_type, torch_gen):
    ps = params_with_grads([5, 4], torch.float32, torch_gen)
    ps[1].grad[2] = bad
    qs = twins(ps)
    ours = lt.clip_grad_norm_(ps, 1.0, norm_type)
    theirs = torch.nn.utils.clip_grad_norm_(qs, 1.0, norm_type)
    assert (math.isnan(ours.item()), math.isinf(ours.item())) == \
        (math.isnan(theirs.item()), math.isinf(theirs.item()))
    for p, q in zip(ps, qs):  # scaled by the non-finite norm anyway, as torch
        assert torch.equal(p.grad.isnan(), q.grad.isnan())
        assert torch.equal(torch.nan_to_num(p.grad), torch.nan_to_num(q.grad))
    ps = params_with_grads([5, 4], torch.float32, torch_gen)
    ps[0].grad[1] = bad
    before = [p.grad.clone() for p in ps]
    with pytest.raises(RuntimeError, match="is non-finite, so it cannot be clipped"):
        lt.clip_grad_norm_(ps, 1.0, norm_type, error_if_nonfinite=True)
    for p, b in zip(ps, before):  # the error comes before any grad is touched
        assert torch.equal(p.grad.nan_to_num(), b.nan_to_num())


def test_mixed_dtypes_promote_as_torch(torch_gen):
    ps = params_with_grads([7], torch.bfloat16, torch_gen) + \
        params_with_grads([9], torch.float32, torch_gen)
    ours = lt.get_total_norm([p.grad for p in ps])
    theirs = torch.nn.utils.get_total_norm([p.grad for p in ps])
    assert ours.dtype == theirs.dtype == torch.float32


def test_calls_leanstep_does_not_plan_go_to_torch(torch_gen):
    ps = params_with_grads([7, 5], torch.float64, torch_gen)
    ours = lt.get_total_norm([p.grad for p in ps])
    assert _torch_clip.last_decision["get_total_norm"] == {"path": "torch", "reason": "dtype"}
    assert ours.item() == torch.nn.utils.get_total_norm([p.grad for p in ps]).item()
    ps = params_with_grads([7, 5], torch.float32, torch_gen)
    ps[0].grad[:3] = 0
    assert lt.get_total_norm([p.grad for p in ps], 0).item() == 2.0  # nonzero norms, torch's
    assert _torch_clip.last_decision["get_total_norm"]["reason"] == "norm_type"
    with pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
        lt.get_total_norm([torch.ones(2), torch.empty(0)], math.inf)


def test_dtensor_grads_are_refused():
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.tensor import DTensor, Replicate, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        grad = DTensor.from_local(torch.ones(4), mesh, [Replicate()])
        with pytest.raises(leanstep.Error, match=r"argument 'tensors' holds a DTensor grad"):
            lt.get_total_norm([torch.ones(3), grad])
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.ones(4)
        holder = type("P", (), {})()
        holder.grad = grad
        with pytest.raises(leanstep.Error, match=r"argument 'parameters' holds a DTensor"):
            lt.clip_grad_norm_([p, holder], 1.0)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- GradBuffer


def small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model[0].bias.requires_grad_(False)
    return model


def test_grad_buffer_views_accumulate_in_place_and_clip_in_one_region():
    model = small_model()
    x = torch.randn(4, 6)
    model(x).square().sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    buffer = lt.GradBuffer(model.parameters())
    assert len(buffer.params) == 3 and len(buffer.buffers) == 1
    flat = buffer.buffers[0]
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad._base is flat  # still the view: accumulated in place
            assert torch.allclose(p.grad, expected[n], rtol=1e-6, atol=1e-7)
        else:
            assert p.grad is None
    grads = [p.grad for p in buffer.params]
    plan = _torch_clip.plans.get(grads)[0]
    assert plan.num_regions == 1 and plan.num_generic == 0
    twin = [g.clone() for g in grads]
    norm = lt.clip_grad_norm_(buffer.params, 0.1)
    torch.nn.utils.clip_grads_with_norm_([type("P", (), {"grad": t})() for t in twin], 0.1,
                                         norm.clone())
    for g, t in zip(grads, twin):
        assert torch.equal(g, t)


def test_grad_buffer_zero_grad_keeps_views_and_reattaches():
    model = small_model()
    buffer = lt.GradBuffer(model.parameters())
    buffer.install(model)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    model.zero_grad()  # the buffer's: zeros, views kept
    assert all(p.grad is not None and not p.grad.any() for p in buffer.params)
    assert buffer.attached()
    for p in buffer.params:
        p.grad = None  # something else set them to None
    assert not buffer.attached()
    model.zero_grad()
    assert buffer.attached()
    model(x).sum().backward()
    twice = [p.grad.clone() for p in buffer.params]
    model(x).sum().backward()  # accumulates
    for p, once in zip(buffer.params, twice):
        assert torch.allclose(p.grad, 2 * once)
    buffer.uninstall()
    assert "zero_grad" not in model.__dict__
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_grad_buffer_keeps_existing_grads_and_release_copies_them():
    model = small_model()
    model(torch.randn(2, 6)).sum().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    buffer = lt.GradBuffer(model.parameters())
    after = [p.grad for p in buffer.params]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    flat = buffer.buffers[0]
    buffer.release()
    for p, b in zip([p for p in model.parameters() if p.grad is not None], before):
        assert p.grad._base is not flat and torch.equal(p.grad, b)


def test_grad_buffer_refuses_float64():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(leanstep.Error, match="GradBuffer: argument 'params' holds a "
                                             "torch.float64 parameter"):
        lt.GradBuffer([p])
