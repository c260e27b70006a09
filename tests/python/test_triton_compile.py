"""Every Triton kernel variant the host code launches compiles for an NVIDIA
GPU (sm_90: the H100 / H200), here, without one.

Triton's interpreter runs the kernels as Python and never sees what the
compiler refuses (a name bound to two types in the branches of a runtime
`if`, a scalar where a tensor is needed, an unsupported cast). This module
runs itself as a script in a fresh process: triton imported without
TRITON_INTERPRET, a stand-in driver that answers "cuda, sm_90" (no device
is touched), and the launcher switched to compile-only (``warmup=True``:
source -> TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas).
Then the host code of every op runs on CPU tensors, so each constexpr
combination it passes is compiled. Results are not computed (nothing is
launched): that is the tests' job, under the interpreter or on a GPU.
"""

import collections
import os
import subprocess
import sys

import pytest


def test_every_kernel_variant_compiles_for_sm90():
    pytest.importorskip("triton")
    import leanstep

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(leanstep.__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    print(run.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the script


class _StandInDriver:
    """What the launcher asks of a driver before it compiles."""

    def __init__(self, arch=90):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


def _compile_everything():
    import torch
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_StandInDriver())
    import leanstep
    from leanstep.backends import triton_common as tc
    from leanstep.backends import triton_grad as tg
    from leanstep.backends import triton_moe as tmo
    from leanstep.backends import triton_rmsnorm as tr

    assert not tc.INTERPRETED, "TRITON_INTERPRET is set: nothing would be compiled"
    compiled = collections.Counter()
    original_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled[self.fn.__name__] += 1
        return kernel

    JITFunction.run = compile_only
    # The host code on CPU tensors, as if they were device tensors.
    tc.check_device = lambda device, where, what: None
    tg.defaults = lambda device: (tg.DEVICE_CHUNK, tg.DEVICE_BLOCK)
    tc.max_programs = lambda device: 1056
    tmo.tm.assert_rows_cover_routed = lambda *args: None  # counts are never computed here
    cpu = torch.device("cpu")

    # Gradient engine: every norm kind, unscale mode, finish mode, clip / scale mode.
    buf = torch.zeros(100_000)
    grads = [buf[:40_000], buf[40_064:99_000]]
    plan = tg.TritonGradPlan(grads, cpu)
    assert plan.aligned
    odd = tg.TritonGradPlan([buf[1:5000]], cpu)  # a 4-byte-aligned start: no alignment hint
    assert not odd.aligned
    mixed = torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(4096, dtype=torch.float64)
    fallback = tg.TritonGradPlan([buf[:1000], buf[:1000], buf[2000:2064].view(8, 8).t()], cpu)
    flag = torch.zeros(1)
    for p in (2.0, 1.0, float("inf")):
        for pl in (plan, fallback):
            pl.norm(p, None, None)
            pl.norm(p, None, flag, torch.tensor([0.5]))
        plan.norm(p, None, flag, 0.5)
        plan.norm(p, torch.empty(1), flag)
    odd.norm(2.0, None, None)
    tg.TritonGradPlan(list(mixed), cpu).norm(2.0, None, None)
    plan.unscale(torch.tensor([0.5]), flag)
    plan.unscale(0.5, flag)
    for pl in (plan, odd):
        pl.clip(torch.tensor([2.0]), 1.0, None)
        pl.clip(2.0, 1.0, torch.empty(1))
        pl.scale(torch.tensor([0.5]))
        pl.scale(0.5)
        pl.count_zeros(None)
    fallback.count_zeros(None)
    for scale in (0.5, torch.tensor([0.5])):
        tg.multi_tensor_scale([mixed[0], buf[:100]], [mixed[1][:4096], buf[200:300]], scale,
                              torch.zeros(1), cpu)

    # RMSNorm: dtypes, single-block and looped rows, zero-centered gamma, both roundings,
    # frozen and trainable backward.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for hidden in (2048, 9000):
            x = torch.zeros(4, hidden, dtype=dtype)
            w = torch.ones(hidden, dtype=dtype)
            for zc, rounding in ((False, "scale_then_cast"), (True, "cast_then_scale")):
                _, rstd = tr.forward(x, w, 1e-6, zc, rounding)
                for trainable in (False, True):
                    tr.backward(x, x, torch.ones(4), w, zc, trainable)
        tr.forward(torch.zeros(4, 2048, dtype=dtype), torch.ones(2048), 1e-6)  # fp32 weight

    # MoE: permute with and without probs, drop-and-pad; unpermute's three probs forms.
    T, E, k, H = 64, 8, 2, 2048
    gen = torch.Generator().manual_seed(0)
    routing_map, probs, _ = leanstep.moe_route(torch.randn(T, E, generator=gen), k)
    for dtype in (torch.float32, torch.bfloat16):
        tokens = torch.zeros(T, H, dtype=dtype)
        tmo.permute(tokens, routing_map, probs, T * k)
        tmo.permute(tokens, routing_map, None, T * k)
        tmo.permute(tokens, routing_map, probs, E * 16, True)
        permuted, pprobs, idx = leanstep.moe_permute(tokens, routing_map, probs, T * k)
        tmo.unpermute(permuted, idx, (T, H), probs=probs, routing_map=routing_map)
        tmo.unpermute(permuted, idx, (T, H), probs=pprobs)
        tmo.unpermute(permuted, idx, (T, H))
    JITFunction.run = original_run
    expected = {"_reduce_kernel", "_finish_kernel", "_scale_kernel", "_zeros_kernel",
                "_zeros_finish_kernel", "_mts_kernel", "_forward_kernel", "_backward_kernel",
                "_dgamma_kernel", "_rank_kernel", "_scatter_kernel", "_gather_kernel",
                "_unpermute_kernel"}
    missing = expected - set(compiled)
    assert not missing, f"never compiled: {sorted(missing)}"
    print(f"compiled for sm_90: {sum(compiled.values())} launches of {len(compiled)} kernels "
          f"({', '.join(f'{k} {v}' for k, v in sorted(compiled.items()))})")


if __name__ == "__main__":
    _compile_everything()
