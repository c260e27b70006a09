#!/usr/bin/env python3
"""leanstep's Triton kernels against their peers on one accelerator, in one process.

    python bench/gpu_check.py [--json FILE] [--reps N]     # on a CUDA GPU
    python bench/gpu_check.py --cpu-smoke [--json FILE]     # the same logic on the CPU

Cases (GPU sizes; --cpu-smoke shrinks them and runs the Triton kernels in
Triton's interpreter, Megatron-Core's helpers under leanstep.megatron.cpu's
shims, so every code path of this script runs on a machine without a GPU):

- grad norm + clip, the Qwen3-Omni-30B-A3B LoRA r8 EP8 rank layout
  (``leanstep.model_params("qwen3_omni_lora")``, Megatron-Core DDP buffers,
  distributed optimizer, dp 8: 3168 fp32 grads): leanstep Triton
  (``GradPlan(backend="triton").norm_clip_``), leanstep torch-op backend,
  ``torch.nn.utils.clip_grad_norm_(foreach=True)``, Megatron-Core
  ``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32``;
- frozen RMSNorm [8192, 2048] bf16, forward and forward + backward (dx only):
  ``leanstep.torch.RMSNorm(backend="triton")`` vs ``torch.nn.functional.rms_norm``;
- MoE permute / unpermute, T 4096, E 128, top-8, H 2048 bf16: leanstep's
  Triton kernels (the default on a GPU) and its torch-op backend, both through
  ``leanstep.moe_permute`` / ``moe_unpermute`` with ``backend=`` forced, vs
  Megatron-Core ``moe_utils.permute`` / ``unpermute``.

Per variant: median ms (CUDA events on a GPU), kernel launches of one call
(CUDA kernels and memory operations seen by torch.profiler on a GPU; on the
CPU the aten ops), Triton launches (a hook on Triton's launcher), host syncs
of one call (leanstep.audit), GB/s of the minimum traffic and its share of
the device copy bandwidth measured in the same run (``dst.copy_(src)`` of
a large buffer: 2 bytes moved per byte copied). Prints a table and writes
one JSON object per row (and a header object) with --json.
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

SMOKE = "--cpu-smoke" in sys.argv
if SMOKE:  # before anything imports triton: the interpreter runs CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

import leanstep  # noqa: E402
import leanstep.torch as lt  # noqa: E402
from leanstep import _backend  # noqa: E402
from leanstep._grad import ddp_grad_buffers  # noqa: E402


# ---------------------------------------------------------------- measuring


class Device:
    def __init__(self, smoke):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn, reps, warmup=2, setup=None):
        """Median ms of `reps` calls (CUDA events around each call on a GPU)."""
        for _ in range(warmup):
            if setup:
                setup()
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if setup:
                setup()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def counts(self, fn, setup=None):
        """One call: kernel launches, Triton launches, host syncs (and aten ops)."""
        from leanstep.backends import triton_common

        if setup:
            setup()
        self.sync()
        kernels = None
        if self.device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                self.sync()
            kernels = sum(1 for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA)
            if setup:
                setup()
        with leanstep.audit() as audit, triton_common.count_launches() as launches:
            fn()
        self.sync()
        return {"kernels": kernels, "triton_launches": sum(launches.values()),
                "aten_ops": audit.num_ops - audit.num_view_ops, "host_syncs": audit.num_syncs,
                "host_reads": audit.num_device_reads}

    def copy_bandwidth(self, nbytes, reps):
        """GB/s moved by a device copy (read + write) of `nbytes`."""
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=self.device).fill_(1.0)
        dst = torch.empty_like(src)
        ms = self.time_ms(lambda: dst.copy_(src), reps)
        del src, dst
        return 2 * nbytes / (ms * 1e-3) / 1e9


class Table:
    def __init__(self, copy_gbps):
        self.rows = []
        self.copy_gbps = copy_gbps

    def add(self, case, variant, ms, nbytes, counts, note=None):
        gbps = nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("nan")
        row = {"case": case, "variant": variant, "median_ms": round(ms, 4), "bytes": int(nbytes),
               "gbps": round(gbps, 2), "copy_share": round(gbps / self.copy_gbps, 3)}
        row.update(counts)
        if note:
            row["note"] = note
        self.rows.append(row)
        print(f"  {case:30s} {variant:44s} {ms:9.3f} ms", file=sys.stderr, flush=True)

    def skip(self, case, variant, why):
        self.rows.append({"case": case, "variant": variant, "skipped": why})
        print(f"  {case:30s} {variant:44s} skipped: {why}", file=sys.stderr, flush=True)

    def format(self):
        head = (f"{'case':30s} {'variant':44s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s} "
                f"{'kernels':>8s} {'triton':>7s} {'aten':>6s} {'syncs':>6s}")
        out = [head, "-" * len(head)]
        for r in self.rows:
            if "skipped" in r:
                out.append(f"{r['case']:30s} {r['variant']:44s} skipped: {r['skipped']}")
                continue
            kernels = "-" if r["kernels"] is None else str(r["kernels"])
            out.append(f"{r['case']:30s} {r['variant']:44s} {r['median_ms']:9.3f} "
                       f"{r['gbps']:8.1f} {r['copy_share']:8.2f} {kernels:>8s} "
                       f"{r['triton_launches']:>7d} {r['aten_ops']:>6d} {r['host_syncs']:>6d}")
        return "\n".join(out)


# ---------------------------------------------------------------- Megatron-Core


def megatron_modules():
    """(clip_grads, moe_utils, version) or raises ImportError."""
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from importlib.metadata import version

    return clip_grads, moe_utils, version("megatron-core")


def init_process_group(dev):
    """One rank: Megatron's norm all-reduces over the default group."""
    if torch.distributed.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if dev.device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, rank=0, world_size=1)


@contextlib.contextmanager
def megatron_device(dev):
    """Megatron's helpers write device='cuda' scalars and assert CUDA grad
    types: on the CPU, leanstep.megatron.cpu's shims answer them."""
    if dev.device.type == "cuda":
        yield
        return
    import leanstep.megatron.cpu as mcpu

    with mcpu.cuda_literals(), mcpu.cuda_type_names():
        yield


class Param:
    """What Megatron-Core's clip reads: an object with .grad."""

    def __init__(self, grad):
        self.grad = grad


# ---------------------------------------------------------------- cases


def bench_grad(dev, table, args, megatron):
    params = leanstep.model_params("qwen3_omni_lora", 8, 8)
    if dev.smoke:  # both buffers (dense and expert) stay, with few params
        params = params[:40]
    buffers, grads, _ = ddp_grad_buffers(params, distributed_optimizer=True, dp_size=8,
                                         device=dev.device)
    gen = torch.Generator(device=dev.device).manual_seed(1)
    for b in buffers:
        b.uniform_(-1e-3, 1e-3, generator=gen)
    plan = leanstep.GradPlan(grads, backend="triton")
    torch_plan = leanstep.GradPlan(grads, backend="torch")
    nbytes = plan.touched_bytes
    case = f"norm+clip lora {len(grads)} grads"
    print(f"{case}: {nbytes / 2**20:.1f} MiB in {plan.num_regions} regions, "
          f"{plan._torch_plan.num_chunks} chunks", file=sys.stderr)
    norm, _ = plan.norm()
    norm_torch, _ = torch_plan.norm()
    max_norm = float(norm) * (1 - 1e-6)  # every clip multiplies by just under 1
    agree = abs(float(norm) - float(norm_torch)) <= 4 * 2.0**-24 * float(norm)
    tparams = []
    for g in grads:  # zero-stride stand-ins whose .grad are the buffer views
        p = torch.nn.Parameter(torch.zeros(1, device=dev.device).expand(g.shape))
        p.grad = g
        tparams.append(p)
    traffic = 3 * nbytes  # norm reads every grad once, clip reads and writes it
    variants = [
        ("leanstep triton norm_clip_", lambda: plan.norm_clip_(max_norm)),
        ("leanstep torch-op backend norm_clip_", lambda: torch_plan.norm_clip_(max_norm)),
        ("torch clip_grad_norm_ foreach=True",
         lambda: torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=True)),
    ]
    if megatron is not None:
        clip_grads = megatron[0]
        init_process_group(dev)
        mparams = [Param(g) for g in grads]

        def meg_norm_clip():
            with megatron_device(dev):
                total = clip_grads.get_grad_norm_fp32(grads)
                clip_grads.clip_grad_by_total_norm_fp32(mparams, max_norm, total)

        variants.append(("megatron get_grad_norm + clip_by_total", meg_norm_clip))
    else:
        table.skip(case, "megatron norm + clip", args.megatron_missing)
    for variant, fn in variants:
        ms = dev.time_ms(fn, args.reps)
        note = None if variant != variants[0][0] else f"norm agrees with torch-op: {agree}"
        table.add(case, variant, ms, traffic, dev.counts(fn), note)


def bench_rmsnorm(dev, table, args):
    rows, hidden, dtype = (64, 256, torch.bfloat16) if dev.smoke else (8192, 2048, torch.bfloat16)
    gen = torch.Generator(device=dev.device).manual_seed(2)
    x = torch.randn(rows, hidden, generator=gen, device=dev.device).to(dtype)
    dy = torch.randn(rows, hidden, generator=gen, device=dev.device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=dev.device)).to(dtype)
    ln = lt.RMSNorm(hidden, eps=1e-6, dtype=dtype, device=dev.device, backend="triton")
    with torch.no_grad():
        ln.weight.copy_(w)
    ln.weight.requires_grad_(False)
    act = x.numel() * x.element_size()
    fwd_bytes = 2 * act + 4 * rows
    fwd_bwd_bytes = fwd_bytes + 3 * act + 4 * rows
    case = f"rmsnorm frozen {rows}x{hidden} bf16"
    xg = x.clone().requires_grad_()

    def reset():
        xg.grad = None

    def torch_fwd():
        with torch.no_grad():
            torch.nn.functional.rms_norm(x, (hidden,), w, 1e-6)

    def leanstep_fwd():
        with torch.no_grad():
            ln(x)

    def torch_fwd_bwd():
        torch.nn.functional.rms_norm(xg, (hidden,), w, 1e-6).backward(dy)

    def leanstep_fwd_bwd():
        ln(xg).backward(dy)

    for variant, fn, nbytes, setup in [
            ("forward torch.nn.functional.rms_norm", torch_fwd, fwd_bytes, None),
            ("forward leanstep triton", leanstep_fwd, fwd_bytes, None),
            ("fwd+bwd (dx) torch.nn.functional.rms_norm", torch_fwd_bwd, fwd_bwd_bytes, reset),
            ("fwd+bwd (dx) leanstep triton", leanstep_fwd_bwd, fwd_bwd_bytes, reset)]:
        ms = dev.time_ms(fn, args.reps, setup=setup)
        table.add(case, variant, ms, nbytes, dev.counts(fn, setup))
    assert ln.last_decision["backend"] == "triton", ln.last_decision


def bench_moe(dev, table, args, megatron):
    T, E, k, H = (64, 8, 2, 32) if dev.smoke else (4096, 128, 8, 2048)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    routing_map, probs, _ = leanstep.moe_route(torch.randn(T, E, generator=gen), k)
    routing_map, probs = routing_map.to(dev.device), probs.to(dev.device)
    tokens = torch.randn(T, H, generator=gen).to(dtype).to(dev.device)
    N = T * k
    es = tokens.element_size()
    permute_bytes = 2 * N * H * es + T * E + 8 * N
    unpermute_bytes = N * H * es + 8 * N + 4 * N + T * H * es
    case = f"moe T{T} E{E} k{k} H{H} bf16"
    with torch.no_grad():
        permuted, _, idx = leanstep.moe_permute(tokens, routing_map, probs, num_out_tokens=N,
                                                backend="torch")
        variants = []
        for name, backend in (("triton", "triton"), ("torch-op backend", "torch")):
            variants += [
                (f"permute leanstep {name}",
                 functools.partial(leanstep.moe_permute, tokens, routing_map, probs,
                                   num_out_tokens=N, backend=backend), permute_bytes),
                (f"unpermute leanstep {name}",
                 functools.partial(leanstep.moe_unpermute, permuted, idx, (T, H), probs=probs,
                                   routing_map=routing_map, backend=backend), unpermute_bytes),
            ]
        if megatron is not None:
            moe_utils = megatron[1]
            m_out = moe_utils.permute(tokens, routing_map, probs, num_out_tokens=N)
            m_permuted, m_idx = m_out[0], m_out[2]
            variants += [
                ("permute megatron moe_utils",
                 lambda: moe_utils.permute(tokens, routing_map, probs, num_out_tokens=N),
                 permute_bytes),
                ("unpermute megatron moe_utils",
                 lambda: moe_utils.unpermute(m_permuted, m_idx, (T, H), probs=probs,
                                             routing_map=routing_map), unpermute_bytes),
            ]
        else:
            table.skip(case, "megatron permute / unpermute", args.megatron_missing)
        for variant, fn, nbytes in variants:
            ms = dev.time_ms(fn, args.reps)
            table.add(case, variant, ms, nbytes, dev.counts(fn))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on the CPU (Triton interpreter): checks the logic")
    parser.add_argument("--json", help="write the rows as JSON lines to this file")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per variant")
    parser.add_argument("--only", default="grad,rmsnorm,moe")
    args = parser.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.cpu_smoke else 30
    dev = Device(args.cpu_smoke)
    if not dev.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --cpu-smoke on a machine without one)",
              file=sys.stderr)
        return 2
    why = _backend.triton_unusable(dev.device)
    if why is not None:
        print(f"gpu_check: Triton cannot run {dev.device} tensors here: {why}", file=sys.stderr)
        return 2
    try:
        megatron = megatron_modules()
        args.megatron_missing = None
    except Exception as e:  # noqa: BLE001 - reported, the rest still runs
        megatron = None
        args.megatron_missing = f"megatron-core not importable ({type(e).__name__}: {e})"
    import triton

    copy_bytes = (16 << 20) if dev.smoke else (1 << 30)
    copy_gbps = dev.copy_bandwidth(copy_bytes, max(args.reps, 5))
    header = {"device": (torch.cuda.get_device_name() if dev.device.type == "cuda" else "cpu"),
              "mode": "cpu-smoke (Triton interpreter)" if dev.smoke else "native",
              "torch": torch.__version__, "triton": triton.__version__,
              "megatron_core": megatron[2] if megatron else None,
              "copy_bandwidth_gbps": round(copy_gbps, 1), "copy_bytes": copy_bytes,
              "reps": args.reps}
    print(json.dumps(header), file=sys.stderr)
    table = Table(copy_gbps)
    only = set(args.only.split(","))
    if "grad" in only:
        bench_grad(dev, table, args, megatron)
    if "rmsnorm" in only:
        bench_rmsnorm(dev, table, args)
    if "moe" in only:
        bench_moe(dev, table, args, megatron)
    print(f"device copy bandwidth: {copy_gbps:.1f} GB/s (read + write of {copy_bytes >> 20} MiB)")
    print(table.format())
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(dict(header, kind="header")) + "\n")
            for row in table.rows:
                f.write(json.dumps(row) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
