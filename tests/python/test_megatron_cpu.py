"""leanstep.megatron.cpu against the REAL megatron-core in the environment (0.16
on Python 3.11, 0.19 on Python 3.12): every shim restores exactly what it
replaced and nests; Megatron's own code runs on CPU tensors under it; a small
MoE GPTModel trains with Megatron DDP, get_megatron_optimizer and
get_forward_backward_func on one process and on two gloo ranks, where the
gradients are all-reduced only with finalize_model_grads_config (the silent
pitfall is shown).

The module under test is loaded from this checkout's source file, so the tests
run under any Python whether or not leanstep's compiled extension imports
there."""

import importlib.util
import logging
import math
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch

from helpers import free_port, one_rank_gloo

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
mcore = pytest.importorskip("megatron.core")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "megatron_cpu_worker.py")
CPU_PY = os.path.join(ROOT, "python", "leanstep", "megatron", "cpu.py")


def _load_cpu_module():
    spec = importlib.util.spec_from_file_location("_leanstep_megatron_cpu", CPU_PY)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mcpu = _load_cpu_module()

import megatron.core.optimizer.clip_grads as clip_grads  # noqa: E402
import megatron.core.tensor_parallel.mappings as mappings  # noqa: E402
import megatron.core.tensor_parallel.random as mrandom  # noqa: E402
import megatron.core.transformer.moe.moe_utils as moe_utils  # noqa: E402
import megatron.core.transformer.moe.token_dispatcher as token_dispatcher  # noqa: E402

MCORE_016 = mcore.__version__.startswith("0.16.")
ORIGINAL_TORCH_ATTRS = {
    "current_device": torch.cuda.current_device,
    "all_to_all_single": torch.distributed.all_to_all_single,
}

# Warm-up: the shims import the Megatron modules they patch on first entry.
with mcpu.megatron_on_cpu():
    pass


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group on localhost, for Megatron's collectives."""
    with one_rank_gloo():
        yield


# ---------------------------------------------------------------- exact restore


def _owners():
    """Every object whose attributes a shim may replace: all loaded Megatron
    modules, torch and the torch modules and classes involved, the classes that
    cache streams."""
    owners = {name: mod for name, mod in list(sys.modules.items())
              if mod is not None and (name == "megatron" or name.startswith("megatron."))}
    owners.update({"torch": torch, "torch.cuda": torch.cuda, "torch.distributed": torch.distributed,
                   "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module,
                   "torch.nn.Parameter": torch.nn.Parameter,
                   "MoEAlltoAllTokenDispatcher": token_dispatcher.MoEAlltoAllTokenDispatcher})
    shared = sys.modules.get("megatron.core.transformer.moe.shared_experts")
    if shared is not None:
        owners["SharedExpertMLP"] = shared.SharedExpertMLP
    return owners


def snapshot():
    snap = {name: dict(vars(obj)) for name, obj in _owners().items()}
    snap["<random logger filters>"] = list(logging.getLogger(mrandom.__name__).filters)
    return snap


def changes(before, after):
    """(owner, attribute) pairs whose object differs (by identity) or that
    appeared or went away."""
    out = set()
    for owner, attrs in before.items():
        now = after.get(owner)
        if isinstance(attrs, list):
            if now != attrs:
                out.add((owner, "filters"))
            continue
        if now is None:
            out.add((owner, "<gone>"))
            continue
        for key in attrs.keys() | now.keys():
            if attrs.get(key, mcpu._MISSING) is not now.get(key, mcpu._MISSING):
                out.add((owner, key))
    return out


def _mods(*names):
    """(module, "torch") for the named Megatron modules that this version has."""
    out = set()
    for n in names:
        mod = sys.modules.get("megatron.core." + n)
        if mod is not None and vars(mod).get("torch") is not None:
            out.add(("megatron.core." + n, "torch"))
    return out


STREAM_MODULES = ("transformer.moe.token_dispatcher", "distributed.param_and_grad_buffer",
                  "distributed.distributed_data_parallel", "transformer.moe.moe_utils",
                  "transformer.moe.shared_experts", "transformer.moe.moe_layer",
                  "transformer.transformer_layer", "pipeline_parallel.utils")
LITERAL_MODULES = ("optimizer.optimizer", "optimizer.clip_grads", "optimizer.grad_scaler",
                   "optimizer.layer_wise_optimizer", "utils", "pipeline_parallel.schedules",
                   "transformer.moe.moe_utils", "transformer.moe.token_dispatcher",
                   "transformer.utils", "tensor_parallel.data", "rerun_state_machine",
                   "distributed.param_and_grad_buffer")
# What each shim may replace, and nothing else.
EXPECTED = {
    "rng_tracker": {("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
                    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
                    ("<random logger filters>", "filters")}
    | _mods("tensor_parallel.random", "rerun_state_machine"),
    "cuda_streams": _mods(*STREAM_MODULES) | {("MoEAlltoAllTokenDispatcher", "cuda_dtoh_stream"),
                                              ("SharedExpertMLP", "stream")},
    "current_device": {("torch.cuda", "current_device")},
    "cuda_literals": _mods(*LITERAL_MODULES) | {("torch.Tensor", "cuda")},
    "cuda_type_names": {("torch.Tensor", "type")},
    "te_general_gemm": ({("megatron.core.transformer.moe.moe_utils", "te_general_gemm")}
                        if MCORE_016 else set()),
    "gloo_all_to_all": _mods("tensor_parallel.mappings"),
    "dtoh_copies": {("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu")},
}


def test_the_expected_modules_exist_in_this_version():
    # A shim silently skipping a module it should patch would look like success.
    for name in set(STREAM_MODULES) | set(LITERAL_MODULES) | {"tensor_parallel.random",
                                                                 "tensor_parallel.mappings"}:
        assert ("megatron.core." + name, "torch") in _mods(name), name
    assert ("te_general_gemm" in vars(moe_utils)) is (not MCORE_016)


@pytest.mark.parametrize("name", list(mcpu.SHIMS))
def test_each_shim_replaces_only_its_attributes_and_restores_them_exactly(name):
    before = snapshot()
    with mcpu.SHIMS[name]():
        inside = snapshot()
    after = snapshot()
    assert changes(before, inside) == EXPECTED[name]
    assert changes(before, after) == set()


def test_all_shims_together_restore_exactly():
    before = snapshot()
    with mcpu.megatron_on_cpu():
        inside = snapshot()
    with mcpu.cpu_shims(skip=("cuda_type_names", "current_device")):
        partial_ = snapshot()
    assert changes(before, snapshot()) == set()
    assert changes(before, inside) == set().union(*EXPECTED.values())
    assert changes(before, partial_) == (set().union(*EXPECTED.values())
                                         - EXPECTED["cuda_type_names"] - EXPECTED["current_device"])
    with pytest.raises(ValueError, match="unknown shim"):
        with mcpu.megatron_on_cpu(skip=("no_such_shim",)):
            pass


@pytest.mark.parametrize("name", list(mcpu.SHIMS))
def test_each_shim_nests_in_itself_and_in_all(name):
    shim = mcpu.SHIMS[name]
    before = snapshot()
    with shim():
        outer = snapshot()
        with shim():
            with mcpu.megatron_on_cpu():
                pass
        assert changes(outer, snapshot()) == set()
        with mcpu.megatron_on_cpu():
            with shim():
                pass
        assert changes(outer, snapshot()) == set()
    assert changes(before, snapshot()) == set()


def test_nested_views_compose():
    # token_dispatcher is in both the streams and the literals shims.
    real = token_dispatcher.torch
    with mcpu.cuda_streams():
        with mcpu.cuda_literals():
            view = token_dispatcher.torch
            assert view is not real
            assert view.cuda.Stream is mcpu.CpuStream
            assert view.zeros(2, device="cuda").device.type == "cpu"
            assert view.nn is torch.nn and view.Tensor is torch.Tensor  # the rest passes through
            assert view.cuda.device_count is torch.cuda.device_count
        assert token_dispatcher.torch.cuda.Stream is mcpu.CpuStream
        assert token_dispatcher.torch.zeros is torch.zeros
    assert token_dispatcher.torch is real


def test_an_attribute_replaced_inside_the_context_is_left_with_a_warning():
    original = vars(torch.Tensor).get("type", mcpu._MISSING)
    assert original is mcpu._MISSING

    def other(self, *args, **kwargs):
        return "other"

    try:
        with pytest.warns(RuntimeWarning, match="torch.Tensor.type was replaced inside"):
            with mcpu.cuda_type_names():
                torch.Tensor.type = other
        assert vars(torch.Tensor)["type"] is other
    finally:
        if "type" in vars(torch.Tensor):
            del torch.Tensor.type
    assert torch.zeros(1).type() == "torch.FloatTensor"


# ---------------------------------------------------------------- what each shim answers


def test_rng_tracker_keeps_named_cpu_states(monkeypatch):
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", False)
    default_before = torch.get_rng_state()
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):  # what the shim answers
            mrandom.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
    with mcpu.rng_tracker():
        mrandom.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
        tracker = mrandom.get_cuda_rng_tracker()
        assert set(tracker.get_states()) == {"data-parallel-rng", "model-parallel-rng",
                                             "expert-parallel-rng"}
        torch.manual_seed(123)
        outside = torch.get_rng_state()
        with tracker.fork():
            a = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outside)  # fork restored the CPU state
        with tracker.fork():
            b = torch.rand(4)  # continues the model-parallel stream
        with tracker.fork("expert-parallel-rng"):
            c = torch.rand(4)
        fresh = torch.Generator().manual_seed(7 + 2718)  # Megatron's tensor-parallel seed
        assert torch.equal(torch.cat([a, b]), torch.rand(8, generator=fresh))
        assert torch.equal(c, torch.rand(4, generator=torch.Generator().manual_seed(7 + 1024)))
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger(mrandom.__name__).addHandler(handler)
        try:
            with tracker.fork():
                torch.rand(1)
        finally:
            logging.getLogger(mrandom.__name__).removeHandler(handler)
        assert records == []  # the CPU-state warning is dropped inside the context
    torch.set_rng_state(default_before)


def test_cuda_streams_stand_ins():
    entry = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    with mcpu.cuda_streams():
        cuda = token_dispatcher.torch.cuda
        default = cuda.current_stream()
        assert default is cuda.default_stream() and isinstance(default, mcpu.CpuStream)
        side = cuda.Stream(device=torch.device("cpu"))
        assert side != default
        with cuda.stream(side):
            assert cuda.current_stream() is side
            with cuda.stream(None):
                assert cuda.current_stream() is side
        assert cuda.current_stream() is default
        side.wait_stream(default)
        event = side.record_event()
        assert isinstance(event, mcpu.CpuEvent) and event.query()
        end = cuda.Event(enable_timing=True)
        end.record()
        assert end.elapsed_time(end) == 0.0 and event.elapsed_time(end) >= 0.0
        # The class-wide stream the dispatcher makes at first use is a CPU one in
        # every context (a dispatcher built in an earlier one works) ...
        assert isinstance(token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream,
                          mcpu.CpuStream)
    # ... and what it was outside (a later CUDA run makes a real one).
    assert token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is entry


def test_current_device():
    with mcpu.current_device():
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.cuda.current_device is ORIGINAL_TORCH_ATTRS["current_device"]


def test_cuda_literals():
    t = torch.arange(3.0)
    with mcpu.cuda_literals():
        for device in ("cuda", "cuda:0", torch.device("cuda")):
            z = clip_grads.torch.zeros(1, dtype=torch.int, device=device)
            assert z.device.type == "cpu" and z.dtype == torch.int
        assert clip_grads.torch.tensor([1.0], device="cuda", pin_memory=True).device.type == "cpu"
        assert clip_grads.torch.zeros(1, device="meta").device.type == "meta"  # others unchanged
        assert t.cuda() is t and t.cuda(0, non_blocking=True) is t
        assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
        with clip_grads.torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.is_autocast_enabled("cpu")
    assert clip_grads.torch is torch and "cuda" not in vars(torch.Tensor)


def test_cuda_type_names():
    meta_name = torch.zeros(1, device="meta").type()
    with mcpu.cuda_type_names():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1, dtype=torch.float16).type() == "torch.cuda.HalfTensor"
        assert torch.nn.Parameter(torch.zeros(1)).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversion as before
        assert torch.zeros(1, device="meta").type() == meta_name  # not a CPU tensor
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_te_general_gemm_answers_the_name_0_16_leaves_undefined():
    inp = torch.randn(6, 8)
    weight = torch.randn(4, 8)
    if MCORE_016:
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    with mcpu.te_general_gemm():
        out = moe_utils.router_gating_linear(inp, weight, None, torch.float32)
    torch.testing.assert_close(out, inp @ weight.t())
    assert ("te_general_gemm" in vars(moe_utils)) is (not MCORE_016)


def test_gloo_all_to_all_takes_tensor_split_sizes(process_group):
    x = torch.arange(4.0)
    out = torch.empty(4)
    splits = torch.tensor([4])  # what Megatron's dispatcher passes
    with pytest.raises(TypeError):
        mappings.torch.distributed.all_to_all_single(out, x, output_split_sizes=splits,
                                                     input_split_sizes=splits)
    with mcpu.gloo_all_to_all():
        mappings.torch.distributed.all_to_all_single(out, x, output_split_sizes=splits,
                                                     input_split_sizes=splits.numpy())
        assert torch.distributed.all_to_all_single is ORIGINAL_TORCH_ATTRS["all_to_all_single"]
    assert torch.equal(out, x)


class _Param:
    def __init__(self, grad):
        self.grad = grad


def test_megatrons_gradient_helpers_run_on_cpu_tensors(process_group):
    # What tests/python/test_megatron.py needs: device='cuda' scalars in
    # clip_grads and utils, and clip's type assertion.
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(n, generator=gen) for n in (5, 17, 64)]
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    with mcpu.cuda_literals(), mcpu.cuda_type_names():
        norm = float(clip_grads.get_grad_norm_fp32(grads))
        inf_norm = float(clip_grads.get_grad_norm_fp32(grads, norm_type=math.inf))
        before = [g.clone() for g in grads]
        clip_grads.clip_grad_by_total_norm_fp32([_Param(g) for g in grads], 1.0, norm)
        world = torch.distributed.group.WORLD
        zeros = clip_grads.count_zeros_fp32([_Param(torch.tensor([0.0, 1.0, 0.0]))], world,
                                            tp_group=world)
    assert norm == pytest.approx(expected, rel=1e-6)
    assert inf_norm == max(float(g.abs().max()) for g in before)
    for g, b in zip(grads, before):
        torch.testing.assert_close(g, b * (1.0 / (norm + 1e-6)))
    assert zeros == 2


# ---------------------------------------------------------------- the gradient-sync wiring


class _Chunk:
    """What the wiring reads of a Megatron DDP model chunk."""

    def __init__(self, **ddp):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.ddp_config = DistributedDataParallelConfig(**ddp)

    def no_sync(self):
        pass

    def start_grad_sync(self):
        pass

    def start_param_sync(self):
        pass


class _Config:
    finalize_model_grads_func = no_sync_func = grad_sync_func = param_sync_func = None
    grad_scale_func = None


def test_finalize_model_grads_config_wires_what_megatrons_training_loop_does():
    from megatron.core.distributed import finalize_model_grads

    chunk = _Chunk()
    config = mcpu.finalize_model_grads_config(_Config(), chunk)
    assert config.finalize_model_grads_func is finalize_model_grads
    assert config.no_sync_func is config.grad_sync_func is config.param_sync_func is None

    class Opt:
        def scale_loss(self, loss):
            return loss

    opt = Opt()
    chunk = _Chunk(overlap_grad_reduce=True, overlap_param_gather=True, align_param_gather=True)
    config = mcpu.finalize_model_grads_config(_Config(), [chunk], opt)
    assert config.no_sync_func == chunk.no_sync and config.grad_sync_func == chunk.start_grad_sync
    assert config.param_sync_func == chunk.start_param_sync
    assert config.grad_scale_func == opt.scale_loss
    chunks = [_Chunk(overlap_grad_reduce=True), _Chunk(overlap_grad_reduce=True)]
    config = mcpu.finalize_model_grads_config(_Config(), chunks, align_grad_reduce=False)
    assert config.no_sync_func == [c.no_sync for c in chunks]
    assert config.grad_sync_func is None and config.param_sync_func is None


# ---------------------------------------------------------------- real training


def _run(cmd, out_dir, world):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd[1:])} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-8000:]}")
    results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
    print(f"{world} process(es): {seconds:.1f} s", file=sys.stderr)
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_process")
    return _run([sys.executable, WORKER, "--out", str(out), "--port", str(free_port()),
                 "distopt:steps=2",
                 "bf16:distopt=0,bf16=1,steps=2",
                 # A one-process reference for the two-rank run: the batches of
                 # rank 0 and rank 1 as two micro-batches of one step.
                 "ref_distopt:mbs=2,data=ranks",
                 "ref_ddp:distopt=0,mbs=2,data=ranks"], out, 1)[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", WORKER, "--out", str(out),
                 "ddp:distopt=0", "ddp_unset:distopt=0,finalize=0",
                 "distopt:distopt=1", "distopt_unset:distopt=1,finalize=0",
                 "ep2:ep=2,steps=2"], out, 2)


def _same(a, b, keys=None, atol=0.0):
    keys = a.keys() if keys is None else keys
    return all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in keys)


def test_moe_gpt_trains_on_one_process(one_process):
    assert one_process["megatron_core_version"] == mcore.__version__
    for phase in ("distopt", "bf16"):
        losses = one_process[phase]["losses"]
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
        assert losses[1] != losses[0]
        assert all(math.isfinite(v) and v > 0 for v in one_process[phase]["grad_norms"])
    assert one_process["bf16"]["params"]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    assert any(".mlp.experts." in n for n in one_process["distopt"]["params"])


def test_two_data_parallel_ranks_all_reduce_their_gradients(two_ranks, one_process):
    r0, r1 = two_ranks
    for phase, ref, atol in (("ddp", "ref_ddp", 0.0), ("distopt", "ref_distopt", 1e-6)):
        assert r0[phase]["losses"] != r1[phase]["losses"]  # each rank saw different data
        assert _same(r0[phase]["params"], r1[phase]["params"]), phase
        # ... and the step is the one of both ranks' batches on one process.
        assert _same(r0[phase]["params"], one_process[ref]["params"], atol=atol), phase


def test_without_finalize_model_grads_the_ranks_never_reduce(two_ranks, one_process):
    r0, r1 = two_ranks
    # Plain DDP: each rank steps with its own gradients, the replicas drift apart.
    assert not _same(r0["ddp_unset"]["params"], r1["ddp_unset"]["params"], atol=1e-4)
    # The distributed optimizer all-gathers the shards each rank updated with its
    # own gradient: the replicas agree, silently on the wrong parameters.
    assert _same(r0["distopt_unset"]["params"], r1["distopt_unset"]["params"])
    assert not _same(r0["distopt_unset"]["params"], one_process["ref_distopt"]["params"], atol=1e-4)


def test_expert_parallel_two_ranks_over_gloo(two_ranks):
    r0, r1 = two_ranks
    for r in (r0, r1):
        losses = r["ep2"]["losses"]
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses) and losses[0] != losses[1]
    params0, params1 = r0["ep2"]["params"], r1["ep2"]["params"]
    experts = [n for n in params0 if ".mlp.experts." in n]
    assert experts and all(re.search(r"local_experts\.[01]\.", n) for n in experts)  # 2 of 4 each
    assert _same(params0, params1, [n for n in params0 if n not in experts])  # dense: all-reduced
    assert not _same(params0, params1, experts, atol=1e-4)  # experts: different ones per rank


def test_the_package_module_is_this_source_where_leanstep_imports():
    try:
        import leanstep.megatron.cpu as packaged
    except ImportError as e:
        pytest.skip(f"the leanstep package does not import under this Python ({e}); "
                    f"its source file was tested")
    if not os.path.samefile(packaged.__file__, CPU_PY):
        pytest.skip(f"leanstep is imported from an installed copy ({packaged.__file__}), "
                    f"not this checkout; its source file was tested")
    assert packaged.SHIMS.keys() == mcpu.SHIMS.keys()
