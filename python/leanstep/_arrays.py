"""Framework plumbing: hand the library zero-copy views of the caller's arrays
and allocate results in the framework of the inputs (torch in, torch out;
NumPy otherwise)."""

import sys

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


def empty(shape, dtype, like):
    """An uninitialised array of `shape` and `dtype` (a name such as
    "bfloat16") in the framework of `like`, on its device."""
    shape = tuple(int(s) for s in shape)
    if is_torch(like):
        return torch_module().empty(shape, dtype=_torch_dtype(dtype), device=like.device)
    if dtype == "bfloat16":
        raise Error(f"argument of dtype bfloat16 needs torch tensors (NumPy has no bfloat16)")
    return np.empty(shape, dtype=_NUMPY_DTYPES[dtype])


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
