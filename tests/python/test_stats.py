"""leanstep.step_summaries / compare_runs / crossover_analysis on the example
step logs, checked against the definitions recomputed here in Python."""

import json
import os
import statistics

import pytest

import leanstep

pytestmark = pytest.mark.skipif("stats" not in leanstep.areas, reason="stats not built")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOGS = os.path.join(ROOT, "examples", "logs")


def step_durations(path, warmup):
    """Step duration = max over ranks; the first `warmup` step positions dropped."""
    by_step = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            by_step.setdefault(r["step"], []).append(r["duration_s"])
    first = min(by_step)
    return [max(v) for s, v in sorted(by_step.items()) if s - first >= warmup]


def test_summaries_match_the_definition():
    path = os.path.join(LOGS, "baseline.jsonl")
    runs = leanstep.step_summaries(path, warmup=20, window=20)["runs"]
    assert len(runs) == 1
    run = runs[0]
    durations = step_durations(path, 20)
    assert run["steps_used"] == len(durations)
    assert run["mean_s"] == pytest.approx(statistics.fmean(durations), rel=1e-12)
    assert run["median_s"] == pytest.approx(statistics.median(durations), rel=1e-12)


def test_compare_runs():
    old, new = os.path.join(LOGS, "baseline.jsonl"), os.path.join(LOGS, "fused.jsonl")
    c = leanstep.compare_runs(old, new, warmup=20, window=20)
    expected = statistics.fmean(step_durations(new, 20)) / statistics.fmean(step_durations(old, 20)) - 1
    assert c["mean_change"] == pytest.approx(expected, rel=1e-9)


def test_crossover_analysis_runs_on_the_example():
    logs = sorted(os.path.join(LOGS, "crossover", f) for f in os.listdir(os.path.join(LOGS, "crossover")))
    result = leanstep.crossover_analysis(logs, plan=os.path.join(LOGS, "crossover_plan.json"))
    assert [c["condition"] for c in result["conditions"]] == ["baseline", "rmsnorm", "grad", "rmsnorm+grad"]
    assert result["baseline"] == "baseline"
    # The example logs were generated with known effects (rmsnorm 7%, grad 12%, both 17%;
    # docs/stats.md): every comparison vs the baseline, then every other pair, each on
    # the same matched positions, and each interval holding the generated effect.
    pairs = {(c["condition"], c["versus"]): c for c in result["comparisons"]}
    assert list(pairs) == [("rmsnorm", "baseline"), ("grad", "baseline"), ("rmsnorm+grad", "baseline"),
                           ("grad", "rmsnorm"), ("rmsnorm+grad", "rmsnorm"), ("rmsnorm+grad", "grad")]
    effects = {"baseline": 0.0, "rmsnorm": 0.07, "grad": 0.12, "rmsnorm+grad": 0.17}
    for (cond, versus), c in pairs.items():
        assert c["matched_positions"] == 92
        assert c["ci_low"] <= c["reduction"] <= c["ci_high"]
        expected = 1 - (1 - effects[cond]) / (1 - effects[versus])
        assert c["ci_low"] - 0.01 <= expected <= c["ci_high"] + 0.01, (cond, versus, c, expected)
        assert c["reduction"] == pytest.approx(expected, abs=0.02)


def test_errors_are_leanstep_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": "x", "rank": 0, "step": 0, "duration_s": -1}\n')
    with pytest.raises(leanstep.Error, match="duration_s"):
        leanstep.step_summaries(str(bad))
