"""One preset switch and one report from Python: the preset reaches the CPU
kernels (reference vs fused, counted by the C++ registry) and the Megatron
patches; the device backends' calls join the same report."""

import pytest
import torch

import leanstep

from helpers import moe_hostile_calls


@pytest.fixture(autouse=True)
def restore_preset():
    yield
    leanstep.set_preset("all")


def impl_calls(op):
    return {s["impl"]: s["calls"] for s in leanstep.paths()["ops"][op]["cpu"]["stats"]}


def test_preset_switches_the_cpu_kernels_of_python_calls(torch_gen):
    grads = [torch.randn(100, generator=torch_gen), torch.randn(7, generator=torch_gen)]
    plan = leanstep.GradPlan(grads)
    leanstep.reset_paths()
    fast, _ = plan.norm()
    leanstep.set_preset("baseline")
    assert leanstep.preset() == "baseline"
    reference, _ = plan.norm()
    assert impl_calls("grad.norm") == {"fused": 1, "reference": 1}
    assert abs(fast.item() - reference.item()) <= 2 * 2**-24 * fast.item()
    leanstep.set_preset("rmsnorm,grad.clip")
    plan.norm()
    assert impl_calls("grad.norm")["reference"] == 2
    assert leanstep.paths()["ops"]["grad.clip"]["fast_paths_enabled"]
    assert not leanstep.paths()["ops"]["grad.norm"]["fast_paths_enabled"]


def test_unknown_preset_names_raise_and_change_nothing():
    leanstep.set_preset("grad")
    with pytest.raises(leanstep.Error, match="nope"):
        leanstep.set_preset("grad,nope")
    assert leanstep.preset() == "grad"
    with pytest.raises(leanstep.Error, match=r"argument 'preset' must be"):
        leanstep.set_preset("")


def test_device_backend_calls_join_the_report():
    leanstep.reset_paths()
    g = torch.empty(64, device="meta")
    leanstep.GradPlan([g]).norm()
    leanstep.GradPlan([torch.zeros(3)], backend="torch").count_zeros()
    ops = leanstep.paths()["ops"]
    assert ops["grad.norm"]["calls"] == {"torch": {"meta": 1}}
    assert ops["grad.count_zeros"]["calls"] == {"torch": {"cpu": 1}}
    text = leanstep.format_paths()
    assert "grad.norm: fast paths enabled" in text and "routed to torch: meta 1" in text


def test_megatron_families_are_the_preset():
    lm = pytest.importorskip("leanstep.megatron")
    leanstep.set_preset("grad")
    assert leanstep.preset() == "grad" and lm.active() == ["grad"]
    leanstep.set_preset("moe.permute")
    assert lm.active() == ["moe"]  # a family with any enabled op
    leanstep.set_preset("baseline")
    assert lm.active() == []


def test_megatron_patch_calls_join_the_one_report():
    lm = pytest.importorskip("leanstep.megatron")
    from leanstep.megatron import _patching

    leanstep.reset_paths()
    _patching.count("permute", "cuda", "triton")
    _patching.count("permute", reason="fused")
    entry = leanstep.paths()["ops"]["moe.permute"]["megatron"]["permute"]
    assert entry == {"leanstep": {"triton:cuda": 1}, "delegated": {"fused": 1}}
    assert "megatron patch permute: leanstep triton:cuda 1; delegated: fused 1" in \
        leanstep.format_paths()
    assert lm.report()["calls"]["permute"]["leanstep"] == 1
    leanstep.reset_paths()  # one reset for every count
    assert "megatron" not in leanstep.paths()["ops"]["moe.permute"]


def test_every_op_lists_its_implementations_per_backend():
    ops = leanstep.paths()["ops"]
    for name in ("grad.norm", "grad.clip", "rmsnorm.forward", "moe.permute", "moe.unpermute"):
        assert "torch" in ops[name]["implementations"], name
    # The C++ registry's CPU implementations sit beside them.
    assert {i["name"] for i in ops["grad.norm"]["cpu"]["implementations"]} == {"fused"}
    assert ops["grad.norm"]["cpu"]["reference"] == "reference"
    leanstep.reset_paths()
    leanstep.moe_permute(torch.zeros(4, 3), torch.eye(4, 2, dtype=torch.bool), None, 2,
                         backend="torch")
    assert leanstep.paths()["ops"]["moe.permute"]["calls"] == {"torch": {"cpu": 1}}


def test_the_cpp_op_table_and_the_python_backends_agree():
    """The C++ op table (include/leanstep/ops.h) declares each op's device
    backends for `leanstep paths`; the Python package is what implements them."""
    import json

    from leanstep._registry import REGISTRY

    table = json.loads(leanstep._leanstep.dispatch_paths_json())["ops"]
    assert table, "no ops in the C++ registry"
    for op in table:
        declared = set(op["backends"])
        implemented = set(REGISTRY[op["op"]].implementations)
        assert declared == implemented, op["op"]
        assert op["backends"]["cpu"][0] == op["reference"]


def test_moe_calls_go_through_the_registry_unless_a_method_is_forced(torch_gen):
    routing_map = torch.rand(16, 4, generator=torch_gen) < 0.5
    tokens = torch.randn(16, 8, generator=torch_gen)
    leanstep.reset_paths()
    fast = leanstep.moe_permute(tokens, routing_map)
    leanstep.set_preset("baseline")
    reference = leanstep.moe_permute(tokens, routing_map)
    forced = leanstep.moe_permute(tokens, routing_map, method="fused")  # bypasses the registry
    assert impl_calls("moe.permute") == {"fused": 1, "sort": 1}  # "sort" is the reference
    for a, b, c in zip(fast, reference, forced):
        if a is None:  # no probs given: no permuted probs
            assert b is None and c is None
            continue
        assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------- one op vocabulary

def _entry(path):
    obj = leanstep
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_op_of_the_table_has_a_registry_entry_and_back():
    from leanstep._registry import REGISTRY

    table = leanstep.ops()
    assert list(table) == [name for name, _ in leanstep._leanstep.dispatch_op_table()]
    assert set(REGISTRY) == set(table), (
        f"ops without a registry entry: {sorted(set(table) - set(REGISTRY))}; entries without "
        f"a row: {sorted(set(REGISTRY) - set(table))}")
    for op, spec in REGISTRY.items():
        assert callable(_entry(spec.entry)), (op, spec.entry)
        assert leanstep.paths()["ops"][op]["entry"] == spec.entry
    # The report covers exactly the vocabulary (nothing reported outside it).
    assert set(leanstep.paths()["ops"]) == set(table)


def test_the_device_backends_implement_what_the_table_says():
    import importlib

    from leanstep._registry import REGISTRY

    table = leanstep.ops()
    for op, backends in table.items():
        spec = REGISTRY[op]
        assert spec.backends == backends, op  # the same backends, in the same order
        for backend, impl in spec.implementations.items():
            assert impl.how, (op, backend)
            if backend == "triton" or impl.module is None:
                continue  # Triton modules import triton (test_triton_*.py load them)
            name = op.split(".", 1)[1]
            device = importlib.import_module(impl.module)
            assert impl.module.startswith("leanstep.backends."), (op, backend)
            assert any(hasattr(device, n) for n in (name, name.removeprefix("moe_"),
                                                    "TorchGradPlan", "forward")), (op, backend)
    assert all(backends[0] == "cpu" for backends in table.values())


def test_a_call_counted_under_a_name_outside_the_table_is_refused():
    from leanstep import _backend

    with pytest.raises(leanstep.Error, match="'grad.unscale_all' is not in the op table"):
        _backend.record("grad.unscale_all", "cpu", "cpu")


def test_ops_with_one_cpu_implementation_are_counted_and_switched_alike(torch_gen):
    # The ops that were outside the table: routed through the registry now,
    # counted per call, and their names accepted by the preset.
    leanstep.reset_paths()
    routing_map = torch.zeros(6, 3, dtype=torch.bool)
    routing_map[torch.arange(6), torch.arange(6) % 3] = True
    leanstep.pad_routing_map(routing_map, 4)
    rows = torch.randn(6, 5, generator=torch_gen)
    leanstep.sort_chunks_by_idxs(rows, torch.tensor([2, 4]), torch.tensor([1, 0]))
    leanstep.moe_route(torch.randn(6, 3, generator=torch_gen), 2)
    plan = leanstep.GradPlan([torch.randn(9, generator=torch_gen)])
    plan.unscale_(0.5)
    for op, impl in [("moe.pad_routing_map", "reference"), ("moe.sort_chunks_by_idxs", "reference"),
                     ("moe.route", "reference"), ("grad.unscale", "fused")]:
        assert impl_calls(op).get(impl) == 1, op
    leanstep.set_preset("grad.unscale,moe.route")
    plan.unscale_(0.5)
    leanstep.set_preset("baseline")
    plan.unscale_(0.5)
    assert impl_calls("grad.unscale") == {"fused": 2, "reference": 1}


# ---------------------------------------------------------------- one rule on every backend

@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_max_norm_has_one_rule_on_every_backend(backend, torch_gen):
    # The C++ rule (grad::check_max_norm): finite and >= 0; 0 zeroes the grads
    # (torch's clip_grad_norm_ does the same), on every backend alike.
    grads = [torch.randn(37, generator=torch_gen), torch.randn(5, 3, generator=torch_gen)]
    plan = leanstep.GradPlan(grads, backend=backend)
    norm, _ = plan.norm()
    coeff = plan.clip_(0.0, norm)
    assert coeff.item() == 0.0 and all(bool((g == 0).all()) for g in grads)
    for bad, shown in [(-1.0, r"\(got -1\)"), (float("nan"), r"\(got nan\)"),
                       (float("inf"), r"\(got inf\)")]:
        with pytest.raises(leanstep.Error, match=r"clip: argument 'max_norm' must be finite and "
                                                 r">= 0 " + shown):
            plan.clip_(bad, norm)
        with pytest.raises(leanstep.Error, match=r"norm_clip: argument 'max_norm' must be finite"):
            plan.norm_clip_(bad)
    with pytest.raises(leanstep.Error, match=r"clip: argument 'max_norm' must be a real number "
                                             r"\(got str\)"):
        plan.clip_("1.0", norm)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_integer_arguments_are_never_truncated(backend, torch_gen):
    # num_out_tokens=20.7 and multiple=2.5 were truncated on the CPU path and
    # refused on the device path: one rule now (leanstep._rules.host_int).
    routing_map = torch.zeros(8, 4, dtype=torch.bool)
    routing_map[torch.arange(8), torch.arange(8) % 4] = True
    tokens = torch.randn(8, 6, generator=torch_gen)
    with pytest.raises(leanstep.Error, match=r"permute: argument 'num_out_tokens' must be a host "
                                             r"integer \(got float\)"):
        leanstep.moe_permute(tokens, routing_map, num_out_tokens=20.7, backend=backend)
    with pytest.raises(leanstep.Error, match=r"pad_routing_map: argument 'multiple' must be a host "
                                             r"integer \(got float\)"):
        leanstep.pad_routing_map(routing_map, 2.5, backend=backend)
    with pytest.raises(leanstep.Error, match=r"must be a host integer \(got bool\)"):
        leanstep.pad_routing_map(routing_map, True, backend=backend)
    # Integers of any kind are taken: a NumPy integer and a 0-dim integer tensor.
    import numpy as np

    a = leanstep.moe_permute(tokens, routing_map, num_out_tokens=np.int64(10), backend=backend)
    b = leanstep.moe_permute(tokens, routing_map, num_out_tokens=torch.tensor(10), backend=backend)
    assert a[0].shape == b[0].shape == (10, 6) and torch.equal(a[0], b[0])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_rms_norm_arguments_have_the_cpu_rules_on_every_backend(backend, torch_gen):
    # The torch-op backend, which every accelerator runs, used to broadcast a
    # [1] weight silently (and return a dweight of shape [8]), ignore a misspelt
    # rounding and take eps=-1, eps=nan and int32 inputs. It now checks with the
    # C++ kernels' rules, on metadata (rmsnorm::check_forward_args).
    x = torch.randn(4, 8, generator=torch_gen)
    w = torch.ones(8)
    bad = [((x, torch.ones(1), 1e-6), {}, r"argument 'gamma' must have shape \[8\] \(H of x\) "
                                         r"\(got \[1\]\)"),
           ((x, w, 1e-6), {"rounding": "scale_than_cast"},
            r"must be scale_then_cast or cast_then_scale \(got 'scale_than_cast'\)"),
           ((x, w, -1.0), {}, r"argument 'eps' must be finite and >= 0 \(got -1\)"),
           ((x, w, float("nan")), {}, r"argument 'eps' must be finite and >= 0 \(got nan\)"),
           ((x.to(torch.int32), w, 1e-6), {}, r"argument 'x' must have dtype"),
           ((x.t(), w[:4], 1e-6), {}, r"argument 'x' must be contiguous")]
    for args, kwargs, message in bad:
        with pytest.raises(leanstep.Error, match=message):
            leanstep.rms_norm(*args, backend=backend, **kwargs)
    y, rstd = leanstep.rms_norm(x, w, 1e-6, backend=backend)
    dy = torch.randn(4, 8, generator=torch_gen)
    with pytest.raises(leanstep.Error, match=r"argument 'gamma' must have shape \[8\]"):
        leanstep.rms_norm_backward(dy, x, rstd, torch.ones(1), backend=backend)
    with pytest.raises(leanstep.Error, match=r"argument 'rstd' must have one element per row"):
        leanstep.rms_norm_backward(dy, x, rstd[:3], w, backend=backend)
    with pytest.raises(leanstep.Error, match=r"argument 'dy' must have the shape of x"):
        leanstep.rms_norm_backward(dy[:3], x, rstd, w, backend=backend)
    dx, dweight = leanstep.rms_norm_backward(dy, x, rstd, w, backend=backend)
    assert dx.shape == x.shape and dweight.shape == w.shape


def test_rms_norm_rules_on_meta_tensors_read_nothing():
    # Meta tensors have no data: the rules run on their metadata alone, and a
    # view of the input's own storage as the weight is an overlap as on the CPU.
    x = torch.empty(4, 8, device="meta")
    y, rstd = leanstep.rms_norm(x, torch.empty(8, device="meta"), 1e-6)
    assert y.device.type == "meta" and rstd.shape == (4,)
    with pytest.raises(leanstep.Error, match=r"argument 'gamma' must have shape \[8\]"):
        leanstep.rms_norm(x, torch.empty(1, device="meta"), 1e-6)
    from leanstep import _rules

    a, b = _rules.tensor_metas([x, x[1]])
    assert b[0] - a[0] == 8 * 4 and a[2:] == ((4, 8), (8, 1))
    _, c = _rules.tensor_metas([x, torch.empty(8, device="meta")])
    assert c[0] >= a[0] + 4 * 8 * 4  # another storage of the call: memory of its own


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_grad_outputs_have_the_cpu_rules_on_every_backend(backend, torch_gen):
    # The torch-op backend accepted norm(out=<float64 or [2]>), found_inf=<int32>
    # and count_zeros(out=<float32>); the rule of a backend scalar is now the C++
    # one (grad::check_scalar_arg) there too.
    plan = leanstep.GradPlan([torch.randn(11, generator=torch_gen)], backend=backend)
    bad = [(lambda: plan.norm(out=torch.zeros(1, dtype=torch.float64)), r"'out(_norm)?' must have dtype"),
           (lambda: plan.norm(out=torch.zeros(2)), r"'out(_norm)?' must have exactly 1 element \(got 2\)"),
           (lambda: plan.norm(found_inf=torch.zeros(1, dtype=torch.int32)), r"'found_inf' must have dtype"),
           (lambda: plan.count_zeros(out=torch.zeros(1)), r"'out(_count)?' must have dtype"),
           (lambda: plan.unscale_(0.5, found_inf=torch.zeros(3)), r"'found_inf' must have exactly 1 element")]
    for call, message in bad:
        with pytest.raises(leanstep.Error, match=message):
            call()
    norm, found = plan.norm(out=torch.zeros(1), found_inf=torch.zeros(1))
    assert norm.dtype == torch.float32 and found.item() == 0.0
    assert plan.count_zeros(out=torch.zeros(1, dtype=torch.int64)).item() == 0


def test_sort_chunks_split_sizes_that_wrap_int64_are_refused(torch_gen):
    # Four sizes of 2^62 sum to 2^64, which wraps to 0 in int64: the device-side
    # check took that for "at most R rows". Each size is now bounded first.
    rows = torch.randn(8, 3, generator=torch_gen)
    sizes, order = torch.tensor([2**62] * 4), torch.tensor([3, 2, 1, 0])
    assert int(sizes.sum()) == 0  # the wrap itself
    with pytest.raises(leanstep.Error, match="split_sizes"):
        leanstep.sort_chunks_by_idxs(rows, sizes, order)
    with pytest.raises(RuntimeError, match="'split_sizes' must be >= 0 and sum to at most"):
        leanstep.sort_chunks_by_idxs(rows, sizes, order, backend="torch")


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_moe_arguments_have_the_cpu_rules_on_every_backend(backend, torch_gen):
    # The torch-op backend had its own copies of the MoE rules (a bool map, the
    # probs' shapes, E * capacity slots, ...), which had drifted: it took strided
    # tokens and truncated nothing the CPU refused, but the messages differed.
    # Both now run the C++ rules; every hostile call is refused the same way.
    for name, call, message in moe_hostile_calls(torch_gen):
        with pytest.raises(leanstep.Error, match=message):
            call(backend)
            pytest.fail(f"{name}: accepted")


def test_moe_rules_on_meta_tensors_read_nothing(torch_gen):
    # On meta tensors (no data: any host read raises) the device backend refuses
    # the same inputs before it runs anything.
    for name, call, message in moe_hostile_calls(torch_gen, device="meta"):
        with pytest.raises(leanstep.Error, match=message):
            call(None)
            pytest.fail(f"{name}: accepted")
    tokens = torch.empty(6, 4, device="meta")
    routing_map = torch.empty(6, 3, dtype=torch.bool, device="meta")
    permuted, _, indices = leanstep.moe_permute(tokens, routing_map, num_out_tokens=9)
    assert permuted.shape == (9, 4) and indices.shape == (9,)
    assert leanstep.moe_unpermute(permuted, indices, (6, 4)).shape == (6, 4)


def test_moe_value_rules_run_on_the_device_for_the_torch_backend(torch_gen):
    # The rules on values (checked by the CPU kernels before they write) are
    # asynchronous device checks there: -1 beyond the routed pairs is one.
    tokens = torch.randn(6, 4, generator=torch_gen)
    routing_map = torch.zeros(6, 3, dtype=torch.bool)
    routing_map[:, 1] = True
    probs = torch.rand(6, 3, generator=torch_gen)
    permuted, _, indices = leanstep.moe_permute(tokens, routing_map, num_out_tokens=8)
    bad = indices.clone()
    bad[7] = 2  # a source token in a slot past the 6 routed pairs
    with pytest.raises(leanstep.Error, match="must be -1 beyond the 6 routed pairs"):
        leanstep.moe_unpermute(permuted, bad, (6, 4), probs, routing_map)
    with pytest.raises(RuntimeError, match="must be -1 beyond the routed pairs"):
        leanstep.moe_unpermute(permuted, bad, (6, 4), probs, routing_map, backend="torch")
    out = leanstep.moe_unpermute(permuted, indices, (6, 4), probs, routing_map, backend="torch")
    assert torch.equal(out, leanstep.moe_unpermute(permuted, indices, (6, 4), probs, routing_map))


def test_the_preset_keeps_the_automatic_device_choice_off_triton(monkeypatch):
    # set_preset("baseline") used to stop at the CPU kernels: a cuda call still
    # picked the Triton kernels. The automatic choice now asks the preset (the
    # torch-op backend is the device path's reference). Triton is made "usable"
    # for meta tensors here, so the choice itself is what is tested.
    from leanstep import _backend, _registry

    monkeypatch.setattr(_backend, "triton_unusable", lambda device: None)
    monkeypatch.setattr(_backend, "triton_self_check", lambda family, device: None)
    monkeypatch.delenv("LEANSTEP_TRITON", raising=False)
    x = [torch.empty(4, 8, device="meta")]

    def choice(op, backend=None):
        return _registry.choose(op, x, None, backend, "t")

    assert choice("moe.permute")[0] == "triton"
    leanstep.set_preset("baseline")
    chosen, why = choice("moe.permute")
    assert chosen == "torch" and why == "meta tensors; the preset switches moe.permute off"
    leanstep.set_preset("moe.permute")
    assert choice("moe.permute")[0] == "triton" and choice("moe.unpermute")[0] == "torch"
    leanstep.set_preset("moe")
    assert choice("moe.unpermute")[0] == "triton"
    assert choice("moe.permute", "triton") == ("triton", "forced")
    # A forced Triton backend follows the preset too (its reference is the torch-op code),
    # as the CPU kernels follow it when no impl= is forced.
    leanstep.set_preset("grad")
    assert choice("moe.permute", "triton") == (
        "torch", "forced; the preset switches moe.permute off")

    # The entry points name their op: under baseline they run the torch-op code.
    leanstep.set_preset("baseline")
    _backend.reset_calls()
    tokens = torch.empty(6, 4, device="meta")
    routing_map = torch.empty(6, 3, dtype=torch.bool, device="meta")
    leanstep.moe_permute(tokens, routing_map, num_out_tokens=9)
    import leanstep.torch as lt

    lt.rms_norm(tokens, torch.empty(4, device="meta"), 1e-6)
    reasons = _backend.reasons()
    assert list(reasons["moe.permute"]["torch"]["meta"]) == [
        "meta tensors; the preset switches moe.permute off"]
    assert list(reasons["rmsnorm.forward"]["torch"]["meta"]) == [
        "meta tensors; the preset switches rmsnorm.forward off"]
