"""Host-cost model: the host time per step that a path costs on an accelerator,
predicted from the counts of ``leanstep.audit`` and per-launch and per-sync costs.

It is a model, not a measurement. From an audit report (``Audit.to_dict()``,
or the JSON of ``python -m leanstep.audit --json``) it derives:

- **launches**: one per aten op, except
  - views and metadata ops (``view``, ``detach``, ``empty``, ``lift_fresh``...)
    and the ops that are themselves a host sync (``_local_scalar_dense``, a
    blocking device-to-host copy): 0, the sync's cost covers them;
  - ops over a list of tensors, from the sizes the audit records per call:
    foreach ops as CUDA's ``multi_tensor_apply`` groups them (a launch when 110
    tensors or 320 blocks of 65,536 elements are full, fewer tensors per launch
    for more tensor lists: 64 for two, 48 for three; ``_foreach_norm`` adds its
    two zero fills and a clean-up launch per 400 tensors), ``cat`` / ``stack``
    one launch per 128 inputs;
- **syncs**: host waits. Per call site, the larger of the blocking aten syncs
  (``_local_scalar_dense``, blocking device-to-host copies, plus data-dependent
  ops) and the host reads of device memory, since on a device each such read
  dispatches one of those syncs; a non-blocking copy does not wait.

and prices them: ``host_us = launches * launch_us + syncs * sync_us``.
:func:`predict` compares two reports (a baseline and leanstep's path) and
returns each one's launches, syncs and host time, and the saving.

The costs are parameters (:class:`CostParams`), with defaults per device kind
from published figures (:data:`DEFAULTS`, each with its source), and are
replaced by a measurement where one exists: ``scripts/gpu-check.sh`` prints
``--launch-us X --sync-us Y`` for the GPU it ran on. A sync is priced at its
fixed round trip; the device idling while the host waits, and the host no
longer running ahead, come on top: for a step bound by the host, a sync costs
more than this.

Command line: ``python -m leanstep.hostcost [--device-kind cuda|npu]
[--launch-us X] [--sync-us Y] [--foreach-tensors N] [--foreach-blocks N]
[--model-from RESULTS.json] [--json]``:
the model for the Qwen3-Omni-30B-A3B LoRA EP8 rank layout (3168 fp32 grads),
the per-tensor gradient paths against leanstep's ``GradPlan.norm_clip_``, each
audited here on CPU tensors; with ``--model-from``, for the per-condition
audits of the main job's results (``python -m leanstep.megatron.train``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from typing import Optional

import leanstep

from . import audit as la
from ._leanstep import Error

__all__ = ["CostParams", "DEFAULTS", "SEED_LAYOUT", "SEED_PATHS", "audit_seed_layout",
           "default_params", "estimate", "foreach_launches", "main", "predict",
           "seed_layout_params", "seed_layout_paths"]

# ---------------------------------------------------------------- parameters

#: Published figures per device kind: (low, high) microseconds of host time and
#: where each comes from. The default is the low end: the saving predicted is
#: then the smaller one.
DEFAULTS = {
    "cuda": {
        "launch_us": (4.0, 10.0, "a CUDA kernel launch costs about 4-10 us of host time "
                                 "(the figure of leanstep's host-cost issue)"),
        "sync_us": (8.0, 20.0, "no published figure at hand: an assumption of about two "
                               "launches (the copy's enqueue and the wait's round trip); "
                               "scripts/gpu-check.sh measures it"),
    },
    "npu": {
        "launch_us": (4.0, 10.0, "no separate published figure for an Ascend launch: the CUDA "
                                 "figure stands in (an assumption)"),
        "sync_us": (19.0, 30.0, "a tiny launch plus a stream synchronisation is about 19-30 us "
                                "on an Ascend 910B3 NPU (the figure of leanstep's host-cost "
                                "issue)"),
    },
}

#: PyTorch's multi_tensor_apply (aten/src/ATen/native/cuda/MultiTensorApply.cuh):
#: tensors per launch by the number of tensor lists (1-5), the scalar-list
#: variant's, blocks per launch, elements per block. CUDA >= 12.1 on sm70+ uses
#: 7x these (770 tensors, 2240 blocks): --foreach-tensors 770 --foreach-blocks 2240.
_MAX_TENSORS = (110, 64, 48, 36, 30)
_MAX_TENSORS_SCALAR_LIST = (96, 64, 48, 36, 30)


def _check_device_kind(device_kind):
    if device_kind not in DEFAULTS:
        raise Error(f"leanstep.hostcost: argument device_kind must be one of "
                    f"{', '.join(sorted(DEFAULTS))} (got {device_kind!r})")


@dataclasses.dataclass(frozen=True)
class CostParams:
    """What one launch and one sync cost the host, in microseconds, and how a
    foreach op is cut into launches. Every field is checked: a negative or
    non-finite cost is an error naming the argument."""

    device_kind: str = "cuda"
    launch_us: float = DEFAULTS["cuda"]["launch_us"][0]
    sync_us: float = DEFAULTS["cuda"]["sync_us"][0]
    foreach_tensors: int = 110       # tensors per launch with one tensor list
    foreach_blocks: int = 320        # blocks per launch
    foreach_chunk: int = 65536       # elements per block
    norm_cleanup_tensors: int = 400  # _foreach_norm: tensors per clean-up launch
    cat_inputs: int = 128            # cat / stack: inputs per launch (CatArrayBatchedCopy)

    def __post_init__(self):
        _check_device_kind(self.device_kind)
        for name in ("launch_us", "sync_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise Error(f"leanstep.hostcost: argument {name} must be a finite number >= 0 "
                            f"(got {type(value).__name__} {value!r})")
            if not math.isfinite(value) or value < 0:
                raise Error(f"leanstep.hostcost: argument {name} must be a finite number >= 0 "
                            f"(got {value!r})")
        for name in ("foreach_tensors", "foreach_blocks", "foreach_chunk",
                     "norm_cleanup_tensors", "cat_inputs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Error(f"leanstep.hostcost: argument {name} must be an integer >= 1 "
                            f"(got {value!r})")

    def max_tensors(self, depth: int, scalar_list: bool = False) -> int:
        """Tensors per launch for ``depth`` tensor lists (PyTorch's table,
        scaled by ``foreach_tensors`` / 110)."""
        table = _MAX_TENSORS_SCALAR_LIST if scalar_list else _MAX_TENSORS
        base = table[min(max(depth, 1), len(table)) - 1]
        return max(1, round(base * self.foreach_tensors / _MAX_TENSORS[0]))


def default_params(device_kind: str = "cuda", which: str = "low", **overrides) -> CostParams:
    """The published defaults of ``device_kind`` (``which``: ``"low"`` or
    ``"high"`` end of their range), with ``overrides`` applied."""
    _check_device_kind(device_kind)
    if which not in ("low", "high"):
        raise Error(f"leanstep.hostcost: argument which must be 'low' or 'high' (got {which!r})")
    i = 0 if which == "low" else 1
    d = DEFAULTS[device_kind]
    values = {"device_kind": device_kind, "launch_us": d["launch_us"][i],
              "sync_us": d["sync_us"][i]}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return CostParams(**values)


# ---------------------------------------------------------------- launches

# Aten ops that allocate, alias or read metadata: no kernel. Views are known
# from the audit itself (its view_ops).
_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_",
    "set_", "lift_fresh", "alias", "detach", "record_stream", "is_same_size",
    "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
    "is_nonzero", "_has_compatible_shallow_copy_type",
})
_BLOCKING_SYNCS = ("scalar", "d2h_copy")  # Sync.kind values that make the host wait
_REDUCTIONS = ("_foreach_norm", "_foreach_max")  # one input list, results apart


def _base(op: str) -> str:
    """``aten._foreach_mul_.Tensor`` -> ``_foreach_mul_``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


def foreach_launches(numels, max_tensors: int, max_blocks: int, chunk: int) -> int:
    """Launches of CUDA's multi_tensor_apply over tensors of these element
    counts, in order (``numels``: ints or ``(numel, repeat)`` runs): a launch
    when ``max_blocks`` blocks are full, or when ``max_tensors`` tensors are
    and the last one's chunks are all placed; a tensor cut by a full launch
    carries over into the next; empty tensors are skipped."""
    launches = tensors = blocks = 0
    for item in numels:
        numel, repeat = (item, 1) if isinstance(item, int) else item
        if numel <= 0:
            continue
        chunks = -(-numel // chunk)
        for _ in range(repeat):
            tensors += 1
            left = chunks
            while left:
                take = min(left, max_blocks - blocks)
                blocks += take
                left -= take
                if left:  # blocks full in the middle of the tensor: it carries over
                    launches += 1
                    blocks, tensors = 0, 1
                elif tensors == max_tensors or blocks == max_blocks:
                    launches += 1
                    blocks, tensors = 0, 0
    return launches + (1 if blocks else 0)


def _list_call_launches(call: dict, params: CostParams) -> int:
    """Launches of one recorded call of an op over a list of tensors."""
    op = call["op"]
    base = _base(op)
    runs = [tuple(r) for r in call["numels"]]
    tensors = call.get("tensors", sum(n for _, n in runs))
    if base in ("cat", "stack"):
        return max(1, -(-tensors // params.cat_inputs))
    if "foreach" not in base and not base.startswith("_fused_"):
        return 1  # another op taking a list (index, ...): one kernel
    lists = max(1, int(call.get("lists", 1)))
    if base.startswith("_fused_"):
        depth = lists - 1  # state_steps rides along, not a list of the kernel's depth
    elif base in _REDUCTIONS or base.endswith("_"):
        depth = 1 if base in _REDUCTIONS else lists
    else:
        depth = lists + 1  # out-of-place: the outputs are one more list
    n = foreach_launches(runs, params.max_tensors(depth, "ScalarList" in op),
                         params.foreach_blocks, params.foreach_chunk)
    if base in _REDUCTIONS and tensors:
        # two zero fills (per-chunk partials, per-block output), then the clean-up kernels
        n += 2 + -(-tensors // params.norm_cleanup_tensors)
    return n


def _is_full_report(report: dict) -> bool:
    return isinstance(report.get("ops"), dict)


def estimate(report: dict, params: Optional[CostParams] = None,
             measured_us: Optional[float] = None) -> dict:
    """Launches, syncs and host time of one audited region.

    ``measured_us``: the region's own host time per call, measured on the CPU
    where its compute is negligible (:func:`measure_seed_layout`): Python,
    leanstep's bindings, the framework's dispatch. The launch model prices
    launches and syncs; the measurement sees the code around them. Each is a
    lower bound of the host time on a device and they overlap (the dispatch of
    each launched op is in both), so ``host_us`` is the larger of the two
    (``model_us`` and ``measured_us`` are returned too).

    ``report``: an ``Audit.to_dict()`` (or its JSON), or the main job's
    per-condition summary (``ops``, ``view_ops``, ``syncs``, ``device_reads``
    as numbers), which gives a coarser estimate (one launch per op that is no
    view and no sync; syncs the larger of the syncs and the device reads).
    Returns ``{launches, syncs, launch_us, sync_us, model_us, measured_us, host_us,
    by_op, notes}``;
    ``by_op`` lists ``[op, calls, launches]`` for a full report."""
    params = params or CostParams()
    if not isinstance(report, dict):
        raise Error(f"leanstep.hostcost: argument report must be a dict from Audit.to_dict() "
                    f"(got {type(report).__name__})")
    notes = []
    if _is_full_report(report):
        launches, by_op = _launches_full(report, params, notes)
        syncs = _syncs_full(report)
    elif all(isinstance(report.get(k), int) for k in ("ops", "view_ops", "syncs")):
        by_op = []
        syncs = max(report["syncs"], int(report.get("device_reads", 0)))
        launches = max(0, report["ops"] - report["view_ops"] - report["syncs"])
        notes.append("summary counts only: one launch per op (foreach ops not cut into chunks)")
    else:
        raise Error("leanstep.hostcost: argument report must be an Audit.to_dict() (with 'ops' "
                    "by name) or a summary with integer 'ops', 'view_ops' and 'syncs' "
                    f"(got keys {sorted(report)})")
    launch_us = launches * params.launch_us
    sync_us = syncs * params.sync_us
    if measured_us is not None and (isinstance(measured_us, bool) or not isinstance(
            measured_us, (int, float)) or not math.isfinite(measured_us) or measured_us < 0):
        raise Error(f"leanstep.hostcost: argument measured_us must be a finite number >= 0 or "
                    f"None (got {measured_us!r})")
    model_us = launch_us + sync_us
    host_us = model_us if measured_us is None else max(model_us, float(measured_us))
    return {"launches": launches, "syncs": syncs, "launch_us": launch_us, "sync_us": sync_us,
            "model_us": model_us, "measured_us": measured_us, "host_us": host_us,
            "by_op": by_op, "notes": notes}


def _launches_full(report, params, notes):
    ops = report["ops"]
    views = report.get("view_ops")
    if views is None:
        views = {}
        notes.append("no per-op view counts: views counted as launches")
    sync_ops = {}
    for s in report.get("syncs", ()):
        if s.get("kind") in _BLOCKING_SYNCS:
            sync_ops[s["op"]] = sync_ops.get(s["op"], 0) + s["count"]
    per_call = {}  # op -> [calls seen in list_calls, their launches]
    for call in report.get("list_calls", ()):
        seen = per_call.setdefault(call["op"], [0, 0])
        seen[0] += call["count"]
        seen[1] += call["count"] * _list_call_launches(call, params)
    if "list_calls" not in report and any("foreach" in op or _base(op) in ("cat", "stack")
                                          for op in ops):
        notes.append("no list sizes recorded: one launch per foreach / cat call")
    total, by_op = 0, []
    for op, calls in ops.items():
        kernel_calls = calls - views.get(op, 0) - sync_ops.get(op, 0)
        if _base(op) in _NO_KERNEL or kernel_calls <= 0:
            n = 0
        elif op in per_call:
            seen, seen_launches = per_call[op]
            n = seen_launches + max(0, kernel_calls - seen)  # calls not recorded: one each
        else:
            n = kernel_calls
        total += n
        by_op.append([op, calls, n])
    by_op.sort(key=lambda row: (-row[2], row[0]))
    return total, by_op


def _site_key(record: dict) -> tuple:
    return (record.get("file"), record.get("line"), record.get("function"))


def _syncs_full(report) -> int:
    if report.get("device_memory"):
        # A CPU run whose reads a DeviceMemory classified: the reads of device memory are
        # the waits a device run makes (the aten-level syncs of a CPU run include reads of
        # host-resident tensors, no wait there), plus the data-dependent ops.
        implicit = sum(s["count"] for s in report.get("implicit_syncs", ()))
        return implicit + sum(r["count"] for r in report.get("host_reads", ())
                              if r.get("memory") == "device")
    waits, reads = {}, {}
    for s in list(report.get("syncs", ())) + list(report.get("implicit_syncs", ())):
        if s.get("kind") in _BLOCKING_SYNCS + ("data_dependent",):
            waits[_site_key(s)] = waits.get(_site_key(s), 0) + s["count"]
    for r in report.get("host_reads", ()):
        if r.get("memory") == "device":
            reads[_site_key(r)] = reads.get(_site_key(r), 0) + r["count"]
    # A device read dispatches the sync counted at the same line: the larger, not the sum.
    return sum(max(waits.get(k, 0), reads.get(k, 0)) for k in set(waits) | set(reads))


def predict(baseline_report: dict, leanstep_report: dict,
            params: Optional[CostParams] = None, measured_us=(None, None)) -> dict:
    """Host time per step of a baseline path and leanstep's, and the saving.

    ``measured_us``: (the baseline's, leanstep's) measured host time per call
    or None (see :func:`estimate`). Returns ``{params, baseline, leanstep,
    saving}``: the first two as :func:`estimate` gives them; ``saving`` the
    baseline minus leanstep for ``launches``, ``syncs``, ``launch_us``,
    ``sync_us``, ``model_us`` and ``host_us``."""
    params = params or CostParams()
    base = estimate(baseline_report, params, measured_us[0])
    lean = estimate(leanstep_report, params, measured_us[1])
    keys = ("launches", "syncs", "launch_us", "sync_us", "model_us", "host_us")
    return {"params": dataclasses.asdict(params), "baseline": base, "leanstep": lean,
            "saving": {k: base[k] - lean[k] for k in keys}}


# ---------------------------------------------------------------- the seed's layout

#: The layout of the seed's run: one EP rank of Qwen3-Omni-30B-A3B LoRA r8
#: (EP 8), Megatron-Core DDP buffers with the distributed optimizer, dp 8.
SEED_LAYOUT = "qwen3-omni-30b-a3b-lora-r8-ep8"
SEED_LAYOUT_OPTIONS = {"distributed_optimizer": True, "dp_size": 8, "bucket_size": 40_000_000}


def seed_layout_params():
    """The seed layout's parameter list (registration order), as
    ``leanstep.ddp_grad_buffers`` takes it: 3168 LoRA tensors."""
    return leanstep.model_params("qwen3_omni_lora", 8, 8)


def _seed_grads(device):
    buffers, grads, _ = leanstep.ddp_grad_buffers(seed_layout_params(), device=device,
                                                  **SEED_LAYOUT_OPTIONS)
    return buffers, grads


def _per_tensor_host_norms(grads, max_norm):
    """Megatron-Core 0.16's gradient path without Transformer Engine or apex
    (NPU stacks): get_grad_norm_fp32 through local_multi_tensor_l2_norm, then
    clip_grad_by_total_norm_fp32 through local_multi_tensor_scale."""
    import torch

    device = grads[0].device
    torch.zeros(1, dtype=torch.int, device=device)  # the unused overflow buffer
    norms = [torch.norm(g) for g in grads]
    # Megatron passes this list to torch.tensor(), which reads every element in
    # its C++ constructor, out of the audit's sight; on a device each is a sync.
    host = [n.item() for n in norms]
    reduced = math.sqrt(sum(v * v for v in host))  # a CPU tensor's norm: host work, no launch
    grad_norm = torch.full((1,), reduced, dtype=torch.float, device=device)
    total = grad_norm ** 2.0
    # (the all-reduce over the grad-stats group: one collective, left out on both sides)
    total_norm = total.item() ** 0.5
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        torch.zeros(1, dtype=torch.int, device=device)
        for g in grads:
            g.copy_(g * coeff)


#: The paths audited on the seed's layout: name -> what it runs. The baselines
#: first, leanstep's path last.
SEED_PATHS = {
    "megatron-per-tensor": "Megatron-Core without TE/apex (NPU stacks): norms read to the host "
                           "per tensor, host coefficient, a copy per tensor",
    "torch-per-tensor": "torch clip_grad_norm_(foreach=False, error_if_nonfinite=True): norm "
                        "per tensor, non-finite check on the host, mul_ per tensor",
    "torch-foreach": "torch clip_grad_norm_(foreach=True)",
    "leanstep": "leanstep GradPlan.norm_clip_, torch-op backend: norm, found_inf and clip "
                "on the device",
}


def seed_layout_paths(grads) -> dict:
    """{name: fn(max_norm)} of :data:`SEED_PATHS` over ``grads``. What a step
    holds anyway (the parameters, leanstep's plan) is made here, outside the
    calls."""
    import torch

    params = []
    for g in grads:  # zero-stride stand-ins (no memory) whose .grad are the views
        p = torch.nn.Parameter(torch.zeros(1).expand(g.shape))
        p.grad = g
        params.append(p)
    plan = leanstep.GradPlan(grads, backend="torch")  # the device backend, on these tensors
    return {
        "megatron-per-tensor": lambda max_norm: _per_tensor_host_norms(grads, max_norm),
        "torch-per-tensor": lambda max_norm: torch.nn.utils.clip_grad_norm_(
            params, max_norm, foreach=False, error_if_nonfinite=True),
        "torch-foreach": lambda max_norm: torch.nn.utils.clip_grad_norm_(
            params, max_norm, foreach=True),
        "leanstep": lambda max_norm: plan.norm_clip_(max_norm),
    }


def audit_seed_layout(paths=None) -> dict:
    """One audited call of each path of :data:`SEED_PATHS` (``paths``: some
    of their names; default all) on the seed's layout, CPU tensors standing
    in for device tensors. Each gets grads filled with 1, so that every clip
    multiplies; leanstep's is called once before (its first call makes the
    max_norm scalar later calls reuse, as every step after the first does).
    Returns ``{layout, grads, buffers, elements, reports:
    {name: Audit.to_dict()}}``."""
    names = list(SEED_PATHS) if paths is None else list(paths)
    unknown = sorted(set(names) - set(SEED_PATHS))
    if unknown:
        raise Error(f"leanstep.hostcost: argument paths must name paths of SEED_PATHS "
                    f"({', '.join(SEED_PATHS)}) (got {unknown})")
    buffers, grads = _seed_grads("cpu")
    fns = seed_layout_paths(grads)
    def fill():
        for b in buffers:
            b.fill_(1.0)

    reports = {}
    for name in names:
        if name == "leanstep":
            fill()
            fns[name](1.0)
        fill()
        with la.audit() as a:
            fns[name](1.0)
        reports[name] = a.to_dict()
    return {"layout": SEED_LAYOUT, "grads": len(grads), "buffers": len(buffers),
            "elements": sum(b.numel() for b in buffers), "reports": reports}


def measure_seed_layout(paths=None, calls: int = 15) -> dict:
    """``{name: median microseconds per call}`` of :data:`SEED_PATHS` on the
    seed's layout at negligible compute: its 3168 grads as one-element views
    of buffers holding as many grads as the real ones, CPU tensors, one thread.
    What is left is the host's own work per call (Python, leanstep's
    bindings, torch's dispatch of every op), which a device does not take
    away. Grads are refilled with 1 outside the timer (every clip multiplies);
    leanstep's first call (its plan) is made before."""
    import torch

    names = list(SEED_PATHS) if paths is None else list(paths)
    _, real = _seed_grads("meta")  # the layout's counts, no memory
    bases = []
    for g in real:
        base = g._base if g._base is not None else g
        if not bases or bases[-1][0] is not base:
            bases.append([base, 0])
        bases[-1][1] += 1
    buffers = [torch.ones(n) for _, n in bases]
    grads = [b[i:i + 1] for b in buffers for i in range(b.numel())]
    fns = seed_layout_paths(grads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name in names:
            times = []
            for call in range(calls + 2):  # two warm-up calls
                for b in buffers:
                    b.fill_(1.0)
                start = time.perf_counter()
                fns[name](1.0)
                if call >= 2:
                    times.append(time.perf_counter() - start)
            out[name] = statistics.median(times) * 1e6
        return out
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------- the main job's results

def main_job_reports(results: dict) -> list:
    """[(label, {condition: report}, trainable tensors)] from the main job's
    results (``build/demo/*/results.json``): rank 0's audit per EP size, each
    condition's full ``Audit.to_dict()`` where the results hold it, else its
    summary counts; the rank's trainable tensor count, or None."""
    out = []
    for ep, e in sorted((results.get("ep") or {}).items(), key=lambda kv: str(kv[0])):
        audits = e.get("audit") or {}
        rank0 = audits.get("0", audits.get(0))
        trainable = e.get("trainable") or {}
        tensors = (trainable.get("0", trainable.get(0)) or {}).get("tensors")
        if rank0:
            out.append((f"EP {ep}, rank 0", {c: a.get("report", a) for c, a in rank0.items()},
                        tensors))
    if not out:
        raise Error("leanstep.hostcost: argument --model-from must be the main job's results "
                    "with an audit (python -m leanstep.megatron.train --phases ...,audit): "
                    "no ep.*.audit found")
    return out


# ---------------------------------------------------------------- printing

def _us_to_ms(us):
    return us / 1000.0


def _params_line(low: CostParams, high: Optional[CostParams]) -> str:
    def r(a, b):
        return f"{a:g}" if high is None or a == b else f"{a:g}-{b:g}"
    h = high or low
    return (f"{low.device_kind}: launch {r(low.launch_us, h.launch_us)} us, sync "
            f"{r(low.sync_us, h.sync_us)} us; foreach {low.foreach_tensors} tensors / "
            f"{low.foreach_blocks} blocks of {low.foreach_chunk} per launch")


def format_table(rows, low: CostParams, high: Optional[CostParams], title: str,
                 comparisons, notes=(), measured=None) -> str:
    """The model as text. ``rows``: ``[(name, description, report)]``;
    ``comparisons``: ``[(reference, candidate)]`` names whose saving to
    print; ``high``: the other end of the cost range, or None; ``measured``:
    ``{name: measured host us per call}`` (a column, and each host time is at
    least it)."""
    lines = [f"host-cost model (a model, not a measurement) -- {title}",
             f"  costs {_params_line(low, high)}", ""]
    measured = measured or {}
    est = {name: (estimate(rep, low, measured.get(name)),
                  estimate(rep, high, measured.get(name)) if high else None)
           for name, _, rep in rows}

    def ms(lo_us, hi_us):
        text = f"{_us_to_ms(lo_us):.2f}"
        return text if hi_us is None or hi_us == lo_us else f"{text}-{_us_to_ms(hi_us):.2f}"

    header = ("path", "aten ops", "views", "launches", "syncs", "model ms") + (
        ("measured ms", "host ms") if measured else ())
    table = []
    for name, _, rep in rows:
        lo, hi = est[name]
        ops = rep["num_ops"] if _is_full_report(rep) else rep["ops"]
        views = rep["num_view_ops"] if _is_full_report(rep) else rep["view_ops"]
        row = (name, str(ops), str(views), str(lo["launches"]), str(lo["syncs"]),
               ms(lo["model_us"], hi and hi["model_us"]))
        if measured:
            got = measured.get(name)
            row += ("-" if got is None else f"{_us_to_ms(got):.2f}",
                    ms(lo["host_us"], hi and hi["host_us"]))
        table.append(row)
    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    for r in [header] + table:
        lines.append("  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                                      for i, c in enumerate(r)))
    lines.append("")
    for reference, candidate in comparisons:
        (r_lo, r_hi), (c_lo, c_hi) = est[reference], est[candidate]
        saving = ms(r_lo["host_us"] - c_lo["host_us"],
                    None if r_hi is None else r_hi["host_us"] - c_hi["host_us"])
        lines.append(f"  saving of {candidate} against {reference}: {saving} ms of host time "
                     f"per step ({r_lo['launches'] - c_lo['launches']} launches, "
                     f"{r_lo['syncs'] - c_lo['syncs']} syncs)")
    lines.append("")
    for name, desc, _ in rows:
        lines.append(f"  {name}: {desc}")
    for n in list(notes) + sorted({n for name in est for n in est[name][0]["notes"]}):
        lines.append(f"  note: {n}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- command line

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m leanstep.hostcost",
        description="The host-cost model (a model, not a measurement): host time per step "
                    "from the audit's launches and syncs and per-launch / per-sync costs, for "
                    "the Qwen3-Omni-30B-A3B LoRA EP8 rank layout (3168 grads: per-tensor "
                    "gradient paths against leanstep's GradPlan, audited here on CPU tensors), "
                    "or for the per-condition audits of the main job's results.")
    p.add_argument("--device-kind", choices=sorted(DEFAULTS), default="cuda",
                   help="whose published costs are the defaults (default cuda)")
    p.add_argument("--launch-us", type=float, default=None, metavar="X",
                   help="host microseconds per kernel launch (default: the device kind's "
                        "published range, low and high)")
    p.add_argument("--sync-us", type=float, default=None, metavar="Y",
                   help="host microseconds per host sync (default: the published range)")
    p.add_argument("--foreach-tensors", type=int, default=None, metavar="N",
                   help="tensors per foreach launch with one tensor list (default 110; 770 "
                        "where CUDA >= 12.1 passes 32 KB kernel arguments)")
    p.add_argument("--foreach-blocks", type=int, default=None, metavar="N",
                   help="blocks per foreach launch (default 320; 2240 with 32 KB arguments)")
    p.add_argument("--model-from", metavar="RESULTS.json", default=None,
                   help="the main job's results (python -m leanstep.megatron.train): the model "
                        "for its per-condition audits instead of the seed layout")
    p.add_argument("--no-measure", action="store_true",
                   help="the model alone: no measured host time per call (seed layout)")
    p.add_argument("--json", action="store_true", help="print the predictions as one JSON object")
    return p


def _check_flag(ap, flag, value):
    if value is not None and not (math.isfinite(value) and value >= 0):
        ap.error(f"argument {flag}: must be a finite number >= 0 (got {value!r})")


def _params_from(opts):
    structural = {"foreach_tensors": opts.foreach_tensors, "foreach_blocks": opts.foreach_blocks}
    costs = {"launch_us": opts.launch_us, "sync_us": opts.sync_us}
    low = default_params(opts.device_kind, "low", **structural, **costs)
    high = default_params(opts.device_kind, "high", **structural, **costs)
    return low, (None if high == low else high)


_MAIN_JOB_NOTES = (
    "a CPU run: leanstep's C++ kernels dispatch no aten ops, so the launches of "
    "leanstep's device backends (docs/accelerators.md) are not in its conditions' counts",
)
_TRACKED_NOTE = (
    "syncs: the reads of device memory by leanstep.audit.DeviceMemory (what a GPU run "
    "reads; host-resident reads such as AdamW's step counters are not waits there), each "
    "counted as one wait (the dispatcher's two copies per MoE layer share one on a GPU)")
_UNTRACKED_NOTE = (
    "syncs include reads of host-resident tensors (AdamW's per-parameter step counters), "
    "no wait on a GPU; every condition has them, so they cancel in the saving")


def _main_job(opts, low, high, ap) -> int:
    try:
        with open(opts.model_from) as f:
            results = json.load(f)
        groups = main_job_reports(results)
    except (OSError, ValueError) as e:
        ap.error(f"argument --model-from: must be a readable results JSON of the main job ({e})")
    version = results.get("megatron_core_version", "?")
    out, text = {}, []
    for label, conditions, tensors in groups:
        if "baseline" not in conditions:
            ap.error(f"argument --model-from: {label} has no 'baseline' audit")
        others = [c for c in conditions if c != "baseline"]
        out[label] = {c: predict(conditions["baseline"], conditions[c], low) for c in others}
        if high is not None:
            out[label + " (high)"] = {c: predict(conditions["baseline"], conditions[c], high)
                                      for c in others}
        rows = [(c, f"the main job's condition {c!r} (preset {c})", a)
                for c, a in conditions.items()]
        notes = list(_MAIN_JOB_NOTES)
        tracked = all(a.get("device_memory") for a in conditions.values())
        notes.append(_TRACKED_NOTE if tracked else _UNTRACKED_NOTE)
        if version.startswith("0.16") and not tracked:
            notes.append("without TE/apex, megatron-core 0.16 passes the per-tensor norms to "
                         "torch.tensor(), which reads each one inside its C++ constructor, out "
                         "of the audit's sight: on a device the baseline has one more sync per "
                         "grad in the norm than counted here"
                         + (f" ({tensors} trainable tensors on this rank)" if tensors else ""))
        text.append(format_table(rows, low, high,
                                 f"main job, megatron-core {version}, {label}: one step",
                                 [("baseline", c) for c in others], notes))
    if opts.json:
        print(json.dumps(out))
    else:
        sys.stdout.write("\n".join(text))
    return 0


def main(argv: Optional[list] = None) -> int:
    ap = _parser()
    opts = ap.parse_args(sys.argv[1:] if argv is None else argv)
    _check_flag(ap, "--launch-us", opts.launch_us)
    _check_flag(ap, "--sync-us", opts.sync_us)
    for flag, value in (("--foreach-tensors", opts.foreach_tensors),
                        ("--foreach-blocks", opts.foreach_blocks)):
        if value is not None and value < 1:
            ap.error(f"argument {flag}: must be an integer >= 1 (got {value!r})")
    try:
        low, high = _params_from(opts)
    except Error as e:
        ap.error(str(e))
    if opts.model_from:
        return _main_job(opts, low, high, ap)
    audited = audit_seed_layout()
    reports = audited["reports"]
    measured = None if opts.no_measure else measure_seed_layout(list(reports))
    baselines = [name for name in reports if name != "leanstep"]

    def pair(b):
        return (None, None) if measured is None else (measured[b], measured["leanstep"])

    if opts.json:
        out = {"layout": audited["layout"], "grads": audited["grads"],
               "measured_us": measured,
               "predictions": {b: predict(reports[b], reports["leanstep"], low, pair(b))
                               for b in baselines}}
        if high is not None:
            out["predictions_high"] = {b: predict(reports[b], reports["leanstep"], high,
                                                  pair(b))
                                       for b in baselines}
        print(json.dumps(out))
        return 0
    sys.stdout.write(format_table(
        [(name, SEED_PATHS[name], reports[name]) for name in reports], low, high,
        f"{audited['layout']}: {audited['grads']} fp32 grads in {audited['buffers']} buffers, "
        f"{audited['elements']:,} elements; norm + clip, one step, audited on CPU tensors",
        [(b, "leanstep") for b in baselines],
        ["the all-reduce of the norm (one collective on either side) is left out"]
        + ([] if measured is None else [
            "measured: the path's own host time per call on this CPU, its 3168 grads one "
            "element each (negligible compute), one thread; host ms is the larger of the "
            "model and the measurement (each a lower bound: they overlap in each launched "
            "op's dispatch)"]), measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
