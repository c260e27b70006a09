"""The sync-free optimizer step on a device (scripts/gpu-check.sh, step 1).

leanstep.megatron.step's masked Adam update against torch's own AdamW as
Megatron-Core builds it without Transformer Engine or apex (torch's default
implementation for the device: foreach on CUDA, the for-loop on the CPU) on the
same device: 12 steps, 4 of them skipped with non-finite grads, with fp32
parameters and then bf16 ones (whose ops torch computes in fp32, rounding once:
the masked step's other branch). Prints, per step, whether parameters, moments
and step counters match torch's (bit for bit, or the largest difference in ulps
of their dtype: the bias corrections are float64 on the device here, Python
floats on the host there), the host syncs of one masked step
(leanstep.audit; exact on a device: must be 0), and the host time of both steps.
With megatron-core installed, the device loss scale is checked against
DynamicGradScaler's trajectory too.

    python bench/gpu_step.py [--cpu-smoke]

Exit status 0 when the masked step makes no host sync, skips exactly (a skipped
step changes no bit) and stays within 1 ulp of torch, for both dtypes.
"""

import argparse
import math
import sys
import time

import torch

import leanstep
from leanstep.megatron import step as lstep


_INT_OF = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF),
           torch.float16: (torch.int16, 0x7FFF)}


def ulps(a, b):
    """Largest distance in ulps of their dtype between two tensors (0 when equal)."""
    view, magnitude = _INT_OF[a.dtype]
    ia = a.contiguous().view(view).to(torch.int64)
    ib = b.contiguous().view(view).to(torch.int64)
    ia = torch.where(ia < 0, -(ia & magnitude), ia)  # a monotone integer line
    ib = torch.where(ib < 0, -(ib & magnitude), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="run on the CPU (script logic only)")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    sync = (lambda: None) if args.cpu_smoke else torch.cuda.synchronize
    passed = True
    # fp32 parameters, then bf16 ones (torch computes their ops in fp32 and rounds once:
    # the masked step's other branch)
    for dtype in (torch.float32, torch.bfloat16):
        print(f"-- {str(dtype).removeprefix('torch.')} parameters")
        passed &= run(dev, sync, dtype)
    passed &= loss_scale_follows_megatron(args.cpu_smoke)
    print(f"sync-free step, all: {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


def run(dev, sync, dtype):
    gen = torch.Generator().manual_seed(1234)
    shapes = [(8, 256), (256, 8), (384, 8), (512, 8)] * 36  # 144 LoRA-like tensors
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    ref_params = [torch.nn.Parameter(t.to(dev)) for t in init]
    our_params = [torch.nn.Parameter(t.to(dev)) for t in init]
    # foreach left to torch, as Megatron-Core leaves it
    ref = torch.optim.AdamW(ref_params, lr=1e-3, weight_decay=0.01)
    ours = torch.optim.AdamW(our_params, lr=1e-3, weight_decay=0.01)
    skipped = {3, 4, 8, 9}
    worst, exact_skips, ok = 0, True, True
    times = {"torch": [], "masked": []}
    for step in range(12):
        grads = [(torch.randn(s, generator=gen) * 1e-2).to(dtype).to(dev) for s in shapes]
        skip = step in skipped
        before = [p.detach().clone() for p in our_params]
        if skip:
            grads[0].view(-1)[0] = math.inf
        else:
            for p, g in zip(ref_params, grads):
                p.grad = g.clone()
            sync()
            t = time.perf_counter()
            ref.step()
            sync()
            times["torch"].append(time.perf_counter() - t)
        for p, g in zip(our_params, grads):
            p.grad = g.clone()
        found = torch.tensor([1.0 if skip else 0.0], device=dev)
        sync()
        t = time.perf_counter()
        if step == 5:
            with leanstep.audit() as a:
                lstep.masked_adam_step(ours, found)
            syncs = a.num_syncs
            for where, count in a.syncs.items():  # where any came from: op, device, call site
                print(f"  host sync x{count}: {where}")
        else:
            lstep.masked_adam_step(ours, found)
        sync()
        times["masked"].append(time.perf_counter() - t)
        if skip:
            exact_skips &= all(torch.equal(p.detach(), b) for p, b in zip(our_params, before))
        diff = 0
        for a_, b_ in zip(ref_params, our_params):
            sa, sb = ref.state.get(a_, {}), ours.state[b_]
            diff = max(diff, ulps(a_.detach(), b_.detach()))
            if sa:
                diff = max(diff, ulps(sa["exp_avg"], sb["exp_avg"]),
                           ulps(sa["exp_avg_sq"], sb["exp_avg_sq"]))
                ok &= float(sa["step"]) == float(sb["step"])
        worst = max(worst, diff)
        print(f"step {step:2d} {'skipped' if skip else 'taken  '}  max diff vs torch: "
              f"{diff} ulps")
    median = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    print(f"host syncs of one masked step: {syncs} (leanstep.audit on {dev.type})")
    print(f"step time, median: torch AdamW (its default) {median['torch']:.3f} ms, "
          f"masked {median['masked']:.3f} ms ({len(shapes)} tensors)")
    passed = ok and syncs == 0 and exact_skips and worst <= 1
    print(f"sync-free step: {'PASS' if passed else 'FAIL'} (syncs {syncs}, skips exact "
          f"{exact_skips}, worst {worst} ulps)")
    return passed


def loss_scale_follows_megatron(cpu_smoke):
    """The device loss scale against DynamicGradScaler's trajectory (needs
    megatron-core: True without it, said so)."""
    ok = True
    try:
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    except ImportError as e:
        print(f"loss scale: megatron-core not importable ({e}); skipped")
    else:
        if cpu_smoke:
            from leanstep.megatron import cpu as mcpu
            ctx = mcpu.megatron_on_cpu()
        else:
            import contextlib
            ctx = contextlib.nullcontext()
        with ctx:
            theirs = DynamicGradScaler(2.0 ** 12, 2.0 ** 9, 2.0, 0.5, 3, 2)
            mine = DynamicGradScaler(2.0 ** 12, 2.0 ** 9, 2.0, 0.5, 3, 2)
            same = True
            for f in (0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0):
                theirs.update(bool(f))
                lstep.update_scaler_on_device(mine, torch.tensor([float(f)], device=mine.scale.device))
                same &= torch.equal(mine.scale, theirs.scale)
            print(f"loss scale on the device follows DynamicGradScaler: {same}")
            ok &= same
    return ok


if __name__ == "__main__":
    sys.exit(main())
