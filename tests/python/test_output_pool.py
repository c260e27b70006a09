"""The output pool for fresh torch CPU outputs (leanstep.output_pool): a block
is handed out again only once nothing can read or write its previous output
(views, NumPy arrays, DLPack exports, autograd's saved tensors all keep it
taken); outputs are ordinary tensors (not views); the cap bounds the memory;
results are identical with the pool and huge pages on and off; a caller's
out= array is never taken from the pool."""

import gc
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import leanstep
import leanstep.torch as lt

MIB = 1 << 20


def held_by_others():
    """Bytes of pool blocks still taken by arrays of earlier tests (collected first)."""
    gc.collect()
    leanstep.empty_cache()
    return leanstep.output_pool()["cached_bytes"]


@pytest.fixture
def pool():
    """The pool on, empty of free blocks, with 64 MiB of room beside whatever
    earlier tests' live arrays still hold (the cap counts taken blocks too)."""
    others = held_by_others()
    previous = leanstep.set_output_pool(True, others + 64 * MIB)
    yield others
    leanstep.set_output_pool(*previous)
    leanstep.empty_cache()


def norm(x):
    return leanstep.rms_norm(x, torch.ones(x.shape[-1]), 1e-6)[0]


def test_a_block_is_reused_only_once_its_output_is_gone(pool):
    x = torch.randn(1024, 1024)  # 4 MiB outputs
    first = norm(x)
    address = first.data_ptr()
    second = norm(x)
    assert second.data_ptr() != address  # first is alive: its block is taken
    del first
    gc.collect()
    info = leanstep.output_pool()
    third = norm(x)
    assert third.data_ptr() == address and leanstep.output_pool()["hits"] == info["hits"] + 1
    assert torch.equal(third, second)


@pytest.mark.parametrize("holder", ["view", "numpy", "dlpack", "storage", "saved_for_backward"])
def test_anything_that_can_reach_the_memory_keeps_the_block(pool, holder):
    x = torch.randn(1024, 1024)
    if holder == "saved_for_backward":
        xg = x.clone().requires_grad_()
        weight = torch.nn.Parameter(torch.ones(1024))
        out = lt.rms_norm(xg, weight)  # its backward keeps x and the output's rstd
        y = out * 2.0  # saves nothing of out itself...
        z = out.square()  # ...this saves out
        address = out.data_ptr()
        kept = z
        del out, y
    else:
        out = norm(x)
        address = out.data_ptr()
        kept = {"view": lambda: out[3:].view(-1),
                "numpy": lambda: out.numpy(),
                "dlpack": lambda: np.from_dlpack(out),
                "storage": lambda: out.untyped_storage()}[holder]()
        expected = out.clone()
        del out
    gc.collect()
    for _ in range(3):
        fresh = norm(x)
        assert fresh.data_ptr() != address
        fresh.fill_(7.0)  # writes into whatever block it got
    if holder != "saved_for_backward":
        back = {"view": lambda k: k, "numpy": torch.from_numpy, "dlpack": torch.from_numpy,
                "storage": lambda k: torch.empty(0).set_(k, 0, (1024, 1024))}[holder](kept)
        assert torch.equal(back.reshape(-1)[:16], expected.reshape(-1)[(3 * 1024 if holder ==
                                                                         "view" else 0):][:16])
    del kept
    gc.collect()


def test_outputs_are_plain_tensors_for_in_place_and_autograd(pool):
    x = torch.randn(1024, 1024, requires_grad=True)
    weight = torch.nn.Parameter(torch.ones(1024))
    y = lt.rms_norm(x, weight)
    assert not y._is_view() and y.is_contiguous() and y.shape == (1024, 1024)
    y.add_(1.0)  # in place on a custom Function's output: as for torch.empty outputs
    y.sum().backward()
    assert x.grad is not None and weight.grad is not None


def test_the_cap_bounds_the_memory_and_empty_cache_releases(pool):
    others = pool
    leanstep.set_output_pool(True, others + 8 * MIB)
    x = torch.randn(1024, 1024)
    alive = [norm(x) for _ in range(4)]  # 4 MiB each: two fit under the cap
    info = leanstep.output_pool()
    assert info["cached_bytes"] <= others + 8 * MIB and info["over_cap"] >= 2
    del alive
    gc.collect()
    for size in (600, 1100, 1500, 2047):  # varied sizes: the pool stays under its cap
        norm(torch.randn(size, 1024))
        assert leanstep.output_pool()["cached_bytes"] <= others + 8 * MIB
    assert leanstep.empty_cache() > 0 and leanstep.output_pool()["cached_bytes"] == others
    leanstep.set_output_pool(False)
    before = leanstep.output_pool()
    norm(x)
    after = leanstep.output_pool()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    assert after["free_bytes"] == 0


def test_small_outputs_are_not_pooled_and_numpy_outputs_are(pool):
    before = leanstep.output_pool()
    norm(torch.randn(8, 16))
    assert leanstep.output_pool()["misses"] == before["misses"]
    y, _ = leanstep.rms_norm(np.random.rand(1024, 1024).astype(np.float32),
                             np.ones(1024, np.float32), 1e-6)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (1024, 1024)
    assert leanstep.output_pool()["misses"] == before["misses"] + 1
    address = y.ctypes.data
    del y
    gc.collect()
    again, _ = leanstep.rms_norm(np.ones((1024, 1024), np.float32), np.ones(1024, np.float32),
                                 1e-6)
    assert again.ctypes.data == address and np.allclose(again, 1.0, rtol=1e-6)


def test_new_blocks_and_unpooled_outputs_are_advised_small_ones_never(pool):
    info = leanstep.huge_pages()
    if info["thp_mode"] not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {info['thp_mode']!r} here: nothing to advise")
    if info["huge_page_bytes"] != 2 << 20:  # the sizes below are written for 2 MiB huge pages
        pytest.skip(f"huge pages are {info['huge_page_bytes']} bytes here, not 2 MiB")
    previous = leanstep.set_huge_pages(True)
    try:
        before = leanstep.huge_pages()["advised_bytes"]
        norm(torch.randn(8, 16))  # far below 2 MiB
        assert leanstep.huge_pages()["advised_bytes"] == before
        kept = norm(torch.randn(1024, 2048))  # 8 MiB: a new pool block
        assert leanstep.huge_pages()["advised_bytes"] == before + (8 << 20)
        leanstep.set_output_pool(False)
        unpooled = norm(torch.randn(1024, 2048))  # torch.empty, then its aligned part
        middle = leanstep.huge_pages()["advised_bytes"]
        assert middle >= before + (8 << 20) + (6 << 20)
        leanstep.set_huge_pages(False)
        norm(torch.randn(1024, 2048))
        assert leanstep.huge_pages()["advised_bytes"] == middle
        del kept, unpooled
    finally:
        leanstep.set_huge_pages(previous)


def test_results_identical_with_pool_and_huge_pages_on_and_off(pool, torch_gen):
    x = torch.randn(700, 2048, generator=torch_gen)  # 5.5 MiB outputs
    w = torch.rand(2048, generator=torch_gen) + 0.5
    routing_map = torch.rand(700, 16, generator=torch_gen) < 0.25
    results = []
    previous = leanstep.set_huge_pages(True)
    try:
        for pooled, huge in ((True, True), (True, False), (False, True), (False, False)):
            leanstep.set_output_pool(pooled)
            leanstep.set_huge_pages(huge)
            for _ in range(2):  # the second round reuses the first round's blocks
                y, rstd = leanstep.rms_norm(x, w, 1e-6)
                permuted, _, idx = leanstep.moe_permute(x, routing_map)
                back = leanstep.moe_unpermute(permuted, idx, x.shape)
                results.append((y, rstd, permuted, idx, back))
    finally:
        leanstep.set_huge_pages(previous)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_a_callers_out_array_is_never_pooled_advised_or_reallocated(pool):
    x = torch.randn(1024, 2048)
    out = torch.empty_like(x)
    rstd = torch.empty(1024)
    address = out.data_ptr()
    pool_before, huge_before = leanstep.output_pool(), leanstep.huge_pages()["advised_bytes"]
    y, r = leanstep.rms_norm(x, torch.ones(2048), 1e-6, out=out, rstd_out=rstd)
    assert y is out and y.data_ptr() == address and r is rstd
    pool_after = leanstep.output_pool()
    assert (pool_after["hits"], pool_after["misses"]) == (pool_before["hits"],
                                                          pool_before["misses"])
    assert leanstep.huge_pages()["advised_bytes"] == huge_before


@pytest.mark.parametrize("cap", [-1, 2**63, 2**64, True, 1.5, "1"])
def test_bad_caps_name_the_argument(cap):
    before = leanstep.output_pool()
    with pytest.raises(leanstep.Error, match=r"argument 'cap_bytes' must be an int in \[0, 2\^63 - 1\]"):
        leanstep.set_output_pool(True, cap)
    assert leanstep.output_pool()["cap_bytes"] == before["cap_bytes"]  # nothing was changed


@pytest.mark.parametrize("enabled", ["off", 1, 0])
def test_enabled_must_be_a_bool(enabled):
    with pytest.raises(leanstep.Error, match="argument 'enabled' must be True, False or None"):
        leanstep.set_output_pool(enabled)


@pytest.mark.parametrize("value", ["lots", "1", "-5", "18000000000000", "1.5"])
def test_bad_environment_names_the_rule(monkeypatch, value):
    from leanstep import _arrays

    monkeypatch.setenv("LEANSTEP_OUTPUT_POOL", value)
    least = leanstep.huge_pages()["block_bytes"] >> 20  # one block
    with pytest.raises(leanstep.Error, match="LEANSTEP_OUTPUT_POOL must be 'on' .* or a cap in MiB "
                                             f"from {least} to .*got '{re.escape(value)}'"):
        _arrays._parse_pool_env()


def test_environment_values(monkeypatch):
    from leanstep import _arrays

    for value, expected in [("off", False), ("0", False), ("on", True), ("", True)]:
        monkeypatch.setenv("LEANSTEP_OUTPUT_POOL", value)
        assert _arrays._parse_pool_env()[0] is expected
    monkeypatch.setenv("LEANSTEP_OUTPUT_POOL", "256")
    assert _arrays._parse_pool_env() == (True, 256 * MIB)
    monkeypatch.setenv("LEANSTEP_OUTPUT_POOL", str(_arrays.MAX_POOL_CAP >> 20))
    assert _arrays._parse_pool_env() == (True, (_arrays.MAX_POOL_CAP >> 20) << 20)


def test_import_with_a_too_large_cap_says_why():
    # A cap past 2^63 bytes failed inside the binding with a signature error at import.
    env = dict(os.environ, LEANSTEP_OUTPUT_POOL="18000000000000")
    proc = subprocess.run([sys.executable, "-c", "import leanstep"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "LEANSTEP_OUTPUT_POOL must be 'on'" in proc.stderr, proc.stderr


def test_page_sizes_come_from_the_system():
    info = leanstep.huge_pages()
    assert info["page_bytes"] == os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            pmd = int(f.read())
    except OSError:
        pmd = 0
    assert info["huge_page_bytes"] == pmd
    # The pooled-block unit: the huge page up to 32 MiB, else 2 MiB (a 64 KiB-page
    # arm64 kernel's 512 MiB huge page would make every output a 512 MiB block).
    expected = pmd if 0 < pmd <= 32 << 20 else max(info["page_bytes"], 2 << 20)
    assert info["block_bytes"] == expected
    if pmd == 0:
        assert info["thp_mode"] == "none"
