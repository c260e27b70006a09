"""The sync-free optimizer step (leanstep.megatron.step), on the megatron-core of
this interpreter (0.16.1 on Python 3.11, 0.19.2 on 3.12):

- the loss scale on the device follows DynamicGradScaler's trajectory exactly;
- the masked inner update equals torch's Adam / AdamW bit for bit, and leaves
  parameters, moments and step counters unchanged on a skipped step;
- the main job's model in fp16, 20 steps with overflows injected: leanstep's step
  skips the same steps as Megatron's and keeps bit-identical parameters, moments,
  step counters and loss scales (against Megatron's step running the same
  kernels), and the same skips and scales as Megatron alone;
- a whole iteration (forward, backward, DDP reduction, optimizer step), fp16 and
  bf16, reads no device memory but the dispatcher's token counts
  (leanstep.audit.DeviceMemory), where Megatron's reads its found_inf and norm.
"""

import math
import os
import random

import pytest
import torch

pytest.importorskip("megatron.core")

import leanstep  # noqa: E402
import leanstep.megatron as lm  # noqa: E402
from leanstep.audit import DeviceMemory  # noqa: E402
from leanstep.megatron import cpu as mcpu  # noqa: E402
from leanstep.megatron import step as lstep  # noqa: E402
from leanstep.megatron import train as main_job  # noqa: E402
from megatron.core.optimizer.grad_scaler import DynamicGradScaler  # noqa: E402

from helpers import (MAIN_JOB_SMALL, megatron_cpu_session, megatron_installed,  # noqa: E402
                     overflow_at)

# The data is the corpus of the source tree or of the installed package.
SMALL = MAIN_JOB_SMALL


@pytest.fixture(scope="module", autouse=True)
def gloo_and_cpu():
    with megatron_cpu_session():
        yield


@pytest.fixture
def installed():
    with megatron_installed():
        yield


# ---------------------------------------------------------------- the loss scale


def _scaler(hysteresis, interval):
    return DynamicGradScaler(initial_scale=2.0 ** 12, min_scale=2.0 ** 9, growth_factor=2.0,
                             backoff_factor=0.5, growth_interval=interval, hysteresis=hysteresis)


@pytest.mark.parametrize("hysteresis,interval", [(1, 1), (2, 3), (3, 2), (2, 1000)])
def test_the_loss_scale_on_the_device_follows_megatron(hysteresis, interval, rng):
    rng = random.Random(int(rng.integers(2**31)))
    theirs, ours = _scaler(hysteresis, interval), _scaler(hysteresis, interval)
    for i in range(60):
        found = rng.random() < 0.35
        theirs.update(found)
        lstep.update_scaler_on_device(ours, torch.tensor([1.0 if found else 0.0]))
        assert type(ours).__mro__[1] is DynamicGradScaler  # the same class underneath
        assert torch.equal(ours.scale, theirs.scale), (i, ours.scale, theirs.scale)
        assert ours.scale is not theirs.scale and ours.scale.dtype == torch.float32
        assert (ours._growth_tracker, ours._hysteresis_tracker) == \
            (theirs._growth_tracker, theirs._hysteresis_tracker), i
    # The checkpoint is Megatron's (Python ints); loading one puts the trackers back.
    assert ours.state_dict()["growth_tracker"] == theirs.state_dict()["growth_tracker"]
    saved = theirs.state_dict()
    ours.load_state_dict({**saved, "scale": saved["scale"].clone()})
    assert (ours._growth_tracker, ours._hysteresis_tracker) == \
        (theirs._growth_tracker, theirs._hysteresis_tracker)
    lstep.untrack(ours)
    assert type(ours) is DynamicGradScaler and isinstance(ours._growth_tracker, int)


def test_the_loss_scale_update_reads_nothing():
    s = _scaler(2, 3)
    lstep.track_on_device(s)
    with leanstep.audit() as a:
        for f in (0.0, 1.0, 1.0, 0.0):
            lstep.update_scaler_on_device(s, torch.tensor([f]))
    assert a.num_host_reads == 0 and a.num_syncs == 0, a.format_table()


# ---------------------------------------------------------------- the masked inner update


def _adam_case(rng, gen, kind, decoupled, weight_decay):
    shapes = [(rng.randint(1, 257),) for _ in range(4)] + [(17, 33), (1,)]
    params = [torch.randn(s, dtype=torch.float32, generator=gen) for s in shapes]
    options = {"foreach": False} if kind == "for-loop" else (
        {"foreach": True} if kind == "foreach" else {"fused": True})
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam

    def make():
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        return ps, cls(ps, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay,
                       **options)
    return shapes, make


@pytest.mark.parametrize("kind", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("decoupled,weight_decay", [(True, 0.0), (True, 0.1), (False, 0.01)])
def test_masked_adam_equals_torch_bitwise_and_skips_exactly(kind, decoupled, weight_decay, rng,
                                                           torch_gen):
    rng = random.Random(int(rng.integers(2**31)))
    shapes, make = _adam_case(rng, torch_gen, kind, decoupled, weight_decay)
    ref_params, ref = make()  # Megatron's skip: the step is not called
    our_params, ours = make()
    for step in range(25):
        lr = rng.choice([1e-3, 3e-4, 2e-2])  # a schedule changes lr between steps
        for o in (ref, ours):
            o.param_groups[0]["lr"] = lr
        grads = [torch.randn(s, generator=torch_gen) * 10 ** rng.uniform(-6, 2) for s in shapes]
        skip = rng.random() < 0.3
        if skip:  # an overflow: non-finite grads, found_inf set
            grads[0].view(-1)[0] = rng.choice([math.inf, -math.inf, math.nan])
        else:
            for p, g in zip(ref_params, grads):
                p.grad = g.clone()
            ref.step()
        for p, g in zip(our_params, grads):
            p.grad = g.clone()
        lstep.masked_adam_step(ours, torch.tensor([1.0 if skip else 0.0]))
        for a, b in zip(ref_params, our_params):
            sa, sb = ref.state.get(a, {}), ours.state.get(b, {})
            assert torch.equal(a.detach(), b.detach()), (step, skip)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in sa:
                    assert torch.equal(sa[key].to(sb[key].device), sb[key]), (step, key)
                else:  # never stepped: torch has no state yet, ours starts at zero
                    assert key not in sb or not torch.count_nonzero(sb[key])


@pytest.mark.parametrize("kind", ["for-loop", "foreach"])
def test_masked_adam_with_params_left_without_grads(kind, rng, torch_gen):
    # A param without a grad is not stepped: its counter falls behind, the group's
    # counters differ, and each param takes its own bias corrections.
    rng = random.Random(int(rng.integers(2**31)))
    shapes, make = _adam_case(rng, torch_gen, kind, True, 0.01)
    ref_params, ref = make()
    our_params, ours = make()
    for step in range(12):
        grads = [torch.randn(s, generator=torch_gen) for s in shapes]
        missing = {rng.randrange(len(shapes))} if step % 3 == 1 else set()
        skip = step in (4, 7)
        if skip:
            grads[0].view(-1)[0] = math.nan
        for params, do in ((ref_params, not skip), (our_params, True)):
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if i in missing else g.clone()
        if not skip:
            ref.step()
        lstep.masked_adam_step(ours, torch.tensor([1.0 if skip else 0.0]))
        for a, b in zip(ref_params, our_params):
            assert torch.equal(a.detach(), b.detach()), step
            if a in ref.state:
                assert torch.equal(ref.state[a]["exp_avg"], ours.state[b]["exp_avg"]), step
                assert float(ref.state[a]["step"]) == float(ours.state[b]["step"]), step
    assert ours._leanstep_uniform_steps == {0: False}


def test_masked_adam_reads_nothing():
    params = [torch.nn.Parameter(torch.randn(5)) for _ in range(3)]
    opt = torch.optim.AdamW(params, foreach=False)
    for p in params:
        p.grad = torch.randn(5)
    lstep.masked_adam_step(opt, torch.tensor([0.0]))  # the state exists
    with leanstep.audit() as a:
        lstep.masked_adam_step(opt, torch.tensor([1.0]))
    assert a.num_host_reads == 0 and a.num_syncs == 0, a.format_table()


@pytest.mark.parametrize("change,reason", [
    ({"amsgrad": True}, "adam_amsgrad"), ({"maximize": True}, "adam_maximize"),
    ({"capturable": True}, "adam_capturable"), ({"lr": torch.tensor(1e-3)}, "adam_tensor_hyperparameter")])
def test_adam_options_the_mask_cannot_keep_go_to_megatron(change, reason):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
    opt.param_groups[0].update(change)
    assert lstep._inner_reason(opt) == reason
    assert lstep._inner_reason(torch.optim.SGD([torch.nn.Parameter(torch.randn(3))], lr=0.1)) == \
        "inner_optimizer"
    assert lstep._inner_reason(torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])) is None


def test_a_for_loop_adam_on_cuda_goes_to_megatron():
    """torch's for-loop Adam on CUDA rounds as neither the CPU's for-loop nor
    CUDA's foreach (measured on an H200: foreach=False differs from the
    default); the masked update copies those two only, so that optimizer keeps
    Megatron's step. The same optimizer with foreach left to torch, or on the
    CPU, is masked."""

    class OnCuda(torch.Tensor):  # what the check reads of a CUDA param, without a GPU
        @property
        def is_cuda(self):
            return True

    cuda_param = torch.nn.Parameter(torch.Tensor._make_subclass(OnCuda, torch.randn(3)))
    assert lstep._inner_reason(torch.optim.AdamW([cuda_param], foreach=False)) == \
        "adam_for_loop_on_cuda"
    assert lstep._inner_reason(torch.optim.AdamW([cuda_param])) is None
    assert lstep._inner_reason(torch.optim.AdamW([cuda_param], fused=True)) is None
    cpu_param = torch.nn.Parameter(torch.randn(3))
    assert lstep._inner_reason(torch.optim.AdamW([cpu_param], foreach=False)) is None


def test_device_bool_reads_only_when_asked():
    flag = lstep.DeviceBool(torch.tensor(True))
    with leanstep.audit() as a:
        lstep.DeviceBool(torch.tensor(False))
    assert a.num_host_reads == 0
    assert bool(flag) is True and not lstep.DeviceBool(torch.tensor(False))


# ---------------------------------------------------------------- the main job's model


def _trainer(dtype, *extra):
    ap = main_job.build_parser()
    args = ap.parse_args([*SMALL, "--dtype", dtype, *extra])
    main_job.check_args(ap, args)
    return main_job.Trainer(args, 1, 0, 1)


def _optimizer_state(trainer):
    """Every sub-optimizer's main params, moments and step counters, and loss scale."""
    out = []
    for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p, {})
                out.append(("param", p.detach().clone()))
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    if key in st:
                        out.append((key, st[key].detach().to("cpu").clone()))
        if opt.grad_scaler is not None:
            out.append(("scale", opt.grad_scaler.scale.clone()))
            out.append(("trackers", (opt.grad_scaler._growth_tracker,
                                     opt.grad_scaler._hysteresis_tracker)))
    for p in trainer.model.module.parameters():
        if p.requires_grad:
            out.append(("model param", p.detach().clone()))
    return out


def _run(dtype, preset, steps, injected=(), megatron_step=False):
    leanstep.set_preset(preset)
    if megatron_step:
        lm.uninstall(["optimizer_step", "chained_optimizer_step"])
    trainer = _trainer(dtype, "--initial-loss-scale", "1024", "--loss-scale-window", "3",
                       "--hysteresis", "2").build()
    trainer.before_optimizer_step = overflow_at(injected)
    trajectory = []
    for step in range(steps):
        done = trainer.step(step)
        loss, norm, ok = done.logged()
        trajectory.append({"ok": ok, "loss": loss, "state": _optimizer_state(trainer)})
    if megatron_step:
        lm.install(["optimizer_step", "chained_optimizer_step"])
    return trajectory


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        # Bits, not values: -0.0 and +0.0, NaN payloads.
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return a == b


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fp16_overflow_steps_skip_as_megatron_bit_for_bit(installed):
    steps, injected = 20, {2, 3, 4, 9, 15}
    ours = _run("fp16", "all", steps, injected)
    theirs = _run("fp16", "all", steps, injected, megatron_step=True)
    alone = _run("fp16", "baseline", steps, injected)
    skipped = [not s["ok"] for s in ours]
    assert skipped == [not s["ok"] for s in theirs] == [not s["ok"] for s in alone]
    assert all(skipped[i] for i in injected) and sum(skipped) < steps  # steps were taken too
    for i, (a, b) in enumerate(zip(ours, theirs)):
        # Megatron's step on the same kernels: every value bit-identical, every step.
        assert [k for k, _ in a["state"]] == [k for k, _ in b["state"]]
        for (key, x), (_, y) in zip(a["state"], b["state"]):
            assert _equal(x, y), (i, key)
        assert a["loss"] == b["loss"], i
    for i, (a, c) in enumerate(zip(ours, alone)):
        # Megatron alone: the same loss scales and trackers (they follow the skips).
        scales = [(k, v) for k, v in a["state"] if k in ("scale", "trackers")]
        assert all(_equal(x, y) for (_, x), (_, y) in zip(
            scales, [(k, v) for k, v in c["state"] if k in ("scale", "trackers")])), i
    # The patches ran, and the step was leanstep's.
    assert lm.report()["calls"]["chained_optimizer_step"]["leanstep"] >= steps


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_bf16_steps_equal_megatron_step_bit_for_bit(installed):
    # bf16 (fp32 main params, no loss scale): leanstep's step (device norm, no read) against
    # Megatron's step on the same kernels, 10 steps, every value bit-identical.
    ours = _run("bf16", "all", 10)
    theirs = _run("bf16", "all", 10, megatron_step=True)
    assert all(s["ok"] for s in ours) and all(s["ok"] for s in theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for (key, x), (_, y) in zip(a["state"], b["state"]):
            assert _equal(x, y), (i, key)
        assert a["loss"] == b["loss"], i


# ---------------------------------------------------------------- no read of device memory


INHERENT = "transformer/moe/token_dispatcher.py"


def _device_reads(dtype, preset, steps=3):
    """Device-memory reads of the last of `steps` iterations, by call site."""
    memory = DeviceMemory(mcpu.ACCELERATOR)
    leanstep.set_preset(preset)
    with memory:
        trainer = _trainer(dtype, "--initial-loss-scale", "1024").build()
        if dtype == "fp16":
            trainer.before_optimizer_step = overflow_at({steps - 1})  # the audited step overflows
        for step in range(steps - 1):
            trainer.step(step)
        with leanstep.audit(device_memory=memory, stacklevel_filter="leanstep/megatron/cpu.py") as a:
            done = trainer.step(steps - 1)
        ok = bool(done.ok)
    reads = {}
    for r, n in a.host_reads.items():
        if r.memory == "device":
            key = f"{os.path.basename(r.site.file)}:{r.site.function}"
            reads[key] = reads.get(key, 0) + n
    return reads, a, ok


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_a_whole_iteration_reads_only_the_dispatcher_counts(dtype, installed):
    ours, audit_all, ok = _device_reads(dtype, "all")
    inherent = {k: n for k, n in ours.items() if k.startswith("token_dispatcher.py:")}
    assert ours == inherent, audit_all.format_table()
    # 2 layers: each copies its token counts to the host once (two tensors, one sync).
    assert inherent == {"token_dispatcher.py:_maybe_dtoh_and_synchronize": 4}
    if dtype == "fp16":
        assert ok is False  # the injected overflow was skipped, on the device
    # Megatron's own step reads its found_inf (fp16) or its norm (bf16): the check sees them.
    theirs, audit_base, _ = _device_reads(dtype, "baseline")
    megatron_reads = {k for k in theirs if not k.startswith("token_dispatcher.py:")}
    assert megatron_reads & {"optimizer.py:_unscale_main_grads_and_check_for_nan",
                             "clip_grads.py:get_grad_norm_fp32"}, audit_base.format_table()
    # Host-resident reads (RNG bookkeeping, the for-loop Adam's counters) are told apart.
    assert any(r.memory == "host-resident" for r in audit_base.host_reads)


def test_the_report_names_the_reads_left(installed):
    r = lm.report()
    assert any("token_dispatcher" in site for site in r["inherent_reads"])
    assert "reads of device memory left per iteration" in lm.format_report()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("foreach_reference", [False, True], ids=["cpu-order", "cuda-order"])
def test_the_masked_update_and_the_loss_scale_run_on_meta_tensors(dtype, foreach_reference,
                                                                   monkeypatch):
    # Meta tensors hold no data: any host read raises. Both run to the end, in the
    # update's CPU order and in the order CUDA's foreach Adam rounds it (its branch
    # runs nowhere but on a GPU otherwise).
    monkeypatch.setattr(lstep, "_foreach_reference", lambda device_type: foreach_reference)
    params = [torch.nn.Parameter(torch.empty(7, device="meta", dtype=dtype)) for _ in range(3)]
    opt = torch.optim.AdamW(params, foreach=False, weight_decay=0.1)
    for p in params:
        p.grad = torch.empty(7, device="meta", dtype=dtype)
    found = torch.empty(1, device="meta")
    with leanstep.audit() as first:
        lstep.masked_adam_step(opt, found)
    with leanstep.audit() as a:
        lstep.masked_adam_step(opt, found)
    assert all(opt.state[p]["step"].device.type == "meta" for p in params)
    # The first step reads torch's host counters (host memory) before moving them to the
    # device; after that nothing is read.
    assert first.num_device_reads == 0 and first.num_host_reads == len(params)
    assert a.num_host_reads == 0 and a.num_syncs == 0, a.format_table()
    scaler = DynamicGradScaler.__new__(DynamicGradScaler)  # its __init__ allocates on "cuda"
    scaler._scale = torch.empty(1, device="meta")
    scaler.min_scale = scaler.growth_factor = scaler.backoff_factor = torch.empty(1, device="meta")
    scaler.growth_interval, scaler.hysteresis = 3, 2
    scaler._growth_tracker, scaler._hysteresis_tracker = 0, 2
    lstep.track_on_device(scaler)
    scaler._leanstep_trackers = scaler._leanstep_trackers.to("meta")
    lstep.update_scaler_on_device(scaler, found)
    assert scaler.scale.device.type == "meta"
