"""Per-phase timers of the main job (leanstep.megatron.phases): what they time,
that they time forward and backward, that a nested call counts once, that the
gradients are unchanged, and that every wrapped attribute is restored."""

import sys
import time
import types

import pytest

torch = pytest.importorskip("torch")

from leanstep.megatron import phases  # noqa: E402

SLEEP = 0.02  # long against the timers' own cost (microseconds), short for a test


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP)
        return grad * ctx.scale, None


def permute(tokens, routing_map, probs=None):
    time.sleep(SLEEP)
    out = _SlowBackward.apply(tokens, 2.0)
    return out, None if probs is None else probs * 3.0, routing_map


def unpermute(tokens):
    return permute(tokens, None)[0]  # nested: counted once, by the outer call


@pytest.fixture
def fake_megatron(monkeypatch):
    """A token-dispatcher module holding permute / unpermute, as Megatron's does."""
    mod = types.ModuleType("megatron.core.transformer.moe.token_dispatcher")
    mod.permute, mod.unpermute = permute, unpermute
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_forward_and_backward_of_a_wrapped_function_are_timed_and_restored(fake_megatron):
    x = torch.randn(5, 3, requires_grad=True)
    p = torch.randn(5, requires_grad=True)
    with phases.PhaseTimers() as timers:
        assert fake_megatron.permute is not permute  # wrapped at the call site
        out, probs, _ = fake_megatron.permute(x, "map", probs=p)
        forward = timers.totals()[phases.MOE_PHASE]
        assert SLEEP <= forward < SLEEP + 0.5
        (out.sum() + probs.sum()).backward()
        both = timers.totals()[phases.MOE_PHASE]
        # The backward's sleep lies between the outputs' and the inputs' marks.
        assert both - forward >= SLEEP, (forward, both)
        assert "megatron.core.transformer.moe.token_dispatcher.permute" in timers.sites[phases.MOE_PHASE]
        timers.reset()
        assert timers.totals() == dict.fromkeys(phases.PHASES, 0.0)
        y = torch.randn(4, 2, requires_grad=True)
        fake_megatron.unpermute(y)
        nested = timers.totals()[phases.MOE_PHASE]
        assert SLEEP <= nested < 2 * SLEEP, nested  # one sleep, counted once
    assert fake_megatron.permute is permute and fake_megatron.unpermute is unpermute
    # The marks change no gradient: the same values as without the timers.
    assert torch.equal(x.grad, torch.full_like(x, 2.0))
    assert torch.equal(p.grad, torch.full_like(p, 3.0))


def test_outputs_that_need_no_gradient_and_no_grad_mode(fake_megatron):
    x = torch.randn(3, 2)  # no gradient anywhere: nothing is marked
    with phases.PhaseTimers() as timers:
        out, probs, rm = fake_megatron.permute(x, "map")
        assert probs is None and rm == "map" and not out.requires_grad
        with torch.no_grad():
            out2, _, _ = fake_megatron.permute(torch.randn(3, 2, requires_grad=True), "map")
        assert not out2.requires_grad
        assert timers.totals()[phases.MOE_PHASE] >= 2 * SLEEP


def test_rmsnorm_modules_are_timed_forward_and_backward_with_the_same_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8), torch.nn.Linear(8, 8),
                                torch.nn.RMSNorm(8))
    x = torch.randn(6, 8)

    def grads():
        model.zero_grad()
        model(x).square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    before = grads()
    with phases.PhaseTimers(model) as timers:
        assert timers.sites[phases.RMSNORM_PHASE] == ["1", "3"]
        inside = grads()
        assert timers.totals()[phases.RMSNORM_PHASE] > 0
        timers.reset()
        with torch.no_grad():  # forward only: still timed
            model(x)
        assert timers.totals()[phases.RMSNORM_PHASE] > 0
    after = grads()
    for a, b, c in zip(before, inside, after):
        assert torch.equal(a, b) and torch.equal(a, c)
    # The wrappers are gone: every module's forward is its class's again.
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_timers_leave_leanstep_norms_on_leanstep_path():
    # Module hooks would send leanstep's RMSNorm to torch ("debug_hooks"): the timers
    # wrap forward instead, so what is timed is what runs without them.
    import leanstep.torch as lt

    ref = torch.nn.RMSNorm(16, eps=1e-6)
    ref.weight.requires_grad_(False)
    norm = lt.RMSNorm.from_torch(ref, frozen_only=True, exact_forward=True)
    x = torch.randn(5, 16, requires_grad=True)
    norm(x).sum().backward()
    untimed = dict(norm.last_decision)
    assert untimed["path"] == "frozen_fused", untimed
    with phases.PhaseTimers(norm) as timers:
        norm(x).sum().backward()
        assert norm.last_decision == untimed
        assert not (norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks
                    or norm._backward_pre_hooks)
        assert timers.totals()[phases.RMSNORM_PHASE] > 0


def test_only_loaded_modules_are_touched(monkeypatch):
    for name in list(sys.modules):
        if name.startswith("megatron"):
            monkeypatch.delitem(sys.modules, name)
    with phases.PhaseTimers() as timers:
        # leanstep's own step, where loaded, is its one site outside Megatron
        assert all(not site.startswith("megatron") for sites in timers.sites.values()
                   for site in sites), timers.sites
    assert not any(name.startswith("megatron") for name in sys.modules)


class _SlowNorm(torch.nn.RMSNorm):
    def forward(self, x):
        return _SlowBackward.apply(super().forward(x), 1.0)


def test_an_rmsnorm_backward_is_inside_its_span():
    norm = _SlowNorm(4)
    x = torch.randn(3, 4, requires_grad=True)
    with phases.PhaseTimers(norm) as timers:
        y = norm(x)
        forward = timers.totals()[phases.RMSNORM_PHASE]
        assert forward < SLEEP
        y.sum().backward()
        assert timers.totals()[phases.RMSNORM_PHASE] - forward >= SLEEP


class _SlowIdentity(torch.autograd.Function):
    """An op outside the timed call whose backward sleeps: before or after the span."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLEEP)
        return grad


def test_the_span_holds_the_calls_backward_and_nothing_around_it(fake_megatron):
    # Backward runs downstream first: the consumer's sleep comes before the call's outputs
    # get their gradient, the producer's sleep after its inputs have theirs. Only the call's
    # own backward sleep lies between.
    x = torch.randn(4, 3, requires_grad=True)
    with phases.PhaseTimers() as timers:
        out, _, _ = fake_megatron.permute(_SlowIdentity.apply(x), "map")
        forward = timers.totals()[phases.MOE_PHASE]
        _SlowIdentity.apply(out).sum().backward()
        backward = timers.totals()[phases.MOE_PHASE] - forward
    assert SLEEP <= backward < 2 * SLEEP, backward
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_an_output_used_twice_and_changed_in_place_is_timed_once(fake_megatron):
    # Its gradient is complete only after both uses; the in-place op after the call moves the
    # tensor to another node, not the call's own.
    x = torch.randn(4, 3, requires_grad=True)
    with phases.PhaseTimers() as timers:
        out, _, _ = fake_megatron.permute(x, "map")
        other = out * 5.0
        out.add_(1.0)
        forward = timers.totals()[phases.MOE_PHASE]
        (_SlowIdentity.apply(out).sum() + other.sum()).backward()
        backward = timers.totals()[phases.MOE_PHASE] - forward
    assert SLEEP <= backward < 2 * SLEEP, backward
    assert torch.equal(x.grad, torch.full_like(x, 12.0))  # (1 + 5) * 2


def _graph_nodes(tensor):
    seen, stack = [], [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or any(node is n for n in seen):
            continue
        seen.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return seen


def test_the_marks_add_no_python_node_to_the_graph():
    # A Python autograd node costs tens of microseconds forward and backward, more than a
    # small norm call it would time: the marks are a view and hooks on C++ nodes.
    norm = torch.nn.RMSNorm(8)
    x = torch.randn(3, 8, requires_grad=True)
    untimed = [type(n).__name__ for n in _graph_nodes(norm(x))]
    with phases.PhaseTimers(norm):
        y = norm(x)
    timed = [type(n).__name__ for n in _graph_nodes(y)]
    assert "BackwardCFunction" not in untimed
    assert all(not name.endswith("BackwardCFunction") and not name.startswith("_Mark")
               for name in timed), timed
    assert sorted(timed) == sorted(untimed + ["ViewBackward0"]), (timed, untimed)


def test_the_grad_phases_collectives_start_their_timers_after_the_barrier(monkeypatch):
    # As Megatron's level-1 timers with barrier_with_L1_time: the barrier (its wait for a
    # late rank, here a sleep) runs before the timer of each call with an all-reduce
    # inside (the norm, the zero count), not before the clip, not for a nested call, and
    # its time is outside the phase.
    from leanstep.megatron import grad as lm_grad

    calls = []
    mod = types.ModuleType(lm_grad.OPTIMIZER)

    def get_grad_norm_fp32(grads):
        calls.append("norm")
        time.sleep(SLEEP)
        return mod.count_zeros_fp32(grads)  # nested: no barrier, counted once

    def clip_grad_by_total_norm_fp32(params, max_norm, total_norm):
        calls.append("clip")

    def count_zeros_fp32(params):
        calls.append("zeros")
        return 0

    mod.get_grad_norm_fp32 = get_grad_norm_fp32
    mod.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mod.count_zeros_fp32 = count_zeros_fp32
    monkeypatch.setitem(sys.modules, mod.__name__, mod)

    def barrier():
        calls.append("barrier")
        time.sleep(4 * SLEEP)

    with phases.PhaseTimers(barrier=barrier) as timers:
        mod.get_grad_norm_fp32([])
        mod.clip_grad_by_total_norm_fp32([], 1.0, 2.0)
        mod.count_zeros_fp32([])
        total = timers.totals()[phases.GRAD_PHASE]
    assert calls == ["barrier", "norm", "zeros", "clip", "barrier", "zeros"], calls
    assert SLEEP <= total < 3 * SLEEP, total  # the norm's sleep, none of the barriers' (4 each)
    calls.clear()
    with phases.PhaseTimers() as timers:  # no barrier: the calls alone
        mod.get_grad_norm_fp32([])
        mod.count_zeros_fp32([])
    assert calls == ["norm", "zeros", "zeros"], calls
    assert mod.get_grad_norm_fp32 is get_grad_norm_fp32


def test_leanstep_steps_own_unscale_is_in_the_grad_phase(monkeypatch):
    # leanstep's optimizer step (fp16) shadows the unscale method on each optimizer with
    # its sync-free version, which it calls through its module's global: that call is
    # timed into the grad phase too, after the barrier, and put back on exit.
    from leanstep.megatron import step as lstep

    calls = []

    def unscale(optimizer):
        calls.append("unscale")
        time.sleep(SLEEP)
        return optimizer

    def barrier():
        calls.append("barrier")

    monkeypatch.setattr(lstep, "unscale_and_check_on_device", unscale)
    with phases.PhaseTimers(barrier=barrier) as timers:
        assert lstep.unscale_and_check_on_device is not unscale
        assert f"{lstep.__name__}.unscale_and_check_on_device" in timers.sites[phases.GRAD_PHASE]
        assert lstep.unscale_and_check_on_device("opt") == "opt"
        assert calls == ["barrier", "unscale"]
        assert SLEEP <= timers.totals()[phases.GRAD_PHASE] < 3 * SLEEP
    assert lstep.unscale_and_check_on_device is unscale
