"""The gradient engine's Triton kernels, run on CPU tensors by Triton's
interpreter (backend="triton"): what the conformance harness
(test_conformance.py) does not hold. The harness holds their values against
the C++ path and a float64 oracle (every op, dtype, layout, non-finite
placement, scalar form); here: those cases again with regions of several
chunks and chunks of several blocks, which lists route to the torch-op
code, plans of mixed dtypes in one launch, the same bits for any grid, the
launches and host syncs of each op, pairs that share memory, the automatic
choice, the preset, the self-check and the errors. Launches are counted
with a hook on Triton's launcher, host syncs with leanstep.audit().

Triton's interpreter needs TRITON_INTERPRET=1 before triton is first
imported (its own library is decorated then). When this module is imported
first, it sets the variable only around that import (and for its own tests):
other modules never see it. When triton was already imported for a device
(megatron-core imports it, and pytest imports every module before running
any), these tests run in a fresh process instead, with the variable set, as
one test here (the same seed).
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import leanstep
from leanstep import _backend

import triton_harness  # noqa: E402 (tests/python is on sys.path under pytest)
from helpers import assert_bitwise, assert_within
from leanstep._grad import ddp_grad_buffers


_SETUP = triton_harness.load("triton_common", "triton_grad")
DEVICE, NATIVE, IN_PROCESS = _SETUP.device, _SETUP.native, _SETUP.in_process
triton = _SETUP.triton
triton_common, triton_grad = _SETUP.modules["triton_common"], _SETUP.modules["triton_grad"]
_interpreter = triton_harness.interpreter_fixture(_SETUP)
test_in_a_fresh_interpreter_process = triton_harness.fresh_process_test(__file__, _SETUP)

from test_conformance import (CASES, FLOATS, conform, grad_layout, grad_oracle_norm,  # noqa: E402
                              grad_views, named_case, place)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def dev(t):
    return t.to(DEVICE) if NATIVE else t


def harness_views(op, name, gen):
    """(CPU views, the same views on the Triton side) of a harness case's layout."""
    buffers, layout = grad_layout(named_case(op, name), gen)
    return (grad_views(buffers, layout),
            grad_views([place(b, "triton") for b in buffers], layout))


# ---------------------------------------------------------------- regions of several chunks

#: Chunks of an odd length and blocks that do not divide them: the harness's
#: 1037-element region spans 11 chunks, and a chunk ends inside a block.
SMALL_CHUNK, SMALL_BLOCK = 100, 32

#: The harness's grad cases whose regions the small chunks cut: the long one,
#: the views layout (aliased entries beside dense regions) and the non-finite
#: values first and last (chunk edges), with each scalar form.
SMALL_CHUNK_CASES = [
    c for c in CASES if c.op.startswith("grad.") and c.get("p") in (None, 2.0, math.inf, 1.0)
    and (c.get("size") == 1037 or c.get("layout") == "views"
         or (c.special and c.where in ("first", "last")))]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(triton_grad, "defaults", lambda device: (SMALL_CHUNK, SMALL_BLOCK))


def test_the_small_chunks_cut_the_regions(small_chunks, torch_gen):
    _, views = harness_views("grad.norm", "fp32-n1037-p2", torch_gen)
    plan = leanstep.GradPlan(views, backend="triton")._torch_plan
    assert (plan.chunk, plan.block, plan.num_chunks) == (SMALL_CHUNK, SMALL_BLOCK, 11)


@pytest.mark.parametrize("case", SMALL_CHUNK_CASES, ids=lambda c: c.id)
def test_regions_of_several_chunks_keep_the_harness_results(case, small_chunks):
    conform(case, "triton")


def test_only_aliased_or_strided_entries_take_the_torch_op_code(torch_gen):
    """The harness's views layout (a duplicate, an overlap, a transposed view)
    keeps the same region table as the C++ planner; its aliased and strided
    entries run by the torch-op code inside the plan, dense lists by the
    kernels alone."""
    for name, aliased in (("fp32-views-p2", True), ("fp32-n1037-p2", False),
                          ("fp32-inf-middle-p2", False)):
        cpu_views, views = harness_views("grad.norm", name, torch_gen)
        plan = leanstep.GradPlan(views, backend="triton")
        assert plan.backend == "triton"
        assert plan.num_regions == leanstep.GradPlan(cpu_views).num_regions, name
        assert (plan._torch_plan.fallback is not None) == aliased, name


def test_same_bits_for_any_grid_size(small_chunks, torch_gen):
    _, views = harness_views("grad.norm", "fp32-views-p2", torch_gen)
    results = []
    for programs in (1, 3, 1000):
        plan = leanstep.GradPlan(views, backend="triton")
        plan._torch_plan = triton_grad.TritonGradPlan(plan.grads, DEVICE, max_programs=programs)
        results.append(torch.cat([plan.norm(p)[0] for p in (2.0, 1.0, math.inf)]))
    assert_bitwise(results[0], results[1])
    assert_bitwise(results[0], results[2])


# ---------------------------------------------------------------- launches

#: Kernel launches per op whatever the layout: one pass over the table (and
#: one fixed-order finish), the aliased entries adding none.
LAUNCHES = {"grad.norm": {"_reduce_kernel": 1, "_finish_kernel": 1},
            "grad.unscale_norm": {"_reduce_kernel": 1, "_finish_kernel": 1},
            "grad.unscale": {"_reduce_kernel": 1},
            "grad.clip": {"_scale_kernel": 1}, "grad.scale": {"_scale_kernel": 1},
            "grad.count_zeros": {"_zeros_kernel": 1, "_zeros_finish_kernel": 1},
            "grad.norm_clip": {"_reduce_kernel": 1, "_finish_kernel": 1, "_scale_kernel": 1}}


@pytest.mark.parametrize("op", sorted(LAUNCHES))
@pytest.mark.parametrize("layout", ["n1037", "views"])
def test_one_launch_per_pass_on_any_layout(op, layout):
    case = named_case(op, f"fp32-{layout}" + ("-p2" if op == "grad.norm" else ""))
    with triton_common.count_launches() as launches:
        conform(case, "triton")
    assert dict(launches) == LAUNCHES[op]


def test_an_empty_plan_answers_on_the_device_of_like():
    like = dev(torch.zeros(1))
    empty = leanstep.GradPlan([], backend="triton", like=like)
    norm, flag = empty.norm()
    # like.device, not DEVICE: a tensor names its device with an index ("cuda:0"),
    # and torch.device("cuda") compares unequal to it.
    assert norm.device == flag.device == empty.count_zeros().device == like.device
    assert norm.device.type == DEVICE.type


# ---------------------------------------------------------------- mixed dtypes in one launch


def mixed_buffers(gen):
    """One buffer of every dtype: a plan of all of them in separate storages."""
    return [(torch.randn(1000 + 37 * i, generator=gen, dtype=torch.float64) * 2).to(dtype)
            for i, dtype in enumerate(FLOATS.values())]


def mixed_views(bufs):
    return [v for b in bufs for v in (b[:300], b[301:1000])]


def test_mixed_dtypes_in_one_launch(torch_gen):
    bufs = mixed_buffers(torch_gen)
    views, ref_views = mixed_views(bufs), mixed_views([b.clone() for b in bufs])
    tv = mixed_views([place(b, "triton") for b in bufs])
    plan = leanstep.GradPlan(tv, backend="triton")
    with triton_common.count_launches() as launches:
        norm, flag = plan.norm()
    assert dict(launches) == {"_reduce_kernel": 1, "_finish_kernel": 1}
    assert_within(norm.double(), grad_oracle_norm(views, 2.0), ("grad", "norm"),
                  dtype=torch.float32)
    assert_within(flag, torch.zeros(1), ("grad", "found_inf"))
    with triton_common.count_launches() as launches:
        coeff = plan.clip_(0.25, norm)
    assert dict(launches) == {"_scale_kernel": 1}
    coeff_cpu = leanstep.GradPlan(ref_views).clip_(0.25, norm.cpu().clone())
    assert_within(coeff, coeff_cpu, ("grad", "clip_coeff"))
    for a, b in zip(tv, ref_views):
        assert_within(a, b, ("grad", "elementwise"))


def mts_pairs(gen):
    """(src, dst) pairs of six dtype pairs, a source past fp16's range into
    fp16 (1e5 * 0.01: 1000, no fp16 intermediate) and an in-place pair."""
    pairs = []
    for i, (sd, dd) in enumerate([(torch.float32, torch.float16), (torch.float16, torch.float32),
                                  (torch.bfloat16, torch.bfloat16), (torch.float64, torch.bfloat16),
                                  (torch.float32, torch.float64), (torch.float32, torch.float32)]):
        n = 37 + 211 * i
        src = (torch.randn(n, generator=gen, dtype=torch.float64) * 50).to(sd)
        pairs.append((src, torch.empty(n, dtype=dd)))
    big = torch.full((33,), 1.0e5)
    pairs.append((big, torch.empty(33, dtype=torch.float16)))
    inplace = (torch.randn(301, generator=gen) * 3).to(torch.bfloat16)
    pairs.append((inplace, inplace))
    return pairs


@pytest.mark.parametrize("scale", [0.01, "tensor"])
@pytest.mark.parametrize("where", [None, "first", "middle", "last"])
def test_multi_tensor_scale_of_mixed_pairs_in_one_launch(scale, where, torch_gen):
    pairs = mts_pairs(torch_gen)
    if where is not None:
        src = {"first": pairs[0][0], "middle": pairs[3][0], "last": pairs[-1][0]}[where]
        src.view(-1)[{"first": 0, "middle": src.numel() // 2, "last": -1}[where]] = math.nan
    ref = [(s.clone(), d.clone() if d is not s else None) for s, d in pairs]
    ref = [(s, s if d is None else d) for s, d in ref]
    value = torch.tensor([0.01]) if scale == "tensor" else scale
    if NATIVE:  # device copies; the in-place pair stays in place
        moved = [(dev(s), None if d is s else dev(d)) for s, d in pairs]
        pairs = [(s, s if d is None else d) for s, d in moved]
    with triton_common.count_launches() as launches:
        flag = leanstep.multi_tensor_scale([s for s, _ in pairs], [d for _, d in pairs],
                                           dev(value) if scale == "tensor" else value,
                                           backend="triton")
    assert dict(launches) == {"_mts_kernel": 1}
    cpu_flag = leanstep.multi_tensor_scale([s for s, _ in ref], [d for _, d in ref],
                                           value.clone() if scale == "tensor" else value)
    assert_within(flag, cpu_flag, ("grad", "found_inf"))
    assert cpu_flag.item() == (0.0 if where is None else 1.0)
    for (s, d), (rs, rd) in zip(pairs, ref):
        assert_within(d, rd, ("grad", "elementwise"))
        assert_within(s, rs, ("grad", "elementwise"))
    assert torch.all(pairs[6][1] == 1000.0)


def test_multi_tensor_scale_pairs_that_share_memory_run_in_list_order(torch_gen):
    # Pairs that share memory run in list order through the torch-op code; recorded as such.
    _backend.reset_calls()
    for cut in ((0, 16, 16, 32, 32, 48), (0, 32, 16, 48, 32, 64)):  # sharing; self-overlapping
        a, b, c, d, e, f = cut
        buf2 = torch.randn(64, generator=torch_gen)
        buf = dev(buf2.clone())
        leanstep.multi_tensor_scale([buf[a:b], buf[c:d]], [buf[c:d], buf[e:f]], 0.5,
                                    backend="triton")
        leanstep.multi_tensor_scale([buf2[a:b], buf2[c:d]], [buf2[c:d], buf2[e:f]], 0.5)
        assert_within(buf, buf2, ("grad", "elementwise"))
    why = _backend.reasons()["grad.multi_tensor_scale"]["torch"][DEVICE.type]
    assert any("share memory" in r for r in why), why
    assert any("partially overlap" in r for r in why), why


# ---------------------------------------------------------------- budget, selection, report


def test_lora_layout_norm_clip_launch_and_sync_budget(monkeypatch):
    """norm + clip of the Qwen3-Omni LoRA EP-rank layout (3168 grads, 2 flat
    buffers): at most 4 launches and 0 host syncs. The launch count does not
    depend on the chunking; large chunks keep the interpreter quick."""
    monkeypatch.setattr(triton_grad, "INTERPRETER_CHUNK", 1 << 20)
    monkeypatch.setattr(triton_grad, "INTERPRETER_BLOCK", 1 << 16)
    params = leanstep.model_params("qwen3_omni_lora")
    bufs, grads, _ = ddp_grad_buffers(params, distributed_optimizer=True, dp_size=8)
    assert len(grads) == 3168
    gen = torch.Generator().manual_seed(7)
    for b in bufs:
        b.normal_(generator=gen).mul_(1e-3)
    cpu_norm = leanstep.GradPlan(grads).norm()[0]
    if NATIVE:
        dbufs, grads, _ = ddp_grad_buffers(params, distributed_optimizer=True, dp_size=8,
                                           device=DEVICE)
        for d, b in zip(dbufs, bufs):
            d.copy_(b)
    plan = leanstep.GradPlan(grads, backend="triton")
    if NATIVE:
        plan.norm_clip_(1e30)  # compiles the kernels (a coefficient of 1 changes no value)
    with leanstep.audit() as audit, triton_common.count_launches() as launches:
        norm, flag, coeff = plan.norm_clip_(1.0)
    assert sum(launches.values()) <= 4, dict(launches)
    assert dict(launches) == {"_reduce_kernel": 1, "_finish_kernel": 1, "_scale_kernel": 1}
    assert audit.num_syncs == 0 and audit.num_host_reads == 0, audit.format_table()
    # The only aten ops on a device would be the three result allocations (no kernels).
    assert_within(norm, cpu_norm, ("grad", "norm_between_backends"))
    assert flag.item() == 0.0 and 0.0 < coeff.item() < 1.0


@pytest.mark.skipif(NATIVE, reason="the interpreter's errors")
def test_errors_name_the_argument(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(leanstep.Error, match=r"GradPlan: argument 'backend' is 'triton' for CPU "
                                             r"tensors.*set TRITON_INTERPRET=1"):
        leanstep.GradPlan([torch.zeros(4)], backend="triton")
    with pytest.raises(leanstep.Error, match=r"multi_tensor_scale: argument 'backend'.*"
                                             r"TRITON_INTERPRET=1"):
        leanstep.multi_tensor_scale([torch.zeros(4)], [torch.zeros(4)], 1.0, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(leanstep.Error, match=r"argument 'backend' must be one of cpu, torch, "
                                             r"triton or None"):
        leanstep.GradPlan([torch.zeros(4)], backend="cuda")
    with pytest.raises(leanstep.Error, match="argument 'backend' is 'triton', but Triton cannot "
                                             "run the meta tensors"):
        leanstep.GradPlan([torch.zeros(4, device="meta")], backend="triton")


def test_automatic_selection_and_report(torch_gen, monkeypatch):
    cpu = torch.zeros(4)
    meta = [torch.zeros(4, device="meta")]
    assert _backend.choose([cpu], None, "t", triton="grad") == ("cpu", "CPU tensors")
    monkeypatch.delenv("LEANSTEP_TRITON", raising=False)  # the default: automatic
    chosen, why = _backend.choose(meta, None, "t", triton="grad")
    assert chosen == "torch" and "Triton kernels do not run meta tensors" in why
    with monkeypatch.context() as m:
        m.setenv("LEANSTEP_TRITON", "off")
        chosen, why = _backend.choose(meta, None, "t", triton="grad")
        assert chosen == "torch" and "switched off (LEANSTEP_TRITON)" in why
        m.setenv("LEANSTEP_TRITON", "sometimes")
        with pytest.raises(leanstep.Error, match="LEANSTEP_TRITON must be 'auto'"):
            _backend.choose(meta, None, "t", triton="grad")
        m.setenv("LEANSTEP_TRITON", "auto")
        # A device where Triton runs (simulated on meta tensors): the family's
        # self-check decides, once per family and device.
        m.setattr(_backend, "triton_unusable", lambda device: None)
        from leanstep.backends import triton_selfcheck

        checks = []
        verdicts = {"grad": None, "moe": "the moe self-check failed: unpermute differs"}

        def fake_check(family, device):
            checks.append((family, str(device)))
            return verdicts[family]

        m.setattr(triton_selfcheck, "check", fake_check)
        m.setattr(_backend, "_self_checks", {})
        for _ in range(2):
            assert _backend.choose(meta, None, "t", triton="grad") == (
                "triton", "meta tensors, Triton driver active, self-check passed")
            assert _backend.choose(meta, None, "t", triton="moe") == (
                "torch", "meta tensors; Triton: the moe self-check failed: unpermute differs")
        assert checks == [("grad", "meta"), ("moe", "meta")]
        assert _backend.choose(meta, None, "t", triton=False)[0] == "torch"
    assert leanstep.GradPlan([cpu]).backend == "cpu"
    if NATIVE:  # a device with a Triton driver: chosen without asking
        auto = leanstep.GradPlan([dev(cpu)])
        assert auto.backend == "triton" and "self-check passed" in auto._reason
    else:  # no GPU here: a cuda tensor cannot exist, but the decision says why not
        assert _backend.triton_unusable(torch.device("cuda")) is not None
    _backend.reset_calls()
    _, views = harness_views("grad.norm", "fp32-views-p2", torch_gen)
    plan = leanstep.GradPlan(views, backend="triton")
    plan.norm(2.0)
    plan.norm(1.5)  # no kernel for this p: the torch-op code, recorded so
    calls = _backend.calls()
    kind = DEVICE.type
    assert calls["grad.norm"]["triton"][kind] == 1 and calls["grad.norm"]["torch"][kind] == 1
    reasons = _backend.reasons()["grad.norm"]
    (triton_reason,) = reasons["triton"][kind]
    assert triton_reason.startswith("forced") and "by the torch-op code" in triton_reason
    assert "grad.norm" in leanstep.paths()["ops"]


def test_the_preset_switches_a_triton_plan_to_the_torch_op_code(torch_gen):
    """set_preset("baseline") reaches a plan built on Triton: each call runs
    the torch-op plan inside it (the device path's reference), counted and
    explained; "all" runs the kernels again. The two norms agree within
    grad.norm_between_backends: both accumulate in float64 and round once, in
    different orders."""
    _, views = harness_views("grad.norm", "fp32-views-p2", torch_gen)
    plan = leanstep.GradPlan(views, backend="triton")
    kind = DEVICE.type
    try:
        _backend.reset_calls()
        leanstep.set_preset("baseline")
        reference, _ = plan.norm(2.0)
        leanstep.set_preset("all")
        fast, _ = plan.norm(2.0)
        assert_within(fast, reference, ("grad", "norm_between_backends"))
        calls = _backend.calls()["grad.norm"]
        assert calls["torch"][kind] == 1 and calls["triton"][kind] == 1
        (why,) = _backend.reasons()["grad.norm"]["torch"][kind]
        assert why.endswith("the preset switches grad.norm off")
        leanstep.set_preset("baseline")
        _backend.reset_calls()
        plan.clip_(1.0, reference)
        plan.scale_(0.5)
        plan.unscale_(2.0)
        plan.count_zeros()
        calls = _backend.calls()
        for op in ("grad.clip", "grad.scale", "grad.unscale", "grad.count_zeros"):
            assert set(calls[op]) == {"torch"}, op
    finally:
        leanstep.set_preset("all")


def test_self_check_passes_and_catches_a_broken_kernel(monkeypatch):
    """The first-use gate of the automatic choice: it passes for the real
    kernels and names one that is off by one bit or fails to run."""
    from leanstep.backends import triton_selfcheck

    assert triton_selfcheck.check("grad", DEVICE) is None
    real = triton_grad.TritonGradPlan.clip

    def clip_off_by_one_bit(self, *args, **kwargs):
        coeff = real(self, *args, **kwargs)
        self.views[0].view(torch.int32)[7] ^= 1
        return coeff

    monkeypatch.setattr(triton_grad.TritonGradPlan, "clip", clip_off_by_one_bit)
    assert re.fullmatch(r"the grad self-check failed: clipped grads\[\d\] differs from the "
                        r"torch-op backend", triton_selfcheck.check("grad", DEVICE))
    # The check runs the kernels whatever the preset: through GradPlan, "baseline"
    # sent its Triton calls to the torch-op code, which then agreed with itself.
    leanstep.set_preset("baseline")
    try:
        assert "clipped grads" in triton_selfcheck.check("grad", DEVICE)
    finally:
        leanstep.set_preset("all")
    monkeypatch.setattr(triton_grad.TritonGradPlan, "unscale", lambda *a: 1 / 0)
    assert "the grad self-check raised ZeroDivisionError" in triton_selfcheck.check("grad", DEVICE)


def test_import_leanstep_does_not_import_triton():
    code = ("import sys, torch, leanstep, leanstep.torch\n"
            "plan = leanstep.GradPlan([torch.ones(3)])\n"
            "plan.norm_clip_(1.0)\n"
            "leanstep.multi_tensor_scale([torch.ones(3)], [torch.ones(3)], 2.0)\n"
            "assert 'triton' not in sys.modules, 'triton imported'\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(leanstep.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_in_place_ops_refuse_a_self_overlapping_grad_as_every_backend_does():
    """A grad from expand() reaches one element by six indices: the in-place
    ops refuse it with leanstep's named error (torch's own error before),
    before any launch; the norm only reads it."""
    dense, expanded = dev(torch.full((4,), 3.0)), dev(torch.ones(1)).expand(6)
    plan = leanstep.GradPlan([dense, expanded], backend="triton")
    rule = r"argument 'grads\[1\]' must not overlap itself.*strides \[0\]"
    for op, call in (("unscale_", lambda: plan.unscale_(2.0)), ("scale_", lambda: plan.scale_(2.0)),
                     ("clip_", lambda: plan.clip_(1.0, dev(torch.tensor([100.0])))),
                     ("norm_clip_", lambda: plan.norm_clip_(1.0)),
                     ("norm", lambda: plan.norm(inv_scale=0.5))):
        with triton_common.count_launches() as launches, \
                pytest.raises(leanstep.Error, match=rf"GradPlan\.{op}: " + rule):
            call()
        assert not launches, op
    assert torch.equal(dense.cpu(), torch.full((4,), 3.0)) and torch.equal(expanded.cpu(), torch.ones(6))
    norm, _ = plan.norm()
    assert_within(norm.double(), torch.tensor([math.sqrt(36 + 6)], dtype=torch.float64),
                  ("grad", "norm"), dtype=torch.float32)
    with pytest.raises(leanstep.Error, match=r"multi_tensor_scale: argument 'dst_list\[0\]' "
                                             r"must not overlap itself"):
        leanstep.multi_tensor_scale([dev(torch.ones(6))], [dev(torch.zeros(1)).expand(6)], 2.0,
                                    backend="triton")
