"""Install leanstep's fast paths into the Megatron-Core you already run
(0.16 on Python 3.11, 0.17 to 0.19 on Python 3.12).

    import leanstep.megatron
    leanstep.megatron.install()      # patch in place (idempotent)
    print(leanstep.megatron.format_report())
    leanstep.megatron.set_active(["grad"])   # switch families at run time
    leanstep.megatron.uninstall()    # restore the originals exactly

What is patched (each a "patch" with its own signature check, one variant per
supported signature, in the home module and in every loaded module that
imported it by name):

- ``optimizer.clip_grads``: ``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
  ``count_zeros_fp32`` (module :mod:`leanstep.megatron.grad`);
- ``optimizer.optimizer.MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan``:
  unscale and the non-finite check in one pass;
- ``distributed``: ``_ParamAndGradBucketGroup.check_grads`` and
  ``DistributedDataParallel.finish_grad_sync``: the DDP NaN/Inf grad check with
  one host read per gradient sync (:mod:`leanstep.megatron.ddp`);
- ``transformer.moe.moe_utils``: ``permute``, ``unpermute``, ``sort_chunks_by_idxs``,
  ``pad_routing_map`` (:mod:`leanstep.megatron.moe`);
- ``transformer.torch_norm.WrappedTorchNorm.__new__``: RMSNorm modules become
  :class:`leanstep.torch.RMSNorm` sharing the same weight (:mod:`leanstep.megatron.norm`).

Tensors on the CPU run the C++ kernels; tensors on CUDA, NPU, XPU (any
device this torch build runs) the torch-op backend, which never reads a
device value on the host. Calls leanstep does not run (tensor subclasses
such as DTensor, Transformer Engine ``fused=True`` paths, Megatron-FSDP
params, unsupported dtypes) go to the original function; :func:`report`
counts calls per path, backend and device, and per delegation reason, and
names the host reads that remain because Megatron's API returns a Python
number or branches on a Python bool.

Collectives: when ``torch.distributed`` is initialised, the same all-reduces
as the original run on the same groups. Without an initialised process group
a single process is assumed (the originals would raise).
"""

from . import _patching
from . import ddp as _ddp_patches
from . import grad as _grad_patches
from . import moe as _moe_patches
from . import norm as _norm_patches
from . import step as _step_patches
from ._patching import FAMILIES, active, installed, installed_variant, reset_call_counts, set_active
from .norm import convert_norms

__all__ = ["install", "uninstall", "report", "format_report", "installed", "installed_variant",
           "set_active", "active", "reset_call_counts", "convert_norms", "PATCHES", "FAMILIES"]

#: Every patch, in install order.
PATCHES = (_grad_patches.SPECS + _step_patches.SPECS + _ddp_patches.SPECS + _moe_patches.SPECS
           + _norm_patches.SPECS)


def install(patches=None):
    """Applies the patches (all, or those named in `patches`; an unknown name
    is an error). Returns :func:`report`. Safe to call again: an installed
    patch is left as it is, modules loaded since then that imported the
    original by name are patched as well, and a target that no longer holds
    the replacement (its module was reloaded) is patched anew."""
    _moe_patches._cpu_kernels_enabled()  # LEANSTEP_MEGATRON_MOE_CPU: read (and checked) once
    _patching.install(PATCHES, patches)
    return report()


def uninstall(patches=None):
    """Restores the original objects wherever a patch set its replacement and
    it is still there; a target that another patch replaced after install is
    left as it is (and the report says so). Returns :func:`report`. DDP grad
    checks still queued are read after the restore (and raise Megatron's
    error for a NaN or Inf norm): uninstall never drops one."""
    names = _patching.check_names(patches, PATCHES, "uninstall")
    ddp_names = {spec.name for spec in _ddp_patches.SPECS}
    queued = _ddp_patches.take_pending() if names is None or ddp_names & set(names) else []
    _patching.uninstall(PATCHES, patches)
    if not _patching.installed():
        _grad_patches.plans.clear()
    _ddp_patches.check_pending(queued)
    return report()


def report():
    """``{"megatron_core_version", "active_families", "installed": {name: [targets]},
    "variants": {name: label}, "skipped": {name: reason}, "notes": {name: [..]},
    "host_reads": {name: why}, "calls": {name: {"leanstep": n, "paths": {"backend:device": n},
    "delegated": {reason: n}}}}``; a path is the backend that ran (cpu, torch) and the
    tensors' device type."""
    return _patching.report(PATCHES)


def format_report():
    """:func:`report` as readable lines."""
    return _patching.format_report(PATCHES)
