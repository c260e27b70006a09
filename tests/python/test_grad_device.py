"""The gradient engine's torch-op device backend, checked on CPU tensors
(backend="torch") against the C++ path and a float64 oracle, and on meta
tensors for zero host reads and its op count.

Tolerances: both paths accumulate the norm in float64 and round once to
fp32, so each is within 1 fp32 ulp of the float64 oracle (bound used: 2 ulp,
2 * 2^-24 relative, to cover the fp64 rounding of the sum); they may differ
from each other by the same. Everything that is a rounding of one fp32
product per element (clip, scale, unscale, multi_tensor_scale) and every
count is bitwise, as is the multiplicity of duplicated and overlapping views.
"""

import math

import numpy as np
import pytest
import torch

import leanstep
from leanstep._grad import ddp_grad_buffers

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
NORM_TYPES = [2.0, math.inf, 1.0, 1.5]
U32 = 2.0**-24


def make_views(gen, dtype, n=2000):
    """A buffer and a list of views into it: params, a duplicate, an
    overlap, a strided (transposed) view, an empty view and odd sizes."""
    buf = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).to(dtype)
    sizes = [int(s) for s in torch.randint(1, 97, (12,), generator=gen)]
    views, at = [], 0
    for s in sizes:
        views.append(buf[at:at + s])
        at += s + int(torch.randint(0, 5, (1,), generator=gen))  # padding never listed
    views.append(views[2])                    # the same view twice
    views.append(buf[at - 40:at - 10])        # overlaps the last params
    views.append(buf[at:at + 48].view(6, 8).t())  # strided: a generic view
    views.append(buf[at + 48:at + 48])        # empty
    views.append(buf[at + 60:at + 61].view(1, 1))
    return buf, views


def clone_views(buf, views):
    """The same views into a copy of the buffer."""
    copy = buf.clone()
    base = buf.untyped_storage().data_ptr()
    out = []
    for v in views:
        out.append(copy.as_strided(v.shape, v.stride(), v.storage_offset()))
    assert copy.untyped_storage().data_ptr() != base
    return copy, out


def oracle_norm(views, p):
    vals = [v.detach().to(torch.float64).reshape(-1).numpy() for v in views]
    flat = np.concatenate(vals) if vals else np.zeros(0)
    if p == math.inf:
        return float(np.abs(flat).max()) if flat.size else 0.0
    return float((np.abs(flat) ** p).sum() ** (1.0 / p))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", NORM_TYPES)
def test_norm_matches_cpu_path_and_oracle(dtype, p, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    cpu_norm, cpu_flag = leanstep.GradPlan(views).norm(p)
    plan = leanstep.GradPlan(views, backend="torch")
    assert plan.backend == "torch"
    dev_norm, dev_flag = plan.norm(p)
    exact = oracle_norm(views, p)
    assert abs(dev_norm.item() - exact) <= 2 * U32 * exact, (dev_norm.item(), exact)
    assert abs(cpu_norm.item() - exact) <= 2 * U32 * exact
    assert dev_flag.item() == cpu_flag.item() == 0.0
    # The same region table as the CPU planner: same coalescing and multiplicity.
    assert plan.num_regions == leanstep.GradPlan(views).num_regions
    assert plan.num_generic == leanstep.GradPlan(views).num_generic


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("p", [2.0, math.inf, 1.5])
def test_found_inf_and_nan_propagation(dtype, where, bad, p, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    listed = [v for v in views if v.numel() > 0]
    target = {"first": listed[0], "middle": listed[len(listed) // 2], "last": listed[-1]}[where]
    target.view(-1)[{"first": 0, "middle": target.numel() // 2, "last": -1}[where]] = bad
    norm, flag = leanstep.GradPlan(views, backend="torch").norm(p)
    cpu_norm, cpu_flag = leanstep.GradPlan(views).norm(p)
    assert flag.item() == cpu_flag.item() == 1.0
    if math.isnan(bad):
        assert math.isnan(norm.item()) and math.isnan(cpu_norm.item())
    else:
        assert norm.item() == cpu_norm.item() == math.inf


def test_found_inf_is_ored_into_and_large_finite_values_are_not_flagged():
    # fp16 max squared overflows fp32 but not the float64 accumulator.
    g = torch.full((64,), 65504.0, dtype=torch.float16)
    flag = torch.zeros(1)
    norm, flag_out = leanstep.GradPlan([g], backend="torch").norm(2.0, found_inf=flag)
    assert flag_out is flag and flag.item() == 0.0
    assert norm.item() == pytest.approx(65504.0 * 8, rel=U32)
    flag.fill_(1.0)
    leanstep.GradPlan([g], backend="torch").norm(2.0, found_inf=flag)
    assert flag.item() == 1.0  # OR-ed into, never reset


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e30])
def test_clip_is_bitwise_the_cpu_path(dtype, max_norm, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    buf2, views2 = clone_views(buf, views)
    norm = leanstep.GradPlan(views).norm()[0]
    coeff_cpu = leanstep.GradPlan(views).clip_(max_norm, norm.clone())
    coeff_dev = leanstep.GradPlan(views2, backend="torch").clip_(max_norm, norm.clone())
    assert torch.equal(coeff_cpu, coeff_dev)
    assert torch.equal(buf, buf2)  # every element, the duplicated ones scaled twice
    if max_norm == 1e30:
        assert coeff_dev.item() == 1.0


def test_clip_by_exactly_one_leaves_every_bit():
    g = torch.tensor([1.0, -0.0, 3e-45, 65504.0, 1e-8], dtype=torch.float32)
    before = g.clone()
    coeff = leanstep.GradPlan([g], backend="torch").clip_(1e30, torch.tensor([1.0]))
    assert coeff.item() == 1.0
    assert torch.equal(g.view(torch.int32), before.view(torch.int32))


def test_clip_with_a_nan_norm_gives_nan_grads_never_unclipped():
    g = torch.ones(5)
    coeff = leanstep.GradPlan([g], backend="torch").clip_(1.0, torch.tensor([math.nan]))
    assert math.isnan(coeff.item()) and torch.isnan(g).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_clip_matches_cpu(dtype, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    buf2, views2 = clone_views(buf, views)
    n1, f1, c1 = leanstep.GradPlan(views).norm_clip_(0.5)
    n2, f2, c2 = leanstep.GradPlan(views2, backend="torch").norm_clip_(0.5)
    assert abs(n1.item() - n2.item()) <= 2 * U32 * n1.item()
    assert f1.item() == f2.item() == 0.0
    assert abs(c1.item() - c2.item()) <= 4 * U32 * c1.item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inv_scale", [0.25, 1.0 / 3.0, 1.0])
def test_unscale_norm_is_bitwise_on_the_grads(dtype, inv_scale, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    buf2, views2 = clone_views(buf, views)
    views[3].view(-1)[-1] = math.inf  # the last element: views have random sizes >= 1
    views2[3].view(-1)[-1] = math.inf
    n1, f1 = leanstep.GradPlan(views).norm(2.0, inv_scale=inv_scale)
    n2, f2 = leanstep.GradPlan(views2, backend="torch").norm(2.0,
                                                             inv_scale=torch.tensor([inv_scale]))
    assert f1.item() == f2.item() == 1.0
    assert torch.equal(buf.nan_to_num(), buf2.nan_to_num())
    assert n1.item() == n2.item() == math.inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_alone_matches_unscale_norm(dtype, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    buf2, views2 = clone_views(buf, views)
    flag1 = leanstep.GradPlan(views).unscale_(0.125)
    flag2 = leanstep.GradPlan(views2, backend="torch").unscale_(0.125)
    assert flag1.item() == flag2.item() == 0.0
    assert torch.equal(buf, buf2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_count_zeros_exact(dtype, torch_gen):
    buf, views = make_views(torch_gen, dtype)
    mask = torch.rand(buf.shape, generator=torch_gen) < 0.3
    buf[mask] = 0.0
    buf[0] = -0.0
    buf[5] = math.nan
    expected = sum(v.numel() - int(torch.count_nonzero(v)) for v in views)
    assert leanstep.GradPlan(views, backend="torch").count_zeros().item() == expected
    assert leanstep.GradPlan(views).count_zeros().item() == expected


def test_scale_is_bitwise(torch_gen):
    for dtype in DTYPES:
        buf, views = make_views(torch_gen, dtype)
        buf2, views2 = clone_views(buf, views)
        leanstep.GradPlan(views).scale_(torch.tensor([0.7]))
        leanstep.GradPlan(views2, backend="torch").scale_(0.7)
        assert torch.equal(buf, buf2), dtype


def test_empty_list(torch_gen):
    plan = leanstep.GradPlan([], like=torch.empty(0), backend="torch")
    norm, flag = plan.norm()
    assert norm.item() == 0.0 and flag.item() == 0.0
    assert plan.count_zeros().item() == 0
    assert plan.clip_(1.0, norm).item() == 1.0


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_multi_tensor_scale_bitwise(src_dtype, dst_dtype, torch_gen):
    srcs = [(torch.randn(n, generator=torch_gen, dtype=torch.float64) * 1e3).to(src_dtype)
            for n in (1, 7, 300, 0)]
    srcs[1][3] = math.inf
    outs_cpu = [torch.empty(s.shape, dtype=dst_dtype) for s in srcs]
    outs_dev = [torch.empty(s.shape, dtype=dst_dtype) for s in srcs]
    f1 = leanstep.multi_tensor_scale(srcs, outs_cpu, 0.01)
    f2 = leanstep.multi_tensor_scale(srcs, outs_dev, 0.01, backend="torch")
    assert f1.item() == f2.item() == 1.0
    for a, b in zip(outs_cpu, outs_dev):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_multi_tensor_scale_overlaps_follow_list_order(torch_gen):
    def run(backend):
        buf = torch.arange(20, dtype=torch.float32)
        # pair 0 writes [5, 15); pair 1 reads [10, 20) (partly pair 0's output);
        # pair 2 is in place; pair 3 partially overlaps itself.
        src = [buf[0:10], buf[10:20], buf[0:3], buf[2:8]]
        dst = [buf[5:15], buf[0:10], buf[0:3], buf[4:10]]
        leanstep.multi_tensor_scale(src, dst, 2.0, backend=backend)
        return buf

    assert torch.equal(run(None), run("torch"))


# ---------------------------------------------------------------- meta tensors: no host reads


def lora_layout(device):
    params = leanstep.model_params("qwen3_omni_lora")
    return ddp_grad_buffers(params, distributed_optimizer=True, dp_size=8, device=device)


def test_every_entry_point_runs_on_meta():
    buffers, grads, _ = lora_layout("meta")
    plan = leanstep.GradPlan(grads)
    assert plan.backend == "torch"  # chosen from the device
    norm, flag = plan.norm()
    assert norm.device.type == "meta" and flag.shape == (1,)
    plan.norm(math.inf)
    plan.norm(1.5)
    plan.norm(2.0, inv_scale=torch.ones(1, device="meta"))
    plan.unscale_(0.5)
    plan.clip_(1.0, norm)
    plan.norm_clip_(1.0)
    plan.scale_(0.5)
    assert plan.count_zeros().dtype == torch.int64
    leanstep.multi_tensor_scale(grads[:5], [torch.empty_like(g) for g in grads[:5]], 0.5)


def test_norm_clip_of_the_lora_layout_is_sync_free_in_few_ops():
    buffers, grads, _ = lora_layout("meta")
    assert len(grads) == 3168
    plan = leanstep.GradPlan(grads)
    with leanstep.audit() as a:
        norm, found_inf, coeff = plan.norm_clip_(1.0)
    assert a.num_syncs == 0, a.format_table()
    assert a.num_host_reads == 0, a.format_table()
    assert a.num_ops <= 16, f"{a.num_ops} aten ops:\n{a.format_table()}"


def test_unscale_norm_and_count_zeros_op_counts():
    buffers, grads, _ = lora_layout("meta")
    plan = leanstep.GradPlan(grads)
    with leanstep.audit() as a:
        plan.norm(2.0, inv_scale=torch.full((1,), 0.5, device="meta"))
    assert a.num_syncs == 0 and a.num_ops <= 10, a.format_table()
    with leanstep.audit() as a:
        plan.count_zeros()
    assert a.num_syncs == 0 and a.num_ops <= 8, a.format_table()


# ---------------------------------------------------------------- bad input


def test_mixed_devices_are_an_error_naming_both():
    with pytest.raises(leanstep.Error, match=r"one device.*grads\[0\].*cpu.*grads\[1\].*meta"):
        leanstep.GradPlan([torch.zeros(3), torch.zeros(3, device="meta")])


def test_backend_cpu_refuses_device_tensors_and_unknown_backends():
    with pytest.raises(leanstep.Error, match=r"backend='cpu' needs CPU tensors \(got meta\)"):
        leanstep.GradPlan([torch.zeros(3, device="meta")], backend="cpu")
    with pytest.raises(leanstep.Error, match=r"argument 'backend' must be one of.*got 'cuda'"):
        leanstep.GradPlan([torch.zeros(3)], backend="cuda")


def test_unusable_device_is_named():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the device is usable")
    # A CUDA tensor cannot be made here; the check itself names the device.
    from leanstep import _backend

    assert "no usable CUDA" in _backend.device_usable(torch.device("cuda"))
    # torch itself cannot name an npu device without torch_npu: a stand-in
    # with the device's type is what the check reads.
    import types

    assert "torch_npu" in _backend.device_usable(types.SimpleNamespace(type="npu"))


def test_integer_grads_and_bad_scalars_are_refused():
    with pytest.raises(leanstep.Error, match=r"grads\[0\]' must be float32.*got int64"):
        leanstep.GradPlan([torch.zeros(3, dtype=torch.int64)], backend="torch")
    plan = leanstep.GradPlan([torch.zeros(3)], backend="torch")
    with pytest.raises(leanstep.Error, match=r"'norm' must be a 1-element float32 tensor"):
        plan.clip_(1.0, torch.zeros(2))
    with pytest.raises(leanstep.Error, match=r"clip: argument 'max_norm' must be finite and >= 0 "
                                             r"\(got -1\)"):
        plan.clip_(-1.0, torch.zeros(1))
    with pytest.raises(leanstep.Error, match=r"'inv_scale' must be finite \(got nan\)"):
        plan.norm(2.0, inv_scale=math.nan)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("change", ["set_", "resize_", "storage_resize"])
def test_a_re_pointed_or_resized_grad_is_refused(backend, change):
    buf = torch.ones(100)
    grads = [buf[:10], buf[10:30]]
    plan = leanstep.GradPlan(grads, backend=backend)
    assert plan.is_current()
    if change == "set_":
        grads[1].set_(torch.zeros(20))
    elif change == "resize_":
        grads[0].resize_(50)
    else:
        buf.untyped_storage().resize_(0)
    assert not plan.is_current()
    with pytest.raises(leanstep.Error, match="re-pointed or resized since the plan was built"):
        plan.norm()
    with pytest.raises(leanstep.Error, match="re-pointed or resized"):
        plan.clip_(1.0, torch.ones(1))
