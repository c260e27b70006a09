"""Reliability: the torch backend's clip keeps no state per max_norm value;
the audit CLI's JSON always starts a line of its own; an audit removes
exactly its own modes from torch's mode stacks, whatever the audited code
left entered, and counts nothing after its block."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.utils._python_dispatch as pd
from torch import overrides

import leanstep
from leanstep._leanstep import Error
from leanstep.backends.torch_grad import TorchGradPlan


# ---------------------------------------------------------------- clip: no cache per max_norm


def _container_sizes(obj):
    """Attribute name -> len of every container attribute (the plan's state)."""
    return {k: len(v) for k, v in vars(obj).items() if isinstance(v, (dict, list, tuple, set))}


def _reference_clip(grads, norm, max_norm):
    """The coefficient as the backend has always computed it (an fp32 device
    scalar of max_norm, ONE fp32 division, a clamp) and the grads scaled by it."""
    numerator = torch.full((), max_norm, dtype=torch.float32, device=norm.device)
    coeff = torch.div(numerator, norm.add(1.0e-6)).clamp_(max=1.0)
    return coeff, [g * coeff.view(()) for g in grads]


def test_clip_with_a_new_max_norm_every_step_keeps_no_state_and_is_bitwise(torch_gen):
    buf = torch.randn(700, generator=torch_gen) * 3
    grads = [buf[0:300], buf[300:301], buf[310:700].view(13, 30), buf[0:300]]  # a duplicate too
    plan = TorchGradPlan(grads, buf.device)
    names, sizes = set(vars(plan)), _container_sizes(plan)
    max_norms = [0.5 + k * 0.731 for k in range(400)] + [1e-7 * (k + 1) for k in range(100)]
    for max_norm in max_norms:  # a clip schedule: a new value every step
        before = [g.clone() for g in grads]
        norm = plan.norm(2.0, None, torch.zeros(1))
        want_coeff, want_grads = _reference_clip(before, norm, max_norm)
        coeff = plan.clip(norm, max_norm, None)
        assert torch.equal(coeff, want_coeff), (max_norm, coeff, want_coeff)
        # grads[0] and grads[3] are one view: scaled twice, as listed
        want_grads[0] = want_grads[3] = want_grads[0] * coeff.view(())
        for g, w in zip(grads, want_grads):
            assert torch.equal(g, w), max_norm
        out = torch.empty(1)
        assert plan.clip(norm, max_norm, out) is out
        assert torch.equal(out, torch.div(torch.full((), max_norm), norm.add(1.0e-6)).clamp_(max=1.0))
        buf.copy_(torch.randn(700, generator=torch_gen) * 3)
    # The plan's state is what it was when built: no entry per max_norm seen.
    assert set(vars(plan)) == names
    assert _container_sizes(plan) == sizes


def test_clip_on_meta_is_sync_free_and_the_same_ops_for_a_new_max_norm():
    grads = [torch.empty(n, device="meta") for n in (1000, 37, 4096)]
    plan = TorchGradPlan(grads, torch.device("meta"))
    norm = plan.norm(2.0, None, torch.zeros(1, device="meta"))
    runs = []
    for max_norm in (1.0, 1.0, 2.5, 0.125, 1.0):  # new and repeated values alike
        with leanstep.audit() as c:
            plan.clip(norm, max_norm, None)
        runs.append(c.ops)
        with leanstep.audit() as a:
            n = plan.norm(2.0, None, torch.zeros(1, device="meta"))
            plan.clip(n, max_norm, None)
        assert a.num_syncs == 0 and a.num_implicit_syncs == 0, a.format_table()
        assert a.num_host_reads == 0, a.format_table()
    # A value seen for the first time makes nothing more (no device scalar per value).
    assert all(ops == runs[0] for ops in runs), runs
    assert c.num_ops <= 6, c.format_table()


# ---------------------------------------------------------------- CLI: the JSON on a line of its own


def _run_cli(tmp_path, body):
    script = tmp_path / "ends_without_newline.py"
    script.write_text(body)
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(leanstep.__file__))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-m", "leanstep.audit", "--json", str(script)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("body, script_out", [
    ('import torch\nx = torch.ones(2) * 2\nprint("x", end="")\n', "x"),
    ('import os, sys\nprint("a")\nsys.stdout.flush()\nos.write(1, b"raw")\n', "a\nraw"),
    ('print("line")\n', "line\n"),  # ends with a newline: the JSON on the next line
])
def test_cli_json_starts_its_own_line(tmp_path, body, script_out):
    out = _run_cli(tmp_path, body)
    assert out.startswith(script_out), repr(out)  # the script's output as it wrote it
    last = out.splitlines()[-1]
    d = json.loads(last)  # the last line is the JSON, whole
    rest = out[len(script_out):]  # all the report wrote: newlines around the JSON only
    assert rest.strip("\n") == last and rest.endswith("\n"), repr(out)
    assert script_out.endswith("\n") or rest.startswith("\n"), repr(out)  # a line of its own
    assert d["num_syncs"] == 0


# ---------------------------------------------------------------- the audit's exit and torch's mode stacks


class _UserDispatchMode(pd.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        return func(*args, **(kwargs or {}))


class _UserFunctionMode(overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _audit_modes(stack):
    return [m for m in stack if type(m).__module__ == "leanstep.audit"]


@pytest.fixture
def mode_stacks():
    """Restores torch's mode stacks to their depth before the test, whatever
    the test (or a broken audit) left on them."""
    depth_d = len(pd._get_current_dispatch_mode_stack())
    depth_f = len(overrides._get_current_function_mode_stack())
    flag = pd._is_in_torch_dispatch_mode
    yield
    while len(pd._get_current_dispatch_mode_stack()) > depth_d:
        pd._pop_mode()
    while len(overrides._get_current_function_mode_stack()) > depth_f:
        overrides._pop_mode()
    pd._is_in_torch_dispatch_mode = flag


def test_a_dispatch_mode_left_entered_keeps_its_place_and_the_audit_leaves(mode_stacks):
    before = pd._get_current_dispatch_mode_stack()
    user = _UserDispatchMode()
    x = torch.ones(3)
    with leanstep.audit() as a:
        x + 1
        user.__enter__()  # never exited inside the block
        x * 2
    stack = pd._get_current_dispatch_mode_stack()
    assert _audit_modes(stack) == [], stack
    assert stack == before + [user]  # the user's stack as it was inside the block
    assert pd._is_in_torch_dispatch_mode  # torch still knows a mode is active
    counted = dict(a.ops)
    assert counted == {"aten.add.Tensor": 1, "aten.mul.Tensor": 1}
    seen = user.seen
    x - 1
    torch.ones(2).sum()
    assert dict(a.ops) == counted  # nothing counted after the block
    assert user.seen == seen + 3  # the user's mode still runs
    user.__exit__(None, None, None)  # the user's own exit pops the user's mode
    assert pd._get_current_dispatch_mode_stack() == before
    assert pd._is_in_torch_dispatch_mode == bool(before)


def test_a_function_mode_left_entered_keeps_its_place_and_reads_stop_counting(mode_stacks):
    before = overrides._get_current_function_mode_stack()
    user = _UserFunctionMode()
    t = torch.tensor(2.0)
    with leanstep.audit() as a:
        user.__enter__()
        t.item()
    stack = overrides._get_current_function_mode_stack()
    assert _audit_modes(stack) == [] and stack == before + [user], stack
    assert a.num_host_reads == 1
    t.item()
    assert a.num_host_reads == 1 and a.num_syncs == 1
    user.__exit__(None, None, None)
    assert overrides._get_current_function_mode_stack() == before


def test_nested_audits_each_remove_their_own_modes_under_a_user_mode(mode_stacks):
    user = _UserDispatchMode()
    x = torch.ones(2)
    with leanstep.audit() as outer:
        with leanstep.audit() as inner:
            user.__enter__()
            x + 1
        x * 2
    assert pd._get_current_dispatch_mode_stack()[-1] is user
    assert _audit_modes(pd._get_current_dispatch_mode_stack()) == []
    assert dict(inner.ops) == {"aten.add.Tensor": 1}
    assert dict(outer.ops) == {"aten.add.Tensor": 1, "aten.mul.Tensor": 1}
    x - 1
    assert outer.num_ops == 2 and inner.num_ops == 1
    user.__exit__(None, None, None)


def test_exiting_a_mode_entered_before_the_audit_inside_it_is_an_error(mode_stacks):
    earlier = _UserDispatchMode()
    earlier.__enter__()
    x = torch.ones(2)
    with pytest.raises(Error, match=r"leanstep.audit: its TorchDispatchMode was no longer on "
                                    r"torch's mode stack.*exited a mode entered before the audit"):
        with leanstep.audit() as a:
            earlier.__exit__(None, None, None)  # pops the audit's mode, not its own
    assert _audit_modes(pd._get_current_dispatch_mode_stack()) == []
    assert _audit_modes(overrides._get_current_function_mode_stack()) == []
    n = a.num_ops
    x + 1
    assert a.num_ops == n
