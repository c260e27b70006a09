"""The first-use check that lets a device pick leanstep's Triton kernels by itself.

Before a family's Triton kernels (grad, rmsnorm, moe) are chosen
automatically on a device, :func:`check` runs them once there on small inputs
that still cover every code path the family launches (several chunks, mixed
dtypes, a tail block, a non-finite value, rows past the routed pairs) and
compares the results with the torch-op backend on the same device:

- grad: unscale + found_inf and clip with a given norm are bitwise (both
  backends round each product once); the norm agrees within
  ``("grad", "norm_selfcheck")``, 16 fp32 ulp (the two sum in different
  orders; the tests bound each within 2u of a float64 oracle);
- rmsnorm: forward and frozen backward within ``("rmsnorm", "selfcheck")``,
  64 u (2^-24) of the row's largest value plus 2 ulp of the output dtype,
  against the torch-op composite (the tests' bounds, doubled: both sides
  carry their own rounding);
- moe: permute and unpermute bitwise (both follow the reference order).

The bounds are entries of :mod:`leanstep._tolerances`, the table the tests
use.

A failure (a compile error, a launch error, a disagreement) keeps that
family on the torch-op backend for that device and says why in
``leanstep.paths()``. This is a gate against a broken toolchain or a
miscompile, not the test suite: tests/python/test_triton_*.py are the exact
tests (scripts/gpu-check.sh runs them on a GPU).
"""

import torch

from .._tolerances import check as check_tolerance, tolerance

_NORM_BOUND = tolerance("grad", "norm_selfcheck")
_RMSNORM_BOUND = tolerance("rmsnorm", "selfcheck")


def _bits(t):
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view) if t.dtype.is_floating_point else t


def _same_bits(a, b, what):
    if a is None and b is None:
        return None
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bits(a), _bits(b)):
        return f"{what} differs from the torch-op backend"
    return None


def _close(actual, expected, what, dtype, per_row=True):
    """Within ("rmsnorm", "selfcheck") of the torch-op result: 64 u |row max| +
    2 ulp(dtype) |expected| (u = 2^-24)."""
    e = expected.float()
    scale = e.abs().amax(-1, keepdim=True) if per_row and e.dim() > 1 else e.abs().amax()
    if check_tolerance(actual.float(), e, _RMSNORM_BOUND, dtype, scale=scale,
             compute_dtype=torch.float32) is not None:
        return f"{what} is outside the stated bound of the torch-op backend's"
    return None


def _grad(device, gen):
    # The two backends' plans themselves, not GradPlan: no package API from a
    # backend, no counts in the report, and no preset (which would switch a
    # GradPlan's Triton calls to the torch-op code, so the check compared it
    # with itself). Imported here: an import failure is a failed check.
    from . import torch_grad, triton_grad

    shapes = [(40_000, torch.float32), (1000, torch.bfloat16), (17, torch.float16),
              (33_333, torch.float32)]
    made = [torch.randn(n, generator=gen).to(dtype) for n, dtype in shapes]
    made[2][16] = float("inf")  # the flag, in the last element of a small tensor

    def copies():
        return [t.to(device, copy=True) for t in made]

    def plans(mine, ref):
        return triton_grad.TritonGradPlan(mine, device), torch_grad.TorchGradPlan(ref, device)

    mine, ref = copies(), copies()
    p_mine, p_ref = plans(mine, ref)
    f_mine, f_ref = p_mine.scalar(), p_ref.scalar()
    p_mine.unscale(0.5, f_mine)
    p_ref.unscale(0.5, f_ref)
    for i, (a, b) in enumerate(zip(mine, ref)):
        if (why := _same_bits(a, b, f"unscale of grads[{i}]")) is not None:
            return why
    if (why := _same_bits(f_mine, f_ref, "found_inf")) is not None:
        return why
    mine, ref = copies(), copies()
    for t in (mine[2], ref[2]):
        t[16] = 0.25  # finite again: a real norm
    p_mine, p_ref = plans(mine, ref)
    n_mine, _ = p_mine.norm(2.0, None, None)
    n_ref = p_ref.norm(2.0, None, p_ref.scalar())
    if check_tolerance(n_mine, n_ref, _NORM_BOUND, compute_dtype=torch.float32) is not None:
        return "the 2-norm is outside 16 ulp of the torch-op backend's"
    c_mine, c_ref = p_mine.clip(n_ref, 1.0, None), p_ref.clip(n_ref, 1.0, None)
    if (why := _same_bits(c_mine, c_ref, "the clip coefficient")) is not None:
        return why
    for i, (a, b) in enumerate(zip(mine, ref)):
        if (why := _same_bits(a, b, f"clipped grads[{i}]")) is not None:
            return why
    return None


def _rmsnorm(device, gen):
    from . import torch_rmsnorm, triton_rmsnorm

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 300, generator=gen).to(dtype).to(device)
        w = (1 + 0.1 * torch.randn(300, generator=gen)).to(dtype).to(device)
        dy = torch.randn(37, 300, generator=gen).to(dtype).to(device)
        y, rstd = triton_rmsnorm.forward(x, w, 1e-6)
        y_ref, rstd_ref = torch_rmsnorm.forward(x, w, 1e-6, impl="composite")
        if (why := _close(y, y_ref, f"{dtype} forward", dtype)) is not None:
            return why
        if (why := _close(rstd, rstd_ref, "rstd", torch.float32, per_row=False)) is not None:
            return why
        dx = triton_rmsnorm.backward_dx(dy, x, rstd_ref, w)
        dx_ref = torch_rmsnorm.backward_dx(dy, x, rstd_ref, w)
        if (why := _close(dx, dx_ref, f"{dtype} frozen backward", dtype)) is not None:
            return why
    return None


def _moe(device, gen):
    from . import torch_moe, triton_moe

    num_tokens, num_experts, topk, hidden = 67, 6, 2, 130
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    routing_map[:, 1] = False  # an expert with no token
    probs = torch.where(routing_map, scores, torch.zeros(()))
    tokens = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    rows = int(routing_map.sum()) + 3  # rows past the routed pairs
    tokens, routing_map, probs = tokens.to(device), routing_map.to(device), probs.to(device)
    mine = triton_moe.permute(tokens, routing_map, probs, rows)
    ref = torch_moe.permute(tokens, routing_map, probs, rows, False, "fused")
    for name, a, b in zip(("permuted", "permuted_probs", "sorted_indices"), mine, ref):
        if (why := _same_bits(a, b, f"permute's {name}")) is not None:
            return why
    out = triton_moe.unpermute(ref[0], ref[2], (num_tokens, hidden), probs, routing_map)
    out_ref = torch_moe.unpermute(ref[0], ref[2], (num_tokens, hidden), probs, routing_map)
    return _same_bits(out, out_ref, "unpermute")


def check(family, device):
    """None when `family`'s Triton kernels agree with the torch-op backend on
    `device`, else why not (a compile or launch error included)."""
    run = {"grad": _grad, "rmsnorm": _rmsnorm, "moe": _moe}[family]
    gen = torch.Generator().manual_seed(20261201)
    try:
        why = run(device, gen)
    except Exception as e:  # noqa: BLE001 - any failure keeps the torch-op backend
        return f"the {family} self-check raised {type(e).__name__}: {str(e)[:300]}"
    return None if why is None else f"the {family} self-check failed: {why}"
