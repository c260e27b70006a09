"""Fresh outputs on transparent huge pages: results identical with the
advice on and off; a caller's out= array is never advised or reallocated."""

import pytest
import torch

import leanstep


@pytest.fixture
def restore():
    previous = leanstep.set_huge_pages(True)
    yield
    leanstep.set_huge_pages(previous)


def test_results_are_identical_with_huge_pages_on_and_off(restore, torch_gen):
    x = torch.randn(512, 2048, generator=torch_gen)  # 4 MiB outputs
    w = torch.rand(2048, generator=torch_gen) + 0.5
    routing_map = torch.rand(512, 16, generator=torch_gen) < 0.25
    results = []
    for on in (True, False):
        leanstep.set_huge_pages(on)
        y, rstd = leanstep.rms_norm(x, w, 1e-6)
        permuted, _, idx = leanstep.moe_permute(x, routing_map)
        back = leanstep.moe_unpermute(permuted, idx, x.shape)
        results.append((y, rstd, permuted, idx, back))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_large_fresh_outputs_are_advised_and_small_ones_are_not(restore):
    info = leanstep.huge_pages()
    if info["thp_mode"] not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {info['thp_mode']!r} on this machine: nothing "
                    f"to advise")
    before = leanstep.huge_pages()["advised_bytes"]
    leanstep.rms_norm(torch.randn(8, 16), torch.ones(16), 1e-6)  # far below 2 MiB
    assert leanstep.huge_pages()["advised_bytes"] == before
    leanstep.rms_norm(torch.randn(1024, 2048), torch.ones(2048), 1e-6)  # 8 MiB output
    assert leanstep.huge_pages()["advised_bytes"] >= before + (6 << 20)
    leanstep.set_huge_pages(False)
    middle = leanstep.huge_pages()["advised_bytes"]
    leanstep.rms_norm(torch.randn(1024, 2048), torch.ones(2048), 1e-6)
    assert leanstep.huge_pages()["advised_bytes"] == middle


def test_a_callers_out_array_is_never_advised_or_reallocated(restore):
    x = torch.randn(1024, 2048)
    out = torch.empty_like(x)
    rstd = torch.empty(1024)
    address = out.data_ptr()
    before = leanstep.huge_pages()["advised_bytes"]
    y, r = leanstep.rms_norm(x, torch.ones(2048), 1e-6, out=out, rstd_out=rstd)
    assert y is out and y.data_ptr() == address and r is rstd
    assert leanstep.huge_pages()["advised_bytes"] == before
