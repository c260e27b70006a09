"""leanstep.audit: aten ops by name, host syncs and Python-level host reads by
call site, on CPU and meta tensors; nesting, JSON, the table and the CLI."""

import collections
import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import leanstep
import leanstep.audit as la


def _line():
    """The caller's line number."""
    return inspect.currentframe().f_back.f_lineno


def _at(counter, line, file=__file__):
    """Count of the records of a Sync/HostRead counter at file:line."""
    return sum(n for r, n in counter.items() if r.site.file == file and r.site.line == line)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_counts_exact_op_names(device):
    x = torch.ones(3, device=device)
    with leanstep.audit() as a:
        y = x + 1
        y.sum()
    assert a.ops == collections.Counter({"aten.add.Tensor": 1, "aten.sum.default": 1})
    assert a.num_ops == 2
    assert a.num_syncs == 0 and a.num_host_reads == 0
    assert a.summary() == "2 aten ops (0 views), 0 host syncs, 0 host reads (0 of device memory)"


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_view_ops_are_counted_apart(device):
    x = torch.ones(4, 6, device=device)
    with leanstep.audit() as a:
        z = x.t()[1:]
        z * 2
        x.view(-1)
    assert a.view_ops == collections.Counter(
        {"aten.t.default": 1, "aten.slice.Tensor": 1, "aten.view.default": 1})
    assert a.num_ops == 4 and a.num_view_ops == 3


def test_item_on_cpu_is_one_sync_and_one_read_at_the_call_site():
    x = torch.arange(4, dtype=torch.float32)
    s = x.sum()
    with la.audit() as a:
        v = s.item(); line = _line()  # noqa: E702
    assert v == 6.0
    assert a.ops == collections.Counter({"aten._local_scalar_dense.default": 1})
    assert a.num_syncs == 1 and _at(a.syncs, line) == 1
    (sync,) = a.syncs
    assert (sync.kind, sync.device, sync.site.function) == ("scalar", "cpu", inspect.currentframe().f_code.co_name)
    assert a.num_host_reads == 1 and _at(a.host_reads, line) == 1
    (read,) = a.host_reads
    assert (read.kind, read.memory, read.device, read.dtype, read.shape, read.error) == (
        "item", "host-resident", "cpu", "float32", (), None)
    assert a.num_device_reads == 0
    assert a.summary() == "1 aten ops (0 views), 1 host syncs, 1 host reads (0 of device memory)"


def test_bool_tolist_and_other_reads_are_host_reads():
    x = torch.arange(5, dtype=torch.int64)
    with leanstep.audit() as a:
        b = bool(x[1]); line_bool = _line()  # noqa: E702
        lst = x.tolist(); line_list = _line()  # noqa: E702
        line_more = _line() + 1
        int(x[2]), float(x[3]), x.cpu(), x.numpy(), x.to("cpu"), x.to(device="cpu")
        x.to(torch.float64)  # a dtype conversion, not a read
        x.to(x.device), x.to(torch.device("cpu")), x.to(x)  # to its own device: no read
    assert b is True and lst == [0, 1, 2, 3, 4]
    kinds = collections.Counter()
    for r, n in a.host_reads.items():
        kinds[r.kind] += n
    assert kinds == collections.Counter(
        {"bool": 1, "tolist": 1, "int": 1, "float": 1, "cpu": 1, "numpy": 1, "to_cpu": 2})
    assert _at(a.host_reads, line_bool) == 1 and _at(a.host_reads, line_list) == 1
    assert _at(a.host_reads, line_more) == 6
    shapes = {r.kind: r.shape for r in a.host_reads}
    assert shapes["bool"] == () and shapes["tolist"] == (5,)
    # bool/int/float dispatch _local_scalar_dense; a CPU tolist reads memory directly
    assert a.num_syncs == 3 and _at(a.syncs, line_bool) == 1 and _at(a.syncs, line_list) == 0
    assert all(r.memory == "host-resident" for r in a.host_reads)


def test_meta_item_raises_and_the_attempt_is_recorded():
    m = torch.ones((), device="meta")
    v = torch.ones(2, 3, device="meta")
    with leanstep.audit() as a:
        with pytest.raises(RuntimeError):
            line_item = _line() + 1
            m.item()
        with pytest.raises(Exception):
            line_list = _line() + 1
            v.tolist()
    reads = {r.kind: r for r in a.host_reads}
    assert set(reads) == {"item", "tolist"}
    assert reads["item"].error == "RuntimeError" and reads["item"].site.line == line_item
    assert reads["tolist"].error is not None and reads["tolist"].site.line == line_list
    assert all(r.memory == "device" and r.device == "meta" for r in reads.values())
    assert reads["tolist"].shape == (2, 3)
    assert a.num_device_reads == 2
    # the aten-level attempt: _local_scalar_dense on meta (a copy out of meta is no sync)
    assert a.num_syncs == 1 and _at(a.syncs, line_item) == 1
    assert next(iter(a.syncs)).device == "meta"
    assert "2 host reads (2 of device memory)" in a.summary()


def test_data_dependent_ops_are_implicit_syncs_kept_apart():
    x = torch.arange(6.0)
    counts = torch.tensor([1, 2, 0, 1, 1, 1])
    idx = torch.tensor([0, 2])
    with leanstep.audit() as a:
        line = _line() + 1
        x[x > 2], torch.nonzero(x), torch.repeat_interleave(x, counts)
        x[idx], torch.repeat_interleave(x, counts, output_size=6)  # shapes known: none
    ops = collections.Counter(r.op for r in a.implicit_syncs.elements())
    # repeat_interleave(x, counts) decomposes into repeat_interleave.Tensor + index_select
    assert ops == collections.Counter(
        {"aten.index.Tensor": 1, "aten.nonzero.default": 1, "aten.repeat_interleave.Tensor": 1})
    assert a.num_implicit_syncs == 3 and _at(a.implicit_syncs, line) == 3
    assert a.num_syncs == 0 and a.num_host_reads == 0
    assert a.summary().endswith(", 3 implicit syncs (data-dependent ops)")


def _params_with_grads(n, gen):
    ps = []
    for i in range(n):
        p = torch.nn.Parameter(torch.empty(3 + i % 7, 5))
        p.grad = torch.randn(p.shape, generator=gen)
        ps.append(p)
    return ps


def test_clip_grad_norm_foreach_has_no_syncs_and_few_ops(torch_gen):
    ps = _params_with_grads(50, torch_gen)
    expect = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps]))
    with leanstep.audit() as a:
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm=1.0, foreach=True)
    torch.testing.assert_close(total, expect)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ps]))
    assert abs(float(clipped) - 1.0) < 1e-3
    assert a.num_syncs == 0, a.format_table()
    assert a.num_host_reads == 0, a.format_table()
    assert a.num_ops <= 12, f"{a.num_ops} aten ops: {dict(a.ops)}"
    assert any(name.startswith("aten._foreach_norm") for name in a.ops)
    print(f"clip_grad_norm_(foreach=True), 50 grads: {a.summary()}")
    # the per-tensor path issues ops per grad: the audit tells the two apart
    with leanstep.audit() as b:
        torch.nn.utils.clip_grad_norm_(ps, max_norm=1.0, foreach=False)
    assert b.num_ops >= 100 and b.num_syncs == 0
    print(f"clip_grad_norm_(foreach=False), 50 grads: {b.summary()}")


def test_nested_audits_count_their_own_regions():
    x = torch.ones(4)
    with leanstep.audit() as outer:
        x + 1
        with leanstep.audit() as inner:
            x * 2
            x.sum().item(); line = _line()  # noqa: E702
        x - 1
    assert inner.ops == collections.Counter(
        {"aten.mul.Tensor": 1, "aten.sum.default": 1, "aten._local_scalar_dense.default": 1})
    assert outer.ops == inner.ops + collections.Counter({"aten.add.Tensor": 1, "aten.sub.Tensor": 1})
    for a in (inner, outer):
        assert a.num_syncs == 1 and _at(a.syncs, line) == 1
        assert a.num_host_reads == 1 and _at(a.host_reads, line) == 1
    with pytest.raises(RuntimeError):
        with inner:
            with inner:
                pass


def test_stacklevel_filter_attributes_a_library_read_to_its_caller(tmp_path):
    lib = tmp_path / "readerlib.py"
    lib.write_text("def read(t):\n    return t.item()\n")
    spec = importlib.util.spec_from_file_location("readerlib", lib)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = torch.tensor(2.0)
    with leanstep.audit() as a:
        mod.read(t)
    with leanstep.audit(stacklevel_filter="readerlib") as b:
        mod.read(t); line = _line()  # noqa: E702
    (ra,) = a.host_reads
    assert (ra.site.file, ra.site.line, ra.site.function, ra.site.via) == (str(lib), 2, "read", None)
    (rb,) = b.host_reads
    assert (rb.site.file, rb.site.line) == (__file__, line)
    assert rb.site.via.endswith("readerlib.py:2 (read)")
    assert _at(b.syncs, line) == 1


def test_to_dict_round_trips_and_table_lists_sections():
    x = torch.arange(3.0)
    with leanstep.audit() as a:
        y = x * 3
        y.max().item(); line = _line()  # noqa: E702
        bool(y[0])
    d = a.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["num_ops"] == a.num_ops and d["num_syncs"] == 2 and d["num_host_reads"] == 2
    assert d["ops"]["aten.mul.Tensor"] == 1
    assert {(s["line"], s["kind"]) for s in d["syncs"]} >= {(line, "scalar")}
    assert {r["kind"] for r in d["host_reads"]} == {"item", "bool"}
    table = a.format_table()
    i_ops, i_syncs, i_reads = (table.index(h) for h in ("aten ops:", "host syncs:", "host reads:"))
    assert i_ops < i_syncs < i_reads
    assert f"test_audit.py:{line} (" in table
    assert table.splitlines()[0] == "audit: " + a.summary()
    assert "aten._local_scalar_dense.default" in table.split("host syncs:")[0]  # the op count
    # rows sorted by count: _local_scalar_dense (2) before mul (1)
    ops_section = table.split("host syncs:")[0]
    assert ops_section.index("_local_scalar_dense") < ops_section.index("aten.mul.Tensor")
    short = a.format_table(top=1)
    assert "more rows" in short and "aten.mul.Tensor" not in short


SCRIPT = """\
import sys
import torch
print("script says", sys.argv[1:])
x = torch.ones(4)
v = (x * 2).sum().item()
sys.exit(3)
"""


def test_cli_json_and_exit_code(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(leanstep.__file__))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "leanstep.audit", "--json", str(script), "a", "--b"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "script says ['a', '--b']"
    d = json.loads(lines[-1])
    assert d["ops"] == {"aten.ones.default": 1, "aten.mul.Tensor": 1, "aten.sum.default": 1,
                        "aten._local_scalar_dense.default": 1}
    assert d["num_syncs"] == 1 and d["num_host_reads"] == 1 and d["num_device_reads"] == 0
    (sync,) = d["syncs"]
    assert (os.path.basename(sync["file"]), sync["line"]) == ("tiny.py", 5)
    (read,) = d["host_reads"]
    assert (read["kind"], read["memory"], read["line"]) == ("item", "host-resident", 5)
    assert "RuntimeWarning" not in proc.stderr


def test_cli_table_in_process(tmp_path, capsys):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT.replace("sys.exit(3)", "print(bool(x[0]))"))
    argv = sys.argv[:]
    rc = la.main(["--top", "2", str(script)])
    assert sys.argv == argv
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == "script says []\nTrue\n"
    assert err.startswith("audit: 6 aten ops (1 views), 2 host syncs, 2 host reads (0 of device memory)\n")
    assert "tiny.py:5 (<module>)" in err and "tiny.py:6 (<module>)" in err
    assert "... 3 more rows" in err  # --top 2 of 5 op names


# ---------------------------------------------------------------- DeviceMemory


STAND_IN = torch.device("cpu")  # the stand-in object: identity, not equality, counts


def _reads(a, memory):
    return collections.Counter({(r.kind, r.site.line): n for r, n in a.host_reads.items()
                                if r.memory == memory})


def test_device_memory_sources_and_propagation():
    dm = la.DeviceMemory(STAND_IN)
    with dm:
        made = torch.zeros(4, device=STAND_IN)
        host = torch.zeros(4, device=torch.device("cpu"))  # equal to the stand-in, not it
        plain = torch.tensor(0.0)
        module = torch.nn.Linear(3, 2)
        dm.place(module)
        moved = plain.to(STAND_IN)
        assert dm.holds(made) and dm.holds(module.weight) and dm.holds(module.bias)
        assert not dm.holds(host) and not dm.holds(plain)
        # A host tensor moved to the device is a copy there, as on a GPU.
        assert dm.holds(moved) and not dm.holds(plain) and moved is not plain
        assert made.to(STAND_IN) is made  # already there: no copy
        # Views, results, in-place and foreach writes, autograd's grads.
        assert dm.holds(made[1:]) and dm.holds(made.sum()) and dm.holds(made * plain)
        written = [torch.zeros(2), torch.zeros(2)]
        torch._foreach_add_(written, [made[:2], made[2:]])
        assert all(dm.holds(t) for t in written)
        module(torch.randn(5, 3)).sum().backward()
        assert dm.holds(module.weight.grad)
        # "Where t is" is the accelerator: allocations there are device memory.
        assert made.device is STAND_IN and plain.device is not STAND_IN
        assert dm.holds(torch.empty(3, device=made.device))
        # Moves to the host are host memory, and copies: never the device tensor.
        for back in (made.cpu(), made.to("cpu"), made.to(torch.device("cpu"))):
            assert not dm.holds(back) and back.untyped_storage().data_ptr() != \
                made.untyped_storage().data_ptr()
        sink = torch.empty(4)
        sink.copy_(made)
        assert not dm.holds(sink)
        # A torch optimizer's step counter stays on the host.
        p = torch.nn.Parameter(torch.ones(3, device=STAND_IN))
        opt = torch.optim.AdamW([p], foreach=False)
        p.grad = torch.ones_like(p)
        opt.step()
        assert dm.holds(opt.state[p]["exp_avg"]) and not dm.holds(opt.state[p]["step"])
    # Outside the context nothing more is tracked, and a freed storage leaves the set.
    assert not dm.holds(torch.zeros(2, device=STAND_IN))
    n = len(dm._storages)
    del made, module, moved, written, p, opt
    import gc

    gc.collect()
    assert len(dm._storages) < n


def test_device_memory_reads_are_told_from_host_resident_ones():
    dm = la.DeviceMemory(STAND_IN)
    with dm:
        dev = torch.arange(4.0, device=STAND_IN)
        counter = torch.tensor(3.0)
        norms = [dev[i].abs() for i in range(3)]
        with leanstep.audit(device_memory=dm) as a:
            l1 = _line(); dev.sum().item()
            l2 = _line(); counter.item()
            l3 = _line(); dev.tolist()
            l4 = _line(); host = dev.cpu()
            l5 = _line(); host.tolist()
            l6 = _line(); torch.tensor(norms)  # reads each value beneath the dispatcher
            l7 = _line(); torch.empty(4).copy_(dev)
            l8 = _line(); dev.to(dev.device)  # no move
            l9 = _line(); bool(dev[0] > 0)
    assert _reads(a, "device") == collections.Counter(
        {("item", l1): 1, ("tolist", l3): 1, ("cpu", l4): 1, ("tensor_from_list", l6): 3,
         ("copy_to_host", l7): 1, ("bool", l9): 1})
    assert _reads(a, "host-resident") == collections.Counter({("item", l2): 1, ("tolist", l5): 1})
    assert a.num_device_reads == 8
    assert all(r.site.line != l8 for r in a.host_reads)
    with pytest.raises(TypeError, match="device_memory"):
        leanstep.audit(device_memory="cuda")
    with pytest.raises(TypeError, match="stand_in"):
        la.DeviceMemory(torch.device("meta"))


def test_device_memory_sees_aten_level_reads_once():
    dm = la.DeviceMemory(STAND_IN)
    with dm:
        dev = torch.ones(2, device=STAND_IN)
        with leanstep.audit(device_memory=dm) as a:
            dev[0].item()  # one Python read: its _local_scalar_dense is not a second one
            torch.ops.aten._local_scalar_dense(dev[1])  # a read no Python method made
    kinds = collections.Counter(r.kind for r in a.host_reads.elements())
    assert kinds == collections.Counter({"item": 1, "scalar": 1})


def test_device_memory_adopts_leanstep_cpu_outputs():
    # The C++ kernels write outside the dispatcher: their outputs are device memory
    # when made like device memory.
    dm = la.DeviceMemory(STAND_IN)
    with dm:
        grads = [torch.randn(5, device=STAND_IN), torch.randn(3, device=STAND_IN)]
        plan = leanstep.GradPlan(grads)
        norm, _ = plan.norm()
        host_plan = leanstep.GradPlan([torch.randn(4)])
        host_norm, _ = host_plan.norm()
        assert dm.holds(norm) and not dm.holds(host_norm)
    assert not leanstep._arrays.output_hooks
