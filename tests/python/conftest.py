"""Shared fixtures: fresh random seeds per run (printed, replay with
LEANSTEP_TEST_SEED), as in the C++ tests."""

import os
import random
import sys

import numpy as np
import pytest

try:
    import torch
except ImportError:  # the core package works without torch
    torch = None


def _session_seed():
    env = os.environ.get("LEANSTEP_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


SEED = _session_seed()


def pytest_report_header(config):
    import sys

    lines = [f"leanstep test seed: {SEED} (replay with LEANSTEP_TEST_SEED={SEED})"]
    try:
        from importlib.metadata import version

        lines.append(f"Python {sys.version.split()[0]}, torch {version('torch')}, "
                     f"megatron-core {version('megatron-core')}")
    except Exception as e:  # noqa: BLE001 - a header, never a failure
        lines.append(f"Python {sys.version.split()[0]} (versions unknown: {e})")
    return lines


@pytest.fixture
def rng(request):
    # One stream per test, derived from the session seed and the test's name,
    # so a failing test replays alone with the same numbers.
    salt = sum(request.node.nodeid.encode()) * 7919
    seed = (SEED + salt) % 2**31
    request.node.user_properties.append(("seed", SEED))
    return np.random.default_rng(seed)


@pytest.fixture
def torch_gen(rng):
    if torch is None:
        pytest.skip("torch is not installed")
    g = torch.Generator()
    g.manual_seed(int(rng.integers(2**31)))
    return g


def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        item.add_report_section("call", "seed", f"LEANSTEP_TEST_SEED={SEED}")


@pytest.fixture(autouse=True)
def _moe_cpu_kernels(request, monkeypatch):
    """The Megatron MoE patches hand CPU unpermutes and chunk sorts back to Megatron
    by default (leanstep.megatron.moe.cpu_kernels); the tests run leanstep's kernels through
    them, in this process and in the workers it starts, unless a test is marked
    ``moe_cpu_default``."""
    if request.node.get_closest_marker("moe_cpu_default") is None:
        monkeypatch.setenv("LEANSTEP_MEGATRON_MOE_CPU", "leanstep")
    else:
        monkeypatch.delenv("LEANSTEP_MEGATRON_MOE_CPU", raising=False)
    # The patches read the environment once: have them read it again.
    _forget_moe_cpu_setting()
    yield
    _forget_moe_cpu_setting()


def _forget_moe_cpu_setting():
    moe = sys.modules.get("leanstep.megatron.moe")
    if moe is not None:
        moe._cpu_kernels = None


def pytest_configure(config):
    config.addinivalue_line("markers", "moe_cpu_default: run with the MoE patches' CPU default "
                                       "(leanstep's permute, Megatron's unpermute)")
