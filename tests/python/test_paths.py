"""One preset switch and one report from Python: the preset reaches the CPU
kernels (reference vs fused, counted by the C++ registry) and the Megatron
patches; the device backends' calls join the same report."""

import pytest
import torch

import leanstep


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
    lm.set_active(["grad"])
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

    from leanstep.backends import IMPLEMENTATIONS

    table = json.loads(leanstep._leanstep.dispatch_paths_json())["ops"]
    assert table, "no ops in the C++ registry"
    for op in table:
        declared = set(op["backends"]) - {"cpu"}
        implemented = {backend for backend, ops in IMPLEMENTATIONS.items() if op["op"] in ops}
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
