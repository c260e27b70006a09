"""Helpers shared by the Python tests: the bound checks of the tolerance table
(leanstep._tolerances) as assertions, the C++ rule's hostile MoE calls, a
one-rank gloo group. Case generators and oracles of the ops are the
conformance harness's (test_conformance.py); the ulp helpers below serve the
C++-path tests (test_grad, test_moe, test_rmsnorm, test_reliability) and the
Megatron ones."""

import contextlib
import os
import socket

import numpy as np
import torch

import leanstep
from leanstep._tolerances import Tolerance, check, tolerance

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Unit roundoff (half an ulp at 1) of each dtype.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8,
                 torch.float64: 2.0**-53}

# Spacing of the subnormals (the smallest positive value) of each dtype: below the
# smallest normal, an ulp stops shrinking with |v| and stays this wide.
SUBNORMAL_SPACING = {torch.float32: 2.0**-149, torch.float16: 2.0**-24,
                     torch.bfloat16: 2.0**-133, torch.float64: 2.0**-1074}


def free_port():
    """A free TCP port on localhost (a gloo rendezvous, a worker's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_gloo():
    """A one-rank gloo process group on localhost for the block, as Megatron's
    collectives need one; a group that already exists serves and is left."""
    if torch.distributed.is_initialized():
        yield
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def overflow_at(steps):
    """A main-job trainer's ``before_optimizer_step`` hook: at each of `steps`, an
    inf in one trainable grad after the DDP reduction (an fp16 overflow)."""
    def before_optimizer_step(trainer, step):
        if step in steps:
            for p in trainer.model.module.parameters():
                if p.requires_grad:
                    p.main_grad.view(-1)[0] = float("inf")
                    return
    return before_optimizer_step


@contextlib.contextmanager
def megatron_cpu_session():
    """A one-rank gloo group and Megatron on the CPU for a test module; no
    Megatron parallel groups are left to the next module."""
    from megatron.core import parallel_state

    from leanstep.megatron import cpu as mcpu

    with one_rank_gloo(), mcpu.megatron_on_cpu():
        try:
            yield
        finally:
            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()


#: The main job's model at test size (2 MoE layers, 4 experts, EP 1).
MAIN_JOB_SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                  "--experts", "4", "--moe-ffn", "64", "--seq", "32", "--micro-batch", "2",
                  "--ep", "1"]


@contextlib.contextmanager
def megatron_installed():
    """Every leanstep.megatron patch installed, call counts from zero, the MoE
    patches on leanstep's CPU kernels as on a device; all undone afterwards."""
    import leanstep.megatron as lm
    from leanstep.megatron import moe as lm_moe

    lm.install()
    lm.reset_call_counts()
    previous = lm_moe.cpu_kernels(True)
    try:
        yield
    finally:
        lm_moe.cpu_kernels(previous)
        leanstep.set_preset("all")
        lm.uninstall()


def to_f64(t):
    """Exact float64 copy of a torch tensor or NumPy array."""
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def round_to(values_f64, dtype):
    """Correctly rounded (RNE) cast of float64 values to `dtype` (torch's casts
    from float64 round once)."""
    return torch.from_numpy(np.ascontiguousarray(values_f64)).to(dtype)


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def assert_within_ulps(actual, expected_f64, dtype, ulps=1.0, atol=0.0):
    """|actual - expected| <= ulps * ulp(expected) + atol, element-wise, where
    ulp(v) = max(2 * unit_roundoff * |v|, subnormal spacing). One ulp is what a
    result computed in fp32 and rounded once to a narrower dtype may be off from
    the correctly rounded value (the fp32 error can push a value across a rounding
    boundary); among the subnormals the spacing is fixed, not relative."""
    a = to_f64(actual)
    ulp = np.maximum(2 * UNIT_ROUNDOFF[dtype] * np.abs(expected_f64), SUBNORMAL_SPACING[dtype])
    bound = ulps * ulp + atol
    err = np.abs(a - expected_f64)
    bad = ~(err <= bound)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(
            f"{bad.sum()} of {bad.size} elements off by more than {ulps} ulp(s) + {atol}: "
            f"first at {tuple(i)}: got {a[tuple(i)]!r}, expected {expected_f64[tuple(i)]!r}")


#: Two runs of one computation that must agree in every bit (a grid size, a
#: path that must change nothing, the same kernels by two entry points).
SAME_BITS = Tolerance(exact=True, why="the same computation: the same bits, NaN as NaN")


def assert_within(actual, expected, tol, **kwargs):
    """`actual` within `tol` of `expected` (leanstep._tolerances.check, both
    moved to the host): `tol` is a (family, quantity) key of the tolerance
    table or a Tolerance; kwargs are check's (dtype, scale, terms). None
    matches None only."""
    if isinstance(tol, tuple):
        tol = tolerance(*tol)
    if actual is None or expected is None:
        assert actual is None and expected is None, f"got {actual!r}, expected {expected!r}"
        return
    scale = kwargs.get("scale")
    if isinstance(scale, torch.Tensor):
        kwargs["scale"] = scale.detach().cpu()
    why = check(actual.detach().cpu(), expected.detach().cpu(), tol, **kwargs)
    assert why is None, f"{why} [{tol.describe()}: {tol.why}]"


def assert_bitwise(actual, expected):
    """Every bit the same (NaN as NaN), dtype and shape included."""
    assert_within(actual, expected, SAME_BITS)


def moe_hostile_calls(torch_gen, device="cpu"):
    """(name, call(backend), message) for MoE inputs every backend must refuse
    with the C++ kernels' rule (leanstep/moe.h check_*_args on metadata)."""
    t, e, h = 6, 3, 4
    tokens = torch.randn(t, h, generator=torch_gen).to(device)
    routing_map = torch.zeros(t, e, dtype=torch.bool)
    routing_map[:, 1] = True
    routing_map[::2, 2] = True
    routing_map = routing_map.to(device)
    probs = torch.rand(t, e, generator=torch_gen).to(device)
    n = 9  # routed pairs
    permuted = torch.randn(n, h, generator=torch_gen).to(device)
    indices = torch.arange(n).remainder(t).to(device)
    sizes, order = torch.tensor([2, 1, 3]).to(device), torch.tensor([2, 0, 1]).to(device)
    d = device
    return [
        ("tokens 1-D", lambda b: leanstep.moe_permute(tokens[:, 0].contiguous(), routing_map, backend=b),
         r"permute: argument 'tokens' must have 2 dims"),
        ("map not bool", lambda b: leanstep.moe_permute(tokens, routing_map.int(), backend=b),
         r"permute: argument 'routing_map' must have dtype"),
        ("map of no expert", lambda b: leanstep.moe_permute(tokens, routing_map[:, :0], backend=b),
         r"argument 'routing_map' must have at least one expert"),
        ("tokens of another T", lambda b: leanstep.moe_permute(tokens[:5], routing_map, backend=b),
         r"argument 'tokens' must have T=6 rows like routing_map"),
        ("probs [T, E-1]", lambda b: leanstep.moe_permute(tokens, routing_map, probs[:, :2].contiguous(),
                                                          backend=b),
         r"argument 'probs' must have shape \[6, 3\] like routing_map"),
        ("tokens strided", lambda b: leanstep.moe_permute(tokens.t().contiguous().t(), routing_map,
                                                          backend=b),
         r"argument 'tokens' must be contiguous"),
        ("num_out_tokens < 0", lambda b: leanstep.moe_permute(tokens, routing_map,
                                                              num_out_tokens=-1, backend=b),
         r"permute: argument 'num_out_tokens' must be >= 0 \(got -1\)"),
        ("drop_and_pad without num_out_tokens",
         lambda b: leanstep.moe_permute(tokens, routing_map, drop_and_pad=True, backend=b),
         r"argument 'num_out_tokens' is required with drop_and_pad"),
        ("drop_and_pad, not E * capacity",
         lambda b: leanstep.moe_permute(tokens, routing_map, num_out_tokens=7, drop_and_pad=True,
                                        backend=b),
         r"argument 'num_out_tokens' must be a multiple of E=3"),
        ("drop_and_pad, capacity > T",
         lambda b: leanstep.moe_permute(tokens, routing_map, num_out_tokens=21, drop_and_pad=True,
                                        backend=b),
         r"gives capacity 7 > T=6"),
        ("unpermute, float indices",
         lambda b: leanstep.moe_unpermute(permuted, indices.float(), (t, h), backend=b),
         r"unpermute: argument 'sorted_indices' must have dtype"),
        ("unpermute, indices of another N",
         lambda b: leanstep.moe_unpermute(permuted, indices[:5], (t, h), backend=b),
         r"argument 'sorted_indices' must have shape \[9\]"),
        ("unpermute, int permuted",
         lambda b: leanstep.moe_unpermute(permuted.int(), indices, (t, h), backend=b),
         r"unpermute: argument 'permuted' must have dtype"),
        ("unpermute, [N+1] probs",
         lambda b: leanstep.moe_unpermute(permuted, indices, (t, h),
                                          torch.rand(n + 1, device=d), backend=b),
         r"argument 'probs' must be the \[N=9\] permuted probs"),
        ("unpermute, map of another T",
         lambda b: leanstep.moe_unpermute(permuted, indices, (t, h), probs[:5], routing_map[:5],
                                          backend=b),
         r"argument 'routing_map' must have T=6 rows like the output"),
        ("unpermute, probs [T, E-1]",
         lambda b: leanstep.moe_unpermute(permuted, indices, (t, h), probs[:, :2].contiguous(), routing_map,
                                          backend=b),
         r"argument 'probs' must have shape \[6, 3\] like routing_map"),
        ("unpermute, drop_and_pad rows not E * capacity",
         lambda b: leanstep.moe_unpermute(permuted[:8], indices[:8], (t, h), probs, routing_map,
                                          drop_and_pad=True, backend=b),
         r"argument 'sorted_indices' must have E \* capacity entries with drop_and_pad"),
        ("unpermute, restore_shape of another H",
         lambda b: leanstep.moe_unpermute(permuted, indices, (t, h + 1), backend=b),
         r"argument 'restore_shape' must be \(T >= 0, H=4\)"),
        ("unpermute, fractional restore_shape",
         lambda b: leanstep.moe_unpermute(permuted, indices, (6.5, h), backend=b),
         r"argument 'restore_shape' must be a host integer"),
        ("permute_backward, negative num_tokens",
         lambda b: leanstep.moe_permute_backward(permuted, indices, -1, backend=b),
         r"permute_backward: argument 'num_tokens' must be >= 0 \(got -1\)"),
        ("permute_backward, fractional num_tokens",
         lambda b: leanstep.moe_permute_backward(permuted, indices, 6.5, backend=b),
         r"permute_backward: argument 'num_tokens' must be a host integer"),
        ("permute_probs_backward, 2-D dprobs",
         lambda b: leanstep.moe_permute_probs_backward(permuted, indices, routing_map, backend=b),
         r"permute_probs_backward: argument 'dpermuted_probs' must have 1 dims"),
        ("permute_probs_backward, drop_and_pad rows not E * capacity",
         lambda b: leanstep.moe_permute_probs_backward(torch.rand(8, device=d), indices[:8],
                                                       routing_map, True, backend=b),
         r"argument 'sorted_indices' must have E \* capacity entries with drop_and_pad"),
        ("unpermute_backward, dout of another H",
         lambda b: leanstep.moe_unpermute_backward(torch.randn(t, h + 1, device=d), permuted,
                                                   indices, backend=b),
         r"unpermute_backward: argument 'dout' must have shape \[6, 4\]"),
        ("unpermute_backward, probs [T, E-1]",
         lambda b: leanstep.moe_unpermute_backward(torch.randn(t, h, device=d), permuted, indices,
                                                   probs[:, :2].contiguous(), routing_map, backend=b),
         r"argument 'probs' must have shape \[6, 3\] like routing_map"),
        ("pad_routing_map, int map",
         lambda b: leanstep.pad_routing_map(routing_map.int(), 4, backend=b),
         r"pad_routing_map: argument 'routing_map' must have dtype"),
        ("pad_routing_map, multiple 0", lambda b: leanstep.pad_routing_map(routing_map, 0, backend=b),
         r"pad_routing_map: argument 'multiple' must be >= 1 \(got 0\)"),
        ("pad_routing_map, fractional multiple",
         lambda b: leanstep.pad_routing_map(routing_map, 2.5, backend=b),
         r"pad_routing_map: argument 'multiple' must be a host integer"),
        ("pad_routing_map, out of another shape",
         lambda b: leanstep.pad_routing_map(routing_map, 4, out=routing_map[:5], backend=b),
         # the out= rule of the Python layer on the CPU, the kernel's on a device
         r"pad_routing_map: argument 'out' must (be bool\[6, 3\]|have shape \[6, 3\])"),
        ("sort_chunks, 2-D split sizes",
         lambda b: leanstep.sort_chunks_by_idxs(tokens, sizes.view(1, 3), order, backend=b),
         r"sort_chunks_by_idxs: argument 'split_sizes' must be 1-D"),
        ("sort_chunks, float split sizes",
         lambda b: leanstep.sort_chunks_by_idxs(tokens, sizes.float(), order, backend=b),
         r"sort_chunks_by_idxs: argument 'split_sizes' must have dtype"),
        ("sort_chunks, order of another length",
         lambda b: leanstep.sort_chunks_by_idxs(tokens, sizes, order[:2], backend=b),
         r"sort_chunks_by_idxs: argument 'sorted_idxs' must have shape \[3\]"),
        ("sort_chunks, probs of other rows",
         lambda b: leanstep.sort_chunks_by_idxs(tokens, sizes, order, probs[:5], backend=b),
         r"sort_chunks_by_idxs: argument 'probs' must be contiguous with R=6 rows"),
        ("sort_chunks, strided rows",
         lambda b: leanstep.sort_chunks_by_idxs(tokens.t().contiguous().t(), sizes, order,
                                                backend=b),
         r"sort_chunks_by_idxs: argument 'rows' must be a contiguous tensor with a row dim"),
    ]


class UndoImportPatches:
    """Puts back, on exit, what importing ms-swift (and mcore_bridge, which its
    Megatron side imports) patches process-wide in Transformers and PEFT and
    what this suite's other tests rely on: the HF Trainer's default callbacks
    (ms-swift's need its own TrainingArguments), and PEFT LoRA's
    dispatch_megatron and LoraModel.__init__ (mcore_bridge's dispatcher tests
    Transformer Engine classes, None without TE). TEST-ONLY: the other tests
    in this process then see the libraries as installed."""

    _TRAINER_NAMES = ("DEFAULT_CALLBACKS", "DEFAULT_PROGRESS_CALLBACK", "PrinterCallback")

    def __enter__(self):
        import importlib

        self._trainer = importlib.import_module("transformers.trainer")
        self._trainer_values = {n: getattr(self._trainer, n) for n in self._TRAINER_NAMES}
        self._lora = importlib.import_module("peft.tuners.lora.model")
        self._dispatch = self._lora.dispatch_megatron
        self._lora_class = dict(vars(self._lora.LoraModel))
        return self

    def __exit__(self, *exc):
        for name, value in self._trainer_values.items():
            setattr(self._trainer, name, value)
        self._lora.dispatch_megatron = self._dispatch
        cls = self._lora.LoraModel
        for name, value in list(vars(cls).items()):
            if name not in self._lora_class:
                delattr(cls, name)  # what a patch added (an __init__, a flag)
            elif value is not self._lora_class[name]:
                setattr(cls, name, self._lora_class[name])
        return False
