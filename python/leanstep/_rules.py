"""Argument rules shared by the CPU entry points and the device backends, so
each rule has one copy (the rules on tensors live in the C++ checks)."""

import operator

from . import _leanstep
from ._leanstep import Error


def host_int(value, where, name):
    """`value` as a Python int if it is an integer (an int, a NumPy integer, a
    0-dim integer tensor); anything else (20.7, 2.5, "4") is an error naming
    the argument, never truncated."""
    if isinstance(value, bool):
        raise Error(f"{where}: argument '{name}' must be a host integer (got bool)")
    try:
        return operator.index(value)
    except TypeError:
        raise Error(f"{where}: argument '{name}' must be a host integer "
                    f"(got {type(value).__name__})") from None


# ---------------------------------------------------------------- tensor rules on metadata
# The device backends check their tensors with the C++ kernels' own rules
# (leanstep/rmsnorm.h check_*_args), from metadata: (address, dtype, shape,
# strides). Real tensors give their data address; meta tensors, which have
# none, an address per storage of the call (so views of one storage overlap
# as they would); outputs not allocated yet, an address of their own. The
# addresses are compared for overlap, never read.
_META_BASE = 1 << 61
_PLANNED_BASE = 1 << 62
_SPAN = 1 << 52


def _dtype_name(t):
    return str(t.dtype).removeprefix("torch.")


def tensor_metas(tensors):
    """Metadata of each tensor (None stays None)."""
    storages = {}
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        if t.device.type == "meta":
            key = t.untyped_storage()._cdata
            base = storages.setdefault(key, _META_BASE + len(storages) * _SPAN)
            address = base + t.storage_offset() * t.element_size()
        else:
            address = t.data_ptr()
        out.append((address, _dtype_name(t), tuple(t.shape), tuple(t.stride())))
    return out


def planned_meta(shape, dtype_name, slot):
    """Metadata of an output the backend will allocate (contiguous, its own memory)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return (_PLANNED_BASE + slot * _SPAN, dtype_name, tuple(shape), tuple(reversed(strides)))


def check_rms_norm(x, weight, eps, zero_centered_gamma, rounding):
    """RMSNorm forward's rules (the CPU kernels'), for a backend that allocates
    y (x's dtype and shape) and rstd (fp32, x.shape[:-1])."""
    if not isinstance(rounding, str):
        raise Error(f"rms_norm: argument 'rounding' must be scale_then_cast or cast_then_scale "
                    f"(got {rounding!r})")
    xm, wm = tensor_metas([x, weight])
    _leanstep.rmsnorm_check_forward(xm, wm, planned_meta(x.shape, _dtype_name(x), 0),
                                    planned_meta(x.shape[:-1], "float32", 1), float(eps),
                                    bool(zero_centered_gamma), rounding)


def check_rms_norm_backward(dy, x, rstd, weight, weight_requires_grad):
    """RMSNorm backward's rules, for a backend that allocates dx (x's dtype
    and shape) and, when the weight is trained, dweight (weight's)."""
    dym, xm, rm, wm = tensor_metas([dy, x, rstd, weight])
    dweight = planned_meta(weight.shape, _dtype_name(weight), 1) if weight_requires_grad else None
    _leanstep.rmsnorm_check_backward(dym, xm, rm, wm, planned_meta(x.shape, _dtype_name(x), 0),
                                     dweight)


def check_scalar(t, dtype_name, where, name):
    """A 1-element backend scalar of `dtype_name` given to a device backend
    (out=, found_inf=): the C++ rule (grad::check_scalar_arg)."""
    if t is not None:
        _leanstep.grad_check_scalar(tensor_metas([t])[0], dtype_name, where, name)


# ---------------------------------------------------------------- MoE permutation
# Host arguments first (one rule each, every backend), then the tensors' rules
# in C++ (leanstep/moe.h check_*_args) on metadata, for a backend that
# allocates the outputs itself.
METHODS = ("sort", "fused")


def check_method(method, where):
    if method not in METHODS:
        raise Error(f'{where}: argument \'method\' must be "sort" or "fused" (got {method!r})')


def host_count(value, where, name):
    """A host integer >= 0 (a row count)."""
    value = host_int(value, where, name)
    if value < 0:
        raise Error(f"{where}: argument '{name}' must be >= 0 (got {value})")
    return value


def restore_rows(restore_shape, where, hidden):
    """T of unpermute's ``restore_shape`` (T, H): host integers, T >= 0, H the
    permuted rows' width."""
    if (type(restore_shape) is tuple and len(restore_shape) == 2
            and type(restore_shape[0]) is int and type(restore_shape[1]) is int
            and restore_shape[0] >= 0 and restore_shape[1] == hidden):
        return restore_shape[0]  # the common call (every lean unpermute's): no other check
    try:
        shape = tuple(restore_shape)
    except TypeError:
        shape = (restore_shape,)
    if len(shape) != 2:
        raise Error(f"{where}: argument 'restore_shape' must be (T, H) (got {shape})")
    num_tokens, width = (host_int(s, where, "restore_shape") for s in shape)
    if num_tokens < 0 or width != hidden:
        raise Error(f"{where}: argument 'restore_shape' must be (T >= 0, H={hidden}) (got {shape})")
    return num_tokens


def _width(t):
    """Row width of a 2-D tensor; 0 for another rank (the C++ check names it)."""
    return t.shape[1] if t.dim() == 2 else 0


def check_moe_permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    """permute's rules; `num_out_tokens` a host int or None (the outputs' rows
    are then the routed count, a value)."""
    rows = num_out_tokens if num_out_tokens is not None else 0
    tm, mm, pm = tensor_metas([tokens, routing_map, probs])
    permuted = planned_meta((rows, _width(tokens)), _dtype_name(tokens), 0)
    permuted_probs = None if probs is None else planned_meta((rows,), _dtype_name(probs), 1)
    _leanstep.moe_check_permute(tm, mm, pm, num_out_tokens, bool(drop_and_pad), permuted,
                                permuted_probs, planned_meta((rows,), "int64", 2))


def check_moe_unpermute(permuted, sorted_indices, num_tokens, probs, routing_map, drop_and_pad,
                        where="unpermute"):
    """unpermute's rules (permute_backward's with where="permute_backward",
    no probs), for an output of `num_tokens` rows."""
    out = planned_meta((num_tokens, _width(permuted)), _dtype_name(permuted), 0)
    if where == "permute_backward":
        _leanstep.moe_check_permute_backward(*tensor_metas([permuted, sorted_indices]), out)
        return
    pm, si, pr, rm = tensor_metas([permuted, sorted_indices, probs, routing_map])
    _leanstep.moe_check_unpermute(pm, si, out, pr, rm, bool(drop_and_pad))


def check_moe_permute_probs_backward(dpermuted_probs, sorted_indices, routing_map, drop_and_pad):
    dp, si, rm = tensor_metas([dpermuted_probs, sorted_indices, routing_map])
    dprobs = planned_meta(tuple(routing_map.shape), _dtype_name(dpermuted_probs), 0)
    _leanstep.moe_check_permute_probs_backward(dp, si, rm, bool(drop_and_pad), dprobs)


def check_moe_unpermute_backward(dout, permuted, sorted_indices, probs, routing_map, drop_and_pad):
    metas = tensor_metas([dout, permuted, sorted_indices, probs, routing_map])
    dpermuted = planned_meta(tuple(permuted.shape), _dtype_name(permuted), 0)
    dprobs = None if probs is None else planned_meta(tuple(probs.shape), _dtype_name(probs), 1)
    _leanstep.moe_check_unpermute_backward(*metas, bool(drop_and_pad), dpermuted, dprobs)


def check_pad_routing_map(routing_map, multiple, out):
    """pad_routing_map's rules; `out` None: a new map the backend allocates."""
    mm, om = tensor_metas([routing_map, out])
    if om is None:
        om = planned_meta(tuple(routing_map.shape), "bool", 0)
    _leanstep.moe_check_pad_routing_map(mm, multiple, om)


def check_sort_chunks_by_idxs(rows, split_sizes, sorted_idxs, probs):
    """sort_chunks_by_idxs' rules, for outputs like rows and probs; the split
    sizes' and order's values are the device's to check."""
    metas = tensor_metas([rows, split_sizes, sorted_idxs, probs])
    out = planned_meta(tuple(rows.shape), _dtype_name(rows), 0)
    out_probs = None if probs is None else planned_meta(tuple(probs.shape), _dtype_name(probs), 1)
    _leanstep.moe_check_sort_chunks_by_idxs(*metas[:3], out, metas[3], out_probs)
