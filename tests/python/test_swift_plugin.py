"""leanstep.megatron.swift against the REAL ms-swift in the environment
(requirements-dev.txt pins ms-swift[megatron]): the plugin file loaded by
ms-swift's own --external_plugins loader, registration in
megatron_callbacks_map (idempotent), the callback built and driven the way
ms-swift's Megatron trainer does it (patches installed at on_train_begin, the
report logged at the beginning and the end), the error without ms-swift, and
ms-swift's bare KeyError for an unknown callback name."""

import importlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import pathlib
import subprocess
import sys
import types
import warnings

import pytest

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
pytest.importorskip("torch", reason="torch is not installed (leanstep.megatron needs it)")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

import torch  # noqa: E402

from helpers import UndoImportPatches  # noqa: E402

import leanstep  # noqa: E402
import leanstep.megatron as lm  # noqa: E402
import leanstep.megatron.swift as ls  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "swift" / "leanstep_plugin.py"
PYTHON_DIR = pathlib.Path(leanstep.__file__).resolve().parents[1]

# Megatron-Core modules that ms-swift's import chain loads and that would record
# Transformer Engine as present (HAVE_TE = True, or a module global bound to the
# placeholder) if first imported while the placeholder below is in sys.modules.
# They are imported before it; the fixture checks that no other module did so.
PRE_IMPORT = [
    "megatron.core.extensions.transformer_engine",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.multi_token_prediction",
    "megatron.core.ssm.mamba_context_parallel",
]


def _missing(module, package):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed (requirements-dev.txt pins ms-swift[megatron], "
                    f"which brings it)", allow_module_level=True)


_missing("swift", "ms-swift")
_missing("mcore_bridge", "mcore-bridge")


@pytest.fixture(scope="module")
def swift_callbacks():
    """ms-swift's ``swift.megatron.callbacks`` module, imported for real.

    Without Transformer Engine, ms-swift's callbacks do not import:
    swift.megatron.callbacks -> print.py -> mcore_bridge, whose import-time
    patcher does ``import transformer_engine`` and patches
    ``TEGroupedLinear`` (None in Megatron-Core without TE). TEST-ONLY
    WORKAROUND: for the duration of that one import, a placeholder
    ``transformer_engine`` module (an empty module with a spec, so
    ``find_spec`` works) is put into sys.modules and Megatron's
    ``TEGroupedLinear`` is set to an empty placeholder class, both through
    monkeypatch and both undone as soon as the import is done. Megatron-Core
    is imported first (and the modules in PRE_IMPORT) so that it records TE as
    absent; no product code ever sees the placeholder."""
    for name in ["megatron.core", *PRE_IMPORT]:
        importlib.import_module(name)
    with UndoImportPatches():
        yield from _swift_megatron_callbacks()


def _swift_megatron_callbacks():
    if importlib.util.find_spec("transformer_engine") is not None:  # a real TE: no placeholder
        try:
            yield importlib.import_module("swift.megatron.callbacks")
        except ImportError as e:
            pytest.skip(f"ms-swift's Megatron callbacks do not import: missing package "
                        f"{e.name or e!s} ({e})")
        return
    te_ext = sys.modules["megatron.core.extensions.transformer_engine"]
    placeholder = types.ModuleType("transformer_engine")
    placeholder.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    grouped = type("TEGroupedLinearPlaceholder", (), {})
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "transformer_engine", placeholder)
        if getattr(te_ext, "TEGroupedLinear", None) is None:
            mp.setattr(te_ext, "TEGroupedLinear", grouped)
        try:
            callbacks = importlib.import_module("swift.megatron.callbacks")
        except ImportError as e:
            pytest.skip(f"ms-swift's Megatron callbacks do not import on this machine even with "
                        f"a placeholder transformer_engine module: missing package "
                        f"{e.name or e!s} ({e})")
    # peft caches "is transformer_engine importable" (it saw the placeholder).
    peft_utils = sys.modules.get("peft.import_utils")
    for fn in ("is_te_available", "is_te_pytorch_available"):
        if hasattr(getattr(peft_utils, fn, None), "cache_clear"):
            getattr(peft_utils, fn).cache_clear()
    leaked = []
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron.") or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is placeholder or value is grouped:
                leaked.append(f"{name}.{attr}")
        if name not in before and vars(mod).get("HAVE_TE") is True:
            leaked.append(f"{name}.HAVE_TE")
    if leaked:
        pytest.fail("Megatron-Core modules first imported under the placeholder recorded "
                    f"Transformer Engine as present: {leaked}; add them to PRE_IMPORT")
    yield callbacks


@pytest.fixture
def clean_patches():
    """leanstep uninstalled (and call counts reset) before and after the test."""
    was = lm.installed()
    if was:
        pytest.skip("leanstep.megatron is already installed in this process")
    lm.reset_call_counts()
    yield
    lm.uninstall()
    lm.reset_call_counts()
    assert not lm.installed()


@pytest.fixture
def external_loader(swift_callbacks, monkeypatch):
    """ms-swift's own loader for --external_plugins
    (BaseArguments._import_external_plugins -> swift.utils.import_external_file)
    with its process-wide side effects undone afterwards: the plugin's folder on
    sys.path, the record of plugin files, the DataLoader.__init__ wrapper it
    installs for worker processes, and the cached plugin module."""
    from torch.utils.data import DataLoader

    from swift.arguments.base_args.base_args import BaseArguments
    import swift.utils.utils as swift_utils

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(swift_utils, "_external_files", list(swift_utils._external_files))
    monkeypatch.setattr(DataLoader, "__init__", DataLoader.__init__)
    monkeypatch.setattr(DataLoader, "_swift_external_plugins",
                        getattr(DataLoader, "_swift_external_plugins", False), raising=False)
    cached = [m for m in sys.modules if m.startswith("_swift_external_")]
    had = dict(swift_callbacks.megatron_callbacks_map)

    def load(*paths):
        args = types.SimpleNamespace(external_plugins=[str(p) for p in paths],
                                     custom_register_path=[])
        BaseArguments._import_external_plugins(args)

    yield load
    for m in [m for m in sys.modules if m.startswith("_swift_external_") and m not in cached]:
        del sys.modules[m]
    swift_callbacks.megatron_callbacks_map.clear()
    swift_callbacks.megatron_callbacks_map.update(had)


@pytest.fixture
def swift_log():
    """Records of the logger the callback writes to (ms-swift's 'swift'
    logger, which does not propagate to the root logger)."""
    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = ls._logger()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _leanstep_messages(records):
    return [m for m in (r.getMessage() for r in records) if m.startswith("leanstep:")]


def test_plugin_file_through_swift_loader(swift_callbacks, external_loader, clean_patches):
    mapping = swift_callbacks.megatron_callbacks_map
    mapping.pop(ls.NAME, None)
    defaults = sorted(mapping)
    external_loader(PLUGIN)
    cls = mapping[ls.NAME]
    assert cls is ls.callback_class()
    assert issubclass(cls, swift_callbacks.MegatronCallback)
    assert ls.registered()
    assert sorted(mapping) == sorted(defaults + [ls.NAME])  # the defaults are untouched
    assert not lm.installed()  # loading the plugin patches nothing

    # Twice through the loader (ms-swift returns its cached module), register()
    # again, and the plugin file executed afresh: one entry, the same class.
    external_loader(PLUGIN)
    assert ls.register() is cls
    for m in [m for m in sys.modules if m.startswith("_swift_external_")]:
        del sys.modules[m]
    external_loader(PLUGIN)
    assert mapping[ls.NAME] is cls
    assert sorted(mapping) == sorted(defaults + [ls.NAME])
    assert not lm.installed()


def test_register_refuses_a_foreign_entry(swift_callbacks, monkeypatch):
    other = type("OtherCallback", (swift_callbacks.MegatronCallback,), {})
    monkeypatch.setitem(swift_callbacks.megatron_callbacks_map, ls.NAME, other)
    with pytest.raises(ValueError, match="already holds"):
        ls.register()
    assert swift_callbacks.megatron_callbacks_map[ls.NAME] is other
    assert not ls.registered()


def _trainer(tmp_path, callbacks):
    """What ms-swift's callbacks read from the trainer: args (the parsed
    MegatronSftArguments) and state (TrainerState)."""
    args = types.SimpleNamespace(callbacks=callbacks, train_iters=1, output_dir=str(tmp_path),
                                 manual_gc=False, manual_gc_steps=0, manual_gc_eval=True,
                                 global_batch_size=1, logging_steps=1, eval_steps=None,
                                 eval_iters=0, save_steps=None)
    state = types.SimpleNamespace(iteration=0, consumed_train_samples=0, should_log=False,
                                  should_eval=False, should_save=False)
    return types.SimpleNamespace(args=args, state=state)


def _build_callbacks(mapping, trainer):
    # BaseMegatronTrainer.__init__ (swift/megatron/trainers/base.py), verbatim but
    # for `self`. The trainer module itself does not import here: it pulls in
    # mcore_bridge.model, which needs transformer_engine.pytorch.
    trainer.callbacks = []
    for callback in trainer.args.callbacks:
        trainer.callbacks.append(mapping[callback](trainer))


def _call_event(trainer, event, **kwargs):
    # BaseMegatronTrainer.call_event, verbatim but for `self`.
    for callback in trainer.callbacks:
        getattr(callback, event)(**kwargs)


def test_callback_installs_at_train_begin_and_logs(swift_callbacks, external_loader,
                                                   clean_patches, swift_log, tmp_path):
    external_loader(PLUGIN)
    mapping = swift_callbacks.megatron_callbacks_map
    # --callbacks leanstep; MegatronArguments.__post_init__ appends the
    # defaults ('print', 'default_flow') after the user's callbacks.
    trainer = _trainer(tmp_path, ["leanstep", "print", "default_flow"])
    _build_callbacks(mapping, trainer)
    cb = trainer.callbacks[0]
    assert type(cb) is ls.callback_class()
    assert isinstance(cb, swift_callbacks.MegatronCallback)
    assert cb.trainer is trainer and cb.args is trainer.args and cb.state is trainer.state
    assert not lm.installed()  # constructing the callback patches nothing

    _call_event(trainer, "on_train_begin")
    assert lm.installed()
    assert set(lm.report()["installed"]) == ({s.name for s in lm.PATCHES + ls.SPECS}
                                             - set(lm.report()["skipped"]))
    assert {"swift_logical_and", "swift_reduce_max_stat"} <= set(lm.installed())
    import megatron.core.optimizer.optimizer as optimizer
    begin = _leanstep_messages(swift_log)
    assert len(begin) == 1 and "installed at train begin" in begin[0]
    assert "leanstep.megatron on megatron-core" in begin[0]
    assert "installed get_grad_norm_fp32" in begin[0]

    # One "step": the optimizer module's own alias now runs leanstep.
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(1)), torch.ones(3)]
    expected = float(torch.linalg.vector_norm(torch.cat(grads)))
    assert optimizer.get_grad_norm_fp32(grads) == pytest.approx(expected, rel=1e-6)
    assert lm.report()["calls"]["get_grad_norm_fp32"]["leanstep"] == 1

    # A second on_train_begin (a second trainer in the process) changes nothing.
    installed = lm.report()["installed"]
    cb.on_train_begin()
    assert lm.report()["installed"] == installed

    del swift_log[:]
    _call_event(trainer, "on_step_end")  # the defaults run alongside
    assert trainer.state.consumed_train_samples == 1
    _call_event(trainer, "on_train_end")
    end = _leanstep_messages(swift_log)
    assert len(end) == 1 and "report at train end" in end[0]
    assert "calls: leanstep cpu:cpu 1" in end[0]  # the call counts of the run
    assert lm.installed()  # the patches stay until the process ends (or uninstall())


def test_unknown_callback_name_is_a_bare_key_error(swift_callbacks, monkeypatch, tmp_path):
    """ms-swift looks --callbacks names up in a plain dict: an unknown name (a
    typo, or --callbacks leanstep without the --external_plugins file) is a
    bare KeyError carrying only the name."""
    monkeypatch.delitem(swift_callbacks.megatron_callbacks_map, ls.NAME, raising=False)
    for name in ("leanstep", "lean_step"):
        with pytest.raises(KeyError) as e:
            _build_callbacks(swift_callbacks.megatron_callbacks_map, _trainer(tmp_path, [name]))
        assert e.value.args == (name,)


SUBPROCESS = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import leanstep.megatron.swift as s
out = {"swift_loaded_by_import": any(m == "swift" or m.startswith("swift.") for m in sys.modules)}
sys.modules["swift"] = None          # ms-swift absent
try:
    s.register()
except ImportError as e:
    out["absent"] = [str(e), e.name]
out["registered_absent"] = s.registered()
del sys.modules["swift"]             # the real ms-swift, no placeholder
try:
    s.register()
    out["real"] = ["registered", None]
except ImportError as e:
    out["real"] = [str(e), e.name]
print(json.dumps(out))
"""


def test_import_is_lazy_and_errors_name_the_missing_package():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PYTHON_DIR)] + [p for p in
                                        env.get("PYTHONPATH", "").split(os.pathsep) if p])
    run = subprocess.run([sys.executable, "-c", SUBPROCESS], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["swift_loaded_by_import"] is False  # importing leanstep.megatron.swift loads no ms-swift
    msg, name = out["absent"]
    assert "ms-swift is not installed" in msg and "ms-swift[megatron]" in msg
    assert out["registered_absent"] is False
    if importlib.util.find_spec("transformer_engine") is None:
        # This machine: ms-swift's Megatron callbacks need transformer_engine.
        msg, name = out["real"]
        assert name == "transformer_engine", msg
        assert "missing package 'transformer_engine'" in msg and "swift.megatron.callbacks" in msg
    else:
        assert out["real"] == ["registered", None]


def test_train_step_reductions_stay_on_the_device(swift_callbacks, clean_patches):
    """ms-swift's train_step reduces the step's flag and norm across the
    model-parallel group and reads both back; with the plugin they stay on the
    device, with ms-swift's values."""
    from megatron.core import parallel_state

    from helpers import one_rank_gloo
    from leanstep.megatron.step import DeviceBool

    parallel_utils = importlib.import_module(ls.PARALLEL_UTILS)
    logical_and = parallel_utils.logical_and_across_model_parallel_group
    reduce_max = parallel_utils.reduce_max_stat_across_model_parallel_group
    with one_rank_gloo():
        if parallel_state.model_parallel_is_initialized():  # left by another module
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 1)
        try:
            import leanstep.megatron.cpu as mcpu

            with mcpu.megatron_on_cpu():
                ls.install_train_step_patches()
                ls.install_train_step_patches()  # idempotent
                assert parallel_utils.logical_and_across_model_parallel_group is not logical_and
                norm = torch.tensor(2.5, dtype=torch.float64)
                with leanstep.audit() as a:
                    ok = parallel_utils.logical_and_across_model_parallel_group(
                        DeviceBool(torch.tensor(True)))
                    bad = parallel_utils.logical_and_across_model_parallel_group(False)
                    reduced = parallel_utils.reduce_max_stat_across_model_parallel_group(norm)
                assert a.num_host_reads == 0 and a.num_syncs == 0, a.format_table()
                assert isinstance(ok, DeviceBool) and bool(ok) is logical_and(True) is True
                assert bool(bad) is logical_and(False) is False
                assert reduced.shape == (1,) and reduced.dtype == torch.float32
                assert reduced.item() == reduce_max(float(norm)) == 2.5
                # A host number (ms-swift's memory statistic) goes to ms-swift's own code.
                assert parallel_utils.reduce_max_stat_across_model_parallel_group(1.25) == 1.25
                calls = lm.report()["calls"]
                assert calls["swift_reduce_max_stat"]["delegated"] == {"host_value": 1}
                assert calls["swift_logical_and"]["leanstep"] == 2
                assert "learning-rate schedule" in ls.HOST_READS["swift_logical_and"]
        finally:
            parallel_state.destroy_model_parallel()
