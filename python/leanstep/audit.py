"""Host-overhead audit: aten ops, host syncs and host reads by call site.

``leanstep.audit()`` (the same as ``leanstep.audit.audit()``) is a context
manager that counts, for the code inside it:

- **aten ops** by overload name (``aten.add.Tensor``), seen with a
  ``TorchDispatchMode``. On an accelerator each is about one kernel launch; a
  foreach op (``aten._foreach_norm``, ``aten._foreach_mul_``) launches once per
  chunk of tensors (on CUDA about 110 tensors or 320 blocks of 65,536 elements
  per launch), so it counts 1 here and ceil(N / chunk) launches there. Views
  and metadata ops (``aten.view``, ``aten.detach``) count as ops but launch
  nothing. So that launches can be estimated (``leanstep.hostcost``), every
  call of an op whose first argument is a list of tensors (foreach and fused
  optimizer ops, ``cat``, ``stack``) is also recorded with the element count of
  each tensor of that list, in order, and the number of tensor lists it takes.
- **host syncs** at the aten level: every ``aten._local_scalar_dense`` (what
  ``.item()``, ``bool(t)``, ``int(t)``... dispatch to) and every device-to-host
  copy (``aten._to_copy`` / ``aten.copy_`` / ``aten._copy_from`` from a tensor on
  a device other than CPU and meta into CPU memory), each attributed to the
  Python call site ``file:line (function)`` of the first frame outside torch and
  outside this module.
- **implicit syncs**: ops whose output shape or result the host needs and that
  therefore wait for the device inside the op (``nonzero``, ``masked_select``,
  ``unique``, ``repeat_interleave`` without ``output_size``, indexing with a bool
  mask, ``equal``, ``allclose``, ``bincount``), kept apart from the above.
- **host reads** at the Python level, seen with a ``TorchFunctionMode`` and
  kept separate from ``_local_scalar_dense``: ``Tensor.item``, ``tolist``,
  ``cpu``, ``numpy`` (and ``__array__``), ``__bool__``, ``__int__``,
  ``__float__``, ``__index__``, ``__complex__``, ``__format__``, ``__repr__``,
  ``__contains__``, ``.to("cpu")`` / ``.to(device="cpu")`` (a literal ``"cpu"``;
  a ``torch.device`` or tensor naming the CPU counts only when it moves a
  non-CPU tensor, since on a CPU run ``t.to(p.device)`` is no read), and
  ``cpu_t.copy_(t)`` from a non-CPU tensor. Each read records the tensor's dtype, shape and device
  and a device class: ``"device"`` when the tensor is not on the CPU (meta
  included: on a CPU run, meta tensors stand in for device tensors), so the
  read would touch device memory on an accelerator; ``"host-resident"`` when
  it is a CPU tensor (optimizer step counters, RNG state, CPU shims).

What a count means depends on where the code ran. On a real device,
``host syncs`` (``_local_scalar_dense`` plus device-to-host copies) are exact.
On a CPU run they are not: ``.item()`` of a CPU counter counts as a sync
although it would not wait for a device, and ``.cpu()`` of a tensor that would
live on the device is a no-op that dispatches nothing. The host reads fill that
gap: read them by call site and device class, dtype and shape (a 0-d int64 or
float32 read per parameter is a step counter; a read of a grad or activation is
not). Code that runs to the end on meta tensors makes no host reads of data.

The audit works on any device (CPU and meta included). A host read that raises
(``.item()`` of a meta tensor) is recorded, with the exception's type, and the
exception propagates. Audits nest: each counts its own region. Modes are
thread-local: ops issued from other threads (data loader workers) are not
counted; the backward pass of CPU tensors, run by the autograd engine on the
calling thread, is.

Overhead: every aten op and every torch function call goes through a Python
handler (microseconds each), and each sync or read walks the Python stack. The
audit is for counting, not for timing.

Command line (the host-cost model over these counts is
``python -m leanstep.hostcost``): ``python -m leanstep.audit [--json] [--top N] [-o FILE] script.py
[args...]`` runs the script as ``__main__`` (``sys.argv`` set to the script and
its arguments) under one audit, then writes the table to stderr, or with
``--json`` one line of JSON to stdout after the script's own output and a
newline (so the JSON is always the last line, even after output that does not
end with one), so the script's output stays as it was. The exit code is the
script's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import traceback
import types
from typing import Callable, Iterable, NamedTuple, Optional, Union

from . import _arrays
from ._leanstep import Error

__all__ = ["Audit", "CallSite", "DeviceMemory", "HostRead", "ListCall", "Sync", "audit", "main"]

_THIS_FILE = os.path.normcase(os.path.abspath(__file__))


class CallSite(NamedTuple):
    """Where a sync or read came from: the first frame outside torch, this
    module and the audit's ``stacklevel_filter``. ``via`` is the innermost
    frame (``file:line (function)``) when it lies in torch or a filtered
    library (e.g. ``torch/optim/adamw.py:...``), else None."""

    file: str
    line: int
    function: str
    via: Optional[str] = None

    def __str__(self) -> str:
        s = f"{_short_path(self.file)}:{self.line} ({self.function})"
        return s + (f" via {self.via}" if self.via else "")


class Sync(NamedTuple):
    """A host sync seen at the aten level. ``kind``: ``"scalar"``
    (``_local_scalar_dense``), ``"d2h_copy"``, ``"d2h_copy_nonblocking"`` or,
    in ``Audit.implicit_syncs``, ``"data_dependent"``."""

    kind: str
    op: str
    device: str
    site: CallSite


class ListCall(NamedTuple):
    """A call of an op whose first argument is a list of tensors. ``numels``:
    the element counts of that list's tensors in order, as ``(numel, repeat)``
    runs; ``lists``: how many non-empty tensor lists the call passed."""

    op: str
    lists: int
    numels: tuple

    @property
    def num_tensors(self) -> int:
        return sum(n for _, n in self.numels)

    @property
    def num_elements(self) -> int:
        return sum(v * n for v, n in self.numels)


class HostRead(NamedTuple):
    """A Python-level read of tensor data by the host. ``kind`` is the method
    (``"item"``, ``"bool"``, ``"tolist"``, ``"cpu"``, ``"to_cpu"``, ...);
    ``memory`` is ``"device"`` or ``"host-resident"``; ``error`` is the type
    name of the exception the read raised, else None."""

    kind: str
    memory: str
    device: str
    dtype: str
    shape: tuple
    site: CallSite
    error: Optional[str] = None

    @property
    def tensor(self) -> str:
        dims = ",".join(str(d) for d in self.shape)
        return f"{self.dtype}[{dims}] {self.device}"


def _short_path(path: str) -> str:
    """A path relative to the working directory when below it, else from the
    site-packages directory on, else unchanged."""
    if not path or path.startswith("<"):
        return path
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    for marker in ("site-packages", "dist-packages"):
        i = path.rfind(marker + os.sep)
        if i >= 0:
            return path[i + len(marker) + 1 :]
    return path


# --- the torch side (imported on the first audit, not with this module) ---

_torch = None
_modes = None  # (FunctionMode, DispatchMode) classes
_torch_dir = None


def _load_torch():
    global _torch, _modes, _torch_dir
    if _modes is not None:
        return _modes
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    _torch = torch
    _torch_dir = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep
    T = torch.Tensor
    reads = {
        T.item: "item",
        T.tolist: "tolist",
        T.cpu: "cpu",
        T.numpy: "numpy",
        T.__array__: "numpy",
        T.__bool__: "bool",
        T.__int__: "int",
        T.__float__: "float",
        T.__index__: "index",
        T.__complex__: "complex",
        T.__format__: "format",
        T.__repr__: "repr",
        T.__contains__: "contains",
    }
    new_tensor = T.new_tensor
    to_fn = T.to
    copy_fn = T.copy_
    from_data = (torch.tensor, torch.as_tensor)
    aten = torch.ops.aten
    scalar = aten._local_scalar_dense.default
    to_copy = aten._to_copy.default
    copies = {aten.copy_.default: (1, 0), aten._copy_from.default: (0, 1),
              aten._copy_from_and_resize.default: (0, 1)}  # op -> (src, dst) arg index
    data_dependent = {
        getattr(aten, name).default
        for name in ("nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                     "unique_consecutive", "unique_dim_consecutive", "bincount",
                     "equal", "allclose")
        if hasattr(aten, name)
    }
    repeat_interleave = aten.repeat_interleave.Tensor
    bool_indexed = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default}
    mask_dtypes = (torch.bool, torch.uint8)

    def _to_host(args, kwargs, memory):
        # Tensor.to(device, ...), to(dtype), to(tensor), to(device=...). A read:
        # a non-CPU tensor moved to the CPU, or a literal "cpu" target. A
        # torch.device or a tensor naming the CPU, applied to a CPU tensor, is
        # not: on a CPU run that is how code moves tensors to their own device
        # (norm.to(grads[0].device) in clip_grad_norm_), a no-op on a GPU.
        # With a DeviceMemory, the stand-in device is the accelerator, and any
        # other CPU target moves a tensor that holds device memory to the host.
        target = _to_target(args, kwargs)
        if memory is not None:
            return memory._moves_to_host(args[0], target)
        if isinstance(target, str):
            try:
                return torch.device(target).type == "cpu"
            except RuntimeError:
                return False
        if isinstance(target, torch.device):
            return target.type == "cpu" and args[0].device.type != "cpu"
        return False

    class _FunctionMode(TorchFunctionMode):
        def __init__(self, owner):
            super().__init__()
            self.owner = owner
            self.active = True  # False once its audit ended: it never counts after its block

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not self.active:
                return func(*args, **kwargs)
            kind = reads.get(func)
            t = args[0] if args else None
            if func in from_data and isinstance(t, (list, tuple)):
                # torch.tensor([t0, t1, ...]) reads each tensor's value on the host,
                # beneath torch's dispatcher (no aten op shows it).
                owner = self.owner
                for x in _tensor_leaves(t, []):
                    if owner._is_device_memory(x):
                        owner._record_read("tensor_from_list", x, None)
                return func(*args, **kwargs)
            if kind is None and (func in from_data or func is new_tensor):
                # torch.tensor(d, device="cpu"), torch.as_tensor(d, device="cpu"),
                # x.new_tensor(d, device="cpu"): a copy of d to the host.
                data = args[1] if func is new_tensor and len(args) > 1 else t
                target = _device_arg(func, args, kwargs)
                if isinstance(data, torch.Tensor) and target is not None and _to_host(
                        (data, target), {}, self.owner.device_memory):
                    kind, t = "tensor_to_host", data
            if kind is None:
                memory = self.owner.device_memory
                if func is to_fn and isinstance(t, torch.Tensor) and _to_host(args, kwargs, memory):
                    kind = "to_cpu"
                elif (func is copy_fn and len(args) > 1 and isinstance(t, torch.Tensor)
                      and isinstance(args[1], torch.Tensor)
                      and _copies_to_host(t, args[1], memory)):
                    kind, t = "copy_to_host", args[1]
                else:
                    return func(*args, **kwargs)
            if not isinstance(t, torch.Tensor):
                return func(*args, **kwargs)
            error = None
            self.owner._reading += 1  # the aten-level read under it is this one
            try:
                return func(*args, **kwargs)
            except BaseException as e:
                error = type(e).__name__
                raise
            finally:
                self.owner._reading -= 1
                self.owner._record_read(kind, t, error)

    class _DispatchMode(TorchDispatchMode):
        def __init__(self, owner):
            super().__init__()
            self.owner = owner
            self.names = {}
            self.list_args = {}  # op -> (position, name) of its Tensor[] arguments; () if none first
            self.active = True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not self.active:
                return func(*args, **kwargs)
            owner = self.owner
            name = self.names.get(func)
            if name is None:
                name = self.names[func] = str(func)
            owner.ops[name] += 1
            if func.is_view:  # metadata only: launches no kernel
                owner.view_ops[name] += 1
            lists = self.list_args.get(func)
            if lists is None:
                lists = self.list_args[func] = _tensor_list_args(func)
            if lists:
                owner._record_list_call(name, lists, args, kwargs)
            if func is scalar:
                owner._record_sync(owner.syncs, "scalar", name, args[0])
                if not owner._reading and owner._is_device_memory(args[0]):
                    # A read no Python-level method made: torch.tensor([t, ...]) of
                    # device tensors, a C++ caller.
                    owner._record_read("scalar", args[0], None)
            elif func is to_copy:
                dev = kwargs.get("device")
                src = args[0]
                if (dev is not None and torch.device(dev).type == "cpu"
                        and src.device.type not in ("cpu", "meta")):
                    kind = "d2h_copy_nonblocking" if kwargs.get("non_blocking") else "d2h_copy"
                    owner._record_sync(owner.syncs, kind, name, src)
            elif func in copies:
                i_src, i_dst = copies[func]
                src, dst = args[i_src], args[i_dst]
                if (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)
                        and dst.device.type == "cpu" and src.device.type not in ("cpu", "meta")):
                    nb = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
                    kind = "d2h_copy_nonblocking" if nb else "d2h_copy"
                    owner._record_sync(owner.syncs, kind, name, src)
                memory = owner.device_memory
                if (memory is not None and not owner._reading and isinstance(src, torch.Tensor)
                        and isinstance(dst, torch.Tensor) and memory.holds(src)
                        and not memory.holds(dst)):
                    owner._record_read("copy_to_host", src, None)
            elif func in data_dependent or (
                func is repeat_interleave and kwargs.get("output_size") is None
            ):
                owner._record_data_dependent(name, args)
            elif func in bool_indexed and len(args) > 1:
                if any(isinstance(i, torch.Tensor) and i.dtype in mask_dtypes
                       for i in (args[1] or ())):
                    owner._record_data_dependent(name, args)
            return func(*args, **kwargs)

    _modes = (_FunctionMode, _DispatchMode)
    return _modes


_saves = {"depth": 0, "original": None}
_saves_lock = threading.Lock()


def _watch_saves(delta):
    """While any audit is active, ``torch.save`` tells the audits of each
    tensor it writes: serializing reads every element, on a GPU after a copy
    of the storage to the host, beneath any aten op or torch function."""
    with _saves_lock:
        _saves["depth"] += delta
        if _saves["depth"] == 1 and delta > 0:
            original = _saves["original"] = _torch.save

            def save(obj, *args, **kwargs):
                if _arrays.read_hooks:
                    for t in _tensor_leaves(obj, []):
                        for hook in list(_arrays.read_hooks):
                            hook(t, "save")
                return original(obj, *args, **kwargs)

            save.__wrapped__ = original
            _torch.save = save
        elif _saves["depth"] == 0 and _saves["original"] is not None:
            if getattr(_torch.save, "__wrapped__", None) is _saves["original"]:
                _torch.save = _saves["original"]
            _saves["original"] = None


def _device_arg(func, args, kwargs):
    """The ``device`` a factory or conversion call names (a keyword-only
    argument of every one of them), else None."""
    target = kwargs.get("device")
    return target if isinstance(target, (str, _torch.device)) else None


def _to_target(args, kwargs):
    """The device (or device string) a ``Tensor.to`` call moves to, else None."""
    target = kwargs.get("device")
    if target is None and len(args) > 1:
        target = args[1]
    if isinstance(target, _torch.Tensor):
        with _torch._C.DisableTorchFunction():
            return target.device
    return target if isinstance(target, (str, _torch.device)) else None


def _copies_to_host(dst, src, memory) -> bool:
    """Whether ``dst.copy_(src)`` copies device memory into host memory."""
    with _torch._C.DisableTorchFunction():
        if memory is not None:
            return memory.holds(src) and not memory.holds(dst)
        return dst.device.type == "cpu" and src.device.type != "cpu"


def _tensor_list_args(func) -> tuple:
    """(position, name) of each of ``func``'s ``Tensor[]`` arguments when its
    first argument is one (``_foreach_*``, ``_fused_adamw_``, ``cat``,
    ``stack``), else ()."""
    arguments = func._schema.arguments
    if not arguments or str(arguments[0].type) != "List[Tensor]":
        return ()
    return tuple((i, a.name) for i, a in enumerate(arguments) if str(a.type) == "List[Tensor]")


def _run_lengths(values) -> tuple:
    """((value, repeat), ...) of consecutive equal values: a layout's many
    grads of one shape stay short."""
    runs = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return tuple((v, n) for v, n in runs)


def _enter_modes(mode_classes, owner):
    """Enters a (TorchFunctionMode, TorchDispatchMode) pair made for `owner`;
    returns it. Neither stays entered if the second cannot be."""
    fmode_cls, dmode_cls = mode_classes
    fmode, dmode = fmode_cls(owner), dmode_cls(owner)
    fmode.__enter__()
    try:
        dmode.__enter__()
    except BaseException:
        fmode.__exit__(None, None, None)
        raise
    return fmode, dmode


def _leave_modes(modes):
    """Stops the pair (nothing counts after its block, whatever the stacks
    hold) and takes it off torch's stacks; returns the problems found."""
    fmode, dmode = modes
    fmode.active = dmode.active = False
    return _remove_modes(fmode, dmode)


def _remove_modes(fmode, dmode):
    """Takes the audit's two modes off torch's mode stacks, wherever they are
    on them, and leaves every other mode as it was. A mode the audited code
    entered and never exited sits above the audit's; a plain ``__exit__``
    would pop that mode instead and leave the audit's counting. Returns the
    problems found (a mode no longer on its stack), else an empty list."""
    problems = []
    try:
        if not _remove_dispatch_mode(dmode):
            problems.append("its TorchDispatchMode")
    finally:
        if not _remove_function_mode(fmode):
            problems.append("its TorchFunctionMode")
    return problems


def _remove_dispatch_mode(dmode) -> bool:
    from torch.utils import _python_dispatch as pd

    # Dispatch modes keep "in a mode" flags that each mode saves on enter and
    # restores on exit: modes above the audit's are exited and re-entered with
    # the base class's methods (stack and flags only, none of their own
    # enter/exit logic), so the flags end as if they had been entered after
    # the audit. A mode pushed without those flags moves without them.
    stack = pd._get_current_dispatch_mode_stack()
    at = next((i for i in range(len(stack) - 1, -1, -1) if stack[i] is dmode), None)
    if at is None:
        return False
    moved = []
    for m in reversed(stack[at + 1:]):
        try:
            pd.TorchDispatchMode.__exit__(m, None, None, None)
            moved.append((m, True))
        except (AttributeError, IndexError):
            pd._pop_mode()
            moved.append((m, False))
    try:
        dmode.__exit__(None, None, None)
    finally:
        for m, with_flags in reversed(moved):
            if with_flags:
                pd.TorchDispatchMode.__enter__(m)
            else:
                pd._push_mode(m)
    return True


def _remove_function_mode(fmode) -> bool:
    from torch import overrides

    # Torch-function modes have no flags: the stack alone (as torch's own
    # DeviceContext moves modes for set_default_device).
    stack = overrides._get_current_function_mode_stack()
    at = next((i for i in range(len(stack) - 1, -1, -1) if stack[i] is fmode), None)
    if at is None:
        return False
    above = [overrides._pop_mode() for _ in stack[at + 1:]]
    try:
        fmode.__exit__(None, None, None)
    finally:
        for m in reversed(above):
            overrides._push_mode(m)
    return True


# --- which tensors stand for accelerator memory on a CPU run ---

_memory_modes = None  # (FunctionMode, DispatchMode) classes of DeviceMemory


def _tensor_leaves(obj, out):
    """Appends the tensors in obj (a tensor, or lists / tuples / dicts of them)."""
    if isinstance(obj, _torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensor_leaves(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensor_leaves(x, out)
    return out


def _written_args(func) -> tuple:
    """Positions of the arguments ``func`` writes (its schema's alias
    annotations with ``!``): in-place and out= ops, foreach ops returning
    nothing."""
    return tuple(i for i, a in enumerate(func._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _load_memory_modes():
    global _memory_modes
    if _memory_modes is not None:
        return _memory_modes
    _load_torch()
    torch = _torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    T = torch.Tensor
    device_getter = torch._C.TensorBase.__dict__["device"]
    to_fn, cpu_fn, numpy_fn = T.to, T.cpu, T.numpy
    aten = torch.ops.aten
    copies = {aten.copy_.default: (1, 0), aten._copy_from.default: (0, 1),
              aten._copy_from_and_resize.default: (0, 1)}  # op -> (src, dst) arg index

    class _MemoryFunctionMode(TorchFunctionMode):
        def __init__(self, owner):
            super().__init__()
            self.owner = owner
            self.active = True

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not self.active:
                return func(*args, **kwargs)
            owner = self.owner
            if getattr(func, "__self__", None) is device_getter:
                dev = func(*args, **kwargs)
                if dev.type == "cpu" and owner.holds(args[0]):
                    return owner.stand_in  # "where t is" is the accelerator
                return dev
            t = args[0] if args else None
            if func is to_fn and isinstance(t, torch.Tensor):
                target = _to_target(args, kwargs)
                if target is owner.stand_in:  # to the accelerator
                    out = func(*args, **kwargs)
                    if not owner.holds(t):  # from the host: a copy, as on a GPU
                        out = owner._fresh(out, t)
                        owner.place(out)
                    return out
                if owner._moves_to_host(t, target):
                    return owner._to_host(func(*args, **kwargs), t)
            elif func is cpu_fn and isinstance(t, torch.Tensor) and owner.holds(t):
                return owner._to_host(func(*args, **kwargs), t)
            elif func is numpy_fn and isinstance(t, torch.Tensor) and owner.holds(t):
                return func(owner._to_host(t, t), *args[1:], **kwargs)
            target = _device_arg(func, args, kwargs)
            if target is not None and target is not owner.stand_in and _names_host(target):
                # Made on the host from device memory (torch.as_tensor(d, device="cpu"),
                # zeros_like(d, device="cpu"), d.new_zeros(2, device="cpu")): host
                # memory, a copy where torch gave d itself back (as on a GPU).
                out = func(*args, **kwargs)
                sources = [x for x in _tensor_leaves(args, []) if owner.holds(x)]
                for r in _tensor_leaves(out, []):
                    if owner.holds(r):
                        fresh = owner._to_host(r, sources[0] if sources else r)
                        if fresh is not r:
                            return fresh if isinstance(out, torch.Tensor) else out
                return out
            out = func(*args, **kwargs)
            stand_in = owner.stand_in
            if any(v is stand_in for v in kwargs.values()) or any(a is stand_in for a in args):
                for r in _tensor_leaves(out, []):  # made on the accelerator
                    owner.place(r)
            return out

    class _MemoryDispatchMode(TorchDispatchMode):
        def __init__(self, owner):
            super().__init__()
            self.owner = owner
            self.active = True
            self.written = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not self.active:
                return out
            owner = self.owner
            inputs = _tensor_leaves(kwargs, _tensor_leaves(args, []))
            if not any(map(owner.holds, inputs)):
                return out
            pair = copies.get(func)
            if pair is not None and not owner.holds(args[pair[1]]):
                return out  # device memory copied into host memory stays host memory
            for r in _tensor_leaves(out, []):
                owner.place(r)
            written = self.written.get(func)
            if written is None:
                written = self.written[func] = _written_args(func)
            for i in written:
                if i < len(args):
                    for r in _tensor_leaves(args[i], []):
                        owner.place(r)
            return out

    _memory_modes = (_MemoryFunctionMode, _MemoryDispatchMode)
    return _memory_modes


def _names_host(target) -> bool:
    try:
        return _torch.device(target).type == "cpu" if isinstance(target, str) \
            else target.type == "cpu"
    except RuntimeError:
        return False


class DeviceMemory:
    """Which tensors of a CPU run hold what a GPU run keeps in accelerator
    memory: the audit (``leanstep.audit(device_memory=...)``) then tells a read
    of device memory from a read of a host-resident tensor (a step counter, an
    RNG state), although every tensor of the run lives on the CPU.

    ``stand_in`` is the one ``torch.device("cpu")`` object that the CPU
    stand-ins for the accelerator hand out wherever code asks for it
    (:data:`leanstep.megatron.cpu.ACCELERATOR`: ``torch.cuda.current_device()``,
    ``device="cuda"``, ``Tensor.cuda()``). While the context is active:

    - a tensor that a torch function makes given ``stand_in`` as its device,
      or that moves there (``t.to(stand_in)``, ``t.cuda()``: from the host, a
      copy, as on a GPU), holds device memory, as does every tensor given to
      :meth:`place` (a module's parameters and buffers: what ``.cuda()`` does);
    - so does every output of an aten op with a device-memory input, and every
      argument such an op writes (views, in-place and foreach results,
      collectives' buffers, autograd's grads);
    - ``t.device`` of such a tensor is ``stand_in``, so code that allocates
      "where t is" (``torch.empty(n, device=t.device)``) allocates device
      memory, as it would on a GPU;
    - a move to the host (``t.cpu()``, ``t.to("cpu")``, ``t.to(<a CPU device
      other than stand_in>)``, ``t.numpy()``, ``host.copy_(t)``) gives host
      memory: a copy, as on a GPU, never the device tensor itself.

    Everything else is host-resident: tensors made without a device or on a
    CPU device other than ``stand_in`` (``torch.tensor(0.0)``, a torch
    optimizer's step counters, ``torch.get_rng_state()``), and what moved to
    the host. Membership is per storage (views share it) and weak: a freed
    storage leaves the set. Tensors without storage (sparse, subclasses
    without data) are never device memory. The modes are thread-local, like
    the audit's; contexts of one object do not nest.
    """

    def __init__(self, stand_in):
        _load_torch()
        if not isinstance(stand_in, _torch.device) or stand_in.type != "cpu":
            raise TypeError(f"leanstep.audit.DeviceMemory: stand_in must be a torch.device of "
                            f"type 'cpu' (the object the CPU stand-ins hand out for the "
                            f"accelerator), got {stand_in!r}")
        from torch.utils.weak import WeakIdKeyDictionary

        self.stand_in = stand_in
        self._storages = WeakIdKeyDictionary()
        self._active = None

    @staticmethod
    def _storage(t):
        try:
            with _torch._C.DisableTorchFunction():
                return t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def holds(self, t) -> bool:
        """Whether tensor ``t`` holds device memory."""
        s = self._storage(t)
        return s is not None and s in self._storages

    def place(self, *objs) -> None:
        """Marks tensors, and the parameters and buffers of modules, as device
        memory (what ``.cuda()`` does on a GPU, in place)."""
        for obj in objs:
            if isinstance(obj, _torch.nn.Module):
                tensors = list(obj.parameters()) + list(obj.buffers())
            else:
                tensors = _tensor_leaves(obj, [])
            for t in tensors:
                s = self._storage(t)
                if s is not None:
                    self._storages[s] = True

    def _release(self, t) -> None:
        s = self._storage(t)
        if s is not None:
            self._storages.pop(s, None)

    def _fresh(self, out, source):
        """``out``, or a copy of it where it still shares ``source``'s memory."""
        s = self._storage(out)
        if s is not None and s is self._storage(source):
            with _torch._C.DisableTorchFunction():
                return out.clone()
        return out

    def _to_host(self, out, source):
        out = self._fresh(out, source)
        self._release(out)
        return out

    def _moves_to_host(self, t, target) -> bool:
        """Whether ``t.to(target)`` moves device memory to the host."""
        if target is None or target is self.stand_in:
            return False
        try:
            host = _torch.device(target).type == "cpu" if isinstance(target, str) \
                else target.type == "cpu"
        except RuntimeError:
            return False
        with _torch._C.DisableTorchFunction():
            return host and (t.device.type != "cpu" or self.holds(t))

    def __enter__(self) -> "DeviceMemory":
        if self._active is not None:
            raise RuntimeError("this DeviceMemory is already active")
        self._active = _enter_modes(_load_memory_modes(), self)
        _arrays.output_hooks.append(self._adopt)
        return self

    def _adopt(self, out, like):
        # An output of leanstep's C++ kernels, made like `like`: device memory when like is.
        if self._active is not None and isinstance(like, _torch.Tensor) and self.holds(like):
            self.place(out)

    def __exit__(self, exc_type, exc, tb):
        active, self._active = self._active, None
        if self._adopt in _arrays.output_hooks:
            _arrays.output_hooks.remove(self._adopt)
        problems = _leave_modes(active)
        if problems:
            raise Error(f"leanstep.audit.DeviceMemory: {' and '.join(problems)} no longer on "
                        f"torch's mode stack when the context ended (modes must be exited in "
                        f"the reverse order of entering)")
        return False


# --- call sites ---

_lib_cache: dict = {}


def _is_torch_or_audit(filename: str) -> bool:
    r = _lib_cache.get(filename)
    if r is None:
        norm = os.path.normcase(os.path.abspath(filename)) if not filename.startswith("<") else filename
        r = norm == _THIS_FILE or norm.startswith(_torch_dir)
        _lib_cache[filename] = r
    return r


_PLUMBING = tuple(os.sep + p.replace("/", os.sep) for p in (
    "torch/overrides.py",            # handle_torch_function
    "torch/_tensor.py",              # Python methods (__format__, ...) forwarding to it
    "torch/_compile.py",             # the dynamo-disable wrapper around mode handlers
    "torch/_dynamo/eval_frame.py",
    "torch/utils/_python_dispatch.py",
))


_plumbing_cache: dict = {}


def _is_plumbing(filename: str) -> bool:
    # Frames of torch's mode machinery (and of this module) between an op and
    # the audit's handler say nothing about where a sync came from.
    r = _plumbing_cache.get(filename)
    if r is None:
        r = _is_torch_or_audit(filename) and (
            filename.endswith(_PLUMBING) or os.path.normcase(os.path.abspath(filename)) == _THIS_FILE
        )
        _plumbing_cache[filename] = r
    return r


def _frame_str(f) -> str:
    fn = f.f_code.co_filename
    norm = os.path.normcase(os.path.abspath(fn)) if not fn.startswith("<") else fn
    if _torch_dir and norm.startswith(_torch_dir):
        fn = "torch/" + norm[len(_torch_dir):].replace(os.sep, "/")
    else:
        fn = _short_path(fn)
    return f"{fn}:{f.f_lineno} ({f.f_code.co_name})"


def _make_filter(spec) -> Callable[[str], bool]:
    if spec is None:
        return lambda filename: False
    if callable(spec):
        return spec
    if isinstance(spec, str):
        spec = (spec,)
    frags = tuple(spec)
    return lambda filename: any(s in filename for s in frags)


class Audit:
    """Counts of one audited region (see the module docstring).

    Use as ``with leanstep.audit() as a: ...``; the counters fill while the
    region runs. Entering the same object again accumulates. Attributes:

    - ``ops``: ``Counter`` aten overload name -> count; ``num_ops``; of
      those, ``view_ops`` / ``num_view_ops`` only make views (no kernel).
    - ``syncs``: ``Counter`` of :class:`Sync` (kind, op, device, site) -> count;
      ``num_syncs``. ``implicit_syncs`` likewise for data-dependent ops.
    - ``host_reads``: ``Counter`` of :class:`HostRead` -> count;
      ``num_host_reads``, ``num_device_reads`` (reads of non-CPU tensors).
    - ``list_calls``: ``Counter`` of :class:`ListCall` -> count, the calls of
      ops taking a list of tensors with the sizes of that list's tensors.
    - ``to_dict()``, ``format_table(top=None)``, ``summary()``.

    ``stacklevel_filter`` names further frames to skip when attributing a call
    site, besides torch and this module: a callable ``filename -> bool`` (True
    skips), a path fragment or an iterable of them (``"megatron/core/"``
    attributes Megatron-Core's syncs to the training script's line).
    """

    def __init__(self, *, stacklevel_filter: Union[None, str, Iterable[str], Callable[[str], bool]] = None,
                 device_memory: Optional["DeviceMemory"] = None):
        if device_memory is not None and not isinstance(device_memory, DeviceMemory):
            raise TypeError(f"leanstep.audit: device_memory must be a leanstep.audit.DeviceMemory "
                            f"or None, got {type(device_memory).__name__}")
        self.device_memory = device_memory
        self._reading = 0  # > 0 inside a Python-level read (its aten-level read is the same)
        self.ops: collections.Counter = collections.Counter()
        self.view_ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.implicit_syncs: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()
        self.list_calls: collections.Counter = collections.Counter()
        self._filter = _make_filter(stacklevel_filter)
        self._filter_cache: dict = {}
        self._active = None

    # -- recording --
    def _skip(self, filename: str) -> bool:
        if _is_torch_or_audit(filename):
            return True
        r = self._filter_cache.get(filename)
        if r is None:
            r = self._filter_cache[filename] = bool(self._filter(filename))
        return r

    def _site(self) -> CallSite:
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename == __file__:
            f = f.f_back
        # via: the innermost library frame, past torch's torch-function plumbing
        innermost = f
        while innermost is not None and _is_plumbing(innermost.f_code.co_filename):
            innermost = innermost.f_back
        while f is not None and self._skip(f.f_code.co_filename):
            f = f.f_back
        via = _frame_str(innermost) if innermost is not None and innermost is not f else None
        if f is None:
            return CallSite("<unknown>", 0, "<unknown>", via)
        return CallSite(f.f_code.co_filename, f.f_lineno, f.f_code.co_name, via)

    def _record_sync(self, counter, kind, op, t):
        dev = "?"
        if isinstance(t, _torch.Tensor):
            with _torch._C.DisableTorchFunction():
                dev = str(t.device)
            if self.device_memory is not None and self.device_memory.holds(t):
                dev += " (device memory)"  # a CPU run standing in for the accelerator
        counter[Sync(kind, op, dev, self._site())] += 1

    def _record_list_call(self, op, list_args, args, kwargs):
        lists = [args[i] if i < len(args) else kwargs.get(name) for i, name in list_args]
        with _torch._C.DisableTorchFunction():
            numels = _run_lengths(int(t.numel()) for t in (lists[0] or ()))
        self.list_calls[ListCall(op, sum(1 for x in lists if x), numels)] += 1

    def _is_device_memory(self, t) -> bool:
        """Whether a read of `t` reads device memory: a tensor on any device but
        the CPU (meta included) does; a CPU tensor does when the DeviceMemory,
        if there is one, holds it."""
        if not isinstance(t, _torch.Tensor):
            return False
        with _torch._C.DisableTorchFunction():
            if t.device.type != "cpu":
                return True
        return self.device_memory is not None and self.device_memory.holds(t)

    def _record_data_dependent(self, op, args):
        """An op whose result or output shape the host needs (nonzero, equal,
        allclose, a bool mask...): an implicit sync, and on device memory a read
        of it (the host waits for its values)."""
        t = args[0]
        self._record_sync(self.implicit_syncs, "data_dependent", op, t)
        if not self._reading and self._is_device_memory(t):
            self._record_read(op.split(".")[1] if op.startswith("aten.") else op, t, None)

    def _on_native_read(self, array, kind):
        # leanstep.read_scalar, torch.save: reads beneath torch's dispatcher. The hooks
        # are process-wide; the audit, like its modes, counts its own thread only.
        if (self._active is not None and threading.get_ident() == self._thread
                and isinstance(array, _torch.Tensor)):
            self._record_read(kind, array, None)

    def _record_read(self, kind, t, error):
        memory = "device" if self._is_device_memory(t) else "host-resident"
        with _torch._C.DisableTorchFunction():
            dev = t.device
            rec = HostRead(kind, memory, str(dev), str(t.dtype).replace("torch.", ""),
                           tuple(t.shape), self._site(), error)
        self.host_reads[rec] += 1

    # -- context manager --
    def __enter__(self) -> "Audit":
        if self._active is not None:
            raise RuntimeError("this Audit is already active; nest a new leanstep.audit() instead")
        self._active = _enter_modes(_load_torch(), self)
        self._thread = threading.get_ident()
        _arrays.read_hooks.append(self._on_native_read)
        _watch_saves(+1)
        return self

    def __exit__(self, exc_type, exc, tb):
        active, self._active = self._active, None
        if self._on_native_read in _arrays.read_hooks:
            _arrays.read_hooks.remove(self._on_native_read)
            _watch_saves(-1)
        problems = _leave_modes(active)
        if problems:
            raise Error(
                f"leanstep.audit: {' and '.join(problems)} {'was' if len(problems) == 1 else 'were'} "
                f"no longer on torch's mode stack "
                f"when the audited block ended: code inside the block exited a mode entered "
                f"before the audit (modes must be exited in the reverse order of entering); "
                f"the counts stop where it was removed")
        return False

    # -- results --
    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_view_ops(self) -> int:
        """Ops that only make views (t, view, slice, ...): no kernel launch."""
        return sum(self.view_ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())

    @property
    def num_implicit_syncs(self) -> int:
        return sum(self.implicit_syncs.values())

    @property
    def num_host_reads(self) -> int:
        return sum(self.host_reads.values())

    @property
    def num_device_reads(self) -> int:
        return sum(n for r, n in self.host_reads.items() if r.memory == "device")

    def summary(self) -> str:
        s = (f"{self.num_ops} aten ops ({self.num_view_ops} views), {self.num_syncs} host syncs, "
             f"{self.num_host_reads} host reads ({self.num_device_reads} of device memory)")
        if self.implicit_syncs:
            s += f", {self.num_implicit_syncs} implicit syncs (data-dependent ops)"
        return s

    def __repr__(self) -> str:
        return f"<leanstep.audit.Audit: {self.summary()}>"

    def to_dict(self) -> dict:
        """Everything as plain JSON types; rows sorted by count, descending."""

        def site(s: CallSite) -> dict:
            return {"file": s.file, "line": s.line, "function": s.function, "via": s.via}

        def syncs(counter) -> list:
            return [{"count": n, "kind": r.kind, "op": r.op, "device": r.device, **site(r.site)}
                    for r, n in _sorted(counter)]

        return {
            "summary": self.summary(),
            # whether reads were classified by a DeviceMemory (a CPU run standing in for a
            # device run), rather than by the tensors' own devices
            "device_memory": self.device_memory is not None,
            "num_ops": self.num_ops,
            "num_view_ops": self.num_view_ops,
            "num_syncs": self.num_syncs,
            "num_implicit_syncs": self.num_implicit_syncs,
            "num_host_reads": self.num_host_reads,
            "num_device_reads": self.num_device_reads,
            "ops": dict(self.ops.most_common()),
            "view_ops": dict(self.view_ops.most_common()),
            "syncs": syncs(self.syncs),
            "implicit_syncs": syncs(self.implicit_syncs),
            "host_reads": [
                {"count": n, "kind": r.kind, "memory": r.memory, "device": r.device,
                 "dtype": r.dtype, "shape": list(r.shape), "error": r.error, **site(r.site)}
                for r, n in _sorted(self.host_reads)
            ],
            "list_calls": [
                {"count": n, "op": c.op, "lists": c.lists, "tensors": c.num_tensors,
                 "elements": c.num_elements, "numels": [list(r) for r in c.numels]}
                for c, n in sorted(self.list_calls.items(), key=lambda kv: (-kv[1], kv[0].op))
            ],
        }

    def format_table(self, top: Optional[int] = None) -> str:
        """A text report: ops by name (most frequent first), then host syncs,
        implicit syncs and host reads by call site. ``top`` limits each
        section's rows (the totals stay complete)."""
        out = [f"audit: {self.summary()}", ""]

        def section(title, header, rows):
            out.append(title)
            if not rows:
                out.append("  (none)")
                out.append("")
                return
            shown = rows if top is None else rows[:top]
            widths = [max(len(str(r[i])) for r in [header] + shown) for i in range(len(header))]
            for r in [header] + shown:
                cells = [str(c).rjust(widths[0]) if i == 0 else str(c).ljust(widths[i])
                         for i, c in enumerate(r)]
                out.append("  " + "  ".join(cells).rstrip())
            if len(shown) < len(rows):
                out.append(f"  ... {len(rows) - len(shown)} more rows")
            out.append("")

        section(f"aten ops: {self.num_ops} ({len(self.ops)} names)", ("count", "op"),
                [(n, name) for name, n in self.ops.most_common()])
        sync_hdr = ("count", "kind", "op", "device", "call site")
        section(f"host syncs: {self.num_syncs}", sync_hdr,
                [(n, r.kind, r.op, r.device, str(r.site)) for r, n in _sorted(self.syncs)])
        if self.implicit_syncs:
            section(f"implicit syncs (data-dependent ops): {self.num_implicit_syncs}", sync_hdr,
                    [(n, r.kind, r.op, r.device, str(r.site))
                     for r, n in _sorted(self.implicit_syncs)])
        section(f"host reads: {self.num_host_reads} ({self.num_device_reads} of device memory)",
                ("count", "read", "memory", "tensor", "call site"),
                [(n, r.kind + (f" ({r.error})" if r.error else ""), r.memory, r.tensor, str(r.site))
                 for r, n in _sorted(self.host_reads)])
        return "\n".join(out).rstrip() + "\n"


def _sorted(counter):
    return sorted(counter.items(), key=lambda kv: (-kv[1], str(kv[0].site), kv[0][:2]))


def audit(*, stacklevel_filter=None, device_memory=None) -> Audit:
    """A new :class:`Audit`, to be used as a context manager:

    >>> with leanstep.audit() as a:            # doctest: +SKIP
    ...     loss = step(batch)
    >>> print(a.summary())                     # doctest: +SKIP
    412 aten ops, 1 host syncs, 1 host reads (1 of device memory)
    """
    return Audit(stacklevel_filter=stacklevel_filter, device_memory=device_memory)


# --- command line ---

def _flush_c_stdio() -> None:
    """Flushes C stdio buffers (printf from extensions, NCCL's log), so that
    what the script wrote comes before the report rather than at exit."""
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no C runtime to ask (Windows): nothing to flush
        pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m leanstep.audit",
        description="Run a Python script under leanstep.audit() and report its aten ops, "
                    "host syncs and host reads by call site. The table goes to stderr, "
                    "--json to stdout (one line, the last, after the script's output and a "
                    "newline); the exit code is the script's.",
    )
    p.add_argument("--json", action="store_true", help="print the report as one line of JSON on stdout")
    p.add_argument("--top", type=int, default=None, metavar="N", help="at most N rows per table section")
    p.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead")
    p.add_argument("--skip", action="append", default=[], metavar="FRAGMENT",
                   help="path fragment of frames to skip when attributing call sites (repeatable)")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def main(argv: Optional[list] = None) -> int:
    import runpy

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    opts = parser.parse_args(argv)
    script = opts.script
    old_argv, old_path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [script] + list(opts.args)
    script_dir = os.path.dirname(os.path.abspath(script))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    rc = 0
    a = audit(stacklevel_filter=opts.skip or None)
    try:
        with a:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    finally:
        sys.argv = old_argv
        if old_path0 is not None:
            sys.path[0] = old_path0
    sys.stdout.flush()
    _flush_c_stdio()
    report = json.dumps(a.to_dict()) if opts.json else a.format_table(opts.top)
    if opts.output:
        with open(opts.output, "w") as f:
            f.write(report if report.endswith("\n") else report + "\n")
    elif opts.json:
        # A newline first: the script's output may not end with one (print(x,
        # end="")), and writes that bypass sys.stdout (os.write, C code,
        # subprocesses) cannot be seen, so the JSON always starts a line of
        # its own: the last line of stdout is the JSON.
        sys.stdout.write("\n" + report + "\n")
        sys.stdout.flush()
    else:
        sys.stderr.write(report)
        sys.stderr.flush()
    return rc


class _CallableModule(types.ModuleType):
    """``leanstep.audit`` is this module and ``leanstep.audit()`` starts an
    audit, so both ``leanstep.audit()`` and ``leanstep.audit.audit()`` work."""

    def __call__(self, **kwargs) -> Audit:
        return audit(**kwargs)


if __name__ == "__main__":
    try:  # run the package's copy of this module, so nested audits share its classes
        from leanstep.audit import main as _main
    except ImportError:
        _main = main
    sys.exit(_main())
else:
    sys.modules[__name__].__class__ = _CallableModule
