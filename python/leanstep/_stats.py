"""Step-time statistics over step logs (see docs/stats.md): the same results
as ``leanstep steps summarize|compare`` and ``leanstep crossover analyze --json``."""

import json
import os

from . import _leanstep

__all__ = ["step_summaries", "compare_runs", "crossover_analysis", "crossover_plan",
           "crossover_steps"]


def _paths(paths):
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return [os.fspath(p) for p in paths]


def step_summaries(paths, warmup=20, window=20):
    """Per run: step duration = max over ranks; after warm-up: count, mean,
    median, min, max, window means. Returns ``{"runs": [...]}``."""
    return json.loads(_leanstep.stats_summarize_json(_paths(paths), int(warmup), int(window)))


def compare_runs(old_paths, new_paths, warmup=20, window=20):
    """Compares two runs (one each): timing changes and loss/grad-norm agreement."""
    return json.loads(_leanstep.stats_compare_json(_paths(old_paths), _paths(new_paths),
                                                   int(warmup), int(window)))


def crossover_analysis(paths, plan=None, baseline="", warmup=None, plot=None,
                       reductions_plot=None, title=""):
    """Counterbalanced crossover analysis of step logs (paired same-position
    ratios; 95% intervals over runs, the independent units: docs/stats.md).
    A comparison resting on fewer than 3 runs has ``ci_low`` / ``ci_high``
    None. Every other numeric field of the logs (per-phase durations) is
    reduced like the step (``fields``). ``plot``: an SVG of step duration per
    run, coloured by condition; ``reductions_plot``: an SVG of the reductions
    vs the baseline with their intervals, the step's and every field's."""
    return json.loads(_leanstep.stats_crossover_json(
        _paths(paths), os.fspath(plan) if plan else "", baseline,
        None if warmup is None else int(warmup), os.fspath(plot) if plot else "",
        os.fspath(reductions_plot) if reductions_plot else "", str(title)))


def crossover_plan(conditions, runs, block_steps, warmup, allocations=(),
                   exclude_after_transition=2, cycles=1):
    """A counterbalanced crossover plan (as ``leanstep crossover plan --json``):
    every run holds every condition ``cycles`` times as a block; Williams
    squares when the run count allows. Write it with ``json.dump`` and pass its
    path to :func:`crossover_analysis`."""
    return json.loads(_leanstep.stats_crossover_plan_json(
        [str(c) for c in conditions], int(runs), int(block_steps), int(warmup),
        [str(a) for a in allocations], int(exclude_after_transition), int(cycles)))


def crossover_steps(plan, run_index):
    """[(condition, block)] of every step of one run of a :func:`crossover_plan`
    plan: the warm-up steps run block 0's condition."""
    run = plan["runs"][run_index]
    steps = [(run["blocks"][0], 0)] * plan["warmup"]
    for block, condition in enumerate(run["blocks"]):
        steps += [(condition, block)] * plan["block_steps"]
    return steps
