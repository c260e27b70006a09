"""RMSNorm in Triton kernels (docs/rmsnorm.md for the semantics).

x is ``[rows, H]`` (leading dims flattened, contiguous); every statistic is
per row and fp32:

- forward, one launch: ``r = 1 / sqrt(sum(x^2) / H + eps)`` (fp32 sum, fp32
  correctly rounded division and square root, as the C++ kernels), rstd
  saved as fp32, ``y = cast(x * r * g)`` ("scale_then_cast") or
  ``cast(g * cast_x(x * r))`` ("cast_then_scale"); ``g = weight`` or
  ``1 + weight`` (zero-centered, formed in fp32; the weight is never
  rewritten). fp32/fp16/bf16 for x, weight and y.
- frozen backward, one launch, dx only (no weight-gradient memory, no
  cross-row work): ``dx = r * (g*dy - xhat * mean(g*dy*xhat))``,
  ``xhat = x*r``, fp32 math, one cast.
- trainable backward, two launches, deterministic: the same dx pass also
  accumulates ``dy * xhat`` in fp32 over a fixed chunk of rows into that
  chunk's own partial row (no atomics); a second kernel sums the partial
  rows in chunk order per column and casts once. The chunks depend on the
  shape only, so dgamma does not depend on the grid.

Rows with H up to 8192 are held in registers (one read of x per pass);
longer rows loop over blocks. Programs are persistent over rows.
"""

import torch
import triton
import triton.language as tl

from .._rules import check_rms_norm, check_rms_norm_backward
from . import triton_common as tc
from .triton_common import bf16_bits_to_f32, f32_to_bf16_bits

MAX_SINGLE_BLOCK = 8192  # rows up to this many elements stay in registers


# ---------------------------------------------------------------- typed loads and stores


@triton.jit
def _load(p, offs, mask, CODE: tl.constexpr):
    """fp32 values of a fp32 (0), fp16 (1) or bf16 (2) tensor pointer."""
    if CODE == 2:
        bits = tl.load(p.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, mask=mask, other=0)
        v = bf16_bits_to_f32(bits)
    else:
        v = tl.load(p + offs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _store(p, offs, v, mask, CODE: tl.constexpr):
    """fp32 values stored with one rounding to the tensor's dtype."""
    if CODE == 2:
        tl.store(p.to(tl.pointer_type(tl.uint16), bitcast=True) + offs, f32_to_bf16_bits(v),
                 mask=mask)
    elif CODE == 1:
        tl.store(p + offs, v.to(tl.float16), mask=mask)
    else:
        tl.store(p + offs, v, mask=mask)


@triton.jit
def _round(v, CODE: tl.constexpr):
    """fp32 values rounded to a dtype and back (cast_then_scale's cast_x)."""
    if CODE == 2:
        r = bf16_bits_to_f32(f32_to_bf16_bits(v))
    elif CODE == 1:
        r = v.to(tl.float16).to(tl.float32)
    else:
        r = v
    return r


@triton.jit
def _gamma(w, offs, mask, WC: tl.constexpr, ZC: tl.constexpr):
    g = _load(w, offs, mask, WC)
    if ZC:
        g = g + 1.0
    return g


# ---------------------------------------------------------------- kernels


@triton.jit
def _forward_kernel(x, w, y, rstd, rows, H, eps, XC: tl.constexpr, WC: tl.constexpr,
                    YC: tl.constexpr, ZC: tl.constexpr, CAST_THEN_SCALE: tl.constexpr,
                    BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    hf = tl.cast(H, tl.float32)
    cols = tl.arange(0, BLOCK)
    for row in range(pid, rows, nprog):
        base = tl.cast(row, tl.int64) * H
        if SINGLE:
            m = cols < H
            xv = _load(x + base, cols, m, XC)
            ss = tl.sum(xv * xv, 0)
        else:
            acc = tl.zeros([BLOCK], tl.float32)
            for s in range(0, H, BLOCK):
                m = s + cols < H
                xb = _load(x + base, s + cols, m, XC)
                acc += xb * xb
            ss = tl.sum(acc, 0)
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, hf) + eps))
        tl.store(rstd + row, r)
        if SINGLE:
            g = _gamma(w, cols, m, WC, ZC)
            if CAST_THEN_SCALE:
                yv = g * _round(xv * r, XC)
            else:
                yv = xv * r * g
            _store(y + base, cols, yv, m, YC)
        else:
            for s in range(0, H, BLOCK):
                m = s + cols < H
                xb = _load(x + base, s + cols, m, XC)
                g = _gamma(w, s + cols, m, WC, ZC)
                if CAST_THEN_SCALE:
                    yv = g * _round(xb * r, XC)
                else:
                    yv = xb * r * g
                _store(y + base, s + cols, yv, m, YC)


@triton.jit
def _backward_kernel(dy, x, rstd, w, dx, partials, rows, H, chunk_rows, num_chunks,
                     DYC: tl.constexpr, XC: tl.constexpr, WC: tl.constexpr, DXC: tl.constexpr,
                     ZC: tl.constexpr, DGAMMA: tl.constexpr, BLOCK: tl.constexpr,
                     SINGLE: tl.constexpr):
    """dx per row; with DGAMMA, program-owned fp32 partial rows of sum(dy * xhat)
    over each fixed chunk of rows (partials[chunk, :])."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    hf = tl.cast(H, tl.float32)
    cols = tl.arange(0, BLOCK)
    for c in range(pid, num_chunks, nprog):
        first = c * chunk_rows
        last = tl.minimum(first + chunk_rows, rows)
        pbase = tl.cast(c, tl.int64) * H
        if SINGLE:
            m = cols < H
            g = _gamma(w, cols, m, WC, ZC)
            dg = tl.zeros([BLOCK], tl.float32)
        for row in range(first, last):
            base = tl.cast(row, tl.int64) * H
            r = tl.load(rstd + row)
            if SINGLE:
                xhat = _load(x + base, cols, m, XC) * r
                dyv = _load(dy + base, cols, m, DYC)
                gdy = g * dyv
                mean = tl.div_rn(tl.sum(gdy * xhat, 0), hf)
                _store(dx + base, cols, r * (gdy - xhat * mean), m, DXC)
                if DGAMMA:
                    dg += dyv * xhat
            else:
                acc = tl.zeros([BLOCK], tl.float32)
                for s in range(0, H, BLOCK):
                    mb = s + cols < H
                    xhat = _load(x + base, s + cols, mb, XC) * r
                    gdy = _gamma(w, s + cols, mb, WC, ZC) * _load(dy + base, s + cols, mb, DYC)
                    acc += gdy * xhat
                mean = tl.div_rn(tl.sum(acc, 0), hf)
                for s in range(0, H, BLOCK):
                    mb = s + cols < H
                    xhat = _load(x + base, s + cols, mb, XC) * r
                    dyv = _load(dy + base, s + cols, mb, DYC)
                    gdy = _gamma(w, s + cols, mb, WC, ZC) * dyv
                    _store(dx + base, s + cols, r * (gdy - xhat * mean), mb, DXC)
                    if DGAMMA:
                        pp = partials + pbase + s + cols
                        if row == first:
                            tl.store(pp, dyv * xhat, mask=mb)
                        else:
                            tl.store(pp, tl.load(pp, mask=mb, other=0.0) + dyv * xhat, mask=mb)
        if DGAMMA:
            if SINGLE:
                tl.store(partials + pbase + cols, dg, mask=m)


@triton.jit
def _dgamma_kernel(partials, dgamma, num_chunks, H, WC: tl.constexpr, BLOCK: tl.constexpr):
    """dgamma[col] = sum over chunks, in chunk order, of partials[chunk, col]."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, num_chunks):
        acc += tl.load(partials + tl.cast(c, tl.int64) * H + cols, mask=m, other=0.0)
    _store(dgamma, cols, acc, m, WC)


# ---------------------------------------------------------------- host side


def _launch_shape(h, device):
    single = h <= MAX_SINGLE_BLOCK
    block = triton.next_power_of_2(h) if single else 4096
    warps = 4 if block <= 2048 else 8
    return block, single, warps


def chunk_rows(rows, h):
    """Rows per dgamma chunk: a function of the shape only (so dgamma does
    not depend on the grid): about 512 chunks, at most 64 rows each."""
    return max(1, min(64, -(-rows // 512)))


def forward(x, weight, eps, zero_centered_gamma=False, rounding="scale_then_cast"):
    """Returns ``(y, rstd)``: y in x's dtype and shape, rstd fp32 ``x.shape[:-1]``."""
    tc.check_device(x.device, "rms_norm", f"argument 'x' is on {x.device}")
    check_rms_norm(x, weight, eps, zero_centered_gamma, rounding)  # the CPU kernels' rules
    eps = float(eps)
    h = x.shape[-1]
    rows = x.numel() // h
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, rstd
    block, single, warps = _launch_shape(h, x.device)
    grid = (max(1, min(rows, tc.max_programs(x.device))),)
    code = tc.DTYPE_CODES
    _forward_kernel[grid](x, weight, y, rstd, rows, h, tc.host_f32(eps), XC=code[x.dtype],
                          WC=code[weight.dtype], YC=code[y.dtype], ZC=bool(zero_centered_gamma),
                          CAST_THEN_SCALE=rounding == "cast_then_scale", BLOCK=block,
                          SINGLE=single, num_warps=warps)
    return y, rstd


def backward(dy, x, rstd, weight, zero_centered_gamma=False, weight_requires_grad=True):
    """Returns ``(dx, dweight)``: dx in x's dtype; dweight in the weight's
    dtype, or None for a frozen weight (then one launch and no cross-row work)."""
    tc.check_device(x.device, "rms_norm_backward", f"argument 'x' is on {x.device}")
    check_rms_norm_backward(dy, x, rstd, weight, weight_requires_grad)  # the CPU kernels' rules
    h = x.shape[-1]
    rows = x.numel() // h
    dx = torch.empty_like(x)
    dweight = torch.empty_like(weight) if weight_requires_grad else None
    if rows == 0:
        if dweight is not None:
            dweight.zero_()
        return dx, dweight
    block, single, warps = _launch_shape(h, x.device)
    per_chunk = chunk_rows(rows, h)
    num_chunks = -(-rows // per_chunk)
    partials = (torch.empty((num_chunks, h), dtype=torch.float32, device=x.device)
                if weight_requires_grad else rstd)
    grid = (max(1, min(num_chunks, tc.max_programs(x.device))),)
    code = tc.DTYPE_CODES
    _backward_kernel[grid](dy, x, rstd, weight, dx, partials, rows, h, per_chunk, num_chunks,
                           DYC=code[dy.dtype], XC=code[x.dtype], WC=code[weight.dtype],
                           DXC=code[dx.dtype], ZC=bool(zero_centered_gamma),
                           DGAMMA=bool(weight_requires_grad), BLOCK=block, SINGLE=single,
                           num_warps=warps)
    if weight_requires_grad:
        col_block = min(1024, triton.next_power_of_2(h))
        _dgamma_kernel[(triton.cdiv(h, col_block),)](partials, dweight, num_chunks, h,
                                                     WC=code[weight.dtype], BLOCK=col_block)
    return dx, dweight


class RMSNormFunction(torch.autograd.Function):
    """y = rms_norm(x, weight) in Triton kernels; the backward computes dweight
    only when the weight needs a gradient (frozen: dx only, one launch)."""

    @staticmethod
    def forward(ctx, x, weight, eps, zero_centered_gamma, rounding, on_backward):
        y, rstd = forward(x, weight, eps, zero_centered_gamma, rounding)
        ctx.save_for_backward(x, weight, rstd)
        ctx.zero_centered_gamma = zero_centered_gamma
        ctx.on_backward = on_backward
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        trainable = bool(ctx.needs_input_grad[1])
        if ctx.on_backward is not None:  # the caller counts the call (backends count nothing)
            ctx.on_backward(x.device.type,
                            "trainable: dx and dweight" if trainable else "frozen: dx only")
        dx, dweight = backward(dy if dy.is_contiguous() else dy.contiguous(), x, rstd, weight,
                               ctx.zero_centered_gamma, trainable)
        return dx, dweight, None, None, None, None


def backward_dx(dy, x, rstd, weight, zero_centered_gamma=False):
    """dx only (a frozen weight), rstd of ``x.shape[:-1]`` or ``x.shape[:-1] + (1,)``."""
    return backward(dy, x, rstd.reshape(x.shape[:-1]) if rstd.is_contiguous() else
                    rstd.contiguous().reshape(x.shape[:-1]), weight, zero_centered_gamma,
                    False)[0]


def rms_norm(x, weight, eps, zero_centered_gamma=False, rounding="scale_then_cast",
             on_backward=None):
    """The autograd entry point: the Function when a gradient is wanted,
    else the forward kernel alone. ``on_backward(device_type, reason)`` is
    called when the backward runs (the caller's call count)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, eps, zero_centered_gamma, rounding, on_backward)
    return forward(x, weight, eps, zero_centered_gamma, rounding)[0]
