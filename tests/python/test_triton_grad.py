"""The gradient engine's Triton kernels, run on CPU tensors by Triton's
interpreter (backend="triton"), against the C++ path and a float64 oracle.

Bitwise (NaN compared as NaN, every other bit exact, signed zeros
included): clip and its coefficient, scale, unscale (the values written),
multi_tensor_scale, count_zeros, found_inf. Bounded: the norms, each within
2 fp32 ulp of the float64 oracle (fp64 accumulation, one rounding to fp32,
as the C++ path, whose own result is within the same bound), so the two
paths are within 4 ulp of each other. Launches are counted with a hook on
Triton's launcher, host syncs with leanstep.audit().

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

import numpy as np

import pytest
import torch

import leanstep
from leanstep import _backend

import triton_harness  # noqa: E402 (tests/python is on sys.path under pytest)
from leanstep._grad import ddp_grad_buffers


_SETUP = triton_harness.load("triton_common", "triton_grad")
DEVICE, NATIVE, IN_PROCESS = _SETUP.device, _SETUP.native, _SETUP.in_process
triton = _SETUP.triton
triton_common, triton_grad = _SETUP.modules["triton_common"], _SETUP.modules["triton_grad"]
_interpreter = triton_harness.interpreter_fixture(_SETUP)
test_in_a_fresh_interpreter_process = triton_harness.fresh_process_test(__file__, _SETUP)

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
U32 = 2.0**-24
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bitwise(actual, expected):
    """Every element the same bits, NaN matched as NaN (payloads may differ)."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    an, en = actual.isnan(), expected.isnan()
    assert torch.equal(an, en), f"NaN at different places: {an.sum()} vs {en.sum()}"
    ia = actual.contiguous().view(INT_VIEW[actual.element_size()])
    ie = expected.contiguous().view(INT_VIEW[actual.element_size()])
    bad = (ia != ie) & ~an
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise AssertionError(f"{int(bad.sum())} of {actual.numel()} elements differ: first at "
                             f"{i}: {actual.view(-1)[i]!r} vs {expected.view(-1)[i]!r}")


def oracle_norm(views, p):
    vals = [v.detach().to(torch.float64).reshape(-1).numpy() for v in views]
    flat = np.concatenate(vals) if vals else np.zeros(0)
    if p == math.inf:
        return float(np.abs(flat).max()) if flat.size else 0.0
    return float((np.abs(flat) ** p).sum() ** (1.0 / p))


def tiny_regions(gen, dtype, count=60, end=4999):
    """Many tiny views of odd sizes with unlisted gaps (each its own region),
    one long run of odd length (several chunks), and a second storage."""
    buf = (torch.randn(end + 1, generator=gen, dtype=torch.float64) * 3).to(dtype)
    views, at = [], 0
    for k in range(count):
        size = 1 + (k * 7) % 13
        views.append(buf[at:at + size])
        at += size + 1 + k % 3
    views.append(buf[at:end])
    other = (torch.randn(777, generator=gen, dtype=torch.float64)).to(dtype)
    views.append(other[5:])
    return [buf, other], views


def aliased(gen, dtype):
    """Duplicates, an overlap, a strided view and an empty view: the entries
    the table does not take (the torch-op code runs them)."""
    buf = (torch.randn(900, generator=gen, dtype=torch.float64) * 3).to(dtype)
    views = [buf[0:100], buf[103:250], buf[250:333]]
    views.append(views[1])                     # multiplicity 2
    views.append(buf[300:320])                 # overlaps: multiplicity 2 there
    views.append(buf[400:448].view(6, 8).t())  # strided: generic
    views.append(buf[500:500])                 # empty
    views.append(buf[600:877])
    return [buf], views


def mixed(gen):
    """Every dtype in one plan, in separate storages: one launch per op."""
    bufs, views = [], []
    for i, dtype in enumerate(DTYPES):
        b = (torch.randn(1000 + 37 * i, generator=gen, dtype=torch.float64) * 2).to(dtype)
        bufs.append(b)
        views += [b[:300], b[301:1000]]
    return bufs, views


LAYOUTS = {"tiny": tiny_regions, "aliased": aliased}


def clone_layout(bufs, views, device=None):
    """The same views into copies of the buffers (on `device` if given)."""
    copies = {b.untyped_storage()._cdata: b.clone() if device is None else b.to(device, copy=True)
              for b in bufs}
    out = []
    for v in views:
        c = copies[v.untyped_storage()._cdata]
        out.append(c.as_strided(v.shape, v.stride(), v.storage_offset()))
    return list(copies.values()), out


def on_device(bufs, views):
    """The layout the Triton side runs on: the tensors themselves under the
    interpreter, copies on the device in a native run."""
    return clone_layout(bufs, views, DEVICE) if NATIVE else (bufs, views)


def dev(t):
    return t.to(DEVICE) if NATIVE else t


def small_plan(views, **knobs):
    """A Triton plan (with small chunks when knobs are given, so short lists
    span several chunks)."""
    plan = leanstep.GradPlan(views, backend="triton")
    if knobs:
        plan._torch_plan = triton_grad.TritonGradPlan(plan.grads, DEVICE, **knobs)
    return plan


# ---------------------------------------------------------------- norms and found_inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("p", [2.0, math.inf, 1.0])
def test_norm_matches_cpu_path_and_oracle(dtype, layout, p, torch_gen):
    bufs, views = LAYOUTS[layout](torch_gen, dtype)
    cpu_norm, cpu_flag = leanstep.GradPlan(views).norm(p)
    plan = small_plan(on_device(bufs, views)[1], chunk=1024, block=256)
    assert plan.backend == "triton"
    norm, flag = plan.norm(p)
    exact = oracle_norm(views, p)
    assert abs(norm.item() - exact) <= 2 * U32 * exact, (norm.item(), exact)
    assert abs(cpu_norm.item() - exact) <= 2 * U32 * exact
    assert flag.item() == cpu_flag.item() == 0.0
    assert plan.num_regions == leanstep.GradPlan(views).num_regions
    tp = plan._torch_plan
    assert (tp.fallback is None) == (layout == "tiny")


def test_mixed_dtypes_in_one_launch(torch_gen):
    bufs, views = mixed(torch_gen)
    tb, tv = on_device(bufs, views)
    plan = leanstep.GradPlan(tv, backend="triton")
    with triton_common.count_launches() as launches:
        norm, flag = plan.norm()
    assert dict(launches) == {"_reduce_kernel": 1, "_finish_kernel": 1}
    exact = oracle_norm(views, 2.0)
    assert abs(norm.item() - exact) <= 2 * U32 * exact
    bufs2, views2 = clone_layout(bufs, views)
    coeff = plan.clip_(0.25, norm)
    coeff_cpu = leanstep.GradPlan(views2).clip_(0.25, norm.cpu().clone())
    assert_bitwise(coeff, coeff_cpu)
    for a, b in zip(tb, bufs2):
        assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [-math.inf, math.nan])
def test_found_inf_and_nan_propagation(dtype, where, bad, torch_gen):
    bufs, views = tiny_regions(torch_gen, dtype, count=8, end=1200)
    target = {"first": views[0], "middle": views[len(views) // 2], "last": views[-1]}[where]
    target.view(-1)[{"first": 0, "middle": target.numel() // 2, "last": -1}[where]] = bad
    plan = small_plan(on_device(bufs, views)[1], chunk=512, block=128)
    for p in (2.0, math.inf):
        norm, flag = plan.norm(p)
        cpu_norm, cpu_flag = leanstep.GradPlan(views).norm(p)
        assert flag.item() == cpu_flag.item() == 1.0
        if math.isnan(bad):
            assert math.isnan(norm.item()) and math.isnan(cpu_norm.item())
        else:
            assert norm.item() == cpu_norm.item() == math.inf


def test_found_inf_is_ored_into_and_large_values_are_finite():
    g = dev(torch.full((64,), 65504.0, dtype=torch.float16))  # fp16 max: its square needs fp64
    flag = dev(torch.zeros(1))
    plan = leanstep.GradPlan([g], backend="triton")
    norm, out_flag = plan.norm(2.0, found_inf=flag)
    assert out_flag is flag and flag.item() == 0.0
    assert norm.item() == pytest.approx(65504.0 * 8, rel=U32)
    flag.fill_(1.0)
    plan.norm(2.0, found_inf=flag)
    assert flag.item() == 1.0  # never reset


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("inv_scale", [0.5, "tensor", 1.0, 3.0e4])
def test_unscale_norm_is_bitwise_the_cpu_path(dtype, layout, inv_scale, torch_gen):
    bufs, views = LAYOUTS[layout](torch_gen, dtype)
    views[0].view(-1)[0] = math.inf  # flagged from the input, before unscaling
    if layout == "tiny":
        views[-1].view(-1)[-1] = math.nan
    bufs2, views2 = clone_layout(bufs, views)
    tb, tv = on_device(bufs, views)
    inv = dev(torch.tensor([0.125])) if inv_scale == "tensor" else inv_scale
    norm, flag = small_plan(tv, chunk=1024, block=256).norm(2.0, inv_scale=inv)
    cpu_norm, cpu_flag = leanstep.GradPlan(views2).norm(
        2.0, inv_scale=inv.cpu().clone() if isinstance(inv, torch.Tensor) else inv)
    for a, b in zip(tb, bufs2):
        assert_bitwise(a, b)  # 3e4 overflows fp16 and bf16 values to inf, as on the CPU
    assert flag.item() == cpu_flag.item() == 1.0
    assert_bitwise(norm, cpu_norm)  # inf or NaN here


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_norm_finite_bound_and_unscale_alone(dtype, torch_gen):
    bufs, views = tiny_regions(torch_gen, dtype, count=20)
    bufs2, views2 = clone_layout(bufs, views)
    bufs3, views3 = on_device(*clone_layout(bufs, views))
    norm, flag = leanstep.GradPlan(on_device(bufs, views)[1], backend="triton").norm(
        2.0, inv_scale=0.37)
    cpu_norm, _ = leanstep.GradPlan(views2).norm(2.0, inv_scale=0.37)
    exact = oracle_norm(views2, 2.0)  # of the unscaled values
    assert abs(norm.item() - exact) <= 2 * U32 * exact
    assert abs(cpu_norm.item() - exact) <= 2 * U32 * exact
    assert flag.item() == 0.0
    plan = leanstep.GradPlan(views3, backend="triton")
    with triton_common.count_launches() as launches:
        flag3 = plan.unscale_(dev(torch.tensor([0.37])), found_inf=dev(torch.zeros(1)))
    assert sum(launches.values()) == 1 and flag3.item() == 0.0
    for a, b in zip(bufs3, bufs2):
        assert_bitwise(a, b)


# ---------------------------------------------------------------- clip, scale, count_zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e30])
def test_clip_is_bitwise_the_cpu_path(dtype, layout, max_norm, torch_gen):
    bufs, views = LAYOUTS[layout](torch_gen, dtype)
    bufs2, views2 = clone_layout(bufs, views)
    norm = leanstep.GradPlan(views).norm()[0]
    tb, tv = on_device(bufs, views)
    plan = small_plan(tv, chunk=1024, block=256)
    with triton_common.count_launches() as launches:
        coeff = plan.clip_(max_norm, dev(norm.clone()))
    assert dict(launches) == {"_scale_kernel": 1}
    coeff_cpu = leanstep.GradPlan(views2).clip_(max_norm, norm.clone())
    assert_bitwise(coeff, coeff_cpu)
    for a, b in zip(tb, bufs2):
        assert_bitwise(a, b)  # duplicated elements scaled twice on both paths
    # A norm given as a number: the same fp32 rounding of it.
    coeff = plan.clip_(max_norm, float(norm) * 3)
    coeff_cpu = leanstep.GradPlan(views2).clip_(max_norm, float(norm) * 3)
    assert_bitwise(coeff, coeff_cpu)
    for a, b in zip(tb, bufs2):
        assert_bitwise(a, b)


@pytest.mark.parametrize("bad_norm", [math.nan, math.inf, 0.0])
def test_clip_special_norms(bad_norm, torch_gen):
    bufs, views = tiny_regions(torch_gen, torch.bfloat16, count=5, end=900)
    bufs2, views2 = clone_layout(bufs, views)
    tb, tv = on_device(bufs, views)
    coeff = leanstep.GradPlan(tv, backend="triton").clip_(1.0, dev(torch.tensor([bad_norm])))
    coeff_cpu = leanstep.GradPlan(views2).clip_(1.0, torch.tensor([bad_norm]))
    assert_bitwise(coeff, coeff_cpu)  # NaN stays NaN (never silently 1), inf gives 0
    for a, b in zip(tb, bufs2):
        assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.3, "tensor", 7.0e4])
def test_scale_is_bitwise_the_cpu_path(dtype, scale, torch_gen):
    bufs, views = aliased(torch_gen, dtype)
    bufs2, views2 = clone_layout(bufs, views)
    value = torch.tensor([1.7]) if scale == "tensor" else scale
    tb, tv = on_device(bufs, views)
    small_plan(tv, chunk=128, block=64).scale_(dev(value) if scale == "tensor" else value)
    leanstep.GradPlan(views2).scale_(value.clone() if scale == "tensor" else value)
    for a, b in zip(tb, bufs2):
        assert_bitwise(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_count_zeros_is_exact(dtype, layout, torch_gen):
    bufs, views = LAYOUTS[layout](torch_gen, dtype)
    for b in bufs:
        b[::3] = 0.0
        b[1::7] = -0.0
    plan = small_plan(on_device(bufs, views)[1], chunk=1024, block=256)
    with triton_common.count_launches() as launches:
        zeros = plan.count_zeros()
    assert sum(launches.values()) == 2
    expected = leanstep.GradPlan(views).count_zeros()
    assert zeros.dtype == torch.int64 and zeros.shape == (1,)
    assert zeros.item() == expected.item() > 0


# ---------------------------------------------------------------- determinism, empty lists


def test_same_bits_for_any_grid_size(torch_gen):
    bufs, views = on_device(*tiny_regions(torch_gen, torch.float32, count=30))
    results = []
    for programs in (1, 3, 1000):
        plan = small_plan(views, chunk=512, block=128, max_programs=programs)
        results.append(torch.cat([plan.norm(p)[0] for p in (2.0, 1.0, math.inf)]))
    assert_bitwise(results[0], results[1])
    assert_bitwise(results[0], results[2])


def test_empty_lists():
    empty = leanstep.GradPlan([], backend="triton", like=dev(torch.zeros(1)))
    norm, flag = empty.norm()
    assert norm.item() == 0.0 and flag.item() == 0.0 and norm.device == DEVICE
    assert empty.count_zeros().item() == 0
    coeff = empty.clip_(1.0, dev(torch.tensor([4.0])))
    assert coeff.item() == pytest.approx(0.25)
    only_empty = leanstep.GradPlan([dev(torch.zeros(0)), dev(torch.zeros(3))[3:]],
                                   backend="triton")
    assert only_empty.norm(math.inf)[0].item() == 0.0
    flag = leanstep.multi_tensor_scale([], [], 2.0, found_inf=dev(torch.zeros(1)),
                                       backend="triton")
    assert flag.item() == 0.0


# ---------------------------------------------------------------- multi_tensor_scale


def mts_pairs(gen):
    pairs = []
    for i, (sd, dd) in enumerate([(torch.float32, torch.float16), (torch.float16, torch.float32),
                                  (torch.bfloat16, torch.bfloat16), (torch.float64, torch.bfloat16),
                                  (torch.float32, torch.float64), (torch.float32, torch.float32)]):
        n = 37 + 211 * i
        src = (torch.randn(n, generator=gen, dtype=torch.float64) * 50).to(sd)
        pairs.append((src, torch.empty(n, dtype=dd)))
    big = torch.full((33,), 1.0e5)  # 1e5 * 0.01 into fp16: 1000, no fp16 intermediate
    pairs.append((big, torch.empty(33, dtype=torch.float16)))
    inplace = (torch.randn(301, generator=gen) * 3).to(torch.bfloat16)
    pairs.append((inplace, inplace))
    return pairs


@pytest.mark.parametrize("scale", [0.01, "tensor"])
@pytest.mark.parametrize("where", [None, "first", "middle", "last"])
def test_multi_tensor_scale_is_bitwise_the_cpu_path(scale, where, torch_gen):
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
    assert flag.item() == cpu_flag.item() == (0.0 if where is None else 1.0)
    for (s, d), (rs, rd) in zip(pairs, ref):
        assert_bitwise(d, rd)
        assert_bitwise(s, rs)
    assert torch.all(pairs[6][1] == 1000.0)


def test_multi_tensor_scale_fp16_overflow_and_sharing_pairs(torch_gen):
    src = torch.tensor([6.0e4, -6.0e4, 1.0, 65504.0], dtype=torch.float32)
    out = dev(torch.empty(4, dtype=torch.float16))
    out_cpu = torch.empty(4, dtype=torch.float16)
    flag = leanstep.multi_tensor_scale([dev(src)], [out], 2.0, backend="triton")
    leanstep.multi_tensor_scale([src], [out_cpu], 2.0)
    assert_bitwise(out, out_cpu)
    assert flag.item() == 0.0 and torch.isinf(out[:2]).all()  # overflow of the product is no flag
    # Pairs that share memory run in list order through the torch-op code; recorded as such.
    _backend.reset_calls()
    for cut in ((0, 16, 16, 32, 32, 48), (0, 32, 16, 48, 32, 64)):  # sharing; self-overlapping
        a, b, c, d, e, f = cut
        buf2 = torch.randn(64, generator=torch_gen)
        buf = dev(buf2.clone())
        leanstep.multi_tensor_scale([buf[a:b], buf[c:d]], [buf[c:d], buf[e:f]], 0.5,
                                    backend="triton")
        leanstep.multi_tensor_scale([buf2[a:b], buf2[c:d]], [buf2[c:d], buf2[e:f]], 0.5)
        assert_bitwise(buf, buf2)
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
    assert abs(norm.item() - cpu_norm.item()) <= 4 * U32 * cpu_norm.item()
    assert flag.item() == 0.0 and 0.0 < coeff.item() < 1.0


def test_launch_counts_do_not_depend_on_the_layout(torch_gen):
    for layout in (tiny_regions, aliased):
        bufs, views = on_device(*layout(torch_gen, torch.float32))
        plan = leanstep.GradPlan(views, backend="triton")
        with triton_common.count_launches() as launches:
            norm, flag = plan.norm()
        assert launches["_reduce_kernel"] == 1 and launches["_finish_kernel"] == 1


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
    assert _backend.choose_with_reason([cpu], None, "t", triton="grad") == ("cpu", "CPU tensors")
    monkeypatch.delenv("LEANSTEP_TRITON", raising=False)  # the default: automatic
    chosen, why = _backend.choose_with_reason(meta, None, "t", triton="grad")
    assert chosen == "torch" and "Triton kernels do not run meta tensors" in why
    with monkeypatch.context() as m:
        m.setenv("LEANSTEP_TRITON", "off")
        chosen, why = _backend.choose_with_reason(meta, None, "t", triton="grad")
        assert chosen == "torch" and "switched off (LEANSTEP_TRITON)" in why
        m.setenv("LEANSTEP_TRITON", "sometimes")
        with pytest.raises(leanstep.Error, match="LEANSTEP_TRITON must be 'auto'"):
            _backend.choose_with_reason(meta, None, "t", triton="grad")
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
            assert _backend.choose_with_reason(meta, None, "t", triton="grad") == (
                "triton", "meta tensors, Triton driver active, self-check passed")
            assert _backend.choose_with_reason(meta, None, "t", triton="moe") == (
                "torch", "meta tensors; Triton: the moe self-check failed: unpermute differs")
        assert checks == [("grad", "meta"), ("moe", "meta")]
        assert _backend.choose_with_reason(meta, None, "t", triton=False)[0] == "torch"
    assert leanstep.GradPlan([cpu]).backend == "cpu"
    if NATIVE:  # a device with a Triton driver: chosen without asking
        auto = leanstep.GradPlan([dev(cpu)])
        assert auto.backend == "triton" and "self-check passed" in auto._reason
    else:  # no GPU here: a cuda tensor cannot exist, but the decision says why not
        assert _backend.triton_unusable(torch.device("cuda")) is not None
    _backend.reset_calls()
    bufs, views = on_device(*aliased(torch_gen, torch.float32))
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
    explained; "all" runs the kernels again. The two norms agree to 2 fp32
    ulp: both accumulate in float64 and round once, in different orders."""
    bufs, views = on_device(*aliased(torch_gen, torch.float32))
    plan = leanstep.GradPlan(views, backend="triton")
    kind = DEVICE.type
    try:
        _backend.reset_calls()
        leanstep.set_preset("baseline")
        reference, _ = plan.norm(2.0)
        leanstep.set_preset("all")
        fast, _ = plan.norm(2.0)
        assert torch.allclose(fast.cpu(), reference.cpu(), rtol=2 ** -22, atol=0)
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
    assert abs(norm.item() - math.sqrt(36 + 6)) <= 4 * U32 * math.sqrt(42)
    with pytest.raises(leanstep.Error, match=r"multi_tensor_scale: argument 'dst_list\[0\]' "
                                             r"must not overlap itself"):
        leanstep.multi_tensor_scale([dev(torch.ones(6))], [dev(torch.zeros(1)).expand(6)], 2.0,
                                    backend="triton")
