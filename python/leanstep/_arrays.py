"""Framework plumbing: hand the library zero-copy views of the caller's arrays
and allocate results in the framework of the inputs (torch in, torch out;
NumPy otherwise)."""

import math
import os
import sys

import numpy as np

from . import _leanstep
from ._leanstep import Error

_NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "bool": np.bool_,
    "uint8": np.uint8,
}


_ITEMSIZE = {name: np.dtype(t).itemsize for name, t in _NUMPY_DTYPES.items()} | {"bfloat16": 2}
#: The dtypes any leanstep call takes (each op narrows them further).
SUPPORTED_DTYPES = tuple(_ITEMSIZE)


def torch_module():
    """The torch module if the caller has imported it (never imports it)."""
    return sys.modules.get("torch")


def is_torch(x):
    torch = torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def view(x):
    """What the library receives for `x`: the same memory, without autograd
    tracking (a torch tensor that requires grad cannot be exported by DLPack;
    detach() shares its storage)."""
    if is_torch(x) and x.requires_grad:
        return x.detach()
    return x


def opt_view(x):
    return None if x is None else view(x)


# ---------------------------------------------------------------- handing arrays over
#
# nanobind takes a torch tensor by calling its __dlpack__, which is Python code
# (about 6 us a tensor here, more than a small kernel); torch's C exporter
# takes 0.7 us and nanobind accepts its capsule as is. The hot entry points
# call the extension through `native`, which hands torch tensors over that
# way and everything else (NumPy arrays, None, numbers, strings) unchanged.

_to_capsule = None


def _exporter():
    global _to_capsule
    torch = torch_module()
    if torch is None:
        return None
    if _to_capsule is None:
        _to_capsule = torch.utils.dlpack.to_dlpack
    return torch


def export(x):
    """What the extension receives for `x`: a DLPack capsule of a plain torch
    tensor (or Parameter), a list of such for a list, else `x` itself."""
    torch = _exporter()
    if torch is None:
        return x
    return _export(x, torch.Tensor, torch.nn.Parameter)


def _export(x, tensor_type, parameter_type):
    kind = type(x)
    if kind is tensor_type or kind is parameter_type:
        if x.is_neg():
            # A lazy negation (z.conj().imag, torch._neg_view): DLPack would
            # hand over the un-negated memory, a silently wrong sign.
            raise Error("a torch tensor with the negative bit set (a lazy negation such as "
                        "z.conj().imag) cannot be handed to leanstep: call .resolve_neg() first")
        return _to_capsule(x.detach() if x.requires_grad else x)
    if kind is list or kind is tuple:
        return [_export(v, tensor_type, parameter_type) for v in x]
    return x


class Native:
    """`target` (the extension module, or an object it made), its functions
    and methods handed torch tensors as capsules (:func:`export`). Exception
    classes and attributes that are not callable pass through."""

    def __init__(self, target):
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name):
        target = getattr(self._target, name)
        if not callable(target) or (isinstance(target, type)
                                    and issubclass(target, BaseException)):
            return target

        def call(*args, **kwargs):
            try:
                # The extension takes torch tensors and Parameters through DLPack's C
                # exchange table (no per-argument Python work here), anything else
                # through nanobind's import.
                return target(*args, **kwargs)
            except TypeError:
                torch = _exporter()
                if torch is None:
                    raise
            # No overload took the arguments: a tensor without the exchange table
            # (an older torch) or one it refuses (a negated view: _export says why).
            # Again with torch's C exporter's capsules.
            t, p = torch.Tensor, torch.nn.Parameter
            exported_args = [_export(a, t, p) for a in args]
            exported_kwargs = {k: _export(v, t, p) for k, v in kwargs.items()}
            try:
                return target(*exported_args, **exported_kwargs)
            except TypeError:
                # A capsule is used up by the first overload that imports it, so the
                # next overloads were not really tried: resolve again with the arrays
                # themselves (and their names in the message, should none match).
                return target(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = target.__doc__
        # Looked up once: a module's functions, and an object's methods (a GradPlan's
        # core, whose every call would otherwise make this closure anew).
        object.__setattr__(self, name, call)
        return call


#: The extension module for calls that take tensors (see :func:`export`).
native = Native(_leanstep)


def dtype_name(x):
    if is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


# ---------------------------------------------------------------- fresh CPU outputs
#
# A fresh 100 MB output costs more in first-touch page faults than the kernel
# that writes it (glibc maps every block over 32 MiB anew and unmaps it when
# freed). The C++ library's host memory (include/leanstep/host_memory.h) has
# two remedies, both on by default here:
#
# - the output pool: CPU outputs of a block (2 MiB on x86-64) or more come
#   from blocks leanstep keeps once their previous output is gone (the
#   array's memory released: the DLPack owner is destroyed), so their pages
#   are already mapped;
# - huge pages: a new block is advised as transparent huge pages before the
#   kernel first writes it (the kernels' threads then touch the pages they
#   write), so its first use faults 512 times less often.

# Outputs of a block or more (2 MiB on x86-64 and 4 KiB-page arm64, from the
# system's page sizes: include/leanstep/host_memory.h) are pooled and advised.
_BLOCK = _leanstep.huge_page_info()["block_bytes"]


def _physical_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


DEFAULT_POOL_CAP = min(_physical_memory() // 8, 16 << 30)


#: The largest pool cap (bytes): the C++ pool counts bytes in a signed 64-bit integer.
MAX_POOL_CAP = (1 << 63) - 1
_MIN_POOL_CAP_MIB = _BLOCK >> 20  # one block (never under 2 MiB)
_POOL_ENV_RULE = ("LEANSTEP_OUTPUT_POOL must be 'on' (the default cap), 'off' (or 0), or a cap in "
                  f"MiB from {_MIN_POOL_CAP_MIB} to {MAX_POOL_CAP >> 20} "
                  f"(pooled blocks are {_BLOCK >> 20} MiB or more)")


def _parse_pool_env():
    """LEANSTEP_OUTPUT_POOL: unset or "on" (on, the default cap), "off" or 0,
    or a cap in MiB. "1" is refused: it reads as "on" and as a 1 MiB cap,
    which could hold no block."""
    value = os.environ.get("LEANSTEP_OUTPUT_POOL", "").strip().lower()
    if value in ("", "on", "auto"):
        return True, DEFAULT_POOL_CAP
    if value in ("0", "off", "no", "false"):
        return False, DEFAULT_POOL_CAP
    try:
        mib = int(value)
    except ValueError:
        raise Error(f"{_POOL_ENV_RULE} (got {value!r})") from None
    if not _MIN_POOL_CAP_MIB <= mib <= MAX_POOL_CAP >> 20:
        raise Error(f"{_POOL_ENV_RULE} (got {value!r})")
    return True, mib << 20


_leanstep.host_pool_configure(*_parse_pool_env())


def set_huge_pages(enabled):
    """Whether memory leanstep allocates for its outputs (never the caller's
    ``out=`` arrays) is advised as transparent huge pages before its first
    write: only blocks spanning a huge page (2 MiB on x86-64), only their
    huge-page-aligned part, only
    when the kernel's THP mode is "madvise" or "always". On by default;
    ``set_huge_pages(False)`` or ``LEANSTEP_HUGE_PAGES=0`` turns it off.
    Where THP defrag is "madvise", the first fault in an advised block may
    compact memory synchronously (a fresh 64 MiB block measured 9 to 88 ms
    here): with the output pool on, that is paid once per block, not per
    call. Results never depend on it. Returns the previous setting."""
    return _leanstep.set_huge_pages(bool(enabled))


def huge_pages():
    """``{"enabled", "thp_mode", "advised_bytes", "page_bytes", "huge_page_bytes",
    "block_bytes"}``: the setting, what it did, and the system's page sizes
    (``block_bytes``: from which size outputs are pooled and advised; the huge
    page up to 32 MiB, else 2 MiB)."""
    return _leanstep.huge_page_info()


def set_output_pool(enabled=None, cap_bytes=None):
    """Switches the output pool (see :func:`output_pool`) and sets its cap.
    Switching it off or lowering the cap releases free blocks (oldest first).
    Returns the previous ``(enabled, cap_bytes)``."""
    if enabled is not None and not isinstance(enabled, bool):
        raise Error(f"set_output_pool: argument 'enabled' must be True, False or None "
                    f"(got {enabled!r})")
    if cap_bytes is not None and (isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int)
                                  or not 0 <= cap_bytes <= MAX_POOL_CAP):
        raise Error(f"set_output_pool: argument 'cap_bytes' must be an int in [0, 2^63 - 1] "
                    f"(got {cap_bytes!r})")
    info = _leanstep.host_pool_info()
    previous = (info["enabled"], info["cap_bytes"])
    _leanstep.host_pool_configure(previous[0] if enabled is None else bool(enabled),
                                  previous[1] if cap_bytes is None else cap_bytes)
    return previous


def output_pool():
    """The output pool: CPU outputs of a block (2 MiB on x86-64) or more that
    leanstep allocates (torch tensors and NumPy arrays) come from blocks whose pages are already
    mapped, once the array that last used a block is gone: no first-touch
    faults. A block is handed out again only after its array's memory is
    released (views, NumPy arrays, DLPack exports and autograd's saved
    tensors all keep it), and outputs are ordinary tensors, not views.
    ``{"enabled", "cap_bytes", "cached_bytes", "free_bytes", "blocks", "hits",
    "misses", "over_cap"}``. On by default, capped at 1/8 of physical memory
    (at most 16 GiB); ``LEANSTEP_OUTPUT_POOL=off`` or a cap in MiB, or
    :func:`set_output_pool`. :func:`empty_cache` releases the free blocks."""
    return _leanstep.host_pool_info()


def empty_cache():
    """Releases the output pool's free blocks to the system; returns their bytes."""
    return _leanstep.host_pool_release_free()


#: Callables ``(out, like)`` told of every torch output :func:`empty` makes on
#: the CPU: :class:`leanstep.audit.DeviceMemory` counts it as device memory when
#: `like` is (the C++ kernels write it outside torch's dispatcher, where the
#: tracker cannot see it).
output_hooks = []

#: Callables ``(array, kind)`` told of every read of an array's values on the
#: host that leanstep makes outside torch's dispatcher (:func:`read_scalar`):
#: :class:`leanstep.audit.Audit` counts them where no aten op shows them.
read_hooks = []


def read_scalar(scalar):
    """The value of a 1-element array (NumPy or torch, any device) as a Python
    float: a read of its memory on the host (a device value waits for the
    device)."""
    if read_hooks:
        for hook in list(read_hooks):
            hook(scalar, "read_scalar")
    return _leanstep.read_scalar(scalar)


def empty(shape, dtype, like):
    """An uninitialised array of `shape` and `dtype` (a name such as
    "bfloat16") in the framework of `like`, on its device. CPU arrays of
    a block (2 MiB on x86-64) or more come from the output pool
    (:func:`output_pool`), or else are advised as huge pages (:func:`set_huge_pages`)."""
    out = _empty(shape, dtype, like)
    if output_hooks:
        for hook in list(output_hooks):
            hook(out, like)
    return out


def _empty(shape, dtype, like):
    shape = tuple(map(int, shape))
    torch = torch_module()
    torch_like = torch is not None and isinstance(like, torch.Tensor)
    if torch_like and not like.is_cpu:
        return torch.empty(shape, dtype=getattr(torch, dtype), device=like.device)
    if not torch_like and dtype == "bfloat16":
        raise Error("argument of dtype bfloat16 needs torch tensors (NumPy has no bfloat16)")
    nbytes = math.prod(shape) * _ITEMSIZE[dtype]
    if torch_like and nbytes < _BLOCK:
        return torch.empty(shape, dtype=getattr(torch, dtype))  # the common small output
    if nbytes >= _BLOCK:
        out = _leanstep.pool_array(shape, dtype, torch_like)
        if out is not None:
            return out
    if torch_like:
        out = torch.empty(shape, dtype=getattr(torch, dtype))
        address = out.data_ptr()
    else:
        out = np.empty(shape, dtype=_NUMPY_DTYPES[dtype])
        address = out.ctypes.data
    if nbytes >= _BLOCK:
        _leanstep.advise_huge_pages(address, nbytes)
    return out


def zeros(shape, dtype, like):
    out = empty(shape, dtype, like)
    # torch: one zero_ op, not the indexing path of `out[...] = 0` (several ops; after a
    # pass over thousands of grads, when torch's code is out of cache, 25 us more per
    # scalar, measured).
    if is_torch(out):
        out.zero_()
    else:
        out[...] = 0
    return out


def check_out(out, shape, dtype, where, arg):
    """An `out=` array must have exactly the result's shape and dtype (the
    library writes it as is; a mismatch would be a silent reinterpretation)."""
    got_shape = tuple(out.shape)
    if got_shape != tuple(shape) or dtype_name(out) != dtype:
        raise Error(
            f"{where}: argument '{arg}' must be {dtype}{list(shape)} "
            f"(got {dtype_name(out)}{list(got_shape)})"
        )
    return out


def result(shape, dtype, like, out, where, arg):
    if out is None:
        return empty(shape, dtype, like)
    return check_out(view(out), shape, dtype, where, arg)
