"""The Hugging Face example job: LoRA training of a Qwen3-MoE (the
Qwen3-30B-A3B architecture at tiny widths: its eps, rope, q/k norms and expert
routing; random weights, no download) with the HF Trainer on the CPU, and an
honest crossover of what leanstep changes there.

    python -m leanstep.transformers.train [--runs 5] [--out build/hf-train] [--json]

Conditions, switched at block boundaries inside each run (a counterbalanced
crossover: every run holds every condition; leanstep.crossover_analysis gives
paired reductions with 95% intervals over runs):

- ``baseline``: the model's own RMSNorm forward, torch's clip_grad_norm_,
  Transformers' "grouped_mm" experts;
- ``rmsnorm``: leanstep's RMSNorm swap (frozen path under LoRA);
- ``clip``: leanstep's clip_grad_norm_ under torch.nn.utils' names;
- ``experts``: the "leanstep" experts backend;
- ``all``: the three together (what :class:`leanstep.transformers.Callback` does).

Per step it records the step's wall time (the Trainer's on_step_begin to
on_step_end: forward, backward, clip, optimizer, zero_grad) and three phases
timed at their call sites: RMSNorm forward + backward, the Trainer's
clip_grad_norm_ (accelerate's), the experts' forward + backward. Then a short
agreement check: ``all`` against ``baseline`` from the same start, losses and
grad norms over the same steps. Pictures: steps.svg (step time per run, by
condition) and reductions.svg (reductions with their intervals).
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings

import torch

import leanstep

from .. import _phase_timers, _torch_clip
from .. import torch as lt
from . import apply, undo
from . import experts as _experts

CONDITIONS = ("baseline", "rmsnorm", "clip", "experts", "all")
SWITCHES = {"baseline": (), "rmsnorm": ("rmsnorm",), "clip": ("clip",),
            "experts": ("experts",), "all": ("rmsnorm", "clip", "experts")}
PHASE_LABELS = {"rmsnorm_s": "RMSNorm fwd + bwd", "clip_s": "clip_grad_norm_",
                "experts_s": "experts fwd + bwd"}


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m leanstep.transformers.train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--moe-ffn", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--runs", type=int, default=5,
                    help="crossover runs, a multiple of the 5 conditions (the independent units)")
    ap.add_argument("--block-steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--exclude-after-transition", type=int, default=2,
                    help="steps after each condition change left out of the analysis")
    ap.add_argument("--agreement-steps", type=int, default=6)
    ap.add_argument("--out", default=os.path.join("build", "hf-train"))
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    return ap


def check_args(ap, args):
    for name in ("layers", "hidden", "experts", "topk", "moe_ffn", "seq", "batch", "lora_rank",
                 "runs", "block_steps", "agreement_steps"):
        value = getattr(args, name)
        if value < 1:
            ap.error(f"argument --{name.replace('_', '-')} must be >= 1 (got {value})")
    if args.warmup < 0:
        ap.error(f"argument --warmup must be >= 0 (got {args.warmup})")
    if args.runs % len(CONDITIONS):
        ap.error(f"argument --runs must be a multiple of the {len(CONDITIONS)} conditions, so "
                 f"that each holds every block position equally often (got {args.runs})")
    if not 0 <= args.exclude_after_transition < args.block_steps:
        ap.error(f"argument --exclude-after-transition must be in [0, --block-steps = "
                 f"{args.block_steps}) (got {args.exclude_after_transition})")
    if args.topk > args.experts:
        ap.error(f"argument --topk must be <= --experts ({args.experts}) (got {args.topk})")
    if args.hidden % 4:
        ap.error(f"argument --hidden must be a multiple of 4, the heads (got {args.hidden})")


def build_model(args, seed=0):
    """A Qwen3-MoE with PEFT LoRA (attention projections), as the seed's
    Qwen3-30B-A3B config has it (eps 1e-6, rope theta 1e6, normalised top-k),
    at the widths asked."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = tf.Qwen3MoeConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        moe_intermediate_size=args.moe_ffn, num_experts=args.experts,
        num_experts_per_tok=args.topk, num_hidden_layers=args.layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=args.hidden // 4, rms_norm_eps=1e-6,
        rope_theta=1e6, norm_topk_prob=True, max_position_embeddings=max(256, args.seq))
    model = tf.Qwen3MoeForCausalLM(config).to(getattr(torch, args.dtype))
    return get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                            target_modules=["q_proj", "k_proj", "v_proj",
                                                            "o_proj"]))


class Corpus(torch.utils.data.Dataset):
    def __init__(self, rows, seq, seed=7):
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 256, (rows, seq), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Timers(_phase_timers.PhaseTimers):
    """The HF Trainer's call sites: its clip (accelerate's clip_grad_norm_, over
    whatever runs under it), every RMSNorm module, every experts module."""

    PHASES = ("rmsnorm_s", "clip_s", "experts_s")

    def __enter__(self):
        import accelerate

        self._wrap(accelerate.Accelerator, "clip_grad_norm_", "clip_s", False,
                   "accelerate.Accelerator.clip_grad_norm_")
        self._wrap_norms(self.model)
        for name, module in self.model.named_modules():
            if _experts.is_experts_module(module):
                self._wrap_instance(module, "experts_s", name)
        return self


class Conditions:
    """Switches the three parts on and off at block boundaries: the swapped
    norms' ``enabled``, leanstep's clip under torch.nn.utils, the experts
    implementation."""

    def __init__(self, model):
        self.model = model
        self.base = model.get_base_model()
        self.on = set()
        report = apply(model)
        self.report = report
        self.grouped = report.experts[1] if report.experts else None
        for module in model.modules():
            if isinstance(module, lt.RMSNorm):
                module.enabled = self._rmsnorm_on
        self.set("baseline")

    def _rmsnorm_on(self):
        return "rmsnorm" in self.on

    def set(self, condition):
        wanted = set(SWITCHES[condition])
        if ("clip" in wanted) != ("clip" in self.on):
            _torch_clip.install() if "clip" in wanted else _torch_clip.uninstall()
        if self.grouped is not None and ("experts" in wanted) != ("experts" in self.on):
            self.base.set_experts_implementation(
                _experts.NAME if "experts" in wanted else self.grouped)
        self.on = wanted

    def close(self):
        if "clip" in self.on:
            _torch_clip.uninstall()
        self.on = set()
        undo(self.model)


def trainer_for(args, model, steps, callback, out):
    import transformers as tf

    targs = tf.TrainingArguments(
        output_dir=out, per_device_train_batch_size=args.batch, max_steps=steps,
        learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, data_seed=0, disable_tqdm=True, dataloader_num_workers=0)
    trainer = tf.Trainer(model=model, args=targs,
                         train_dataset=Corpus(steps * args.batch, args.seq), callbacks=[callback])
    trainer.remove_callback(tf.trainer_callback.PrinterCallback)  # the job prints its own table
    return trainer


def run_crossover(args, plan, log_path, say):
    import transformers as tf

    class StepLog(tf.TrainerCallback):
        def __init__(self, steps, run, conditions, timers, log):
            self.steps, self.run, self.conditions = steps, run, conditions
            self.timers, self.log, self.start = timers, log, None

        def on_step_begin(self, targs, state, control, **kwargs):
            condition, _ = self.steps[state.global_step]
            self.conditions.set(condition)
            self.timers.reset()
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kwargs):
            duration = time.perf_counter() - self.start
            condition, block = self.steps[state.global_step - 1]
            record = {"run": self.run["run"], "rank": 0, "step": state.global_step - 1,
                      "duration_s": duration, "condition": condition, "block": block,
                      "allocation": self.run["allocation"], **self.timers.totals()}
            self.log.write(json.dumps(record) + "\n")

    report = lora_tensors = None
    with open(log_path, "w") as log:
        for run_index, run in enumerate(plan["runs"]):
            steps = leanstep.crossover_steps(plan, run_index)
            model = build_model(args, seed=run_index)
            lora_tensors = sum(1 for p in model.parameters() if p.requires_grad)
            conditions = Conditions(model)
            report = conditions.report
            try:
                with Timers(model) as timers, tempfile.TemporaryDirectory() as out:
                    callback = StepLog(steps, run, conditions, timers, log)
                    trainer_for(args, model, len(steps), callback, out).train()
            finally:
                conditions.close()
            log.flush()
            say(f"{run['run']}: {len(steps)} steps, blocks {' '.join(run['blocks'])}")
    return report, lora_tensors


def agreement(args):
    """Losses and grad norms of ``all`` against ``baseline`` over the same
    steps from the same start."""
    import transformers as tf

    class Fixed(tf.TrainerCallback):
        def __init__(self, conditions, condition):
            self.conditions, self.condition = conditions, condition

        def on_train_begin(self, targs, state, control, **kwargs):
            self.conditions.set(self.condition)

    logged = {}
    for condition in ("baseline", "all"):
        model = build_model(args, seed=100)
        conditions = Conditions(model)
        try:
            with tempfile.TemporaryDirectory() as out:
                trainer = trainer_for(args, model, args.agreement_steps,
                                      Fixed(conditions, condition), out)
                trainer.train()
        finally:
            conditions.close()
        logged[condition] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history
                             if "loss" in h]

    def rel(i):
        return max(abs(a[i] - b[i]) / max(abs(b[i]), 1e-30)
                   for a, b in zip(logged["all"], logged["baseline"]))

    return {"steps": args.agreement_steps, "loss_max_rel": rel(0), "grad_norm_max_rel": rel(1),
            "losses": logged}


def interval(comparison):
    low, high = comparison.get("ci_low"), comparison.get("ci_high")
    return "no interval" if low is None or high is None else f"[{100 * low:+.1f}%, {100 * high:+.1f}%]"


def verdict(comparison):
    low, high = comparison.get("ci_low"), comparison.get("ci_high")
    if low is None or high is None:
        return "no interval (too few runs)"
    if low > 0:
        return "faster (the interval excludes 0)"
    if high < 0:
        return "slower (the interval excludes 0)"
    return "within noise (the interval holds 0)"


def format_results(r):
    xo = r["crossover"]
    lines = [f"== leanstep.transformers.train: transformers {r['versions']['transformers']}, "
             f"peft {r['versions']['peft']}, torch {r['versions']['torch']}, {r['seconds']:.0f} s",
             f"  model: Qwen3-MoE, {r['settings']['layers']} layers, hidden "
             f"{r['settings']['hidden']}, {r['settings']['experts']} experts top-"
             f"{r['settings']['topk']}, {r['settings']['dtype']}, LoRA r "
             f"{r['settings']['lora_rank']} on q/k/v/o ({r['lora_tensors']} tensors); batch "
             f"{r['settings']['batch']} x {r['settings']['seq']} tokens",
             f"  {r['report']}".replace("\n", "\n  "),
             "  step duration per condition (after warm-up), s:"]
    lines += [f"    {c['condition']:<9} median {c.get('median_s', math.nan):.4f}"
              for c in xo.get("conditions", [])]
    lines.append("  paired same-position reductions vs baseline (geometric mean of ratios, "
                 "95% CI over runs; positive = faster):")
    lines += [f"    {c['condition']:<9} {100 * c['reduction']:+6.1f}%  {interval(c)}  {verdict(c)}"
              for c in xo.get("comparisons", []) if c.get("versus") == "baseline"]
    fields = [f for f in xo.get("fields", []) if f["field"] in PHASE_LABELS]
    if fields:
        lines.append("  per phase (summed over the step; median, paired reduction vs baseline, "
                     "95% CI over runs):")
    for f in sorted(fields, key=lambda f: list(PHASE_LABELS).index(f["field"])):
        medians = {c["condition"]: c.get("median_s") for c in f["conditions"]}
        lines.append(f"    {PHASE_LABELS[f['field']]:<20} baseline "
                     f"{1e3 * (medians.get('baseline') or math.nan):8.2f} ms")
        for c in f["comparisons"]:
            if c.get("versus", "baseline") != "baseline" or c.get("reduction") is None:
                continue
            median = medians.get(c["condition"]) or math.nan
            lines.append(f"      {c['condition']:<9} {1e3 * median:8.2f} ms  "
                         f"{100 * c['reduction']:+6.1f}%  {interval(c)}")
    ag = r["agreement"]
    lines.append(f"  agreement over {ag['steps']} steps, all vs baseline: loss max relative "
                 f"difference {ag['loss_max_rel']:.2e}, grad norm {ag['grad_norm_max_rel']:.2e}")
    for what, path in r["plots"].items():
        lines.append(f"  plot ({what}): {path}")
    return "\n".join(lines)


def main(argv=None):
    warnings.filterwarnings("ignore")
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    import peft
    import transformers

    torch.set_num_threads(1)
    leanstep.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    say = (lambda msg: print(msg, file=sys.stderr, flush=True))
    started = time.perf_counter()
    plan = leanstep.crossover_plan(list(CONDITIONS), args.runs, args.block_steps, args.warmup,
                                   exclude_after_transition=args.exclude_after_transition)
    plan_path = os.path.join(args.out, "plan.json")
    with open(plan_path, "w") as f:
        json.dump(plan, f, indent=1)
    log_dir = os.path.join(args.out, "crossover")
    os.makedirs(log_dir, exist_ok=True)
    report, lora_tensors = run_crossover(args, plan, os.path.join(log_dir, "steps.rank0.jsonl"),
                                         say)
    plots = {"steps": os.path.join(args.out, "steps.svg"),
             "reductions": os.path.join(args.out, "reductions.svg")}
    crossover = leanstep.crossover_analysis(
        [log_dir], plan=plan_path, baseline="baseline", plot=plots["steps"],
        reductions_plot=plots["reductions"],
        title=f"HF Trainer, Qwen3-MoE LoRA, transformers {transformers.__version__}: "
              f"step and phases")
    results = {"versions": {"transformers": transformers.__version__, "peft": peft.__version__,
                            "torch": torch.__version__, "leanstep": leanstep.__version__},
               "settings": vars(args), "lora_tensors": lora_tensors, "report": str(report),
               "crossover": crossover, "agreement": agreement(args), "plots": plots,
               "seconds": time.perf_counter() - started}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results) if args.json else format_results(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
