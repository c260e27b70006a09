"""Set-up shared by the Triton test modules (tests/python/test_triton_*.py).

Triton's interpreter must be chosen before triton is first imported
(TRITON_INTERPRET=1). A test module calls :func:`load` at import: when
triton is not imported yet, it sets the variable only around that first
import; when something else in this process imported triton for a device
(megatron-core does), the module's tests skip and
``test_in_a_fresh_interpreter_process`` reruns the module in a fresh
process. ``LEANSTEP_TEST_DEVICE=cuda`` (scripts/gpu-check.sh) runs the same
tests with compiled kernels on that device, the C++ side on CPU copies.
"""

import importlib
import os
import subprocess
import sys
import types

import pytest
import torch

import leanstep
from leanstep import _backend


def triton_state():
    """How this process imported triton: "absent", "interpreted" or "compiled"."""
    if "triton" not in sys.modules:
        return "absent"
    try:
        import triton.language.standard as standard
        from triton.runtime.interpreter import InterpretedFunction

        return "interpreted" if isinstance(standard.zeros, InterpretedFunction) else "compiled"
    except Exception:  # noqa: BLE001
        return "compiled"


def load(*backend_modules):
    """Imports triton and ``leanstep.backends.<name>`` for each name as the
    calling test module can use them. Returns a namespace: device, native,
    in_process, triton, and the modules by name (None when not importable here)."""
    device = torch.device(os.environ.get("LEANSTEP_TEST_DEVICE", "cpu"))
    native = device.type != "cpu"
    in_process = native or triton_state() != "compiled"
    modules = dict.fromkeys(backend_modules)

    def import_all():
        for name in backend_modules:
            modules[name] = importlib.import_module(f"leanstep.backends.{name}")

    triton = None
    if native:
        triton = pytest.importorskip("triton")
        import_all()
        why = _backend.triton_unusable(device)
        if why is not None:
            pytest.skip(f"Triton cannot run {device}: {why}", allow_module_level=True)
    elif in_process:
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            triton = pytest.importorskip("triton")
            import_all()
        finally:
            if previous is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = previous
        in_process = importlib.import_module("leanstep.backends.triton_common").INTERPRETED
    else:
        triton = pytest.importorskip("triton")
    return types.SimpleNamespace(device=device, native=native, in_process=in_process,
                                 triton=triton, modules=modules)


def interpreter_fixture(setup):
    """The module's autouse fixture: skip in a process whose triton is compiled
    (the fresh-process test covers it); TRITON_INTERPRET=1 during each test."""

    @pytest.fixture(autouse=True)
    def _interpreter(request, monkeypatch):
        if request.node.name == "test_in_a_fresh_interpreter_process":
            return
        if not setup.in_process:
            pytest.skip("triton was imported for a device: "
                        "test_in_a_fresh_interpreter_process runs this module")
        if not setup.native:
            monkeypatch.setenv("TRITON_INTERPRET", "1")

    return _interpreter


def fresh_process_test(test_file, setup):
    """The test that reruns `test_file` in a fresh interpreter process."""

    def test_in_a_fresh_interpreter_process():
        if setup.in_process:
            pytest.skip("the tests run in this process")
        try:
            from conftest import SEED
        except ImportError:
            SEED = os.environ.get("LEANSTEP_TEST_SEED", "0")
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(leanstep.__file__)))
        env = dict(os.environ, TRITON_INTERPRET="1", LEANSTEP_TEST_SEED=str(SEED))
        env["PYTHONPATH"] = os.pathsep.join([package_root]
                                            + [p for p in [env.get("PYTHONPATH")] if p])
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              os.path.abspath(test_file)], env=env, capture_output=True,
                             text=True, timeout=600, cwd=os.path.dirname(os.path.abspath(test_file)))
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
        print(run.stdout.strip().splitlines()[-1])

    return test_in_a_fresh_interpreter_process
