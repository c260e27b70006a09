"""Run real Megatron-Core training on a CPU-only torch, scoped and exactly undone.

    import leanstep.megatron.cpu as mcpu

    with mcpu.megatron_on_cpu():
        ...  # parallel_state, model_parallel_cuda_manual_seed, GPTModel, DDP,
             # get_megatron_optimizer, get_forward_backward_func, optimizer.step()

Megatron-Core (0.16 on Python 3.11, 0.17 to 0.19 on Python 3.12) hard-codes
CUDA in a few places on its training path. Each place is answered by one small
shim, itself a context manager that can be used alone:

- :func:`rng_tracker`: the CUDA RNG tracker runs on the CPU default generator;
- :func:`cuda_streams`: ``torch.cuda.Stream`` / ``Event`` / ``current_stream`` /
  ``default_stream`` / ``stream`` are CPU stand-ins;
- :func:`current_device`: ``torch.cuda.current_device()`` is ``torch.device("cpu")``;
- :func:`cuda_literals`: ``device="cuda"`` in tensor factories is the CPU, and
  ``Tensor.cuda()`` of a CPU tensor is the tensor;
- :func:`cuda_type_names`: ``Tensor.type()`` of a CPU tensor reads
  ``"torch.cuda.<T>Tensor"``;
- :func:`te_general_gemm`: 0.16 without Transformer Engine: the router's missing
  ``te_general_gemm`` name is ``None`` (its torch path runs);
- :func:`gloo_all_to_all`: ``all_to_all_single`` gets its split sizes as lists;
- :func:`dtoh_copies`: the dispatcher copies its token counts to the host where
  a GPU run does (seen only under :class:`leanstep.audit.DeviceMemory`).

:func:`megatron_on_cpu` (also :func:`cpu_shims`) enters all of them. Wherever
possible a shim replaces a Megatron module's own ``torch`` name with a view of
torch that answers the few CUDA attributes that module uses and passes every
other attribute through; only ``torch.cuda.current_device``, ``Tensor.cuda``
and ``Tensor.type`` (called from too many modules, or methods of tensors) are
replaced globally, for the duration of the context. On exit every replaced
attribute gets back the very object it held (an attribute that did not exist
is removed again). Contexts nest, and a piece the installed version does not
have is skipped. The global replacements are process-wide: use the context
around the whole run (model building, training steps), not from several
threads with different needs.

Megatron's training loop (megatron.training, not part of megatron-core) also
wires the gradient reduction into the model config; a run written against
megatron-core alone has to do the same, or the data-parallel ranks never
all-reduce their gradients, silently: see :func:`finalize_model_grads_config`.

This module imports torch and (lazily) Megatron-Core only, not leanstep's
compiled extension.
"""

import contextlib
import importlib
import logging
import threading
import time
import types
import warnings

import torch

__all__ = [
    "megatron_on_cpu",
    "cpu_shims",
    "SHIMS",
    "rng_tracker",
    "cuda_streams",
    "current_device",
    "cuda_literals",
    "cuda_type_names",
    "te_general_gemm",
    "gloo_all_to_all",
    "dtoh_copies",
    "finalize_model_grads_config",
    "CpuStream",
    "CpuEvent",
    "ACCELERATOR",
]

_MISSING = object()


# ---------------------------------------------------------------- machinery


class _Patches:
    """Attribute replacements (and undo callbacks) made by one shim entry,
    undone in reverse order. An attribute that no longer holds the
    replacement at exit (something replaced it inside the context and did
    not put it back) is left as it is, with a warning."""

    def __init__(self, shim):
        self._shim = shim
        self._undo = []

    def set(self, owner, name, value):
        saved = vars(owner).get(name, _MISSING)
        setattr(owner, name, value)
        self._undo.append((owner, name, saved, value))

    def on_exit(self, fn):
        self._undo.append(fn)

    def restore(self):
        while self._undo:
            item = self._undo.pop()
            if callable(item):
                item()
                continue
            owner, name, saved, value = item
            if vars(owner).get(name, _MISSING) is not value:
                where = (f"{owner.__module__}.{owner.__qualname__}" if isinstance(owner, type)
                         else getattr(owner, "__name__", repr(owner)))
                warnings.warn(f"leanstep.megatron.cpu.{self._shim}: {where}.{name} was replaced "
                              f"inside the context; left as it is", RuntimeWarning, stacklevel=3)
                continue
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)


def _shim(fn):
    """A shim: `fn(patches)` applies its replacements; the context undoes them."""

    @contextlib.contextmanager
    def shim():
        patches = _Patches(fn.__name__)
        try:
            fn(patches)
            yield
        finally:
            patches.restore()

    shim.__name__ = shim.__qualname__ = fn.__name__
    shim.__doc__ = fn.__doc__
    shim.__module__ = fn.__module__
    return shim


_import_failures = {}


def _module(name):
    """megatron.core.<name>, imported if needed; None when it does not import
    (an optional module, or a version without it)."""
    full = "megatron.core." + name
    if full in _import_failures:
        return None
    try:
        return importlib.import_module(full)
    except Exception as e:  # noqa: BLE001 - any import failure means: not in this installation
        _import_failures[full] = repr(e)
        return None


class _View(types.ModuleType):
    """A module (torch, torch.cuda, torch.distributed, or a view of one) with
    some attributes answered here; every other attribute is the base's."""

    def __init__(self, base, attrs):
        super().__init__(getattr(base, "__name__", "torch"))
        self.__dict__["_leanstep_base"] = base
        self.__dict__.update(attrs)

    def __getattr__(self, name):
        return getattr(self.__dict__["_leanstep_base"], name)

    def __repr__(self):
        return f"<leanstep.megatron.cpu view of {self.__dict__['_leanstep_base']!r}>"


def _view_torch(patches, module, attrs=None, cuda=None, distributed=None):
    """Replaces `module.torch` by a view answering `attrs`, and `cuda` /
    `distributed` attributes of torch.cuda / torch.distributed. A module
    without a `torch` name is left alone."""
    if module is None:
        return
    base = vars(module).get("torch")
    if base is None:
        return
    over = dict(attrs or {})
    if cuda:
        over["cuda"] = _View(base.cuda, cuda)
    if distributed:
        over["distributed"] = _View(base.distributed, distributed)
    patches.set(module, "torch", _View(base, over))


# ---------------------------------------------------------------- 1. RNG tracker


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


class _DropMessage(logging.Filter):
    def __init__(self, text):
        super().__init__()
        self.text = text

    def filter(self, record):
        return self.text not in record.getMessage()


_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


@_shim
def rng_tracker(patches):
    """The "CUDA" RNG state is the CPU default generator's state.

    ``tensor_parallel.random`` (0.16.1 and 0.19.2):

    - ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (``CudaRNGStatesTracker.fork``,
      ``add``, ``_get_all_rng_states`` / ``_set_all_rng_states`` of activation
      recomputation) read and write ``torch.get_rng_state`` / ``set_rng_state``;
    - its ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed`` /
      ``manual_seed_all`` (``CudaRNGStatesTracker.add``,
      ``model_parallel_cuda_manual_seed``) act on the CPU generator, so the
      tracker's named states (data-, tensor-, expert-parallel) are distinct CPU
      states and ``fork()`` swaps them in and out;
    - ``fork()`` logs "CPU RNG state changed within GPU RNG context" whenever the
      forked region draws numbers, which on the CPU is what it is for: that
      message is dropped (a filter on the module's logger).

    ``rerun_state_machine`` (both): ``torch.cuda.get_rng_state`` /
    ``set_rng_state`` of the saved rerun state, likewise.
    """
    random_mod = _module("tensor_parallel.random")
    cuda = {
        "get_rng_state": _cpu_get_rng_state,
        "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
        "manual_seed": _cpu_manual_seed,
        "manual_seed_all": _cpu_manual_seed,
    }
    if random_mod is not None:
        for name, fn in (("_get_cuda_rng_state", _cpu_get_rng_state),
                         ("_set_cuda_rng_state", _cpu_set_rng_state)):
            if name in vars(random_mod):
                patches.set(random_mod, name, fn)
        _view_torch(patches, random_mod, cuda=cuda)
        logger = logging.getLogger(random_mod.__name__)
        drop = _DropMessage(_RNG_WARNING)
        logger.addFilter(drop)
        patches.on_exit(lambda: logger.removeFilter(drop))
    _view_torch(patches, _module("rerun_state_machine"), cuda=cuda)


# ---------------------------------------------------------------- 2. streams and events


class CpuEvent:
    """Stands for a ``torch.cuda.Event``: CPU work is done when it is issued, so
    an event is complete once recorded; ``elapsed_time`` is wall time in ms."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **kwargs):
        self.enable_timing = enable_timing
        self._time = None

    def record(self, stream=None):
        self._time = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event):
        return (end_event._time - self._time) * 1e3


class CpuStream:
    """Stands for a ``torch.cuda.Stream``: CPU ops run in order on the calling
    thread, so every wait is already satisfied."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = CpuEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True

    @staticmethod
    def priority_range():
        return (0, 0)


class _Streams:
    """The current-stream stack of one `cuda_streams` context."""

    def __init__(self):
        self.default = CpuStream()
        self._local = threading.local()

    def _stack(self):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current_stream(self, device=None):
        stack = self._stack()
        return stack[-1] if stack else self.default

    def default_stream(self, device=None):
        return self.default

    def stream(self, stream):
        return _StreamContext(self, stream)


class _StreamContext:
    def __init__(self, streams, stream):
        self.streams, self.stream = streams, stream

    def __enter__(self):
        if self.stream is not None:
            self.streams._stack().append(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            self.streams._stack().pop()
        return False


# (module, attributes of classes that cache a stream made at first use)
_STREAM_MODULES = (
    ("transformer.moe.token_dispatcher", ("MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",)),
    ("distributed.param_and_grad_buffer", ()),
    ("distributed.distributed_data_parallel", ()),
    ("transformer.moe.moe_utils", ()),
    ("transformer.moe.shared_experts", ("SharedExpertMLP.stream",)),
    ("transformer.moe.moe_layer", ()),
    ("transformer.transformer_layer", ()),
    ("pipeline_parallel.utils", ()),
)


@_shim
def cuda_streams(patches):
    """``torch.cuda.Stream`` / ``Event`` / ``current_stream`` / ``default_stream`` /
    ``stream`` / ``synchronize`` / ``is_current_stream_capturing`` are CPU
    stand-ins (:class:`CpuStream`, :class:`CpuEvent`; waits are no-ops, the
    ``stream()`` context sets what ``current_stream()`` returns), in the
    modules that use them:

    - ``transformer.moe.token_dispatcher`` (0.16.1 and 0.19.2, every MoE
      forward): ``MoEAlltoAllTokenDispatcher.__init__`` makes the class-wide
      device-to-host stream ``cuda_dtoh_stream``; ``_maybe_dtoh_and_synchronize``
      compares it with ``current_stream()``, waits on it, runs the copies under
      ``torch.cuda.stream`` and records an event;
    - ``distributed.param_and_grad_buffer``: 0.19.2
      ``_ParamAndGradBucketGroup.start_grad_sync`` reads ``current_stream()`` on
      every gradient reduction; both versions, with ``overlap_grad_reduce``, its
      ``communication_stream`` paths (``torch.cuda.stream``, ``default_stream`` /
      ``current_stream().wait_stream``);
    - ``distributed.distributed_data_parallel``: the communication stream
      ``DistributedDataParallel.__init__`` makes with ``overlap_grad_reduce``;
    - ``transformer.moe.moe_utils`` (``maybe_move_tensor_to_cpu``),
      ``transformer.moe.shared_experts`` (the class-wide ``SharedExpertMLP.stream``
      of ``moe_shared_expert_overlap``), ``transformer.moe.moe_layer`` (0.19.2:
      the delayed-wgrad stream and event), ``transformer.transformer_layer``
      (0.19.2: the router's d2h event of the CUDA-graph scope),
      ``pipeline_parallel.utils`` (the comm stream of the overlapped EP schedule).

    The class-wide streams Megatron makes at first use
    (``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream``, ``SharedExpertMLP.stream``)
    are a :class:`CpuStream` for the context and what they were (``None``, or a
    real stream) again after it: a dispatcher built in one context works in the
    next, and a later CUDA run in the process makes a real stream.
    """
    streams = _Streams()
    cuda = {
        "Stream": CpuStream,
        "Event": CpuEvent,
        "current_stream": streams.current_stream,
        "default_stream": streams.default_stream,
        "stream": streams.stream,
        "synchronize": lambda device=None: None,
        "is_current_stream_capturing": lambda: False,
    }
    for name, cached in _STREAM_MODULES:
        mod = _module(name)
        if mod is None:
            continue
        _view_torch(patches, mod, cuda=cuda)
        for qual in cached:
            cls_name, attr = qual.rsplit(".", 1)
            cls = getattr(mod, cls_name, None)
            if cls is not None and attr in vars(cls):
                patches.set(cls, attr, CpuStream())


# ---------------------------------------------------------------- 3. current device


#: The device the stand-ins hand out for the accelerator: a ``torch.device("cpu")``,
#: always this one object, so that :class:`leanstep.audit.DeviceMemory` can tell
#: what a GPU run would allocate on the device from what it keeps on the host.
ACCELERATOR = torch.device("cpu")


def _cpu_current_device():
    return ACCELERATOR


@_shim
def current_device(patches):
    """``torch.cuda.current_device()`` returns ``torch.device("cpu")``.

    A global replacement (``torch.cuda.current_device`` itself) for the context:
    the call sites are spread over dozens of modules, some imported only when
    first used. Those a training step reaches, in 0.16.1 and 0.19.2 alike:
    ``distributed.param_and_grad_buffer._ParamAndGradBuffer.__init__`` (the DDP
    param and grad buffers), ``tensor_parallel.mappings`` (the outputs of
    ``_gather_along_first_dim`` / ``_gather_along_last_dim`` /
    ``_reduce_scatter_along_first_dim`` and of ``_AllToAll.forward``, the
    expert-parallel token exchange), ``transformer.moe.router`` (``TopKRouter``
    aux-loss scalars, ``gating``), ``models.common.embeddings.rotary_pos_embedding``
    (``RotaryEmbedding`` frequencies), ``utils.GlobalMemoryBuffer.get_tensor``,
    ``optimizer.optimizer.ChainedOptimizer.get_loss_scale`` (the loss scale of
    ``scale_loss``, i.e. ``config.grad_scale_func``). Others (not reached by
    that run, same answer): ``optimizer.distrib_optimizer`` (checkpoint
    buffers), ``tensor_parallel.layers``, ``transformer.moe.experts``,
    ``transformer.attention``, ``models.gpt.gpt_model`` (MTP),
    ``pipeline_parallel.p2p_communication`` and, in 0.19.2,
    ``utils.get_batch_on_this_tp_rank``.
    """
    patches.set(torch.cuda, "current_device", _cpu_current_device)


# ---------------------------------------------------------------- 4. "cuda" literals


def _is_cuda(device):
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, torch.device) and device.type == "cuda"


_wrappers = {}


def _cached(make_wrapper, original):
    """One wrapper per (kind, original): re-entering a shim builds nothing anew."""
    key = (make_wrapper, original)
    wrapper = _wrappers.get(key)
    if wrapper is None:
        wrapper = _wrappers[key] = make_wrapper(original)
    return wrapper


def _on_cpu(factory):
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = ACCELERATOR
            kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    make.__name__ = factory.__name__
    make.__wrapped__ = factory
    return make


_FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "eye",
              "rand", "randn", "randint", "zeros_like", "ones_like", "empty_like", "full_like")


def _cpu_autocast(autocast):
    def make(device_type, *args, **kwargs):
        if device_type == "cuda":
            device_type = "cpu"
        return autocast(device_type, *args, **kwargs)

    make.__name__ = "autocast"
    make.__wrapped__ = autocast
    return make


_LITERAL_MODULES = (
    "optimizer.optimizer",
    "optimizer.clip_grads",
    "optimizer.grad_scaler",
    "optimizer.layer_wise_optimizer",
    "utils",
    "pipeline_parallel.schedules",
    "transformer.moe.moe_utils",
    "transformer.moe.token_dispatcher",
    "transformer.utils",
    "tensor_parallel.data",
    "rerun_state_machine",
    "distributed.param_and_grad_buffer",
)


def _tensor_cuda(original):
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        if self.device.type == "cpu":
            if memory_format is not torch.preserve_format:
                return self.contiguous(memory_format=memory_format).to(ACCELERATOR)
            return self.to(ACCELERATOR)  # this very tensor, but seen as moved to the device
        return original(self, device, non_blocking, memory_format=memory_format)

    cuda.__name__ = "cuda"
    cuda.__wrapped__ = original
    return cuda


@_shim
def cuda_literals(patches):
    """``device="cuda"`` (or ``"cuda:N"``, ``torch.device("cuda")``) passed to a
    tensor factory (``torch.tensor``, ``zeros``, ``empty``, ``ones``, ``full``,
    ``arange``, ...) makes a CPU tensor (``pin_memory`` dropped), and
    ``torch.autocast("cuda", ...)`` is CPU autocast, in the modules that write
    them. Reached by a training step (0.16.1 and 0.19.2 unless noted):

    - ``optimizer.optimizer``: ``MixedPrecisionOptimizer.__init__``'s
      ``found_inf``, ``_dummy_overflow_buf`` and ``_scale_one``,
      ``FP32Optimizer.__init__``'s ``_scale``; 0.19.2 also
      ``MegatronOptimizer.has_grad_norm_group``'s flag;
    - ``optimizer.clip_grads``: ``get_grad_norm_fp32``'s scalars (the inf-norm
      all-reduce, the L2 overflow buffer and norm), ``clip_grad_by_total_norm_fp32``'s
      overflow buffer, ``count_zeros_fp32``'s accumulator;
    - ``utils.local_multi_tensor_l2_norm`` (the L2 norm without TE or apex);
    - ``pipeline_parallel.schedules``: the ``total_num_tokens`` counter of
      ``forward_backward_no_pipelining`` and both pipelined schedules;
      ``forward_step``'s ``enable_autocast`` context;
    - ``transformer.utils.get_default_causal_mask`` (the causal mask of the local
      attention's softmax) and ``get_sliding_window_causal_mask``.

    Also covered, on other paths: ``optimizer.grad_scaler`` (fp16 loss scales),
    ``optimizer.layer_wise_optimizer`` (0.19.2 flag), ``utils``' hybrid-CP batch
    helper (0.16.1), ``transformer.moe.moe_utils.track_moe_metrics`` (0.16.1),
    ``transformer.moe.token_dispatcher._HybridEPManager`` (0.19.2),
    ``tensor_parallel.data`` (``broadcast_data``), ``rerun_state_machine``
    (``_reduce_any``), ``distributed.param_and_grad_buffer`` (the NCCL-UB warm-up).

    ``Tensor.cuda()`` of a CPU tensor returns the tensor (a global replacement
    for the context: a method of every tensor; ``Module.cuda()`` goes through
    it): ``tensor_parallel.data.broadcast_data``,
    ``utils.check_param_hashes_across_dp_replicas``,
    ``models.common.language_module.LanguageModule.setup_embeddings_and_output_layer``
    (shared embeddings across pipeline stages),
    ``optimizer.distrib_optimizer.DistributedOptimizer.get_parameter_state_dp_zero``,
    ``optimizer.grad_scaler`` (``load_state_dict``), the optimizers' offload paths.
    """
    for name in _LITERAL_MODULES:
        mod = _module(name)
        if mod is None or vars(mod).get("torch") is None:
            continue
        base = vars(mod)["torch"]
        attrs = {f: _cached(_on_cpu, getattr(base, f)) for f in _FACTORIES}
        attrs["autocast"] = _cached(_cpu_autocast, base.autocast)
        _view_torch(patches, mod, attrs)
    patches.set(torch.Tensor, "cuda", _cached(_tensor_cuda, torch.Tensor.cuda))


# ---------------------------------------------------------------- 5. CUDA type names


def _tensor_type(original):
    def type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if (not args and not kwargs and self.device.type == "cpu" and name.startswith("torch.")
                and not name.startswith("torch.cuda.")):
            return "torch.cuda." + name[len("torch."):]
        return name

    type.__name__ = "type"
    type.__wrapped__ = original
    return type


@_shim
def cuda_type_names(patches):
    """``Tensor.type()`` (no arguments) of a CPU tensor reads as the CUDA type
    (``torch.FloatTensor`` -> ``torch.cuda.FloatTensor``, likewise ``HalfTensor``,
    ``BFloat16Tensor``, ...). With a dtype argument it converts as before.

    A global replacement for the context (a method of every tensor; subclasses
    that define their own ``type`` keep it). Megatron compares these names in
    ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (asserts fp32 grads),
    ``optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__`` (bf16 / fp16
    without the distributed optimizer) and ``optimizer.distrib_optimizer.DistributedOptimizer``
    (``__init__`` and ``_build_model_and_main_param_groups``), 0.16.1 and 0.19.2
    alike; on CPU tensors every parameter would be refused ("Wrapped parameters
    must be one of torch.cuda.FloatTensor, ...") and every grad fail the assert.
    """
    patches.set(torch.Tensor, "type", _cached(_tensor_type, torch.Tensor.type))


# ---------------------------------------------------------------- 6. te_general_gemm


@_shim
def te_general_gemm(patches):
    """Megatron-Core 0.16 without Transformer Engine never defines
    ``transformer.moe.moe_utils.te_general_gemm`` (it is imported inside the
    ``try`` that fails), yet ``RouterGatingLinearFunction.forward`` / ``backward``
    (the router's gating GEMM, ``router_gating_linear``) test it with
    ``te_general_gemm is not None``: a NameError on the first MoE forward. The
    name is set to ``None`` for the context, as 0.19.2 does itself when TE is
    absent, so the torch ``mm`` / ``addmm`` path runs. A no-op when the name
    exists (0.19.2, or any version with TE)."""
    mod = _module("transformer.moe.moe_utils")
    if mod is not None and "te_general_gemm" not in vars(mod):
        patches.set(mod, "te_general_gemm", None)


# ---------------------------------------------------------------- 7. gloo all-to-all


def _as_split_sizes(sizes):
    if sizes is None or isinstance(sizes, list):
        return sizes
    if hasattr(sizes, "tolist"):  # a CPU tensor or a numpy array
        return [int(s) for s in sizes.tolist()]
    return [int(s) for s in sizes]


def _all_to_all_single(original):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        return original(output, input, output_split_sizes=_as_split_sizes(output_split_sizes),
                        input_split_sizes=_as_split_sizes(input_split_sizes), group=group,
                        async_op=async_op)

    all_to_all_single.__wrapped__ = original
    return all_to_all_single


@_shim
def gloo_all_to_all(patches):
    """``torch.distributed.all_to_all_single`` gets its split sizes as Python
    lists. Megatron's ``tensor_parallel.mappings._AllToAll`` (``all_to_all``,
    used by ``MoEAlltoAllTokenDispatcher`` for expert parallelism; 0.16.1 and
    0.19.2) passes the token counts the dispatcher keeps on the host as
    tensors; the gloo backend accepts only lists of ints (NCCL converts). Only
    that module's ``torch.distributed`` is affected."""
    mod = _module("tensor_parallel.mappings")
    if mod is None or vars(mod).get("torch") is None:
        return
    base = vars(mod)["torch"].distributed
    _view_torch(patches, mod, distributed={
        "all_to_all_single": _cached(_all_to_all_single, base.all_to_all_single)})


# ---------------------------------------------------------------- 8. the dispatcher's copies to the host


def _dtoh_copy(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and tensor.device is ACCELERATOR:
            host = tensor.to(torch.device("cpu"), non_blocking=True)  # no stream on the CPU
            return host.numpy() if as_numpy else host
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__wrapped__ = original
    return maybe_move_tensor_to_cpu


@_shim
def dtoh_copies(patches):
    """The alltoall dispatcher's copies of its token counts to the host
    (``transformer.moe.token_dispatcher`` calls ``maybe_move_tensor_to_cpu``,
    which moves only ``is_cuda`` tensors) are made for the tensors that hold
    device memory too: those whose ``device`` is :data:`ACCELERATOR`, which
    only :class:`leanstep.audit.DeviceMemory` answers (for every other CPU
    tensor ``device`` is a new object, and nothing changes). So a CPU run under
    it reads device memory where a GPU run does, once per MoE layer in
    ``_maybe_dtoh_and_synchronize``, and the later reads of the counts
    (``SequentialMLP``'s splits, ``sort_chunks_by_idxs``) are of host memory,
    as on a GPU. 0.16.1 and 0.19.2 alike."""
    mod = _module("transformer.moe.token_dispatcher")
    if mod is None or "maybe_move_tensor_to_cpu" not in vars(mod):
        return
    patches.set(mod, "maybe_move_tensor_to_cpu",
                _cached(_dtoh_copy, vars(mod)["maybe_move_tensor_to_cpu"]))


# ---------------------------------------------------------------- all together

#: name -> shim, in the order :func:`megatron_on_cpu` enters them.
SHIMS = {
    "rng_tracker": rng_tracker,
    "cuda_streams": cuda_streams,
    "current_device": current_device,
    "cuda_literals": cuda_literals,
    "cuda_type_names": cuda_type_names,
    "te_general_gemm": te_general_gemm,
    "gloo_all_to_all": gloo_all_to_all,
    "dtoh_copies": dtoh_copies,
}


@contextlib.contextmanager
def megatron_on_cpu(skip=()):
    """Enters every shim of :data:`SHIMS` (but those named in `skip`) and
    leaves them in reverse order. See the module docstring."""
    unknown = set(skip) - set(SHIMS)
    if unknown:
        raise ValueError(f"unknown shim(s) {sorted(unknown)}; known: {list(SHIMS)}")
    with contextlib.ExitStack() as stack:
        for name, shim in SHIMS.items():
            if name not in skip:
                stack.enter_context(shim())
        yield


cpu_shims = megatron_on_cpu


# ---------------------------------------------------------------- the gradient-sync wiring


def finalize_model_grads_config(config, model, optimizer=None, *, align_grad_reduce=True):
    """Wires gradient synchronisation into `config` (the model's
    TransformerConfig, which the forward-backward functions read) the way
    Megatron's own training loop does:

    - ``config.finalize_model_grads_func = finalize_model_grads``: at the end of
      ``forward_backward_func`` the data-parallel all-reduce (or the distributed
      optimizer's reduce-scatter) of the DDP grad buffers, embedding and
      layernorm grad reductions. Without it nothing reduces the gradients:
      each data-parallel rank steps with its own, and the replicas drift apart
      with no error;
    - with ``overlap_grad_reduce`` (read from each chunk's ``ddp_config``):
      ``config.no_sync_func`` (the chunks' ``no_sync``) and, with
      `align_grad_reduce` (Megatron's default), ``config.grad_sync_func`` (their
      ``start_grad_sync``);
    - with ``overlap_param_gather`` and ``align_param_gather``:
      ``config.param_sync_func`` (their ``start_param_sync``);
    - given the `optimizer`, ``config.grad_scale_func = optimizer.scale_loss``
      (the loss scale of fp16 training; 1 otherwise).

    `model` is a model chunk or a list of them (Megatron DDP modules). A single
    chunk gets single functions, several get lists, as in Megatron. Returns
    `config`.
    """
    from megatron.core.distributed import finalize_model_grads

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]

    def one_or_list(fns):
        return fns[0] if len(fns) == 1 else fns

    ddp_configs = [getattr(c, "ddp_config", None) for c in chunks]
    if any(getattr(d, "overlap_grad_reduce", False) for d in ddp_configs):
        config.no_sync_func = one_or_list([c.no_sync for c in chunks])
        if align_grad_reduce:
            config.grad_sync_func = one_or_list([c.start_grad_sync for c in chunks])
    if any(getattr(d, "overlap_param_gather", False) and getattr(d, "align_param_gather", False)
           for d in ddp_configs):
        config.param_sync_func = one_or_list([c.start_param_sync for c in chunks])
    if optimizer is not None:
        config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return config
