"""The gradient engine's torch-op device backend: what the conformance
harness (test_conformance.py) does not hold. Its values on CPU tensors
(backend="torch") and on meta tensors are the harness's cases (every op,
dtype, layout, non-finite placement, the scalar forms and the clip
coefficient's edges); here: the region table it shares with the C++
planner, a coefficient of exactly one, pairs that share memory, the op
counts of the LoRA layout on meta, and the errors.
"""

import math

import pytest
import torch

import leanstep
from helpers import assert_bitwise
from leanstep._grad import ddp_grad_buffers
from test_conformance import FLOATS, grad_layout, grad_views, named_case


@pytest.mark.parametrize("dname", sorted(FLOATS))
def test_the_torch_plan_has_the_cpu_planners_region_table(dname, torch_gen):
    # The harness's layout: a view listed twice, one overlapping another, a
    # transposed one, an empty one, a second storage.
    buffers, layout = grad_layout(named_case("grad.norm", f"{dname}-views-p2"), torch_gen)
    views = grad_views(buffers, layout)
    cpu, dev = leanstep.GradPlan(views), leanstep.GradPlan(views, backend="torch")
    assert dev.backend == "torch"
    # The same coalescing and multiplicity (addresses, and so the order of the
    # storages: the device plan's own numbering).
    assert sorted(r[1:] for r in dev.regions) == sorted(r[1:] for r in cpu.regions)
    assert dev.generic == cpu.generic and dev.num_generic == cpu.num_generic >= 1
    assert any(r[3] == 2 for r in cpu.regions)  # the duplicate and the overlap


def test_clip_by_exactly_one_leaves_every_bit():
    g = torch.tensor([1.0, -0.0, 3e-45, 65504.0, 1e-8], dtype=torch.float32)
    before = g.clone()
    coeff = leanstep.GradPlan([g], backend="torch").clip_(1e30, torch.tensor([1.0]))
    assert coeff.item() == 1.0
    assert_bitwise(g, before)


def test_multi_tensor_scale_overlaps_follow_list_order():
    def run(backend):
        buf = torch.arange(20, dtype=torch.float32)
        # pair 0 writes [5, 15); pair 1 reads [10, 20) (partly pair 0's output);
        # pair 2 is in place; pair 3 partially overlaps itself.
        src = [buf[0:10], buf[10:20], buf[0:3], buf[2:8]]
        dst = [buf[5:15], buf[0:10], buf[0:3], buf[4:10]]
        leanstep.multi_tensor_scale(src, dst, 2.0, backend=backend)
        return buf

    expected = run(None)
    assert not torch.equal(expected, torch.arange(20, dtype=torch.float32) * 2)  # order matters
    assert_bitwise(run("torch"), expected)


# ---------------------------------------------------------------- meta tensors: no host reads


def lora_layout(device):
    params = leanstep.model_params("qwen3_omni_lora")
    return ddp_grad_buffers(params, distributed_optimizer=True, dp_size=8, device=device)


def test_norm_clip_of_the_lora_layout_is_sync_free_in_few_ops():
    buffers, grads, _ = lora_layout("meta")
    assert len(grads) == 3168
    plan = leanstep.GradPlan(grads)
    assert plan.backend == "torch"  # chosen from the device
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


def _bound_twice(cache, make_grads):
    """A cached torch-op plan bound to a second fresh list of the same views (a
    cache hit, as each step of Megatron's loop), and that list."""
    cache.get(make_grads())
    grads = make_grads()
    plan, reason = cache.get(grads, in_place=True)
    assert reason is None and plan.backend == "torch"
    return plan, grads


@pytest.mark.parametrize("dname", sorted(FLOATS))
@pytest.mark.parametrize("case", ["whole_buffer", "buffer_with_a_tail", "two_d_buffer",
                                  "offset_view"])
def test_a_cached_plan_binds_a_whole_buffer_as_its_region_and_only_that(dname, case, torch_gen):
    # The cache's bind takes the views' base as the one region's flat view (no storage
    # object, no as_strided) only where that base is exactly the region's memory;
    # otherwise the general bind. Either way the scale is the CPU kernels' bit for bit,
    # and memory outside the views is never written.
    from leanstep._plans import PlanCache

    n, numel = 37, 5  # odd sizes
    owner = torch.randn(n * numel + 11, generator=torch_gen).to(FLOATS[dname])
    start = 0
    if case == "whole_buffer":
        base = owner[: n * numel].clone()
    elif case == "buffer_with_a_tail":
        base = owner  # the views leave 11 elements out: the region is not the base
    elif case == "two_d_buffer":
        base = owner[: n * numel].clone().view(n, numel)
    else:
        base, start = owner, 3  # views of a view: their root is larger than the region

    def views_of(tensor):
        flat = tensor.detach().view(-1)[start:]
        return [flat[i * numel:(i + 1) * numel] for i in range(n)]

    cache = PlanCache()
    cache.backend = "torch"
    plan, grads = _bound_twice(cache, lambda: views_of(base))
    (view,) = plan._torch_plan.views
    assert (view is grads[0]._base) == (case == "whole_buffer"), case
    assert view.data_ptr() == grads[0].data_ptr() and view.numel() == n * numel
    expected = base.detach().clone()
    leanstep.GradPlan(views_of(expected)).scale_(0.37)  # the CPU kernels
    plan.scale_(0.37)
    assert_bitwise(base.detach(), expected)  # outside the views too: untouched


def test_a_whole_buffer_bind_still_finds_a_re_pointed_view():
    # The key fixes every view's address: a list whose views moved to another buffer
    # of the same size gets a new plan, never the first buffer as its region.
    from leanstep._plans import PlanCache

    first, second = torch.ones(40), torch.full((40,), 2.0)
    cache = PlanCache()
    cache.backend = "torch"
    _bound_twice(cache, lambda: list(first.split(8)))
    grads = list(second.split(8))
    plan, _ = cache.get(grads, in_place=True)
    (view,) = plan._torch_plan.views
    assert view.data_ptr() == second.data_ptr()
    plan.scale_(0.5)
    assert torch.equal(first, torch.ones(40)) and torch.equal(second, torch.ones(40))


def test_the_same_key_over_another_base_takes_the_general_bind():
    # Two lists with equal keys (the same addresses, shapes and strides), whose views'
    # bases differ: first the views of a tensor that is exactly the region (not itself a
    # view), then the same views taken from the larger tensor that owns the storage. The
    # cached plan binds the first's base, and must not take the second's (11 elements
    # longer): the general bind, and the tail never written.
    from leanstep._plans import PlanCache

    n = 40
    owner = torch.arange(float(n + 11))
    exact = torch.empty(0).set_(owner.untyped_storage(), 0, (n,), (1,))
    assert exact._base is None and exact.data_ptr() == owner.data_ptr()
    cache = PlanCache()
    cache.backend = "torch"
    plan, grads = _bound_twice(cache, lambda: list(exact.split(8)))
    assert plan._torch_plan.views[0] is grads[0]._base  # exact itself
    grads = list(owner[:n].split(8))
    assert grads[0]._base is owner
    plan, reason = cache.get(grads, in_place=True)
    assert reason is None
    (view,) = plan._torch_plan.views
    assert view is not owner and view.numel() == n and view.data_ptr() == owner.data_ptr()
    plan.scale_(2.0)
    expected = torch.arange(float(n + 11))
    expected[:n] *= 2.0
    assert torch.equal(owner, expected)


def test_a_base_that_requires_grad_is_never_the_regions_view():
    # Views taken under no_grad of a leaf that requires grad: an in-place op on the leaf
    # itself is refused where one on the grads' own region view is torch's to judge, as
    # before the shortcut. The bind leaves such a base alone.
    from leanstep._plans import PlanCache

    base = torch.ones(40, requires_grad=True)

    def views():
        with torch.no_grad():
            return list(base.split(8))

    cache = PlanCache()
    cache.backend = "torch"
    plan, grads = _bound_twice(cache, views)
    assert grads[0]._base is base
    (view,) = plan._torch_plan.views
    assert view is not base and view.numel() == 40 and view.data_ptr() == base.data_ptr()


# ---------------------------------------------------------------- what a device's kernels lack


@pytest.mark.parametrize("dname", sorted(FLOATS))
@pytest.mark.parametrize("op", ["unscale", "scale", "clip"])
def test_the_device_formulations_match_the_cpu_path_bit_for_bit(dname, op, monkeypatch,
                                                                  torch_gen):
    """On CUDA, ``_amp_foreach_non_finite_check_and_unscale_`` has no bf16
    kernel, and ``_foreach_mul_`` by an fp32 0-d tensor casts it to an fp16 or
    bf16 view's dtype first (both measured on an H200). The torch-op backend
    then forms the products in fp32 itself. Those formulations, forced here on
    CPU tensors, must give the C++ path's bits and flag: the harness layout
    (a view listed twice, an overlap, a strided view, a second storage), a
    non-finite value included."""
    from leanstep.backends import torch_grad

    case = named_case("grad.norm", f"{dname}-views-p2")
    scale = 0.7308  # not a power of two: every product is rounded

    def run(device_formulations):
        with monkeypatch.context() as m:
            if device_formulations:
                m.setattr(torch_grad, "_amp_unscale_takes_bf16", lambda device_type: False)
                m.setattr(torch_grad, "_foreach_scale_reads_fp32", lambda device_type: False)
                m.setattr(torch_grad, "_WIDE_CHUNK", 5)  # regions in bounded pieces, odd size
            gen = torch.Generator().manual_seed(int(torch_gen.initial_seed()))
            buffers, layout = grad_layout(case, gen)
            buffers[0].view(-1)[3] = math.inf if op == "unscale" else buffers[0].view(-1)[3]
            views = grad_views(buffers, layout)
            plan = leanstep.GradPlan(views, backend="torch" if device_formulations else None)
            flag = torch.zeros(1)
            if op == "unscale":
                plan.unscale_(scale, found_inf=flag)
            elif op == "scale":
                plan.scale_(torch.tensor([scale]))
            else:
                plan.clip_(1.0, torch.tensor([1.0 / scale - 1e-6]))
            return buffers, flag

    expected, expected_flag = run(False)
    got, flag = run(True)
    for a, b in zip(got, expected):
        assert_bitwise(a, b)
    assert_bitwise(flag, expected_flag)
    if op == "unscale":
        assert flag.item() == 1.0


def test_a_plan_names_its_device_as_its_tensors_do(monkeypatch):
    """torch.device("cuda") means the current device, but a tensor there says
    cuda:0, and the two compare unequal: a plan built for the former refused
    its own found_inf (first seen on an H200, where the Triton self-check
    failed on it and the Triton grad kernels were never chosen)."""
    from leanstep.backends import torch_grad

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert torch_grad.canonical_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert torch_grad.canonical_device("cuda:1") == torch.device("cuda", 1)
    assert torch_grad.canonical_device(torch.device("cpu")) == torch.device("cpu")
    assert torch_grad.canonical_device("meta") == torch.device("meta")
    assert torch_grad.TorchGradPlan([], torch.device("cuda")).device == torch.device("cuda", 3)


# ---------------------------------------------------------------- the norm without its flag


def test_total_norm_makes_no_flag_on_the_torch_backend():
    # get_grad_norm_fp32 and clip_grad_norm_ drop the flag: total_norm must not pay for it
    # (its zeroed scalar and the non-finite test: four ops), and must stay sync-free.
    _, grads, _ = lora_layout("meta")
    plan = leanstep.GradPlan(grads)
    with leanstep.audit() as with_flag:
        plan.norm(2.0)
    with leanstep.audit() as alone:
        plan.total_norm(2.0)
    assert alone.num_syncs == 0 and alone.num_host_reads == 0, alone.format_table()
    assert alone.num_ops <= with_flag.num_ops - 4, (
        f"total_norm: {alone.num_ops} ops, norm: {with_flag.num_ops}\n{alone.format_table()}")
    table = alone.format_table()
    assert "aten.maximum" not in table and "aten.ne." not in table, table


def test_one_region_is_one_op_on_the_torch_backend():
    # A flat buffer's views coalesce into one region: its norm is one op, then the fp32
    # result; its zero count one op (on a view of it), then numel minus the count.
    buf = torch.empty(3168 * 16, device="meta")
    plan = leanstep.GradPlan(list(buf.split(16)))
    with leanstep.audit() as norm:
        plan.total_norm(2.0)
    assert norm.num_syncs == 0 and norm.num_ops <= 2, norm.format_table()
    with leanstep.audit() as zeros:
        plan.count_zeros()
    assert zeros.num_syncs == 0 and zeros.num_ops <= 3, zeros.format_table()
    with leanstep.audit() as scaled:
        plan.scale_(0.5)  # fp32 views times a Python number: one multiply in place
    assert scaled.num_syncs == 0 and scaled.num_ops == 1, scaled.format_table()


@pytest.mark.parametrize("dname", sorted(FLOATS))
@pytest.mark.parametrize("p", [2.0, math.inf, 1.0, 3.0])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("layout", ["one_region", "views_in_two_buffers", "duplicated", "empty"])
def test_total_norm_is_norms_value_on_random_grads(dname, p, backend, layout, torch_gen):
    """total_norm gives norm()'s first result bit for bit on the same plan, and both
    are within one fp32 rounding of a float64 oracle: the sum runs in float64 on
    both backends (its error, below 2^-40 relative for these sizes, is far under
    the 2^-24 of the final fp32 rounding; 2^-23 allows for the fp16/bf16 grads'
    own widening, which is exact). The torch backend takes one op for a single
    region (a flat buffer's views), the list path otherwise: both are covered."""
    dtype = FLOATS[dname]
    sizes = [int(s) for s in torch.randint(1, 300, (int(torch.randint(1, 9, (1,),
                                                                        generator=torch_gen)),),
                                           generator=torch_gen)]
    buf = (torch.randn(sum(sizes) + 5, generator=torch_gen, dtype=torch.float64)
           * 10.0 ** float(torch.randint(-3, 4, (1,), generator=torch_gen))).to(dtype)
    views = list(buf[5:].split(sizes))
    if layout == "views_in_two_buffers":
        views.append(torch.randn(17, generator=torch_gen, dtype=torch.float64).to(dtype))
    elif layout == "duplicated":
        views.append(views[0])  # listed twice: counted twice, as the CPU path does
    elif layout == "empty":
        views = []
    plan = leanstep.GradPlan(views, backend=backend, like=buf)
    if layout == "one_region" and backend == "torch":
        assert len(plan._torch_plan.views) == 1  # the single-op path
    alone = plan.total_norm(p)
    with_flag, _ = plan.norm(p)
    assert alone.dtype == torch.float32 and alone.shape == (1,)
    assert_bitwise(alone, with_flag)
    if views:
        values = torch.cat([v.reshape(-1).to(torch.float64) for v in views])
        oracle = values.abs().max() if p == math.inf else values.abs().pow(p).sum().pow(1.0 / p)
    else:
        oracle = torch.zeros((), dtype=torch.float64)
    assert abs(float(alone) - float(oracle)) <= 2.0 ** -23 * float(oracle), (
        f"{float(alone)!r} against the float64 oracle {float(oracle)!r}")


def test_total_norm_of_a_non_finite_grad_is_the_norms():
    # No flag made, but the value says it: inf or NaN as norm() gives it.
    for bad in (math.inf, math.nan):
        buf = torch.ones(40)
        buf[7] = bad
        views = list(buf.split([9, 31]))
        for backend in ("cpu", "torch"):
            plan = leanstep.GradPlan(views, backend=backend)
            for p in (2.0, math.inf):
                got, flag = plan.norm(p)
                assert flag.item() == 1.0
                assert_bitwise(plan.total_norm(p), got)
                assert not math.isfinite(got.item())


@pytest.mark.parametrize("dname", sorted(FLOATS))
@pytest.mark.parametrize("layout", ["one_region", "views_in_two_buffers", "duplicated", "empty"])
def test_count_zeros_on_random_grads_every_backend(dname, layout, torch_gen):
    # The torch backend counts one region (a flat buffer's views) in one op plus the
    # subtraction, the list path otherwise; both against the exact count (zeros of both
    # signs, a view listed twice counted twice).
    dtype = FLOATS[dname]
    n_views = int(torch.randint(1, 9, (1,), generator=torch_gen))
    sizes = [int(s) for s in torch.randint(0, 300, (n_views,), generator=torch_gen)]
    buf = torch.randn(sum(sizes) + 3, generator=torch_gen).to(dtype)
    buf[torch.rand(buf.shape, generator=torch_gen) < 0.3] = 0.0
    buf[torch.rand(buf.shape, generator=torch_gen) < 0.1] = -0.0
    views = list(buf[3:].split(sizes))
    if layout == "views_in_two_buffers":
        views.append(torch.tensor([0.0, 1.0, -0.0], dtype=dtype))
    elif layout == "duplicated":
        views.append(views[-1])
    elif layout == "empty":
        views = []
    expected = sum(int((v == 0).sum()) for v in views)
    for backend in ("cpu", "torch"):
        plan = leanstep.GradPlan(views, backend=backend, like=buf)
        got = plan.count_zeros()
        assert got.dtype == torch.int64 and got.shape == (1,)
        assert int(got) == expected, (backend, int(got), expected)


@pytest.mark.parametrize("dname", sorted(FLOATS))
@pytest.mark.parametrize("layout", ["one_region", "views_in_two_buffers", "duplicated", "empty"])
def test_scale_by_a_number_on_random_grads_every_backend(dname, layout, torch_gen):
    """scale_ by a Python number: the torch backend (one multiply over a single fp32
    region, its list path otherwise) gives the CPU kernels' bits on every dtype and
    layout; a view listed twice is scaled twice. fp32 grads are also checked against
    a float64 oracle: x * float32(scale) is exact in float64, so rounding it to fp32
    once must give the kernels' bits (tolerance 0)."""
    dtype = FLOATS[dname]
    n_views = int(torch.randint(1, 9, (1,), generator=torch_gen))
    sizes = [int(s) for s in torch.randint(0, 300, (n_views,), generator=torch_gen)]
    source = torch.randn(sum(sizes) + 3, generator=torch_gen, dtype=torch.float64).to(dtype)
    scale = float(torch.rand((), generator=torch_gen, dtype=torch.float64)) * 2.0
    results = {}
    for backend in ("cpu", "torch"):
        buf = source.clone()
        views = list(buf[3:].split(sizes))
        if layout == "views_in_two_buffers":
            views.append(torch.tensor([1.5, -2.25, 3.0], dtype=dtype))
        elif layout == "duplicated":
            views.append(views[-1])
        elif layout == "empty":
            views = []
        plan = leanstep.GradPlan(views, backend=backend, like=source)
        if backend == "torch" and layout == "one_region":
            assert len(plan._torch_plan.views) == 1  # the single-op path for fp32
        plan.scale_(scale)
        results[backend] = (buf, views)
    (cpu_buf, cpu_views), (torch_buf, torch_views) = results["cpu"], results["torch"]
    assert_bitwise(torch_buf, cpu_buf)
    for got, want in zip(torch_views, cpu_views):
        assert_bitwise(got, want)
    if dtype == torch.float32 and layout == "one_region":
        oracle = (source[3:].to(torch.float64) * float(torch.tensor(scale, dtype=torch.float32)))
        assert_bitwise(torch_buf[3:], oracle.to(torch.float32))
    assert_bitwise(torch_buf[:3], source[:3])  # memory outside the views is untouched


def test_a_plan_built_for_fresh_grads_each_call_reasons_and_names_as_before():
    # Fresh grads each step (the HF Trainer's zero_grad) build a plan every call; its
    # checks run as passes in C over the list. The reasons the cache gives, the names
    # an error gives, and the fingerprint a cached plan carries stay what they were.
    from leanstep._grad import GradPlan, _ArgNames, fingerprint
    from leanstep._plans import PlanCache, grads_with_key

    cache = PlanCache()
    plain = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16)]

    class Sub(torch.Tensor):
        pass

    assert cache.get(plain + [torch.ones(3).as_subclass(Sub)])[1] == "tensor_subclass"
    assert cache.get(plain + [torch.ones(3, dtype=torch.int32)])[1] == "dtype"
    assert cache.get(plain + [torch.ones(3, device="meta")])[1] == "mixed_devices"
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(5)]
    for p in params:
        p.grad = torch.randn(4)
    grads, key = grads_with_key(params)
    plan, reason = cache.get(grads, key=key)
    # The cache's plan is for this call (as a bound template is): not read again.
    assert reason is None and plan._fingerprint is None
    assert plan.dtypes == frozenset({torch.float32})
    # Built with the key, a plan keeps it as its fingerprint (what fingerprint() reads),
    # and finds a grad re-pointed after it was built.
    plan = GradPlan(grads, _key=key[1], _plain_cpu=True)
    assert plan._fingerprint == fingerprint(grads) == key[1]
    plan.total_norm()
    grads[1].set_(torch.zeros(4))
    with pytest.raises(leanstep.Error, match="re-pointed or resized"):
        plan.total_norm()
    grads, key = grads_with_key(params)
    params[2].grad.requires_grad_(True)  # a grad that requires grad: the plan keeps a detached view
    plan = GradPlan([p.grad for p in params])
    assert not any(g.requires_grad for g in plan.grads)
    assert plan.grads[2].data_ptr() == params[2].grad.data_ptr()
    names = _ArgNames(2, 1, 1)
    assert [names[i] for i in range(len(names))] == ["grads[0]", "grads[1]", "buffers[0]", "like"]
    with pytest.raises(IndexError):
        names[4]
    with pytest.raises(leanstep.Error, match=r"'grads\[0\]' on cpu and 'grads\[3\]' on meta"):
        GradPlan([torch.ones(1)] * 3 + [torch.ones(1, device="meta")], backend="torch")
    with pytest.raises(leanstep.Error, match=r"grads\[1\]"):
        GradPlan([torch.ones(2), torch.ones(2, dtype=torch.complex64)])
