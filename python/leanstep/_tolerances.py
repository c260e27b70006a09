"""The tolerances of leanstep's numerical results: one table for every backend,
the tests and the Triton first-use self-check.

An entry bounds one quantity of one op family. A comparison passes when

    |actual - expected| <= ulps * ulp(expected) + (rel + per_term * terms) * scale

element-wise, where ``ulp(v) = max(eps(dtype) * |v|, smallest subnormal of
dtype)`` in the quantity's own dtype (one unit in the last place at |v|; among
the subnormals the spacing stops shrinking), ``scale`` is |expected| unless the
comparison passes another magnitude (a row's largest value, a sum of |terms|)
and ``terms`` is how many terms the result sums. ``exact`` entries are
bitwise: every bit equal, NaN matched as NaN (payloads may differ).

Bounds against a float64 oracle are the table's entries; two backends each
within such a bound are within :meth:`Tolerance.doubled` of each other.
``U32`` is fp32's unit roundoff (half an ulp at 1), ``U64`` float64's.

This module imports nothing of the leanstep package (the backends import it)
and imports torch only inside the functions that need it.
"""

import dataclasses

U32 = 2.0**-24
U64 = 2.0**-53


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """One bound (see the module docstring): ``exact``, or ulps of the
    quantity's dtype plus ``rel`` and ``per_term`` times a scale."""

    exact: bool = False
    ulps: float = 0.0
    rel: float = 0.0
    per_term: float = 0.0
    why: str = ""

    def doubled(self):
        """The bound between two results each within this one of the same oracle."""
        if self.exact:
            return self
        return dataclasses.replace(self, ulps=2 * self.ulps, rel=2 * self.rel,
                                   per_term=2 * self.per_term,
                                   why=f"{self.why} (doubled: two sides)")

    def describe(self):
        if self.exact:
            return "bitwise"
        parts = []
        if self.ulps:
            parts.append(f"{self.ulps:g} ulp")
        if self.rel:
            parts.append(f"{self.rel / U32:g} u32 * scale")
        if self.per_term:
            unit = ("u64", U64) if self.per_term <= 64 * U64 else ("u32", U32)
            parts.append(f"{self.per_term / unit[1]:g} {unit[0]} * terms * scale")
        return " + ".join(parts) or "0"


def _exact(why):
    return Tolerance(exact=True, why=why)


#: (op family, quantity) -> Tolerance. Where a test or the self-check uses the
#: bound, its file is named after the reason.
TOLERANCES = {
    # ---------------------------------------------------------------- grad
    ("grad", "norm"): Tolerance(
        rel=2 * U32,
        why="|x|^p summed in float64 (error ~n 2^-53), rounded once to fp32 (<= u): 2u "
            "against a float64 oracle (test_conformance, test_triton_grad)"),
    ("grad", "norm_between_backends"): Tolerance(
        rel=4 * U32,
        why="two backends each within 2u of the float64 oracle; docs/grad.md's 2^-22 between "
            "fused and reference (test_triton_grad's LoRA layout)"),
    ("grad", "norm_selfcheck"): Tolerance(
        rel=32 * U32,
        why="triton_selfcheck's first-use gate, 16 fp32 ulp of the torch-op norm: eight times "
            "the between-backends bound, a gate against miscompiles, not a test"),
    ("grad", "norm_ulps"): Tolerance(
        ulps=4,
        why="test_grad's C++ norms against the oracle, 4 fp32 ulp (8u): p-th powers and the "
            "root add a few roundings beyond the sum for p other than 2"),
    ("grad", "elementwise"): _exact(
        "one product per element rounded once, the same on every backend: clip, scale and "
        "unscale in fp32 (fp64 grads in double), multi_tensor_scale float(src) * scale in fp32, "
        "cast to dst's dtype"),
    ("grad", "multi_tensor_scale_f64"): Tolerance(
        ulps=1,
        why="against a float64 product: the fp32 product rounded, then cast to a destination "
            "of fp32 or narrower (1 ulp of it; test_grad)"),
    ("grad", "found_inf"): _exact("a flag: 1 iff some input element is non-finite"),
    ("grad", "count_zeros"): _exact("an integer count"),
    ("grad", "clip_coeff"): _exact(
        "min(1, max_norm / (norm + 1e-6)) from the same norm: the same fp32 division"),
    ("grad", "norm_clip_coeff"): Tolerance(
        rel=6 * U32,
        why="the coefficient of norms 4u apart, plus one rounding of each side's division "
            "(test_conformance's grad.norm_clip cases)"),
    ("grad", "norm_clip_values"): Tolerance(
        ulps=1, rel=8 * U32,
        why="grads scaled by coefficients 6u apart, each fp32 product rounded (u each side), "
            "then one cast to the grad's dtype (1 ulp)"),
    # ---------------------------------------------------------------- rmsnorm
    ("rmsnorm", "rstd"): Tolerance(
        ulps=64,
        why="fp32 blocked sums (SIMD lanes, Triton blocks, torch's cascade; the C++ "
            "reference in double) of H <= 2^14 squares, a division, a square root and a "
            "reciprocal, each correctly rounded (test_conformance: H up to 9000)"),
    ("rmsnorm", "rstd_between_cpu_paths"): Tolerance(
        ulps=32,
        why="the C++ fused and reference rstd: fp32 statistics summed in different orders "
            "(test_rmsnorm)"),
    ("rmsnorm", "y"): Tolerance(
        ulps=1, rel=64 * U32,
        why="scale_then_cast: fp32 products rounded once to y's dtype (1 ulp), rstd's error "
            "within 64u of the row's largest |y| (scale: that row max; test_rmsnorm_device)"),
    ("rmsnorm", "y_between_cpu_paths"): Tolerance(
        ulps=1,
        why="the C++ fused and reference bf16 y: a few fp32 ulp of the statistics can flip "
            "one rounding to bf16 (test_rmsnorm)"),
    ("rmsnorm", "y_cast_then_scale"): Tolerance(
        ulps=3, rel=64 * U32,
        why="x * r is rounded to x's dtype before g multiplies it: a few-ulp difference in r "
            "can move that first rounding by one ulp (test_triton_rmsnorm)"),
    ("rmsnorm", "dx"): Tolerance(
        ulps=1.5, rel=36 * U32, per_term=0.375 * U32,
        why="docs/rmsnorm.md's derived bound, 1.5 (r (2u |g dy| + |xhat| (3u |m| + (H/4 + 16) u "
            "mean|g dy xhat|)) + (2u + u_dx) |dx|), over scale r (|g dy| + |xhat| (|m| + "
            "mean|g dy xhat|)), terms H: dx cancels, so it follows the terms"),
    ("rmsnorm", "dweight"): Tolerance(
        ulps=1.5, rel=6 * U32, per_term=1.5 * U32,
        why="1.5 ((rows + 4) u sum|dy xhat| + 1 ulp): fp32 sums over the rows in chunk order "
            "(scale: sum over rows |dy xhat|, terms: rows; test_triton_rmsnorm)"),
    ("rmsnorm", "selfcheck"): Tolerance(
        ulps=2, rel=64 * U32,
        why="triton_selfcheck against the torch-op composite: the y bound with its ulp part "
            "doubled, both sides carrying their own rounding (scale: the row's largest value)"),
    ("rmsnorm", "y_f32_ulps"): Tolerance(
        ulps=40,
        why="test_rmsnorm's C++ fp32 y against the oracle, element-wise: rstd's few-ulp error "
            "and two fp32 products"),
    # ---------------------------------------------------------------- moe
    ("moe", "permute"): _exact("a gather: rows, probs and indices are copied bits"),
    ("moe", "unpermute"): _exact(
        "fp32 sums from +0 in increasing slot order, products rounded before each add, one "
        "cast: the order is the semantics, so every backend has the same bits"),
    ("moe", "unpermute_f64"): Tolerance(
        ulps=1, per_term=4 * U32,
        why="against float64: k fp32 products and adds (<= 2u each, over scale sum|terms|, "
            "terms k per token), then one cast (1 ulp; test_moe)"),
    ("moe", "permute_backward"): _exact("unpermute without probs"),
    ("moe", "permute_probs_backward"): _exact(
        "a scatter: each (token, expert) entry receives one slot's value"),
    ("moe", "unpermute_backward_dpermuted"): _exact("one fp32 product, one cast"),
    ("moe", "unpermute_backward_dprobs"): Tolerance(
        ulps=0.5, per_term=2 * U64,
        why="a float64 dot product of H terms rounded once to probs' dtype (half an ulp); the "
            "op's sum and the oracle's are each within H u64 of sum|terms| (test_moe_device "
            "counts one); orders differ between backends"),
    ("moe", "pad_routing_map"): _exact("booleans"),
    ("moe", "sort_chunks_by_idxs"): _exact("a gather of rows and probs"),
    ("moe", "selfcheck"): _exact("triton_selfcheck: permute and unpermute follow the reference "
                                 "order"),
}


def tolerance(family, quantity):
    """The table's entry, or a KeyError naming the entries of that family."""
    try:
        return TOLERANCES[(family, quantity)]
    except KeyError:
        known = sorted(q for f, q in TOLERANCES if f == family)
        raise KeyError(f"no tolerance for ({family!r}, {quantity!r}); {family} has "
                       f"{known}") from None


def ulp(expected, dtype, compute_dtype=None):
    """One unit in the last place of `dtype` at |expected|: eps(dtype) |v|,
    at least the dtype's smallest subnormal."""
    import torch

    info = torch.finfo(dtype)
    e = expected.to(compute_dtype or _wide(expected)).abs()
    return torch.clamp(e * info.eps, min=info.tiny * info.eps)


def bound(expected, dtype, tol, scale=None, terms=0, compute_dtype=None):
    """The element-wise bound of `tol` around `expected` (a tensor of the
    compute dtype: float64 unless given, or the device lacks it)."""
    wide = compute_dtype or _wide(expected)
    e = expected.to(wide)
    magnitude = e.abs() if scale is None else _as(scale, e)
    out = (tol.rel + tol.per_term * terms) * magnitude
    if tol.ulps:
        out = out + tol.ulps * ulp(e, dtype, wide)
    return out


def check(actual, expected, tol, dtype=None, scale=None, terms=0, compute_dtype=None):
    """None when `actual` is within `tol` of `expected`, else what is wrong:
    the shapes or dtypes, or how many elements are off and the first one
    (index, both values, the bound). Non-finite expected values must be
    matched exactly (the same inf, NaN for NaN). `dtype`: the quantity's
    dtype for ulps (default: expected's)."""
    import torch

    if tuple(actual.shape) != tuple(expected.shape):
        return f"shape {list(actual.shape)}, expected {list(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype}, expected {expected.dtype}"
    if tol.exact:
        return _check_bits(actual, expected)
    dtype = dtype or expected.dtype
    wide = compute_dtype or _wide(expected)
    a, e = actual.to(wide), expected.to(wide)
    limit = bound(e, dtype, tol, scale, terms, wide)
    finite = torch.isfinite(e)
    same_special = (a == e) | (torch.isnan(a) & torch.isnan(e))
    ok = torch.where(finite, (a - e).abs() <= limit, same_special)
    if bool(ok.all()):
        return None
    bad = ~ok
    first = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
    return (f"{int(bad.sum())} of {bad.numel()} elements outside {tol.describe()}: first at "
            f"{first}: got {a[first].item()!r}, expected {e[first].item()!r}, bound "
            f"{limit[first].item():.3g}")


def _check_bits(actual, expected):
    import torch

    if not actual.dtype.is_floating_point:
        bad = actual != expected
    else:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        view = ints[actual.element_size()]
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        bad = ((actual.contiguous().view(view) != expected.contiguous().view(view))
               & ~(nan_a & nan_e)) | (nan_a ^ nan_e)
    if not bool(bad.any()):
        return None
    first = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
    return (f"{int(bad.sum())} of {bad.numel()} elements differ in bits: first at {first}: "
            f"got {actual[first].item()!r}, expected {expected[first].item()!r}")


def _wide(t):
    import torch

    return torch.float32 if t.device.type == "mps" else torch.float64


def _as(scale, like):
    import torch

    if isinstance(scale, torch.Tensor):
        return scale.to(like.dtype).to(like.device)
    return torch.full_like(like, float(scale))
