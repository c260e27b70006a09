"""Regressions of a hostile probe of the sync-free step, the plan cache, the
audit and the presets, on the megatron-core of this interpreter (0.16.1 on
Python 3.11, 0.19.2 on 3.12). Each test names the defect it holds down:

1. Megatron-LM's train_step tests ``update_successful is True``: the step must
   return a real bool there, or every step counts as skipped;
2. a fused inner AdamW must not re-enter leanstep's shadow of its step;
3. the plan cache must hold no grad memory past the call that used it;
4. the step's values must behave as Megatron's do (formatting, JSON, ints);
5. a cached plan must run over the caller's tensors, never stale ones;
6. the audit must see device-to-host copies, device reads and hidden syncs;
7. concurrent set_preset calls must leave C++ and Python agreeing;
8. the masked Adam update must stay exact across checkpoint loads, shared
   step counters and low-precision params;
9. uninstall must give the loss scaler Megatron's class back (it pickles);
10. a process must exit without nanobind's leak warning.
"""

import copy
import io
import json
import math
import os
import pickle
import random
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

pytest.importorskip("megatron.core")

import leanstep  # noqa: E402
import leanstep.megatron as lm  # noqa: E402
from leanstep import _leanstep  # noqa: E402
from leanstep.audit import DeviceMemory  # noqa: E402
from leanstep.megatron import cpu as mcpu  # noqa: E402
from leanstep.megatron import grad as lm_grad  # noqa: E402
from leanstep.megatron import step as lstep  # noqa: E402
from leanstep.megatron import train as main_job  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.optimizer.grad_scaler import DynamicGradScaler  # noqa: E402

from helpers import (MAIN_JOB_SMALL, megatron_cpu_session, megatron_installed,  # noqa: E402
                     overflow_at)

SMALL = MAIN_JOB_SMALL
STEP_PATCHES = ["optimizer_step", "chained_optimizer_step"]


@pytest.fixture(scope="module", autouse=True)
def gloo_and_cpu():
    with megatron_cpu_session():
        yield


@pytest.fixture
def installed():
    with megatron_installed():
        yield


def _trainer(dtype="fp16", *extra, on_device=False):
    """The main job's model and Megatron optimizer. The main job's loop takes the
    step's device values; a plain Megatron loop does not (``on_device=False``)."""
    ap = main_job.build_parser()
    args = ap.parse_args([*SMALL, "--dtype", dtype, "--initial-loss-scale", "1024",
                          "--loss-scale-window", "3", "--hysteresis", "2", *extra])
    main_job.check_args(ap, args)
    trainer = main_job.Trainer(args, 1, 0, 1).build()
    lstep.keep_results_on_device(trainer.optimizer, on_device)
    return trainer


def _sub_optimizers(trainer):
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


def _bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _state(trainer):
    out = []
    for opt in _sub_optimizers(trainer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out.append(_bits(p))
                for key in ("exp_avg", "exp_avg_sq", "step"):
                    if key in inner.state.get(p, {}):
                        out.append(_bits(inner.state[p][key].to("cpu")))
        if opt.grad_scaler is not None:
            out.append(_bits(opt.grad_scaler.scale))
    return out


# ---------------------------------------------------------------- 1. Megatron-LM's loop


def _logical_and_across_model_parallel_group(value):
    """Megatron-LM's reduction of update_successful (megatron/training/utils.py),
    by its semantics: a rank counts as successful only when its value is the
    object ``True`` (``input is True``); the MIN over the model-parallel group
    (one rank here) is read back as a Python bool."""
    flag = torch.tensor([1 if value is True else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def _megatron_lm_loop(trainer, steps):
    """Megatron-LM's train_step after the optimizer step: the learning-rate
    schedule steps on success, else the iteration counts as skipped."""
    schedule_steps = skipped = 0
    for step in range(steps):
        done = trainer.step(step)
        if _logical_and_across_model_parallel_group(done.ok):
            schedule_steps += 1
        else:
            skipped += 1
    return schedule_steps, skipped


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_megatron_lm_loop_steps_its_schedule_in_fp16(installed):
    trainer = _trainer("fp16")
    assert _megatron_lm_loop(trainer, 6) == (6, 0)
    assert lm.report()["calls"]["chained_optimizer_step"]["leanstep"] == 6  # leanstep's step ran
    # An overflow is still a skipped iteration, as in Megatron's own step.
    trainer = _trainer("fp16")
    trainer.before_optimizer_step = overflow_at({2})
    assert _megatron_lm_loop(trainer, 4) == (3, 1)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_opt_in_returns_device_values_and_reads_nothing(installed):
    trainer = _trainer("fp16", on_device=True)
    trainer.step(0)
    with leanstep.audit() as a:
        ok, norm, _ = trainer.optimizer.step()
    assert isinstance(ok, lstep.DeviceBool) and isinstance(norm, torch.Tensor)
    assert a.num_host_reads == 0, a.format_table()
    assert "is True" in lm.report()["inherent_reads"]["the training loop"]
    # The process-wide opt-in (the ms-swift plugin's) is taken back by uninstall.
    lstep.keep_results_on_device(None, True)
    assert lstep._results_on_device(object.__new__(type("Opt", (), {})))
    lm.uninstall(STEP_PATCHES)
    assert not lstep._results_on_device(object.__new__(type("Opt", (), {})))
    lm.install(STEP_PATCHES)


# ---------------------------------------------------------------- 2. fused inner AdamW


def _fused(trainer):
    for opt in _sub_optimizers(trainer):
        for group in opt.optimizer.param_groups:
            group["fused"] = True
            group["foreach"] = False
    return trainer


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_fused_inner_adamw_steps_as_megatron_does(installed):
    def run(megatron_step):
        if megatron_step:
            lm.uninstall(STEP_PATCHES)
        try:
            trainer = _fused(_trainer("fp16"))
            trainer.before_optimizer_step = overflow_at({1})
            hooks = []
            for opt in _sub_optimizers(trainer):
                opt.optimizer.register_step_post_hook(lambda *a: hooks.append(1))
            oks = [trainer.step(s).logged()[2] for s in range(4)]
            return oks, _state(trainer), len(hooks)
        finally:
            if megatron_step:
                lm.install(STEP_PATCHES)

    ours, theirs = run(False), run(True)
    assert ours[0] == theirs[0] == [True, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1]))
    # torch's hooks run once per taken step, as for Megatron's step (which skips the
    # inner step on an overflow; the fused kernel skips it on the device).
    assert ours[2] >= theirs[2] > 0
    assert lm.report()["calls"]["chained_optimizer_step"]["leanstep"] == 4


# ---------------------------------------------------------------- 3. plan-cache memory


@pytest.fixture
def patched_grad():
    lm.install(["get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"])
    lm_grad.plans.clear()
    try:
        yield
    finally:
        lm.uninstall()


def test_the_plan_cache_keeps_no_fresh_grads_alive(patched_grad):
    # fp16 without grad_reduce_in_fp32: the main grads are new fp32 tensors every step.
    alive = []
    for step in range(11):
        grads = [torch.randn(40) for _ in range(4)]
        alive += [weakref.ref(g) for g in grads]
        norm = clip_grads.get_grad_norm_fp32(grads)
        expected = torch.linalg.vector_norm(torch.cat(grads).double())
        assert abs(float(norm) - float(expected)) <= 1e-6 * float(expected)
        del grads
    assert not any(ref() is not None for ref in alive), "the cache kept grads alive"
    assert len(lm_grad.plans) <= 8


def test_cached_plans_hold_no_storage_of_the_persistent_buffers_either(patched_grad):
    buf = torch.randn(64)
    grads = [buf[:16], buf[16:48].view(4, 8), buf[48:]]
    clip_grads.get_grad_norm_fp32(grads)
    ref = weakref.ref(buf)
    del buf, grads
    assert ref() is None


# ---------------------------------------------------------------- 5. never a stale plan


def test_a_cached_plan_runs_over_the_callers_tensors(patched_grad):
    buf = torch.tensor([2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0])  # norm of all: sqrt(80)
    x1, y1 = buf[:4], buf[4:]
    clip_grads.get_grad_norm_fp32([x1, y1])
    x2, y2 = buf[:4], buf[4:]  # new view objects, the same addresses: the same plan
    grads = [x2, y2]
    assert float(clip_grads.get_grad_norm_fp32(grads)) == pytest.approx(math.sqrt(80.0))
    other = torch.tensor([6.0, 6.0, 8.0, 8.0, 6.0, 6.0, 8.0, 8.0])  # norm 20
    x2.set_(other.untyped_storage(), 0, (4,), (1,))  # x2, y2 re-pointed onto it
    y2.set_(other.untyped_storage(), 4, (4,), (1,))
    assert float(clip_grads.get_grad_norm_fp32(grads)) == pytest.approx(20.0)


def test_a_new_tensor_at_a_repointed_grads_address_gets_its_norm(patched_grad):
    buf = torch.tensor([1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    x, y = buf[:4], buf[4:]
    clip_grads.get_grad_norm_fp32([x, y])
    x.set_(torch.zeros(4).untyped_storage(), 0, (4,), (1,))  # the plan's tensor re-pointed
    z = buf[:4]  # a new tensor where x was
    assert float(clip_grads.get_grad_norm_fp32([z, y])) == pytest.approx(math.sqrt(40.0))


# ---------------------------------------------------------------- 4. values as Megatron's


def _step_values(dtype, with_leanstep):
    if not with_leanstep:
        lm.uninstall()  # Megatron alone: its own norm, zero count and step
    try:
        trainer = _trainer(dtype)
        for opt in _sub_optimizers(trainer):
            opt.config.log_num_zeros_in_grad = True
        trainer.step(0)
        return trainer.optimizer.step()
    finally:
        if not with_leanstep:
            lm.install()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_step_returns_values_that_behave_as_megatrons(installed, dtype):
    ok, norm, zeros = _step_values(dtype, True)
    theirs = _step_values(dtype, False)
    assert [type(v) for v in (ok, norm, zeros)] == [type(v) for v in theirs]
    assert ok is True and ok == True  # noqa: E712 - the loops' own comparisons
    assert f"{ok}" == "%s" % ok == "True" and int(ok) == 1 and 1 - ok == 0
    assert sum([ok, ok]) == 2 and "%d" % ok == "1" and torch.tensor(ok).item() is True
    assert {ok: 1}[True] == 1
    json.dumps({"ok": ok, "grad_norm": norm, "num_zeros": zeros})
    assert round(norm, 3) == round(theirs[1], 3)
    assert zeros == theirs[2]


def test_the_device_flag_behaves_as_a_bool_where_python_allows():
    ok = lstep.DeviceBool(torch.tensor(True))
    no = lstep.DeviceBool(torch.tensor(False))
    assert ok == True and no == False and ok != no  # noqa: E712
    assert f"{ok}" == "%s" % ok == str(ok) == "True" and int(ok) == 1 and 1 - ok == 0
    assert sum([ok, ok, no]) == 2 and "%d" % ok == "1" and {ok: 1}[True] == 1
    assert [0, 1][ok] == 1


# ---------------------------------------------------------------- 6. the audit


@pytest.fixture
def memory():
    mem = DeviceMemory(mcpu.ACCELERATOR)
    with mem:
        yield mem


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("copy_to_host", [
    lambda d: torch.as_tensor(d, device="cpu"),
    lambda d: torch.as_tensor(d, dtype=torch.float32, device="cpu"),
    lambda d: torch.tensor(d, device="cpu"),
    lambda d: torch.empty_like(d, device="cpu").copy_(d),
    lambda d: d.new_tensor(d, device="cpu"),
], ids=["as_tensor", "as_tensor_dtype", "tensor", "empty_like_copy", "new_tensor"])
def test_device_to_host_copies_are_reads_and_give_host_memory(memory, copy_to_host):
    d = torch.arange(4.0, device=mcpu.ACCELERATOR)
    with leanstep.audit(device_memory=memory) as a:
        host = copy_to_host(d)
    assert a.num_device_reads == 1, a.format_table()
    assert not memory.holds(host) and memory.holds(d)
    with leanstep.audit(device_memory=memory) as b:
        host.sum().item()  # a read of the host copy: host-resident
    assert b.num_device_reads == 0 and b.num_host_reads == 1, b.format_table()


@pytest.mark.parametrize("make", [
    lambda d: d.new_zeros(2, device="cpu"), lambda d: torch.zeros_like(d, device="cpu"),
    lambda d: torch.full_like(d, 3.0, device="cpu"), lambda d: torch.empty_like(d, device="cpu"),
], ids=["new_zeros", "zeros_like", "full_like", "empty_like"])
def test_host_tensors_made_like_device_memory_are_host_memory(memory, make):
    d = torch.ones(4, device=mcpu.ACCELERATOR)
    with leanstep.audit(device_memory=memory) as a:
        out = make(d)
    assert a.num_host_reads == 0 and not memory.holds(out)
    assert memory.holds(torch.zeros_like(d))  # made where d is: device memory


def test_a_non_cpu_tensor_is_device_memory_with_a_device_memory_too(memory):
    m = torch.ones(2, device="meta")
    for kwargs in ({}, {"device_memory": memory}):
        with leanstep.audit(**kwargs) as a:
            with pytest.raises(Exception):
                m.sum().item()
        assert [r.memory for r in a.host_reads] == ["device"], kwargs


@pytest.mark.parametrize("op,read", [
    (lambda d: torch.equal(d, d), "equal"), (lambda d: torch.allclose(d, d), "allclose"),
    (lambda d: torch.nonzero(d), "nonzero")])
def test_data_dependent_ops_on_device_memory_are_reads_of_it(memory, op, read):
    d = torch.arange(4.0, device=mcpu.ACCELERATOR)
    with leanstep.audit(device_memory=memory) as a:
        op(d)
    assert a.num_device_reads >= 1, a.format_table()
    assert any(r.memory == "device" for r in a.host_reads)
    assert a.implicit_syncs and all("device memory" in s.device for s in a.implicit_syncs)


def test_torch_save_and_read_scalar_are_reads(memory):
    d = torch.arange(4.0, device=mcpu.ACCELERATOR)
    with leanstep.audit(device_memory=memory) as a:
        torch.save({"w": d}, io.BytesIO())
    assert [(r.kind, r.memory) for r in a.host_reads] == [("save", "device")], a.format_table()
    assert torch.save.__module__ == "torch.serialization"  # put back after the audit
    with leanstep.audit(device_memory=memory) as b:
        value = leanstep.read_scalar(d[1:2])
    assert value == 1.0
    assert [(r.kind, r.memory) for r in b.host_reads] == [("read_scalar", "device")]


# ---------------------------------------------------------------- 7. set_preset


def test_concurrent_presets_leave_cpp_and_python_agreeing(monkeypatch):
    real = _leanstep.dispatch_set_preset

    def slow(preset):  # widens the window between the C++ and the Python half
        real(preset)
        time.sleep(0.002)

    monkeypatch.setattr(_leanstep, "dispatch_set_preset", slow)
    try:
        for trial in range(25):
            barrier = threading.Barrier(2)

            def set_(p):
                barrier.wait()
                leanstep.set_preset(p)

            threads = [threading.Thread(target=set_, args=(p,)) for p in ("rmsnorm", "grad")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert leanstep.preset() == _leanstep.dispatch_preset(), trial
    finally:
        monkeypatch.undo()
        leanstep.set_preset("all")


# ---------------------------------------------------------------- 8. masked Adam exactness


def _pair(shapes, dtype, gen, **options):
    params = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    make = lambda: [torch.nn.Parameter(p.clone()) for p in params]  # noqa: E731
    ref_params, our_params = make(), make()
    # fp16 cannot hold eps = 1e-8 (nor the squares of small grads): a representable eps
    # keeps the run finite, where the bits compared are values, not NaN payloads.
    options.setdefault("eps", 1e-3 if dtype == torch.float16 else 1e-8)
    ref = torch.optim.AdamW(ref_params, lr=2e-3, weight_decay=0.05, foreach=False, **options)
    ours = torch.optim.AdamW(our_params, lr=2e-3, weight_decay=0.05, foreach=False, **options)
    return ref_params, ref, our_params, ours


def _step_both(ref_params, ref, our_params, ours, grads, skip):
    if not skip:
        for p, g in zip(ref_params, grads):
            p.grad = g.clone()
        ref.step()
    for p, g in zip(our_params, grads):
        p.grad = g.clone()
    lstep.masked_adam_step(ours, torch.tensor([1.0 if skip else 0.0]))


def _assert_same(ref_params, ref, our_params, ours, where):
    for a, b in zip(ref_params, our_params):
        assert torch.equal(_bits(a), _bits(b)), where
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key in ref.state.get(a, {}):
                assert torch.equal(_bits(ref.state[a][key]), _bits(ours.state[b][key])), \
                    (where, key)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_adam_equals_torch_on_low_precision_params(dtype, rng, torch_gen):
    rng = random.Random(int(rng.integers(2**31)))
    shapes = [(rng.randint(1, 300),) for _ in range(3)] + [(9, 13)]
    pair = _pair(shapes, dtype, torch_gen)
    for step in range(12):
        scale = 10 ** (rng.uniform(-1, 0.5) if dtype == torch.float16 else rng.uniform(-3, 1))
        grads = [(torch.randn(s, generator=torch_gen) * scale).to(dtype) for s in shapes]
        skip = step in (3, 7)
        if skip:
            grads[1].view(-1)[0] = math.inf
        _step_both(*pair, grads, skip)
        _assert_same(*pair, (dtype, step))
        assert all(torch.isfinite(p).all() for p in pair[0])  # the case stays meaningful


def test_masked_adam_after_loading_unequal_counters(rng, torch_gen):
    rng = random.Random(int(rng.integers(2**31)))
    shapes = [(rng.randint(1, 100),) for _ in range(4)]
    ref_params, ref, our_params, ours = _pair(shapes, torch.float32, torch_gen)
    for step in range(3):  # equal counters: the group's foreach path
        grads = [torch.randn(s, generator=torch_gen) for s in shapes]
        _step_both(ref_params, ref, our_params, ours, grads, False)
    # A checkpoint from a run where one param missed steps: its counter differs.
    saved = copy.deepcopy(ref.state_dict())
    saved["state"][2]["step"] = torch.tensor(1.0)
    ref.load_state_dict(copy.deepcopy(saved))
    ours.load_state_dict(copy.deepcopy(saved))
    for step in range(4):
        grads = [torch.randn(s, generator=torch_gen) for s in shapes]
        _step_both(ref_params, ref, our_params, ours, grads, step == 1)
        _assert_same(ref_params, ref, our_params, ours, step)


def test_masked_adam_with_one_shared_step_counter_as_megatron_loads_it(rng, torch_gen):
    # Megatron's DistributedOptimizer.load_state_dict (no TE or apex) gives every param
    # one shared "step" tensor: torch's for-loop then advances it once per param per
    # step, and each param reads it after its own increment. leanstep does the same.
    rng = random.Random(int(rng.integers(2**31)))
    shapes = [(rng.randint(1, 100),) for _ in range(5)]
    ref_params, ref, our_params, ours = _pair(shapes, torch.float32, torch_gen)
    grads = [torch.randn(s, generator=torch_gen) for s in shapes]
    _step_both(ref_params, ref, our_params, ours, grads, False)
    for opt in (ref, ours):
        saved = opt.state_dict()
        shared = torch.tensor(float(saved["state"][0]["step"]))
        for s in saved["state"].values():
            s["step"] = shared
        opt.load_state_dict(saved)
    for step in range(4):
        grads = [torch.randn(s, generator=torch_gen) for s in shapes]
        _step_both(ref_params, ref, our_params, ours, grads, step == 2)
        _assert_same(ref_params, ref, our_params, ours, step)
    assert float(ours.state[our_params[0]]["step"]) == 1 + 3 * len(shapes)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_resumed_distributed_optimizer_steps_as_megatrons_resumed_run(installed):
    # The main job's optimizer is Megatron's DistributedOptimizer: its state_dict and
    # load_state_dict as a resume does them (no TE or apex: one shared step tensor).
    def run(megatron_step):
        if megatron_step:
            lm.uninstall(STEP_PATCHES)
        try:
            trainer = _trainer("fp16")
            trainer.before_optimizer_step = overflow_at({3})
            for step in range(2):
                trainer.step(step)
            trainer.optimizer.load_state_dict(trainer.optimizer.state_dict())
            for step in range(2, 6):
                trainer.step(step)
            return _state(trainer)
        finally:
            if megatron_step:
                lm.install(STEP_PATCHES)

    ours, theirs = run(False), run(True)
    assert len(ours) == len(theirs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ---------------------------------------------------------------- 9. the scaler after uninstall


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_uninstall_gives_the_scaler_megatrons_class_back(installed):
    trainer = _trainer("fp16")
    trainer.step(0)
    scalers = [opt.grad_scaler for opt in _sub_optimizers(trainer)]
    assert all(isinstance(s, lstep.DeviceTrackedDynamicGradScaler) for s in scalers)
    trackers = [(s._growth_tracker, s._hysteresis_tracker) for s in scalers]
    # Pickled while tracked: Megatron's class and Python ints come back.
    back = pickle.loads(pickle.dumps(scalers[0]))
    assert type(back) is DynamicGradScaler
    assert (back._growth_tracker, back._hysteresis_tracker) == trackers[0]
    assert torch.equal(back.scale, scalers[0].scale)
    lm.uninstall()
    for s, t in zip(scalers, trackers):
        assert type(s) is DynamicGradScaler and "_leanstep_trackers" not in vars(s)
        assert (s._growth_tracker, s._hysteresis_tracker) == t
        pickle.dumps(s)
        torch.save(s, io.BytesIO())
    lm.install()


# ---------------------------------------------------------------- 10. exit without leaks


def test_a_process_that_ran_a_step_exits_without_leaks():
    # A Megatron step with every patch: the plan cache held native plans at exit.
    code = (
        "import sys\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
        "import leanstep.megatron as lm\n"
        "from leanstep.megatron import cpu, train\n"
        "from helpers import one_rank_gloo\n"
        "lm.install()\n"
        "argv = ['--layers', '1', '--hidden', '32', '--heads', '2', '--kv-heads', '1',\n"
        "        '--experts', '2', '--moe-ffn', '32', '--seq', '16', '--micro-batch', '1',\n"
        "        '--ep', '1', '--dtype', 'fp16']\n"
        "with one_rank_gloo(), cpu.megatron_on_cpu():\n"
        "    ap = train.build_parser()\n"
        "    args = ap.parse_args(argv)\n"
        "    train.check_args(ap, args)\n"
        "    print(train.Trainer(args, 1, 0, 1).build().step(0).logged())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr[-3000:]
