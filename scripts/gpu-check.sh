#!/usr/bin/env bash
# The accelerator check of leanstep's Triton kernels: one script, at most 8 minutes,
# installs nothing.
#
#   0. the host cost of a launch and of a sync (1000 tiny launches, 200 .item() reads), printed
#      as the host-cost model's flags: python -m leanstep.hostcost --launch-us X --sync-us Y;
#   0b. bench/gpu_step.py: the sync-free optimizer step's masked Adam update on the device
#      against torch's AdamW, fp32 and bf16 parameters (skips exact, at most 1 ulp, no host
#      sync in a step);
#   1. the Triton tests natively: LEANSTEP_TEST_DEVICE=cuda pytest tests/python/test_triton_*.py
#      and the conformance harness's Triton cases (tests/python/test_conformance.py -k triton:
#      the values of every op on its case list) (the Triton side on the GPU, compiled; the C++
#      path and the float64 oracle on the CPU);
#   2. bench/gpu_check.py: norm + clip on the Qwen3-Omni LoRA layout (leanstep Triton, the
#      torch-op backend, torch clip_grad_norm_ foreach, Megatron-Core), frozen RMSNorm
#      [8192, 2048] bf16 (vs torch.nn.functional.rms_norm), MoE permute / unpermute
#      T 4096 E 128 k 8 H 2048 (vs Megatron-Core): ms, launches, syncs, share of the copy
#      bandwidth measured in the same run;
#   3. bench/host_overhead.py --device cuda: leanstep's host time per call at the main job's
#      sizes beside its peers, on the Triton kernels and (LEANSTEP_TRITON=off) on the torch-op
#      backend (the MoE and grad cases need megatron-core; without it, RMSNorm only), in
#      what is left of the budget.
#
# Usage: scripts/gpu-check.sh [--cpu-smoke] [--wheel WHEEL] [OUT_DIR]  (default: gpu-check-out)
#   --wheel WHEEL: the leanstep wheel for that Python (make wheel: build/wheel/*-cp312-*.whl),
#   installed into OUT_DIR/site (pip --no-index --no-deps --target) and imported from there;
#   without it the compiled extension must be in python/leanstep/ (see below).
#   --cpu-smoke: the same steps on a machine without a GPU (tests in Triton's interpreter,
#   bench/gpu_check.py --cpu-smoke with tiny sizes): checks this script's logic only.
#   PYTHON=/path/to/python  the interpreter (default: python3). It needs torch with CUDA,
#   triton, numpy and pytest; megatron-core is optional (its variants are then skipped).
#   The compiled extension for that Python must be in python/leanstep/ (an ignored build
#   output: bring it along, e.g. python/leanstep/_leanstep.cpython-312-x86_64-linux-gnu.so).
# Writes OUT_DIR/env.txt, hostcost.txt, step.txt, tests.txt, bench.txt, gpu_check.json,
# host.txt. Exit status: 0 when the environment, the launch and sync cost, the tests and the
# benchmark all succeed; else the first failure's (the host-time step is reported, not
# counted: it runs only in what time is left).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
SMOKE=0
WHEEL=
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu-smoke) SMOKE=1; shift ;;
        --wheel) WHEEL=${2:?--wheel needs the path of a wheel}; shift 2 ;;
        *) break ;;
    esac
done
PY=${PYTHON:-python3}
SMOKE_ARG=()
[ "$SMOKE" -eq 1 ] && SMOKE_ARG=(--cpu-smoke)
OUT=${1:-gpu-check-out}
BUDGET=${GPU_CHECK_BUDGET_S:-470}  # seconds for the whole script (8 minutes with margin)
TESTS_S=${GPU_CHECK_TESTS_S:-290}  # the tests' share: first launches compile every kernel
mkdir -p "$OUT"
if [ -n "$WHEEL" ]; then
    # The wheel's package, not the source tree's (which has no compiled extension there).
    SITE="$(cd "$OUT" && pwd)/site"
    rm -rf "$SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL"; then
        echo "gpu-check: could not install $WHEEL for $PY"
        exit 2
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
fi
unset TRITON_INTERPRET
# Device tensors pick the Triton kernels by themselves (after their first-use self-check);
# stated here so that a LEANSTEP_TRITON=off in the caller's environment does not hide them.
export LEANSTEP_TRITON=auto
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

echo "== environment"
timeout 60 env GPU_CHECK_SMOKE="$SMOKE" "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/env.txt"
import os
import sys
import torch
smoke = os.environ["GPU_CHECK_SMOKE"] == "1"
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
if not smoke:
    assert torch.cuda.is_available(), "no CUDA device visible to torch"
    print("gpu:", torch.cuda.get_device_name(), "| sms:",
          torch.cuda.get_device_properties(0).multi_processor_count)
import triton
print("triton", triton.__version__)
import leanstep
from leanstep import _backend
print("leanstep", leanstep.__version__, "| areas:", ",".join(leanstep.areas), "| from",
      os.path.dirname(leanstep.__file__))
if not smoke:
    from triton.runtime import driver
    print("triton driver:", driver.active.get_current_target())
    why = _backend.triton_unusable(torch.device("cuda"))
    assert why is None, f"leanstep cannot run Triton here: {why}"
try:
    from importlib.metadata import version
    print("megatron-core", version("megatron-core"))
except Exception as e:  # noqa: BLE001
    print("megatron-core: not installed (its variants are skipped):", e)
PYEOF
env_rc=${PIPESTATUS[0]}
if [ "$env_rc" -ne 0 ]; then
    echo "gpu-check: the environment check failed (rc $env_rc); see $OUT/env.txt"
    exit "$env_rc"
fi

echo "== launch and sync cost (the host-cost model's parameters)"
# Host time of an eager op (Python, dispatcher, launch) on a 1-element tensor, and of an
# .item() of a ready tensor (the copy and the wait): what the model calls launch_us, sync_us.
timeout 60 env GPU_CHECK_SMOKE="$SMOKE" "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/hostcost.txt"
import os
import time
import torch
smoke = os.environ["GPU_CHECK_SMOKE"] == "1"
dev = "cpu" if smoke else "cuda"
sync = (lambda: None) if smoke else torch.cuda.synchronize
x = torch.zeros(1, device=dev)
for _ in range(100):  # warm-up: the kernel and the allocator's block exist
    x.add_(1)
    x.item()
sync()
t = time.perf_counter()
for _ in range(1000):
    x.add_(1)
sync()
launch_us = (time.perf_counter() - t) / 1000 * 1e6
t = time.perf_counter()
for _ in range(200):
    x.item()
sync_us = (time.perf_counter() - t) / 200 * 1e6
kind = "cpu (--cpu-smoke: not a device figure)" if smoke else torch.cuda.get_device_name()
print(f"hostcost: --device-kind cuda --launch-us {launch_us:.2f} --sync-us {sync_us:.2f}  ({kind})")
PYEOF
cost_rc=${PIPESTATUS[0]}
[ "$cost_rc" -ne 0 ] && echo "gpu-check: the launch and sync cost failed (rc $cost_rc); see $OUT/hostcost.txt"

echo "== the sync-free optimizer step on the device"
timeout 120 "$PY" bench/gpu_step.py "${SMOKE_ARG[@]+"${SMOKE_ARG[@]}"}" 2>&1 | tee "$OUT/step.txt"
step_rc=${PIPESTATUS[0]}
[ "$step_rc" -ne 0 ] && echo "gpu-check: the sync-free step check failed (rc $step_rc); see $OUT/step.txt"

TESTS=(tests/python/test_triton_*.py tests/python/test_conformance.py)
if [ "$SMOKE" -eq 1 ]; then
    echo "== Triton tests in the interpreter (--cpu-smoke; limit ${TESTS_S}s)"
    TEST_ENV=(TRITON_INTERPRET=1)
    BENCH_ARGS=(--cpu-smoke)
else
    echo "== Triton tests on the GPU (limit ${TESTS_S}s)"
    TEST_ENV=(LEANSTEP_TEST_DEVICE=cuda)
    BENCH_ARGS=()
fi
# One pytest per module, in parallel: the first launch of each kernel variant compiles it
# (single-threaded per kernel), so the modules' compiles overlap on the host's cores.
LOGS=$(mktemp -d)
PIDS=()
for t in "${TESTS[@]}"; do
    SELECT=()  # the harness: its Triton cases (its other backends run on the CPU anywhere)
    [ "$(basename "$t")" = test_conformance.py ] && SELECT=(-k triton)
    timeout "$TESTS_S" env "${TEST_ENV[@]}" "$PY" -m pytest -q -p no:cacheprovider \
        --durations=5 "$t" ${SELECT[@]+"${SELECT[@]}"} > "$LOGS/$(basename "$t" .py).txt" 2>&1 &
    PIDS+=("$!")
done
tests_rc=0
for i in "${!PIDS[@]}"; do
    wait "${PIDS[$i]}"
    rc=$?
    echo "${TESTS[$i]}: rc $rc, $(tail -n 1 "$LOGS/$(basename "${TESTS[$i]}" .py).txt")"
    if [ "$rc" -ne 0 ] && [ "$tests_rc" -eq 0 ]; then
        tests_rc=$rc
    fi
done
for t in "${TESTS[@]}"; do
    echo "===== $t"
    cat "$LOGS/$(basename "$t" .py).txt"
done > "$OUT/tests.txt"
rm -rf "$LOGS"
echo "tests: rc $tests_rc after $(elapsed)s (logs in $OUT/tests.txt)"

LEFT=$(( BUDGET - $(elapsed) ))
if [ "$LEFT" -lt 30 ]; then
    echo "gpu-check: ${LEFT}s left, too little for the benchmark"
    bench_rc=124
else
    echo "== benchmark (limit ${LEFT}s)"
    timeout "$LEFT" "$PY" bench/gpu_check.py "${BENCH_ARGS[@]}" --json "$OUT/gpu_check.json" \
        2>&1 | tee "$OUT/bench.txt"
    bench_rc=${PIPESTATUS[0]}
fi
LEFT=$(( BUDGET - $(elapsed) ))
host_rc=skipped
if [ "$LEFT" -lt 40 ]; then
    echo "gpu-check: ${LEFT}s left, too little for the host time per call"
else
    echo "== host time per call (limit ${LEFT}s)"
    if "$PY" -c "import megatron.core.transformer.moe.moe_utils" > /dev/null 2>&1; then
        HOST_ONLY=rmsnorm,moe,grad
    else
        HOST_ONLY=rmsnorm  # the MoE and grad cases' peers are Megatron-Core's
    fi
    if [ "$SMOKE" -eq 1 ]; then
        HOST_ARGS=(--device cpu --quick --only "$HOST_ONLY")
    else
        HOST_ARGS=(--device cuda --rounds 7 --only "$HOST_ONLY")
    fi
    # Half of what is left for each backend: the Triton kernels (the default on a GPU),
    # then the torch-op backend.
    HALF=$(( LEFT / 2 ))
    {
        echo "### leanstep default (Triton after its self-check)"
        timeout "$HALF" "$PY" bench/host_overhead.py "${HOST_ARGS[@]}" 2>&1
        echo "rc $?"
        echo "### LEANSTEP_TRITON=off (the torch-op backend)"
        LEANSTEP_TRITON=off timeout "$HALF" "$PY" bench/host_overhead.py "${HOST_ARGS[@]}" 2>&1
        echo "rc $?"
    } > "$OUT/host.txt"
    host_rc=$(grep -c '^rc 0$' "$OUT/host.txt")/2
    grep -v '^  ' "$OUT/host.txt"
fi
echo "== summary: launch/sync cost rc $cost_rc, sync-free step rc $step_rc, tests rc $tests_rc, benchmark rc $bench_rc, host time runs ok $host_rc, $(elapsed)s in all; files in $OUT"
for rc in "$cost_rc" "$step_rc" "$tests_rc" "$bench_rc"; do
    [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
