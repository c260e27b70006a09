"""The lean host path: decisions made once and reused, tensors handed over
from C through DLPack's exchange table, grad lists keyed from C. Each reuse
must give what the full path gives, and anything that can change between
calls (hooks, autocast, offload, the weight's requires_grad, a negated view,
re-pointed grads) must be seen."""

import struct
import sys
import types
import warnings

import pytest

import torch

import leanstep
import leanstep.torch as lt
from leanstep import _backend, _leanstep


FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _oracle(x, weight, eps):
    x64 = x.double()
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rstd * weight.double()


# ---------------------------------------------------------------- RMSNorm


def _module(width, dtype, frozen=True, **kwargs):
    m = lt.RMSNorm(width, eps=1e-6, dtype=dtype, **kwargs)
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5)
    m.weight.requires_grad_(not frozen)
    return m


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("frozen", [True, False])
def test_the_decided_path_gives_the_full_paths_bits(dtype, frozen, torch_gen, rng):
    width = int(rng.integers(1, 300))
    rows = int(rng.integers(0, 40))
    m = _module(width, dtype, frozen)
    results = []
    for call in range(3):  # the first call decides; the next ones reuse the decision
        x = torch.randn(rows, width, generator=torch_gen).to(dtype).requires_grad_(True)
        if call == 0:
            first = x
        x = first.detach().clone().requires_grad_(True)
        dy = torch.ones(rows, width, dtype=dtype)
        y = m(x)
        y.backward(dy)
        results.append((y.detach(), x.grad, None if frozen else m.weight.grad.clone()))
        m.weight.grad = None
        if call == 0:
            assert "_lean" in m.__dict__  # decided
    for y, dx, dw in results[1:]:
        assert torch.equal(y, results[0][0]) and torch.equal(dx, results[0][1])
        assert (dw is None) == frozen and (frozen or torch.equal(dw, results[0][2]))
    # Against the float64 oracle: one rounding of the output's dtype, times a few
    # (the fp32 rstd and the fp32 products before it).
    expected = _oracle(first.detach(), m.weight.detach(), 1e-6)
    bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert torch.allclose(results[1][0].double(), expected, rtol=bound, atol=bound)


def test_no_grad_calls_reuse_the_decision_and_count_each_call():
    m = _module(64, torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    leanstep.reset_paths()
    with torch.no_grad():
        ys = [m(x) for _ in range(5)]
    assert all(torch.equal(y, ys[0]) for y in ys)
    calls = leanstep.paths()["ops"]["rmsnorm.forward"]["calls"]
    assert calls == {"cpu": {"cpu": 5}}
    assert m.last_decision["path"] == "frozen_fused"


def test_a_hook_added_after_the_decision_is_honoured():
    m = _module(32, torch.float32)
    x = torch.randn(4, 32)
    m(x)
    assert "_lean" in m.__dict__
    seen = []
    handle = m.register_forward_hook(lambda mod, inp, out: seen.append(out))
    y = m(x)
    assert seen and seen[0] is y
    assert m.last_decision["path"] == "torch"  # the full path delegated for the hook
    handle.remove()
    m(x)
    assert m.last_decision["path"] == "frozen_fused"
    glob = torch.nn.modules.module.register_module_forward_hook(lambda *a: seen.append("g"))
    try:
        m(x)
        assert seen[-1] == "g"
    finally:
        glob.remove()
    # Every kind of global hook, each checked on its own (the decided path names each).
    module_api = torch.nn.modules.module
    for register in (module_api.register_module_forward_pre_hook,
                     module_api.register_module_forward_hook,
                     module_api.register_module_full_backward_pre_hook,
                     module_api.register_module_full_backward_hook):
        m(x)
        assert m.last_decision["path"] == "frozen_fused"
        handle = register(lambda *a: None)
        try:
            m(x)
            assert m.last_decision["path"] == "torch", register.__name__
        finally:
            handle.remove()


def test_autocast_and_offload_after_the_decision_go_to_the_full_path():
    m = _module(32, torch.float32)
    x = torch.randn(4, 32, requires_grad=True)
    m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m(x)
    assert m.last_decision["path"] == "torch"
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        m(x).sum().backward()
    assert m.last_decision["path"] == "torch"
    m(x)
    assert m.last_decision["path"] == "frozen_fused"


def test_the_weight_becoming_trainable_gets_its_gradient():
    m = _module(16, torch.float32)
    x = torch.randn(3, 16, requires_grad=True)
    m(x).sum().backward()
    assert m.weight.grad is None
    m.weight.requires_grad_(True)
    m(x).sum().backward()
    ref = torch.nn.functional.rms_norm(x.detach(), [16], m.weight.detach().requires_grad_(True),
                                       1e-6)
    assert m.weight.grad is not None and m.last_decision["path"] == "general"
    w = m.weight.detach().clone().requires_grad_(True)
    torch.nn.functional.rms_norm(x.detach(), [16], w, 1e-6).sum().backward()
    assert torch.allclose(m.weight.grad, w.grad, rtol=1e-5, atol=1e-6)
    del ref


def test_a_new_dtype_or_width_decides_again():
    m = _module(16, torch.float32)
    m(torch.randn(2, 16))
    first = m.__dict__["_lean"]
    m(torch.randn(2, 16).to(torch.float16))  # the weight stays fp32: a mixed call
    assert m.__dict__["_lean"] is not first
    with pytest.raises(RuntimeError):
        m(torch.randn(2, 17))  # torch's own error, as before


def _decided_fp32(width, rows, torch_gen):
    """(module, x, its decision) after one no_grad call."""
    m = _module(width, torch.float32)
    x = torch.randn(rows, width, generator=torch_gen)
    with torch.no_grad():
        m(x)
    return m, x, m.__dict__["_lean"]


def _assert_norm_of(y, expected, instead):
    """y is the fp32 norm `expected` (float64 oracle; a few roundings of the fp32 rstd and
    products, as the first test's bound), far from `instead`."""
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y.double(), instead, rtol=1e-3, atol=1e-3)


def test_an_option_set_after_the_decision_decides_again(torch_gen):
    # The decided path reads no option per call: setting one drops the decision.
    m, x, decided = _decided_fp32(24, 5, torch_gen)
    with torch.no_grad():
        m.train()
        m.eval()  # .train() / .eval() (each step in some trainers) keep the decision
        m(x)
        assert m.__dict__["_lean"] is decided
        m.eps = 0.5  # large enough to move every output far past fp32 rounding
        expected = _oracle(x, m.weight, 0.5)
        _assert_norm_of(m(x), expected, _oracle(x, m.weight, 1e-6))
        m.zero_centered_gamma = True  # g = 1 + weight from now on
        _assert_norm_of(m(x), _oracle(x, 1.0 + m.weight.double(), 0.5), expected)


def test_a_weight_placed_in_parameters_directly_is_the_one_used(torch_gen):
    # `_parameters["weight"] = p` skips __setattr__: the decided path still sees it.
    m, x, decided = _decided_fp32(16, 3, torch_gen)
    new = torch.nn.Parameter(torch.rand(16, generator=torch_gen) + 0.5, requires_grad=False)
    m._parameters["weight"] = new
    with torch.no_grad():
        y = m(x)
    assert m.__dict__["_lean"] is not decided
    _assert_norm_of(y, _oracle(x, new, 1e-6), _oracle(x, decided.weight, 1e-6))


def test_a_copied_or_pickled_module_decides_for_itself(torch_gen, tmp_path):
    import copy

    m = _module(16, torch.bfloat16)
    x = torch.randn(3, 16, generator=torch_gen).to(torch.bfloat16)
    with torch.no_grad():
        y = m(x)
        assert "_lean" in m.__dict__
        twin = copy.deepcopy(m)
        assert "_lean" not in twin.__dict__ and "_lean" in m.__dict__
        torch.save(m, tmp_path / "m.pt")
        loaded = torch.load(tmp_path / "m.pt", weights_only=False)
        assert "_lean" not in loaded.__dict__
        leanstep.reset_paths()
        for module in (twin, loaded):
            assert torch.equal(module(x), y)
            assert torch.equal(module(x), y)  # decided now: its own weight, its own count
            assert module.__dict__["_lean"].weight is module.weight
    assert _backend.calls()["rmsnorm.forward"] == {"cpu": {"cpu": 4}}


def test_decided_paths_count_every_call_across_resets(torch_gen):
    # Lean calls are counted by tallies (one `next` each) beside the router's
    # records: both show in paths() and reasons, and a reset zeroes both.
    m = _module(32, torch.bfloat16)
    x = torch.randn(4, 32, generator=torch_gen).to(torch.bfloat16)
    tokens = torch.randn(6, 8, generator=torch_gen)
    routing = torch.zeros(6, 3, dtype=torch.bool)
    routing[torch.arange(6), torch.arange(6) % 3] = True
    with torch.no_grad():
        m(x)  # decides
        leanstep.reset_paths()
        for _ in range(3):
            m(x)
            lt.permute(tokens, routing)
    report = leanstep.paths()["ops"]
    assert report["rmsnorm.forward"]["calls"] == {"cpu": {"cpu": 3}}
    assert report["moe.permute"]["calls"] == {"cpu": {"cpu": 3}}
    reasons = _backend.reasons()
    assert sum(reasons["rmsnorm.forward"]["cpu"]["cpu"].values()) == 3
    assert reasons["moe.permute"]["cpu"]["cpu"] == {"CPU tensors": 3}
    leanstep.reset_paths()
    assert "rmsnorm.forward" not in _backend.calls() and "moe.permute" not in _backend.calls()
    with torch.no_grad():
        m(x)
    assert _backend.calls()["rmsnorm.forward"] == {"cpu": {"cpu": 1}}
    with pytest.raises(leanstep.Error, match="not in the op table"):
        _backend.tally("rmsnorm.sideways", "cpu", "cpu")


def test_a_negated_view_is_not_read_as_its_memory():
    # DLPack's exchange table hands over the un-negated memory: the decided path
    # gives such a view to the full path, whose clear error it gets.
    m = _module(8, torch.float32)
    x = torch.randn(4, 8)
    m(x)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    with pytest.raises(leanstep.Error, match="negative bit"):
        m(neg)
    assert torch.equal(m(neg.resolve_neg()), m(-x))


def test_the_negative_bit_is_read_whatever_the_tensor_class_and_after_is_neg_changes(
        monkeypatch):
    # The extension calls is_neg's C function straight, found once per type and kept
    # while the type's version tag stands: a Parameter (another type, the same C
    # function) is read too, and replacing Tensor.is_neg (which changes that tag) is
    # seen on the next call.
    x = torch.randn(4, 8)
    w = torch.nn.Parameter(torch.ones(8), requires_grad=False)
    y = torch.empty_like(x)
    _leanstep.rmsnorm_forward_lean(x, w, y, None, 1e-6, False, False, False)
    with pytest.raises(TypeError):
        _leanstep.rmsnorm_forward_lean(torch._neg_view(x), w, y, None, 1e-6, False, False,
                                       False)
    asked = []
    real_is_neg = torch.Tensor.is_neg

    def counted_is_neg(t):
        asked.append(type(t))
        return real_is_neg(t)

    monkeypatch.setattr(torch.Tensor, "is_neg", counted_is_neg)
    _leanstep.rmsnorm_forward_lean(x, w, y, None, 1e-6, False, False, False)
    assert asked.count(torch.Tensor) == 2 and asked.count(torch.nn.Parameter) == 1
    with pytest.raises(TypeError):
        _leanstep.rmsnorm_forward_lean(torch._neg_view(x), w, y, None, 1e-6, False, False,
                                       False)
    monkeypatch.undo()
    asked.clear()
    _leanstep.rmsnorm_forward_lean(x, w, y, None, 1e-6, False, False, False)
    assert asked == []
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, expected, rtol=2**-20, atol=2**-20)


def test_the_lean_entry_points_check_their_arguments():
    x = torch.randn(4, 8)
    w = torch.ones(8)
    y = torch.empty_like(x)
    r = torch.empty(4)
    with pytest.raises(leanstep.Error, match="argument 'x' must be contiguous"):
        _leanstep.rmsnorm_forward_lean(x[:, :4], w[:4], y[:, :4], r, 1e-6, False, False, False)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        _leanstep.rmsnorm_forward_lean("x", w, y, r, 1e-6, False, False, False)
    # A negated view is refused where it is handed over (its memory is not its values).
    with pytest.raises(TypeError):
        _leanstep.rmsnorm_forward_lean(torch._neg_view(x), w, y, r, 1e-6, False, False, False)


# ---------------------------------------------------------------- grad-list keys


def test_a_list_key_names_address_shape_strides_dtype_and_device():
    buf = torch.zeros(64)
    base = [buf[0:8], buf[8:24].view(4, 4)]
    h, key = _leanstep.tensor_list_key(base)
    assert _leanstep.tensor_list_key([buf[0:8], buf[8:24].view(4, 4)]) == (h, key)
    others = [
        [buf[0:16:2], buf[8:24].view(4, 4)],          # same address and numel, strides differ
        [buf[0:8].view(2, 4), buf[8:24].view(4, 4)],  # shape differs
        [buf[1:9], buf[8:24].view(4, 4)],             # address differs
        [buf[0:8], buf[8:24].view(4, 4).t()],         # strides differ
        [buf[0:8].view(torch.int32), buf[8:24].view(4, 4)],  # dtype differs
        [buf[0:8]],                                   # length differs
    ]
    for other in others:
        assert _leanstep.tensor_list_key(other)[1] != key
    assert _leanstep.tensor_list_key([torch.zeros(2, device="meta")]) is None
    assert _leanstep.tensor_list_key([]) is not None


def test_grads_and_key_reads_the_named_attribute_in_order():
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(4)]
    grads = [torch.full((3,), float(i)) for i in range(4)]
    for p, g in zip(params, grads):
        p.grad = g
    params[1].grad = None
    out, h, key = _leanstep.grads_and_key(params, "grad")
    assert [id(g) for g in out] == [id(grads[0]), id(grads[2]), id(grads[3])]
    assert (h, key) == _leanstep.tensor_list_key(out)
    assert _leanstep.grads_and_key(params, "decoupled_grad")[0] == []
    counted, skipped = object(), object()
    for i, p in enumerate(params):
        vars(p)["flag"] = counted if i != 2 else skipped
    out, _, _ = _leanstep.grads_and_key(params, "grad", "flag", counted, skipped)
    assert [id(g) for g in out] == [id(grads[0]), id(grads[3])]
    del vars(params[3])["flag"]
    assert _leanstep.grads_and_key(params, "grad", "flag", counted, skipped) is False
    with pytest.raises(TypeError):
        _leanstep.grads_and_key(iter(params), "grad")


def test_grads_match_key_answers_as_grads_and_key_would():
    """grads_match_key(params, name, key) holds exactly when grads_and_key would give
    `key`; it returns the index-th grad that is not None. It answers only where no
    read runs Python (torch's own getter, a plain instance attribute): a property is
    never called, and its list is no match (the general pass, which holds what it
    reads, decides)."""
    buf = torch.arange(40, dtype=torch.float32)
    params = [types.SimpleNamespace(grad=None) for _ in range(5)]

    def point(grads):
        for p, g in zip(params, grads):
            p.grad = g

    point([buf[0:8], None, buf[8:24].view(4, 4), buf[24:25], buf[25:40]])
    _, _, key = _leanstep.grads_and_key(params, "grad")
    point([buf[0:8], None, buf[8:24].view(4, 4), buf[24:25], buf[25:40]])  # fresh views
    assert _leanstep.grads_match_key(params, "grad", key) is True
    assert _leanstep.grads_match_key(tuple(params), "grad", key) is True
    assert _leanstep.grads_match_key(params, "grad", key, 0).data_ptr() == buf.data_ptr()
    assert _leanstep.grads_match_key(params, "grad", key, 1) is params[2].grad  # None skipped
    assert _leanstep.grads_match_key(params, "grad", key, 4) is None  # 4 grads
    changes = [
        [buf[1:9], None, buf[9:25].view(4, 4), buf[25:26], buf[26:40]],   # moved
        [buf[0:8], None, buf[8:24].view(4, 4).t(), buf[24:25], buf[25:40]],  # strides
        [buf[0:8], None, buf[8:24], buf[24:25], buf[25:40]],              # shape
        [buf[0:8], buf[8:9], buf[8:24].view(4, 4), buf[24:25], buf[25:40]],  # one more
        [buf[0:8], None, buf[8:24].view(4, 4), buf[24:25], None],         # one fewer
        [buf[0:8], None, buf[8:24].view(4, 4), buf[24:25], buf[25:39]],   # last one shorter
        [buf[0:8], None, buf[8:24].view(4, 4), buf[24:25].double(), buf[25:40]],  # dtype
    ]
    for grads in changes:
        point(grads)
        assert _leanstep.grads_match_key(params, "grad", key) is None
        assert _leanstep.grads_match_key(params, "grad", key, 0) is None
        assert _leanstep.grads_and_key(params, "grad")[2] != key
    point([buf[0:8], None, buf[8:24].view(4, 4), buf[24:25], buf[25:40]])
    assert _leanstep.grads_match_key(params[:-1], "grad", key) is None  # the key goes on
    assert _leanstep.grads_match_key(params, "grad", key + key[-8:]) is None
    assert _leanstep.grads_match_key(params, "grad", key[:-8]) is None
    assert _leanstep.grads_match_key(params, "grad", b"") is None
    assert _leanstep.grads_match_key([], "grad", b"") is True
    assert _leanstep.grads_match_key([torch.nn.Parameter(torch.zeros(2))],
                                     "grad", b"") is True  # no grad: the empty key

    reads = []

    class Computed:
        @property
        def grad(self):
            reads.append(1)
            return buf[0:8]

    class Held:
        def __init__(self, grad):
            self.grad = grad

    assert _leanstep.grads_match_key([Computed()] + params[1:], "grad", key) is None
    assert reads == []  # never called
    assert _leanstep.grads_match_key([Held(buf[0:8])] + params[1:], "grad", key) is True

    class Subclass(torch.Tensor):
        pass

    sub = Subclass(torch.zeros(8))
    sub.grad = buf[0:8]  # torch's getter on a subclass: its __torch_function__ may run
    assert _leanstep.grads_match_key([sub] + params[1:], "grad", key) is None
    owner = torch.nn.Parameter(torch.zeros(8))
    owner.grad = buf[0:8]
    assert _leanstep.grads_match_key([owner] + params[1:], "grad", key) is True
    meta = types.SimpleNamespace(grad=torch.zeros(8, device="meta"))
    assert _leanstep.grads_match_key([meta], "grad", key) is None  # no description: no match
    with pytest.raises(TypeError):
        _leanstep.grads_match_key(iter(params), "grad", key)
    # name None: the items are the grads (tensor_list_key's list; a None is no match).
    tensors = [buf[0:8], buf[8:24].view(4, 4), buf[24:25]]
    _, tensors_key = _leanstep.tensor_list_key(tensors)
    fresh = [buf[0:8], buf[8:24].view(4, 4), buf[24:25]]
    assert _leanstep.grads_match_key(fresh, None, tensors_key) is True
    assert _leanstep.grads_match_key(fresh, None, tensors_key, 2) is fresh[2]
    assert _leanstep.grads_match_key(fresh[:2] + [None], None, tensors_key) is None
    assert _leanstep.grads_match_key(fresh[:2] + [buf[25:26]], None, tensors_key) is None
    assert _leanstep.grads_match_key(fresh, None, key) is None
    with pytest.raises(TypeError):
        _leanstep.grads_match_key(fresh, 3, tensors_key)


def test_grads_match_key_through_a_selection_compares_its_counted_params_only():
    """With ids and counted (a remembered selection), grads_match_key compares the key
    of the counted params' grads, and answers None for any other list (an entry
    replaced, one more or fewer), as selected_grads_and_key answers False."""
    buf = torch.arange(32, dtype=torch.float32)
    params = [types.SimpleNamespace(grad=buf[8 * i:8 * (i + 1)]) for i in range(4)]
    ids = struct.pack("4P", *map(id, params))
    mask = bytes([1, 0, 1, 1])
    _, _, key = _leanstep.grads_and_key([params[0], params[2], params[3]], "grad")
    for i, p in enumerate(params):
        p.grad = buf[8 * i:8 * (i + 1)]  # fresh views
    assert _leanstep.grads_match_key(params, "grad", key, -1, ids, mask) is True
    assert _leanstep.grads_match_key(params, "grad", key, 1, ids, mask) is params[2].grad
    params[1].grad = buf[1:3]  # not counted: not compared
    assert _leanstep.grads_match_key(params, "grad", key, -1, ids, mask) is True
    params[3].grad = buf[24:31]  # counted and resized
    assert _leanstep.grads_match_key(params, "grad", key, -1, ids, mask) is None
    params[3].grad = buf[24:32]
    other = list(params)
    other[1] = types.SimpleNamespace(grad=buf[8:16])
    assert _leanstep.grads_match_key(other, "grad", key, -1, ids, mask) is None
    assert _leanstep.grads_match_key(params[:-1], "grad", key, -1, ids, mask) is None
    assert _leanstep.grads_match_key(params + params[:1], "grad", key, -1, ids, mask) is None
    with pytest.raises(ValueError, match="one address and one byte"):
        _leanstep.grads_match_key(params, "grad", key, -1, ids, mask[:-1])
    with pytest.raises(TypeError, match="both given"):
        _leanstep.grads_match_key(params, "grad", key, -1, ids, None)
    with pytest.raises(TypeError, match="both given"):
        _leanstep.grads_match_key(params, None, key, -1, ids, mask)


def test_region_base_is_the_grads_base_only_where_it_is_exactly_the_region():
    """region_base(grad, dtype, address, numel) is the tensor grad views (grad itself
    when it is no view) where that tensor is one compact 1-d region of that dtype at
    that address, of that numel, that does not require grad; every other case is
    None, each checked on its own."""
    buf = torch.randn(40)
    address, grad = buf.data_ptr(), buf[8:24]
    assert _leanstep.region_base(grad, "float32", address, 40) is buf
    assert _leanstep.region_base(grad.view(4, 4), "float32", address, 40) is buf  # a view's view
    assert _leanstep.region_base(buf, "float32", address, 40) is buf  # no view: itself
    assert _leanstep.region_base(grad, "float32", address + 4, 40) is None  # address
    assert _leanstep.region_base(grad, "float32", address, 39) is None  # numel
    assert _leanstep.region_base(grad, "bfloat16", address, 40) is None  # dtype
    assert _leanstep.region_base(grad, "float64", address, 40) is None
    assert _leanstep.region_base(buf[8:].view(torch.int32), "int32", address, 40) is None
    square = torch.randn(8, 5)
    assert _leanstep.region_base(square[1], "float32", square.data_ptr(), 40) is None  # 2-d
    strided = torch.randn(80)[::2]
    assert _leanstep.region_base(strided, "float32", strided.data_ptr(), 40) is None
    leaf = torch.randn(40, requires_grad=True)
    assert _leanstep.region_base(leaf[8:24], "float32", leaf.data_ptr(), 40) is None  # requires grad
    param = torch.nn.Parameter(torch.randn(40), requires_grad=False)
    assert _leanstep.region_base(param[8:24], "float32", param.data_ptr(), 40) is param

    class Sub(torch.Tensor):
        pass

    sub = buf.as_subclass(Sub)
    assert _leanstep.region_base(sub[8:24], "float32", address, 40) is None  # not torch's own
    assert _leanstep.region_base(types.SimpleNamespace(), "float32", address, 40) is None


def test_plan_cache_recalls_a_sites_last_plan_for_the_same_memory_only():
    """PlanCache.recall finds the CPU plan a site remembered when the grads cover the
    same memory; another site, a forced backend, another layout or a cleared cache
    find none. A torch-op plan is remembered where it views one region through
    one grad's base (below), not where it has several regions (views with gaps)."""
    from leanstep._plans import PlanCache, grads_with_key

    buf = torch.randn(48)
    params = [torch.nn.Parameter(torch.zeros(15)) for _ in range(3)]

    def fresh(shift=0):
        for i, p in enumerate(params):
            p.grad = buf[shift + 16 * i:shift + 16 * i + 15]

    cache = PlanCache()
    fresh()
    grads, key = grads_with_key(params)
    plan, reason = cache.get(grads, key=key)
    assert reason is None and plan.backend == "cpu"
    assert cache.recall("site", params) is None  # nothing remembered yet
    cache.remember("site", key, grads)
    fresh()
    recalled = cache.recall("site", params)
    assert recalled is not None and recalled.backend == "cpu"
    assert recalled._like is params[0].grad  # outputs made like the grads
    before = buf.clone()
    recalled.scale_(2.0)  # the grads' memory, and only theirs
    covered = torch.zeros(48, dtype=torch.bool)
    for i in range(3):
        covered[16 * i:16 * i + 15] = True
    assert torch.equal(buf, torch.where(covered, before * 2, before))
    from torch.overrides import TorchFunctionMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    fresh()
    with Passing():  # a grad's read may run the mode's Python: never recalled there
        assert cache.recall("site", params) is None
    assert cache.recall("site", params) is not None
    assert cache.recall("another site", params) is None
    fresh(shift=1)
    assert cache.recall("site", params) is None
    fresh()
    cache.backend = "torch"
    assert cache.recall("site", params) is None
    grads, key = grads_with_key(params)
    plan, _ = cache.get(grads, key=key)
    assert plan.backend == "torch"
    cache.remember("torch site", key, grads)
    assert cache.recall("torch site", params) is None
    cache.backend = None
    assert cache.recall("site", params) is not None
    cache.clear()
    assert cache.recall("site", params) is None


def test_plan_cache_recalls_a_torch_op_plan_through_its_buffers_base():
    """A torch-op plan over views laid end to end over a whole buffer is recalled
    with the buffer (the first grad's base) and scales exactly that memory; where
    the memory is the same but its base is no longer the region (a 2-d tensor at
    the same address), the recall binds nothing, and the site's memory is dropped
    (the general path decides); the general path's plan for such grads is not
    remembered, so no later call makes a pass in vain."""
    import leanstep._plans as plans_module
    from leanstep._plans import PlanCache, grads_with_key

    storage_owner = torch.randn(48)
    params = [torch.nn.Parameter(torch.zeros(16)) for _ in range(3)]

    def fresh(base):
        flat = base.view(-1)
        for i, p in enumerate(params):
            p.grad = flat[16 * i:16 * (i + 1)]

    cache = PlanCache()
    cache.backend = "torch"
    fresh(storage_owner)
    grads, key = grads_with_key(params)
    plan, reason = cache.get(grads, key=key)
    assert reason is None and plan.backend == "torch" and plan._recall_index(grads) == 0
    cache.remember("site", key, grads)
    fresh(storage_owner)
    recalled = cache.recall("site", params)
    assert recalled is not None and recalled.backend == "torch"
    before = storage_owner.clone()
    recalled.scale_(0.5)
    assert torch.equal(storage_owner, before * 0.5)
    same_memory_2d = torch.empty(0).set_(storage_owner.untyped_storage(), 0, (24, 2))
    fresh(same_memory_2d)
    assert grads_with_key(params)[1] == key  # the same memory, by its key
    assert cache.recall("site", params) is None
    fresh(storage_owner)
    assert cache.recall("site", params) is None  # dropped: not tried again
    grads, key = grads_with_key(params)
    plan, reason = cache.get(grads, key=key)  # the general path still takes them
    assert reason is None
    plan.scale_(2.0)
    assert torch.equal(storage_owner, before)
    passes = []
    matched = plans_module.grads_match_key

    def spy(*args):
        passes.append(1)
        return matched(*args)

    plans_module.grads_match_key = spy
    try:
        fresh(same_memory_2d)
        grads, key = grads_with_key(params)
        plan, reason = cache.get(grads, key=key)
        assert reason is None and plan._recall_index(grads) is None
        cache.remember("site", key, grads)  # not recallable: the site keeps none
        fresh(same_memory_2d)
        assert cache.recall("site", params) is None and passes == []
        fresh(storage_owner)
        grads, key = grads_with_key(params)
        cache.get(grads, key=key)
        cache.remember("site", key, grads)
        fresh(storage_owner)
        assert cache.recall("site", params) is not None and passes == [1]
    finally:
        plans_module.grads_match_key = matched


def test_grads_and_key_reads_grad_as_getattr_does_for_every_type():
    # The pass calls torch's `grad` getter straight for a run of one type: a type that
    # overrides `grad` (a property), a type changed between calls, a param whose getter
    # raises, and a mixed list must each read as getattr(p, "grad", None) does.
    class Overridden(torch.nn.Parameter):
        @property
        def grad(self):
            return self._other

    class Plain(torch.nn.Parameter):
        pass

    buf = torch.arange(40.0)
    params = [torch.nn.Parameter(torch.zeros(4)), Overridden(torch.zeros(4)),
              Plain(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4)), Plain(torch.zeros(4))]
    for i, p in enumerate(params):
        if type(p) is Overridden:
            p._other = buf[8 * i:8 * i + 4]
        else:
            p.grad = buf[8 * i:8 * i + 4]
    expected = [getattr(p, "grad", None) for p in params]
    out, h, key = _leanstep.grads_and_key(params, "grad")
    assert [id(g) for g in out] == [id(g) for g in expected]
    assert (h, key) == _leanstep.tensor_list_key(expected)

    Plain.grad = property(lambda self: None)  # the type changed: its getter is looked up again
    try:
        out, _, _ = _leanstep.grads_and_key(params, "grad")
        assert [id(g) for g in out] == [id(expected[i]) for i in (0, 1, 3)]
    finally:
        del Plain.grad
    out, _, _ = _leanstep.grads_and_key(params, "grad")
    assert [id(g) for g in out] == [id(g) for g in expected]

    class Raising(torch.nn.Parameter):
        @property
        def grad(self):
            raise RuntimeError("no grad here")

    with pytest.raises(RuntimeError, match="no grad here"):
        _leanstep.grads_and_key(params[:2] + [Raising(torch.zeros(1))], "grad")


def test_grads_and_key_sees_a_type_changed_during_the_pass():
    # The getter is remembered for a run of one type; a type changed by Python code the
    # pass itself runs (here the filter attribute's property, read before each grad) must
    # be looked up again, as getattr would.
    counted, skipped = object(), object()
    alternate = torch.arange(4.0)

    class Changing(torch.nn.Parameter):
        @property
        def flag(self):
            if self.change_type:
                type(self).grad = property(lambda p: alternate)
            return counted

    params = [Changing(torch.zeros(4)) for _ in range(3)]
    for i, p in enumerate(params):
        p.grad = torch.full((4,), float(i))
        p.change_type = i == 1
    expected_first = params[0].grad
    try:
        out, _, _ = _leanstep.grads_and_key(params, "grad", "flag", counted, skipped)
        assert [id(g) for g in out] == [id(expected_first), id(alternate), id(alternate)]
    finally:
        if "grad" in vars(Changing):
            del Changing.grad


def test_grads_and_key_survives_a_list_changed_during_the_pass():
    # A property that empties the list mid-pass: no read past its end, no crash.
    counted, skipped = object(), object()
    params = []

    class Emptying(torch.nn.Parameter):
        @property
        def flag(self):
            params.clear()
            return counted

    params.extend(Emptying(torch.zeros(2)) for _ in range(4))
    for p in params:
        p.grad = torch.ones(2)
    out, _, _ = _leanstep.grads_and_key(params, "grad", "flag", counted, skipped)
    assert len(out) == 1


def test_grads_and_key_takes_a_list_grown_during_the_pass():
    # The grads' list is allocated for the params the pass starts with; a property that
    # appends params mid-pass makes it append past that, every grad in order, once.
    counted, skipped = object(), object()
    params = []

    class Growing(torch.nn.Parameter):
        @property
        def flag(self):
            if len(params) < 6:
                extra = torch.nn.Parameter(torch.zeros(2))
                extra.grad = torch.full((2,), float(len(params)))
                vars(extra)["flag"] = counted
                params.append(extra)
            return counted

    params.extend(Growing(torch.zeros(2)) for _ in range(3))
    for i, p in enumerate(params):
        p.grad = torch.full((2,), float(-i))
    inside = params[0].grad  # a grad moved into the list's room
    before = sys.getrefcount(inside)
    out, h, key = _leanstep.grads_and_key(params, "grad", "flag", counted, skipped)
    assert len(params) == 6 and [id(g) for g in out] == [id(p.grad) for p in params]
    assert (h, key) == _leanstep.tensor_list_key(out)
    past = params[5].grad  # one appended past it
    assert sys.getrefcount(inside) == before + 1  # the list's own reference, one
    past_refs = sys.getrefcount(past)
    for _ in range(3):  # the list the pass returns is a list like any other
        out.append(out[0])
    assert len(out) == 9
    del out
    assert sys.getrefcount(inside) == before and sys.getrefcount(past) == past_refs - 1


def test_selected_grads_and_key_reads_the_counted_params_of_the_named_list():
    # The remembered form of grads_and_key's filter: the same grads and key for the
    # list it names; False for any other list (an entry replaced, shorter, longer).
    counted, skipped = object(), object()
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(5)]
    buf = torch.arange(15.0)
    for i, p in enumerate(params):
        p.grad = buf[3 * i:3 * i + 3]
        vars(p)["flag"] = skipped if i == 3 else counted
    params[1].grad = None
    ids = struct.pack(f"{len(params)}P", *map(id, params))
    mask = bytes(vars(p)["flag"] is counted for p in params)
    got = _leanstep.selected_grads_and_key(params, "grad", ids, mask)
    assert got[1:] == _leanstep.grads_and_key(params, "grad", "flag", counted, skipped)[1:]
    assert [id(g) for g in got[0]] == [id(params[i].grad) for i in (0, 2, 4)]
    assert _leanstep.selected_grads_and_key(tuple(params), "grad", ids, mask)[1:] == got[1:]
    other = list(params)
    other[2] = torch.nn.Parameter(torch.zeros(3))
    assert _leanstep.selected_grads_and_key(other, "grad", ids, mask) is False
    assert _leanstep.selected_grads_and_key(params[:-1], "grad", ids, mask) is False
    assert _leanstep.selected_grads_and_key(params + params[:1], "grad", ids, mask) is False
    meta = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
    meta[0].grad = torch.zeros(2, device="meta")
    assert _leanstep.selected_grads_and_key(
        meta, "grad", struct.pack("P", id(meta[0])), b"\x01") is None
    with pytest.raises(ValueError, match="'ids' and 'counted'"):
        _leanstep.selected_grads_and_key(params, "grad", ids, mask[:-1])
    with pytest.raises(ValueError, match="'ids' and 'counted'"):
        _leanstep.selected_grads_and_key(params, "grad", ids[:-1], mask)
    with pytest.raises(TypeError, match="'params'"):
        _leanstep.selected_grads_and_key(iter(params), "grad", ids, mask)


def test_selected_grads_and_key_survives_a_list_changed_during_the_pass():
    # A grad getter that empties the list mid-pass: no read past its end, and the
    # answer is False (the list is no longer the one named).
    params = []

    class Emptying(torch.nn.Parameter):
        @property
        def grad(self):
            params.clear()
            return torch.ones(2)

    params.extend(Emptying(torch.zeros(2)) for _ in range(4))
    ids = struct.pack(f"{len(params)}P", *map(id, params))
    assert _leanstep.selected_grads_and_key(params, "grad", ids, b"\x01" * 4) is False


def test_keys_are_exact_under_random_views(torch_gen, rng):
    # Random views of random buffers: two lists have one key exactly when every
    # view has the same address, dtype, shape and strides.
    bufs = [torch.zeros(int(rng.integers(16, 64))) for _ in range(3)]

    def random_view():
        b = bufs[int(rng.integers(0, 3))]
        start = int(rng.integers(0, 8))
        step = int(rng.integers(1, 3))
        n = int(rng.integers(0, 4))
        return b[start:start + step * n:step]

    lists = [[random_view() for _ in range(int(rng.integers(0, 4)))] for _ in range(300)]
    meta = [tuple((v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype) for v in lst)
            for lst in lists]
    keys = [_leanstep.tensor_list_key(lst)[1] for lst in lists]
    for i in range(len(lists)):
        for j in range(i + 1, min(len(lists), i + 40)):
            assert (keys[i] == keys[j]) == (meta[i] == meta[j]), (meta[i], meta[j])
    assert any(keys[i] == keys[j] for i in range(len(keys)) for j in range(i))  # some equal


def test_keys_are_exact_for_views_laid_end_to_end(torch_gen, rng):
    # Grad lists as a DDP buffer gives them: views end to end, which the key writes in one
    # word each (a record "adjacent to the previous"). Perturbed lists (a gap, an overlap, a
    # 2-d or strided view, a dtype, a second buffer) must key alike exactly when every
    # view's address, dtype, shape and strides are alike.
    bufs = [torch.zeros(512), torch.zeros(512)]

    def end_to_end_list():
        views, start = [], int(rng.integers(0, 3))
        which = int(rng.integers(0, 2))
        buf = bufs[which]
        for _ in range(int(rng.integers(0, 7))):
            n = int(rng.integers(0, 9))
            kind = int(rng.integers(0, 10))
            if kind == 0:
                start += int(rng.integers(-2, 3))  # a gap or an overlap
                start = max(start, 0)
            view = buf[start:start + n]
            if kind == 1 and n % 2 == 0 and n:
                view = view.view(2, n // 2)
            elif kind == 2 and n % 2 == 0 and n:
                view = view.view(2, n // 2).t()  # same memory, strides differ
            elif kind == 3:
                view = view.view(torch.int32)
            elif kind == 4:
                which = 1 - which  # the same offsets in the other buffer
                buf = bufs[which]
                view = buf[start:start + n]
            elif kind == 5:
                view = buf[start:start + 2 * n:2]
            views.append(view)
            start += n
        return views

    lists = [end_to_end_list() for _ in range(400)]
    meta = [tuple((v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype) for v in lst)
            for lst in lists]
    keys = [_leanstep.tensor_list_key(lst)[1] for lst in lists]
    equal = 0
    for i in range(len(lists)):
        for j in range(i + 1, len(lists)):
            assert (keys[i] == keys[j]) == (meta[i] == meta[j]), (meta[i], meta[j])
            equal += keys[i] == keys[j]
    assert equal > 0
    # A fresh list of fresh views of one buffer keys alike, in one word a view after the
    # first (the key's size is part of what this test pins: a record per view is 8 bytes).
    buf = bufs[0]
    a = [buf[i * 16:(i + 1) * 16] for i in range(32)]
    b = [buf[i * 16:(i + 1) * 16] for i in range(32)]
    assert _leanstep.tensor_list_key(a) == _leanstep.tensor_list_key(b)
    assert len(_leanstep.tensor_list_key(a)[1]) == 8 * (7 + 31)
    b[17] = buf[17 * 16 + 1:18 * 16 + 1]  # one view moved by an element
    assert _leanstep.tensor_list_key(a)[1] != _leanstep.tensor_list_key(b)[1]


def _plan_facts(core):
    return (core.summary(), core.regions, core.generic, core.num_tensors, core.num_empty,
            core.first_self_overlapping, core.listed_bytes, core.touched_bytes)


def test_a_plan_read_back_from_a_key_is_the_plan_of_its_tensors(torch_gen, rng):
    # Fresh grads each step are planned from the key the cache read (the tensors are not
    # described a second time): the plan from the key must be the plan from the tensors,
    # region for region, under random lists of every shape of record (views end to end,
    # gaps, overlaps, 2-d, transposed, strided, expanded, 0-d, empty, every dtype,
    # separate tensors), and its norm and scale the same bits.
    from leanstep._leanstep import GradPlanCore

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    bufs = {d: torch.randn(600, generator=torch_gen).to(d) for d in dtypes}

    def random_list():
        views, start = [], int(rng.integers(0, 3))
        dtype = dtypes[int(rng.integers(0, 4))]
        for _ in range(int(rng.integers(0, 9))):
            buf, n = bufs[dtype], int(rng.integers(0, 9))
            kind = int(rng.integers(0, 12))
            if kind == 0:
                start = max(start + int(rng.integers(-3, 4)), 0)
            view = buf[start:start + n]
            if kind == 1 and n % 2 == 0 and n:
                view = view.view(2, n // 2)
            elif kind == 2 and n % 2 == 0 and n:
                view = view.view(2, n // 2).t()
            elif kind == 3:
                view = buf[start:start + 2 * n:2]
            elif kind == 4:
                view = torch.randn(int(rng.integers(0, 5)), 3, generator=torch_gen).to(dtype)
            elif kind == 5:
                view = buf[start]  # 0-d
            elif kind == 6:
                dtype = dtypes[int(rng.integers(0, 4))]
                view = bufs[dtype][start:start + n]
            elif kind == 7 and n:
                view = buf[start:start + 1].expand(n)  # self-overlapping
            views.append(view)
            start += n
        return views

    read_back = 0
    for _ in range(300):
        views = random_list()
        _, key = _leanstep.tensor_list_key(views)
        names = tuple(dict.fromkeys(str(v.dtype).removeprefix("torch.") for v in views))
        assert _leanstep.key_facts(key) == (True, names)
        from_key, from_tensors = GradPlanCore.from_key(key), GradPlanCore(views, [])
        assert _plan_facts(from_key) == _plan_facts(from_tensors), [
            (v.dtype, tuple(v.shape), v.stride(), v.data_ptr()) for v in views]
        # The generic (strided) views' strides too: the norms read the same elements.
        norms = [torch.empty(1), torch.empty(1)]
        from_key.norm(norms[0], 1.0, None)
        from_tensors.norm(norms[1], 1.0, None)
        assert torch.equal(norms[0], norms[1])
        read_back += bool(views)
    assert read_back > 200
    # Through the cache, on fresh grads: the same norm and clip as a plan of the tensors.
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 17, 1, 100, 5)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=torch_gen)
    twins = [p.grad.clone() for p in params]
    expected = leanstep.GradPlan(twins)
    expected_norm = expected.total_norm(2.0)
    expected.scale_(0.37)
    norm = lt.clip_grad_norm_(params, 1e9)  # planned from the key on a miss
    assert norm.item() == expected_norm.item()
    from leanstep._torch_clip import plans
    plan, _ = plans.get([p.grad for p in params])
    plan.scale_(0.37)
    for p, t in zip(params, twins):
        assert torch.equal(p.grad, t)


def test_a_key_that_is_not_one_is_refused():
    from leanstep._leanstep import GradPlanCore

    buf = torch.zeros(8)
    # Records: buf[0:4] whole (7 words), buf[4:8] adjacent to it (1), a 2-d tensor whole (9).
    _, key = _leanstep.tensor_list_key([buf[0:4], buf[4:8], torch.zeros(2, 2)])
    assert len(key) == 8 * 17
    for bad, match in [(key[:-3], "whole 64-bit words"), (key[:-8], "ends inside a record"),
                       (key[56:64], "starts with an adjacent record"),
                       (b"\x00" * 8, "no record starts with the tag")]:
        with pytest.raises(leanstep.Error, match="tensors_from_key: .*" + match):
            GradPlanCore.from_key(bad)
        with pytest.raises(leanstep.Error, match="key_facts: .*" + match):  # names its caller
            _leanstep.key_facts(bad)
    assert GradPlanCore.from_key(b"").num_tensors == 0
    _, key = _leanstep.tensor_list_key([torch.zeros(2, dtype=torch.int32), torch.zeros(2),
                                        torch.zeros(2, dtype=torch.complex64)])
    assert _leanstep.key_facts(key) == (True, ("other", "float32"))


# ---------------------------------------------------------------- MoE permute / unpermute


def _routing(tokens, experts, topk, gen, dtype):
    scores = torch.rand(tokens, experts, generator=gen)
    topk = min(topk, experts)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool)
    if tokens:
        routing_map.scatter_(1, scores.topk(topk, dim=1).indices, True)
    probs = torch.where(routing_map, scores, 0.0).to(dtype)
    return routing_map, probs


def _permute_round_trip(tokens, routing_map, probs, dout, num_out, **kwargs):
    tokens = tokens.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    permuted, permuted_probs, idx = lt.permute(tokens, routing_map, probs, num_out, **kwargs)
    # permuted_probs feeds the loss too, so both backward kernels of permute run
    out = lt.unpermute(permuted * 2, idx, tokens.shape, probs, routing_map, **kwargs)
    (out.float() * dout.float()).sum().add((permuted_probs.float() ** 2).sum()).backward()
    return out.detach(), permuted.detach(), idx, tokens.grad, probs.grad


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_lean_moe_path_gives_the_general_paths_bits(dtype, torch_gen, rng):
    # Random sizes (empty included), fresh seeds: the lean path (no backend, no method)
    # against the general one (method="fused": the same kernels through the router).
    for _ in range(4):
        t, h, e = int(rng.integers(0, 40)), int(rng.integers(1, 70)), int(rng.integers(1, 9))
        routing_map, probs = _routing(t, e, int(rng.integers(1, 4)), torch_gen, dtype)
        tokens = torch.randn(t, h, generator=torch_gen).to(dtype)
        dout = torch.randn(t, h, generator=torch_gen).to(dtype)
        routed = int(routing_map.sum())
        num_out = None if rng.integers(0, 2) else routed + int(rng.integers(0, 3))
        leanstep.reset_paths()
        lean = _permute_round_trip(tokens, routing_map, probs, dout, num_out)
        calls = _backend.calls()
        for op in ("moe.permute", "moe.unpermute", "moe.unpermute_backward",
                   "moe.permute_backward", "moe.permute_probs_backward"):
            assert calls[op] == {"cpu": {"cpu": 1}}, (op, calls.get(op))
        general = _permute_round_trip(tokens, routing_map, probs, dout, num_out, method="fused")
        for a, b in zip(lean, general):
            assert a.dtype == b.dtype and torch.equal(a, b)
        # float64 oracle of the forward: each token's routed rows times 2 * prob
        out, _, _, dtokens, dprobs = lean
        p64 = probs.double() * routing_map
        expected = (tokens.double() * 2) * p64.sum(1, keepdim=True)
        bound = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        # three roundings (permuted * 2 exact, the product and the sum in fp32, the cast)
        assert torch.allclose(out.double(), expected, rtol=bound, atol=bound)
        assert dtokens.shape == tokens.shape and dprobs.shape == probs.shape


def test_the_lean_moe_path_skips_gradients_nobody_asked_for(torch_gen):
    routing_map, probs = _routing(16, 4, 2, torch_gen, torch.float32)
    tokens = torch.randn(16, 8, generator=torch_gen, requires_grad=True)
    leanstep.reset_paths()
    permuted, _, idx = lt.permute(tokens, routing_map, probs)  # probs needs no grad
    lt.unpermute(permuted, idx, tokens.shape, probs, routing_map).sum().backward()
    calls = _backend.calls()
    # permuted_probs fed nothing: its backward did not run (it once ran on zeros)
    assert "moe.permute_probs_backward" not in calls and calls["moe.permute_backward"]
    expected = (probs * routing_map).sum(1, keepdim=True).expand(16, 8)
    assert torch.allclose(tokens.grad, expected, rtol=1e-6, atol=1e-6)


def _sort_chunks_round_trip(rows, split_sizes, order, probs, drows, dprobs, want, **kwargs):
    rows = rows.detach().clone().requires_grad_(want[0])
    probs = None if probs is None else probs.detach().clone().requires_grad_(want[1])
    out, out_probs = lt.sort_chunks_by_idxs(rows, split_sizes, order, probs, **kwargs)
    loss = (out.double() * drows.double()).sum() if want[0] else 0
    if probs is not None and want[1]:
        loss = loss + (out_probs.double() * dprobs.double()).sum()
    if want[0] or (probs is not None and want[1]):
        loss.backward()
    return (out.detach(), None if out_probs is None else out_probs.detach(), rows.grad,
            None if probs is None else probs.grad)


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_lean_sort_chunks_path_gives_the_general_paths_bits(dtype, torch_gen, rng):
    # Random chunk counts and sizes (empty chunks, no rows, rows past the chunks), with and
    # without probs, either gradient alone or both, fresh seeds: the lean path (one native
    # call each way, no router) against the general one (backend="cpu": the same kernel
    # through the router), and both against a plain-Python move (exact: rows are copied).
    for _ in range(6):
        chunks, h = int(rng.integers(1, 17)), int(rng.integers(1, 40))
        sizes = [int(v) for v in rng.integers(0, 6, size=chunks)]
        tail = int(rng.integers(0, 3))
        n = sum(sizes) + tail
        split_sizes = torch.tensor(sizes, dtype=torch.int64 if rng.integers(0, 2) else torch.int32)
        order = torch.from_numpy(rng.permutation(chunks)).to(split_sizes.dtype)
        rows = torch.randn(n, h, generator=torch_gen).to(dtype)
        probs = None if rng.integers(0, 2) else torch.rand(n, generator=torch_gen).to(dtype)
        drows = torch.randn(n, h, generator=torch_gen).to(dtype)
        dprobs = torch.randn(n, generator=torch_gen).to(dtype)
        want = [(True, True), (True, False), (False, True)][int(rng.integers(0, 3))]
        leanstep.reset_paths()
        lean = _sort_chunks_round_trip(rows, split_sizes, order, probs, drows, dprobs, want)
        calls = _backend.calls()["moe.sort_chunks_by_idxs"]
        backward = want[0] or (probs is not None and want[1])
        assert calls == {"cpu": {"cpu": 1 + backward}}, calls  # one native call each way
        general = _sort_chunks_round_trip(rows, split_sizes, order, probs, drows, dprobs, want,
                                          backend="cpu")
        for a, b in zip(lean, general):
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b))
        starts = [sum(sizes[:c]) for c in range(chunks)]
        moved = [i for c in order.tolist() for i in range(starts[c], starts[c] + sizes[c])]
        moved += list(range(sum(sizes), n))  # rows past the chunks keep their place
        assert torch.equal(lean[0], rows[moved])
        if probs is not None:
            assert torch.equal(lean[1], probs[moved])
        back = torch.empty(n, dtype=torch.int64)
        back[torch.tensor(moved, dtype=torch.int64)] = torch.arange(n)
        if want[0]:
            assert torch.equal(lean[2], drows[back])
        if probs is not None and want[1]:
            assert torch.equal(lean[3], dprobs[back])


def test_strided_negated_or_forced_moe_calls_take_the_general_path(torch_gen):
    routing_map, probs = _routing(12, 4, 2, torch_gen, torch.float32)
    base = torch.randn(8, 12, generator=torch_gen)
    tokens = base.t().requires_grad_(True)  # strided: the general path copies it
    permuted, _, idx = lt.permute(tokens, routing_map, probs)
    out = lt.unpermute(permuted, idx, tokens.shape, probs, routing_map)
    expected = tokens.detach() * (probs * routing_map).sum(1, keepdim=True)
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(leanstep.Error, match="negative bit"):  # never read as its memory
        lt.permute(torch._neg_view(base.t().contiguous()), routing_map, probs)
    with pytest.raises(leanstep.Error, match="negative bit"):
        lt.unpermute(torch._neg_view(permuted), idx, tokens.shape, probs, routing_map)
    with pytest.raises(leanstep.Error, match="restore_shape"):
        lt.unpermute(permuted, idx, (12, 5), probs, routing_map)
    with pytest.raises(leanstep.Error, match="num_out_tokens"):
        lt.permute(base.t().contiguous(), routing_map, probs, 3)  # fewer rows than routed


def _lean_in_python(t):
    """The lean MoE path's rule for one tensor, as torch reads it."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cpu
            and t.dtype in _backend.cpu_dtypes() and t.is_contiguous() and not t.is_neg())


class _TensorSubclass(torch.Tensor):
    pass


def test_the_native_lean_check_is_the_python_rule(torch_gen, rng):
    """lean_cpu_tensors against the same rule read through torch, on random
    views (size-1 dims with odd strides, empty, transposed, sliced, expanded),
    every dtype, negated views, subclasses, Parameters and meta tensors."""
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
              torch.float8_e4m3fn]
    seen = {True: 0, False: 0}
    for _ in range(400):
        dims = int(rng.integers(0, 4))
        shape = [int(rng.choice([0, 1, 1, 2, 3, 5])) for _ in range(dims)]
        dtype = dtypes[int(rng.integers(len(dtypes)))]
        base = torch.zeros([s + 2 for s in shape], dtype=dtype)
        kind = int(rng.integers(7))
        if kind == 0:
            t = base[tuple(slice(0, s) for s in shape)]  # strided unless all dims tiny
        elif kind == 1 and dims >= 2:
            t = base[tuple(slice(0, s) for s in shape)].contiguous().transpose(0, 1)
        elif kind == 2:
            t = torch.empty_strided(shape, [int(rng.integers(1, 9)) for _ in shape], dtype=dtype)
        elif kind == 3 and dims >= 1:
            t = torch.zeros(shape[:-1] + [1], dtype=dtype).expand(shape)
        elif kind == 4 and dtype.is_floating_point and dtype != torch.float8_e4m3fn:
            t = torch._neg_view(torch.zeros(shape, dtype=dtype))
        elif kind == 5:
            t = torch.zeros(shape, dtype=dtype).as_subclass(_TensorSubclass)
        else:
            t = torch.zeros(shape, dtype=dtype)
        if rng.integers(4) == 0 and dtype.is_floating_point and not t.is_neg() \
                and type(t) is torch.Tensor:
            t = torch.nn.Parameter(t, requires_grad=False)
        expected = _lean_in_python(t)
        assert _leanstep.lean_cpu_tensors(t) is expected, (kind, shape, t.stride(), dtype)
        seen[expected] += 1
        # With other arguments: every one must pass, None stands for an absent one.
        ok = torch.zeros(3)
        assert _leanstep.lean_cpu_tensors(ok, None, t) is expected
        assert _leanstep.lean_cpu_tensors(t, ok) is expected
    assert seen[True] > 50 and seen[False] > 50  # both answers were exercised
    assert _leanstep.lean_cpu_tensors() is True
    assert _leanstep.lean_cpu_tensors(None) is True
    assert _leanstep.lean_cpu_tensors(torch.zeros(2, device="meta")) is False
    assert _leanstep.lean_cpu_tensors(torch.zeros(2).numpy()) is False  # not a torch tensor


def test_a_forward_without_rstd_writes_only_y(torch_gen):
    # rstd=None: the kernel's rstd goes to a per-thread scratch; y is the same bits
    x = torch.randn(37, 129, generator=torch_gen).to(torch.bfloat16)
    w = torch.rand(129, generator=torch_gen).to(torch.bfloat16)
    y0, y1 = torch.empty_like(x), torch.empty_like(x)
    rstd = torch.empty(37)
    _leanstep.rmsnorm_forward_lean(x, w, y0, rstd, 1e-6, False, False, False)
    _leanstep.rmsnorm_forward_lean(x, w, y1, None, 1e-6, False, False, False)
    assert torch.equal(y0, y1)
    big = torch.randn(3000, 129, generator=torch_gen).to(torch.bfloat16)  # the scratch grows
    y2 = torch.empty_like(big)
    _leanstep.rmsnorm_forward_lean(big, w, y2, None, 1e-6, False, False, False)
    expected = _oracle(big, w, 1e-6)
    assert torch.allclose(y2.double(), expected, rtol=1.6e-2, atol=1.6e-2)
    empty = torch.empty(0, 129, dtype=torch.bfloat16)
    _leanstep.rmsnorm_forward_lean(empty, w, torch.empty_like(empty), None, 1e-6, False, False,
                                   False)


# ---------------------------------------------------------------- the Megatron patch's norms


def _megatron_style(width, dtype, gen):
    # as the WrappedTorchNorm patch builds them: torch's forward kept, leanstep's dx,
    # a trainable weight left to torch
    base = torch.nn.RMSNorm(width, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.rand(width, generator=gen) + 0.5)
    base.weight.requires_grad_(False)
    return base, lt.RMSNorm.from_torch(base, frozen_only=True, exact_forward=True)


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_exact_forward_norms_decide_once_and_keep_torchs_bits(dtype, torch_gen, rng):
    width = int(rng.integers(1, 200))
    base, m = _megatron_style(width, dtype, torch_gen)
    full = lt.RMSNorm.from_torch(base, frozen_only=True, exact_forward=True)
    shape = (int(rng.integers(0, 9)), int(rng.integers(1, 5)), width)  # [s, b, h]
    for call in range(3):
        x = torch.randn(shape, generator=torch_gen).to(dtype)
        dy = torch.randn(shape, generator=torch_gen).to(dtype)
        a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        leanstep.reset_paths()
        y = m(a)
        assert "_lean" in m.__dict__ and m.last_decision["forward"] == "torch_order"
        assert _backend.calls()["rmsnorm.forward"] == {"cpu": {"cpu": 1}}
        full.__dict__.pop("_lean", None)  # the full path every time
        y_full = full(b)
        assert torch.equal(y, base(x))  # torch's own forward, bit for bit
        y.backward(dy)
        y_full.backward(dy)
        assert torch.equal(a.grad, b.grad)
        with torch.no_grad():
            assert torch.equal(m(x), y)
    assert m.weight.grad is None


# Widths past each branch of torch's order: scalars (< 8), a vector tail, groups of 4
# vectors, one and several cascade runs (>= 512 and 1024), the second level's carry
# (>= 8192), and the widest the kernel takes (32767).
_TORCH_ORDER_WIDTHS = [1, 2, 5, 7, 8, 9, 16, 24, 31, 32, 33, 64, 128, 255, 256, 511, 512, 1000,
                       1024, 1056, 2048, 4097, 8192, 8200, 16384, 32767]


@pytest.mark.parametrize("dtype", FLOATS)
def test_the_kernel_in_torchs_order_gives_torchs_bits(dtype, torch_gen, rng):
    # Against torch's own CPU rms_norm (aten._fused_rms_norm, which torch.nn.RMSNorm
    # runs): y and rstd bit for bit, fresh seeds, random row counts (0 included) and
    # scales from 1e-3 to 1e3; and within the float64 oracle's bound.
    widths = _TORCH_ORDER_WIDTHS + [int(w) for w in rng.integers(1, 3000, size=4)]
    for width in widths:
        rows = int(rng.integers(1, 6))
        scale = float(10.0 ** rng.uniform(-3, 3))
        x = (torch.randn(rows, width, generator=torch_gen) * scale).to(dtype)
        w = (torch.rand(width, generator=torch_gen) + 0.5).to(dtype)
        eps = float(rng.choice([1e-6, 1e-5, 1e-3]))
        expected, expected_rstd = torch.ops.aten._fused_rms_norm(x, [width], w, eps)
        y, rstd = torch.empty_like(x), torch.empty(rows, dtype=torch.float32)
        for impl in ("fused", "reference"):
            _leanstep.rmsnorm_forward(x, w, y, rstd, eps, impl=impl, sum_order="torch_cpu")
            assert torch.equal(y, expected), (width, rows, impl)
            assert torch.equal(rstd, expected_rstd.reshape(rows)), (width, rows, impl)
        # float64 oracle: the fp32 statistics (n squares summed: n ulps at most, plus the
        # mean, eps, sqrt and division) and y's products, then one rounding to the dtype;
        # y is normalised (of order 1 whatever x's scale), and one rounding into the
        # dtype's subnormals is off by less than its smallest normal number (atol)
        bound = {torch.float32: 4e-6 + width * 1.2e-7, torch.float16: 2e-3,
                 torch.bfloat16: 1.6e-2}[dtype]
        if dtype is torch.float32:
            bound = min(bound, 1e-3)
        oracle = _oracle(x, w, eps)
        assert torch.allclose(y.double(), oracle, rtol=bound, atol=torch.finfo(dtype).tiny)
    # torch sums the rows of a large tensor on several threads, each row whole: the same bits
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # and many short rows (the fused forward's blocks and threads' chunks of them)
        for rows, width in ((64, 4096), (4096, 64), (1000, 16), (333, 24)):
            x = torch.randn(rows, width, generator=torch_gen).to(dtype)
            w = torch.rand(width, generator=torch_gen).to(dtype) + 0.5
            expected, expected_rstd = torch.ops.aten._fused_rms_norm(x, [width], w, 1e-6)
            y, rstd = torch.empty_like(x), torch.empty(rows, dtype=torch.float32)
            _leanstep.rmsnorm_forward(x, w, y, rstd, 1e-6, sum_order="torch_cpu")
            assert torch.equal(y, expected), (rows, width)
            assert torch.equal(rstd, expected_rstd.reshape(rows)), (rows, width)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="sum_order"):
        _leanstep.rmsnorm_forward(x, w, y, rstd, 1e-6, sum_order="ordered")


@pytest.mark.parametrize("dtype", FLOATS)
def test_decided_exact_norms_run_the_kernel_in_torchs_order(dtype, torch_gen, rng):
    width = int(rng.choice(_TORCH_ORDER_WIDTHS[:-1]))
    base, m = _megatron_style(width, dtype, torch_gen)
    x = torch.randn(3, 2, width, generator=torch_gen).to(dtype)
    m(x)  # decides
    assert m.__dict__["_lean"].torch_order
    for grad in (False, True):
        fresh = torch.randn(3, 2, width, generator=torch_gen).to(dtype).requires_grad_(grad)
        leanstep.reset_paths()
        y = m(fresh)
        assert m.last_decision["forward_kernel"] == "leanstep"
        assert torch.equal(y, base(fresh.detach()))
        if grad:
            dy = torch.randn(y.shape, generator=torch_gen).to(dtype)
            y.backward(dy)
            reference = fresh.detach().clone().requires_grad_(True)
            lt.RMSNorm.from_torch(base, frozen_only=True, exact_forward=True,
                                  backend="torch")(reference).backward(dy)
            assert torch.allclose(fresh.grad.float(), reference.grad.float(), rtol=2e-2,
                                  atol=2e-2)


@pytest.mark.parametrize("dtype", FLOATS)
def test_strided_q_k_views_are_decided_copied_and_keep_torchs_bits(dtype, torch_gen, rng):
    # k out of a fused qkv projection (Megatron's split of [s, b, groups, (q + 2) * head]):
    # a strided view. The exact module copies it and runs leanstep's kernels, decided
    # once; its forward is torch's on the view bit for bit, and the gradient reaches the
    # fused tensor's k columns only. dx against the float64 oracle: x * rstd * w per
    # row, then the dx of a product (a few ulps of the dtype, whose unit is 2^-7 in bf16:
    # 2e-2 relative, as the decided-path tests above).
    head = int(rng.choice([1, 7, 16, 33, 64, 128]))
    seq, groups, q_heads = int(rng.integers(1, 40)), int(rng.integers(1, 4)), 2
    if seq == groups == 1:
        seq = 2  # one row of one group is contiguous (size-1 dims): no strided view to test
    base, m = _megatron_style(head, dtype, torch_gen)
    fused = torch.randn(seq, 1, groups, (q_heads + 2) * head, generator=torch_gen).to(dtype)
    for call in range(3):
        mixed = fused.clone().requires_grad_(True)
        k = torch.split(mixed, [q_heads * head, head, head], dim=3)[1]
        assert not k.is_contiguous()
        y = m(k)
        assert m.last_decision["path"] == "frozen_fused", m.last_decision
        assert ("_lean" in m.__dict__) and not m.__dict__["_lean"].x_contiguous
        assert torch.equal(y, base(k.detach()))
        dy = torch.randn(y.shape, generator=torch_gen).to(dtype)
        y.backward(dy)
        x64, w64 = k.detach().double(), base.weight.detach().double()
        rstd = (x64.square().mean(-1, keepdim=True) + 1e-5).rsqrt()
        g = dy.double() * w64
        oracle = rstd * (g - x64 * rstd.square() * (g * x64).mean(-1, keepdim=True))
        grad_k = mixed.grad[..., q_heads * head:(q_heads + 1) * head]
        assert torch.allclose(grad_k.double(), oracle, rtol=2e-2, atol=2e-2 * oracle.abs().max()
                              .item() + 1e-6), call
        rest = mixed.grad.clone()
        rest[..., q_heads * head:(q_heads + 1) * head] = 0
        assert not rest.any()


def test_the_exact_forward_keeps_torchs_op_where_the_order_is_not_torchs(monkeypatch,
                                                                           torch_gen):
    # A torch whose sum runs another order: the probe sees other bits and the decided
    # path keeps torch's op (simulated by a kernel that sums in leanstep's own order).
    real = lt._rmsnorm_forward_lean
    monkeypatch.setattr(lt, "_rmsnorm_forward_lean",
                        lambda *args: real(*args[:8], False))
    monkeypatch.setattr(lt, "_torch_order_checks", {})
    base, m = _megatron_style(256, torch.bfloat16, torch_gen)
    x = torch.randn(16, 256, generator=torch_gen).bfloat16()
    m(x)
    assert not m.__dict__["_lean"].torch_order
    y = m(x)
    assert m.last_decision["forward_kernel"] == "torch" and torch.equal(y, base(x))
    wide = lt._torch_order_kernel_matches(torch.float32, 32768, 1e-5)
    assert wide is False  # wider than torch's grain: torch's op, whatever the probe says


def test_no_probe_runs_under_a_dispatch_mode(monkeypatch, torch_gen):
    # An audit's or op counter's mode would see the probe's ops: the decision made under
    # one keeps torch's op, and the probe waits for a decision outside any mode.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(lt, "_torch_order_checks", {})
    base, m = _megatron_style(48, torch.bfloat16, torch_gen)
    x = torch.randn(4, 48, generator=torch_gen).bfloat16()
    with Ops() as mode:
        y = m(x)
    assert not any("randn" in str(op) for op in mode.ops) and lt._torch_order_checks == {}
    assert not m.__dict__["_lean"].torch_order and torch.equal(y, base(x))
    m.__dict__.pop("_lean")
    m(x)
    assert m.__dict__["_lean"].torch_order and torch.equal(m(x), base(x))
    decided = m.__dict__["_lean"]
    with Ops() as mode:  # decided, under a mode: torch's op, which the mode sees
        y = m(x)
    assert torch.ops.aten.rsqrt.default in mode.ops and torch.equal(y, base(x))  # its ops
    assert m.__dict__["_lean"] is decided and m.last_decision["forward_kernel"] == "torch"
    m(x)
    assert m.last_decision["forward_kernel"] == "leanstep"


def test_a_trainable_weight_leaves_the_decided_exact_path_to_torch(torch_gen):
    base, m = _megatron_style(16, torch.float32, torch_gen)
    x = torch.randn(5, 16, generator=torch_gen)
    m(x.requires_grad_(True)).sum().backward()  # decided, frozen
    m.weight.requires_grad_(True)
    y = m(x)  # the signature (requires_grad) differs: the full path, torch's forward
    assert m.last_decision["path"] == "torch"
    y.sum().backward()
    expected = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        expected.weight.copy_(m.weight)
    expected(x.detach()).sum().backward()
    assert torch.allclose(m.weight.grad, expected.weight.grad, rtol=1e-6, atol=1e-6)
    # decided under no_grad with a trainable weight: a later call under autograd still
    # computes the weight's gradient (torch's path), never the frozen dx-only one
    _, m2 = _megatron_style(16, torch.float32, torch_gen)
    m2.weight.requires_grad_(True)
    with torch.no_grad():
        m2(x)
    assert "_lean" in m2.__dict__
    m2(x).sum().backward()
    assert m2.weight.grad is not None and m2.last_decision["path"] == "torch"


@pytest.mark.parametrize("exact", [False, True])
def test_decided_calls_under_make_fx_forward_ad_and_vmap_are_torchs(exact, torch_gen):
    # make_fx records torch ops, forward-mode AD carries their tangents, vmap batches them:
    # a decided call goes back to the full path there, which runs torch's forward (once
    # the C++ kernels' output was missing from make_fx's graph, which returned
    # uninitialised memory, and a tangent was dropped).
    import torch.autograd.forward_ad as forward_ad
    from torch.fx.experimental.proxy_tensor import make_fx

    base, m = _megatron_style(32, torch.float32, torch_gen)
    if not exact:
        m = lt.RMSNorm.from_torch(base)
    x = torch.randn(4, 32, generator=torch_gen)
    with torch.no_grad():
        m(x)
        assert "_lean" in m.__dict__
        graph = make_fx(lambda t: m(t))(x)
        fresh = torch.randn(4, 32, generator=torch_gen)
        assert torch.equal(graph(fresh), base(fresh))
    tangent = torch.randn(4, 32, generator=torch_gen)
    with forward_ad.dual_level():
        ours = forward_ad.unpack_dual(m(forward_ad.make_dual(x, tangent))).tangent
        torchs = forward_ad.unpack_dual(base(forward_ad.make_dual(x, tangent))).tangent
    assert ours is not None and torch.equal(ours, torchs)
    batch = torch.randn(3, 4, 32, generator=torch_gen)
    assert torch.equal(torch.func.vmap(m)(batch), torch.func.vmap(base)(batch))
    m(x)
    assert "_lean" in m.__dict__ and m.last_decision["path"] == "frozen_fused"


def test_functions_under_make_fx_and_forward_ad_run_the_torch_op_code(torch_gen):
    import torch.autograd.forward_ad as forward_ad
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(6, 40, generator=torch_gen)
    w = torch.rand(40, generator=torch_gen) + 0.5
    routing_map, probs = _routing(10, 4, 2, torch_gen, torch.float32)
    tokens = torch.randn(10, 12, generator=torch_gen)
    routed = int(routing_map.sum())  # given: make_fx refuses a count read from the map

    def round_trip(t, p):
        permuted, _, idx = lt.permute(t, routing_map, p, routed)
        return lt.unpermute(permuted * 2, idx, t.shape, p, routing_map)

    with torch.no_grad():
        norm_graph = make_fx(lambda a, b: lt.rms_norm(a, b, 1e-6))(x, w)
        moe_graph = make_fx(round_trip)(tokens, probs)
    fresh = torch.randn(6, 40, generator=torch_gen)
    assert torch.equal(norm_graph(fresh, w), lt.rms_norm(fresh, w, 1e-6, backend="torch"))
    fresh_tokens = torch.randn(10, 12, generator=torch_gen)
    assert torch.allclose(moe_graph(fresh_tokens, probs), round_trip(fresh_tokens, probs),
                          rtol=1e-6, atol=1e-6)
    tangent = torch.randn(6, 40, generator=torch_gen)
    with forward_ad.dual_level():
        ours = forward_ad.unpack_dual(lt.rms_norm(forward_ad.make_dual(x, tangent), w,
                                                  1e-6)).tangent
        torchs = forward_ad.unpack_dual(torch.nn.functional.rms_norm(
            forward_ad.make_dual(x, tangent), [40], w, 1e-6)).tangent
    assert ours is not None and torch.allclose(ours, torchs, rtol=1e-5, atol=1e-6)


def test_the_exact_forwards_probe_runs_on_the_cpu_whatever_the_default_device(monkeypatch,
                                                                               torch_gen):
    monkeypatch.setattr(lt, "_torch_order_checks", {})
    base, m = _megatron_style(40, torch.bfloat16, torch_gen)
    x = torch.randn(4, 40, generator=torch_gen).bfloat16()
    torch.set_default_device("meta")
    try:
        y = m(x)  # the first call, under a default-device mode: no probe
    finally:
        torch.set_default_device(None)
    assert torch.equal(y, base(x)) and not m.__dict__["_lean"].torch_order
    m.__dict__.pop("_lean")
    m(x)
    assert m.__dict__["_lean"].torch_order and torch.equal(m(x), base(x))
    assert lt._torch_order_probe(torch.float16, 300, 1e-5)  # the probe's own rows


def test_a_forward_patched_into_the_class_runs_on_decided_calls(monkeypatch, torch_gen):
    m = _module(16, torch.float32)
    x = torch.randn(4, 16, generator=torch_gen)
    with torch.no_grad():
        m(x)
        seen = []
        original = lt.RMSNorm.forward

        def patched(self, *args, **kwargs):
            seen.append(1)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(lt.RMSNorm, "forward", patched)
        m(x)
        m(x)
    assert len(seen) == 2


# ---------------------------------------------------------------- torch.jit.trace


def _trace(fn, args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jit.trace is deprecated in this torch; it still runs
        return torch.jit.trace(fn, args, check_trace=False)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("decided_first", [True, False])
def test_a_traced_rmsnorm_records_torchs_forward(dtype, decided_first, torch_gen):
    # A trace records torch ops only: the C++ kernels' output would be missing from it
    # (it once recorded only the output's empty_like, and the traced module returned
    # uninitialised memory). While tracing, the module runs torch's own forward.
    m = _module(48, dtype)
    x = torch.randn(5, 48, generator=torch_gen).to(dtype)
    with torch.no_grad():
        if decided_first:
            m(x)
            assert "_lean" in m.__dict__
        traced = _trace(m, (x,))
        for _ in range(3):
            fresh = torch.randn(5, 48, generator=torch_gen).to(dtype)
            expected = torch.nn.functional.rms_norm(fresh, [48], m.weight, 1e-6)
            assert torch.equal(traced(fresh), expected)
        # outside the trace the module is leanstep's again
        m(fresh)
        assert m.last_decision["path"] == "frozen_fused"


def test_a_trace_leaves_no_decision_behind(torch_gen):
    # A module of another convention runs leanstep's torch-op code while traced; its
    # eager calls afterwards run the C++ kernels again (the traced call decided nothing).
    m = lt.RMSNorm(48, zero_centered_gamma=True).requires_grad_(False)
    x = torch.randn(5, 48, generator=torch_gen)
    with torch.no_grad():
        m(x)
        assert m.__dict__["_lean"].backend == "cpu"
        traced = _trace(m, (x,))
        assert torch.allclose(traced(x), m(x), rtol=1e-6, atol=1e-6)
        m(x)
        assert m.last_decision["backend"] == "cpu" and m.__dict__["_lean"].backend == "cpu"


def test_traced_functions_record_the_torch_op_code(torch_gen):
    x = torch.randn(6, 40, generator=torch_gen)
    w = torch.rand(40, generator=torch_gen) + 0.5
    with torch.no_grad():
        traced = _trace(lambda a, b: lt.rms_norm(a, b, 1e-6), (x, w))
        fresh = torch.randn(6, 40, generator=torch_gen)
        assert torch.equal(traced(fresh, w), lt.rms_norm(fresh, w, 1e-6, backend="torch"))
        with pytest.raises(leanstep.Error, match="backend='cpu' cannot run under torch.jit.trace"):
            _trace(lambda a, b: lt.rms_norm(a, b, 1e-6, backend="cpu"), (x, w))
        logits = torch.randn(8, 4, generator=torch_gen)
        with pytest.raises(leanstep.Error, match=r"moe\.route has only the C\+\+ kernels"):
            _trace(lambda a: leanstep.moe_route(a, 2)[1], (logits,))
        routing_map, probs = _routing(10, 4, 2, torch_gen, torch.float32)
        tokens = torch.randn(10, 12, generator=torch_gen)

        def round_trip(t, p):
            permuted, _, idx = lt.permute(t, routing_map, p)
            return lt.unpermute(permuted * 2, idx, t.shape, p, routing_map)

        traced = _trace(round_trip, (tokens, probs))
        fresh = torch.randn(10, 12, generator=torch_gen)
        assert torch.allclose(traced(fresh, probs), round_trip(fresh, probs), rtol=1e-6,
                              atol=1e-6)


# ---------------------------------------------------------------- the module's own call


def test_the_decided_call_leaves_compiled_calls_to_nn_module(torch_gen):
    m = _module(32, torch.float32)
    x = torch.randn(4, 32, generator=torch_gen)
    with torch.no_grad():
        m(x)
        lean = m.__dict__["_lean"]
        calls = []

        def compiled(*args, **kwargs):
            calls.append(args)
            return torch.zeros(1)

        m.__dict__["_compiled_call_impl"] = compiled  # set past __setattr__: decision kept
        assert m.__dict__["_lean"] is lean
        assert m(x).shape == (1,) and len(calls) == 1
        del m.__dict__["_compiled_call_impl"]
        m.compile(backend="eager")  # the real one: its calls are torch's forward
        for _ in range(2):
            fresh = torch.randn(4, 32, generator=torch_gen)
            assert torch.equal(m(fresh), torch.nn.functional.rms_norm(fresh, [32], m.weight, 1e-6))
            assert m.last_decision["path"] == "torch"


def test_the_decided_call_runs_a_forward_set_on_the_instance(torch_gen):
    # A timer or accelerate's hooks replace the instance's forward: every call runs it.
    m = _module(16, torch.float32)
    x = torch.randn(4, 16, generator=torch_gen)
    with torch.no_grad():
        m(x)
        seen = []
        original = m.forward

        def timed(*args, **kwargs):
            seen.append(1)
            return original(*args, **kwargs)

        m.forward = timed
        for _ in range(3):
            y = m(x)
        assert len(seen) == 3 and "_lean" in m.__dict__  # decided again inside the wrapper
        assert torch.equal(y, lt.rms_norm(x, m.weight, 1e-6))


def test_the_decided_call_is_a_leaf_for_fx_and_takes_keywords(torch_gen):
    norm = _module(24, torch.bfloat16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(x) * 2

    net = Net()
    x = torch.randn(3, 24, generator=torch_gen).bfloat16()
    with torch.no_grad():
        net(x)
        assert "_lean" in norm.__dict__
        # fx takes the call through nn.Module's call, which it patches: with the norm a
        # leaf, the graph calls it as a module (traced through, its checks refuse a Proxy
        # loudly, TraceError, as before the module had a call of its own)
        class LeafNorms(torch.fx.Tracer):
            def is_leaf_module(self, module, name):
                return isinstance(module, lt.RMSNorm) or super().is_leaf_module(module, name)

        graph_module = torch.fx.GraphModule(net, LeafNorms().trace(net))
        assert [n.op for n in graph_module.graph.nodes if n.target == "norm"] == ["call_module"]
        with pytest.raises(torch.fx.proxy.TraceError):
            torch.fx.symbolic_trace(net)
        fresh = torch.randn(3, 24, generator=torch_gen).bfloat16()
        assert torch.equal(graph_module(fresh), net(fresh))
        assert torch.equal(norm(x=fresh), norm(fresh))  # a keyword call is nn.Module's


def test_a_grad_of_more_dims_than_a_view_holds_is_keyed_in_python_and_named():
    # A key record holds at most 8 dims (what a plan's view holds, and what
    # tensors_from_key reads back): a list with a 9-d grad is keyed in Python, and the
    # clip names the grad and the rule, as it did before plans were read from keys.
    grad9 = torch.zeros((1,) * 9)
    assert _leanstep.tensor_list_key([torch.zeros(2), grad9]) is None
    assert _leanstep.tensor_list_key([torch.zeros((1,) * 8)]) is not None
    p = torch.nn.Parameter(torch.zeros((1,) * 9))
    p.grad = grad9
    with pytest.raises(leanstep.Error, match="at most 8 dims"):
        lt.clip_grad_norm_([p], 1.0)
