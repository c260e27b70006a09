"""Install leanstep's fast paths into the Megatron-Core you already run
(0.16 on Python 3.11, 0.17 to 0.19 on Python 3.12).

    import leanstep.megatron
    leanstep.megatron.install()      # patch in place (idempotent)
    print(leanstep.megatron.format_report())
    leanstep.set_preset("grad")      # switch families at run time (the one switch)
    leanstep.megatron.uninstall()    # restore the originals exactly

What is patched (each a "patch" with its own signature check, one variant per
supported signature, in the home module and in every loaded module that
imported it by name):

- ``optimizer.clip_grads``: ``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
  ``count_zeros_fp32`` (module :mod:`leanstep.megatron.grad`);
- ``optimizer.optimizer.MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan``:
  unscale and the non-finite check in one pass;
- ``optimizer.optimizer.MixedPrecisionOptimizer.step`` and ``ChainedOptimizer.step``:
  the sync-free step (:mod:`leanstep.megatron.step`): found_inf, the loss scale, the
  skip, the norm and the zero count stay on the device;
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
names the host reads that remain (:data:`INHERENT_READS`). Values Megatron's
API returns as Python numbers (the grad norm, the zero count, the step's
success) come back as device tensors (the norm as the same double where the
installed version returns a float), as Megatron 0.17+ returns the norm with
Transformer Engine: reading them is the caller's choice.

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
from ._patching import FAMILIES, active, installed, installed_variant, reset_call_counts
from .norm import convert_norms

__all__ = ["install", "uninstall", "report", "format_report", "installed", "installed_variant",
           "active", "reset_call_counts", "convert_norms", "PATCHES", "FAMILIES",
           "INHERENT_READS"]

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
    if names is None or {spec.name for spec in _step_patches.SPECS} & set(names):
        _step_patches.untrack_all()  # the scalers get Megatron's class back
        _step_patches.keep_results_on_device(None, False)  # and the process its default
    if not _patching.installed():
        _grad_patches.plans.clear()
    _ddp_patches.check_pending(queued)
    return report()


#: The reads of device memory a training iteration still makes with every patch
#: active, by call site, and why each stays (``leanstep.audit.DeviceMemory``
#: counts them on a CPU run; docs/megatron-cpu.md has the table per condition).
INHERENT_READS = {
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher."
    "_maybe_dtoh_and_synchronize":
        "inherent: the alltoall dispatcher copies its token counts to the host once per MoE "
        "layer and forward (non-blocking copies, one event sync): all_to_all_single's split "
        "sizes and the experts' splits are host integers that size the exchange and the "
        "outputs",
    "megatron.core.distributed.distributed_data_parallel.DistributedDataParallel."
    "finish_grad_sync":
        "only with ddp_config.check_for_nan_in_grad: one read of the combined NaN/Inf flag per "
        "model chunk and step (ddp_finish_grad_sync), where Megatron reads two per bucket; "
        "Megatron raises a Python error",
    "the training loop":
        "optimizer.step() returns what Megatron's step returns (a Python bool, and the norm "
        "and zero count as the installed version types them): one read of the flag per step "
        "(and of the norm where the installed code returns a float), the reads Megatron's own "
        "step makes, because Megatron-LM's train_step and its copies test "
        "`update_successful is True`. A loop known to take device values opts in with "
        "leanstep.megatron.step.keep_results_on_device (the main job; ms-swift's train_step "
        "with the plugin): then the step reads nothing, and whoever logs the values or steps "
        "a learning-rate schedule on update_successful reads them then",
}


def report():
    """``{"megatron_core_version", "active_families", "installed": {name: [targets]},
    "variants": {name: label}, "skipped": {name: reason}, "notes": {name: [..]},
    "host_reads": {name: why}, "inherent_reads": {site: why}, "calls": {name: {"leanstep": n,
    "paths": {"backend:device": n}, "delegated": {reason: n}}}}``; a path is the backend that
    ran (cpu, torch) and the tensors' device type. ``host_reads``: the reads a patch keeps in
    some configuration; ``inherent_reads``: :data:`INHERENT_READS`."""
    r = _patching.report(PATCHES)
    r["inherent_reads"] = dict(INHERENT_READS)
    return r


def format_report():
    """:func:`report` as readable lines."""
    lines = [_patching.format_report(PATCHES), "  reads of device memory left per iteration:"]
    lines += [f"      {site}: {why}" for site, why in INHERENT_READS.items()]
    return "\n".join(lines)
