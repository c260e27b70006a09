"""The gradient engine in PyTorch ops, for grads on any torch device.

The C++ planner runs on metadata only: every grad is described by a
synthetic address (a base per storage plus its byte offset), its dtype,
shape and strides, so regions are found exactly as on the CPU (same
coalescing, same multiplicity of duplicated and overlapping views, same
generic list). Each region then becomes one flat view of its storage, and
every operation is a handful of foreach ops over those views:

- norm: ``_foreach_norm`` per view (accumulated in float64 where the device
  has it), then one reduction; found_inf from the same values, never a host
  comparison;
- unscale + found_inf: ``_amp_foreach_non_finite_check_and_unscale_`` (reads
  each value, flags non-finite inputs, writes the unscaled value: one pass;
  bf16 views off the CPU, which its CUDA kernel does not take: max |x| for
  the flag, then the scale), then the norm pass;
- clip: the coefficient ``clamp(max_norm / (norm + 1e-6), max=1)`` stays a
  device tensor; ``_foreach_mul_`` scales in place (fp32 math, one rounding;
  fp16 and bf16 views off the CPU through fp32 copies, see ``_scale_in_place``);
- count_zeros: ``count_nonzero`` per view, summed in int64.

A view covered by k listed grads is counted k times by norms and zero counts
and scaled k times by in-place ops, as the CPU path does. No operation reads
a device value on the host.
"""

import copy

import torch

from .._leanstep import Error, GradPlanCore, region_base

_STORAGE_SPACING_BITS = 44  # synthetic base of storage k: (k + 1) << 44 (16 TiB apart)
_OFFSET_MASK = (1 << _STORAGE_SPACING_BITS) - 1
#: The grad dtypes the planner takes (the C++ Plan's own list).
PLAN_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def shallow_copy(plan):
    """``copy.copy`` of a plan object for a per-call bind: the same attributes,
    without copy's reduce protocol (measured right after a fresh list of 3168
    views, as Megatron makes it each step: 18.5 us against 6.6 us)."""
    bound = object.__new__(type(plan))
    bound.__dict__.update(plan.__dict__)
    return bound


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def canonical_device(device):
    """``device`` as tensors name it: ``torch.device("cuda")`` means the current
    device, while a tensor on it reports ``cuda:0``, and the two compare
    unequal. A plan keeps the indexed form, so its checks and outputs agree
    with the tensors it is given."""
    device = torch.device(device)
    if device.index is None and device.type == "mps":
        return torch.device("mps", 0)  # one device; torch.mps has no current_device
    if device.index is None and device.type not in ("cpu", "meta"):
        current = getattr(getattr(torch, device.type, None), "current_device", None)
        if current is not None:
            return torch.device(device.type, current())
    return device


def _has_float64(device):
    return device.type != "mps"


class ViewGroup:
    """Views with the same multiplicity (how many listed grads cover them)."""

    __slots__ = ("multiplicity", "views")  # one made per bound call: no instance dict

    def __init__(self, multiplicity):
        self.multiplicity = multiplicity
        self.views = []


class TorchGradPlan:
    """A plan over device grads: the C++ region table, realised as flat
    views. Built once per grad list; every operation is sync-free."""

    def __init__(self, grads, device, where="GradPlan"):
        self.device = device = canonical_device(device)
        self.grads = grads
        storages = {}  # storage identity -> (index, {dtype: list index of a grad there}, storage)
        layout = []
        for i, g in enumerate(grads):
            if g.dtype not in PLAN_DTYPES:
                raise Error(f"{where}: argument 'grads[{i}]' must be float32, float16, bfloat16 "
                            f"or float64 (got {dtype_name(g.dtype)})")
            storage = g.untyped_storage()
            key = storage._cdata
            entry = storages.get(key)
            if entry is None:
                if storage.nbytes() > _OFFSET_MASK:
                    raise Error(f"{where}: argument 'grads[{i}]' lies in a storage of "
                                f"{storage.nbytes()} bytes, above the planner's 2^44-byte limit")
                entry = storages[key] = (len(storages), {}, storage)
            entry[1].setdefault(g.dtype, i)
            address = ((entry[0] + 1) << _STORAGE_SPACING_BITS) + g.storage_offset() * g.element_size()
            layout.append((address, dtype_name(g.dtype), list(g.shape), list(g.stride())))
        self.core = GradPlanCore.from_layout(layout)
        # How to realise the plan over a list of tensors: per storage, the list index of
        # one grad of each dtype in it (the base of its region views) and the storage's
        # address and size; per group, each view as a region of a base or a listed grad.
        # A plan bound to another list (bind) rebuilds its views from these alone.
        self._storages = {index: (bases, storage.data_ptr(), storage.nbytes())
                          for index, bases, storage in storages.values()}
        recipes = {}
        for address, region_dtype, numel, multiplicity in self.core.regions:
            storage_index = (address >> _STORAGE_SPACING_BITS) - 1
            dtype = getattr(torch, region_dtype)
            offset = (address & _OFFSET_MASK) // grads[self._storages[storage_index][0][dtype]] \
                .element_size()
            recipes.setdefault(multiplicity, []).append(("region", storage_index, dtype, offset,
                                                         numel))
        self._generic_indices = [index for index, _ in self.core.generic]
        if self._generic_indices:
            recipes.setdefault(1, []).extend(("grad", index) for index in self._generic_indices)
        self._recipes = [(m, recipes[m]) for m in sorted(recipes)]
        self._whole_base = None
        if not self._generic_indices and len(recipes) == 1 and len(recipes.get(1, ())) == 1 \
                and device.type != "meta":
            # The common plan, one region of one storage counted once (Megatron's grad
            # buffer, its views laid end to end): the region's own memory, by address.
            _, storage_index, dtype, offset, numel = recipes[1][0]
            by_dtype, address, _ = self._storages[storage_index]
            self._whole_base = (by_dtype[dtype], dtype_name(dtype),
                                address + offset * grads[by_dtype[dtype]].element_size(), numel)
        self._realise(grads)
        # Per-view weight (multiplicity) for the norm's reduction, built once.
        self.weighted = any(grp.multiplicity != 1 for grp in self.groups)
        self._flat_dtype = self._flat_view_dtype()
        acc = torch.float64 if _has_float64(device) else torch.float32
        self.acc_dtype = acc
        self.weights = None
        if self.weighted:
            self.weights = torch.tensor([float(grp.multiplicity) for grp in self.groups
                                         for _ in grp.views], dtype=acc, device=device)
        self.has_float64_grads = any(v.dtype == torch.float64 for v in self.views)
        self.numel = sum(v.numel() * grp.multiplicity for grp in self.groups for v in grp.views)

    def _bases(self, grads):
        """{(storage index, dtype): base grad} of ``grads``, or None where a base's
        storage is not the one the plan was built over (its address or size)."""
        bases = {}
        for storage_index, (by_dtype, address, nbytes) in self._storages.items():
            for dtype, index in by_dtype.items():
                base = grads[index]
                storage = base.untyped_storage()
                if storage.data_ptr() != address or storage.nbytes() < nbytes:
                    return None
                bases[storage_index, dtype] = base
        return bases

    def _realise(self, grads, bases=None):
        """The flat views of the plan's regions over ``grads``."""
        if bases is None:
            bases = self._bases(grads)
        groups = []
        for multiplicity, recipes in self._recipes:
            group = ViewGroup(multiplicity)
            for recipe in recipes:
                if recipe[0] == "grad":
                    group.views.append(grads[recipe[1]])
                else:
                    _, storage_index, dtype, offset, numel = recipe
                    group.views.append(bases[storage_index, dtype].as_strided((numel,), (1,),
                                                                              offset))
            groups.append(group)
        self._set_groups(grads, groups)

    def _set_groups(self, grads, groups):
        """This plan over ``grads``, its regions realised as ``groups``."""
        self.grads = grads
        self.generic = [grads[index] for index in self._generic_indices]
        self.groups = groups
        self.views = [v for grp in groups for v in grp.views]

    def unbound(self):
        """This plan without its tensors (no memory kept alive): what a cache
        keeps. :meth:`bind` gives a usable plan again."""
        template = copy.copy(self)
        template.grads = template.generic = template.groups = template.views = None
        return template

    def bind(self, grads):
        """This plan over ``grads``, a list whose every tensor has the address,
        dtype, shape and strides of the list the plan was built from (the
        caller checks that): the region views are rebuilt from its tensors, so
        they cover its memory and keep it alive. None when a region's base
        lies in another storage (the plan does not describe that memory)."""
        if self._whole_base is not None:
            bound = self._bound_to_region(grads, grads[self._whole_base[0]])
            if bound is not None:
                return bound
        bases = self._bases(grads)
        if bases is None:
            return None
        bound = shallow_copy(self)
        bound._realise(grads, bases)
        return bound

    @property
    def base_index(self):
        """The list index of the grad whose base is the plan's one region (see
        :meth:`bind_base`), or None for a plan of other regions."""
        return None if self._whole_base is None else self._whole_base[0]

    def region_is_base(self, grad):
        """Whether :meth:`bind_base` takes ``grad`` (no view made)."""
        return self._whole_base is not None and self._region_as_base(grad) is not None

    def bind_base(self, grad):
        """This plan over a list whose key the caller matched with the one the
        plan was built from, given the grad at :attr:`base_index` alone (the
        caller made no list): its base is the region. None where it is not
        (the general path, :meth:`bind`, decides)."""
        if self._whole_base is None:
            return None
        return self._bound_to_region([grad], grad)

    def _bound_to_region(self, grads, grad):
        flat = self._region_as_base(grad)
        if flat is None:
            return None
        group = ViewGroup(1)
        group.views.append(flat)
        bound = shallow_copy(self)
        # _set_groups' lists, made directly: no listed grad is generic in such a plan.
        bound.grads, bound.generic, bound.groups, bound.views = grads, [], [group], group.views
        return bound

    def _region_as_base(self, grad):
        """The one region's flat view without a storage object or an as_strided
        call: the tensor its grads are views of (``_base``; the grad itself when
        it is no view), where that tensor is exactly the region: 1-d, compact, of
        its dtype, at its address, of its numel (so it covers exactly the memory
        the listed grads cover, which their key fixed), and no autograd leaf
        that an in-place op would refuse. None otherwise (the general path).
        One C call (``region_base``, which reads torch's own types only; a
        grad of another type takes the general path): right after Megatron's
        own clip over 3168 fresh views, the storage check and as_strided cost
        about 40 us a call more, and the same checks read from Python 37 us
        (one thread, median of 200)."""
        _, dtype, address, numel = self._whole_base  # dtype by name
        return region_base(grad, dtype, address, numel)

    # ---------------------------------------------------------------- helpers

    def scalar(self, dtype=torch.float32, zeroed=True):
        make = torch.zeros if zeroed else torch.empty
        return make(1, dtype=dtype, device=self.device)

    def _as_device_scalar(self, value, arg):
        """A number or a 1-element fp32 tensor on the plan's device, as a 0-dim view."""
        if isinstance(value, torch.Tensor):
            self._check_device_scalar(value, arg)
            return value if value.dim() == 0 else value.view(())
        return torch.full((), float(value), dtype=torch.float32, device=self.device)

    def _check_device_scalar(self, value, arg):
        if value.numel() != 1 or value.dtype != torch.float32:
            raise Error(f"GradPlan: argument '{arg}' must be a 1-element float32 tensor "
                        f"(got {dtype_name(value.dtype)}{list(value.shape)})")
        if value.device != self.device:
            raise Error(f"GradPlan: argument '{arg}' must be on the grads' device "
                        f"{self.device} (got {value.device})")

    def _norm_dtype(self, norm_type):
        if norm_type == float("inf") and not self.has_float64_grads:
            return torch.float32  # max |x| is exact in any dtype that holds x
        return self.acc_dtype

    def view_norms(self, norm_type):
        return torch.stack(torch._foreach_norm(self.views, norm_type,
                                               dtype=self._norm_dtype(norm_type)))

    def _flat_view_dtype(self):
        """The dtype of the plan's only view when it is one 1-d view counted once (one
        region, a flat buffer's views coalesced, or one 1-d grad), else None. The plan's
        structure fixes it, and every bind keeps that structure (a region's view is 1-d,
        a listed grad's shape is in the key): read once, as a view's dim and dtype are
        torch calls, microseconds each in the cold state a step leaves."""
        if len(self.views) == 1 and self.views[0].dim() == 1 and not self.weighted:
            return self.views[0].dtype
        return None

    def _one_flat_view(self):
        """The plan's only view when it is one 1-d view counted once, else None: the
        total over it is one op, where the list path stacks per-view results."""
        return self.views[0] if self._flat_dtype is not None else None

    def _total(self, norm_type):
        """The total norm in the accumulation dtype, shape [1]."""
        flat = self._one_flat_view() if norm_type in (2.0, float("inf")) else None
        if flat is not None:
            # One op, not three (per-view norms, stack, their norm). p = 2 and inf only:
            # there the list path's outer norm of one value is exact (sqrt(x * x) and
            # the max of x are x), so the two differ at most by the order in which
            # torch's two kernels sum the view.
            return torch.linalg.vector_norm(flat, norm_type, keepdim=True,
                                            dtype=self._norm_dtype(norm_type))
        norms = self.view_norms(norm_type)
        if norm_type == float("inf"):
            return norms.amax(0, keepdim=True)  # amax propagates NaN
        if not self.weighted:
            if norm_type == 2.0:
                return torch.linalg.vector_norm(norms, keepdim=True)
            return norms.pow(norm_type).sum(0, keepdim=True).pow(1.0 / norm_type)
        return (norms.pow(norm_type) * self.weights).sum(0, keepdim=True).pow(1.0 / norm_type)

    def _flag_into(self, value, found_inf):
        """found_inf = max(found_inf, value is not finite), on device: value * 0
        is 0 for every finite value and NaN for inf or NaN."""
        torch.maximum(found_inf, value.mul(0.0).ne(0.0), out=found_inf)

    def scale_views(self, scale):
        """x = cast(float(x) * scale) in place, ``scale`` a 0-d fp32 device tensor."""
        for grp in self.groups:
            for _ in range(grp.multiplicity):
                _scale_in_place(grp.views, scale)

    @staticmethod
    def _result(total, out):
        if out is None:
            return total.to(torch.float32)
        out.copy_(total)
        return out

    # ---------------------------------------------------------------- operations

    def norm(self, norm_type, out, found_inf, inv_scale=None):
        """Returns the total norm (fp32 [1], into `out` if given); found_inf
        |= any non-finite input (before any unscaling; None: no flag made).
        With inv_scale, the grads are unscaled in place first."""
        if not self.views:
            return self._result(torch.zeros(1, dtype=torch.float32, device=self.device), out)
        if inv_scale is not None:
            self.unscale(inv_scale, found_inf)
            return self._result(self._total(norm_type), out)
        total = self._total(norm_type)
        if found_inf is None:
            return self._result(total, out)
        if norm_type == float("inf") or (norm_type == 2.0 and self.acc_dtype == torch.float64
                                         and not self.has_float64_grads):
            # Exact: squares of finite fp32/fp16/bf16 values cannot overflow
            # float64, and max |x| is finite iff every x is.
            self._flag_into(total, found_inf)
        else:
            self._flag_into(self.view_norms(float("inf")).amax(0, keepdim=True), found_inf)
        return self._result(total, out)

    def unscale(self, inv_scale, found_inf):
        """x = cast(float(x) * inv_scale) in place; found_inf |= any non-finite
        value before scaling. One read and one write of every element."""
        if not self.views:
            return
        if isinstance(inv_scale, torch.Tensor):
            self._check_device_scalar(inv_scale, "inv_scale")
            inv = inv_scale if inv_scale.dim() == 1 else inv_scale.reshape(1)
        else:
            inv = torch.full((1,), float(inv_scale), dtype=torch.float32, device=self.device)
        # Checks every value before scaling it, then writes it scaled:
        # found_inf is OR-ed into (never reset), as the CPU path does.
        for grp in self.groups:
            amp, other = _split_for_amp_unscale(grp.views)
            for _ in range(grp.multiplicity):
                if amp:
                    torch._amp_foreach_non_finite_check_and_unscale_(amp, found_inf, inv)
                if other:
                    # The same pass in two steps: the flag from max |x| (NaN and inf
                    # propagate through it), then the fp32 product rounded once.
                    self._flag_into(torch.stack(torch._foreach_norm(other, float("inf")))
                                    .amax(0, keepdim=True), found_inf)
                    _scale_in_place(other, inv.view(()))

    def clip(self, total_norm, max_norm, coeff_out):
        """Scales every grad by clamp(max_norm / (norm + 1e-6), max=1) and
        returns that coefficient (fp32 [1], into `coeff_out` if given); it
        never leaves the device (a NaN norm gives NaN grads)."""
        if isinstance(total_norm, torch.Tensor):
            norm = total_norm
            if norm.dim() != 1:
                norm = self._as_device_scalar(total_norm, "norm").reshape(1)
            else:
                self._check_device_scalar(total_norm, "norm")
        else:
            norm = torch.full((1,), float(total_norm), dtype=torch.float32, device=self.device)
        # fp32 max_norm / (norm + 1e-6) as ONE division (a reciprocal then a
        # multiply would round twice), clamped on the device. The Python float
        # is the numerator itself: torch passes it to the kernel by value
        # (rounded to fp32, as an fp32 scalar tensor of it would be), so no
        # device scalar is made or kept per max_norm (a schedule that changes
        # max_norm every step keeps no state) and nothing is read back.
        max_norm = float(max_norm)
        if coeff_out is None:
            coeff = torch.div(max_norm, norm.add(1.0e-6))
        else:
            coeff = torch.div(max_norm, norm.add(1.0e-6), out=coeff_out)
        coeff.clamp_(max=1.0)  # NaN stays NaN: the grads become NaN, never unclipped
        if self.views:
            self.scale_views(coeff.view(()))
        return coeff

    def scale(self, scale):
        if not self.views:
            return
        flat = self._one_flat_view()
        if flat is not None and self._flat_dtype == torch.float32 \
                and not isinstance(scale, torch.Tensor):
            # One op, not a device scalar and a foreach call: an fp32 tensor times a
            # Python number is x * float32(scale) on every device, the product the
            # list path forms from its fp32 device scalar.
            flat.mul_(float(scale))
            return
        self.scale_views(self._as_device_scalar(scale, "scale"))

    def count_zeros(self, out):
        """Returns sum(numel - count_nonzero) as int64 [1] (into `out` if given)."""
        if not self.views:
            zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
            return zeros if out is None else out.copy_(zeros)
        flat = self._one_flat_view()
        if flat is not None:
            # torch's whole-tensor count, then shape [1]: with a dim it is two kernels
            # (ne, then sum), 49 us against 21 over a 200 KB fp32 buffer on the CPU.
            nonzero = torch.count_nonzero(flat).view(1)
        else:
            counts = torch.stack([torch.count_nonzero(v) for v in self.views])
            if self.weighted:
                counts = counts * self.weights.to(torch.int64)
            nonzero = counts.sum(0, keepdim=True)
        zeros = torch.rsub(nonzero, self.numel)  # numel - nonzero, int64: exact
        if out is None:
            return zeros
        out.copy_(zeros)
        return out


def _amp_unscale_takes_bf16(device_type):
    return device_type == "cpu"


def _foreach_scale_reads_fp32(device_type):
    """Whether ``_foreach_mul_(views, fp32 0-d tensor)`` multiplies fp16/bf16
    views by the fp32 value itself (the CPU's kernels) rather than by it cast
    to the view's dtype."""
    return device_type == "cpu"


def _split_for_amp_unscale(views):
    """(views torch's ``_amp_foreach_non_finite_check_and_unscale_`` takes,
    the rest): its CPU kernel takes every float dtype, its CUDA kernel (and
    other devices', by assumption) not bfloat16."""
    if not views or _amp_unscale_takes_bf16(views[0].device.type):
        return views, []
    amp = [v for v in views if v.dtype != torch.bfloat16]
    if len(amp) == len(views):
        return views, []
    return amp, [v for v in views if v.dtype == torch.bfloat16]


_WIDE_CHUNK = 1 << 24  # elements of an fp16/bf16 region scaled through fp32 at once (64 MiB)


def _scale_in_place(views, scale):
    """x = cast(float(x) * scale) in place for every view, ``scale`` a 0-d fp32
    tensor on the views' device, never read on the host. fp32 views take one
    foreach launch. For fp16 and bf16 views, a device's foreach multiply by a
    tensor of another dtype falls back to per-tensor ``mul_``, which casts the
    scale to the view's dtype first (measured on CUDA: the products then
    differ by an ulp from the CPU path's); so the products are formed in fp32
    and rounded once on the copy back. fp64 views get ``double(scale)``, exact.
    On the CPU the per-tensor kernels read a 0-d tensor as an fp32 scalar:
    one foreach call, as before."""
    if not views:
        return
    if _foreach_scale_reads_fp32(views[0].device.type):
        torch._foreach_mul_(views, scale)
        return
    low = [v for v in views if v.dtype in (torch.float16, torch.bfloat16)]
    rest = [v for v in views if v.dtype not in (torch.float16, torch.bfloat16)] \
        if low else views
    if rest:
        torch._foreach_mul_(rest, scale)
    for v in low:
        # One view at a time, a flat region in chunks: the fp32 temporary stays
        # bounded (twice the chunk's bytes), however large the grads.
        parts = ([v[i:i + _WIDE_CHUNK] for i in range(0, v.numel(), _WIDE_CHUNK)]
                 if v.dim() == 1 and v.numel() > _WIDE_CHUNK else [v])
        for part in parts:
            part.copy_(part.float().mul_(scale))


def multi_tensor_scale(src, dst, scale, found_inf, device):
    """dst[i] = cast(float(src[i]) * scale); found_inf |= any non-finite source
    element. Pairs run in list order; each pair reads its whole source before
    writing (partial overlaps of a pair's source and destination are safe)."""
    if not src:
        return
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != device:
            raise Error(f"multi_tensor_scale: argument 'scale' must be a 1-element float32 tensor "
                        f"on {device} (got {dtype_name(scale.dtype)}{list(scale.shape)} on "
                        f"{scale.device})")
        scale = scale.reshape(())
    else:
        scale = torch.full((), float(scale), dtype=torch.float32, device=device)
    if pairs_share_memory(src, dst):
        # As the CPU path: pairs that share memory run one after another, in
        # list order, so a later pair reads what an earlier one wrote.
        for s, d in zip(src, dst):
            _scale_pairs([s], [d], scale, found_inf)
        return
    _scale_pairs(src, dst, scale, found_inf)


def _scale_pairs(src, dst, scale, found_inf):
    pairs = [(s, d) for s, d in zip(src, dst) if s.numel() > 0]  # shapes: host metadata
    if not pairs:
        return
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    # Sources in fp32 (fp32 math, as the CPU path: fp64 sources are scaled in fp32 too).
    staged = [s.to(torch.float32) if s.dtype != torch.float32 else s for s in src]
    maxabs = torch.stack(torch._foreach_norm(staged, float("inf")))
    torch.maximum(found_inf, maxabs.amax().mul(0.0).ne(0.0), out=found_inf)
    products = torch._foreach_mul(staged, scale)  # every source read before any write
    torch._foreach_copy_(dst, products)


def byte_range(t):
    """(storage identity, first byte, end byte) a view can touch (host metadata)."""
    if t.numel() == 0:
        return None
    begin = t.storage_offset()
    end = begin + 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    es = t.element_size()
    return t.untyped_storage()._cdata, begin * es, end * es


def pairs_share_memory(src, dst):
    """Whether any pair touches memory that another pair touches too."""
    spans = []
    for pair, (s, d) in enumerate(zip(src, dst)):
        for t in (s, d):
            r = byte_range(t)
            if r is not None:
                spans.append((r[0], r[1], r[2], pair))
    spans.sort()
    reach = {}  # storage -> (end of the furthest span so far, its pair)
    for storage, begin, end, pair in spans:
        far = reach.get(storage)
        if far is not None and begin < far[0] and far[1] != pair:
            return True
        if far is None or end > far[0]:
            reach[storage] = (end, pair)
    return False
