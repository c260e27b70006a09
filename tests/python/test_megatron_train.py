"""The main job on the real engine, short: Megatron-Core MoE-LoRA training on
2 gloo CPU ranks with and without leanstep (python -m leanstep.megatron.train),
on the megatron-core of this interpreter (0.16.1 on Python 3.11, 0.19.2 on 3.12).

Tolerances. fp32: leanstep's RMSNorm forward is torch's own (bit-identical),
its dx and the gradient norm differ from torch's in the last bits, and Adam's
first updates are nearly scale-invariant, so the first two losses are
bit-identical and later ones drift by rounding only (1e-6 relative over 10
steps). bf16: the same, with bf16 rounding of activations: 2e-3 relative.
Data parallelism: 2 ranks x 1 microbatch and 1 rank x 2 microbatches compute
the same mean gradient, summed in another order: 1e-5 relative.
"""

import copy
import json
import os
import subprocess
import sys

import pytest

import leanstep

pytest.importorskip("megatron.core")

from leanstep.megatron import train as main_job  # noqa: E402

SMALL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--experts", "4",
         "--moe-ffn", "64", "--seq", "32", "--micro-batch", "2"]


def job_env():
    """This environment, with the leanstep this process imported first on the path."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(leanstep.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def run_job(tmp_path, *extra, name="job"):
    out = tmp_path / name
    env = job_env()
    cmd = [sys.executable, "-m", "leanstep.megatron.train", *SMALL, "--out", str(out), "--json",
           *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def test_fp32_patched_equals_unpatched(tmp_path):
    r = run_job(tmp_path, "--ep", "1", "--dtype", "fp32", "--phases", "agreement",
                "--agreement-steps", "10")
    e = r["ep"]["1"]
    base, fast = e["losses"]["baseline"], e["losses"]["all"]
    assert len(base) == len(fast) == 10
    assert fast[:2] == base[:2], (fast[:2], base[:2])  # bit-identical
    assert max(rel(a, b) for a, b in zip(fast, base)) <= 1e-6, (fast, base)
    assert max(rel(a, b) for a, b in zip(e["grad_norms"]["all"], e["grad_norms"]["baseline"])) \
        <= 1e-5
    assert e["agreement"]["loss"]["all_finite"]
    # LoRA only: the frozen base is bit-unchanged, every trainable tensor is an adapter.
    assert e["base_unchanged"] is True
    names = [n for n, _ in e["trainable"]["0"]["names"]]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # The patches ran (the "all" condition), and each was counted.
    calls = r["patches"]["calls"]
    assert calls["get_grad_norm_fp32"]["leanstep"] > 0
    assert calls["WrappedTorchNorm"]["leanstep"] > 0


def test_bf16_within_its_bound(tmp_path):
    r = run_job(tmp_path, "--ep", "1", "--dtype", "bf16", "--phases", "agreement",
                "--agreement-steps", "6")
    e = r["ep"]["1"]
    assert max(rel(a, b) for a, b in zip(e["losses"]["all"], e["losses"]["baseline"])) <= 2e-3


def test_two_ranks_equal_one_rank_on_the_combined_batch_and_need_the_grad_sync(tmp_path):
    common = ["--ep", "1", "--dtype", "fp32", "--phases", "agreement", "--agreement-steps", "3"]
    two = run_job(tmp_path, *common, "--nproc", "2", "--microbatches", "1", name="two")
    one = run_job(tmp_path, *common, "--nproc", "1", "--microbatches", "2", name="one")
    unsynced = run_job(tmp_path, *common, "--nproc", "2", "--microbatches", "1",
                       "--no-grad-sync", name="unsynced")
    a = two["ep"]["1"]["losses"]["baseline"]
    b = one["ep"]["1"]["losses"]["baseline"]
    c = unsynced["ep"]["1"]["losses"]["baseline"]
    assert max(rel(x, y) for x, y in zip(a, b)) <= 1e-5, (a, b)
    # Without finalize_model_grads_func nothing reduces the gradients: the
    # ranks step apart and the run leaves the one-rank reference.
    assert max(rel(x, y) for x, y in zip(c, b)) > 1e-4, (c, b)
    # Each rank read its own data.
    hashes = two["ep"]["1"]["first_microbatch_hashes"]
    assert hashes["0"] != hashes["1"]


@pytest.fixture(scope="module")
def quick_crossover(tmp_path_factory):
    """(folder, result) of a --quick job with the crossover at EP 1 and 2."""
    tmp_path = tmp_path_factory.mktemp("quick_crossover")
    return tmp_path, run_job(tmp_path, "--quick", "--ep", "1,2", "--crossover-ep", "1,2")


def test_quick_crossover_at_ep_1_and_2(quick_crossover):
    tmp_path, r = quick_crossover
    for ep in ("1", "2"):
        e = r["ep"][ep]
        versus = {c["condition"] for c in e["crossover"]["comparisons"]
                  if c["versus"] == "baseline"}
        assert versus == {"rmsnorm", "grad", "all", "baseline-aa"}
        audit = e["audit"]["0"]
        assert set(audit) == {"baseline", "rmsnorm", "grad", "all"}
        assert all(a["ops"] > 0 for a in audit.values())
        # leanstep removes aten ops from the step (fewer launches on a device).
        assert audit["all"]["ops"] < audit["baseline"]["ops"]
        assert e["agreement"]["loss"]["all_finite"] and e["base_unchanged"]
        # Every step record carries the phases; the analysis reduces each of them.
        fields = {f["field"]: f for f in e["crossover"]["fields"]}
        assert {"optimizer_s", "grad_norm_clip_s", "rmsnorm_s", "moe_permute_s"} <= set(fields)

        def baseline_median(name):
            f = fields[name]
            return next(c["median_s"] for c in f["conditions"] if c["condition"] == "baseline")

        step = next(c["median_s"] for c in e["crossover"]["conditions"]
                    if c["condition"] == "baseline")
        assert 0 < baseline_median("grad_norm_clip_s") < baseline_median("optimizer_s") < step
        assert 0 < baseline_median("rmsnorm_s") < step and 0 < baseline_median("moe_permute_s") < step
        assert {c["condition"] for c in fields["optimizer_s"]["comparisons"]} == \
            {"rmsnorm", "grad", "all", "baseline-aa"}
        # What was timed, by name: Megatron's call sites and the model's norms.
        sites = e["timed_sites"]
        assert any(s.endswith("optimizer.get_grad_norm_fp32") for s in sites["grad_norm_clip_s"])
        assert any(s.endswith("token_dispatcher.permute") for s in sites["moe_permute_s"])
        assert any("layernorm" in s for s in sites["rmsnorm_s"])
        # The pictures: step duration per run, and the reductions with their intervals.
        for path in e["plots"].values():
            with open(path) as f:
                svg = f.read()
            assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        with open(e["plots"]["reductions"]) as f:
            assert "moe_permute_s" in f.read()
    text = main_job.format_results(r)
    assert "per phase" in text and "grad norm + clip" in text and "MoE permute" in text
    assert "design: cyclic latin square, 5 runs" in text  # --quick: one square of the 5
    assert r["settings"]["dtype"] in ("fp32", "bf16") and r["settings"]["dtype_reason"]
    # Expert adapters are split over the EP ranks: fewer trainable per rank at EP 2.
    assert r["ep"]["2"]["trainable"]["0"]["params"] < r["ep"]["1"]["trainable"]["0"]["params"]
    logs = sorted(os.listdir(tmp_path / "job" / "ep1" / "crossover"))
    assert logs == ["steps.rank0.jsonl", "steps.rank1.jsonl"]


def test_aa_condition_is_the_baseline_again_with_an_interval_over_runs(quick_crossover):
    # On the quick crossover's run (one job for both tests: each costs tens of seconds).
    tmp_path, r = quick_crossover
    xo = r["ep"]["1"]["crossover"]
    assert [c["condition"] for c in xo["conditions"]] == ["baseline", "rmsnorm", "grad", "all",
                                                          "baseline-aa"]
    aa = next(c for c in xo["comparisons"]
              if c["condition"] == "baseline-aa" and c["versus"] == "baseline")
    assert aa["independent_runs"] == 5 and aa["ci_low"] < aa["ci_high"]
    plan = json.load(open(tmp_path / "job" / "ep1" / "plan.json"))
    assert len(plan["runs"]) == 5 and all(len(run["blocks"]) == 5 for run in plan["runs"])
    text = main_job.format_results(r)
    assert "baseline-aa" in text and "A/A: the baseline again" in text


def test_the_crossover_runs_at_the_first_ep_size_unless_told(quick_crossover):
    # The defaults: the A/A condition is on, and the crossover runs at the first EP size
    # only (the worker asks crossover_at for each EP size).
    ap = main_job.build_parser()
    args = ap.parse_args(["--quick", "--ep", "1,2", "--dtype", "fp32"])
    main_job.check_args(ap, args)
    assert [main_job.crossover_at(args, ep) for ep in (1, 2)] == [True, False]
    assert main_job.crossover_conditions(args)[-1] == "baseline-aa"
    # How a result without a crossover at an EP size reads.
    _, r = quick_crossover
    r = copy.deepcopy(r)
    del r["ep"]["2"]["crossover"]
    r["settings"]["crossover_ep_sizes"] = [1]
    text = main_job.format_results(r)
    assert "-- EP 2\n  crossover: not run at this EP size (--crossover-ep 1)" in text


def test_the_launcher_plans_the_crossover_at_the_first_ep_size_only(tmp_path, monkeypatch):
    # The launcher in this process, torchrun replaced by a run that fails: what it wrote
    # before starting the ranks (a plan where the crossover runs, none elsewhere) and the
    # command and arguments the ranks would get.
    started = []

    def ranks_fail(cmd, env=None, **kwargs):
        started.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(subprocess, "run", ranks_fail)
    out = tmp_path / "job"
    argv = ["--quick", "--ep", "1,2", "--dtype", "fp32", "--out", str(out)]
    assert main_job.main(argv) == 1
    ((cmd, env),) = started
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    assert cmd[-3:] == ["-m", "leanstep.megatron.train", "--worker"]
    assert json.loads(env["LEANSTEP_TRAIN_ARGV"]) == argv
    plan = json.load(open(out / "ep1" / "plan.json"))
    assert plan["conditions"][-1] == "baseline-aa" and len(plan["runs"]) == 5
    assert (out / "ep2" / "crossover").is_dir() and not (out / "ep2" / "plan.json").exists()


@pytest.mark.parametrize("argv, conditions, runs, cycles, crossover_eps", [
    ([], 5, 10, 5, [1]),                        # the main job's design: A/A on, EP 1
    (["--no-aa"], 4, 8, 4, [1]),
    (["--ep", "2,1"], 5, 10, 5, [2]),           # the first size given
    (["--crossover-ep", "1,2"], 5, 10, 5, [1, 2]),
    (["--cycles", "7"], 5, 10, 7, [1]),         # balanced exactly, and longer
    # make demo's host-bound design: baseline, all and the A/A, 12 runs of 3 cycles
    (["--conditions", "all,baseline", "--runs", "12", "--cycles", "3"], 3, 12, 3, [1]),
])
def test_default_design_is_balanced(argv, conditions, runs, cycles, crossover_eps):
    ap = main_job.build_parser()
    args = ap.parse_args(argv + ["--dtype", "fp32"])
    main_job.check_args(ap, args)
    assert (len(main_job.crossover_conditions(args)), args.runs, args.cycles,
            args.crossover_ep_sizes) == (conditions, runs, cycles, crossover_eps)
    plan = leanstep.crossover_plan(list(main_job.crossover_conditions(args)), args.runs,
                                   args.block_steps, args.warmup, cycles=args.cycles,
                                   exclude_after_transition=args.exclude_after_transition)
    # Transitions: every condition follows every other equally often (3 conditions, any
    # cycles; 4 conditions, 4 cycles; 5 conditions, 7 cycles), or within one of the mean
    # (5 conditions, 5 cycles: 11 to 13 times).
    follows = {}
    for run in plan["runs"]:
        for a, b in zip(run["blocks"], run["blocks"][1:]):
            follows[a, b] = follows.get((a, b), 0) + 1
    assert len(follows) == conditions * (conditions - 1)
    assert plan["carryover_balanced"] == (len(set(follows.values())) == 1)
    assert plan["carryover_balanced"] == (conditions in (3, 4) or cycles == 7)
    mean = sum(follows.values()) / len(follows)
    assert all(abs(n - mean) <= 1 for n in follows.values()), follows


BAD_ARGUMENTS = [(["--ep", "3"], "argument --ep: each size must be >= 1 and divide"),
                 (["--no-aa", "--runs", "6"], "argument --runs: must be a multiple of 4"),
                 (["--runs", "4"], "argument --runs: must be a multiple of 5"),
                 (["--crossover-ep", "2", "--ep", "1"],
                  "argument --crossover-ep: each size must be one of --ep"),
                 (["--topk", "9"], "argument --topk: must be <= --experts"),
                 (["--phases", "nope"], "argument --phases: must name"),
                 (["--conditions", "all"], "argument --conditions: must name baseline"),
                 (["--conditions", "baseline,fast"], "argument --conditions: must name baseline"),
                 (["--conditions", "baseline,all,all"],
                  "argument --conditions: must name baseline"),
                 (["--conditions", "baseline,all", "--runs", "10"],
                  "argument --runs: must be a multiple of 3")]


@pytest.mark.parametrize("args,message", BAD_ARGUMENTS)
def test_bad_arguments_are_named_before_any_rank_starts(args, message, tmp_path, monkeypatch,
                                                        capsys):
    # In this process (a fresh interpreter per case cost 2 s each): the job's own main,
    # with anything that would start a rank replaced by a failure.
    def no_rank(*a, **k):
        raise AssertionError(f"a rank was started for {args}")
    monkeypatch.setattr(main_job, "launch", no_rank)
    monkeypatch.setattr(main_job, "worker", no_rank)
    monkeypatch.setattr(subprocess, "run", no_rank)
    with pytest.raises(SystemExit) as exited:
        main_job.main([*args, "--out", str(tmp_path / "x")])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_bad_arguments_through_the_command_line(tmp_path):
    # The command users run: exit status 2 and the message, before torchrun starts.
    args, message = BAD_ARGUMENTS[0]
    done = subprocess.run([sys.executable, "-m", "leanstep.megatron.train", *args,
                           "--out", str(tmp_path / "x")], env=job_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
    assert not (tmp_path / "x").exists()


def test_the_host_bound_config_sets_the_shape_and_explicit_flags_win():
    ap = main_job.build_parser()
    args = ap.parse_args(["--config", "host-bound", "--hidden", "256", "--dtype", "fp32"])
    main_job.check_args(ap, args)
    shape = {k: getattr(args, k) for k in main_job.CONFIGS["host-bound"]}
    assert shape == dict(main_job.CONFIGS["host-bound"], hidden=256)  # given: kept
    args = ap.parse_args(["--dtype", "fp32"])
    main_job.check_args(ap, args)
    assert {k: getattr(args, k) for k in main_job.CONFIGS["default"]} == \
        main_job.CONFIGS["default"]
    with pytest.raises(SystemExit):
        ap.parse_args(["--config", "huge"])
