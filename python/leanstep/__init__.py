"""leanstep: fast, exact optimizer-step paths (gradient norm/clip/unscale,
RMSNorm, MoE token permutation) over the caller's own tensors.

Inputs are any DLPack arrays on the CPU (PyTorch tensors, NumPy arrays) and are
used zero-copy; in-place operations write into the caller's memory; results
come back in the framework of the inputs (torch in, torch out) or go into
``out=`` arrays. bf16 comes through torch tensors. Errors from the library are
raised as :class:`leanstep.Error` (a ``ValueError``) with the library's message.

Submodules: ``leanstep.torch`` (autograd-aware modules and functions) and
``leanstep.megatron`` (install the fast paths into Megatron-Core).
"""

from . import _leanstep
from ._leanstep import (Error, counters, data_ptr, describe, measure_bandwidth, num_threads,
                        reset_counters, set_num_threads)
from ._dispatch import ops, preset, set_preset
from ._registry import format_paths, paths, reset_paths
from ._arrays import (empty_cache, huge_pages, output_pool, read_scalar, set_huge_pages,
                      set_output_pool)

Error.__module__ = "leanstep"
__version__ = _leanstep.__version__

#: Areas of the C++ library compiled into this build.
areas = tuple(_leanstep.areas)

__all__ = [
    "Error",
    "areas",
    "counters",
    "data_ptr",
    "describe",
    "measure_bandwidth",
    "num_threads",
    "read_scalar",
    "reset_counters",
    "set_num_threads",
    "set_preset",
    "ops",
    "preset",
    "paths",
    "format_paths",
    "reset_paths",
    "huge_pages",
    "set_huge_pages",
    "output_pool",
    "set_output_pool",
    "empty_cache",
]

if "grad" in areas:
    from ._grad import *  # noqa: F401,F403
    from ._grad import __all__ as _grad_all

    __all__ += _grad_all
if "rmsnorm" in areas:
    from ._rmsnorm import *  # noqa: F401,F403
    from ._rmsnorm import __all__ as _rmsnorm_all

    __all__ += _rmsnorm_all
if "moe" in areas:
    from ._moe import *  # noqa: F401,F403
    from ._moe import __all__ as _moe_all

    __all__ += _moe_all
if "lora" in areas:
    from ._lora import *  # noqa: F401,F403
    from ._lora import __all__ as _lora_all

    __all__ += _lora_all
if "stats" in areas:
    from ._stats import *  # noqa: F401,F403
    from ._stats import __all__ as _stats_all

    __all__ += _stats_all


def __getattr__(name):  # leanstep.audit, leanstep.hostcost: imported on first use (no torch until used)
    if name in ("audit", "hostcost"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
