"""The gradient engine in Triton kernels, over a region table.

The regions are the C++ planner's, found exactly as by the torch-op backend
(:class:`~leanstep.backends.torch_grad.TorchGradPlan`: synthetic per-storage
addresses through ``GradPlanCore.from_layout``). Each contiguous region of
multiplicity 1 is cut into work chunks of ``chunk`` elements, and the table,
built once per plan, is one int64 device tensor of shape ``[C, 4]``:

    row c = (byte address of the chunk's first element, its element count,
             dtype code (0 fp32, 1 fp16, 2 bf16, 3 fp64), region index)

Kernels take the table and turn each address into a typed pointer, so one
launch covers every storage and every dtype of a plan (the multi-tensor-apply
scheme of apex and Transformer Engine, without their tensor-count limits per
launch). Launches are persistent: ``grid = min(C, max_programs)`` programs
walk the chunks ``pid, pid + grid, ...``.

- ``_reduce_kernel``: one pass per element: reads it, flags it if it is not
  finite, unscales it in place when asked (``x = cast(float(x) * inv)``,
  skipped when ``inv == 1``, as the CPU path) and accumulates the norm term of
  the stored value (``x^2``, ``|x|`` or ``max |x|``, in fp64 where the device
  has it). Each chunk writes its partial and flag into its own slot, never
  with atomics.
- ``_finish_kernel``: one program sums the slots in a fixed order (fixed
  vector lanes, then a fixed tree), so the norm does not depend on the grid
  size; writes the fp32 norm and found_inf.
- ``_scale_kernel``: clip (coefficient ``min(1, max_norm / (norm + 1e-6))``
  computed by every program from the device norm, one correctly rounded fp32
  division, NaN kept) or scale, in place, one launch.
- ``_zeros_kernel`` + ``_zeros_finish_kernel``: count_zeros, int64.
- ``_mts_kernel``: multi_tensor_scale over a table of (source, destination)
  chunks with mixed dtypes: fp32 math, one rounding into the destination.

So ``norm_clip_`` is 3 launches for any layout (reduce, finish, scale) and
``norm(inv_scale=...)`` 2; nothing is read on the host.

Entries the table does not take run the torch-op backend's code for those
entries only: regions of multiplicity > 1 (duplicated or overlapping views)
and generic (strided) views. Their contribution to a norm is computed with
torch ops and handed to the finish kernel, which combines it with the
chunks' in the same fixed order. Norm types other than 1, 2 and inf run the
torch-op backend for the whole call.
"""

import copy
import math

import torch
import triton
import triton.language as tl

from .._leanstep import Error
from . import triton_common as tc
from . import torch_grad
from .torch_grad import (TorchGradPlan, ViewGroup, byte_range, dtype_name, pairs_share_memory,
                         shallow_copy)
from .triton_common import (
    load_f32,
    load_f64,
    nonfinite_f32,
    nonfinite_f64,
    isnan_f32,
    isnan_f64,
    store_f32,
    store_f64,
)

KIND_NONE, KIND_L2, KIND_L1, KIND_INF = 0, 1, 2, 3
_KINDS = {2.0: KIND_L2, 1.0: KIND_L1, math.inf: KIND_INF}

DEVICE_CHUNK = 16384  # elements per work chunk (64 KiB of fp32)
DEVICE_BLOCK = 1024  # elements per vector step
INTERPRETER_CHUNK = 4096  # the interpreter runs programs one by one: fewer, larger steps
INTERPRETER_BLOCK = 4096
FINISH_BLOCK = 1024  # lanes of the final reduction


def defaults(device):
    """(chunk, block) for `device`: the interpreter (CPU tensors) or a device."""
    if device.type == "cpu":
        return INTERPRETER_CHUNK, INTERPRETER_BLOCK
    return DEVICE_CHUNK, DEVICE_BLOCK


# ---------------------------------------------------------------- kernels


@triton.jit
def _reduce_step(addr, code, offs, n, inv, write, acc, bad, nan, KIND: tl.constexpr,
                 UNSCALE: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
                 ACC: tl.constexpr):
    if code == 3:
        x64 = load_f64(addr, offs, n, MASKED, ALIGNED)
        bad = tl.maximum(bad, nonfinite_f64(x64))
        if UNSCALE:
            v64 = x64 * inv.to(tl.float64)
            store_f64(addr, offs, n, v64, write, MASKED, True, ALIGNED)
        else:
            v64 = x64
        vn = isnan_f64(v64)
        va = v64.to(ACC)
    else:
        x32 = load_f32(addr, code, offs, n, MASKED, ALIGNED)
        bad = tl.maximum(bad, nonfinite_f32(x32))
        if UNSCALE:
            v32 = store_f32(addr, code, offs, n, x32 * inv, write, MASKED, True, ALIGNED)
        else:
            v32 = x32
        vn = isnan_f32(v32)
        va = v32.to(ACC)
    if KIND == 1:
        acc += va * va
    elif KIND == 2:
        acc += tl.abs(va)
    elif KIND == 3:
        acc = tl.maximum(acc, tl.where(vn != 0, 0.0, tl.abs(va)))
        nan = tl.maximum(nan, vn)
    return acc, bad, nan


@triton.jit
def _reduce_kernel(table, num_chunks, partials, flags, inv_ptr, inv_val, found_ptr,
                   KIND: tl.constexpr, UNSCALE: tl.constexpr, FLAG_DIRECT: tl.constexpr,
                   ALIGNED: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """UNSCALE: 0 none, 1 inv from inv_ptr, 2 inv = inv_val. FLAG_DIRECT: a
    chunk with a non-finite input stores 1.0 into found_ptr (the same value
    from every program: no read-modify-write); else flags[c] gets bit 0 (a
    non-finite input) and bit 1 (a NaN value, for the inf-norm)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if UNSCALE == 1:
        inv = tl.load(inv_ptr)
    else:
        inv = tl.cast(inv_val, tl.float32)
    write = inv != 1.0
    for c in range(pid, num_chunks, nprog):
        row = table + c * 4
        addr = tl.load(row)
        n = tl.load(row + 1)
        code = tl.load(row + 2)
        acc = tl.zeros([BLOCK], ACC)
        bad = tl.zeros([BLOCK], tl.int32)
        nan = tl.zeros([BLOCK], tl.int32)
        full = (n // BLOCK) * BLOCK
        for s in range(0, full, BLOCK):
            acc, bad, nan = _reduce_step(addr, code, s + tl.arange(0, BLOCK), n, inv, write, acc,
                                         bad, nan, KIND, UNSCALE != 0, False, ALIGNED, ACC)
        if full < n:
            acc, bad, nan = _reduce_step(addr, code, full + tl.arange(0, BLOCK), n, inv, write,
                                         acc, bad, nan, KIND, UNSCALE != 0, True, ALIGNED, ACC)
        flag = tl.max(bad, 0) + 2 * tl.max(nan, 0)
        if FLAG_DIRECT:
            if flag != 0:
                tl.store(found_ptr, 1.0)
        else:
            if KIND == 3:
                tl.store(partials + c, tl.max(acc, 0))
            else:
                tl.store(partials + c, tl.sum(acc, 0))
            tl.store(flags + c, flag)


@triton.jit
def _finish_kernel(partials, flags, num_chunks, extra, out, found_ptr, KIND: tl.constexpr,
                   HAS_EXTRA: tl.constexpr, FOUND: tl.constexpr, ACC: tl.constexpr,
                   ACC64: tl.constexpr, RBLOCK: tl.constexpr):
    """One program: the fixed-order reduction of the chunks' slots (plus the
    torch-op contribution `extra` = [value, non-finite flag] when HAS_EXTRA);
    out = fp32 norm; FOUND: 0 leave found_inf, 1 assign it, 2 set it to 1
    when flagged (OR)."""
    acc = tl.zeros([RBLOCK], ACC)
    fl = tl.zeros([RBLOCK], tl.int32)
    for s in range(0, num_chunks, RBLOCK):
        offs = s + tl.arange(0, RBLOCK)
        m = offs < num_chunks
        v = tl.load(partials + offs, mask=m, other=0.0)
        if KIND == 3:
            acc = tl.maximum(acc, v)
        else:
            acc += v
        fl = fl | tl.load(flags + offs, mask=m, other=0)
    if KIND == 3:
        total = tl.max(acc, 0)
    else:
        total = tl.sum(acc, 0)
    nonfinite = tl.max(fl & 1, 0)
    nan = tl.max((fl >> 1) & 1, 0)
    if HAS_EXTRA:
        e = tl.load(extra)
        if KIND == 3:
            nan = tl.maximum(nan, (e != e).to(tl.int32))
            total = tl.maximum(total, tl.where(e != e, 0.0, e))
        else:
            total = total + e
        nonfinite = tl.maximum(nonfinite, (tl.load(extra + 1) != 0).to(tl.int32))
    if KIND == 1:
        if ACC64:
            total = tl.sqrt(total)
        else:
            total = tl.sqrt_rn(total)
    norm = total.to(tl.float32)
    if KIND == 3:
        if nan != 0:  # the CPU path's quiet NaN, whatever max() does with NaN
            tl.store(out.to(tl.pointer_type(tl.int32), bitcast=True), 0x7FC00000)
        else:
            tl.store(out, norm)
    else:
        tl.store(out, norm)
    if FOUND == 1:
        tl.store(found_ptr, nonfinite.to(tl.float32))
    elif FOUND == 2:
        if nonfinite != 0:
            tl.store(found_ptr, 1.0)


@triton.jit
def _scale_step(addr, code, offs, n, s, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    if code == 3:
        x64 = load_f64(addr, offs, n, MASKED, ALIGNED)
        store_f64(addr, offs, n, x64 * s.to(tl.float64), True, MASKED, False, ALIGNED)
    else:
        x32 = load_f32(addr, code, offs, n, MASKED, ALIGNED)
        store_f32(addr, code, offs, n, x32 * s, True, MASKED, False, ALIGNED)


@triton.jit
def _scale_kernel(table, num_chunks, scale_ptr, scale_val, max_norm, coeff_ptr,
                  MODE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """x = cast(float(x) * s) in place (fp64 grads: x * double(s)). MODE: 0 s
    from scale_ptr, 1 s = scale_val, 2 clip with the norm at scale_ptr, 3
    clip with norm = scale_val; clipping stores s into coeff_ptr (program 0)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if MODE == 0:
        s = tl.load(scale_ptr)
    elif MODE == 1:
        s = tl.cast(scale_val, tl.float32)
    else:
        if MODE == 2:
            nrm = tl.load(scale_ptr)
        else:
            nrm = tl.cast(scale_val, tl.float32)
        # As Megatron and the C++ path: fp32 max_norm / (norm + 1e-6) as ONE
        # correctly rounded division; at most 1, a NaN norm stays NaN.
        coef = tl.div_rn(tl.cast(max_norm, tl.float32), nrm + 1.0e-6)
        s = tl.where(coef > 1.0, 1.0, coef)
        if pid == 0:
            tl.store(coeff_ptr, s)
    for c in range(pid, num_chunks, nprog):
        row = table + c * 4
        addr = tl.load(row)
        n = tl.load(row + 1)
        code = tl.load(row + 2)
        full = (n // BLOCK) * BLOCK
        for st in range(0, full, BLOCK):
            _scale_step(addr, code, st + tl.arange(0, BLOCK), n, s, False, ALIGNED)
        if full < n:
            _scale_step(addr, code, full + tl.arange(0, BLOCK), n, s, True, ALIGNED)


@triton.jit
def _zeros_step(addr, code, offs, n, cnt, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    if code == 3:
        z = load_f64(addr, offs, n, MASKED, ALIGNED) == 0.0
    else:
        z = load_f32(addr, code, offs, n, MASKED, ALIGNED) == 0.0
    if MASKED:
        z = z & (offs < n)
    return cnt + z.to(tl.int32)


@triton.jit
def _zeros_kernel(table, num_chunks, partials, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for c in range(pid, num_chunks, nprog):
        row = table + c * 4
        addr = tl.load(row)
        n = tl.load(row + 1)
        code = tl.load(row + 2)
        cnt = tl.zeros([BLOCK], tl.int32)
        full = (n // BLOCK) * BLOCK
        for s in range(0, full, BLOCK):
            cnt = _zeros_step(addr, code, s + tl.arange(0, BLOCK), n, cnt, False, ALIGNED)
        if full < n:
            cnt = _zeros_step(addr, code, full + tl.arange(0, BLOCK), n, cnt, True, ALIGNED)
        tl.store(partials + c, tl.sum(cnt.to(tl.int64), 0))


@triton.jit
def _zeros_finish_kernel(partials, num_chunks, extra, out, HAS_EXTRA: tl.constexpr,
                         RBLOCK: tl.constexpr):
    acc = tl.zeros([RBLOCK], tl.int64)
    for s in range(0, num_chunks, RBLOCK):
        offs = s + tl.arange(0, RBLOCK)
        acc += tl.load(partials + offs, mask=offs < num_chunks, other=0)
    total = tl.sum(acc, 0)
    if HAS_EXTRA:
        total = total + tl.load(extra)
    tl.store(out, total)


@triton.jit
def _mts_step(src, dst, cs, cd, offs, n, s, bad, MASKED: tl.constexpr, ALIGNED: tl.constexpr):
    if cs == 3:
        x = load_f64(src, offs, n, MASKED, ALIGNED).to(tl.float32)
    else:
        x = load_f32(src, cs, offs, n, MASKED, ALIGNED)
    bad = tl.maximum(bad, nonfinite_f32(x))
    y = x * s
    if cd == 3:
        store_f64(dst, offs, n, y.to(tl.float64), True, MASKED, False, ALIGNED)
    else:
        store_f32(dst, cd, offs, n, y, True, MASKED, False, ALIGNED)
    return bad


@triton.jit
def _mts_kernel(table, num_chunks, scale_ptr, scale_val, found_ptr, SCALE_PTR: tl.constexpr,
                ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """dst = cast(float(src) * s) per chunk row (src address, dst address,
    count, src code, dst code, 0); a non-finite SOURCE value (as fp32) stores
    1.0 into found_ptr."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if SCALE_PTR:
        s = tl.load(scale_ptr)
    else:
        s = tl.cast(scale_val, tl.float32)
    for c in range(pid, num_chunks, nprog):
        row = table + c * 6
        src = tl.load(row)
        dst = tl.load(row + 1)
        n = tl.load(row + 2)
        cs = tl.load(row + 3)
        cd = tl.load(row + 4)
        bad = tl.zeros([BLOCK], tl.int32)
        full = (n // BLOCK) * BLOCK
        for st in range(0, full, BLOCK):
            bad = _mts_step(src, dst, cs, cd, st + tl.arange(0, BLOCK), n, s, bad, False, ALIGNED)
        if full < n:
            bad = _mts_step(src, dst, cs, cd, full + tl.arange(0, BLOCK), n, s, bad, True, ALIGNED)
        if tl.max(bad, 0) != 0:
            tl.store(found_ptr, 1.0)


# ---------------------------------------------------------------- host side


def _check_device(device, where):
    tensors = "CPU tensors" if device.type == "cpu" else f"{device.type} tensors"
    tc.check_device(device, where, f"argument 'backend' is 'triton' for {tensors}")


def _rows(views, chunk):
    """Table rows of contiguous flat views: (address, count, code, view index)."""
    rows = []
    for index, v in enumerate(views):
        n = v.numel()
        es = v.element_size()
        addr = v.data_ptr()
        code = tc.DTYPE_CODES[v.dtype]
        for off in range(0, n, chunk):
            rows.append((addr + off * es, min(chunk, n - off), code, index))
    return rows


class TritonGradPlan:
    """A plan over grads whose operations are Triton kernels over one region
    table (see the module docstring). Built once per grad list; every
    operation is free of host reads."""

    def __init__(self, grads, device, where="GradPlan", *, chunk=None, block=None,
                 max_programs=None):
        _check_device(device, where)
        self.torch_plan = tp = TorchGradPlan(grads, device, where)
        self.device = device = tp.device  # indexed, as the tensors name it
        self.core = tp.core
        default_chunk, default_block = defaults(device)
        self.chunk = int(chunk or default_chunk)
        self.block = int(block or default_block)
        if self.block & (self.block - 1) or self.chunk < 1:
            raise Error(f"{where}: block must be a power of two and chunk >= 1 "
                        f"(got {self.block}, {self.chunk})")
        self.max_programs = int(max_programs or tc.max_programs(device))
        self.acc64 = tc.device_has_float64(device)
        self.acc_dtype = torch.float64 if self.acc64 else torch.float32

        self._split(tp)
        fast = self.views

        rows = _rows(fast, self.chunk)
        self.num_chunks = len(rows)
        self.aligned = all(r[0] % 16 == 0 for r in rows)
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)
        self.table = table.to(device) if device.type != "cpu" else table
        slots = max(self.num_chunks, 1)
        self.partials = torch.empty(slots, dtype=self.acc_dtype, device=device)
        self.flags = torch.empty(slots, dtype=torch.int32, device=device)
        self.zero_partials = torch.empty(slots, dtype=torch.int64, device=device)
        self.numel = sum(v.numel() for v in fast)

    def _split(self, tp):
        """The views the kernels take (regions listed once) and the torch-op
        fallback plan over the rest (generic views, repeated regions)."""
        generic_ids = {id(g) for g in tp.generic}
        fast, slow_groups = [], []
        for grp in tp.groups:
            if grp.multiplicity == 1:
                fast.extend(v for v in grp.views if id(v) not in generic_ids)
                slow = [v for v in grp.views if id(v) in generic_ids]
            else:
                slow = list(grp.views)
            if slow:
                g = ViewGroup(grp.multiplicity)
                g.views = slow
                slow_groups.append(g)
        self.torch_plan = tp
        self.views = fast
        self.fallback = _subplan(tp, slow_groups) if slow_groups else None
        self.num_fallback = sum(len(g.views) for g in slow_groups)

    def unbound(self):
        """This plan without its tensors (see TorchGradPlan.unbound): the
        region table holds addresses only."""
        template = copy.copy(self)
        template.torch_plan = self.torch_plan.unbound()
        template.views = template.fallback = None
        return template

    def bind(self, grads):
        """This plan over ``grads``, of the addresses, dtypes, shapes and strides
        it was built from (see TorchGradPlan.bind); None where it cannot be."""
        return self._over(self.torch_plan.bind(grads))

    @property
    def base_index(self):
        return self.torch_plan.base_index

    def region_is_base(self, grad):
        return self.torch_plan.region_is_base(grad)

    def bind_base(self, grad):
        """As TorchGradPlan.bind_base: the grad at base_index alone, or None."""
        return self._over(self.torch_plan.bind_base(grad))

    def _over(self, torch_plan):
        """This plan over a bound torch-op plan's views (None: None)."""
        if torch_plan is None:
            return None
        bound = shallow_copy(self)
        bound._split(torch_plan)
        return bound

    # ---------------------------------------------------------------- helpers

    @property
    def grid(self):
        return (max(1, min(self.num_chunks, self.max_programs)),)

    def scalar(self, dtype=torch.float32, zeroed=True):
        make = torch.zeros if zeroed else torch.empty
        return make(1, dtype=dtype, device=self.device)

    def _check_scalar(self, value, arg, dtype=torch.float32):
        if value.numel() != 1 or value.dtype != dtype:
            raise Error(f"GradPlan: argument '{arg}' must be a 1-element "
                        f"{dtype_name(dtype)} tensor (got {dtype_name(value.dtype)}"
                        f"{list(value.shape)})")
        if value.device != self.device:
            raise Error(f"GradPlan: argument '{arg}' must be on the grads' device "
                        f"{self.device} (got {value.device})")
        if not value.is_contiguous():
            raise Error(f"GradPlan: argument '{arg}' must be contiguous")

    def unsupported(self, op, norm_type=None):
        """None if the kernels run `op` ("norm", "clip", ...), else why the
        torch-op plan runs it (the op registry asks, per call)."""
        if op in ("norm", "unscale_norm") and float(norm_type) not in _KINDS:
            return (f"norm_type {norm_type} is not 1, 2 or inf: the torch-op backend runs the "
                    f"whole call")
        return None

    def detail(self):
        """How the kernels cover the grads (recorded with each call's reason)."""
        detail = f"{self.num_chunks} chunks of {len(self.views)} regions"
        if self.num_fallback:
            detail += (f"; {self.num_fallback} entries (multiplicity > 1 or strided) by the "
                       f"torch-op code")
        return detail

    def _fallback_extra(self, kind, flag_values=True):
        """The fallback entries' contribution [value, non-finite flag] in the
        accumulation dtype: sum of |x|^p (weighted by multiplicity) or max |x|."""
        fb = self.fallback
        p = {KIND_L2: 2.0, KIND_L1: 1.0, KIND_INF: math.inf}[kind]
        norms = fb.view_norms(p).to(self.acc_dtype)
        if kind == KIND_INF:
            value = norms.amax(0, keepdim=True)
            maxabs = norms
        else:
            terms = norms if kind == KIND_L1 else norms.pow(2.0)
            if fb.weighted:
                terms = terms * fb.weights.to(self.acc_dtype)
            value = terms.sum(0, keepdim=True)
            maxabs = fb.view_norms(math.inf) if flag_values else None
        if flag_values:
            flag = maxabs.amax(0, keepdim=True).mul(0.0).ne(0.0).to(self.acc_dtype)
        else:
            flag = torch.zeros(1, dtype=self.acc_dtype, device=self.device)
        return torch.cat([value, flag])

    # ---------------------------------------------------------------- operations

    def norm(self, norm_type, out, found_inf, inv_scale=None):
        """Returns ``(norm, found_inf)``: fp32 [1] each. found_inf None: a new
        flag (assigned by the finish kernel); given: set to 1 when flagged."""
        kind = _KINDS.get(float(norm_type))
        if kind is None:
            if found_inf is None:
                found_inf = self.scalar()
            return self.torch_plan.norm(norm_type, out, found_inf, inv_scale), found_inf
        if out is None:
            out = torch.empty(1, dtype=torch.float32, device=self.device)
        else:
            self._check_scalar(out, "out")
        fb = self.fallback
        if found_inf is None:
            found_inf = self.scalar(zeroed=fb is not None)
            mode = 2 if fb is not None else 1
        else:
            self._check_scalar(found_inf, "found_inf")
            mode = 2
        unscale, inv_ptr, inv_val = 0, self.partials, 1.0
        if inv_scale is not None:
            if isinstance(inv_scale, torch.Tensor):
                self._check_scalar(inv_scale, "inv_scale")
                unscale, inv_ptr = 1, inv_scale
            else:
                unscale, inv_val = 2, tc.host_f32(inv_scale)
            if fb is not None:  # as the CPU path: the generic views are scaled first
                fb.unscale(inv_scale, found_inf)
        if self.num_chunks:
            _reduce_kernel[self.grid](self.table, self.num_chunks, self.partials, self.flags,
                                      inv_ptr, inv_val, found_inf, KIND=kind, UNSCALE=unscale,
                                      FLAG_DIRECT=False, ALIGNED=self.aligned,
                                      ACC=_tl_dtype(self.acc_dtype), BLOCK=self.block)
        extra = None
        if fb is not None:
            extra = self._fallback_extra(kind, flag_values=inv_scale is None)
        _finish_kernel[(1,)](self.partials, self.flags, self.num_chunks,
                             extra if extra is not None else self.partials, out, found_inf,
                             KIND=kind, HAS_EXTRA=extra is not None, FOUND=mode,
                             ACC=_tl_dtype(self.acc_dtype), ACC64=self.acc64,
                             RBLOCK=FINISH_BLOCK)
        return out, found_inf

    def unscale(self, inv_scale, found_inf):
        """x = cast(float(x) * inv_scale) in place; found_inf (given) set to 1
        if any value before scaling is not finite. One launch."""
        self._check_scalar(found_inf, "found_inf")
        fb = self.fallback
        if isinstance(inv_scale, torch.Tensor):
            self._check_scalar(inv_scale, "inv_scale")
            unscale, inv_ptr, inv_val = 1, inv_scale, 1.0
        else:
            unscale, inv_ptr, inv_val = 2, found_inf, tc.host_f32(inv_scale)
        if fb is not None:
            fb.unscale(inv_scale, found_inf)
        if self.num_chunks:
            _reduce_kernel[self.grid](self.table, self.num_chunks, self.partials, self.flags,
                                      inv_ptr, inv_val, found_inf, KIND=KIND_NONE,
                                      UNSCALE=unscale, FLAG_DIRECT=True, ALIGNED=self.aligned,
                                      ACC=_tl_dtype(self.acc_dtype), BLOCK=self.block)

    def _scale(self, mode, scale_arg, scale_val, max_norm, coeff):
        _scale_kernel[self.grid](self.table, self.num_chunks, scale_arg, scale_val, max_norm,
                                 coeff, MODE=mode, ALIGNED=self.aligned, BLOCK=self.block)

    def clip(self, total_norm, max_norm, coeff_out):
        """Scales every grad by min(1, max_norm / (norm + 1e-6)) in place and
        returns the coefficient (fp32 [1]): one launch (plus the torch-op
        code for fallback entries)."""
        if coeff_out is None:
            coeff = torch.empty(1, dtype=torch.float32, device=self.device)
        else:
            self._check_scalar(coeff_out, "coeff_out")
            coeff = coeff_out
        if isinstance(total_norm, torch.Tensor):
            self._check_scalar(total_norm, "norm")
            self._scale(2, total_norm, 0.0, tc.host_f32(max_norm), coeff)
        else:
            self._scale(3, coeff, tc.host_f32(total_norm), tc.host_f32(max_norm), coeff)
        if self.fallback is not None:
            self.fallback.scale_views(coeff.view(()))
        return coeff

    def scale(self, scale):
        if isinstance(scale, torch.Tensor):
            self._check_scalar(scale, "scale")
            if self.num_chunks:
                self._scale(0, scale, 0.0, 0.0, scale)
        elif self.num_chunks:
            self._scale(1, self.partials, tc.host_f32(scale), 0.0, self.partials)
        if self.fallback is not None:
            self.fallback.scale(scale)

    def count_zeros(self, out):
        """sum(numel - count_nonzero) as int64 [1] (into `out` if given)."""
        if out is None:
            out = torch.empty(1, dtype=torch.int64, device=self.device)
        else:
            self._check_scalar(out, "out", torch.int64)
        if self.num_chunks:
            _zeros_kernel[self.grid](self.table, self.num_chunks, self.zero_partials,
                                     ALIGNED=self.aligned, BLOCK=self.block)
        extra = None
        fb = self.fallback
        if fb is not None:
            counts = torch.stack([torch.count_nonzero(v) for v in fb.views])
            if fb.weighted:
                counts = counts * fb.weights.to(torch.int64)
            extra = counts.sum(0, keepdim=True).neg_().add_(fb.numel)
        _zeros_finish_kernel[(1,)](self.zero_partials, self.num_chunks,
                                   extra if extra is not None else self.zero_partials, out,
                                   HAS_EXTRA=extra is not None, RBLOCK=FINISH_BLOCK)
        return out


def _tl_dtype(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _subplan(plan, groups):
    """A TorchGradPlan over some of `plan`'s groups (the fallback entries)."""
    sub = copy.copy(plan)
    sub.groups = groups
    sub.views = [v for g in groups for v in g.views]
    sub.weighted = any(g.multiplicity != 1 for g in groups)
    sub.weights = None
    if sub.weighted:
        sub.weights = torch.tensor([float(g.multiplicity) for g in groups for _ in g.views],
                                   dtype=plan.acc_dtype, device=plan.device)
    sub._flat_dtype = sub._flat_view_dtype()
    sub.has_float64_grads = any(v.dtype == torch.float64 for v in sub.views)
    sub.numel = sum(v.numel() * g.multiplicity for g in groups for v in g.views)
    sub._max_norms = {}
    return sub


# ---------------------------------------------------------------- multi_tensor_scale

_MTS_CACHE_SIZE = 32
_mts_tables = {}  # key of the pair list -> (table, num_chunks, aligned), most recent last


def _mts_table(pairs, device, chunk):
    key = (device, chunk, tuple((s.data_ptr(), d.data_ptr(), s.numel(), s.dtype, d.dtype)
                                for s, d in pairs))
    hit = _mts_tables.pop(key, None)
    if hit is None:
        rows = []
        for s, d in pairs:
            n = s.numel()
            ss, ds = s.element_size(), d.element_size()
            cs, cd = tc.DTYPE_CODES[s.dtype], tc.DTYPE_CODES[d.dtype]
            for off in range(0, n, chunk):
                rows.append((s.data_ptr() + off * ss, d.data_ptr() + off * ds, min(chunk, n - off),
                             cs, cd, 0))
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
        if device.type != "cpu":
            table = table.to(device)
        aligned = all(r[0] % 16 == 0 and r[1] % 16 == 0 for r in rows)
        hit = (table, len(rows), aligned)
        if len(_mts_tables) >= _MTS_CACHE_SIZE:
            _mts_tables.pop(next(iter(_mts_tables)))
    _mts_tables[key] = hit
    return hit


def _same_view(s, d):
    return (s.data_ptr() == d.data_ptr() and s.dtype == d.dtype and s.shape == d.shape
            and s.stride() == d.stride())


def mts_route(src, dst):
    """None when the Triton kernel takes the pairs, else why the torch-op
    code runs them (it stages overlaps and runs sharing pairs in order)."""
    for i, (s, d) in enumerate(zip(src, dst)):
        if s.numel() == 0:
            continue
        if not (s.is_contiguous() and d.is_contiguous()):
            return f"pair {i} is strided"
        if not _same_view(s, d):
            a, b = byte_range(s), byte_range(d)
            if a[0] == b[0] and a[1] < b[2] and b[1] < a[2]:
                return f"pair {i}'s source and destination partially overlap"
        if s.dtype not in tc.DTYPE_CODES or d.dtype not in tc.DTYPE_CODES:
            return f"pair {i} has a dtype outside fp32/fp16/bf16/fp64"
    if pairs_share_memory(src, dst):
        return "pairs share memory (they run one after another, in list order)"
    return None


def multi_tensor_scale(src, dst, scale, found_inf, device, *, chunk=None, block=None,
                       supported=False):
    """dst[i] = cast(float(src[i]) * scale); found_inf = 1 if any source value
    is not finite (OR-ed). One launch for every pair and dtype, unless
    :func:`mts_route` sends the call to the torch-op code (returned: its
    reason, else None). ``supported=True``: the caller (the op registry)
    already asked :func:`mts_route`."""
    _check_device(device, "multi_tensor_scale")
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            raise Error(f"multi_tensor_scale: argument 'scale' must be a 1-element float32 tensor "
                        f"on {device} (got {dtype_name(scale.dtype)}{list(scale.shape)} on "
                        f"{scale.device})")
    reason = None if supported else mts_route(src, dst)
    if reason is not None:
        torch_grad.multi_tensor_scale(src, dst, scale, found_inf, device)
        return reason
    pairs = [(s, d) for s, d in zip(src, dst) if s.numel() > 0]
    if not pairs:
        return None
    default_chunk, default_block = defaults(device)
    table, num_chunks, aligned = _mts_table(pairs, device, int(chunk or default_chunk))
    grid = (max(1, min(num_chunks, tc.max_programs(device))),)
    if isinstance(scale, torch.Tensor):
        _mts_kernel[grid](table, num_chunks, scale, 1.0, found_inf, SCALE_PTR=True,
                          ALIGNED=aligned, BLOCK=int(block or default_block))
    else:
        _mts_kernel[grid](table, num_chunks, found_inf, tc.host_f32(scale), found_inf,
                          SCALE_PTR=False, ALIGNED=aligned, BLOCK=int(block or default_block))
    return None
