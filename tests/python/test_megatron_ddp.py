"""The DDP NaN/Inf grad check (leanstep.megatron.ddp) on a real Megatron-Core
DistributedDataParallel on the CPU (one gloo rank): one host read per gradient
sync instead of two per bucket, the same grads, Megatron's own error for a NaN
or Inf bucket, and Megatron's own check where the deferred one cannot stand in."""

import warnings

import pytest
import torch

import leanstep
from helpers import one_rank_gloo

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
mcore = pytest.importorskip("megatron.core")

import leanstep.megatron as lm  # noqa: E402
import leanstep.megatron.cpu as mcpu  # noqa: E402
from leanstep.megatron import ddp as lddp  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel, DistributedDataParallelConfig, param_and_grad_buffer)
from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

BucketGroup = param_and_grad_buffer._ParamAndGradBucketGroup
ORIGINAL_CHECK = BucketGroup.__dict__["check_grads"]
ORIGINAL_FINISH = DistributedDataParallel.__dict__["finish_grad_sync"]
LAYERS = 4  # 16x16 Linear: 272 params each


@pytest.fixture(scope="module", autouse=True)
def megatron_ddp_on_cpu():
    """A one-rank gloo group, Megatron's parallel state, and the CPU shims
    (start_grad_sync and validate_result ask torch.cuda for the stream / device)."""
    with one_rank_gloo(), mcpu.megatron_on_cpu():
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()


@pytest.fixture
def patched():
    lm.uninstall()
    lm.reset_call_counts()
    lm.install()
    assert {lddp.CHECK, lddp.FINISH} <= set(lm.installed()), lm.format_report()
    yield
    lm.uninstall()
    lddp.drop_pending()


def build_ddp(overlap=True, mixed_dtypes=False):
    """Megatron DDP over LAYERS Linear layers, NaN check on. With overlap, a
    small bucket_size: one bucket group per layer; without, bucketing disabled
    (as Megatron does for later model chunks): one group holding a bucket per
    param dtype (mixed_dtypes: bf16 and fp32 layers; fp32 grads, as gloo
    coalesces one dtype only)."""
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)

    class Net(MegatronModule):
        def __init__(self):
            super().__init__(config)
            torch.manual_seed(0)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(LAYERS))
            if mixed_dtypes:
                self.layers[0].to(torch.bfloat16)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap, check_for_nan_in_grad=True,
        bucket_size=200 if overlap else None)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=Net(),
                                   disable_bucketing=not overlap)


def buckets(model):
    return [(g, b) for g in model.bucket_groups for b in g.buckets]


def fill_grads(model, seed=1, bad=None):
    """New step: zeroed buffers, then seeded grads; `bad` = (flat bucket index, value)."""
    model.zero_grad_buffer()
    gen = torch.Generator().manual_seed(seed)
    for _, bucket in buckets(model):
        bucket.grad_data.copy_(torch.randn(bucket.grad_data.shape, generator=gen))
    if bad is not None:
        index, value = bad
        buckets(model)[index][1].grad_data.view(-1)[7] = value


def grad_sync(model):
    if model.ddp_config.overlap_grad_reduce:
        model.start_grad_sync()  # what the backward hooks do
    model.finish_grad_sync()  # without overlap it starts the syncs itself


def audited_sync(model):
    with leanstep.audit() as a:
        grad_sync(model)
    return a


def sync_error(model, bad):
    fill_grads(model, bad=bad)
    with pytest.raises(RuntimeError) as info:
        grad_sync(model)
    return str(info.value)


@pytest.mark.parametrize("overlap", [True, False], ids=["groups_of_one_bucket", "one_group"])
def test_one_host_read_per_grad_sync_and_the_same_grads(overlap):
    model = build_ddp(overlap=overlap, mixed_dtypes=not overlap)
    n = len(buckets(model))
    assert n == (LAYERS if overlap else 2)
    assert len(model.bucket_groups) == (n if overlap else 1)

    lm.uninstall()
    fill_grads(model)
    original = audited_sync(model)
    expected = [b.grad_data.clone() for _, b in buckets(model)]
    assert original.num_host_reads == 2 * n, original.format_table()

    lm.reset_call_counts()
    lm.install()
    try:
        fill_grads(model)
        fast = audited_sync(model)
        got = [b.grad_data.clone() for _, b in buckets(model)]
        calls = lm.report()["calls"]
    finally:
        lm.uninstall()
    assert fast.num_host_reads == 1, fast.format_table()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert calls[lddp.CHECK] == {"leanstep": len(model.bucket_groups),
                                 "paths": {"torch:cpu": len(model.bucket_groups)}, "delegated": {}}
    assert calls[lddp.FINISH]["leanstep"] == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("overlap,bad_index", [(False, 1), (True, 2)],
                         ids=["second_bucket_of_a_group", "third_group"])
def test_a_non_finite_bucket_raises_megatrons_own_error(overlap, bad_index, value):
    lm.uninstall()
    # Megatron raised before the later collectives: that model's sync state is
    # left mid-step, so the patched run gets a model of its own.
    expected = sync_error(build_ddp(overlap=overlap, mixed_dtypes=not overlap), (bad_index, value))
    kind = "NaN" if value != value else "Inf"
    assert f"found {kind} in local grad norm for bucket #{0 if overlap else bad_index} " in expected

    model = build_ddp(overlap=overlap, mixed_dtypes=not overlap)
    lm.reset_call_counts()
    lm.install()
    try:
        assert sync_error(model, (bad_index, value)) == expected
        # The patched sync ran to its end and kept nothing queued: the next
        # finite step on the same model passes.
        fill_grads(model, seed=2)
        assert audited_sync(model).num_host_reads == 1
        assert lm.report()["calls"][lddp.CHECK]["leanstep"] == 2 * len(model.bucket_groups)
    finally:
        lm.uninstall()


def test_megatrons_check_runs_where_the_deferred_one_cannot(patched, monkeypatch):
    model = build_ddp(overlap=True)
    groups = len(model.bucket_groups)
    state = get_rerun_state_machine()
    seen = []
    real_validate = state.validate_result

    def validate_result(**kwargs):
        seen.append(kwargs["message"])
        if state.mode == RerunMode.DISABLED:
            real_validate(**kwargs)

    monkeypatch.setattr(state, "validate_result", validate_result)

    # check_for_large keeps a history per call: Megatron's own loop, three checks a bucket.
    monkeypatch.setattr(model.ddp_config, "check_for_large_grads", True)
    fill_grads(model)
    grad_sync(model)
    assert len(seen) == 3 * groups and "found unexpected large grads in bucket #0" in seen[-1]
    monkeypatch.setattr(model.ddp_config, "check_for_large_grads", False)

    # Reruns enabled: the rerun machinery validates each call.
    seen.clear()
    monkeypatch.setattr(state, "mode", RerunMode.VALIDATE_RESULTS)
    fill_grads(model)
    grad_sync(model)
    assert len(seen) == 2 * groups
    monkeypatch.setattr(state, "mode", RerunMode.DISABLED)

    # Switched off by the preset.
    seen.clear()
    leanstep.set_preset("moe")
    try:
        fill_grads(model, bad=(0, float("nan")))
        with pytest.raises(RuntimeError, match="found NaN in local grad norm for bucket #0"):
            grad_sync(model)
    finally:
        leanstep.set_preset("all")
    assert len(seen) == 1  # the original raised at its first check

    calls = lm.report()["calls"]
    assert calls[lddp.CHECK]["leanstep"] == 0
    assert calls[lddp.CHECK]["delegated"] == {"check_for_large": groups,
                                              "rerun_mode_enabled": groups, "switched_off": 1}
    assert calls[lddp.FINISH]["delegated"] == {"nothing_deferred": 2}


def test_check_grads_needs_the_finish_grad_sync_patch():
    lm.uninstall()
    try:
        r = lm.install(patches=[lddp.CHECK])
        assert r["skipped"][lddp.CHECK] == f"needs patch {lddp.FINISH}, which is not installed"
        assert BucketGroup.__dict__["check_grads"] is ORIGINAL_CHECK
        lm.install(patches=[lddp.FINISH, lddp.CHECK])
        assert set(lm.installed()) == {lddp.CHECK, lddp.FINISH}
        lm.reset_call_counts()
        lm.uninstall(patches=[lddp.FINISH])  # nothing would read the flag now
        model = build_ddp(overlap=True)
        fill_grads(model)
        assert audited_sync(model).num_host_reads == 2 * len(model.bucket_groups)
        assert lm.report()["calls"][lddp.CHECK]["delegated"] == {
            "finish_grad_sync_not_patched": len(model.bucket_groups)}
    finally:
        lm.uninstall()
    assert BucketGroup.__dict__["check_grads"] is ORIGINAL_CHECK
    assert DistributedDataParallel.__dict__["finish_grad_sync"] is ORIGINAL_FINISH


def test_a_check_left_queued_is_read_by_uninstall(patched):
    model = build_ddp(overlap=True)
    fill_grads(model, bad=(1, float("nan")))
    model.start_grad_sync()  # the collectives start; finish_grad_sync never comes
    with pytest.raises(RuntimeError, match="found NaN in local grad norm for bucket #0"):
        lm.uninstall()
    assert lm.installed() == []
    assert BucketGroup.__dict__["check_grads"] is ORIGINAL_CHECK


def test_no_queued_check_is_lost(patched):
    message = "found NaN in local grad norm for bucket #1 "
    # Queued twice without a finish_grad_sync in between: the earlier flag is
    # read before the group's next collective.
    model = build_ddp(overlap=False, mixed_dtypes=True)
    (group,) = model.bucket_groups
    fill_grads(model, bad=(1, float("nan")))
    group.start_grad_sync()
    with pytest.raises(RuntimeError, match=message):
        group.start_grad_sync()

    # Queued, then the preset switched off: finish_grad_sync still reads it
    # (Megatron's own check of the now finite grads passes).
    model = build_ddp(overlap=False, mixed_dtypes=True)
    fill_grads(model, bad=(1, float("nan")))
    model.bucket_groups[0].start_grad_sync()
    for _, bucket in buckets(model):
        bucket.grad_data.zero_()
    leanstep.set_preset("moe")
    try:
        with pytest.raises(RuntimeError, match=message):
            model.finish_grad_sync()
    finally:
        leanstep.set_preset("all")


def test_a_finish_grad_sync_of_another_signature_skips_both(monkeypatch):
    def finish_grad_sync(self):  # a signature leanstep does not support
        pass

    lm.uninstall()
    monkeypatch.setattr(DistributedDataParallel, "finish_grad_sync", finish_grad_sync)
    try:
        skipped = lm.install()["skipped"]
        assert skipped[lddp.FINISH].startswith("signature mismatch: expected 0.16-0.19 "
                                                "(self, force_all_reduce=False), found (self)")
        assert skipped[lddp.CHECK] == (f"needs patch {lddp.FINISH}, which is not installed "
                                       f"({skipped[lddp.FINISH]})")
        assert BucketGroup.__dict__["check_grads"] is ORIGINAL_CHECK
        assert DistributedDataParallel.__dict__["finish_grad_sync"] is finish_grad_sync
    finally:
        lm.uninstall()
