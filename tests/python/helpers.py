"""Oracles and tolerances shared by the Python tests."""

import numpy as np
import torch

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Unit roundoff (half an ulp at 1) of each dtype.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8,
                 torch.float64: 2.0**-53}

# Spacing of the subnormals (the smallest positive value) of each dtype: below the
# smallest normal, an ulp stops shrinking with |v| and stays this wide.
SUBNORMAL_SPACING = {torch.float32: 2.0**-149, torch.float16: 2.0**-24,
                     torch.bfloat16: 2.0**-133, torch.float64: 2.0**-1074}


def to_f64(t):
    """Exact float64 copy of a torch tensor or NumPy array."""
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def round_to(values_f64, dtype):
    """Correctly rounded (RNE) cast of float64 values to `dtype` (torch's casts
    from float64 round once)."""
    return torch.from_numpy(np.ascontiguousarray(values_f64)).to(dtype)


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def assert_within_ulps(actual, expected_f64, dtype, ulps=1.0, atol=0.0):
    """|actual - expected| <= ulps * ulp(expected) + atol, element-wise, where
    ulp(v) = max(2 * unit_roundoff * |v|, subnormal spacing). One ulp is what a
    result computed in fp32 and rounded once to a narrower dtype may be off from
    the correctly rounded value (the fp32 error can push a value across a rounding
    boundary); among the subnormals the spacing is fixed, not relative."""
    a = to_f64(actual)
    ulp = np.maximum(2 * UNIT_ROUNDOFF[dtype] * np.abs(expected_f64), SUBNORMAL_SPACING[dtype])
    bound = ulps * ulp + atol
    err = np.abs(a - expected_f64)
    bad = ~(err <= bound)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(
            f"{bad.sum()} of {bad.size} elements off by more than {ulps} ulp(s) + {atol}: "
            f"first at {tuple(i)}: got {a[tuple(i)]!r}, expected {expected_f64[tuple(i)]!r}")
