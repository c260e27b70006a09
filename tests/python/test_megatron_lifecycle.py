"""install / uninstall across module reloads: after uninstall no leanstep
wrapper is left anywhere, a reloaded class is patched by the next install,
and the report lists only what the live objects hold."""

import importlib
import sys
import types

import pytest
import torch

mcore = pytest.importorskip("megatron.core")

import leanstep.megatron as lm  # noqa: E402
import megatron.core.optimizer.clip_grads as clip_grads  # noqa: E402
import megatron.core.optimizer.distrib_optimizer as distrib_optimizer  # noqa: E402
import megatron.core.optimizer.optimizer as optimizer  # noqa: E402
import megatron.core.transformer.moe.moe_utils  # noqa: E402,F401 - imported for its aliases
import megatron.core.transformer.torch_norm as torch_norm  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

GRAD_FUNCS = ["get_grad_norm_fp32", "clip_grad_by_total_norm_fp32", "count_zeros_fp32"]
PATCHED_NAMES = GRAD_FUNCS + ["permute", "unpermute", "sort_chunks_by_idxs", "pad_routing_map"]
UNSCALE = "_unscale_main_grads_and_check_for_nan"
UNSCALE_LABEL = f"{optimizer.__name__}.MixedPrecisionOptimizer.{UNSCALE}"
NORM_LABEL = f"{torch_norm.__name__}.WrappedTorchNorm.__new__"


def is_wrapper(obj):
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    return getattr(func, "__leanstep_original__", None) is not None


def wrapped_anywhere():
    """Every module attribute, in any loaded module, that holds a leanstep wrapper."""
    found = []
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        found += [f"{mod_name}.{n}" for n in PATCHED_NAMES if is_wrapper(namespace.get(n))]
    return sorted(found)


def unscale_patched(cls):
    return is_wrapper(cls.__dict__[UNSCALE])


def norm_patched(cls):
    return is_wrapper(cls.__dict__["__new__"])


def assert_report_matches_the_live_classes():
    installed = lm.report()["installed"]
    assert (UNSCALE_LABEL in installed.get("unscale_and_check_for_nan", [])) == \
        unscale_patched(optimizer.MixedPrecisionOptimizer)
    assert (NORM_LABEL in installed.get("WrappedTorchNorm", [])) == \
        norm_patched(torch_norm.WrappedTorchNorm)


@pytest.fixture
def restore_megatron():
    """Puts every megatron module namespace and the patched class attributes
    back as they were, whatever a test reloaded or left patched: the other
    megatron tests in this process hold references to those objects."""
    lm.uninstall()
    for spec in lm.PATCHES:  # install imports these: load them before the snapshot
        for name in spec.alias_modules:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    modules = {name: mod for name, mod in sys.modules.items()
               if name.startswith("megatron") and isinstance(getattr(mod, "__dict__", None), dict)}
    saved = {name: dict(vars(mod)) for name, mod in modules.items()}
    classes = [(optimizer.MixedPrecisionOptimizer, UNSCALE), (torch_norm.WrappedTorchNorm, "__new__")]
    saved_attrs = [(cls, attr, cls.__dict__[attr]) for cls, attr in classes]
    before = set(sys.modules)
    try:
        yield
    finally:
        lm.uninstall()
        for name, mod in modules.items():
            namespace = vars(mod)
            if namespace.keys() != saved[name].keys() or any(
                    namespace[k] is not v for k, v in saved[name].items()):
                namespace.clear()
                namespace.update(saved[name])
        for cls, attr, value in saved_attrs:
            if cls.__dict__[attr] is not value:
                setattr(cls, attr, value)
        for name in set(sys.modules) - before:
            if name.startswith("late_user_module"):
                del sys.modules[name]
    assert wrapped_anywhere() == []


def test_uninstall_after_a_home_module_reload_and_reinstall_restores_every_alias(restore_megatron):
    originals = {n: getattr(clip_grads, n) for n in GRAD_FUNCS}
    lm.install()
    importlib.reload(clip_grads)  # fresh originals in the home; the aliases keep the wrappers
    lm.install()
    for name in GRAD_FUNCS:
        assert is_wrapper(getattr(clip_grads, name)) and is_wrapper(getattr(optimizer, name))
    assert set(GRAD_FUNCS) <= set(lm.installed())
    # Idempotent after the re-apply too.
    held = {(m, n): getattr(m, n) for m in (clip_grads, optimizer) for n in GRAD_FUNCS}
    report = lm.report()["installed"]
    lm.install()
    assert all(getattr(m, n) is v for (m, n), v in held.items())
    assert lm.report()["installed"] == report

    lm.uninstall()
    assert wrapped_anywhere() == []
    assert lm.installed() == [] and lm.report()["installed"] == {}
    # Each place gets back what it held: the alias the pre-reload function,
    # the home the reloaded one.
    for name in GRAD_FUNCS:
        assert getattr(optimizer, name) is originals[name]
        assert getattr(clip_grads, name) is not originals[name]


def test_uninstall_restores_a_wrapper_taken_by_name_after_install(restore_megatron):
    original = clip_grads.get_grad_norm_fp32
    lm.install(patches=["get_grad_norm_fp32"])
    late = types.ModuleType("late_user_module")
    late.get_grad_norm_fp32 = clip_grads.get_grad_norm_fp32  # `from ... import` after install
    sys.modules["late_user_module"] = late
    lm.install(patches=["get_grad_norm_fp32"])
    assert "late_user_module.get_grad_norm_fp32" in lm.report()["installed"]["get_grad_norm_fp32"]
    lm.uninstall()
    assert late.get_grad_norm_fp32 is original
    assert wrapped_anywhere() == []


def test_aliases_are_restored_when_the_replaced_home_function_is_refused(restore_megatron):
    lm.install(patches=["count_zeros_fp32"])

    def count_zeros_fp32(parameters, group):  # a signature leanstep does not support
        return 0.0

    clip_grads.count_zeros_fp32 = count_zeros_fp32
    r = lm.install(patches=["count_zeros_fp32"])
    assert "signature mismatch" in r["skipped"]["count_zeros_fp32"]
    # The aliases still hold the wrapper: the report says so, the home is not listed.
    assert f"{optimizer.__name__}.count_zeros_fp32" in r["installed"]["count_zeros_fp32"]
    assert f"{clip_grads.__name__}.count_zeros_fp32" not in r["installed"]["count_zeros_fp32"]
    assert lm.installed() == ["count_zeros_fp32"]
    lm.uninstall()
    assert wrapped_anywhere() == []
    assert lm.installed() == []
    assert clip_grads.count_zeros_fp32 is count_zeros_fp32  # not ours: left as is


def test_install_after_reloading_the_optimizer_module_patches_the_new_class(restore_megatron):
    old = optimizer.MixedPrecisionOptimizer
    lm.install()
    importlib.reload(optimizer)
    new = optimizer.MixedPrecisionOptimizer
    assert new is not old and not unscale_patched(new)
    assert_report_matches_the_live_classes()

    lm.install()
    assert unscale_patched(new)
    # Classes defined elsewhere still derive from the pre-reload class: it stays patched.
    assert old in distrib_optimizer.DistributedOptimizer.__mro__ and unscale_patched(old)
    assert_report_matches_the_live_classes()
    report = lm.report()["installed"]
    attrs = (new.__dict__[UNSCALE], old.__dict__[UNSCALE])
    lm.install()
    assert (new.__dict__[UNSCALE], old.__dict__[UNSCALE]) == attrs
    assert lm.report()["installed"] == report

    lm.uninstall()
    assert not unscale_patched(new) and not unscale_patched(old)
    assert lm.installed() == [] and wrapped_anywhere() == []
    assert_report_matches_the_live_classes()


def test_install_after_reloading_torch_norm_patches_the_new_class(restore_megatron):
    import leanstep.torch as lt

    old = torch_norm.WrappedTorchNorm
    lm.install(patches=["WrappedTorchNorm"])
    importlib.reload(torch_norm)
    new = torch_norm.WrappedTorchNorm
    assert new is not old and not norm_patched(new)
    assert_report_matches_the_live_classes()

    lm.install(patches=["WrappedTorchNorm"])
    assert norm_patched(new) and norm_patched(old)
    assert_report_matches_the_live_classes()
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               normalization="RMSNorm")
    assert isinstance(new(config=config, hidden_size=16), lt.RMSNorm)

    lm.uninstall()
    assert not norm_patched(new) and not norm_patched(old)
    assert type(new(config=config, hidden_size=16)) is torch.nn.RMSNorm
    assert lm.installed() == []
    assert_report_matches_the_live_classes()
