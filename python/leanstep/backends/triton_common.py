"""Pieces shared by leanstep's Triton kernels (imported only when a Triton
backend runs: ``import leanstep`` never imports triton).

- dtype codes of the region tables: 0 float32, 1 float16, 2 bfloat16,
  3 float64 (every table stores them as int64);
- loads and stores of fp32 values at a raw byte address with the C++
  path's roundings: fp16 and fp32 through the hardware (round to nearest
  even), bf16 through integer bit operations (round to nearest even, a NaN
  kept as a quiet NaN with its sign and payload top bits), the way the C++
  kernels do it. Triton's interpreter truncates fp32 -> bf16 casts, and the
  bit form is one formula on every backend, so bf16 results are the same bits
  under the interpreter and on a device;
- non-finite tests on the bits (exponent all ones), which no floating-point
  optimisation can fold away.

``INTERPRETED`` says whether the kernels defined in this process run in
Triton's interpreter (``TRITON_INTERPRET=1`` when they were decorated): then
they run on CPU tensors only; otherwise on device tensors only.
"""

import collections
import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from .._leanstep import Error

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
DTYPE_OF_CODE = {code: dtype for dtype, code in DTYPE_CODES.items()}


@triton.jit
def _marker():
    pass


try:  # the class the decorator returned: interpreter or compiler
    from triton.runtime.interpreter import InterpretedFunction as _Interpreted

    INTERPRETED = isinstance(_marker, _Interpreted)
except ImportError:  # pragma: no cover - a Triton without the interpreter
    INTERPRETED = False


def check_device(device, where, what):
    """Interpreted kernels read CPU memory, compiled ones device memory: the
    tensors of a call (`what`, e.g. "argument 'x' is on cuda:0") must match
    how the kernels were built, else an Error naming them."""
    if INTERPRETED != (device.type == "cpu"):
        mode = "Triton's interpreter" if INTERPRETED else "a device"
        raise Error(f"{where}: {what}, but leanstep's Triton kernels were built for {mode} "
                    f"(TRITON_INTERPRET when they were imported)")


def host_f32(value):
    """A Python number rounded to fp32 on the host (as the C++ path's
    1-element fp32 arrays hold it), returned as a Python float: every later
    conversion to fp32, compiled or interpreted, is then exact. NumPy, not
    torch: no tensor is made, so nothing is read back."""
    with np.errstate(over="ignore"):
        return float(np.float32(float(value)))


@triton.jit
def typed_ptr(addr, ty: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 byte address `addr` as a pointer to `ty` (16-byte aligned
    when ALIGNED: the table builder checked it)."""
    p = addr.to(tl.pointer_type(ty))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit
def bf16_bits_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(y):
    """fp32 -> bf16 bits (uint16): round to nearest even; NaN stays a quiet NaN."""
    bits = y.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    quiet = (bits | 0x400000) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, quiet, rounded).to(tl.uint16)


@triton.jit
def nonfinite_f32(x):
    """1 where the fp32 value is inf or NaN (exponent bits all ones), else 0."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits & 0x7F800000) == 0x7F800000).to(tl.int32)


@triton.jit
def isnan_f32(x):
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits & 0x7FFFFFFF) > 0x7F800000).to(tl.int32)


@triton.jit
def nonfinite_f64(x):
    bits = x.to(tl.uint64, bitcast=True)
    return ((bits & 0x7FF0000000000000) == 0x7FF0000000000000).to(tl.int32)


@triton.jit
def isnan_f64(x):
    bits = x.to(tl.uint64, bitcast=True)
    return ((bits & 0x7FFFFFFFFFFFFFFF) > 0x7FF0000000000000).to(tl.int32)


@triton.jit
def load_f32(addr, code, offs, n, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    """fp32 values of a float32 (code 0), float16 (1) or bfloat16 (2) run at
    byte address `addr`, elements `offs` (masked to < n when MASKED). Each
    branch names its own pointer: the compiler requires a name bound in
    both branches of a runtime `if` to keep one type."""
    if code == 0:
        p32 = typed_ptr(addr, tl.float32, ALIGNED)
        if MASKED:
            x = tl.load(p32 + offs, mask=offs < n, other=0.0)
        else:
            x = tl.load(p32 + offs)
    elif code == 1:
        p16 = typed_ptr(addr, tl.float16, ALIGNED)
        if MASKED:
            x = tl.load(p16 + offs, mask=offs < n, other=0.0).to(tl.float32)
        else:
            x = tl.load(p16 + offs).to(tl.float32)
    else:
        pbf = typed_ptr(addr, tl.uint16, ALIGNED)
        if MASKED:
            x = bf16_bits_to_f32(tl.load(pbf + offs, mask=offs < n, other=0))
        else:
            x = bf16_bits_to_f32(tl.load(pbf + offs))
    return x


@triton.jit
def _store(p, offs, n, v, write, MASKED: tl.constexpr, GUARDED: tl.constexpr):
    """Stores v at p + offs: masked to offs < n when MASKED, and only if the
    scalar `write` holds when GUARDED (a uniform branch: the stores stay
    unmasked, so vectorised, on full blocks)."""
    if GUARDED:
        if write:
            if MASKED:
                tl.store(p + offs, v, mask=offs < n)
            else:
                tl.store(p + offs, v)
    else:
        if MASKED:
            tl.store(p + offs, v, mask=offs < n)
        else:
            tl.store(p + offs, v)


@triton.jit
def store_f32(addr, code, offs, n, y, write, MASKED: tl.constexpr, GUARDED: tl.constexpr,
              ALIGNED: tl.constexpr):
    """Stores fp32 values `y` rounded once to the run's dtype (code 0-2)
    (only if the scalar `write` holds, when GUARDED); returns the stored
    values as fp32."""
    if code == 0:
        _store(typed_ptr(addr, tl.float32, ALIGNED), offs, n, y, write, MASKED, GUARDED)
        v = y
    elif code == 1:
        h = y.to(tl.float16)
        _store(typed_ptr(addr, tl.float16, ALIGNED), offs, n, h, write, MASKED, GUARDED)
        v = h.to(tl.float32)
    else:
        b = f32_to_bf16_bits(y)
        _store(typed_ptr(addr, tl.uint16, ALIGNED), offs, n, b, write, MASKED, GUARDED)
        v = bf16_bits_to_f32(b)
    return v


@triton.jit
def load_f64(addr, offs, n, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    p = typed_ptr(addr, tl.float64, ALIGNED)
    if MASKED:
        x = tl.load(p + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(p + offs)
    return x


@triton.jit
def store_f64(addr, offs, n, y, write, MASKED: tl.constexpr, GUARDED: tl.constexpr,
              ALIGNED: tl.constexpr):
    _store(typed_ptr(addr, tl.float64, ALIGNED), offs, n, y, write, MASKED, GUARDED)


def device_has_float64(device):
    """Whether Triton kernels on `device` may accumulate in float64 (the
    interpreter and CUDA/ROCm do; an XPU says so in its properties; Ascend
    NPUs accumulate in fp32)."""
    if device.type in ("cpu", "cuda"):
        return True
    if device.type == "xpu":
        try:
            return bool(torch.xpu.get_device_properties(device).has_fp64)
        except Exception:  # noqa: BLE001 - unknown: stay in fp32
            return False
    return False


def max_programs(device):
    """Programs of a persistent launch: a few per multiprocessor on a device;
    under the interpreter one per work item (it runs them one by one)."""
    if device.type == "cuda":
        return 8 * torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "xpu":
        try:
            return 8 * torch.xpu.get_device_properties(device).gpu_subslice_count
        except Exception:  # noqa: BLE001
            return 512
    if device.type == "npu":
        return 48
    return 1 << 30


@contextlib.contextmanager
def count_launches():
    """Counts Triton kernel launches inside the block, by kernel name (a
    Counter), with a hook on the launcher every ``kernel[grid](...)`` call
    goes through (``JITFunction.run``, and ``InterpretedFunction.run`` under
    the interpreter). Warm-up compilations are not launches."""
    from triton.runtime.jit import JITFunction

    classes = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    counts = collections.Counter()
    saved = [(cls, cls.__dict__["run"]) for cls in classes if "run" in cls.__dict__]

    def hooked(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                counts[getattr(getattr(self, "fn", None), "__name__", repr(self))] += 1
            return original(self, *args, **kwargs)

        return run

    for cls, original in saved:
        cls.run = hooked(original)
    try:
        yield counts
    finally:
        for cls, original in saved:
            cls.run = original
