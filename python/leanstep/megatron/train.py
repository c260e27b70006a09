"""The main job: real Megatron-Core MoE-LoRA training on CPU ranks, with and
without leanstep, measured by a counterbalanced crossover.

    python -m leanstep.megatron.train [--ep 1,2] [--crossover-ep 1] [--dtype bf16] [--out DIR] ...
    python -m leanstep.megatron.train --help

One command starts the ranks itself (torch.distributed.run, gloo, one CPU
thread per rank) and, when they are done, analyses their step logs with
leanstep's own statistics. What a run does:

1. Builds a Qwen3-MoE-style GPTModel from megatron-core's local layer spec
   (RMSNorm, RoPE, GQA, q/k norm, MoE with the alltoall dispatcher, top-k
   routing, aux loss) on the CPU (:mod:`leanstep.megatron.cpu`), after
   :func:`leanstep.megatron.install`, so its norms are leanstep's drop-ins.
2. Adds LoRA adapters (:mod:`leanstep.megatron.lora`; the base is frozen),
   wraps the model in Megatron DDP with the distributed optimizer (clip 1.0)
   and wires the gradient reduction as Megatron's training loop does.
3. Runs the crossover plan (:func:`leanstep.crossover_plan`, at the first EP
   size by default): every run starts from the same state, the condition
   (baseline, rmsnorm, grad, all, and baseline-aa, the baseline again)
   switches at block boundaries through the preset (:func:`leanstep.set_preset`)
   without rebuilding anything. Each rank logs every step (JSON Lines).
4. Audits one iteration per condition (:func:`leanstep.audit`), with the reads
   of device memory by call site (:class:`leanstep.audit.DeviceMemory`: what a
   GPU run would read), and trains a baseline and an "all" run on the same data
   for the agreement check.

Then it prints the per-condition step summary (step = max over ranks), the
paired same-position reductions with intervals over runs, the audit table,
the loss / grad-norm agreement, the trainable parameters per rank and the
first microbatch hash of every rank, and writes them as JSON (``--out``).
"""

import argparse
import gc
import hashlib
import json
import logging
import math
import os
import re
import socket
import subprocess
import sys
import time
import traceback
import warnings
from functools import partial

import torch

import leanstep
import leanstep.megatron as lm
from leanstep.audit import DeviceMemory

from . import cpu
from ._patching import megatron_core_version
from .lora import apply_lora, is_lora_parameter_name
from .moe import cpu_kernels
from .phases import PhaseTimers
from .step import keep_results_on_device

# Megatron-Core is imported inside the functions that build and run the model: the
# launching process (argument checks, the torchrun launch, verdicts and pictures) never
# imports it.

CONDITIONS = ("baseline", "rmsnorm", "grad", "all")
#: A second baseline, the same preset under another name (on unless --no-aa). Its
#: reduction against "baseline" is 0 in truth, so its interval shows what noise alone gives.
AA_CONDITION = "baseline-aa"
PRESETS = {"baseline": "baseline", "rmsnorm": "rmsnorm", "grad": "grad", "all": "all",
           AA_CONDITION: "baseline"}


#: Named model shapes (--config): the flags each one sets where not given explicitly.
CONFIGS = {
    "default": {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 2, "experts": 8, "topk": 2,
                "moe_ffn": 256, "seq": 128},
    # The seed's rank shape (many layers, 16 local experts at top-8, LoRA on the experts)
    # at tiny widths: 816 LoRA tensors per rank, a step of about 0.2 s here of which
    # Megatron's and leanstep's host work is most, as on an accelerator.
    "host-bound": {"layers": 12, "experts": 16, "topk": 8, "hidden": 64, "heads": 4,
                   "kv_heads": 2, "moe_ffn": 32, "seq": 64},
}


def apply_config(ap, args):
    """Sets the model flags not given explicitly: ``args.config``'s value, else the
    default's."""
    for name, value in CONFIGS["default"].items():
        if getattr(args, name) is None:
            setattr(args, name, CONFIGS[args.config].get(name, value))


def crossover_conditions(args):
    return tuple(args.condition_list) + ((AA_CONDITION,) if args.aa else ())


def crossover_at(args, ep):
    return "crossover" in args.phase_list and ep in args.crossover_ep_sizes

DEFAULT_TARGETS = "linear_qkv,linear_proj,linear_fc1,linear_fc2"
def _default_corpus():
    """The project's training text: in the installed package (leanstep/data/, put
    there by the wheel), else in the source tree's data/ (a checkout run with
    PYTHONPATH=python)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in (os.path.join(package, "data", "corpus.txt"),
                 os.path.join(os.path.dirname(os.path.dirname(package)), "data", "corpus.txt")):
        if os.path.isfile(path):
            return path
    return os.path.join("data", "corpus.txt")  # named in the error if neither exists


CORPUS = _default_corpus()


def build_parser():
    ap = argparse.ArgumentParser(
        prog="python -m leanstep.megatron.train",
        description="Megatron-Core MoE-LoRA training on CPU ranks with and without leanstep: a "
                    "counterbalanced crossover of four conditions (baseline, rmsnorm, grad, all), "
                    "an audit of one step per condition, and the baseline-vs-all agreement.")
    g = ap.add_argument_group("ranks")
    g.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (default 2)")
    g.add_argument("--ep", default="1,2",
                   help="expert-parallel sizes to run, comma-separated (default 1,2)")
    g.add_argument("--crossover-ep", default=None,
                   help="the EP sizes of --ep the crossover runs at (default: the first; the "
                        "audit and the agreement run at every size). At EP 2 a step here is "
                        "mostly gloo's all-to-all, and the time goes further at EP 1")
    g = ap.add_argument_group("model (Qwen3-MoE style)")
    g.add_argument("--config", choices=sorted(CONFIGS), default="default",
                   help="the model's shape: 'default' (4 layers, hidden 256, 8 experts top-2), "
                        "or 'host-bound' (the seed's rank shape at tiny widths: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}"
                                    for k, v in CONFIGS["host-bound"].items())
                        + ": thousands of small tensors, a step bound by host work as on a "
                          "fast accelerator). Flags given explicitly win")
    # Their defaults come from --config (apply_config): None here means "not given".
    g.add_argument("--hidden", type=int, help="hidden size (default 256)")
    g.add_argument("--layers", type=int, help="(default 4)")
    g.add_argument("--heads", type=int, help="(default 8)")
    g.add_argument("--kv-heads", type=int, help="query groups (GQA) (default 2)")
    g.add_argument("--experts", type=int, help="(default 8)")
    g.add_argument("--topk", type=int, help="(default 2)")
    g.add_argument("--moe-ffn", type=int, help="expert FFN hidden size (default 256)")
    g.add_argument("--seq", type=int, help="(default 128)")
    # One row of 128 tokens per rank: a step of about a third of a second here, so both
    # Megatron-Core lines' jobs (10 runs x 5 cycles each) finish within 10 minutes.
    g.add_argument("--micro-batch", type=int, default=1, help="rows per microbatch")
    g.add_argument("--microbatches", type=int, default=1,
                   help="microbatches per rank and step (gradient accumulation)")
    g.add_argument("--dtype", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="parameter dtype (bf16, fp16: fp32 main params in the optimizer; fp16 "
                        "with Megatron's dynamic loss scaler, whose first steps overflow and "
                        "are skipped while the scale backs off from 2^32). auto "
                        "(default): bf16 where this CPU multiplies bf16 natively (oneDNN "
                        "bf16 support: AVX512-BF16 / AMX), else fp32, because without it a "
                        "bf16 matmul is emulated, tens of times slower than fp32, and the "
                        "step would time that emulation rather than training")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="fp16: the dynamic loss scaler's first scale (Megatron's default 2^32)")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="fp16: steps without an overflow before the scale grows (default 1000)")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="fp16: overflows in a row before the scale backs off (default 2)")
    g = ap.add_argument_group("LoRA")
    g.add_argument("--targets", default=DEFAULT_TARGETS,
                   help=f"planner target list (default {DEFAULT_TARGETS})")
    g.add_argument("--lora-rank", type=int, default=8)
    g.add_argument("--lora-alpha", type=float, default=32.0)
    g = ap.add_argument_group("crossover")
    g.add_argument("--runs", type=int, default=None,
                   help="runs of the plan, a multiple of the conditions (default 10, or 8 with "
                        "--no-aa: two Williams squares; each run starts from the same state)")
    g.add_argument("--conditions", default=",".join(CONDITIONS),
                   help="the conditions the crossover compares, comma-separated, from "
                        f"{', '.join(CONDITIONS)}: baseline and at least one more (default "
                        "all four; the host-bound configuration of make demo compares "
                        "baseline and all, with more pairs per run)")
    g.add_argument("--aa", action=argparse.BooleanOptionalAction, default=True,
                   help=f"an A/A condition ({AA_CONDITION!r}: the baseline again) in the "
                        "crossover; its result against the baseline shows what noise alone "
                        "gives (default on)")
    g.add_argument("--block-steps", type=int, default=2,
                   help="steps per block (default 2: the conditions compared alternate every 2 "
                        "steps, so paired steps are seconds apart, not minutes)")
    g.add_argument("--cycles", type=int, default=None,
                   help="times each run holds each condition (default 5, or 4 with --no-aa, "
                        "which balances the transitions exactly)")
    g.add_argument("--warmup", type=int, default=2)
    g.add_argument("--exclude-after-transition", type=int, default=0,
                   help="steps after each block start the analysis leaves out (default 0: the "
                        "plan balances the transitions, so their cost is part of each condition)")
    g.add_argument("--agreement-steps", type=int, default=12,
                   help="steps of the baseline and 'all' runs compared (default 12)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--seed", type=int, default=1234)
    g = ap.add_argument_group("output")
    g.add_argument("--out", default=os.path.join("build", "demo", "megatron"),
                   help="directory for step logs and results (default build/demo/megatron)")
    g.add_argument("--corpus", default=CORPUS, help="training text (bytes are tokens)")
    g.add_argument("--log-interval", type=int, default=10,
                   help="crossover: read and log the loss and grad norm every N steps (and the "
                        "last of each run); the agreement runs log every step (default 10)")
    g.add_argument("--phases", default="crossover,audit,agreement",
                   help="what to run, comma-separated (default crossover,audit,agreement)")
    g.add_argument("--no-pin", action="store_true",
                   help="leave the ranks unbound (by default each is bound to its own CPU)")
    g.add_argument("--no-phase-barrier", action="store_true",
                   help="time the grad phase's collectives without a barrier before them (by "
                        "default a barrier precedes each, as Megatron's level-1 timers with "
                        "barrier_with_L1_time: a rank's wait for a later one is not that "
                        "phase's time)")
    g.add_argument("--no-grad-sync", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--quick", action="store_true",
                   help="a short run for tests: 1 run per condition order, 2-step blocks")
    g.add_argument("--json", action="store_true", help="print the results as one JSON object")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap


def auto_dtype():
    """(dtype, why) for --dtype auto."""
    try:
        native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native = False
    if native:
        return "bf16", "auto: this CPU multiplies bf16 natively"
    return "fp32", ("auto: this CPU has no native bf16 matmul (oneDNN: no AVX512-BF16/AMX), "
                    "so bf16 steps would time emulated matmuls; --dtype bf16 forces it")


def check_args(ap, args):
    """Every argument checked before any rank starts."""
    def bad(arg, rule, value):
        ap.error(f"argument {arg}: {rule} (got {value!r})")

    apply_config(ap, args)

    def ep_list(flag, text):  # comma-separated EP sizes, empty items skipped
        try:
            return [int(e) for e in str(text).split(",") if e.strip()]
        except ValueError:
            bad(flag, "must be comma-separated integers", text)

    chosen = [c.strip() for c in str(args.conditions).split(",") if c.strip()]
    if (any(c not in CONDITIONS for c in chosen) or len(set(chosen)) != len(chosen)
            or "baseline" not in chosen or len(chosen) < 2):
        bad("--conditions", f"must name baseline and at least one of "
                            f"{', '.join(CONDITIONS[1:])}, each once", args.conditions)
    args.condition_list = [c for c in CONDITIONS if c in chosen]  # the usual order
    conditions = crossover_conditions(args)
    for name in ("nproc", "hidden", "layers", "heads", "kv_heads", "experts", "topk", "moe_ffn",
                 "seq", "micro_batch", "microbatches", "lora_rank", "block_steps", "cycles",
                 "loss_scale_window", "hysteresis", "log_interval"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            bad("--" + name.replace("_", "-"), "must be >= 1", getattr(args, name))
    for name in ("warmup", "exclude_after_transition"):
        if getattr(args, name) < 0:
            bad("--" + name.replace("_", "-"), "must be >= 0", getattr(args, name))
    if args.agreement_steps < 2:
        bad("--agreement-steps", "must be >= 2", args.agreement_steps)
    if args.topk > args.experts:
        bad("--topk", "must be <= --experts", args.topk)
    if args.heads % args.kv_heads or args.hidden % args.heads:
        bad("--kv-heads", "must divide --heads, and --heads must divide --hidden", args.kv_heads)
    eps = ep_list("--ep", args.ep)
    if not eps or any(e < 1 or args.nproc % e or args.experts % e for e in eps):
        bad("--ep", "each size must be >= 1 and divide --nproc and --experts", args.ep)
    args.ep_sizes = eps
    crossover_eps = eps[:1] if args.crossover_ep is None else \
        ep_list("--crossover-ep", args.crossover_ep)
    if not crossover_eps or any(e not in eps for e in crossover_eps):
        bad("--crossover-ep", f"each size must be one of --ep ({args.ep})", args.crossover_ep)
    args.crossover_ep_sizes = crossover_eps
    if not (args.lr > 0 and math.isfinite(args.lr)):
        bad("--lr", "must be a finite number > 0", args.lr)
    if not (args.initial_loss_scale >= 1 and math.isfinite(args.initial_loss_scale)):
        bad("--initial-loss-scale", "must be a finite number >= 1 (Megatron's min_loss_scale)",
            args.initial_loss_scale)
    if not os.path.isfile(args.corpus):
        bad("--corpus", "must be a readable file", args.corpus)
    if os.path.getsize(args.corpus) < args.seq + 2:
        bad("--corpus", f"must hold more than --seq + 1 = {args.seq + 1} bytes", args.corpus)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        bad("--out", "must be a directory (or not exist yet)", args.out)
    if args.runs is not None and args.runs < 1:
        bad("--runs", "must be >= 1", args.runs)
    if args.exclude_after_transition >= args.block_steps:
        bad("--exclude-after-transition", f"must be < --block-steps = {args.block_steps}",
            args.exclude_after_transition)
    if args.quick:
        args.block_steps = min(args.block_steps, 2)
        args.cycles = 1
        args.warmup = min(args.warmup, 1)
        args.exclude_after_transition = 0
        args.agreement_steps = min(args.agreement_steps, 4)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - {"crossover", "audit", "agreement"})
    if unknown or not phases:
        bad("--phases", "must name crossover, audit and/or agreement", args.phases)
    args.phase_list = phases
    args.dtype_reason = "as asked"
    if args.dtype == "auto":
        args.dtype, args.dtype_reason = auto_dtype()
    if args.runs is None:  # two Williams squares (an odd count needs 2 per square)
        args.runs = len(conditions) if args.quick else 2 * len(conditions)
    if args.runs % len(conditions):
        bad("--runs", f"must be a multiple of {len(conditions)} (balanced plan of "
                      f"{', '.join(conditions)})", args.runs)
    if args.cycles is None:
        # 4 conditions: 4 cycles balance the transitions exactly. 5: every condition follows
        # every other 11 to 13 times in 10 runs; 7 would balance them exactly, and take make
        # demo past 10 minutes here.
        args.cycles = 5 if args.aa else 4


# ---------------------------------------------------------------- data


class Corpus:
    """Byte tokens of the corpus; the window of microbatch row b of global
    microbatch `index` of step `step` comes from (seed, step, index, b), so a
    step's data depends neither on the condition nor on the rank layout."""

    def __init__(self, path, seq, seed):
        with open(path, "rb") as f:
            self.data = f.read()
        self.seq = seq
        self.seed = seed

    def microbatch(self, step, index, rows):
        out = []
        span = len(self.data) - self.seq - 1
        for b in range(rows):
            key = hashlib.blake2b(f"{self.seed}:{step}:{index}:{b}".encode(), digest_size=8)
            offset = int.from_bytes(key.digest(), "little") % span
            out.append(list(self.data[offset:offset + self.seq + 1]))
        tokens = torch.tensor(out, dtype=torch.int64)
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(rows, self.seq),
                "position_ids": torch.arange(self.seq).expand(rows, self.seq).contiguous()}


def microbatch_hash(batch):
    return hashlib.sha256(batch["tokens"].numpy().tobytes()).hexdigest()[:16]


# ---------------------------------------------------------------- one rank


class Trainer:
    """Model, optimizer and step of one rank; rebuilt for every run so every
    run starts from the same state."""

    def __init__(self, args, ep, rank, world):
        self.args, self.ep, self.rank, self.world = args, ep, rank, world
        self.corpus = Corpus(args.corpus, args.seq, args.seed)
        self.timers = None  # PhaseTimers while the crossover runs
        self.phases = {}
        self.before_optimizer_step = None  # tests: f(trainer, step) after backward

    def build(self):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        a = self.args
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        # Every run starts from the same state, Megatron's class-level state included: the
        # MoE aux-loss scale tensor is made by the first step and copied into after.
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                     expert_model_parallel_size=self.ep)
        torch.manual_seed(a.seed)
        model_parallel_cuda_manual_seed(a.seed, force_reset_rng=True)
        bf16, fp16 = a.dtype == "bf16", a.dtype == "fp16"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.dtype, torch.float32)
        config = TransformerConfig(
            num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
            num_query_groups=a.kv_heads, kv_channels=a.hidden // a.heads,
            ffn_hidden_size=2 * a.hidden, qk_layernorm=True,
            num_moe_experts=a.experts, moe_router_topk=a.topk, moe_ffn_hidden_size=a.moe_ffn,
            moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-3, expert_model_parallel_size=self.ep,
            normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False,
            gated_linear_unit=True, activation_func=torch.nn.functional.silu,
            use_cpu_initialization=True, params_dtype=dtype, bf16=bf16, fp16=fp16,
            hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
            bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
            apply_rope_fusion=False)
        spec = get_gpt_layer_local_spec(num_experts=a.experts, moe_grouped_gemm=False,
                                        qk_layernorm=True, normalization="RMSNorm")
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=256,
                         max_sequence_length=a.seq, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        self.lora = apply_lora(model, targets=a.targets.split(","), rank=a.lora_rank,
                               alpha=a.lora_alpha, seed=a.seed)
        # As Megatron's training (get_model): the model moves to the device before DDP wraps
        # it. On the CPU the tensors stay where they are; leanstep.audit.DeviceMemory sees the
        # move and counts them as device memory.
        model.cuda(torch.cuda.current_device())
        self.bare_model = model
        if bf16 or fp16:
            # As Megatron-LM's get_model: a bf16 or fp16 model is a Float16Module, which casts
            # every parameter to that dtype (the norms' weights too: WrappedTorchNorm makes
            # them fp32) and the first stage's inputs; the optimizer keeps fp32 main params.
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        self.base_checksum = base_checksum(self.bare_model)  # names as GPTModel's own
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
        opt_config = OptimizerConfig(optimizer="adam", lr=a.lr, weight_decay=0.0, clip_grad=1.0,
                                     use_distributed_optimizer=True, bf16=bf16, fp16=fp16,
                                     params_dtype=dtype, initial_loss_scale=a.initial_loss_scale,
                                     loss_scale_window=a.loss_scale_window,
                                     hysteresis=a.hysteresis)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        # This loop takes the step's results on the device and reads them when it logs.
        keep_results_on_device(self.optimizer)
        if not a.no_grad_sync:  # (tests only: the silent pitfall of a hand-written loop)
            cpu.finalize_model_grads_config(config, [self.model], self.optimizer)
        self.config = config
        return self

    def step(self, step):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        a = self.args
        batches = [self.corpus.microbatch(step, self.rank * a.microbatches + m, a.micro_batch)
                   for m in range(a.microbatches)]

        def loss_func(loss_mask, output_tensor):
            loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
            return loss, {"lm loss": loss.detach().clone()}

        def forward_step(data_iterator, model):
            # As Megatron's get_batch: the batch moves to the device.
            b = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
            out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
            return out, partial(loss_func, b["loss_mask"])

        # No garbage collection inside a timed step (Megatron's --manual-gc): a collection
        # lands in whichever step crosses the threshold, whatever its condition. The young
        # generations are collected here, outside the timer; the model, optimizer and
        # modules were frozen out of the collector when the run started (run_ep).
        gc.collect(1)
        if self.timers is not None:
            self.timers.reset()
        torch.distributed.barrier()
        start = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[self.model],
            num_microbatches=len(batches), seq_length=a.seq, micro_batch_size=a.micro_batch,
            forward_only=False)
        if self.before_optimizer_step is not None:  # tests: inject an overflow
            self.before_optimizer_step(self, step)
        optimizer_start = time.perf_counter()
        ok, grad_norm, _ = self.optimizer.step()
        end = time.perf_counter()
        duration = end - start
        self.phases = {"optimizer_s": end - optimizer_start}
        if self.timers is not None:
            self.phases.update(self.timers.totals())
        loss = sum(o["lm loss"] for o in out) / len(out)
        # The loss the step logs is the data-parallel mean, as Megatron reports it.
        torch.distributed.all_reduce(loss)
        # Nothing is read here: the loss, the norm and the success flag stay where the
        # step left them (on a GPU, the device) until the log reads them (logged()).
        return StepResult(duration, loss, grad_norm, ok, batches[0], self.world)


class StepResult:
    """One step's outcome, unread: ``logged()`` reads the values a log needs."""

    def __init__(self, duration, loss, grad_norm, ok, batch, world):
        self.duration, self.loss, self.grad_norm, self.ok = duration, loss, grad_norm, ok
        self.batch, self.world = batch, world

    def logged(self):
        """(loss, grad_norm, update_successful) as Python values: the host reads
        of a logged step (the data-parallel mean loss; NaN for no norm)."""
        norm = float("nan") if self.grad_norm is None else float(self.grad_norm)
        return float(self.loss) / self.world, norm, bool(self.ok)


def base_checksum(model):
    """sha256 over every non-adapter parameter (the frozen base)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if not is_lora_parameter_name(name):
            h.update(name.encode())
            h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pin_to_core(local_rank):
    """Binds this rank to one CPU of those it may use (local rank i gets the i-th,
    round robin): no migration between cores in a timed step, and the two ranks
    do not take turns on one core. Measured on the 2-core CI machine, EP 1, 4
    runs x 2 cycles, twice each: the within-run sd of log step time fell from
    0.103-0.106 to 0.068. Returns the CPU, or None where affinity cannot be set."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        cpu = cpus[local_rank % len(cpus)]
        os.sched_setaffinity(0, {cpu})
    except (AttributeError, OSError):  # not Linux, or not permitted
        return None
    return cpu


def worker(args):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    pinned = None if args.no_pin else pin_to_core(int(os.environ.get("LOCAL_RANK", rank)))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = {"rank": rank, "ep": {}, "pinned_cpu": pinned}
    say = (lambda *m: print(*m, file=sys.stderr, flush=True)) if rank == 0 else (lambda *m: None)
    lm.install()  # before the model is built: its RMSNorms become leanstep's drop-ins
    try:
        with cpu.megatron_on_cpu():
            for ep in args.ep_sizes:
                results["ep"][str(ep)] = run_ep(args, ep, rank, world, say)
    finally:
        leanstep.set_preset("all")
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        results["report"] = lm.report()
        lm.uninstall()
        torch.distributed.destroy_process_group()
    with open(os.path.join(args.out, f"results.rank{rank}.json"), "w") as f:
        json.dump(results, f)


def run_ep(args, ep, rank, world, say):
    out_dir = os.path.join(args.out, f"ep{ep}")
    trainer = Trainer(args, ep, rank, world)
    result = {"runs": []}
    log_path = os.path.join(out_dir, "crossover", f"steps.rank{rank}.jsonl")
    runs = []
    if crossover_at(args, ep):
        plan = json.load(open(os.path.join(out_dir, "plan.json")))
        runs = plan["runs"]
    with open(log_path, "w") as log:
        for run_index, run in enumerate(runs):
            trainer.build()
            if run_index == 0:
                result["trainable"] = trainer.lora.layout() if hasattr(trainer.lora, "layout") \
                    else None
                result["num_trainable_params"] = trainer.lora.num_params
                result["num_trainable_tensors"] = trainer.lora.num_tensors
            current = None
            steps = leanstep.crossover_steps(plan, run_index)
            # The phase timers wrap what install() put in place, and leave before anything
            # else touches those attributes.
            gc.collect()
            gc.freeze()  # everything built so far: never scanned again (0.3 s per full pass here)
            gc.disable()
            barrier = None if args.no_phase_barrier else torch.distributed.barrier
            with PhaseTimers(trainer.model, barrier=barrier) as timers:
                trainer.timers = timers
                try:
                    for step, (condition, block) in enumerate(steps):
                        if condition != current:
                            leanstep.set_preset(PRESETS[condition])  # at a block boundary
                            current = condition
                        outcome = trainer.step(step)
                        duration, batch = outcome.duration, outcome.batch
                        record = {"run": run["run"], "rank": rank, "step": step,
                                  "duration_s": duration, "condition": condition,
                                  "block": block, "allocation": run["allocation"],
                                  **trainer.phases}
                        # Loss and norm are read (from the device, on a GPU) on logged
                        # steps only, as a training loop logs every N steps: the step
                        # itself reads nothing.
                        if step % args.log_interval == 0 or step == len(steps) - 1:
                            loss, grad_norm, _ = outcome.logged()
                            record.update(loss=loss, grad_norm=grad_norm)
                        if run_index == 0 and step < 2:
                            result.setdefault("first_microbatch_hashes", []).append(
                                microbatch_hash(batch))
                        log.write(json.dumps(record) + "\n")
                finally:
                    trainer.timers = None
                    gc.enable()
                    gc.unfreeze()
            log.flush()
            if run_index == 0:
                result["timed_sites"] = timers.sites
            say(f"[ep {ep}] {run['run']}: {len(steps)} steps in {len(run['blocks'])} blocks "
                f"(first cycle {' '.join(run['blocks'][:len(plan['conditions'])])}), "
                f"last loss {loss:.4f}")

    if not runs:
        trainer.build()
        result["num_trainable_params"] = trainer.lora.num_params
        result["num_trainable_tensors"] = trainer.lora.num_tensors
        result["first_microbatch_hashes"] = [
            microbatch_hash(trainer.corpus.microbatch(s, rank * args.microbatches, args.micro_batch))
            for s in range(2)]
    if "audit" in args.phase_list:
        result["audit"] = audit_conditions(trainer, say, ep)
    if "agreement" in args.phase_list:
        agreement(args, trainer, out_dir, rank, result, say, ep)
    result["trainable_names"] = [
        [n, list(p.shape)] for n, p in trainer.bare_model.named_parameters() if p.requires_grad]
    return result


def audit_conditions(trainer, say, ep):
    """One audited iteration per condition (each rank audits its own): aten ops,
    host syncs, host reads, and the reads of device memory by call site. Each
    condition builds its run afresh under :class:`leanstep.audit.DeviceMemory`
    (which tensors a GPU run keeps on the device: the model, the batches, what
    Megatron allocates on "cuda", all that follows from them) and audits its
    third step, after the plans, buffers and optimizer state exist. The MoE
    patches run leanstep's kernels on the CPU here, as they run on a device."""
    audits = {}
    previous = cpu_kernels(True)
    try:
        for condition in CONDITIONS:
            leanstep.set_preset(PRESETS[condition])
            memory = DeviceMemory(cpu.ACCELERATOR)
            with memory:
                trainer.build()
                for step in range(AUDIT_WARMUP):
                    trainer.step(step)
                with leanstep.audit(device_memory=memory,
                                    stacklevel_filter="leanstep/megatron/cpu.py") as a:
                    trainer.step(AUDIT_WARMUP)
            audits[condition] = {"ops": a.num_ops, "view_ops": a.num_view_ops,
                                 "syncs": a.num_syncs, "host_reads": a.num_host_reads,
                                 "device_reads": a.num_device_reads,
                                 "device_reads_by_site": device_reads_by_site(a),
                                 "top_syncs": [[str(k.site), n] for k, n in a.syncs.most_common(4)],
                                 # all of it, for the host-cost model (--model-from)
                                 "report": a.to_dict()}
    finally:
        cpu_kernels(previous)
    say(f"[ep {ep}] audited one iteration per condition")
    return audits


AUDIT_WARMUP = 2  # steps before the audited one (fp16 at 2^32 overflows at first: these skip)


def device_reads_by_site(a):
    """[[count, "file:line (function)", what]] of an audit's reads of device memory,
    the most frequent first (what: read kind, dtype and shape)."""
    rows = {}
    for r, n in a.host_reads.items():
        if r.memory != "device":
            continue
        site = f"{os.path.basename(r.site.file)}:{r.site.line} ({r.site.function})"
        key = (site, f"{r.kind} {r.dtype}[{','.join(map(str, r.shape))}]")
        rows[key] = rows.get(key, 0) + n
    return [[n, site, what] for (site, what), n in sorted(rows.items(), key=lambda kv: -kv[1])]


def agreement(args, trainer, out_dir, rank, result, say, ep):
    """baseline vs all: the same initial state and data."""
    for condition in ("baseline", "all"):
        trainer.build()
        leanstep.set_preset(PRESETS[condition])
        path = os.path.join(out_dir, condition, f"steps.rank{rank}.jsonl")
        losses, norms = [], []
        with open(path, "w") as log:
            for step in range(args.agreement_steps):
                done = trainer.step(step)
                duration = done.duration
                loss, grad_norm, ok = done.logged()
                losses.append(loss)
                norms.append(grad_norm)
                log.write(json.dumps({"run": condition, "rank": rank, "step": step,
                                      "duration_s": duration, "condition": condition,
                                      "loss": loss, "grad_norm": grad_norm}) + "\n")
        result[f"{condition}_losses"], result[f"{condition}_grad_norms"] = losses, norms
        result[f"{condition}_base_checksum_before"] = trainer.base_checksum
        result[f"{condition}_base_checksum_after"] = base_checksum(trainer.bare_model)
    say(f"[ep {ep}] agreement runs done ({args.agreement_steps} steps each)")


# ---------------------------------------------------------------- the launcher


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, argv):
    os.makedirs(args.out, exist_ok=True)
    for ep in args.ep_sizes:
        ep_dir = os.path.join(args.out, f"ep{ep}")
        for sub in ("crossover", "baseline", "all"):
            os.makedirs(os.path.join(ep_dir, sub), exist_ok=True)
            for f in os.listdir(os.path.join(ep_dir, sub)):
                if f.endswith(".jsonl"):
                    os.remove(os.path.join(ep_dir, sub, f))
        if os.path.exists(os.path.join(ep_dir, "plan.json")):
            os.remove(os.path.join(ep_dir, "plan.json"))
        if not crossover_at(args, ep):
            continue
        plan = leanstep.crossover_plan(list(crossover_conditions(args)), args.runs,
                                       args.block_steps, args.warmup,
                                       exclude_after_transition=args.exclude_after_transition,
                                       cycles=args.cycles)
        with open(os.path.join(ep_dir, "plan.json"), "w") as f:
            json.dump(plan, f, indent=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONWARNINGS="ignore")
    # The ranks get this command's arguments through the environment: on
    # torchrun's command line an option like --nproc could be taken as its own.
    env["LEANSTEP_TRAIN_ARGV"] = json.dumps(argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "leanstep.megatron.train", "--worker"]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env)
    if done.returncode != 0:
        print(f"leanstep.megatron.train: the ranks failed (exit {done.returncode})",
              file=sys.stderr)
        return done.returncode
    results = analyse(args, time.perf_counter() - start)
    if args.json:
        print(json.dumps(results))
    else:
        print(format_results(results))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


def _diffs(a, b):
    d = [abs(x - y) for x, y in zip(a, b)]
    rel = [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)]
    return {"mean_abs": sum(d) / len(d), "max_abs": max(d), "max_rel": max(rel),
            "all_finite": all(math.isfinite(v) for v in list(a) + list(b))}


def analyse(args, seconds):
    import megatron.core

    ranks = [json.load(open(os.path.join(args.out, f"results.rank{r}.json")))
             for r in range(args.nproc)]
    out = {"megatron_core_version": megatron_core_version(megatron.core),
           "python": sys.version.split()[0],
           "seconds": seconds, "settings": {k: v for k, v in vars(args).items()
                                            if k not in ("worker", "json")},
           "ep": {}, "patches": ranks[0]["report"]}
    for ep in args.ep_sizes:
        ep_dir = os.path.join(args.out, f"ep{ep}")
        per_rank = [r["ep"][str(ep)] for r in ranks]
        r0 = per_rank[0]
        e = out["ep"][str(ep)] = {
            "trainable": {r: {"params": pr["num_trainable_params"],
                              "tensors": pr["num_trainable_tensors"],
                              "names": pr["trainable_names"]} for r, pr in enumerate(per_rank)},
            "first_microbatch_hashes": {r: pr["first_microbatch_hashes"]
                                        for r, pr in enumerate(per_rank)},
        }
        if crossover_at(args, ep):
            e["plots"] = {"steps": os.path.join(ep_dir, "steps.svg"),
                          "reductions": os.path.join(ep_dir, "reductions.svg")}
            e["crossover"] = leanstep.crossover_analysis(
                [os.path.join(ep_dir, "crossover")], plan=os.path.join(ep_dir, "plan.json"),
                baseline="baseline", plot=e["plots"]["steps"],
                reductions_plot=e["plots"]["reductions"],
                title=f"megatron-core {out['megatron_core_version']}, EP {ep}: step and phases")
            plan = json.load(open(os.path.join(ep_dir, "plan.json")))
            e["design"] = {k: plan.get(k) for k in ("design", "block_steps", "cycles", "warmup",
                                                    "exclude_after_transition",
                                                    "carryover_balanced", "steps_per_run")}
            e["design"]["runs"] = len(plan["runs"])
            e["design"]["pinned_cpus"] = [r.get("pinned_cpu") for r in ranks]
            e["timed_sites"] = r0.get("timed_sites", {})
        if "audit" in args.phase_list:
            e["audit"] = {r: pr["audit"] for r, pr in enumerate(per_rank)}
        if "agreement" in args.phase_list:
            e["agreement"] = {"steps": args.agreement_steps,
                              "loss": _diffs(r0["all_losses"], r0["baseline_losses"]),
                              "grad_norm": _diffs(r0["all_grad_norms"], r0["baseline_grad_norms"])}
            e["base_unchanged"] = all(
                pr[f"{c}_base_checksum_before"] == pr[f"{c}_base_checksum_after"]
                for pr in per_rank for c in ("baseline", "all"))
            e["losses"] = {"baseline": r0["baseline_losses"], "all": r0["all_losses"]}
            e["grad_norms"] = {"baseline": r0["baseline_grad_norms"], "all": r0["all_grad_norms"]}
    return out


def group_names(names):
    """[(name with layer and expert indices as *, shape, count)] in first-seen order."""
    groups = {}
    for name, shape in names:
        key = (re.sub(r"\.(\d+)\.", ".*.", re.sub(r"\.(\d+)\.", ".*.", name)), str(shape))
        groups[key] = groups.get(key, 0) + 1
    return [(pattern, shape, n) for (pattern, shape), n in groups.items()]


def format_results(r):
    lines = [f"== leanstep.megatron.train: megatron-core {r['megatron_core_version']} "
             f"(Python {r['python']}), {r['settings']['nproc']} gloo ranks, "
             f"{r['settings']['dtype']} ({r['settings'].get('dtype_reason', 'as asked')}), "
             f"{r['seconds']:.0f} s"]
    for ep, e in r["ep"].items():
        lines.append(f"-- EP {ep}")
        xo = e.get("crossover", {})
        settings = r["settings"]
        if not xo and "crossover" in settings.get("phase_list", ()):
            at = ",".join(str(s) for s in settings.get("crossover_ep_sizes", ()))
            lines.append(f"  crossover: not run at this EP size (--crossover-ep {at})")
        if xo:
            lines.append("  step duration per condition (max over ranks, after warm-up), s:")
        for c in xo.get("conditions", []):
            lines.append(f"    {c['condition']:<9} median {c.get('median_s', float('nan')):.4f}  "
                         f"mean {c.get('mean_s', float('nan')):.4f}")
        if xo:
            lines.append("  paired same-position reductions vs baseline (geometric mean of "
                         "ratios, 95% CI over runs; positive = faster):")
        for c in xo.get("comparisons", []):
            if c.get("versus") != "baseline":
                continue
            interval = ("no interval: too few runs" if c["ci_low"] is None or c["ci_high"] is None
                        else f"[{100 * c['ci_low']:+.1f}%, {100 * c['ci_high']:+.1f}%]")
            aa = "  A/A: the baseline again, 0 in truth" if c["condition"] == AA_CONDITION else ""
            lines.append(f"    {c['condition']:<11} {100 * c['reduction']:+6.1f}%  {interval}  "
                         f"({c['independent_runs']} runs, {c['matched_positions']} matched "
                         f"positions){aa}")
        if xo:
            lines += format_design(e)
            lines += format_phases(xo, barrier=not settings.get("no_phase_barrier", False))
            for what, path in e.get("plots", {}).items():
                lines.append(f"  plot ({what}): {path}")
        if "audit" in e:
            lines.append("  audit of one iteration per condition (rank 0: aten ops (views), host "
                         "syncs, host reads, of device memory):")
        # Rank 0's audit (keys are ints here, strings once read back from results.json).
        audits = e.get("audit") or {}
        rank0 = audits.get(0, audits.get("0", {}))
        for cond, a in rank0.items():
            lines.append(f"    {cond:<9} {a['ops']:>6} ({a['view_ops']}) {a['syncs']:>4} "
                         f"{a['host_reads']:>4} {a.get('device_reads', 0):>4}")
        if rank0:
            lines.append("  reads of device memory per iteration by call site (rank 0; what a "
                         "GPU run reads, seen by leanstep.audit.DeviceMemory):")
        for cond, a in rank0.items():
            rows = a.get("device_reads_by_site", [])
            lines.append(f"    {cond}: {sum(n for n, _, _ in rows)}"
                         + ("" if rows else " (none)"))
            for n, site, what in rows:
                lines.append(f"      {n:>3}  {site}  {what}")
        ag = e.get("agreement")
        if ag:
            lines.append(f"  agreement over {ag['steps']} steps, all vs baseline: loss mean |diff| "
                     f"{ag['loss']['mean_abs']:.3g}, max {ag['loss']['max_abs']:.3g}; grad norm "
                     f"mean |diff| {ag['grad_norm']['mean_abs']:.3g}, max "
                     f"{ag['grad_norm']['max_abs']:.3g}; all finite: "
                     f"{ag['loss']['all_finite'] and ag['grad_norm']['all_finite']}")
            lines.append(f"  base weights unchanged (checksum): {e['base_unchanged']}")
        for rank, t in e["trainable"].items():
            lines.append(f"  rank {rank}: {t['params']} trainable params in {t['tensors']} tensors:")
            for pattern, shape, count in group_names(t["names"]):
                lines.append(f"    {pattern} {shape} x{count}")
        for rank, h in e["first_microbatch_hashes"].items():
            lines.append(f"  rank {rank} first microbatch hashes: {' '.join(h)}")
    lines.append("(agreement over these steps does not prove long-term convergence equivalence)")
    return "\n".join(lines)


PHASE_LABELS = {"optimizer_s": "optimizer step",
                "grad_norm_clip_s": "grad norm + clip",
                "rmsnorm_s": "RMSNorm fwd + bwd",
                "moe_permute_s": "MoE permute + unpermute"}


def half_widths(comparisons):
    return [(c["ci_high"] - c["ci_low"]) / 2 for c in comparisons
            if c.get("ci_low") is not None and c.get("ci_high") is not None]


def format_design(e):
    d = e.get("design")
    if not d:
        return []
    widths = half_widths([c for c in e["crossover"].get("comparisons", [])
                          if c.get("versus") == "baseline"])
    resolves = (f"its intervals here are +/-{100 * max(widths):.1f}% wide at most: smaller "
                "effects are within noise" if widths else "no intervals (too few runs)")
    pins = d.get("pinned_cpus") or []
    pinning = (f"ranks bound to CPUs {', '.join(str(c) for c in pins)}"
               if pins and all(c is not None for c in pins) else "ranks not bound to CPUs")
    return [f"  design: {d['design']}, {d['runs']} runs x {d['cycles']} cycle(s) of "
            f"{d['block_steps']}-step blocks after {d['warmup']} warm-up steps; carryover "
            f"balanced: {'yes' if d['carryover_balanced'] else 'no'}; {pinning}; {resolves}"]


def format_phases(xo, barrier=True):
    fields = [f for f in xo.get("fields", []) if f["field"] in PHASE_LABELS]
    if not fields:
        return []
    order = list(PHASE_LABELS)
    fields.sort(key=lambda f: order.index(f["field"]))
    lines = ["  per phase (max over ranks, summed over the step; median, paired reduction vs "
             "baseline, 95% CI over runs" + ("; the grad phase's all-reduces timed from a "
                                             "barrier, as Megatron's level-1 timers"
                                             if barrier else "") + "):"]
    for f in fields:
        medians = {c["condition"]: c.get("median_s") for c in f["conditions"]}
        base = medians.get("baseline")
        lines.append(f"    {PHASE_LABELS[f['field']]:<24} baseline "
                     + (f"{1e3 * base:8.2f} ms" if base is not None else "     n/a"))
        for c in f["comparisons"]:
            med = medians.get(c["condition"])
            interval = ("no interval" if c["ci_low"] is None or c["ci_high"] is None
                        else f"[{100 * c['ci_low']:+.1f}%, {100 * c['ci_high']:+.1f}%]")
            red = "n/a" if c.get("reduction") is None else f"{100 * c['reduction']:+6.1f}%"
            lines.append(f"      {c['condition']:<11} "
                         + (f"{1e3 * med:8.2f} ms" if med is not None else "     n/a")
                         + f"  {red}  {interval}")
    return lines


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--worker"] and "LEANSTEP_TRAIN_ARGV" in os.environ:
        argv = json.loads(os.environ["LEANSTEP_TRAIN_ARGV"]) + ["--worker"]
    warnings.filterwarnings("ignore")
    # torch says at import that this machine has no CUDA runtime: known here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    if args.worker:
        try:
            worker(args)
        except BaseException:
            print(f"rank {os.environ.get('RANK', '?')}: {traceback.format_exc()}", file=sys.stderr,
                  flush=True)
            raise
        return 0
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
