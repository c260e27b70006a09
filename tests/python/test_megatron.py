"""leanstep.megatron against the REAL megatron-core in the environment: which
aliases get patched, idempotence, exact restore, refusal of a mismatched
signature, and result parity with Megatron-Core's own functions on CPU."""

import importlib.metadata
import inspect
import math
import os
import struct
import types
import warnings

import numpy as np
import pytest
import torch

import leanstep
from helpers import assert_within_ulps, one_rank_gloo, randn, to_f64

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
mcore = pytest.importorskip("megatron.core")

import leanstep.megatron as lm  # noqa: E402
import leanstep.megatron.grad as lm_grad  # noqa: E402
from leanstep.megatron._patching import megatron_core_version  # noqa: E402
import megatron.core.optimizer.clip_grads as clip_grads  # noqa: E402
import megatron.core.optimizer.layer_wise_optimizer as layer_wise_optimizer  # noqa: E402
import megatron.core.optimizer.optimizer as optimizer  # noqa: E402
import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402
import megatron.core.transformer.moe.token_dispatcher as token_dispatcher  # noqa: E402
import megatron.core.transformer.torch_norm as torch_norm  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# 0.17 and later (Python >= 3.12): count_zeros_fp32 takes expert_tp_group and
# returns an int; permute returns a 5-tuple and needs num_out_tokens.
NEW_API = "expert_tp_group" in inspect.signature(clip_grads.count_zeros_fp32).parameters
print(f"megatron-core {mcore.__version__}: {'0.17+ API' if NEW_API else '0.16 API'}")

GRAD_FUNCS = ["get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"]
MOE_FUNCS = ["permute", "unpermute", "sort_chunks_by_idxs", "pad_routing_map"]
# Where megatron-core 0.16 imported each function by name.
EXPECTED_ALIASES = {
    "get_grad_norm_fp32": [clip_grads, optimizer, layer_wise_optimizer],
    "clip_grad_by_total_norm_fp32": [clip_grads, optimizer],
    "count_zeros_fp32": [clip_grads, optimizer, layer_wise_optimizer],
    "permute": [moe_utils, token_dispatcher],
    "unpermute": [moe_utils, token_dispatcher],
    "sort_chunks_by_idxs": [moe_utils, token_dispatcher],
    "pad_routing_map": [moe_utils, token_dispatcher],
}
ORIGINALS = {name: getattr(mods[0], name) for name, mods in EXPECTED_ALIASES.items()}
ORIGINAL_NORM_NEW = torch_norm.WrappedTorchNorm.__dict__["__new__"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """A one-rank gloo group on localhost, as the collectives need one."""
    with one_rank_gloo():
        yield


@pytest.fixture
def patched():
    lm.uninstall()
    lm.reset_call_counts()
    lm.install()
    yield
    lm.uninstall()


def assert_all_original():
    for name, mods in EXPECTED_ALIASES.items():
        for mod in mods:
            assert getattr(mod, name) is ORIGINALS[name], f"{mod.__name__}.{name} not restored"
    assert torch_norm.WrappedTorchNorm.__dict__["__new__"] is ORIGINAL_NORM_NEW


# ---------------------------------------------------------------- running Megatron's originals on CPU


class _CudaTyped(torch.Tensor):
    """A CPU fp32 tensor that reports the legacy CUDA type name the original
    clip function asserts on; every op still runs on the CPU storage."""

    def type(self, *args, **kwargs):
        if not args and not kwargs:
            return "torch.cuda.FloatTensor"
        return super().type(*args, **kwargs)


@pytest.fixture
def megatron_on_cpu():
    """Megatron-Core's own gradient helpers on CPU tensors: leanstep.megatron.cpu's
    shims for their device='cuda' scalars and clip's CUDA grad-type assertion."""
    import leanstep.megatron.cpu as mcpu

    with mcpu.cuda_literals(), mcpu.cuda_type_names():
        yield


class Param:
    def __init__(self, grad, **attrs):
        self.grad = grad
        for k, v in attrs.items():
            setattr(self, k, v)


def make_buffer_grads(gen, dtype=torch.float32, scale=1.0, with_empty=True):
    params = [("a", (33, 17), "bfloat16"), ("b", (17,), "bfloat16"), ("c", (64, 33), "bfloat16"),
              ("d", (0,), "bfloat16"), ("e", (5, 7, 3), "bfloat16")]
    if not with_empty:
        params.pop(3)
    buffers, grads, _ = leanstep.ddp_grad_buffers(params, grad_dtype=str(dtype).removeprefix("torch."))
    for g in grads:
        g.copy_(randn(g.shape, dtype, gen, scale=scale))
    return buffers, grads


# ---------------------------------------------------------------- install / report / uninstall


def test_install_patches_every_expected_alias(patched):
    r = lm.report()
    assert r["megatron_core_version"] == importlib.metadata.version("megatron-core")
    assert r["skipped"] == {}
    for name, mods in EXPECTED_ALIASES.items():
        for mod in mods:
            current = getattr(mod, name)
            assert current is not ORIGINALS[name]
            assert current.__leanstep_original__ is ORIGINALS[name]
            assert f"{mod.__name__}.{name}" in r["installed"][name]
        # One replacement object everywhere.
        assert len({id(getattr(mod, name)) for mod in mods}) == 1
    new = torch_norm.WrappedTorchNorm.__dict__["__new__"]
    assert new is not ORIGINAL_NORM_NEW and new.__func__.__leanstep_original__ is ORIGINAL_NORM_NEW.__func__
    assert "installed get_grad_norm_fp32" in lm.format_report()


def _fake_megatron(version, directory):
    return types.SimpleNamespace(__version__=version,
                                 __file__=os.path.join(directory, "megatron", "core", "__init__.py"))


@pytest.mark.parametrize("version, directory, installed, want", [
    # 0.19's package_info appends `git rev-parse --short HEAD` run in its own directory:
    # installed in a venv under another checkout, that is the other project's commit.
    ("0.19.2+98e5a13", "/p/build/venv312/lib/python3.12/site-packages", "0.19.2", "0.19.2"),
    ("0.19.2+98e5a13", "/usr/lib/python3/dist-packages", "0.19.2", "0.19.2"),
    # A source checkout: the commit is Megatron-LM's own, kept.
    ("0.19.2+1a2b3c4", "/src/Megatron-LM", "0.19.2", "0.19.2+1a2b3c4"),
    # The installed distribution is another version (a checkout shadows it): kept.
    ("0.19.2+1a2b3c4", "/p/venv/lib/python3.12/site-packages", "0.18.0", "0.19.2+1a2b3c4"),
    ("0.19.2+1a2b3c4", "/p/venv/lib/python3.12/site-packages", None, "0.19.2+1a2b3c4"),
    ("0.16.1", "/p/venv/lib/python3.11/site-packages", "0.16.1", "0.16.1"),
    ("0.20.0rc1+1a2b3c4", "/p/venv/lib/python3.12/site-packages", "0.20.0rc1", "0.20.0rc1"),
])
def test_reported_version_drops_a_commit_that_is_not_megatrons(monkeypatch, version, directory,
                                                               installed, want):
    def distribution_version(name):
        assert name == "megatron-core"
        if installed is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(importlib.metadata, "version", distribution_version)
    assert megatron_core_version(_fake_megatron(version, directory)) == want


def test_reported_version_of_this_megatron_is_the_installed_distributions():
    # Installed by pip into this project's venv, inside this project's git checkout: the
    # report names the release, with no commit of this project attached.
    assert megatron_core_version(mcore) == importlib.metadata.version("megatron-core")
    assert megatron_core_version() == megatron_core_version(mcore)


def test_second_install_changes_nothing(patched):
    before = {(m.__name__, n): getattr(m, n) for n, mods in EXPECTED_ALIASES.items() for m in mods}
    norm_new = torch_norm.WrappedTorchNorm.__dict__["__new__"]
    report = lm.report()
    lm.install()
    after = {(m.__name__, n): getattr(m, n) for n, mods in EXPECTED_ALIASES.items() for m in mods}
    assert all(after[k] is v for k, v in before.items())
    assert torch_norm.WrappedTorchNorm.__dict__["__new__"] is norm_new
    assert lm.report()["installed"] == report["installed"]


def test_uninstall_restores_the_originals_exactly():
    lm.install()
    lm.install()
    lm.uninstall()
    assert_all_original()
    assert lm.installed() == []
    lm.uninstall()  # twice is harmless
    assert_all_original()


def test_mismatched_signature_is_refused_with_its_reason(monkeypatch):
    def count_zeros_fp32(parameters, group):  # a different signature
        return 0.0

    monkeypatch.setattr(clip_grads, "count_zeros_fp32", count_zeros_fp32)
    try:
        r = lm.install()
        reason = r["skipped"]["count_zeros_fp32"]
        assert "signature mismatch" in reason and "tp_group" in reason and "group" in reason
        assert "count_zeros_fp32" not in r["installed"]
        # Never half-patched: neither the home module nor any alias changed.
        assert clip_grads.count_zeros_fp32 is count_zeros_fp32
        assert optimizer.count_zeros_fp32 is ORIGINALS["count_zeros_fp32"]
        assert layer_wise_optimizer.count_zeros_fp32 is ORIGINALS["count_zeros_fp32"]
        # The other patches went in.
        assert "get_grad_norm_fp32" in r["installed"]
        assert "skipped   count_zeros_fp32: signature mismatch" in lm.format_report()
    finally:
        lm.uninstall()
    assert optimizer.get_grad_norm_fp32 is ORIGINALS["get_grad_norm_fp32"]


def test_a_module_imported_later_is_patched_by_the_next_install(patched):
    late = types.ModuleType("late_user_module")
    late.get_grad_norm_fp32 = ORIGINALS["get_grad_norm_fp32"]
    import sys

    sys.modules["late_user_module"] = late
    try:
        lm.install()
        assert late.get_grad_norm_fp32.__leanstep_original__ is ORIGINALS["get_grad_norm_fp32"]
        lm.uninstall()
        assert late.get_grad_norm_fp32 is ORIGINALS["get_grad_norm_fp32"]
    finally:
        del sys.modules["late_user_module"]


# ---------------------------------------------------------------- parity: gradient functions


# 2 and 3 share the cached exponent tensors of the double root (host_float_pow): each
# must get its own.
@pytest.mark.parametrize("norm_type", [2, math.inf, 1.0, 3.0])
def test_grad_norm_matches_megatron(norm_type, patched, megatron_on_cpu, torch_gen):
    # Megatron's inf-norm raises on an empty grad (tensor.max() of nothing).
    _, grads = make_buffer_grads(torch_gen, with_empty=norm_type != math.inf)
    theirs = ORIGINALS["get_grad_norm_fp32"](grads, norm_type=norm_type)
    ours = optimizer.get_grad_norm_fp32(grads, norm_type=norm_type)
    assert type(theirs) is float  # without Transformer Engine the installed code returns a float
    # leanstep keeps it on the device: that double, as a 0-d float64 tensor.
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float64 and ours.shape == ()
    # The same double the float path computes from leanstep's fp32 total: total.item() ** (1 / p).
    plan_norm = float(leanstep.GradPlan(grads).norm(norm_type=norm_type)[0][0])
    total = plan_norm if norm_type in (1.0, math.inf) else float(
        torch.tensor(plan_norm, dtype=torch.float32) ** norm_type)
    assert float(ours) == (total if norm_type in (1.0, math.inf) else total ** (1.0 / norm_type))
    ours = float(ours)
    # Megatron rounds each tensor's norm to fp32 and combines those in fp32;
    # leanstep sums in double. Both are within a few fp32 ulps of the exact norm.
    exact = {2: np.linalg.norm, 1.0: lambda v: np.abs(v).sum(), math.inf: lambda v: np.abs(v).max(),
             3.0: lambda v: (np.abs(v) ** 3).sum() ** (1 / 3)}
    vals = np.concatenate([to_f64(g).ravel() for g in grads])
    e = exact[norm_type](vals)
    assert abs(ours - e) <= 8 * 2**-24 * e
    assert abs(theirs - e) <= 64 * 2**-24 * e
    assert lm.report()["calls"]["get_grad_norm_fp32"]["leanstep"] == 1


def test_grad_norm_of_a_single_tensor_and_empty_list(patched, megatron_on_cpu, torch_gen):
    g = torch.randn(1000, generator=torch_gen)
    assert clip_grads.get_grad_norm_fp32(g) == pytest.approx(
        ORIGINALS["get_grad_norm_fp32"](g), rel=1e-6)
    assert clip_grads.get_grad_norm_fp32([]) == ORIGINALS["get_grad_norm_fp32"]([]) == 0.0


def test_grad_norm_takes_a_generator_also_where_it_falls_back(patched, megatron_on_cpu,
                                                              torch_gen):
    # The patch makes a list of the argument once: a generator is read once, and a list
    # leanstep does not plan (a tensor subclass) goes to Megatron's own code as that list.
    grads = [torch.randn(17, generator=torch_gen) for _ in range(3)]
    expected = ORIGINALS["get_grad_norm_fp32"](list(grads))
    assert float(clip_grads.get_grad_norm_fp32(g for g in grads)) == pytest.approx(expected,
                                                                                   rel=1e-6)
    class Marked(torch.Tensor):
        pass

    marked = [g.as_subclass(Marked) for g in grads]
    before = dict(lm.report()["calls"]["get_grad_norm_fp32"])
    assert float(clip_grads.get_grad_norm_fp32(g for g in marked)) == pytest.approx(expected,
                                                                                    rel=1e-6)
    after = lm.report()["calls"]["get_grad_norm_fp32"]
    assert after["delegated"]["tensor_subclass"] == \
        before.get("delegated", {}).get("tensor_subclass", 0) + 1, after


def test_inf_norm_with_an_empty_grad_works(patched, megatron_on_cpu, torch_gen):
    _, grads = make_buffer_grads(torch_gen)
    with pytest.raises(RuntimeError):
        ORIGINALS["get_grad_norm_fp32"](grads, norm_type=math.inf)
    expected = max(float(g.abs().max()) for g in grads if g.numel())
    assert optimizer.get_grad_norm_fp32(grads, norm_type=math.inf) == expected


def test_grad_norm_nan_is_not_lost(patched, torch_gen):
    _, grads = make_buffer_grads(torch_gen)
    grads[2].view(-1)[7] = math.nan
    assert math.isnan(optimizer.get_grad_norm_fp32(grads))


@pytest.mark.parametrize("max_norm", [0.5, 1e9])
def test_clip_matches_megatron_bitwise(max_norm, patched, megatron_on_cpu, torch_gen):
    _, grads_a = make_buffer_grads(torch_gen)
    buffers_b, grads_b = make_buffer_grads(torch_gen)
    for a, b in zip(grads_a, grads_b):
        b.copy_(a)
    theirs = [Param(g.as_subclass(_CudaTyped)) for g in grads_a]
    ours = [Param(g) for g in grads_b]
    total = ORIGINALS["get_grad_norm_fp32"](grads_a)
    ORIGINALS["clip_grad_by_total_norm_fp32"](theirs, max_norm, total)
    optimizer.clip_grad_by_total_norm_fp32(ours, max_norm, total)
    for a, b in zip(grads_a, grads_b):
        assert torch.equal(a, b)  # same fp32 coefficient, one fp32 multiply each
    if max_norm < total:
        assert abs(optimizer.get_grad_norm_fp32(grads_b) - max_norm) < 1e-5 * max_norm
    assert lm.report()["calls"]["clip_grad_by_total_norm_fp32"]["leanstep"] == 1


def test_clip_with_a_tensor_norm_uses_the_device_coefficient(patched, torch_gen):
    _, grads = make_buffer_grads(torch_gen)
    before = [g.clone() for g in grads]
    total = optimizer.get_grad_norm_fp32(grads).to(torch.float32)  # an fp32 tensor norm (0.19 + TE)
    optimizer.clip_grad_by_total_norm_fp32([Param(g) for g in grads], 0.25, total)
    coeff = torch.tensor(0.25, dtype=torch.float32) / (total + torch.tensor(1e-6, dtype=torch.float32))
    for g, b in zip(grads, before):
        assert torch.equal(g, b * coeff)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("norm_type", [2, 1.5, math.inf])
def test_grad_norm_over_calls_recalls_its_plan_only_for_the_same_memory(norm_type, backend, patched,
                                                                       megatron_on_cpu,
                                                                       monkeypatch, torch_gen):
    """As the clip below: fresh views of the same memory find the plan the norm used
    last without the general path (no key made); any change to the memory a grad
    covers goes the general way; every call's norm is Megatron's."""
    monkeypatch.setattr(lm_grad.plans, "backend", backend)
    general = {"passes": 0}
    key_of = lm_grad.plans.key

    def spy(grads):
        general["passes"] += 1
        return key_of(grads)

    monkeypatch.setattr(lm_grad.plans, "key", spy)
    sizes = [17, 1, 64, 5, 33]
    buf = randn((sum(sizes),), torch.float32, torch_gen)
    other = randn((64,), torch.float32, torch_gen)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def views(change=None):
        grads = [buf[s:s + n] for s, n in zip(starts, sizes)]
        if change == "re_pointed":
            grads[2] = other
        elif change == "re_strided":
            grads[3] = buf[starts[3]:starts[3] + 10:2]
        elif change == "resized":
            grads[4] = buf[starts[4]:starts[4] + 32]
        elif change == "twice":
            grads.append(grads[0])  # one view listed twice: counted twice, as Megatron does
        return grads

    def check(change, expect_general):
        before = general["passes"]
        ours = float(optimizer.get_grad_norm_fp32(views(change), norm_type))
        theirs = ORIGINALS["get_grad_norm_fp32"](views(change), norm_type)
        # The float64 oracle over the listed views: leanstep sums in double (within 8 fp32
        # ulps, as test_grad_norm_matches_megatron states), Megatron in fp32 per tensor.
        vals = np.abs(np.concatenate([to_f64(g).ravel() for g in views(change)]))
        exact = vals.max() if norm_type == math.inf else (vals ** norm_type).sum() ** (1 / norm_type)
        assert abs(ours - exact) <= 8 * 2**-24 * exact
        assert abs(theirs - exact) <= 64 * 2**-24 * exact
        if expect_general is not None:
            assert (general["passes"] > before) == expect_general, change

    check(None, True)
    check(None, False)
    for change in ("re_pointed", "re_strided", "resized", "twice"):
        check(change, True)
        check(None, None)
        check(None, False)


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("norm_kind", ["float", "leanstep_fp64", "fp32_tensor"])
def test_clip_over_calls_recalls_its_plan_only_for_the_same_memory(norm_kind, backend, patched,
                                                                   megatron_on_cpu, monkeypatch,
                                                                   torch_gen):
    """Fresh views of the same memory each call (Megatron's distributed optimizer, each
    step) find the plan the clip used last with no key and no list made (no general
    pass), on the CPU kernels and on the torch-op backend (through the buffer the views
    cover whole). Whatever changes the memory a grad covers goes the general way: a grad
    re-pointed to other memory, re-strided or resized at its address, set to None, a
    param more or fewer, views laid out in another order. Every call scales the grads
    as Megatron's own clip does, bit for bit, and nothing else."""
    monkeypatch.setattr(lm_grad.plans, "backend", backend)
    general = {"passes": 0}
    keyed = lm_grad.grads_with_key

    def spy(*args):
        general["passes"] += 1
        return keyed(*args)

    monkeypatch.setattr(lm_grad, "grads_with_key", spy)
    sizes = [17, 1, 64, 5, 33, 2]
    buf = randn((sum(sizes),), torch.float32, torch_gen)  # the views cover it whole
    other = randn((64,), torch.float32, torch_gen)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def layout(change=None):
        """(buffer, other) -> grads: fresh views each call, with one change."""
        def views(b, o):
            grads = [b[s:s + n] for s, n in zip(starts, sizes)]
            if change == "re_pointed":
                grads[2] = o[:64]
            elif change == "re_strided":
                grads[3] = b[starts[3]:starts[3] + 10:2]  # 5 elements, stride 2
            elif change == "resized":
                grads[2] = b[starts[2]:starts[2] + 63]
            elif change == "none":
                grads[4] = None
            elif change == "more":
                grads.append(o[:3])
            elif change == "fewer":
                grads.pop()
            elif change == "reordered":
                grads[0], grads[1] = grads[1], grads[0]
            return grads
        return views

    def clip(views, expect_general):
        buf_a, other_a = buf.clone(), other.clone()
        theirs = [Param(None if g is None else g.as_subclass(_CudaTyped))
                  for g in views(buf_a, other_a)]
        ours = [Param(g) for g in views(buf, other)]
        present = [g for g in views(buf, other) if g is not None]
        before = general["passes"]
        if norm_kind == "float":
            total = ours_norm = ORIGINALS["get_grad_norm_fp32"](present)
        elif norm_kind == "leanstep_fp64":
            ours_norm = optimizer.get_grad_norm_fp32(present)  # a 0-d fp64 tensor
            total = float(ours_norm)
        else:  # an fp32 device norm (0.19 with TE): the coefficient in fp32 on the device
            ours_norm = optimizer.get_grad_norm_fp32(present).to(torch.float32)
            total = None
        optimizer.clip_grad_by_total_norm_fp32(ours, 0.25, ours_norm)
        if total is not None:
            ORIGINALS["clip_grad_by_total_norm_fp32"](theirs, 0.25, total)
        else:
            coeff = torch.tensor(0.25, dtype=torch.float32) / (
                ours_norm + torch.tensor(1e-6, dtype=torch.float32))
            for g in views(buf_a, other_a):
                if g is not None:
                    g.mul_(torch.clamp(coeff, max=1.0))
        assert torch.equal(buf, buf_a) and torch.equal(other, other_a)
        if expect_general is not None:
            assert (general["passes"] > before) == expect_general, change_of[0]
        path = f"{'torch' if backend else 'cpu'}:cpu"
        assert lm.report()["calls"]["clip_grad_by_total_norm_fp32"]["paths"] == {
            path: calls[0] + 1}
        calls[0] += 1

    calls = [0]
    clip(layout(), expect_general=True)
    clip(layout(), expect_general=False)  # recalled
    change_of = [None]
    for change in ("re_pointed", "re_strided", "resized", "none", "more", "fewer", "reordered"):
        change_of[0] = change
        clip(layout(change), expect_general=True)
        # Again the general way where the changed list's plan became the last one (a
        # torch-op plan over two buffers, or with gaps, is not kept for a recall).
        clip(layout(), expect_general=None)
        clip(layout(), expect_general=False)
    assert lm.report()["calls"]["clip_grad_by_total_norm_fp32"]["leanstep"] == 23


def test_count_zeros_matches_megatron(patched, megatron_on_cpu, torch_gen):
    _, grads = make_buffer_grads(torch_gen)
    grads[0].view(-1)[::5] = 0
    grads[4].view(-1)[:9] = 0
    world = torch.distributed.group.WORLD
    params = [Param(g) for g in grads]
    params[2].shared = True  # filtered out by Megatron's param_is_not_shared
    params.append(Param(None))
    theirs = ORIGINALS["count_zeros_fp32"](params, world, tp_group=world)
    ours = optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world, tp_group=world)
    assert type(theirs) is (int if NEW_API else float)
    # leanstep's count stays on the device: a 0-d tensor of the installed version's type.
    assert isinstance(ours, torch.Tensor) and ours.shape == ()
    assert ours.dtype == (torch.int64 if NEW_API else torch.float32)
    assert ours.item() == theirs == sum(
        g.numel() - int(g.count_nonzero()) for i, g in enumerate(grads) if i != 2)


def test_count_zeros_over_calls_reads_each_list_as_megatron_does(patched, megatron_on_cpu,
                                                                 monkeypatch, torch_gen):
    """A list of params seen before is counted from its remembered marks: no attribute
    of any param is read again, and the pass (the selection's, or the recall of the
    plan through the selection) checks each entry's identity as it reads its grad.
    The count is Megatron's on every call: the same list (or a copy of it),
    an entry replaced by another param with the same ends of the list, a shorter or
    longer list, a reversed one, new param objects after the old ones died (their
    addresses reused), and new zeros in the grads each call."""
    _, grads = make_buffer_grads(torch_gen)
    world = torch.distributed.group.WORLD
    passes = {"remembered": 0, "marks": 0}
    remembered, marks = lm_grad.selected_grads_and_key, lm_grad.grads_and_key

    def spy(name, fn):
        def call(*args):
            passes[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(lm_grad, "selected_grads_and_key", spy("remembered", remembered))
    monkeypatch.setattr(lm_grad, "grads_and_key", spy("marks", marks))
    import leanstep._plans as plans_module
    matched = plans_module.grads_match_key

    def spy_match(*args):
        if args[4] is not None:  # through a remembered selection
            passes["remembered"] += 1
        return matched(*args)

    monkeypatch.setattr(plans_module, "grads_match_key", spy_match)

    def check(params):
        for g in grads:
            g.view(-1)[torch.rand(g.numel(), generator=torch_gen) < 0.3] = 0.0
        theirs = ORIGINALS["count_zeros_fp32"](params, world, tp_group=world)
        ours = optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world, tp_group=world)
        assert ours.item() == theirs

    def make_params(shared_index):
        params = [Param(g) for g in grads] + [Param(None)]
        params[shared_index].shared = True  # filtered out by Megatron's param_is_not_shared
        return params

    params = make_params(2)
    check(params)
    first = dict(passes)
    check(params)
    check(list(params))
    assert passes == {"remembered": first["remembered"] + 2, "marks": first["marks"]}

    swapped = list(params)
    swapped[1] = Param(grads[1], shared=True)  # same length and ends: position 1 differs
    check(swapped)
    assert passes["marks"] > first["marks"]
    check(params[:-1])
    check(params + [Param(grads[0])])
    check(params[::-1])
    check(params)  # the first list again: still remembered
    params = make_params(0)  # new param objects, another one shared
    check(params)
    check(params)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_count_zeros_over_calls_recalls_its_plan_only_for_the_same_memory(backend, patched,
                                                                          megatron_on_cpu,
                                                                          monkeypatch, torch_gen):
    """The same list of params with fresh views of the same memory finds the plan the
    count used last through its remembered selection, with no list and no key made
    (neither the selection's pass nor the marks'); a counted grad re-pointed, resized
    or set to None goes the general way; every count is Megatron's."""
    monkeypatch.setattr(lm_grad.plans, "backend", backend)
    general = {"passes": 0}
    remembered, marks = lm_grad.selected_grads_and_key, lm_grad.grads_and_key

    def spy(fn):
        def call(*args):
            general["passes"] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(lm_grad, "selected_grads_and_key", spy(remembered))
    monkeypatch.setattr(lm_grad, "grads_and_key", spy(marks))
    sizes = [17, 1, 64, 5, 33]
    buf = randn((sum(sizes),), torch.float32, torch_gen)
    other = randn((64,), torch.float32, torch_gen)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    world = torch.distributed.group.WORLD
    params = [Param(None) for _ in sizes]

    def check(change, expect_general):
        buf[torch.rand(buf.numel(), generator=torch_gen) < 0.3] = 0.0
        other[torch.rand(other.numel(), generator=torch_gen) < 0.3] = 0.0
        for p, s, n in zip(params, starts, sizes):
            p.grad = buf[s:s + n]  # fresh views each call
        if change == "re_pointed":
            params[2].grad = other
        elif change == "resized":
            params[4].grad = buf[starts[4]:starts[4] + 32]
        elif change == "none":
            params[1].grad = None
        before = general["passes"]
        theirs = ORIGINALS["count_zeros_fp32"](params, world, tp_group=world)
        ours = optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world, tp_group=world)
        assert ours.item() == theirs
        if expect_general is not None:
            assert (general["passes"] > before) == expect_general, change

    check(None, True)
    check(None, False)
    for change in ("re_pointed", "resized", "none"):
        check(change, True)
        check(None, None)
        check(None, False)


def test_count_zeros_of_params_without_weak_references(patched, megatron_on_cpu, torch_gen):
    """Params that cannot be held weakly are never remembered as a list: each call
    reads their marks, and the count is Megatron's on every call."""

    class SlotParam:
        __slots__ = ("grad", "__dict__")  # no __weakref__

        def __init__(self, grad):
            self.grad = grad

    _, grads = make_buffer_grads(torch_gen)
    world = torch.distributed.group.WORLD
    params = [SlotParam(g) for g in grads]
    params[0].shared = True
    for _ in range(3):
        grads[1].view(-1)[torch.rand(grads[1].numel(), generator=torch_gen) < 0.5] = 0.0
        theirs = ORIGINALS["count_zeros_fp32"](params, world, tp_group=world)
        ours = optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world, tp_group=world)
        assert ours.item() == theirs
    assert not any(lm_grad._Selection.key(params) in c.selections
                   for c in lm_grad._zero_count_contexts.values())


def test_marks_remembered_for_dead_params_are_not_used_at_their_addresses(
        patched, megatron_on_cpu, torch_gen):
    """New params at the addresses of dead ones (as the allocator may place them)
    must be marked afresh: the remembered list is dropped when a param of it dies.
    Forged here: the old list's entry is given the new params' addresses. While it
    is marked dead it is not used (Megatron's count); marked alive it would be (the
    old marks count the new shared param: a different count), which is what the
    weak references prevent."""
    _, grads = make_buffer_grads(torch_gen)
    grads[1].view(-1)[:5] = 0
    world = torch.distributed.group.WORLD
    old = [Param(g) for g in grads]

    def count(params):
        return optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world,
                                          tp_group=world).item()

    count(old)
    context, = [c for c in lm_grad._zero_count_contexts.values()
                if lm_grad._Selection.key(old) in c.selections]
    new = [Param(g) for g in grads]
    new[1].shared = True
    theirs = ORIGINALS["count_zeros_fp32"](new, world, tp_group=world)
    assert count(old) != theirs  # the shared param's zeros make a difference
    for alive, expected_equal in ((False, True), (True, False)):
        selection = lm_grad._Selection(old, context)
        selection.ids = struct.pack(f"{len(new)}P", *map(id, new))
        selection.alive[0] = alive
        context.selections.clear()
        context.selections[lm_grad._Selection.key(new)] = selection
        for p in new:  # not marked yet: only the remembered list could count them
            vars(p).pop(lm_grad.ZERO_COUNT_FLAG, None)
        assert (count(new) == theirs) is expected_equal, alive
    context.selections.clear()


def test_a_remembered_list_of_params_is_dropped_when_a_param_dies(megatron_on_cpu):
    context = lm_grad._zero_count_context(None, None, False)
    params = [Param(torch.zeros(3)) for _ in range(4)]
    for p in params:
        vars(p)[lm_grad.ZERO_COUNT_FLAG] = context.counted
    selection = lm_grad._Selection(params, context)
    assert selection.alive[0] and selection.counted == bytes([1, 1, 1, 1])
    params.pop(0)  # the last one is still bound to the loop's name
    import gc
    gc.collect()
    assert not selection.alive[0]


def test_non_cpu_or_subclass_grads_are_delegated(patched, megatron_on_cpu, torch_gen):
    _, grads = make_buffer_grads(torch_gen)
    wrapped = [g.as_subclass(_CudaTyped) for g in grads]
    expected = ORIGINALS["get_grad_norm_fp32"](grads)
    assert optimizer.get_grad_norm_fp32(wrapped) == expected  # the original ran
    assert lm.report()["calls"]["get_grad_norm_fp32"]["delegated"] == {"tensor_subclass": 1}


# ---------------------------------------------------------------- parity: MoE functions


def routing(T, E, k, gen):
    logits = torch.randn(T, E, generator=gen)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, logits.topk(k, 1).indices, True)
    return routing_map, torch.softmax(logits, 1) * routing_map


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_permute_unpermute_match_megatron(dtype, drop_and_pad, patched, torch_gen):
    T, E, k, H = 48, 8, 2, 32
    routing_map, probs = routing(T, E, k, torch_gen)
    # 0.17+ requires num_out_tokens on the plain path (0.16 ignores it there).
    num_out = E * 10 if drop_and_pad else (int(routing_map.sum()) if NEW_API else None)
    tokens = randn((T, H), dtype, torch_gen)
    t_ours, p_ours = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    t_theirs, p_theirs = tokens.clone().requires_grad_(), probs.clone().requires_grad_()

    ours = token_dispatcher.permute(t_ours, routing_map, p_ours, num_out, drop_and_pad=drop_and_pad)
    theirs = ORIGINALS["permute"](t_theirs, routing_map, p_theirs, num_out, drop_and_pad=drop_and_pad)
    assert len(ours) == len(theirs) == (5 if NEW_API else 3)
    for a, b in zip(ours, theirs):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and torch.equal(a, b)  # a gather: bit-exact

    out_ours = token_dispatcher.unpermute(ours[0], ours[2], tokens.shape, probs=p_ours,
                                          routing_map=routing_map, drop_and_pad=drop_and_pad)
    out_theirs = ORIGINALS["unpermute"](theirs[0], theirs[2], tokens.shape, probs=p_theirs,
                                        routing_map=routing_map, drop_and_pad=drop_and_pad)
    assert out_ours.dtype == out_theirs.dtype == dtype
    # Both multiply in fp32 (Megatron promotes to the fp32 probs) and sum <= k
    # terms in fp32, then round once: equal up to summation order, 1 ulp.
    assert_within_ulps(out_ours, to_f64(out_theirs), dtype, ulps=1, atol=1e-6)

    dy = randn((T, H), dtype, torch_gen)
    (out_ours.float() * dy.float()).sum().backward()
    (out_theirs.float() * dy.float()).sum().backward()
    assert_within_ulps(t_ours.grad, to_f64(t_theirs.grad), dtype, ulps=1, atol=1e-6)
    scale = np.abs(to_f64(p_theirs.grad)).max()
    assert_within_ulps(p_ours.grad, to_f64(p_theirs.grad), torch.float32, ulps=2,
                       atol=H * 2**-24 * max(scale, 1.0) * 4)
    calls = lm.report()["calls"]
    assert calls["permute"]["leanstep"] == 1 and calls["unpermute"]["leanstep"] == 1
    # The pair 0.19's device default makes (Megatron's permute, leanstep's unpermute given
    # probs): leanstep's unpermute over Megatron's outputs gives its own pair's bits.
    with torch.no_grad():
        mixed = token_dispatcher.unpermute(theirs[0], theirs[2], tokens.shape, probs=p_theirs,
                                           routing_map=routing_map, drop_and_pad=drop_and_pad)
    assert torch.equal(mixed, out_ours.detach())


@pytest.mark.skipif(not NEW_API, reason="0.16's plain permute ignores num_out_tokens")
def test_a_num_out_tokens_off_the_routed_count_is_the_same_async_check_on_cpu(patched, torch_gen):
    # The CPU path used to read int(routing_map.sum()) on the host to decide
    # (one read per MoE layer that a device run does not make); it is the
    # device path's asynchronous check now, so a CPU run counts the reads a
    # device run would.
    T, E, k, H = 12, 4, 2, 8
    routing_map, probs = routing(T, E, k, torch_gen)
    tokens = randn((T, H), torch.float32, torch_gen)
    routed = int(routing_map.sum())
    with leanstep.audit() as counted:
        token_dispatcher.permute(tokens, routing_map, probs, routed)
    assert counted.num_host_reads == 0 and counted.num_syncs == 0, counted.format_table()
    assert counted.ops["aten._assert_async.msg"] == 1
    with pytest.raises(RuntimeError, match="num_out_tokens must equal the routed count"):
        token_dispatcher.permute(tokens, routing_map, probs, routed + 1)
    assert lm.report()["calls"]["permute"]["leanstep"] == 2


@pytest.mark.moe_cpu_default
def test_cpu_calls_by_default_permute_on_leanstep_and_the_rest_on_megatron(patched, torch_gen,
                                                                          monkeypatch):
    from leanstep.megatron import moe as moe_patches

    assert moe_patches.cpu_kernels() == "auto"  # the default, with the environment unset
    T, E, k, H = 16, 4, 2, 8
    routing_map, probs = routing(T, E, k, torch_gen)
    num_out = int(routing_map.sum())
    tokens = randn((T, H), torch.float32, torch_gen)
    leanstep.reset_paths()
    ours = token_dispatcher.permute(tokens, routing_map, probs, num_out)
    theirs = ORIGINALS["permute"](tokens, routing_map, probs, num_out)
    for a, b in zip(ours, theirs):
        assert (a is None and b is None) or torch.equal(a, b)
    # Megatron's unpermute takes leanstep's row order as its own.
    restored = token_dispatcher.unpermute(ours[0], ours[2], tokens.shape, routing_map=routing_map)
    assert torch.equal(restored, ORIGINALS["unpermute"](theirs[0], theirs[2], tokens.shape,
                                                         routing_map=routing_map))
    split = torch.tensor([num_out // 2, num_out - num_out // 2])
    token_dispatcher.sort_chunks_by_idxs(ours[0], split, torch.tensor([1, 0]))
    calls = lm.report()["calls"]
    assert calls["permute"]["leanstep"] == 1 and calls["permute"]["delegated"] == {}
    for name in ("unpermute", "sort_chunks_by_idxs"):
        assert calls[name]["leanstep"] == 0, name
        assert calls[name]["delegated"] == {moe_patches.CPU_DELEGATED: 1}, name

    # All on Megatron's, then all on leanstep's (by the call, then by the environment).
    assert moe_patches.cpu_kernels(False) == "auto"
    token_dispatcher.permute(tokens, routing_map, probs, num_out)
    assert lm.report()["calls"]["permute"]["delegated"] == {moe_patches.CPU_DELEGATED: 1}
    assert moe_patches.cpu_kernels(True) is False
    try:
        token_dispatcher.unpermute(ours[0], ours[2], tokens.shape, routing_map=routing_map)
        assert lm.report()["calls"]["unpermute"]["leanstep"] == 1
        with pytest.raises(TypeError, match="'enabled' must be True, False, 'auto' or None"):
            moe_patches.cpu_kernels("yes")
    finally:
        moe_patches.cpu_kernels(False)
    # The environment is read once (not per call): on install, or at the first call.
    monkeypatch.setenv("LEANSTEP_MEGATRON_MOE_CPU", "leanstep")
    assert moe_patches.cpu_kernels() is False  # still the setting in force
    lm.install()
    assert moe_patches.cpu_kernels() is False  # a setting made by the call stays
    moe_patches._cpu_kernels = None  # as if never read
    lm.install()
    assert moe_patches.cpu_kernels() is True
    monkeypatch.setenv("LEANSTEP_MEGATRON_MOE_CPU", "Megatron ")
    moe_patches._cpu_kernels = None
    assert moe_patches.cpu_kernels("auto") is False  # read, then replaced by the call
    assert moe_patches.cpu_kernels() == "auto"
    monkeypatch.setenv("LEANSTEP_MEGATRON_MOE_CPU", "fast")
    token_dispatcher.permute(tokens, routing_map, probs, num_out)  # not read again
    moe_patches._cpu_kernels = None
    with pytest.raises(leanstep.Error, match="LEANSTEP_MEGATRON_MOE_CPU must be 'auto'"):
        lm.install()  # refused before anything is patched anew
    with pytest.raises(leanstep.Error, match="LEANSTEP_MEGATRON_MOE_CPU must be 'auto'"):
        token_dispatcher.permute(tokens, routing_map, probs, num_out)


def test_fused_requests_are_delegated(patched, torch_gen):
    routing_map, probs = routing(8, 4, 2, torch_gen)
    with pytest.raises(ValueError, match="fused_permute is not available"):
        token_dispatcher.permute(torch.randn(8, 4), routing_map, fused=True)  # the original's error
    assert lm.report()["calls"]["permute"]["delegated"] == {"fused": 1}


def test_sort_chunks_matches_megatron(patched, torch_gen):
    rows = torch.randn(30, 6, generator=torch_gen, requires_grad=True)
    probs = torch.rand(30, generator=torch_gen)
    split_sizes = torch.tensor([5, 0, 11, 14])
    order = torch.tensor([3, 1, 0, 2])
    out, out_probs = token_dispatcher.sort_chunks_by_idxs(rows, split_sizes, order, probs=probs)
    ref_rows = rows.detach().clone().requires_grad_()
    ref, ref_probs = ORIGINALS["sort_chunks_by_idxs"](ref_rows, split_sizes, order, probs=probs)
    assert torch.equal(out, ref) and torch.equal(out_probs, ref_probs)
    w = torch.randn(30, 6, generator=torch_gen)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    assert torch.equal(rows.grad, ref_rows.grad)


@pytest.mark.parametrize("chunks", [1, 16, 70])
def test_an_identity_chunk_order_moves_nothing_and_matches_megatron(patched, torch_gen, rng,
                                                                     chunks):
    # EP 1 and TP 1: the dispatcher's order by local expert is 0..C-1. The patch copies the
    # rows and probs (a tensor of its own, as Megatron's concatenation is) instead of
    # splitting and concatenating; values and gradients are Megatron's, bit for bit, in
    # each dtype, with empty chunks, for int64 and int32 orders (past 64 chunks the order
    # is compared as a tensor).
    sizes = [int(v) for v in rng.integers(0, 5, size=chunks)]
    n = sum(sizes)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for index_dtype in (torch.int64, torch.int32):
            split_sizes = torch.tensor(sizes)
            order = torch.arange(chunks, dtype=index_dtype)
            rows = torch.randn(n, 5, generator=torch_gen).to(dtype).requires_grad_()
            probs = torch.rand(n, generator=torch_gen).requires_grad_()
            before = lm.report()["calls"].get("sort_chunks_by_idxs", {}).get(
                "paths", {}).get("identity_order:cpu", 0)
            out, out_probs = token_dispatcher.sort_chunks_by_idxs(rows, split_sizes, order,
                                                                  probs=probs)
            after = lm.report()["calls"]["sort_chunks_by_idxs"]["paths"]["identity_order:cpu"]
            assert after == before + 1
            if n:  # a tensor of its own (an empty one has no memory to share)
                assert out.data_ptr() != rows.data_ptr()
                assert out_probs.data_ptr() != probs.data_ptr()
            ref_rows = rows.detach().clone().requires_grad_()
            ref_probs_in = probs.detach().clone().requires_grad_()
            ref, ref_probs = ORIGINALS["sort_chunks_by_idxs"](ref_rows, split_sizes, order,
                                                              probs=ref_probs_in)
            assert torch.equal(out, ref) and torch.equal(out_probs, ref_probs)
            w = torch.randn(n, 5, generator=torch_gen).to(dtype)
            v = torch.randn(n, generator=torch_gen)
            ((out * w).sum() + (out_probs * v).sum()).backward()
            ((ref * w).sum() + (ref_probs * v).sum()).backward()
            assert torch.equal(rows.grad, ref_rows.grad)
            assert torch.equal(probs.grad, ref_probs_in.grad)


@pytest.mark.moe_cpu_default  # CPU calls go to Megatron's own function, errors included
def test_a_chunk_order_that_moves_or_lives_on_a_device_is_not_taken_as_identity(patched,
                                                                              torch_gen):
    rows = torch.randn(12, 3, generator=torch_gen)
    split_sizes = torch.tensor([4, 4, 4])
    out, _ = token_dispatcher.sort_chunks_by_idxs(rows, split_sizes, torch.tensor([0, 2, 1]))
    assert torch.equal(out, torch.cat([rows[:4], rows[8:], rows[4:8]]))
    # Sizes that do not cover the rows exactly: Megatron's own error, as without leanstep.
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        token_dispatcher.sort_chunks_by_idxs(rows, torch.tensor([4, 4, 3]), torch.arange(3))
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        token_dispatcher.sort_chunks_by_idxs(rows, torch.tensor([8, 8, -4]), torch.arange(3))
    calls = lm.report()["calls"]["sort_chunks_by_idxs"]
    assert "identity_order:cpu" not in calls["paths"], calls
    # Rows on a device: the order is never read on the host (the device kernel moves them).
    with leanstep.audit() as a:
        token_dispatcher.sort_chunks_by_idxs(rows.to("meta"), split_sizes.to("meta"),
                                             torch.arange(3).to("meta"))
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    assert "identity_order:meta" not in lm.report()["calls"]["sort_chunks_by_idxs"]["paths"]


def test_pad_routing_map_matches_megatron_including_mutation(patched, torch_gen):
    routing_map, _ = routing(40, 6, 2, torch_gen)
    a, b = routing_map.clone(), routing_map.clone()
    ours = token_dispatcher.pad_routing_map(a, 8)
    theirs = ORIGINALS["pad_routing_map"](b, 8)
    assert torch.equal(ours, theirs)
    assert torch.equal(a, b)  # the installed version mutates its argument: so do we


# ---------------------------------------------------------------- RMSNorm construction


def test_wrapped_torch_norm_builds_a_leanstep_rmsnorm(patched, torch_gen):
    import leanstep.torch as lt

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               normalization="RMSNorm")
    norm = torch_norm.WrappedTorchNorm(config=config, hidden_size=64, eps=1e-5)
    assert isinstance(norm, lt.RMSNorm) and isinstance(norm, torch.nn.RMSNorm)
    assert norm.eps == 1e-5 and list(norm.state_dict()) == ["weight"]
    with torch.no_grad():
        norm.weight.copy_(randn((64,), torch.float32, torch_gen, scale=0.1) + 1)
    ref = torch.nn.RMSNorm(64, eps=1e-5)
    ref.load_state_dict(norm.state_dict())
    x = randn((5, 64), torch.float32, torch_gen)

    # Trainable weight (frozen_only): torch's own forward, bit-identical.
    y = norm(x)
    assert norm.last_decision["path"] == "torch" and torch.equal(y, ref(x))
    # Frozen (LoRA): leanstep's frozen path.
    norm.weight.requires_grad_(False)
    y = norm(x)
    assert norm.last_decision["path"] == "frozen_fused"
    assert_within_ulps(y, to_f64(ref(x)), torch.float32, ulps=64)

    layer_norm_config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    ln = torch_norm.WrappedTorchNorm(config=layer_norm_config, hidden_size=64)
    assert type(ln) is torch.nn.LayerNorm
    calls = lm.report()["calls"]["WrappedTorchNorm"]
    assert calls["leanstep"] == 1 and calls["delegated"] == {"not_rmsnorm": 1}
    lm.uninstall()
    assert type(torch_norm.WrappedTorchNorm(config=config, hidden_size=64)) is torch.nn.RMSNorm


def test_norm_return_type_follows_what_the_installed_code_does(patched, monkeypatch):
    # Newer versions keep the L2 norm on the device when Transformer Engine's
    # multi_tensor_scale_tensor is importable (a module global), whatever the
    # annotation says; the inf-norm is a float in every version.
    # Where the installed code returns a float, leanstep returns that double as a 0-d
    # float64 device tensor (the inf-norm too).
    grads = [torch.full((4,), 1.0), torch.full((5,), 0.0)]
    out = optimizer.get_grad_norm_fp32(grads)
    assert out.dtype == torch.float64 and out.shape == () and out.item() == 2.0
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", object(), raising=False)
    out = optimizer.get_grad_norm_fp32(grads)
    assert out.dtype == torch.float32 and out.shape == (1,) and out.item() == 2.0
    out_inf = optimizer.get_grad_norm_fp32([torch.tensor([-3.0, 1.0])], norm_type=math.inf)
    assert out_inf.dtype == torch.float64 and out_inf.shape == () and out_inf.item() == 3.0


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_a_megatron_gpt_model_gets_leanstep_norms_with_the_same_checkpoint_layout(torch_gen):
    import leanstep.torch as lt
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    parallel_state.initialize_model_parallel(1, 1)
    try:
        config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                   normalization="RMSNorm", use_cpu_initialization=True)

        def build():
            torch.manual_seed(0)
            return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                            vocab_size=128, max_sequence_length=32)

        plain = build()
        lm.install()
        try:
            fast = build()
        finally:
            lm.uninstall()
        norms = [m for m in fast.modules() if isinstance(m, lt.RMSNorm)]
        assert len(norms) == 5  # 2 layers x (input, pre-MLP) + final
        assert not any(isinstance(m, lt.RMSNorm) for m in plain.modules())
        # Same parameter names, shapes and values: checkpoints are interchangeable.
        a, b = plain.state_dict(), fast.state_dict()
        assert list(a) == list(b)
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
        # LoRA-style: frozen norms take the frozen path.
        for p in fast.parameters():
            p.requires_grad_(False)
        x = randn((16, 2, 64), torch.float32, torch_gen)
        for m in norms:
            m(x)
        assert {m.last_decision["path"] for m in norms} == {"frozen_fused"}
    finally:
        parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------- both versions: every patch applies


def test_every_patch_applies_on_the_installed_version(patched):
    r = lm.report()
    assert r["skipped"] == {}, r["skipped"]
    assert sorted(r["installed"]) == sorted(s.name for s in lm.PATCHES)
    expected = {"count_zeros_fp32": "0.19" if NEW_API else "0.16",
                "permute": "0.19" if NEW_API else "0.16",
                "unpermute": "0.19" if NEW_API else "0.16"}
    for name, label in expected.items():
        assert r["variants"][name] == label


# ---------------------------------------------------------------- device tensors: no delegation


@pytest.fixture
def no_collectives(monkeypatch):
    """Meta tensors cannot go through gloo: the all-reduces are recorded instead."""
    seen = []
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda t, op=None, group=None, async_op=False: seen.append((t.device, op)))
    # as on two ranks: over one, the patched functions issue no all-reduce at all
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    return seen


def test_a_one_rank_group_gets_no_all_reduce(patched, megatron_on_cpu, monkeypatch, torch_gen):
    """Over a group of this rank alone the reduction is the identity: the patched
    functions skip the collective (on gloo a transport round trip that costs more
    than their kernels) and return what they return with it."""
    _, grads = make_buffer_grads(torch_gen)
    grads[0].view(-1)[::5] = 0
    world = torch.distributed.group.WORLD
    assert torch.distributed.get_world_size(world) == 1
    seen = []
    real = torch.distributed.all_reduce
    monkeypatch.setattr(torch.distributed, "all_reduce",
                        lambda *a, **k: seen.append(a) or real(*a, **k))

    def results():
        params = [Param(g) for g in grads]
        out = [float(optimizer.get_grad_norm_fp32(grads, norm_type=p, grad_stats_parallel_group=world))
               for p in (2, 1.0, 3.0)]
        out.append(float(optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world,
                                                    tp_group=world)))
        return out

    skipped = results()
    assert seen == []
    with monkeypatch.context() as m:  # as if the group had two ranks: the collective runs
        m.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
        reduced = results()
    assert len(seen) == 4 and skipped == reduced
    assert lm.report()["calls"]["get_grad_norm_fp32"]["delegated"] == {}


def test_device_grads_take_the_device_backend(patched, no_collectives, monkeypatch):
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", object(), raising=False)
    buf = torch.empty(1000, device="meta")
    grads = [buf[:300], buf[300:700].view(20, 20), buf[700:]]
    norm = optimizer.get_grad_norm_fp32(grads)
    assert isinstance(norm, torch.Tensor) and norm.device.type == "meta"
    params = [Param(g) for g in grads]
    clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm)
    calls = lm.report()["calls"]
    assert calls["get_grad_norm_fp32"]["paths"] == {"torch:meta": 1}
    assert calls["clip_grad_by_total_norm_fp32"]["paths"] == {"torch:meta": 1}
    assert calls["get_grad_norm_fp32"]["delegated"] == {}
    assert [op for _, op in no_collectives] == [torch.distributed.ReduceOp.SUM]


def test_patched_norm_and_clip_on_the_lora_layout_are_sync_free(patched, no_collectives,
                                                                 monkeypatch):
    from leanstep._grad import ddp_grad_buffers

    monkeypatch.setattr(clip_grads, "multi_tensor_scale_tensor_impl", object(), raising=False)
    _, grads, _ = ddp_grad_buffers(leanstep.model_params("qwen3_omni_lora"),
                                   distributed_optimizer=True, dp_size=8, device="meta")
    params = [Param(g) for g in grads]
    optimizer.get_grad_norm_fp32(grads)  # builds the plan once
    with leanstep.audit() as a:
        norm = optimizer.get_grad_norm_fp32(grads)
        clip_grads.clip_grad_by_total_norm_fp32(params, 1.0, norm)
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    # The ops that launch stay within the budget; the cache keeps no grad memory between
    # calls, so each call rebuilds its region views from the caller's grads: one
    # as_strided per region (metadata, no launch).
    regions = lm_grad.plans.get(grads)[0].num_regions
    assert a.num_ops - a.num_view_ops <= 16, f"{a.num_ops} aten ops:\n{a.format_table()}"
    assert a.view_ops["aten.as_strided.default"] == 2 * regions, a.format_table()


def test_a_float_returning_version_reads_nothing(patched, no_collectives):
    grads = [torch.randn(50), torch.randn(7)]
    optimizer.get_grad_norm_fp32(grads)
    with leanstep.audit() as a:
        out = optimizer.get_grad_norm_fp32(grads)
        optimizer.clip_grad_by_total_norm_fp32([Param(g) for g in grads], 1.0, out)
    assert isinstance(out, torch.Tensor)
    assert a.num_host_reads == 0 and a.num_syncs == 0, a.format_table()
    assert "get_grad_norm_fp32" not in lm.report()["host_reads"]


def test_the_native_norm_is_device_memory_where_the_grads_are(patched, no_collectives):
    """On the CPU kernels the float path's norm is written by a native call, outside
    torch's dispatcher: where the CPU stands in for a device, DeviceMemory still counts
    it as the device memory it would be there, so a read of it is a device read."""
    from leanstep.audit import DeviceMemory

    stand_in = torch.device("cpu")
    memory = DeviceMemory(stand_in)
    with memory:
        grads = [torch.randn(50, device=stand_in), torch.randn(7, device=stand_in)]
        norm = optimizer.get_grad_norm_fp32(grads)
        # Again with fresh views of the same memory: DeviceMemory is a torch function
        # mode, under which a grad's read may run Python, so the plan is not recalled
        # (the general path, its key made) and the norm is device memory again.
        keys = []
        key_of = lm_grad.plans.key
        lm_grad.plans.key = lambda grads: keys.append(1) or key_of(grads)
        try:
            again = optimizer.get_grad_norm_fp32([g[:] for g in grads])
        finally:
            del lm_grad.plans.key
        assert keys == [1] and memory.holds(again) and torch.equal(again, norm)
        host_norm = optimizer.get_grad_norm_fp32([torch.randn(5)])
        assert memory.holds(norm) and not memory.holds(host_norm)
        with leanstep.audit(device_memory=memory) as a:
            norm.item()
        assert a.num_device_reads == 1
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    assert abs(float(norm) - expected) <= 1e-6 * expected


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 3.0, 1e9])
def test_clip_by_a_device_double_norm_is_the_float_path_bitwise(max_norm, patched, torch_gen):
    # The installed code clips by max_norm / (norm + 1e-6) in double, only when below 1.
    _, grads = make_buffer_grads(torch_gen)
    expected = [g.clone() for g in grads]
    norm = optimizer.get_grad_norm_fp32(grads)
    coeff = max_norm / (float(norm) + 1.0e-6)
    if coeff < 1.0:
        for g in expected:
            g.mul_(coeff)
    optimizer.clip_grad_by_total_norm_fp32([Param(g) for g in grads], max_norm, norm)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_the_clip_factor_is_the_float_paths_near_fp32_rounding_boundaries(patched, megatron_on_cpu,
                                                                        rng):
    """The float path's factor is Python's max_norm / (norm + 1e-6), one rounding,
    then an fp32 cast. Norms are chosen (fresh seeds) to put that quotient within an
    ulp of an fp32 rounding midpoint, where a reciprocal-then-multiply quotient (two
    roundings) gives another fp32 factor: the device factor must be the float
    path's on every such case, and the grads scaled by it Megatron's, bit for bit."""
    cases = [(0.559911975193751, 14.820119090219713)]  # found by the search below
    while len(cases) < 12:
        max_norm = float(rng.uniform(0.1, 5.0))
        low = np.float32(rng.uniform(0.01, 0.99))
        midpoint = (float(low) + float(np.nextafter(low, np.float32(2)))) / 2
        norm = max_norm / midpoint - 1.0e-6
        two_roundings = (1.0 / (norm + 1.0e-6)) * max_norm
        if np.float32(two_roundings) != np.float32(max_norm / (norm + 1.0e-6)):
            cases.append((max_norm, norm))
    for max_norm, norm in cases:
        quotient = max_norm / (norm + 1.0e-6)
        expected = np.float32(quotient if quotient < 1.0 else 1.0)
        got = lm_grad.host_float_clip_scale(max_norm, torch.tensor(norm, dtype=torch.float64))
        assert got.dtype == torch.float32 and got.shape == (1,)
        assert float(got[0]) == float(expected), (max_norm, norm)
        grads = [torch.tensor([1.0, -3.0, 0.5, 7.25]), torch.tensor([2.0])]
        theirs = [g.clone() for g in grads]
        ORIGINALS["clip_grad_by_total_norm_fp32"]([Param(g) for g in theirs], max_norm, norm)
        optimizer.clip_grad_by_total_norm_fp32([Param(g) for g in grads], max_norm,
                                               torch.tensor(norm, dtype=torch.float64))
        assert all(torch.equal(a, b) for a, b in zip(grads, theirs)), (max_norm, norm)
    # NaN: the float path's `coeff < 1.0` is false, so nothing is scaled.
    assert float(lm_grad.host_float_clip_scale(1.0, torch.tensor(math.nan,
                                                                 dtype=torch.float64))[0]) == 1.0


def test_the_native_float_path_is_pythons_double_arithmetic(rng):
    """grad::float_path_norm and the float-path clip of the CPU kernels, against
    Python's own float arithmetic (what Megatron's float path computes), bit for bit:
    fresh random totals and norms over many binades, the edges (0, subnormal, the
    largest fp32, inf, NaN) and the rounding-boundary norms of the test above."""
    from leanstep import _backend
    from leanstep._grad import GradPlan

    def _scale_calls():
        return _backend.calls().get("grad.scale", {}).get("cpu", {}).get("cpu", 0)

    def f32(x):
        return float(np.float32(x))

    totals = [f32(x) for x in 10.0 ** rng.uniform(-40, 38, 200)]
    totals += [0.0, f32(1e-45), float(np.finfo(np.float32).max), math.inf, math.nan]
    for p in (2.0, 1.0, 3.0, 0.5, 1.7):
        for total in totals:
            out = torch.empty((), dtype=torch.float64)
            leanstep._leanstep.grad_float_path_norm(torch.tensor([total]), 1.0 / p, out)
            expected = total ** (1.0 / p)
            assert struct.pack("<d", float(out)) == struct.pack("<d", expected) or (
                math.isnan(expected) and math.isnan(float(out))), (p, total)
            torch_path = lm_grad.host_float_pow(torch.tensor([total]), 1.0 / p)
            assert torch.equal(torch_path, out) or (math.isnan(expected) and torch_path.isnan())

    norms = [float(x) for x in 10.0 ** rng.uniform(-8, 8, 200)]
    norms += [0.0, 1e-300, math.inf, math.nan, 14.820119090219713]
    for max_norm in [0.0, 0.559911975193751, 1.0, float(rng.uniform(0.1, 5.0)), 1e30]:
        for norm in norms:
            quotient = max_norm / (norm + 1.0e-6)
            expected = np.float32(quotient) if quotient < 1.0 else np.float32(1.0)
            grads = [torch.ones(5), torch.ones(3)]
            scales_before = _scale_calls()
            GradPlan(grads).float_path_clip_(max_norm, torch.tensor([norm], dtype=torch.float64))
            assert all(torch.equal(g, torch.full_like(g, float(expected))) for g in grads), \
                (max_norm, norm)
            # A grad.scale call is counted where one ran: not for a coefficient of 1.
            scaled = bool(quotient < 1.0)
            assert _scale_calls() == scales_before + scaled, (max_norm, norm)
            device = lm_grad.host_float_clip_scale(max_norm, torch.tensor(norm, dtype=torch.float64))
            assert float(device[0]) == float(expected)

    # Bad input: named, before any grad is written.
    grads = [torch.ones(4)]
    plan = GradPlan(grads)
    for args, match in [((math.nan, torch.tensor([1.0], dtype=torch.float64)), "max_norm"),
                        ((-1.0, torch.tensor([1.0], dtype=torch.float64)), "max_norm"),
                        ((1.0, torch.tensor([1.0])), "total_norm.*float64"),
                        ((1.0, torch.zeros(2, dtype=torch.float64)), "total_norm.*1 element")]:
        with pytest.raises(leanstep.Error, match=match):
            plan.float_path_clip_(*args)
        assert torch.equal(grads[0], torch.ones(4))
    for args, match in [((torch.tensor([1.0], dtype=torch.float64), 0.5), "total.*float32"),
                        ((torch.tensor([1.0]), 0.0), "exponent"),
                        ((torch.tensor([1.0]), math.inf), "exponent")]:
        with pytest.raises(leanstep.Error, match=match):
            leanstep._leanstep.grad_float_path_norm(*args, torch.empty((), dtype=torch.float64))
    with pytest.raises(leanstep.Error, match="out_norm.*float64"):
        leanstep._leanstep.grad_float_path_norm(torch.tensor([1.0]), 0.5, torch.empty(()))


# ---------------------------------------------------------------- runtime switch


def test_families_switch_at_run_time_without_reinstalling(patched, megatron_on_cpu, torch_gen):
    _, grads = make_buffer_grads(torch_gen)
    try:
        leanstep.set_preset("moe,rmsnorm")
        optimizer.get_grad_norm_fp32(grads)
        leanstep.set_preset("all")
        optimizer.get_grad_norm_fp32(grads)
        leanstep.set_preset("baseline")
        assert lm.active() == []
        optimizer.get_grad_norm_fp32(grads)
    finally:
        leanstep.set_preset("all")
    calls = lm.report()["calls"]["get_grad_norm_fp32"]
    assert calls["leanstep"] == 1 and calls["delegated"] == {"switched_off": 2}
    with pytest.raises(leanstep.Error, match=r"'preset' must be.*'nope' names none"):
        leanstep.set_preset("nope")
    assert leanstep.preset() == "all"  # an unknown name changes nothing


def test_the_rmsnorm_a_patch_builds_obeys_the_switch(patched):
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               normalization="RMSNorm")
    norm = torch_norm.WrappedTorchNorm(config=config, hidden_size=32)
    norm.weight.requires_grad_(False)
    x = torch.randn(3, 32)
    norm(x)
    assert norm.last_decision["path"] == "frozen_fused"
    try:
        leanstep.set_preset("grad")
        y = norm(x)
        assert norm.last_decision == {"path": "torch", "reason": "switched_off"}
        assert torch.equal(y, torch.nn.functional.rms_norm(x, (32,), norm.weight, norm.eps))
    finally:
        leanstep.set_preset("all")


# ---------------------------------------------------------------- install errors and restores


def test_unknown_patch_names_are_an_error():
    with pytest.raises(leanstep.Error, match=r"unknown patches 'nope'.*known: get_grad_norm_fp32"):
        lm.install(patches=["nope"])
    with pytest.raises(leanstep.Error, match=r"unknown patches 'nope'"):
        lm.uninstall(patches="nope")
    assert lm.installed() == []


def test_uninstall_leaves_a_later_third_party_patch_in_place():
    lm.install(patches=["get_grad_norm_fp32"])
    try:
        def theirs(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
            return 0.0

        optimizer.get_grad_norm_fp32 = theirs
        lm.uninstall()
        assert optimizer.get_grad_norm_fp32 is theirs  # not overwritten
        assert clip_grads.get_grad_norm_fp32 is ORIGINALS["get_grad_norm_fp32"]
        assert any("left megatron.core.optimizer.optimizer.get_grad_norm_fp32 as is" in note
                   for note in lm.report()["notes"]["get_grad_norm_fp32"])
    finally:
        optimizer.get_grad_norm_fp32 = ORIGINALS["get_grad_norm_fp32"]


def test_a_reloaded_module_is_patched_again_by_install():
    import importlib

    lm.install(patches=["pad_routing_map"])
    try:
        importlib.reload(moe_utils)  # puts fresh originals into the home module
        assert getattr(moe_utils.pad_routing_map, "__leanstep_original__", None) is None
        lm.install(patches=["pad_routing_map"])
        assert moe_utils.pad_routing_map.__leanstep_original__ is not None
        assert "pad_routing_map" in lm.installed()
    finally:
        lm.uninstall()
        importlib.reload(moe_utils)
        for mod in EXPECTED_ALIASES["pad_routing_map"]:
            mod.pad_routing_map = ORIGINALS["pad_routing_map"]
        for name in MOE_FUNCS:
            moe_utils.__dict__[name] = ORIGINALS[name]


# ---------------------------------------------------------------- unscale + found_inf


class _FakeMixedPrecisionOptimizer:
    """The attributes _unscale_main_grads_and_check_for_nan reads."""

    def __init__(self, grads, inv_scale):
        self.is_stub_optimizer = False
        self.found_inf = torch.zeros(1)
        self.grad_scaler = types.SimpleNamespace(inv_scale=torch.tensor([inv_scale]))
        self._grads = grads

    def _collect_main_grad_data_for_unscaling(self):
        return [g.data for g in self._grads]  # new tensor objects each call, as Megatron's

    def get_grad_stats_parallel_group(self):
        return None


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_unscale_and_found_inf_match_the_original(patched, torch_gen, bad):
    cls = optimizer.MixedPrecisionOptimizer
    buf = randn((500,), torch.float32, torch_gen, scale=1e3)
    if bad is not None:
        buf[123] = bad
    ours_buf, theirs_buf = buf.clone(), buf.clone()
    ours = _FakeMixedPrecisionOptimizer([ours_buf[:200], ours_buf[200:]], 1 / 1024)
    theirs = _FakeMixedPrecisionOptimizer([theirs_buf[:200], theirs_buf[200:]], 1 / 1024)
    with leanstep.audit() as a:
        flag = cls._unscale_main_grads_and_check_for_nan(ours)
    expected = cls._unscale_main_grads_and_check_for_nan.__leanstep_original__(theirs)
    assert flag is expected is (bad is not None)
    assert torch.equal(ours_buf.nan_to_num(), theirs_buf.nan_to_num())
    assert ours.found_inf.item() == theirs.found_inf.item()
    assert a.num_host_reads == 1  # the Python bool the optimizer's step branches on
    calls = lm.report()["calls"]["unscale_and_check_for_nan"]
    assert calls["paths"] == {"cpu:cpu": 1}
    assert "Python bool" in lm.report()["host_reads"]["unscale_and_check_for_nan"]


def test_convert_norms_in_a_model_built_before_install(torch_gen):
    import leanstep.torch as lt

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               normalization="RMSNorm")
    model = torch.nn.Sequential(torch_norm.WrappedTorchNorm(config=config, hidden_size=32),
                                torch.nn.Linear(32, 32),
                                torch_norm.WrappedTorchNorm(config=config, hidden_size=32))
    hooked = model[2]
    hooked.register_forward_hook(lambda *args: None)
    weight = model[0].weight
    assert lm.convert_norms(model) == 1  # the hooked one is left as it is
    assert isinstance(model[0], lt.RMSNorm) and model[0].weight is weight
    assert model[2] is hooked
    weight.requires_grad_(False)
    model[0](torch.randn(2, 32))
    assert model[0].last_decision["path"] == "frozen_fused"


@pytest.fixture
def leanstep_on_devices():
    """The MoE patches' device path forced on (on 0.19 it hands device calls
    back to Megatron by default)."""
    from leanstep.megatron import moe as lmoe

    previous = lmoe.device_kernels(True)
    yield
    lmoe.device_kernels(previous)


def test_moe_on_device_tensors_goes_where_megatrons_function_is_sync_free(patched, torch_gen):
    """0.16's permute selects with masked_select (a host wait on a device):
    leanstep's sync-free permute and unpermute run. 0.19's permute is an
    argsort of fixed shape, sync-free and faster on an H200: device permutes
    go back to Megatron, and so do unpermutes without probs; its unpermute
    given probs selects them with masked_select, so leanstep's runs. Each
    call counted, the delegated ones with the reason."""
    from leanstep.megatron import moe as lmoe

    T, E, k, H = 16, 4, 2, 8
    routing_map, probs = routing(T, E, k, torch_gen)
    tokens = torch.randn(T, H, generator=torch_gen)
    num_out = int(routing_map.sum())
    sources = {name: inspect.getsource(inspect.unwrap(getattr(moe_utils, name)))
               for name in ("permute", "unpermute")}
    syncs = {name: ".masked_select(" in src for name, src in sources.items()}
    assert syncs["permute"] == (not NEW_API)  # 0.16 and 0.19 as installed by make
    assert syncs["unpermute"]
    on_meta = [t.to("meta") for t in (tokens, routing_map, probs)]
    with leanstep.audit() as a:
        out = token_dispatcher.permute(*on_meta, num_out)
        token_dispatcher.unpermute(out[0], out[2], (T, H))  # probs applied before
        token_dispatcher.unpermute(out[0], out[2], (T, H), probs=on_meta[2],
                                   routing_map=on_meta[1])
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    calls = lm.report()["calls"]
    if syncs["permute"]:
        assert calls["permute"]["paths"] == {"torch:meta": 1}, calls["permute"]
        assert calls["unpermute"]["paths"] == {"torch:meta": 2}, calls["unpermute"]
    else:
        assert calls["permute"]["delegated"] == {lmoe.DEVICE_DELEGATED: 1}, calls["permute"]
        assert calls["unpermute"]["delegated"] == {lmoe.DEVICE_DELEGATED: 1}, calls["unpermute"]
        assert calls["unpermute"]["paths"] == {"torch:meta": 1}, calls["unpermute"]  # with probs
    previous = lmoe.device_kernels(False)
    try:
        assert lmoe._device_delegated(on_meta[0], True) and not lmoe._device_delegated(tokens)
    finally:
        lmoe.device_kernels(previous)
    with pytest.raises(TypeError, match="'enabled' must be True, False or None"):
        lmoe.device_kernels("yes")


def test_moe_functions_on_device_tensors_take_the_device_backend(patched, leanstep_on_devices,
                                                                 torch_gen):
    T, E, k, H = 32, 8, 2, 16
    routing_map, probs = routing(T, E, k, torch_gen)
    tokens = torch.randn(T, H, generator=torch_gen)
    num_out = int(routing_map.sum())
    on_meta = [t.to("meta") for t in (tokens, routing_map, probs)]
    with leanstep.audit() as a:
        out = token_dispatcher.permute(*on_meta, num_out)
        restored = token_dispatcher.unpermute(out[0], out[2], (T, H), probs=on_meta[2],
                                              routing_map=on_meta[1])
        chunks = token_dispatcher.sort_chunks_by_idxs(out[0], torch.tensor([10, 22, 16, 16]),
                                                      torch.tensor([2, 0, 3, 1]))
        padded = token_dispatcher.pad_routing_map(on_meta[1].clone(), 4)
    assert a.num_syncs == 0 and a.num_host_reads == 0, a.format_table()
    assert len(out) == (5 if NEW_API else 3) and out[0].device.type == "meta"
    assert restored.shape == (T, H) and chunks[0].shape == (num_out, H)
    assert padded.device.type == "meta"
    calls = lm.report()["calls"]
    for name in ("permute", "unpermute", "sort_chunks_by_idxs", "pad_routing_map"):
        assert calls[name]["paths"] == {"torch:meta": 1}, (name, calls[name])
    # The same calls on CPU tensors run the C++ kernels and agree bitwise with
    # the device backend forced on them.
    cpu_out = token_dispatcher.permute(tokens, routing_map, probs, num_out)
    forced = leanstep.moe_permute(tokens, routing_map, probs, num_out, backend="torch")
    for a_, b_ in zip(cpu_out[:3], forced):
        assert torch.equal(a_, b_)


# ---------------------------------------------------------------- random views of one buffer


def _random_views(rng, buf, count):
    """Views of one flat buffer as a hostile caller makes them: random
    offsets, 1-D steps of 1 to 3, 2-D blocks with gaps between rows, their
    transposes, contiguous blocks; views may overlap each other (never
    themselves). The same buffer is reused, so addresses repeat across calls."""
    n = buf.numel()
    views = []
    for _ in range(count):
        kind = int(rng.integers(4))
        if kind == 0:  # 1-D with a step
            step, length = int(rng.integers(1, 4)), int(rng.integers(0, 24))
            start = int(rng.integers(0, n - step * max(length - 1, 0)))
            views.append(buf[start:start + step * (length - 1) + 1:step] if length else buf[start:start])
        elif kind in (1, 2):  # rows with gaps, or their transpose
            rows, cols, gap = int(rng.integers(1, 6)), int(rng.integers(1, 8)), int(rng.integers(0, 4))
            row_stride = cols + gap
            start = int(rng.integers(0, n - (rows - 1) * row_stride - cols + 1))
            v = buf.as_strided((rows, cols), (row_stride, 1), buf.storage_offset() + start)
            views.append(v.t() if kind == 2 else v)
        else:  # a contiguous block
            length = int(rng.integers(1, 40))
            start = int(rng.integers(0, n - length + 1))
            views.append(buf[start:start + length])
    return views


def _twins(buf, views):
    """For each view, one at the same address with the same numel but another
    layout (1-D with another step, or 1-D for a 2-D view), where it fits: what
    a cache keyed on address and numel alone confuses."""
    twins = []
    for v in views:
        n, offset = v.numel(), v.storage_offset()
        for step in (2, 1, 3):
            if (v.dim() != 1 or v.stride() != (step,)) and offset + step * max(n - 1, 0) < buf.numel():
                twins.append(buf.as_strided((n,), (step,), offset))
                break
        else:
            twins.append(v)
    return twins


def _oracle_norm(views, p):
    values = [to_f64(v).ravel() for v in views]
    flat = np.concatenate(values) if values else np.zeros(0)
    if p == math.inf:
        return float(np.abs(flat).max()) if flat.size else 0.0
    return float((np.abs(flat) ** p).sum() ** (1.0 / p))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patches_on_random_views_of_one_buffer_match_megatron(dtype, patched, megatron_on_cpu,
                                                                rng):
    """Fuzz: random views of ONE buffer (offsets, strides, overlaps) through the
    patched norm / clip / zero count, against Megatron's originals on the same
    inputs and a float64 oracle (the originals round bf16 norms to bf16, so the
    oracle judges ours there). The plan cache once keyed on address, numel and
    dtype only and so normed and clipped buf[0:8] for buf[0:16:2]."""
    world = torch.distributed.group.WORLD
    buf = torch.empty(256, dtype=dtype)
    for trial in range(40):
        # fresh values in the same memory each trial, a fifth of them zeros to count
        buf.copy_(torch.from_numpy(rng.standard_normal(256) * (rng.random(256) >= 0.2)))
        first = _random_views(rng, buf, int(rng.integers(1, 8)))
        for views in (first, _twins(buf, first)):  # the twins right after: the cache's test
            _check_patches_on_views(views, buf, dtype, world, rng, trial)


def _check_patches_on_views(views, buf, dtype, world, rng, trial):
    what = f"trial {trial}: {[(tuple(v.shape), v.stride(), v.storage_offset()) for v in views]}"
    for p in (2.0, math.inf):
        ours = optimizer.get_grad_norm_fp32(views, norm_type=p)
        expected = _oracle_norm(views, p)
        if p == math.inf:
            assert ours == expected, what
            if all(v.numel() for v in views):  # Megatron's max() raises on an empty grad
                assert ORIGINALS["get_grad_norm_fp32"](views, norm_type=p) == expected, what
            continue
        theirs = ORIGINALS["get_grad_norm_fp32"](views, norm_type=p)
        # fp64 accumulation, one rounding to fp32 (2 ulp with margin)
        assert abs(ours - expected) <= 2 * 2**-23 * expected, what
        rel = 1e-5 if dtype == torch.float32 else 2**-6  # the original rounds per tensor
        assert abs(theirs - expected) <= rel * expected + 1e-30, what
    params = [Param(v) for v in views]
    ours_zeros = optimizer.count_zeros_fp32(params, grad_stats_parallel_group=world,
                                            tp_group=world)
    theirs_zeros = ORIGINALS["count_zeros_fp32"](params, world, tp_group=world)
    assert ours_zeros == theirs_zeros == sum(v.numel() - int(v.count_nonzero())
                                             for v in views), what
    if dtype != torch.float32:
        return  # Megatron's clip asserts fp32 grads
    total = ORIGINALS["get_grad_norm_fp32"](views)
    max_norm = float(rng.choice([0.1, 1.0, 1e9])) * max(total, 1e-3)
    theirs_buf = buf.clone()
    theirs_views = [theirs_buf.as_strided(v.shape, v.stride(), v.storage_offset())
                    for v in views]
    ORIGINALS["clip_grad_by_total_norm_fp32"](
        [Param(v.as_subclass(_CudaTyped)) for v in theirs_views], max_norm, total)
    optimizer.clip_grad_by_total_norm_fp32([Param(v) for v in views], max_norm, total)
    assert torch.equal(buf, theirs_buf), what  # the same memory, scaled the same times


def test_clip_keeps_the_originals_dtype_rule_on_cached_plans(patched, megatron_on_cpu, torch_gen):
    """clip_grad_by_total_norm_fp32 takes fp32 grads (and bf16 decoupled grads); others go
    to the original, which asserts on them. The rule reads the dtypes the cached plan was
    built for (its key holds each grad's dtype): every call, found or built, applies it."""
    _, bf16 = make_buffer_grads(torch_gen, dtype=torch.bfloat16)
    _, fp32 = make_buffer_grads(torch_gen)
    for _ in range(2):  # built, then found in the cache
        with pytest.raises(AssertionError):
            clip_grads.clip_grad_by_total_norm_fp32([Param(g) for g in bf16], 1.0, 1e9)
        clip_grads.clip_grad_by_total_norm_fp32([Param(g) for g in fp32], 1.0, 1e9)
    decoupled = [Param(None, decoupled_grad=g) for g in bf16]
    expected = [g.float() * (1.0 / (1e9 + 1e-6)) for g in bf16]
    clip_grads.clip_grad_by_total_norm_fp32(decoupled, 1.0, 1e9, use_decoupled_grad=True)
    calls = lm.report()["calls"]["clip_grad_by_total_norm_fp32"]
    assert calls["delegated"] == {"dtype": 2} and calls["leanstep"] == 3
    for g, e in zip(bf16, expected):
        assert torch.equal(g, e.to(torch.bfloat16))
