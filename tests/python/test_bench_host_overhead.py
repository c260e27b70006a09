"""bench/host_overhead.py runs on the installed Megatron-Core line (its peers' return
values differ between 0.16 and 0.17+): a short run of the cases that call Megatron-Core
and leanstep.megatron, its JSON rows read back. No timing is checked here; the benchmark
measures, the test only runs it. Megatron-Core is looked for, not imported, in this
process: importing it imports triton, which the Triton-interpreter tests later in the
session need unimported."""

import collections
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_the_megatron_cases_run_and_give_a_row_per_variant():
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_overhead.py"), "--quick", "--only", "moe,grad",
         "--json"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    variants = {(r["bench"], r["case"], r["variant"]) for r in rows}
    assert ("moe", "permute+unpermute fwd+bwd T128 H256 E8 top2", "megatron moe_utils") in variants
    assert ("moe", "permute+unpermute fwd+bwd T128 H256 E8 top2", "leanstep.torch") in variants
    job = "patched job calls fwd+bwd T64 H64 E16 top8"
    assert {v for b, c, v in variants if c == job} == {
        "megatron moe_utils", "leanstep patch, auto (default)", "leanstep patch, all leanstep"}
    for name in ("get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"):
        case = f"{name} 3168 fresh views"
        assert {v for b, c, v in variants if c == case} == {
            "megatron (no TE/apex)", "leanstep patch, CPU kernels",
            "leanstep patch, torch-op backend"}
    # Rounds come in whole Williams squares: two of three rows for three variants
    # (an odd count), one of two rows for two; --quick asks for 3.
    per_case = collections.Counter(c for _, c, _ in variants)
    for r in rows:
        assert r["rounds"] == {2: 4, 3: 6}[per_case[r["case"]]], r
    for r in rows:
        assert math.isfinite(r["median_us"]) and r["median_us"] > 0, r
        if "x_peer" in r:
            assert r["x_peer_low"] <= r["x_peer"] <= r["x_peer_high"], r
