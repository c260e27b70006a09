#!/usr/bin/env python3
"""leanstep's host time per call at the sizes of a real step, against its
peers, side by side in one process, one thread.

    python bench/host_overhead.py [--quick] [--only rmsnorm,moe,grad] [--json]
    python bench/host_overhead.py --device cuda --only rmsnorm,moe,grad   # a GPU

At these sizes the kernels are small: what a call costs is mostly host time,
on an accelerator all of it. With ``--device cuda`` the same cases run on the
GPU (leanstep's default there is Triton after its self-check; run again with
LEANSTEP_TRITON=off for the torch-op backend): a call's time is then the host
time to enqueue it, the device synchronized after each block of calls,
outside the timer. Cases:

- RMSNorm, frozen weight, bf16: [128, 256] (the main job's shape) forward +
  backward, and forward under no_grad (set around each block of calls, as an
  evaluation loop sets it; and, for comparison, entered in every call);
  [8192, 2048] forward + backward (the
  kernel's own speed). Peers: torch.nn.RMSNorm, F.rms_norm. And the module
  the Megatron patch builds (exact_forward: torch's forward bit for bit,
  leanstep's dx) at the host-bound job's [64, 64], forward + backward.
- MoE permute + unpermute, forward + backward, bf16: 128 tokens, H 256, 8
  experts, top-2 (the main job) and 4096 tokens, H 2048, 16 experts, top-8.
  Peer: Megatron-Core's moe_utils.permute / unpermute. And the host-bound
  job's calls through the patches (permute with probs, unpermute without; 64
  tokens, H 64, 16 experts, top-8) under each CPU setting of
  leanstep.megatron.moe.cpu_kernels.
- The grad functions over 3168 fresh views (16 fp32 elements each) of one
  buffer, a fresh list of fresh view objects per call as Megatron's
  distributed optimizer builds them (made outside the timer; the buffer and its
  params are made before any case runs, as training makes its params before its
  steps):
  get_grad_norm_fp32, clip_grad_by_total_norm_fp32, count_zeros_fp32 (Megatron-
  Core's own, no TE or apex, against the patched ones on the CPU kernels and on
  the torch-op backend), and torch.nn.utils.clip_grad_norm_(foreach=True).
- Hugging Face ("hf"): Qwen3RMSNorm and Gemma3RMSNorm (frozen, bf16, the two
  conventions) against leanstep.transformers' swap of each, at the two RMSNorm
  shapes; clip_grad_norm_ over a PEFT LoRA model's 672 grads (torch foreach,
  leanstep over the same separate grads, leanstep over one GradBuffer); the
  "leanstep" experts backend against "grouped_mm" and "eager" (Qwen3-MoE
  experts, 512 tokens, H 256, 16 experts, top-4, bf16, fwd+bwd).

Timing: rounds; in each round every variant of a case runs a block of calls,
in the order of a row of Williams squares (so that each variant follows each
other equally often: a variant run right after a peer's long call finds
colder caches than one run after a short call, and a rotated order would give
one variant that place every round), and the block's median is that round's
time. The rounds are rounded up to whole squares. The
ratio peer / leanstep is the geometric mean over rounds of the per-round
ratios, with a 95% interval from a bootstrap over rounds (the rounds are the
independent units: calls within a block share the machine's state).

Prints a table, then with --json one JSON line per row: {bench, case,
variant, median_us, x_peer, x_peer_low, x_peer_high, rounds}.
"""

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

import leanstep  # noqa: E402
import leanstep.megatron as lm  # noqa: E402
import leanstep.megatron.cpu as mcpu  # noqa: E402
import leanstep.torch as lt  # noqa: E402
from leanstep import _backend  # noqa: E402
from leanstep._stats import crossover_plan  # noqa: E402
from leanstep.megatron import grad as lm_grad  # noqa: E402


DEVICE = torch.device("cpu")


def sync():
    """Waits for the device after a block of calls (outside the timer)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def measure(variants, rounds, calls, setup=None, block_context=contextlib.nullcontext):
    """{name: [per-round median seconds]} of `variants` ({name: fn}): each
    round runs every variant `calls` times, in the order of a row of Williams
    squares (carryover-balanced: each variant follows each other equally
    often); `rounds` is rounded up to whole squares. `setup(name)` runs before
    each call, outside the timer; its result is passed to the variant.
    ``block_context()`` is entered around each block of calls, outside the
    timer (``torch.no_grad``: calls made under no_grad, as an evaluation loop
    makes them, without the context manager's own enter and exit in each)."""
    names = list(variants)
    orders = williams_orders(names)
    rounds = -(-rounds // len(orders)) * len(orders)
    out = {name: [] for name in names}
    for name in names:  # warm-up: caches, allocator, decisions
        with block_context():
            for _ in range(3):
                variants[name](setup(name) if setup else None)
    sync()
    # No garbage collection inside a timed call (as Megatron's --manual-gc): a
    # collection would land in whichever call crosses the threshold. The
    # setups' garbage is collected between rounds.
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            order = orders[r % len(orders)]
            for name in order:
                times = []
                with block_context():
                    for _ in range(calls):
                        arg = setup(name) if setup else None
                        t0 = time.perf_counter()
                        variants[name](arg)
                        times.append(time.perf_counter() - t0)
                        del arg
                sync()
                out[name].append(statistics.median(times))
            gc.collect()
    finally:
        gc.enable()
    return out


def williams_orders(names):
    """The rows of Williams squares over `names` (one square for an even count,
    two for an odd one), as the main job's crossover plans them."""
    if len(names) < 2:
        return [list(names)]
    squares = 1 if len(names) % 2 == 0 else 2
    labels = [f"v{i}" for i in range(len(names))]  # a plan's condition names are plain words
    plan = crossover_plan(labels, squares * len(names), 1, 0, exclude_after_transition=0)
    return [[names[labels.index(b)] for b in run["blocks"]] for run in plan["runs"]]


def ratio_interval(peer, ours, seed=0, resamples=2000):
    """(geometric mean of peer/ours over rounds, 2.5%, 97.5% bootstrap bounds)."""
    logs = [math.log(p / o) for p, o in zip(peer, ours)]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(resamples))
    return (math.exp(statistics.fmean(logs)), math.exp(means[int(0.025 * resamples)]),
            math.exp(means[int(0.975 * resamples) - 1]))


class Table:
    def __init__(self):
        self.rows = []

    def case(self, bench, case, results, peer):
        """Rows of one case: every variant's median, and peer / variant."""
        for name, times in results.items():
            row = {"bench": bench, "case": case, "variant": name,
                   "median_us": round(statistics.median(times) * 1e6, 2), "rounds": len(times)}
            if name != peer:
                x, low, high = ratio_interval(results[peer], times)
                row.update(x_peer=round(x, 3), x_peer_low=round(low, 3),
                           x_peer_high=round(high, 3), peer=peer)
            self.rows.append(row)
            print(f"  {bench:8s} {case:44s} {name:40s} {row['median_us']:12.1f} us"
                  + (f"  x{row['x_peer']:.2f} [{row['x_peer_low']:.2f}, {row['x_peer_high']:.2f}]"
                     if "x_peer" in row else "  (peer)"), file=sys.stderr, flush=True)

    def format(self):
        lines = [f"{'bench':8s} {'case':44s} {'variant':40s} {'median us':>12s} "
                 f"{'peer / this [95% interval]':>30s}"]
        lines.append("-" * len(lines[0]))
        for r in self.rows:
            ratio = (f"{r['x_peer']:8.2f} [{r['x_peer_low']:.2f}, {r['x_peer_high']:.2f}]"
                     if "x_peer" in r else "      (peer)")
            lines.append(f"{r['bench']:8s} {r['case']:44s} {r['variant']:40s} "
                         f"{r['median_us']:12.1f} {ratio:>30s}")
        return "\n".join(lines)


# ---------------------------------------------------------------- RMSNorm


def bench_rmsnorm(table, args):
    shapes = [((128, 256), True), ((8192, 2048), False)]
    for shape, small in shapes:
        rounds, calls = (args.rounds, 50 if small else 2) if not args.quick else (3, 5 if small else 1)
        width = shape[-1]
        x = torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
        dy = torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE)
        peer = torch.nn.RMSNorm(width, eps=1e-6, dtype=torch.bfloat16,
                                device=DEVICE).requires_grad_(False)
        ours = lt.RMSNorm(width, eps=1e-6, dtype=torch.bfloat16,
                          device=DEVICE).requires_grad_(False)
        weight = peer.weight.detach()

        def fwd_bwd(module):
            def run(_):
                x.grad = None
                module(x).backward(dy)
            return run

        def functional(_):
            x.grad = None
            torch.nn.functional.rms_norm(x, [width], weight, 1e-6).backward(dy)

        results = measure({"torch.nn.RMSNorm": fwd_bwd(peer), "F.rms_norm": functional,
                           "leanstep.torch.RMSNorm": fwd_bwd(ours)}, rounds, calls)
        table.case("rmsnorm", f"frozen fwd+bwd {list(shape)} bf16", results, "torch.nn.RMSNorm")
        if small:
            # Calls under no_grad, as an evaluation loop makes them: the mode is set
            # around each block, outside the timer. Entering torch.no_grad() in every
            # call would add its own enter and exit (about 2.3 us, the same on both
            # sides) to both; that row follows, for comparison.
            def forward(module):
                def run(_):
                    module(x)
                return run

            results = measure({"torch.nn.RMSNorm": forward(peer),
                               "leanstep.torch.RMSNorm": forward(ours)}, rounds, calls,
                              block_context=torch.no_grad)
            table.case("rmsnorm", f"forward no_grad {list(shape)} bf16", results,
                       "torch.nn.RMSNorm")

            def no_grad_each_call(module):
                def run(_):
                    with torch.no_grad():
                        module(x)
                return run

            results = measure({"torch.nn.RMSNorm": no_grad_each_call(peer),
                               "leanstep.torch.RMSNorm": no_grad_each_call(ours)}, rounds, calls)
            table.case("rmsnorm", f"with no_grad() each call {list(shape)} bf16", results,
                       "torch.nn.RMSNorm")
    # The module the Megatron patch builds (exact_forward: torch's forward, bit for bit;
    # leanstep's dx), at the host-bound job's shape: a frozen norm's forward + backward.
    shape = (64, 64)
    rounds, calls = (args.rounds, 50) if not args.quick else (3, 5)
    x = torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    dy = torch.randn(*shape, dtype=torch.bfloat16, device=DEVICE)
    peer = torch.nn.RMSNorm(64, eps=1e-5, dtype=torch.bfloat16,
                            device=DEVICE).requires_grad_(False)
    ours = lt.RMSNorm.from_torch(peer, frozen_only=True, exact_forward=True)

    def exact_fwd_bwd(module):
        def run(_):
            x.grad = None
            module(x).backward(dy)
        return run

    results = measure({"torch.nn.RMSNorm": exact_fwd_bwd(peer),
                       "leanstep.torch.RMSNorm exact_forward": exact_fwd_bwd(ours)},
                      rounds, calls)
    table.case("rmsnorm", f"exact_forward fwd+bwd {list(shape)} bf16", results,
               "torch.nn.RMSNorm")


# ---------------------------------------------------------------- MoE


def bench_moe(table, args):
    import megatron.core.transformer.moe.moe_utils as moe_utils

    cases = [(128, 256, 8, 2, True), (4096, 2048, 16, 8, False)]
    for tokens_n, hidden, experts, topk, small in cases:
        rounds, calls = (args.rounds, 20 if small else 1) if not args.quick else (3, 3 if small else 1)
        if not small and args.quick:
            continue
        g = torch.Generator().manual_seed(0)
        tokens = torch.randn(tokens_n, hidden, dtype=torch.bfloat16, generator=g).to(DEVICE)
        tokens.requires_grad_(True)
        scores = torch.rand(tokens_n, experts, generator=g)
        routing_map = torch.zeros(tokens_n, experts, dtype=torch.bool).scatter_(
            1, scores.topk(topk, dim=1).indices, True)
        probs = torch.where(routing_map, scores, 0.0).to(torch.bfloat16)
        num_out = int(routing_map.sum())
        routing_map = routing_map.to(DEVICE)
        probs = probs.to(DEVICE).requires_grad_(True)
        dout = torch.randn(tokens_n, hidden, dtype=torch.bfloat16, generator=g).to(DEVICE)

        def megatron(_):
            out = moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=num_out)
            permuted, idx = out[0], out[2]  # 0.16 returns 3 values, 0.17+ 5
            moe_utils.unpermute(permuted, idx, tokens.shape, probs=probs,
                                routing_map=routing_map).backward(dout)

        def leanstep_(_):
            permuted, _, idx = lt.permute(tokens, routing_map, probs, num_out)
            lt.unpermute(permuted, idx, tokens.shape, probs, routing_map).backward(dout)

        results = measure({"megatron moe_utils": megatron, "leanstep.torch": leanstep_},
                          rounds, calls)
        table.case("moe", f"permute+unpermute fwd+bwd T{tokens_n} H{hidden} E{experts} "
                   f"top{topk}", results, "megatron moe_utils")
    if DEVICE.type == "cpu":
        bench_moe_patches(table, args)


def bench_moe_patches(table, args):
    """The host-bound job's MoE calls through the Megatron patches, on the CPU:
    permute with probs, the experts' weighting, unpermute without (64 tokens,
    H 64, 16 experts, top-8, bf16, forward + backward), under each setting of
    leanstep.megatron.moe.cpu_kernels against Megatron's own functions."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from leanstep.megatron import moe as lm_moe

    rounds, calls = (args.rounds, 20) if not args.quick else (3, 3)
    tokens_n, hidden, experts, topk = 64, 64, 16, 8
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(tokens_n, hidden, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    scores = torch.rand(tokens_n, experts, generator=g)
    routing_map = torch.zeros(tokens_n, experts, dtype=torch.bool).scatter_(
        1, scores.topk(topk, dim=1).indices, True)
    probs = torch.where(routing_map, scores, 0.0).to(torch.bfloat16).requires_grad_(True)
    num_out = int(routing_map.sum())
    dout = torch.randn(tokens_n, hidden, dtype=torch.bfloat16, generator=g)
    lm.uninstall()
    original = {name: getattr(moe_utils, name) for name in ("permute", "unpermute")}
    lm.install(["permute", "unpermute"])
    patched = {name: getattr(moe_utils, name) for name in ("permute", "unpermute")}

    def job_calls(functions, setting):
        def run(_):
            lm_moe.cpu_kernels(setting)
            out = functions["permute"](tokens, routing_map, probs=probs, num_out_tokens=num_out)
            weighted = out[0] * out[1].unsqueeze(-1)
            functions["unpermute"](weighted, out[2], tokens.shape).backward(dout)
        return run

    previous = lm_moe.cpu_kernels()
    try:
        results = measure({"megatron moe_utils": job_calls(original, previous),
                           "leanstep patch, auto (default)": job_calls(patched, "auto"),
                           "leanstep patch, all leanstep": job_calls(patched, True)},
                          rounds, calls)
    finally:
        lm_moe.cpu_kernels(previous)
        lm.uninstall()
    table.case("moe", f"patched job calls fwd+bwd T{tokens_n} H{hidden} E{experts} top{topk}",
               results, "megatron moe_utils")


# ---------------------------------------------------------------- grad functions


@contextlib.contextmanager
def one_rank_group():
    """bench/peers.py's one-rank group (gloo; nccl on a GPU), destroyed afterwards."""
    if torch.distributed.is_initialized():
        yield
        return
    from peers import init_process_group  # this script's folder is on sys.path

    init_process_group("nccl" if DEVICE.type == "cuda" else "gloo")
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


GRAD_VIEWS, GRAD_NUMEL = 3168, 16


@functools.cache
def _grad_fixture():
    """The grad case's buffer and 3168 params, made the first time asked. main() asks
    before any case runs: training makes its params (the optimizer's main params,
    whose grads the clip reads) before its steps churn the heap, not amid them. Made
    after the MoE case instead, in a heap its large tensors left scattered, the
    params' autograd data lies far apart and the clip's pass over them (torch's .grad
    getter, param by param) reads about 120 us slower (measured: --only moe,grad,
    CPU kernels 546 against 420 us, torch-op 604 against 482 us); Megatron's own clip
    the same within 3%."""
    return (torch.randn(GRAD_VIEWS * GRAD_NUMEL, device=DEVICE),
            [torch.nn.Parameter(torch.zeros(GRAD_NUMEL, device=DEVICE))
             for _ in range(GRAD_VIEWS)])


def bench_grad(table, args):
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core import parallel_state

    views_n, numel = GRAD_VIEWS, GRAD_NUMEL
    rounds, calls = (args.rounds, 5) if not args.quick else (3, 2)
    names = ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32")
    lm.uninstall()
    original = {name: getattr(clip_grads, name) for name in names}
    lm.install(list(names))
    patched = {name: getattr(clip_grads, name) for name in names}
    buf, params = _grad_fixture()

    def fresh_views(_name=None):
        views = [buf[i * numel:(i + 1) * numel] for i in range(views_n)]
        for p, v in zip(params, views):
            p.grad = v
        return views

    def with_backend(fn, backend):
        def run(views):
            lm_grad.plans.backend = backend
            try:
                return fn(views)
            finally:
                lm_grad.plans.backend = None
        return run

    # Megatron's helpers assume CUDA: on the CPU, leanstep.megatron.cpu's shims answer them.
    shims = mcpu.megatron_on_cpu() if DEVICE.type == "cpu" else contextlib.nullcontext()
    default = "CPU kernels" if DEVICE.type == "cpu" else "default backend"
    with one_rank_group(), shims:
        parallel_state.initialize_model_parallel(1, 1)
        group = parallel_state.get_data_parallel_group()
        try:
            calls_of = {
                "get_grad_norm_fp32": lambda f: (lambda views: f(views)),
                # a norm far above max_norm: every grad is scaled
                "clip_grad_by_total_norm_fp32": lambda f: (lambda views: f(params, 1.0, 1e9)),
                "count_zeros_fp32": lambda f: (lambda views: f(params, group)),
            }
            for name in names:
                variants = {
                    "megatron (no TE/apex)": calls_of[name](original[name]),
                    f"leanstep patch, {default}": calls_of[name](patched[name]),
                    "leanstep patch, torch-op backend": with_backend(calls_of[name](patched[name]),
                                                                     "torch"),
                }
                results = measure(variants, rounds, calls, setup=fresh_views)
                table.case("grad", f"{name} 3168 fresh views", results, "megatron (no TE/apex)")

            def torch_clip(_):
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)

            def leanstep_clip(views):
                patched["clip_grad_by_total_norm_fp32"](
                    params, 1.0, patched["get_grad_norm_fp32"](views))

            results = measure({"torch clip_grad_norm_(foreach)": torch_clip,
                               "leanstep norm + clip (patched)": leanstep_clip},
                              rounds, calls, setup=fresh_views)
            table.case("grad", "norm + clip 3168 fresh views", results,
                       "torch clip_grad_norm_(foreach)")
        finally:
            parallel_state.destroy_model_parallel()
            lm.uninstall()


# ---------------------------------------------------------------- Hugging Face


def bench_hf(table, args):
    """The HF RMSNorm classes (frozen, bf16) against leanstep's swap of each;
    torch's clip_grad_norm_(foreach) over a PEFT LoRA model's grads against
    leanstep's, over the same separate grads and over one GradBuffer; the
    "leanstep" experts backend against "grouped_mm" and "eager"."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from leanstep.transformers import experts as lx
    from leanstep.transformers import rmsnorm as hf_rmsnorm

    for shape, small in [((128, 256), True), ((8192, 2048), False)]:
        rounds, calls = (args.rounds, 50 if small else 2) if not args.quick else (3, 5 if small else 1)
        width = shape[-1]
        x = torch.randn(*shape, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(*shape, dtype=torch.bfloat16)
        for cls, center in ((Qwen3RMSNorm, 1.0), (Gemma3RMSNorm, 0.0)):
            hf = cls(width, eps=1e-6).to(torch.bfloat16).requires_grad_(False)
            with torch.no_grad():
                hf.weight.normal_(center, 0.1)
            ours = hf_rmsnorm.swap(hf)

            def fwd_bwd(module):
                def run(_):
                    x.grad = None
                    module(x).backward(dy)
                return run

            peer = f"{cls.__name__} (HF)"
            results = measure({peer: fwd_bwd(hf), "leanstep.transformers swap": fwd_bwd(ours)},
                              rounds, calls)
            table.case("hf", f"{cls.__name__} frozen fwd+bwd {list(shape)} bf16", results, peer)

    # Clip: a PEFT LoRA model's grads (r 8 on the seven projections of 48 layers: 672 tensors).
    rounds, calls = (args.rounds, 10) if not args.quick else (3, 2)
    torch.manual_seed(0)
    config = tf.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=48, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16)
    model = get_peft_model(tf.Qwen3ForCausalLM(config), LoraConfig(
        r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.randn_like(p)
    separate = [p.grad for p in trainable]
    buffered_params = [torch.nn.Parameter(p.detach().clone()) for p in trainable]
    for p, g in zip(buffered_params, separate):
        p.grad = g.clone()
    buffer = lt.GradBuffer(buffered_params)

    def torch_foreach(_):
        torch.nn.utils.clip_grad_norm_(trainable, 1e9, foreach=True)

    def leanstep_separate(_):
        lt.clip_grad_norm_(trainable, 1e9)

    def leanstep_buffer(_):
        lt.clip_grad_norm_(buffered_params, 1e9)

    results = measure({"torch clip_grad_norm_(foreach)": torch_foreach,
                       "leanstep.torch.clip_grad_norm_": leanstep_separate,
                       "leanstep, grads in one GradBuffer": leanstep_buffer}, rounds, calls)
    table.case("hf", f"clip_grad_norm_ PEFT LoRA grads ({len(trainable)} tensors)", results,
               "torch clip_grad_norm_(foreach)")

    # The HF Trainer's default: zero_grad(set_to_none=True), so every step's grads are
    # fresh tensors (new addresses): leanstep plans them anew each call.
    def fresh_grads(_name):
        for p, g in zip(trainable, separate):
            p.grad = g.clone()

    results = measure({"torch clip_grad_norm_(foreach)": torch_foreach,
                       "leanstep.torch.clip_grad_norm_": leanstep_separate}, rounds, calls,
                      setup=fresh_grads)
    table.case("hf", f"clip_grad_norm_ PEFT LoRA grads ({len(trainable)} tensors), fresh grads "
               "each call", results, "torch clip_grad_norm_(foreach)")
    del buffer

    # Experts: one Qwen3-MoE experts module, forward + backward, bf16.
    rounds, calls = (args.rounds, 5) if not args.quick else (3, 1)
    lx.register()
    moe_config = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=256, moe_intermediate_size=128,
                                   num_experts=16, num_experts_per_tok=4, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    moe_model = tf.Qwen3MoeForCausalLM(moe_config).to(torch.bfloat16)
    experts = next(m for m in moe_model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    experts.requires_grad_(False)  # frozen experts, as under LoRA: dx and the routing grads
    tokens = 512
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 256, generator=g).to(torch.bfloat16).requires_grad_(True)
    weights, index = torch.rand(tokens, 16, generator=g).softmax(-1).topk(4)
    weights = weights.to(torch.bfloat16).requires_grad_(True)
    dout = torch.randn(tokens, 256, generator=g).to(torch.bfloat16)

    def experts_run(impl):
        def run(_):
            moe_model.config._experts_implementation_internal = impl
            hidden.grad = weights.grad = None
            experts(hidden, index, weights).backward(dout)
        return run

    results = measure({"grouped_mm (HF)": experts_run("grouped_mm"),
                       "eager (HF)": experts_run("eager"),
                       "leanstep experts backend": experts_run(lx.NAME)}, rounds, calls)
    table.case("hf", f"experts fwd+bwd T{tokens} H256 E16 top4 bf16", results, "grouped_mm (HF)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, default=15,
                    help="rounds per case (default 15), rounded up to whole Williams squares")
    ap.add_argument("--only", default=None,
                    help="comma-separated benches (default rmsnorm,moe,grad,hf; on cuda no hf)")
    ap.add_argument("--json", action="store_true", help="JSON lines after the table")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the tensors live (default cpu; hf runs on cpu only)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.only is None:
        args.only = "rmsnorm,moe,grad" + (",hf" if DEVICE.type == "cpu" else "")
    if DEVICE.type == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device")
        torch.cuda.set_device(0)
        if "hf" in args.only.split(","):
            ap.error("--device cuda: the hf bench runs on the CPU only (use --only rmsnorm,moe,grad)")
        print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "triton_default": _backend.triton_automatic()}),
              file=sys.stderr)
    torch.set_num_threads(1)
    leanstep.set_num_threads(1)
    table = Table()
    if "grad" in args.only.split(","):
        _grad_fixture()  # before any case churns the heap, as training makes its params
    benches = {"rmsnorm": bench_rmsnorm, "moe": bench_moe, "grad": bench_grad, "hf": bench_hf}
    for name in args.only.split(","):
        if name not in benches:
            ap.error(f"--only: unknown bench {name!r} (choose from {', '.join(benches)})")
        benches[name](table, args)
    print(table.format())
    if args.json:
        for row in table.rows:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
