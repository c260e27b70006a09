#!/usr/bin/env python3
"""leanstep against its peers, on the same tensors, in one process.

    python bench/peers.py [--quick] [--only grad,rmsnorm,moe] [--json]

Gradient engine (layouts as `leanstep bench grad`: one EP rank of
Qwen3-Omni-30B-A3B LoRA r8 (distributed optimizer, dp 8) and a dense ~101M fp32
model (distributed optimizer, dp 6), Megatron-Core DDP buffers, fp32 grads):
  norm       torch per-tensor loop, torch._foreach_norm, one norm over the flat
             buffers, Megatron-Core get_grad_norm_fp32, leanstep GradPlan.norm,
             and Megatron-Core's function with leanstep.megatron installed
  clip       torch per-tensor mul_, torch._foreach_mul_, Megatron-Core
             clip_grad_by_total_norm_fp32, leanstep GradPlan.clip_
  norm_clip  torch.nn.utils.clip_grad_norm_ (foreach off/on), Megatron-Core
             norm + clip, leanstep norm_clip_, Megatron-Core patched
RMSNorm (shapes as `leanstep bench rmsnorm`), frozen weight:
  forward, fwd_bwd_frozen: HF-style composite, torch.nn.functional.rms_norm,
             leanstep.torch.RMSNorm (frozen direct path)
MoE (as `leanstep bench moe`: T 4096, E 128, top-8, H 2048):
  permute, unpermute: Megatron-Core moe_utils vs leanstep (fused).

Megatron-Core's gradient helpers hard-code device='cuda' for their scalars and
assert a CUDA grad type; to run their own code on the CPU, the harness enters
leanstep.megatron.cpu's cuda_literals and cuda_type_names shims around each
call (scalar allocations on the CPU, the type assertion answered; nothing else
in their code path changes). A one-rank gloo process group serves the
collectives.

Prints a table (median ms, GB/s, x of the bandwidth floor, speedup vs the
first peer of the op, and the aten ops and host syncs of one call of every
variant counted by leanstep.audit) and JSON lines {bench, case, op,
variant, median_ms, bytes, gbps, aten_ops, host_syncs}, then the host
overhead of the Megatron patch: the patched call over the direct leanstep
call. The machine may be shared: medians, repeated runs.
"""

import argparse
import contextlib
import functools
import json
import math
import os
import socket
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

import leanstep  # noqa: E402
import leanstep.hostcost as hostcost  # noqa: E402
import leanstep.megatron as lm  # noqa: E402
import leanstep.megatron.cpu as mcpu  # noqa: E402
import leanstep.torch as lt  # noqa: E402


# ---------------------------------------------------------------- timing


def time_it(fn, min_reps, min_seconds, warmup=1, setup=None):
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < min_seconds and len(times) < 200):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def paired_ratio(fn, reference, min_reps, min_seconds, setup=None):
    """Median over pairs of fn's time / reference's time, the order swapped
    every pair (the machine is shared: a paired ratio cancels its drift)."""
    for _ in range(2):
        for f in (fn, reference):
            if setup:
                setup()
            f()
    ratios, order = [], 0
    start = time.perf_counter()
    while len(ratios) < min_reps or (time.perf_counter() - start < min_seconds
                                     and len(ratios) < 100):
        times = {}
        pair = (fn, reference) if order % 2 == 0 else (reference, fn)
        for f in pair:
            if setup:
                setup()
            t0 = time.perf_counter()
            f()
            times[f] = time.perf_counter() - t0
        ratios.append(times[fn] / times[reference])
        order += 1
    return statistics.median(ratios)


#: The fresh-output settings each leanstep Python variant runs under:
#: (label, output pool on, huge pages on). The default is the first.
OUTPUT_SETTINGS = [("", True, True), (", no pool", False, True), (", no pool, 4K pages", False, False)]


@contextlib.contextmanager
def output_setting(pool, huge):
    previous_pool = leanstep.set_output_pool(pool)
    previous_huge = leanstep.set_huge_pages(huge)
    leanstep.empty_cache()
    try:
        yield
    finally:
        leanstep.set_output_pool(*previous_pool)
        leanstep.set_huge_pages(previous_huge)
        leanstep.empty_cache()


def audited(fn):
    """One more call of `fn` under leanstep.audit (after its timing)."""
    with leanstep.audit() as audit:
        fn()
    return audit


class Results:
    def __init__(self, args):
        self.rows = []
        self.args = args
        self.floors = {}
        self.overheads = []

    def add(self, bench, case, op, variant, median_ms, nbytes, floor_access, audit=None,
            x_cpp=None):
        row = {"bench": bench, "case": case, "op": op, "variant": variant,
               "median_ms": round(median_ms, 4), "bytes": int(nbytes),
               "gbps": round(nbytes / (median_ms * 1e-3) / 1e9, 3)}
        if x_cpp is not None:  # paired: this Python call / the C++ kernel into reused outputs
            row["x_cpp"] = round(x_cpp, 3)
        if audit is not None:  # one call under leanstep.audit: aten ops and host syncs
            row["aten_ops"] = audit.num_ops
            row["host_syncs"] = audit.num_syncs
            row["host_reads"] = audit.num_host_reads
        floor = self.floors.get(floor_access)
        if floor:
            floor_ms = nbytes / (floor * 1e9) * 1e3
            row["floor_ms"] = round(floor_ms, 4)
            row["x_floor"] = round(median_ms / floor_ms, 3)
        row["threads"] = leanstep.num_threads()
        self.rows.append(row)
        print(f"  {bench:8s} {case:34s} {op:15s} {variant:52s} {median_ms:10.3f} ms",
              file=sys.stderr, flush=True)

    def table(self):
        out = []
        header = f"{'bench':8s} {'case':34s} {'op':15s} {'variant':52s} {'median ms':>10s} " \
                 f"{'GB/s':>8s} {'x floor':>8s} {'speedup':>8s} {'x C++':>6s} {'aten ops':>8s} " \
                 f"{'syncs':>6s}"
        out.append(header)
        out.append("-" * len(header))
        baseline = {}
        for r in self.rows:
            key = (r["bench"], r["case"], r["op"])
            baseline.setdefault(key, r["median_ms"])
            speedup = baseline[key] / r["median_ms"]
            x_cpp = f"{r['x_cpp']:6.2f}" if "x_cpp" in r else f"{'':6s}"
            out.append(f"{r['bench']:8s} {r['case']:34s} {r['op']:15s} {r['variant']:52s} "
                       f"{r['median_ms']:10.3f} {r['gbps']:8.2f} {r.get('x_floor', float('nan')):8.2f} "
                       f"{speedup:8.2f} {x_cpp} {r.get('aten_ops', ''):>8} "
                       f"{r.get('host_syncs', ''):>6}")
        return "\n".join(out)


# ---------------------------------------------------------------- running Megatron-Core's own code on CPU


@contextlib.contextmanager
def megatron_on_cpu():
    """Megatron-Core's own gradient helpers on CPU tensors: leanstep.megatron.cpu's
    shims for their device='cuda' scalars (clip_grads, utils) and for clip's
    CUDA grad-type assertion, entered per call as before."""
    with mcpu.cuda_literals(), mcpu.cuda_type_names():
        yield


def init_process_group(backend="gloo"):
    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.distributed.init_process_group(backend, rank=0, world_size=1)


class Param:
    """What Megatron-Core's clip reads: an object with .grad."""

    def __init__(self, grad):
        self.grad = grad


# ---------------------------------------------------------------- gradient engine


def grad_layouts(quick):
    # The seed's layout, as the host-cost model (leanstep.hostcost) builds it.
    yield (hostcost.SEED_LAYOUT, hostcost.seed_layout_params(), dict(hostcost.SEED_LAYOUT_OPTIONS))
    yield ("dense-101m-fp32-distopt-dp6", leanstep.model_params("dense_100m"),
           dict(distributed_optimizer=True, dp_size=6, bucket_size=40_000_000))


def bench_grad(results, args):
    import megatron.core.optimizer.clip_grads as clip_grads

    init_process_group()
    meg_norm = clip_grads.get_grad_norm_fp32
    meg_clip = clip_grads.clip_grad_by_total_norm_fp32
    gen = torch.Generator().manual_seed(1)
    reps, secs = (3, 0.05) if args.quick else (7, 0.4)
    for case, params, options in grad_layouts(args.quick):
        buffers, grads, _ = leanstep.ddp_grad_buffers(params, **options)
        for b in buffers:
            b.uniform_(-1, 1, generator=gen)
        plan = leanstep.GradPlan(grads)
        nbytes = plan.touched_bytes
        print(f"{case}: {plan.num_tensors} grads, {nbytes / 2**20:.1f} MiB, "
              f"{plan.num_regions} regions", file=sys.stderr)
        norm, found_inf = plan.norm()
        norm_value = float(norm.item())  # read once here, not inside the timed calls
        max_norm = norm_value * (1 - 1e-6)  # every clip multiplies by just under 1
        torch_plan = leanstep.GradPlan(grads, backend="torch")  # the device backend, on CPU
        # Parameters for torch.nn.utils.clip_grad_norm_: zero-stride stand-ins
        # (no memory) whose .grad are the buffer views.
        tparams = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros(1).expand(g.shape), requires_grad=True)
            p.grad = g
            tparams.append(p)
        mparams = [Param(g) for g in grads]

        def torch_loop_norm():
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
            return torch.linalg.vector_norm(torch.stack(norms), 2.0).item()

        def foreach_norm():
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0).item()

        def flat_norm():
            return torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(b, 2.0) for b in buffers]), 2.0).item()

        coeff_t = torch.tensor(1 - 1e-6)

        def loop_clip():
            for g in grads:
                g.mul_(coeff_t)

        def foreach_clip():
            torch._foreach_mul_(grads, coeff_t)

        total = None

        def meg_norm_call():
            nonlocal total
            with megatron_on_cpu():
                total = meg_norm(grads)

        def meg_clip_call():
            with megatron_on_cpu():
                meg_clip(mparams, max_norm, norm_value)

        def meg_norm_clip():
            with megatron_on_cpu():
                t = meg_norm(grads)
                meg_clip(mparams, t * (1 - 1e-6), t)

        lm.install(["get_grad_norm_fp32", "clip_grad_by_total_norm_fp32"])
        patched_norm = clip_grads.get_grad_norm_fp32
        patched_clip = clip_grads.clip_grad_by_total_norm_fp32
        lm.uninstall()

        def patched_norm_clip():
            t = patched_norm(grads)
            patched_clip(mparams, t * (1 - 1e-6), t)

        ops = [
            ("norm", nbytes, "read", [
                ("torch per-tensor loop", torch_loop_norm),
                ("torch._foreach_norm", foreach_norm),
                ("torch one norm of flat buffers", flat_norm),
                ("megatron get_grad_norm_fp32", meg_norm_call),
                ("leanstep GradPlan.norm", lambda: plan.norm()),
                ("megatron patched by leanstep", lambda: patched_norm(grads)),
            ]),
            ("clip", 2 * nbytes, "inplace", [
                ("torch per-tensor mul_", loop_clip),
                ("torch._foreach_mul_", foreach_clip),
                ("megatron clip_grad_by_total_norm", meg_clip_call),
                ("leanstep GradPlan.clip_", lambda: plan.clip_(max_norm, norm)),
                ("megatron patched by leanstep", lambda: patched_clip(mparams, max_norm,
                                                                      norm_value)),
            ]),
            ("norm_clip", 2 * nbytes, "copy", [
                ("torch clip_grad_norm_ foreach=False",
                 lambda: torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=False)),
                ("torch clip_grad_norm_ foreach=True",
                 lambda: torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=True)),
                ("megatron norm + clip", meg_norm_clip),
                ("leanstep GradPlan.norm_clip_", lambda: plan.norm_clip_(max_norm)),
                ("leanstep torch-op backend (on CPU)", lambda: torch_plan.norm_clip_(max_norm)),
                ("megatron patched by leanstep", patched_norm_clip),
            ]),
        ]
        for op, op_bytes, access, variants in ops:
            for variant, fn in variants:
                ms = time_it(fn, reps, secs)
                results.add("grad", case, op, variant, ms, op_bytes, access, audited(fn))
        # What the patch itself costs on the host: the patched Megatron call
        # against the direct leanstep call, timed alternately (paired medians).
        direct_ms, patched_ms = [], []
        for _ in range(3):
            direct_ms.append(time_it(lambda: plan.norm(), reps, secs))
            patched_ms.append(time_it(lambda: patched_norm(grads), reps, secs))
        ratio = statistics.median(p / d for p, d in zip(patched_ms, direct_ms))
        results.overheads.append({"bench": "grad", "case": case, "op": "norm",
                                  "patched_over_direct": round(ratio, 3),
                                  "direct_ms": round(statistics.median(direct_ms), 4),
                                  "patched_ms": round(statistics.median(patched_ms), 4)})
        print(f"  {case}: megatron patched / leanstep direct (norm) = {ratio:.3f}x",
              file=sys.stderr)
        del buffers, grads, plan, torch_plan, tparams, mparams


# ---------------------------------------------------------------- RMSNorm


class HFRMSNorm(torch.nn.Module):
    """The Hugging Face Llama/Qwen3 RMSNorm composite."""

    def __init__(self, hidden, eps=1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def bench_rmsnorm(results, args):
    reps, secs = (3, 0.05) if args.quick else (7, 0.4)
    cases = [(8192, 2048, torch.float32), (8192, 2048, torch.bfloat16),
             (4096, 5120, torch.float32), (4096, 5120, torch.bfloat16)]
    gen = torch.Generator().manual_seed(2)
    for rows, hidden, dtype in cases:
        case = f"{rows}x{hidden}_{'fp32' if dtype == torch.float32 else 'bf16'}"
        es = torch.finfo(dtype).bits // 8
        n = rows * hidden
        act, weight_b, stats = es * n, es * hidden, 4 * rows
        fwd_bytes = act + weight_b + act + stats
        fwd_bwd_bytes = fwd_bytes + (act + act + stats + weight_b + act)
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        dy = torch.randn(rows, hidden, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        hf = HFRMSNorm(hidden, dtype=dtype)
        tn = torch.nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        ln = lt.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        for m in (hf, tn, ln):
            with torch.no_grad():
                m.weight.copy_(w)
            m.weight.requires_grad_(False)  # frozen (LoRA)
        modules = [("HF composite (cast then scale)", hf),
                   ("torch.nn.functional.rms_norm", tn),
                   ("leanstep.torch.RMSNorm frozen", ln)]
        # The C++ kernels into outputs allocated once: the figure each Python
        # call into fresh outputs is compared with.
        y, rstd, dx = torch.empty_like(x), torch.empty(rows), torch.empty_like(x)
        context = dict(lt._no_features(), weight_requires_grad=False)

        def cpp_fwd():
            leanstep._leanstep.rmsnorm_forward_routed(x, w, y, rstd, 1e-6, False,
                                                      "scale_then_cast", **context)

        def cpp_fwd_bwd():
            cpp_fwd()
            leanstep._leanstep.rmsnorm_backward_routed(dy, x, rstd, w, dx, None, 0.0, False,
                                                       **context)

        xg = x.clone().requires_grad_()
        for op, cpp, nbytes in (("forward", cpp_fwd, fwd_bytes),
                                ("fwd_bwd_frozen", cpp_fwd_bwd, fwd_bwd_bytes)):
            def call(m, op=op):
                if op == "forward":
                    with torch.no_grad():
                        m(x)
                else:
                    xg.grad = None
                    m(xg).backward(dy)

            for variant, m in modules:
                settings = OUTPUT_SETTINGS if m is ln else [("", True, True)]
                for label, pool, huge in settings:
                    fn = functools.partial(call, m)
                    with output_setting(pool, huge):
                        ms = time_it(fn, reps, secs)
                        x_cpp = paired_ratio(fn, cpp, reps, secs) if m is ln else None
                        results.add("rmsnorm", case, op, variant + label, ms, nbytes, "copy",
                                    audited(fn), x_cpp)
            results.add("rmsnorm", case, op, "C++ kernels, outputs reused", time_it(cpp, reps, secs),
                        nbytes, "copy")
        assert ln.last_decision["path"] == "frozen_fused", ln.last_decision


# ---------------------------------------------------------------- MoE


def bench_moe(results, args):
    import megatron.core.transformer.moe.moe_utils as moe_utils

    reps, secs = (3, 0.05) if args.quick else (7, 0.4)
    T, E, k, H = 4096, 128, 8, 2048
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(T, E, generator=gen)
    routing_map, probs, _ = leanstep.moe_route(logits, k)
    N = int(routing_map.sum())
    for dtype in (torch.float32, torch.bfloat16):
        case = f"T{T}_E{E}_k{k}_H{H}_{'fp32' if dtype == torch.float32 else 'bf16'}"
        es = torch.finfo(dtype).bits // 8
        token_b, slot_b = es * T * H, es * N * H
        permute_bytes = token_b + T * E + 4 * T * E + slot_b + 8 * N + 4 * N
        unpermute_bytes = slot_b + 8 * N + 4 * N + token_b
        tokens = torch.randn(T, H, generator=gen).to(dtype)
        with torch.no_grad():
            permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs)
            # The C++ kernels into outputs allocated once.
            cpp_permuted, cpp_probs, cpp_idx = (torch.empty_like(permuted),
                                                torch.empty_like(pprobs), torch.empty_like(idx))
            cpp_out = torch.empty_like(tokens)

            def cpp_permute():
                leanstep._leanstep.moe_permute(tokens, routing_map, probs, None, False, "auto",
                                               cpp_permuted, cpp_probs, cpp_idx)

            def cpp_unpermute():
                leanstep._leanstep.moe_unpermute(permuted, idx, cpp_out, probs, routing_map,
                                                 False, "auto")

            ops = [
                ("permute", permute_bytes, cpp_permute,
                 ("megatron moe_utils.permute",
                  lambda: moe_utils.permute(tokens, routing_map, probs)),
                 ("leanstep moe_permute (fused)",
                  lambda: leanstep.moe_permute(tokens, routing_map, probs))),
                ("unpermute", unpermute_bytes, cpp_unpermute,
                 ("megatron moe_utils.unpermute",
                  lambda: moe_utils.unpermute(permuted, idx, (T, H), probs=probs,
                                              routing_map=routing_map)),
                 ("leanstep moe_unpermute (fused)",
                  lambda: leanstep.moe_unpermute(permuted, idx, (T, H), probs=probs,
                                                 routing_map=routing_map))),
            ]
            for op, nbytes, cpp, (peer, peer_fn), (mine, mine_fn) in ops:
                results.add("moe", case, op, peer, time_it(peer_fn, reps, secs), nbytes, "copy",
                            audited(peer_fn))
                for label, pool, huge in OUTPUT_SETTINGS:
                    with output_setting(pool, huge):
                        results.add("moe", case, op, mine + label, time_it(mine_fn, reps, secs),
                                    nbytes, "copy", audited(mine_fn),
                                    paired_ratio(mine_fn, cpp, reps, secs))
                results.add("moe", case, op, "C++ kernel, outputs reused",
                            time_it(cpp, reps, secs), nbytes, "copy")
        del tokens, permuted


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--only", default="grad,rmsnorm,moe", help="comma-separated areas")
    parser.add_argument("--json", action="store_true", help="JSON lines only (no table)")
    args = parser.parse_args()
    areas = [a for a in args.only.split(",") if a]
    results = Results(args)
    bw_bytes = (128 if args.quick else 256) << 20
    for access in ("read", "inplace", "copy"):
        results.floors[access] = leanstep.measure_bandwidth(access, bw_bytes)["gbps"]
    print(f"bandwidth floors (GB/s, {leanstep.num_threads()} threads): "
          + ", ".join(f"{a} {g:.1f}" for a, g in results.floors.items()), file=sys.stderr)
    for area in areas:
        if area not in leanstep.areas:
            print(f"skipping {area}: not built into leanstep", file=sys.stderr)
            continue
        {"grad": bench_grad, "rmsnorm": bench_rmsnorm, "moe": bench_moe}[area](results, args)
    if not args.json:
        print(f"leanstep {leanstep.__version__} vs peers (torch {torch.__version__}, "
              f"megatron-core {lm.report()['megatron_core_version']}); "
              f"{leanstep.num_threads()} threads; floors GB/s: "
              + ", ".join(f"{a} {g:.1f}" for a, g in results.floors.items()))
        print("speedup = first variant of the op / this variant; x floor = median / "
              "(bytes / bandwidth of the op's access pattern)\n")
        print(results.table())
        print()
        for o in results.overheads:
            print(f"host overhead of the patch ({o['case']}, {o['op']}): megatron patched "
                  f"{o['patched_ms']:.3f} ms / leanstep direct {o['direct_ms']:.3f} ms = "
                  f"{o['patched_over_direct']:.3f}x (paired medians)")
        print()
    for access, gbps in results.floors.items():
        print(json.dumps({"bench": "peers", "case": "bandwidth", "op": access,
                          "variant": "measured", "gbps": round(gbps, 3)}))
    for row in results.rows:
        print(json.dumps(row))
    for o in results.overheads:
        print(json.dumps(dict(o, variant="patched_over_direct")))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
