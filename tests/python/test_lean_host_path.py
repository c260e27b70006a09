"""The lean host path: decisions made once and reused, tensors handed over
from C through DLPack's exchange table, grad lists keyed from C. Each reuse
must give what the full path gives, and anything that can change between
calls (hooks, autocast, offload, the weight's requires_grad, a negated view,
re-pointed grads) must be seen."""

import pytest
import torch

import leanstep
import leanstep.torch as lt
from leanstep import _leanstep


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
