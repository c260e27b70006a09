"""The Hugging Face example job (python -m leanstep.transformers.train), short:
its crossover holds every condition, the three phases are timed and analysed,
the pictures are written, all agrees with baseline (1e-5 relative: the bound
of test_transformers_trainer.py), and bad arguments are refused by name."""

import json

import pytest

import leanstep

pytest.importorskip("transformers")
pytest.importorskip("peft")

from leanstep.transformers import train  # noqa: E402

pytestmark = pytest.mark.skipif(not {"rmsnorm", "grad", "moe", "stats"} <= set(leanstep.areas),
                                reason="an area the job needs is not built")


def test_short_job_runs_every_condition_and_agrees(tmp_path, capsys):
    out = tmp_path / "job"
    assert train.main(["--runs", "5", "--block-steps", "3", "--warmup", "1", "--layers", "2",
                       "--agreement-steps", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "paired same-position reductions vs baseline" in printed
    results = json.loads((out / "results.json").read_text())
    xo = results["crossover"]
    assert sorted(c["condition"] for c in xo["conditions"]) == sorted(train.CONDITIONS)
    versus = {c["condition"] for c in xo["comparisons"] if c.get("versus") == "baseline"}
    assert versus == set(train.CONDITIONS) - {"baseline"}
    assert {f["field"] for f in xo["fields"]} >= set(train.PHASE_LABELS)
    for path in results["plots"].values():
        assert open(path).read().lstrip().startswith("<")  # an SVG
    assert "9 RMSNorm modules swapped" in results["report"]
    assert "experts: 'leanstep'" in results["report"]
    agreement = results["agreement"]
    assert agreement["loss_max_rel"] <= 1e-5 and agreement["grad_norm_max_rel"] <= 1e-5
    steps = [json.loads(line) for line in
             (out / "crossover" / "steps.rank0.jsonl").read_text().splitlines()]
    assert len(steps) == 5 * (1 + 5 * 3)
    assert all(s["rmsnorm_s"] > 0 and s["experts_s"] > 0 and s["clip_s"] > 0 for s in steps)


@pytest.mark.parametrize("argv,message", [
    (["--runs", "3"], "argument --runs must be a multiple of the 5 conditions"),
    (["--block-steps", "2"], "argument --exclude-after-transition must be in [0, --block-steps"),
    (["--topk", "9", "--experts", "8"], "argument --topk must be <= --experts (8) (got 9)"),
    (["--layers", "0"], "argument --layers must be >= 1 (got 0)"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        train.main(argv)
    assert message in capsys.readouterr().err
