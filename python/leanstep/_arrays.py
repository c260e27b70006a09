"""Framework plumbing: hand the library zero-copy views of the caller's arrays
and allocate results in the framework of the inputs (torch in, torch out;
NumPy otherwise)."""

import ctypes
import os
import sys
import threading

import numpy as np

from ._leanstep import Error

_NUMPY_DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "float64": np.float64,
    "int64": np.int64,
    "int32": np.int32,
    "bool": np.bool_,
    "uint8": np.uint8,
}


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


def dtype_name(x):
    if is_torch(x):
        return str(x.dtype).removeprefix("torch.")
    return np.dtype(x.dtype).name


def _torch_dtype(name):
    torch = torch_module()
    return getattr(torch, name)


# ---------------------------------------------------------------- huge pages for fresh outputs

_HUGE = 1 << 21  # 2 MiB: the x86-64 / arm64 transparent huge page
_MADV_HUGEPAGE = 14
_huge = {"enabled": os.environ.get("LEANSTEP_HUGE_PAGES", "0") == "1", "mode": None,
         "madvise": None, "advised": 0}
_huge_lock = threading.Lock()


def _thp_mode():
    """The kernel's transparent huge page mode ("always", "madvise", "never"),
    read once; None where there is none (not Linux)."""
    if _huge["mode"] is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                text = f.read()
            _huge["mode"] = text[text.index("[") + 1:text.index("]")]
        except (OSError, ValueError):
            _huge["mode"] = "none"
    return _huge["mode"]


def set_huge_pages(enabled):
    """Outputs leanstep allocates itself (never the caller's ``out=`` arrays)
    are advised as transparent huge pages before the kernels first write them,
    when they span at least 2 MiB and the kernel's THP mode is "madvise" or
    "always": first-touch page faults of fresh 100 MB outputs then cost a
    fraction (256 MiB touched: 38 ms against 115 ms here). Off by default:
    where the kernel's THP defrag mode is "madvise" (as on these machines),
    a fault in an advised block may compact memory synchronously, and a
    fresh [8192, 2048] fp32 RMSNorm output measured 12 ms in one process and
    87 ms in the next (15 ms without the advice). ``set_huge_pages(True)`` or
    ``LEANSTEP_HUGE_PAGES=1`` turns it on. Results never depend on it.
    Returns the previous setting."""
    with _huge_lock:
        previous = _huge["enabled"]
        _huge["enabled"] = bool(enabled)
    return previous


def huge_pages():
    """``{"enabled", "thp_mode", "advised_bytes"}``: the setting and what it did."""
    return {"enabled": _huge["enabled"], "thp_mode": _thp_mode(), "advised_bytes": _huge["advised"]}


def _advise_huge(address, nbytes):
    if not _huge["enabled"] or nbytes < _HUGE or _thp_mode() not in ("madvise", "always"):
        return
    begin = (address + _HUGE - 1) & ~(_HUGE - 1)
    end = (address + nbytes) & ~(_HUGE - 1)
    if end <= begin:
        return
    madvise = _huge["madvise"]
    if madvise is None:
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            madvise = False
        _huge["madvise"] = madvise
    if madvise and madvise(begin, end - begin, _MADV_HUGEPAGE) == 0:
        _huge["advised"] += end - begin  # advisory only: a refusal changes nothing


def empty(shape, dtype, like):
    """An uninitialised array of `shape` and `dtype` (a name such as
    "bfloat16") in the framework of `like`, on its device. A fresh CPU block
    of 2 MiB or more is advised as huge pages (see :func:`set_huge_pages`)."""
    shape = tuple(int(s) for s in shape)
    if is_torch(like):
        out = torch_module().empty(shape, dtype=_torch_dtype(dtype), device=like.device)
        if out.device.type == "cpu":
            _advise_huge(out.data_ptr(), out.numel() * out.element_size())
        return out
    if dtype == "bfloat16":
        raise Error(f"argument of dtype bfloat16 needs torch tensors (NumPy has no bfloat16)")
    out = np.empty(shape, dtype=_NUMPY_DTYPES[dtype])
    _advise_huge(out.ctypes.data, out.nbytes)
    return out


def zeros(shape, dtype, like):
    out = empty(shape, dtype, like)
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
