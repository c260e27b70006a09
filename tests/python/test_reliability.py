"""Regressions for wrong results and hangs a hostile probe found, one test (or
group) per finding, and the property test of the drop-in RMSNorm.

Bounds of the property test. torch.nn.RMSNorm and leanstep both compute
rstd = 1/sqrt(mean(x^2) + eps) in fp32 (fp64 for fp64 inputs) and
y = cast(x * rstd * w): against the float64 oracle each y is within one
rounding to its dtype (1 ulp) plus the fp32 error of rstd, a few units of
u = 2^-24 times log2(H) for blocked sums; 64 u relative covers H up to 2^10
with margin (the same derivation as test_rmsnorm_device.py). dx subtracts
two terms of the row's scale, so its bound is 64 u of the row's largest
term (r |g dy|, and as large again) plus 1 ulp of its dtype. dweight sums dy * xhat over R rows in fp32:
R u of the sum of magnitudes (256 u covers R <= 256) plus 1 ulp. Every
bound adds one subnormal spacing of the dtype (a tiny result's rounding). Both
modules are held to the same bound against the oracle, so they agree with
each other within twice it. An eps ignored or taken in the wrong precision
(bf16's 2^-7 instead of fp32's 2^-23 for eps=None) fails these bounds by
orders of magnitude: the inputs are small enough that eps matters.
"""

import math
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt
from helpers import UNIT_ROUNDOFF, to_f64
from leanstep import GradPlan

U32 = 2.0**-24
ALL_FLOAT = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _rms_oracle(x, w, dy, eps):
    x64, dy64 = to_f64(x), to_f64(dy)
    w64 = np.ones(x64.shape[-1]) if w is None else to_f64(w)
    r = 1.0 / np.sqrt((x64**2).mean(-1, keepdims=True) + eps)
    xhat = x64 * r
    y = xhat * w64
    gdy = w64 * dy64
    dx = r * (gdy - xhat * (gdy * xhat).mean(-1, keepdims=True))
    # dx subtracts two terms; its error scales with their size, not with |dx|
    # (for H = 1 they cancel almost exactly)
    dx_scale = r * (np.abs(gdy) + np.abs(xhat) * np.abs(gdy * xhat).mean(-1, keepdims=True))
    dx_scale = dx_scale.max(-1, keepdims=True) if dx_scale.size else dx_scale
    dw = (dy64 * xhat).reshape(-1, x64.shape[-1]).sum(0)
    dw_scale = np.abs(dy64 * xhat).reshape(-1, x64.shape[-1]).sum(0)
    return y, dx, dx_scale, dw, dw_scale


def _check(actual, expected, dtype, rel, scale, what):
    a = to_f64(actual)
    u = UNIT_ROUNDOFF[dtype]
    # one subnormal spacing: rounding a tiny result has an absolute error
    finfo = torch.finfo(dtype)
    bound = 2 * u * np.abs(expected) + rel * scale + finfo.tiny * finfo.eps
    err = np.abs(a - expected)
    bad = ~(err <= bound)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(f"{what}: {bad.sum()} elements out of bound, first at {i}: got "
                             f"{a[i]!r}, expected {expected[i]!r}, bound {bound[i]!r}")


def _random_config(rng):
    dtype = ALL_FLOAT[rng.integers(len(ALL_FLOAT))]
    hidden = int(rng.choice([1, 7, 64, 257]))
    lead = [(0,), (1,), (3,), (2, 1), (1, 0), (5, 3)][rng.integers(6)]
    return dict(
        dtype=dtype, shape=tuple(lead) + (hidden,),
        eps=[None, 1e-6, 1e-5, 1e-3][rng.integers(4)],
        affine=bool(rng.integers(2)), trainable=bool(rng.integers(2)),
        exact_forward=bool(rng.integers(2)), backend=[None, "torch"][rng.integers(2)],
        from_torch=bool(rng.integers(2)), scale=float(rng.choice([1e-3, 1e-2, 1.0, 30.0])))


def test_rmsnorm_drop_in_equals_torch_for_random_configs(rng):
    """Finding 1 (eps=None took the input dtype's epsilon) and the property:
    leanstep's RMSNorm gives torch.nn.RMSNorm's outputs and gradients."""
    for trial in range(80):
        c = _random_config(rng)
        gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
        hidden = c["shape"][-1]
        ref = torch.nn.RMSNorm(hidden, eps=c["eps"], elementwise_affine=c["affine"],
                               dtype=c["dtype"])
        if c["affine"]:
            with torch.no_grad():
                ref.weight.copy_(torch.rand(hidden, generator=gen, dtype=torch.float64) + 0.5)
            ref.weight.requires_grad_(c["trainable"])
        if c["from_torch"]:
            mine = lt.RMSNorm.from_torch(ref, backend=c["backend"],
                                         exact_forward=c["exact_forward"])
        else:
            mine = lt.RMSNorm(hidden, eps=c["eps"], elementwise_affine=c["affine"],
                              dtype=c["dtype"], backend=c["backend"],
                              exact_forward=c["exact_forward"])
            mine.load_state_dict(ref.state_dict())
            if c["affine"]:
                mine.weight.requires_grad_(c["trainable"])
        x64 = torch.randn(c["shape"], generator=gen, dtype=torch.float64) * c["scale"]
        dy = torch.randn(c["shape"], generator=gen, dtype=torch.float64).to(c["dtype"])
        eps = c["eps"] if c["eps"] is not None else torch.finfo(
            torch.float64 if c["dtype"] == torch.float64 else torch.float32).eps
        w = ref.weight.detach() if c["affine"] else None
        y64, dx64, dx_scale, dw64, dw_scale = _rms_oracle(x64.to(c["dtype"]), w, dy, eps)
        what = f"trial {trial}: {c}"
        results = {}
        for name, module in (("torch", ref), ("leanstep", mine)):
            x = x64.to(c["dtype"]).clone().requires_grad_(True)  # .to(float64) would be x64 itself
            if c["affine"]:
                module.weight.grad = None  # from_torch shares the Parameter with ref
            y = module(x)
            assert y.dtype == c["dtype"] and y.shape == x.shape, what
            y.backward(dy)
            results[name] = (y.detach(), x.grad,
                             module.weight.grad if c["affine"] and c["trainable"] else None)
            _check(y, y64, c["dtype"], 64 * U32, scale=np.abs(y64), what=f"{name} y, {what}")
            _check(x.grad, dx64, c["dtype"], 64 * U32, scale=dx_scale, what=f"{name} dx, {what}")
            if results[name][2] is not None:
                _check(results[name][2], dw64, c["dtype"], 256 * U32, scale=dw_scale,
                       what=f"{name} dweight, {what}")
        if c["affine"] and not c["trainable"]:
            assert results["leanstep"][2] is None and ref.weight.grad is None, what


def test_eps_none_is_the_accumulation_types_epsilon():
    assert lt.default_eps(torch.bfloat16) == torch.finfo(torch.float32).eps
    assert lt.default_eps(torch.float16) == torch.finfo(torch.float32).eps
    assert lt.default_eps(torch.float32) == torch.finfo(torch.float32).eps
    assert lt.default_eps(torch.float64) == torch.finfo(torch.float64).eps
    x = (0.01 * torch.randn(4, 64, generator=torch.Generator().manual_seed(0))).bfloat16()
    ref = torch.nn.RMSNorm(64, dtype=torch.bfloat16).requires_grad_(False)
    expected = ref(x).float()
    for kwargs in ({}, {"exact_forward": True}, {"backend": "torch"}):
        mine = lt.RMSNorm(64, dtype=torch.bfloat16, **kwargs).requires_grad_(False)
        # at most 1 bf16 ulp apart (the wrong eps made them 8.5x apart)
        assert ((mine(x).float() - expected).abs() <= 2**-7 * expected.abs()).all(), kwargs


# ---------------------------------------------------------------- 3: fork


_FORK_CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    import leanstep
    x = np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32)
    w = np.ones(1024, np.float32)
    y, _ = leanstep.rms_norm(x, w, 1e-6)       # the parent's thread pool is started
    pid = os.fork()
    if pid == 0:
        y2, _ = leanstep.rms_norm(x, w, 1e-6)  # hung in GNU OpenMP before
        ok = np.array_equal(y, y2) and leanstep.num_threads() == 1
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_a_forked_child_runs_ops_on_one_thread():
    """Finding 3: GNU OpenMP's pool does not survive fork; the child runs
    serially and gets the parent's (bitwise) results."""
    proc = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr


def _norm_in_child(seed):
    x = np.random.default_rng(seed).standard_normal((256, 512)).astype(np.float32)
    return leanstep.rms_norm(x, np.ones(512, np.float32), 1e-6)[0].sum()


def test_a_fork_pool_runs_ops():
    x = np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32)
    leanstep.rms_norm(x, np.ones(512, np.float32), 1e-6)  # the parent's pool is up
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        got = pool.map_async(_norm_in_child, [1, 2]).get(timeout=120)
    assert got[0] == _norm_in_child(1) and got[1] == _norm_in_child(2)


# ---------------------------------------------------------------- 4: self-overlapping grads


def _expanded():
    return torch.ones(1).expand(6)


IN_PLACE_OPS = {
    "unscale_": lambda p: p.unscale_(2.0),
    "scale_": lambda p: p.scale_(2.0),
    "clip_": lambda p: p.clip_(1.0, torch.tensor([100.0])),
    "norm_clip_": lambda p: p.norm_clip_(1.0),
    "norm": lambda p: p.norm(inv_scale=0.5),
}


@pytest.mark.parametrize("op", sorted(IN_PLACE_OPS))
@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("preset", ["all", "baseline"])
@pytest.mark.parametrize("with_contiguous", [False, True])
def test_in_place_ops_refuse_self_overlapping_grads(op, backend, preset, with_contiguous):
    """Finding 4: expand() grads were scaled 2^6 times by unscale_, once by
    scale_, differently by preset; torch's own error on the torch backend."""
    dense = torch.full((4,), 3.0)
    grads = ([dense] if with_contiguous else []) + [_expanded()]
    before = dense.clone()
    previous = leanstep.preset()
    leanstep.set_preset(preset)
    try:
        plan = GradPlan(grads, backend=backend)
        index = len(grads) - 1
        with pytest.raises(leanstep.Error, match=rf"GradPlan\.{op}: argument 'grads\[{index}\]' "
                                                 r"must not overlap itself.*strides \[0\]"):
            IN_PLACE_OPS[op](plan)
    finally:
        leanstep.set_preset(previous)
    assert torch.equal(dense, before)  # refused before any work
    assert torch.equal(grads[-1], torch.ones(6))
    norm, found_inf = plan.norm()  # reading is fine: torch's norm of the view
    assert norm.item() == pytest.approx(math.sqrt(6 + (36 if with_contiguous else 0)), rel=1e-6)


@pytest.mark.parametrize("backend", [None, "torch"])
def test_multi_tensor_scale_refuses_a_self_overlapping_destination(backend):
    src = [torch.ones(6)]
    with pytest.raises(leanstep.Error, match=r"multi_tensor_scale: argument 'dst_list\[0\]' "
                                             r"must not overlap itself"):
        leanstep.multi_tensor_scale(src, [torch.zeros(1).expand(6)], 2.0, backend=backend)
    # a self-overlapping SOURCE is only read
    dst = [torch.zeros(6)]
    leanstep.multi_tensor_scale([torch.ones(1).expand(6)], dst, 2.0, backend=backend)
    assert torch.equal(dst[0], torch.full((6,), 2.0))


def test_self_overlap_rule_on_layouts():
    overlap = leanstep._leanstep.may_self_overlap
    assert overlap([6], [0]) and overlap([2, 3], [1, 1]) and overlap([3, 3], [2, 1])
    assert not overlap([6], [1]) and not overlap([3, 2], [1, 3]) and not overlap([4], [-2])
    assert not overlap([1, 5], [0, 1]) and not overlap([0, 5], [0, 0])  # size 1 or empty
    assert not overlap([3, 4], [9, 2])  # gaps are fine


# ---------------------------------------------------------------- 7: empty index tensors


def test_empty_index_arrays_from_numpy_are_contiguous():
    """Finding 7: an empty int64 tensor from NumPy has stride (0,) and was
    refused as non-contiguous (every token dropped is valid)."""
    idx = torch.as_tensor(np.array([], np.int64))
    assert idx.stride() == (0,) or idx.is_contiguous()
    out = leanstep.moe_unpermute(torch.zeros(0, 8), idx, (3, 8))
    assert torch.equal(out, torch.zeros(3, 8))
    # the other ops' checks go through the same rule
    empty_rows = torch.as_tensor(np.zeros((0, 8), np.float32))
    y, rstd = leanstep.rms_norm(empty_rows, torch.ones(8), 1e-6)
    assert y.shape == (0, 8) and rstd.shape == (0,)
    dtokens = leanstep.moe_permute_backward(torch.zeros(0, 8), idx, 5)
    assert torch.equal(dtokens, torch.zeros(5, 8))


# ---------------------------------------------------------------- 9: thread count


@pytest.mark.parametrize("n", [0, -1, 1025, 100000])
def test_thread_count_is_bounded(n):
    """Finding 9: 100000 was accepted and the next op segfaulted."""
    before = leanstep.num_threads()
    with pytest.raises(leanstep.Error, match=r"set_num_threads: argument 'n' must be in "
                                             rf"\[1, 1024\] \(got {n}\)"):
        leanstep.set_num_threads(n)
    assert leanstep.num_threads() == before


# ---------------------------------------------------------------- 10: unsupported dtypes


UNSUPPORTED = [torch.float8_e4m3fn, torch.complex64, torch.uint16]


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
@pytest.mark.parametrize("backend", [None, "torch"])
def test_unsupported_dtypes_name_the_argument(dtype, backend):
    """Finding 10: a bare KeyError from the output allocation."""
    bad = torch.zeros(2, 4, dtype=dtype)
    rule = r"must have one of the dtypes float32, .* \(got " + str(dtype).removeprefix("torch.")
    with pytest.raises(leanstep.Error, match=r"rms_norm: argument 'x' " + rule):
        leanstep.rms_norm(bad, torch.ones(4), 1e-6, backend=backend)
    routing_map = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(leanstep.Error, match=r"moe_permute: argument 'tokens' " + rule):
        leanstep.moe_permute(bad, routing_map, backend=backend)
    with pytest.raises(leanstep.Error, match=r"moe_unpermute: argument 'permuted' " + rule):
        leanstep.moe_unpermute(bad, torch.arange(2), (2, 4), backend=backend)


def test_unsupported_numpy_dtypes_name_the_argument():
    with pytest.raises(leanstep.Error, match=r"rms_norm: argument 'x' must have one of the "
                                             r"dtypes .* \(got uint16\)"):
        leanstep.rms_norm(np.zeros((2, 4), np.uint16), np.ones(4, np.float32), 1e-6)


# ---------------------------------------------------------------- 11: lazily negated tensors


def test_lazily_negated_tensors_are_refused_not_read_unnegated(torch_gen):
    # z.conj().imag is a real tensor whose negation is only a flag: DLPack would hand
    # over the memory without it, a silently wrong sign.
    z = torch.randn(4, 8, dtype=torch.complex64, generator=torch_gen)
    x = z.conj().imag
    assert x.is_neg()
    w = torch.ones(8)
    with pytest.raises(leanstep.Error, match="negative bit set.*resolve_neg"):
        leanstep.rms_norm(x, w, 1e-6)
    y, _ = leanstep.rms_norm(x.resolve_neg(), w, 1e-6)
    expected = torch.nn.functional.rms_norm(-z.imag, (8,), w, 1e-6)
    torch.testing.assert_close(y, expected, rtol=2**-20, atol=0)


def test_arrays_reach_the_extension_the_same_way_as_by_dlpack(torch_gen):
    from leanstep._arrays import export

    t = torch.randn(3, 5, generator=torch_gen, requires_grad=True)
    capsule = export(t)  # detached: autograd's tensors are handed over as their storage
    assert type(capsule).__name__ == "PyCapsule"
    assert torch.equal(torch.from_dlpack(capsule), t.detach())
    assert export([t, None, 2.0])[1:] == [None, 2.0]
    a = np.ones(3)
    assert export(a) is a  # NumPy arrays: nanobind takes them itself
    # An overloaded function whose first overload uses up the capsules still resolves.
    src, dst = [torch.ones(6)], [torch.zeros(6)]
    leanstep._arrays.native.grad_multi_tensor_scale(src, dst, 2.0, torch.zeros(1))
    assert torch.equal(dst[0], torch.full((6,), 2.0))
