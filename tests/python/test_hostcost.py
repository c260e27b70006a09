"""leanstep.hostcost: aten ops to launches (views, foreach chunking at its
boundaries, cat batching), syncs per call site, the prediction's arithmetic,
parameter checks, the audit's list-call records, and the CLI (the seed's
layout; a main-job results file)."""

import json
import math
import subprocess
import sys

import pytest
import torch

import leanstep
from leanstep import hostcost as hc

CHUNK = 65536


def report(ops, views=None, list_calls=(), syncs=(), implicit=(), reads=()):
    """A hand-made Audit.to_dict()-shaped report."""
    return {"ops": dict(ops), "view_ops": dict(views or {}), "list_calls": list(list_calls),
            "syncs": list(syncs), "implicit_syncs": list(implicit), "host_reads": list(reads),
            "num_ops": sum(ops.values()), "num_view_ops": sum((views or {}).values())}


def call(op, runs, lists=1, count=1):
    return {"count": count, "op": op, "lists": lists, "tensors": sum(n for _, n in runs),
            "elements": sum(v * n for v, n in runs), "numels": [list(r) for r in runs]}


def launches(op, runs, lists=1, **params):
    r = report({op: 1}, list_calls=[call(op, runs, lists)])
    return hc.estimate(r, hc.CostParams(**params))["launches"]


def site(line, **fields):
    return {"file": "step.py", "line": line, "function": "step", "via": None, **fields}


# ---------------------------------------------------------------- launches


def test_foreach_chunks_at_the_tensor_boundary():
    op = "aten._foreach_mul_.Scalar"  # in place, one list: 110 tensors a launch
    assert launches(op, [(10, 110)]) == 1
    assert launches(op, [(10, 111)]) == 2
    assert launches(op, [(10, 220)]) == 2
    assert launches(op, [(10, 221)]) == 3


def test_foreach_chunks_at_the_block_boundary_and_carries_a_cut_tensor():
    op = "aten._foreach_mul_.Scalar"
    assert launches(op, [(320 * CHUNK, 1)]) == 1
    assert launches(op, [(320 * CHUNK + 1, 1)]) == 2
    # 1 block, then a tensor of 320 blocks: 319 of them fill the first launch,
    # its last block starts the second
    assert launches(op, [(CHUNK, 1), (320 * CHUNK, 1)]) == 2
    # 106 tensors of 3 blocks, then one of 2: 320 blocks exactly with its last
    # chunk, one launch; one of 3 instead is cut after its second block
    assert launches(op, [(3 * CHUNK, 106), (2 * CHUNK, 1)]) == 1
    assert launches(op, [(3 * CHUNK, 106), (3 * CHUNK, 1)]) == 2
    assert launches(op, [(0, 500), (10, 1)]) == 1  # empty tensors take no slot


def test_foreach_tensors_per_launch_depend_on_the_lists():
    assert launches("aten._foreach_mul.Scalar", [(10, 64)]) == 1  # out of place: 2 lists, 64
    assert launches("aten._foreach_mul.Scalar", [(10, 65)]) == 2
    assert launches("aten._foreach_copy_.default", [(10, 65)], lists=2) == 2
    assert launches("aten._foreach_addcmul_.Scalar", [(10, 48)], lists=3) == 1
    assert launches("aten._foreach_addcmul_.Scalar", [(10, 49)], lists=3) == 2
    assert launches("aten._foreach_mul_.ScalarList", [(10, 96)]) == 1  # scalar-list table
    assert launches("aten._foreach_mul_.ScalarList", [(10, 97)]) == 2
    # 32 KB kernel arguments: 7x the tensors (770, 448 ...) and the blocks given
    large = dict(foreach_tensors=770, foreach_blocks=2240)
    assert launches("aten._foreach_mul_.Scalar", [(10, 770)], **large) == 1
    assert launches("aten._foreach_mul_.Scalar", [(10, 771)], **large) == 2
    assert launches("aten._foreach_mul.Scalar", [(10, 448)], **large) == 1
    assert launches("aten._foreach_mul.Scalar", [(10, 449)], **large) == 2
    assert launches("aten._foreach_mul_.Scalar", [(10, 770)], foreach_tensors=770) == 3  # blocks


def test_foreach_norm_adds_two_fills_and_a_cleanup_per_400_tensors():
    op = "aten._foreach_norm.Scalar"
    assert launches(op, [(10, 110)]) == 1 + 2 + 1
    assert launches(op, [(10, 111)]) == 2 + 2 + 1
    # 401 tensors: ceil(401/110) = 4 launches, 2 fills, 2 clean-ups
    assert launches(op, [(10, 401)]) == 4 + 2 + 2


def test_cat_and_stack_batch_128_inputs():
    assert launches("aten.stack.default", [(1, 128)]) == 1
    assert launches("aten.stack.default", [(1, 129)]) == 2
    assert launches("aten.cat.default", [(5, 3168)]) == math.ceil(3168 / 128)


def test_views_metadata_and_sync_ops_launch_nothing():
    r = report({"aten.view.default": 3, "aten.t.default": 1, "aten.add.Tensor": 2,
                "aten.empty.memory_format": 1, "aten.detach.default": 1,
                "aten._local_scalar_dense.default": 1},
               views={"aten.view.default": 3, "aten.t.default": 1})
    e = hc.estimate(r)
    assert e["launches"] == 2
    assert dict((op, n) for op, _, n in e["by_op"])["aten.view.default"] == 0


def test_a_report_without_list_sizes_counts_one_launch_per_call():
    r = report({"aten._foreach_norm.Scalar": 2, "aten.add.Tensor": 1})
    del r["list_calls"]
    e = hc.estimate(r)
    assert e["launches"] == 3 and any("no list sizes" in n for n in e["notes"])


# ---------------------------------------------------------------- syncs


def test_a_device_read_and_its_sync_at_one_line_are_one_wait():
    r = report({"aten._local_scalar_dense.default": 2, "aten.nonzero.default": 1,
                "aten._to_copy.default": 2},
               syncs=[site(10, count=2, kind="scalar", op="aten._local_scalar_dense.default",
                           device="cuda:0"),
                      site(12, count=1, kind="d2h_copy", op="aten._to_copy.default",
                           device="cuda:0"),
                      site(13, count=1, kind="d2h_copy_nonblocking", op="aten._to_copy.default",
                           device="cuda:0")],
               implicit=[site(14, count=1, kind="data_dependent", op="aten.nonzero.default",
                              device="cuda:0")],
               reads=[site(10, count=2, kind="item", memory="device"),
                      site(11, count=1, kind="cpu", memory="device"),
                      site(15, count=3, kind="item", memory="host-resident")])
    e = hc.estimate(r)
    # line 10: 2 syncs = 2 reads -> 2; line 11: a read no aten sync saw -> 1;
    # line 12: a blocking copy -> 1; line 13: non-blocking, no wait; line 14:
    # the data-dependent op -> 1; line 15: host-resident reads -> none
    assert e["syncs"] == 2 + 1 + 1 + 1
    # the blocking copy's launch is inside its sync; the non-blocking one and
    # nonzero launch
    assert e["launches"] == 1 + 1


def test_a_summary_report_of_the_main_job():
    e = hc.estimate({"ops": 100, "view_ops": 30, "syncs": 5, "device_reads": 7},
                    hc.CostParams(launch_us=2.0, sync_us=10.0))
    assert (e["launches"], e["syncs"]) == (100 - 30 - 5, 7)
    assert e["host_us"] == 65 * 2.0 + 7 * 10.0


# ---------------------------------------------------------------- prediction


def test_prediction_arithmetic():
    base = report({"aten.mul_.Tensor": 10, "aten._local_scalar_dense.default": 2},
                  syncs=[site(1, count=2, kind="scalar", op="aten._local_scalar_dense.default",
                              device="cuda:0")])
    lean = report({"aten._foreach_mul_.Tensor": 1, "aten.add.Tensor": 1},
                  list_calls=[call("aten._foreach_mul_.Tensor", [(100, 200)])])
    p = hc.predict(base, lean, hc.CostParams(launch_us=5.0, sync_us=20.0))
    assert (p["baseline"]["launches"], p["baseline"]["syncs"]) == (10, 2)
    assert (p["leanstep"]["launches"], p["leanstep"]["syncs"]) == (2 + 1, 0)  # 200 tensors: 2
    assert p["baseline"]["launch_us"] == 50.0 and p["baseline"]["sync_us"] == 40.0
    assert p["baseline"]["host_us"] == 90.0 and p["leanstep"]["host_us"] == 15.0
    assert p["saving"] == {"launches": 7, "syncs": 2, "launch_us": 35.0, "sync_us": 40.0,
                           "model_us": 75.0, "host_us": 75.0}
    assert p["params"]["launch_us"] == 5.0 and p["params"]["device_kind"] == "cuda"
    # A measured host time per call: each side's host time is at least it and at least the
    # model (both lower bounds); the model's own figures are unchanged.
    m = hc.predict(base, lean, hc.CostParams(launch_us=5.0, sync_us=20.0), (60.0, 400.0))
    assert m["baseline"]["host_us"] == 90.0 and m["baseline"]["measured_us"] == 60.0
    assert m["leanstep"]["host_us"] == 400.0 and m["leanstep"]["model_us"] == 15.0
    assert m["saving"]["host_us"] == -310.0 and m["saving"]["model_us"] == 75.0
    for bad in (-1.0, float("nan"), "3", True):
        with pytest.raises(leanstep.Error, match="argument measured_us must be a finite number"):
            hc.estimate(base, measured_us=bad)


def test_defaults_per_device_kind_are_the_published_ranges():
    npu_low, npu_high = hc.default_params("npu", "low"), hc.default_params("npu", "high")
    assert (npu_low.sync_us, npu_high.sync_us) == (19.0, 30.0)
    cuda_low, cuda_high = hc.default_params("cuda", "low"), hc.default_params("cuda", "high")
    assert (cuda_low.launch_us, cuda_high.launch_us) == (4.0, 10.0)
    assert hc.default_params("npu", "low", launch_us=7.5).launch_us == 7.5
    for kind, costs in hc.DEFAULTS.items():  # every default names its source
        assert all(len(v) == 3 and v[0] <= v[1] and v[2] for v in costs.values()), kind


@pytest.mark.parametrize("field,value,shown", [
    ("launch_us", -1.0, "-1.0"), ("launch_us", math.nan, "nan"), ("sync_us", math.inf, "inf"),
    ("sync_us", -0.5, "-0.5")])
def test_a_negative_or_non_finite_cost_is_an_error_naming_it(field, value, shown):
    with pytest.raises(leanstep.Error, match=rf"argument {field} must be a finite number >= 0 "
                                             rf"\(got {shown}\)"):
        hc.CostParams(**{field: value})


def test_other_parameters_are_checked():
    with pytest.raises(leanstep.Error, match=r"argument launch_us must be a finite number >= 0 "
                                             r"\(got bool True\)"):
        hc.CostParams(launch_us=True)
    with pytest.raises(leanstep.Error, match=r"argument device_kind must be one of cuda, npu "
                                             r"\(got 'tpu'\)"):
        hc.CostParams(device_kind="tpu")
    with pytest.raises(leanstep.Error, match=r"argument foreach_tensors must be an integer >= 1 "
                                             r"\(got 0\)"):
        hc.CostParams(foreach_tensors=0)
    with pytest.raises(leanstep.Error, match=r"argument which must be 'low' or 'high'"):
        hc.default_params("cuda", "middle")
    with pytest.raises(leanstep.Error, match=r"argument report must be"):
        hc.estimate({"ops": "many"})


# ---------------------------------------------------------------- the audit's records


def test_the_audit_records_list_calls_with_their_tensor_sizes():
    xs = [torch.empty(3, device="meta") for _ in range(111)] + [torch.empty(2, 5, device="meta")]
    with leanstep.audit() as a:
        torch._foreach_mul_(xs, 2.0)
        torch._foreach_add_(xs, xs)
        torch.stack(xs[:4])
    d = a.to_dict()
    rows = {c["op"]: c for c in d["list_calls"]}
    assert rows["aten._foreach_mul_.Scalar"] == {
        "count": 1, "op": "aten._foreach_mul_.Scalar", "lists": 1, "tensors": 112,
        "elements": 111 * 3 + 10, "numels": [[3, 111], [10, 1]]}
    assert rows["aten._foreach_add_.List"]["lists"] == 2
    assert rows["aten.stack.default"]["numels"] == [[3, 4]]
    assert d["view_ops"] == {}
    assert json.loads(json.dumps(d)) == d
    e = hc.estimate(d)
    # mul_: 112 tensors, one list: 2; add_: two lists, 64 a launch: 2; stack: 1
    assert e["launches"] == 2 + 2 + 1


def test_hostcost_imports_neither_torch_nor_the_megatron_patches():
    code = ("import sys, leanstep.hostcost; "
            "print('torch' in sys.modules, 'leanstep.megatron' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


# ---------------------------------------------------------------- command line


def test_cli_on_the_seed_layout():
    out = subprocess.run([sys.executable, "-m", "leanstep.hostcost", "--launch-us", "5",
                          "--sync-us", "20", "--json"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    d = json.loads(out.strip().splitlines()[-1])
    assert d["layout"] == hc.SEED_LAYOUT and d["grads"] == 3168
    assert "predictions_high" not in d  # both costs given: one prediction, no range
    n = d["grads"]
    meg = d["predictions"]["megatron-per-tensor"]
    # a norm per tensor, a read of each, then g * coeff and a copy per tensor;
    # 2 overflow buffers, the device norm and its square
    assert meg["baseline"]["launches"] == 3 * n + 4
    assert meg["baseline"]["syncs"] == n + 1
    lean = meg["leanstep"]
    assert lean["syncs"] == 0
    # the saving is the arithmetic of the two estimates at 5 us / 20 us
    measured = d["measured_us"]
    assert sorted(measured) == sorted(hc.SEED_PATHS) and all(v > 0 for v in measured.values())
    for name, p in d["predictions"].items():
        s = p["saving"]
        assert s["launches"] == p["baseline"]["launches"] - lean["launches"]
        assert s["model_us"] == pytest.approx(5 * s["launches"] + 20 * s["syncs"]), name
        for side, path in (("baseline", name), ("leanstep", "leanstep")):
            e = p[side]
            assert e["measured_us"] == measured[path]
            assert e["host_us"] == max(e["model_us"], measured[path])
        assert p["leanstep"] == lean
    # foreach=True: _foreach_norm and _foreach_mul_ over n one-block tensors,
    # a stack of n norms, and one launch for each other op
    tf = d["predictions"]["torch-foreach"]["baseline"]
    by_op = {op: k for op, _, k in tf["by_op"]}
    assert by_op["aten._foreach_norm.Scalar"] == math.ceil(n / 110) + 2 + math.ceil(n / 400)
    assert by_op["aten._foreach_mul_.Tensor"] == math.ceil(n / 110)
    assert by_op["aten.stack.default"] == math.ceil(n / 128)
    assert tf["syncs"] == 0
    tp = d["predictions"]["torch-per-tensor"]["baseline"]
    assert tp["syncs"] == 1  # error_if_nonfinite: one host check


def test_cli_text_and_flag_errors(monkeypatch, capsys):
    base = report({"aten.mul_.Tensor": 8, "aten._local_scalar_dense.default": 1},
                  syncs=[site(1, count=1, kind="scalar", op="aten._local_scalar_dense.default",
                              device="cpu")])
    lean = report({"aten.add.Tensor": 2})
    monkeypatch.setattr(hc, "audit_seed_layout", lambda: {
        "layout": hc.SEED_LAYOUT, "grads": 8, "buffers": 1, "elements": 80,
        "reports": {"torch-per-tensor": base, "leanstep": lean}})
    assert hc.main(["--device-kind", "npu", "--no-measure"]) == 0
    text = capsys.readouterr().out
    assert "a model, not a measurement" in text and "measured ms" not in text
    # npu: launch 4-10 us, sync 19-30 us; 8 launches + 1 sync against 2 launches
    assert "launch 4-10 us, sync 19-30 us" in text
    assert (f"saving of leanstep against torch-per-tensor: {(6 * 4 + 19) / 1000:.2f}-"
            f"{(6 * 10 + 30) / 1000:.2f} ms") in text
    # with measured host times: leanstep's 500 us outweighs its model (8-20 us), the
    # baseline's model (51-110 us) its 10 us measured; the saving is negative
    monkeypatch.setattr(hc, "measure_seed_layout",
                        lambda names: {"torch-per-tensor": 10.0, "leanstep": 500.0})
    assert hc.main(["--device-kind", "npu"]) == 0
    text = capsys.readouterr().out
    assert "measured ms" in text and "host ms is the larger" in text
    assert (f"saving of leanstep against torch-per-tensor: {(8 * 4 + 19 - 500) / 1000:.2f}-"
            f"{(8 * 10 + 30 - 500) / 1000:.2f} ms") in text
    for argv, flag in ((["--launch-us", "-3"], "--launch-us"),
                       (["--sync-us", "nan"], "--sync-us")):
        with pytest.raises(SystemExit) as e:
            hc.main(argv)
        assert e.value.code == 2
        assert f"argument {flag}: must be a finite number >= 0" in capsys.readouterr().err


def test_cli_model_from_main_job_results(tmp_path, capsys):
    full_base = report({"aten.mul.Tensor": 40, "aten._local_scalar_dense.default": 3},
                       syncs=[site(1, count=3, kind="scalar",
                                   op="aten._local_scalar_dense.default", device="cpu")])
    full_grad = report({"aten.mul.Tensor": 10, "aten._local_scalar_dense.default": 2},
                       syncs=[site(1, count=2, kind="scalar",
                                   op="aten._local_scalar_dense.default", device="cpu")])
    results = {"megatron_core_version": "0.16.1", "ep": {
        "1": {"trainable": {"0": {"tensors": 96}},
              "audit": {"0": {"baseline": {"ops": 43, "view_ops": 0, "syncs": 3,
                                           "report": full_base},
                              "grad": {"ops": 12, "view_ops": 0, "syncs": 2,
                                       "report": full_grad}}}},
        "2": {"audit": {"0": {"baseline": {"ops": 50, "view_ops": 10, "syncs": 4,
                                           "device_reads": 0},
                              "grad": {"ops": 20, "view_ops": 10, "syncs": 3}}}}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert hc.main(["--model-from", str(path), "--launch-us", "1", "--sync-us", "10",
                    "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    s1 = d["EP 1, rank 0"]["grad"]["saving"]
    assert (s1["launches"], s1["syncs"], s1["host_us"]) == (30, 1, 30 * 1 + 10)
    s2 = d["EP 2, rank 0"]["grad"]["saving"]  # summary counts: ops - views - syncs
    assert (s2["launches"], s2["syncs"]) == ((50 - 10 - 4) - (20 - 10 - 3), 1)
    assert hc.main(["--model-from", str(path)]) == 0
    text = capsys.readouterr().out
    assert "EP 1, rank 0" in text and "96 trainable tensors on this rank" in text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ep": {}}))
    with pytest.raises(SystemExit):
        hc.main(["--model-from", str(bad)])
    assert "no ep.*.audit found" in capsys.readouterr().err
