"""Double backward through gradops (issue 17 item 3): every module, functional forward and backward op whose torch
counterpart supports double backward (``F.rms_norm``, ``native_layer_norm_backward``, ``hardswish_backward``,
``embedding_dense_backward``) passes ``gradgradcheck``, and a gradient penalty through a gradops module equals
torch's own.

Before: "Trying to backward through gradops.embedding_dense_backward.default but no autograd formula was
registered" (PyTorch's test_embedding_dense_grad), and "gradops.rms_norm_grad has no derivative" for the others.
The backward ops' derivatives are the reference formula's (``gradops.ops._double``), the embedding's an exact
gather. float64 (the PyTorch API computes it on the reference in float64); the backend fixture runs each case on
the reference and on the compiled CPU kernels (float64 plans onto the reference either way: the float32 cases at
the end are the kernels' check).
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import gradops
import gradops.nn as gnn
import module_cases as cases
from gradops.ops import _direct

F64 = cases.F64
IDX = cases.IDX
_x, _hardswish_input = cases.x64, cases.hardswish_input


def _positive(*shape):
    """A statistic such as rstd: positive, away from 0."""
    return (torch.rand(*shape, dtype=F64) + 0.5).requires_grad_()


MODULES = {
    **cases.MODULES,
    "Embedding-padding": lambda: (gnn.Embedding(6, 4, padding_idx=1).double(), (IDX,)),
    "Embedding-negative-padding": lambda: (gnn.Embedding(6, 4, padding_idx=-5).double(), (IDX,)),
    "Embedding-scale": lambda: (gnn.Embedding(6, 4, scale_grad_by_freq=True).double(), (IDX,)),
    "Embedding-padding-scale": lambda: (gnn.Embedding(6, 4, padding_idx=1, scale_grad_by_freq=True).double(),
                                        (IDX,)),
}


def _as_function(name: str):
    return cases.as_function(MODULES, name)


def _defined_gradient(name: str) -> bool:
    """Whether an embedding case's first backward is the forward's derivative, which gradcheck's finite
    differences can see: a padding row's gradient is zero and scale_grad_by_freq divides by the count by definition
    (torch's embedding fails gradcheck there too). Their backward is still a function whose own derivative
    gradgradcheck tests."""
    return not any(word in name for word in ("-padding", "-scale", "-float-indices")) or "outside-table" in name


@pytest.mark.parametrize("name", MODULES)
def test_modules(name, backend):
    f, tensors = _as_function(name)
    if _defined_gradient(name):
        assert gradcheck(f, tensors)
    assert gradgradcheck(f, tensors)


def _embedding(padding_idx=-1, scale=False, indices=IDX):
    return lambda w: gradops.embedding(w, indices, padding_idx, scale)


FUNCTIONS = {
    # every output, statistics included: their second derivatives reach x through the forward's drstd / dmean /
    # dvar terms
    "rms_norm": lambda: (lambda x, g: gradops.rms_norm(x, g, 1e-6), (_x(3, 8), _x(8))),
    "rms_norm-multidim-gamma": lambda: (lambda x, g: gradops.rms_norm(x, g), (_x(2, 3, 4), _x(3, 4))),
    "rms_norm-y-only": lambda: (lambda x, g: gradops.rms_norm(x, g)[0], (_x(4, 8), _x(8))),
    "layer_norm": lambda: (lambda x, g, b: gradops.layer_norm(x, g, b, 1e-5), (_x(3, 8), _x(8), _x(8))),
    "layer_norm-y-only": lambda: (lambda x, g, b: gradops.layer_norm(x, g, b)[0], (_x(2, 3, 8), _x(8), _x(8))),
    "hardswish": lambda: (gradops.hardswish, (_hardswish_input(5, 8),)),
    "hardswish-0d": lambda: (gradops.hardswish, (torch.tensor(1.7, dtype=F64, requires_grad=True),)),
    "embedding": lambda: (_embedding(), (_x(6, 3),)),
    "embedding-padding": lambda: (_embedding(padding_idx=1), (_x(6, 3),)),
    "embedding-padding-outside-table": lambda: (_embedding(padding_idx=9), (_x(6, 3),)),
    "embedding-scale": lambda: (_embedding(scale=True), (_x(6, 3),)),
    "embedding-padding-scale": lambda: (_embedding(padding_idx=1, scale=True), (_x(6, 3),)),
    "embedding-float-indices": lambda: (_embedding(2, True, torch.tensor([4.7, 0.2, 4.0, 2.9], dtype=F64)),
                                        (_x(5, 3),)),
    "embedding-0d-index": lambda: (_embedding(indices=torch.tensor(3)), (_x(5, 3),)),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_functional_forwards(name, backend):
    fn, inputs = FUNCTIONS[name]()
    if _defined_gradient(name):
        assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


def _edb(padding_idx=-1, scale=False, indices=IDX, num_weights=6):
    return lambda g: gradops.embedding_dense_backward(g, indices, num_weights, padding_idx, scale)


BACKWARD_OPS = {
    # gradgradcheck of a backward op is a third derivative of its forward: the derivative of the registered
    # double backward itself (the gather; the reference formula's vjp)
    "embedding_dense_backward": lambda: (_edb(), (_x(2, 3, 4),)),
    "embedding_dense_backward-padding": lambda: (_edb(padding_idx=1), (_x(2, 3, 4),)),
    "embedding_dense_backward-padding-outside-table": lambda: (_edb(padding_idx=-2), (_x(2, 3, 4),)),
    "embedding_dense_backward-scale": lambda: (_edb(scale=True), (_x(2, 3, 4),)),
    "embedding_dense_backward-padding-scale": lambda: (_edb(padding_idx=1, scale=True), (_x(2, 3, 4),)),
    "embedding_dense_backward-float-indices": lambda: (
        _edb(2, True, torch.tensor([4.7, 0.2, 4.0, 2.9, True], dtype=torch.float32), 5), (_x(5, 3),)),
    "embedding_dense_backward-bool-indices": lambda: (_edb(1, True, torch.tensor([True, False, True]), 3),
                                                      (_x(3, 2),)),
    "embedding_dense_backward-empty": lambda: (_edb(scale=True, indices=torch.zeros(0, dtype=torch.long)),
                                               (_x(0, 4),)),
    # rstd (and layer_norm_backward's mean) as given: independent inputs with their own gradient
    "rms_norm_grad": lambda: (gradops.rms_norm_grad, (_x(3, 8), _x(3, 8), _positive(3), _x(8))),
    "rms_norm_grad-keepdim-rstd": lambda: (gradops.rms_norm_grad, (_x(2, 3, 4), _x(2, 3, 4), _positive(2, 1, 1),
                                                                   _x(3, 4))),
    "layer_norm_backward": lambda: (gradops.layer_norm_backward, (_x(3, 8), _x(3, 8), _x(3), _positive(3), _x(8))),
    "layer_norm_backward-3d": lambda: (gradops.layer_norm_backward, (_x(2, 3, 5), _x(2, 3, 5), _x(2, 3),
                                                                     _positive(2, 3), _x(5))),
    "hardswish_backward": lambda: (gradops.hardswish_backward, (_x(5, 8), _hardswish_input(5, 8))),
}


# The MoE token movers (their backward ops raised "no autograd formula was registered" on a second backward).
_TOPK = torch.tensor([[0, 1], [1, 2], [2, 0], [1, 0]])
_ORDER = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4], dtype=torch.int32)
_MAP = torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1]], dtype=torch.bool)
MOE_FUNCTIONS = {
    "moe_token_permute": lambda: (lambda x: gradops.moe_token_permute(x, _TOPK)[0], (_x(4, 3),)),
    "moe_token_unpermute": lambda: (lambda p, w: gradops.moe_token_unpermute(p, _ORDER, w), (_x(8, 3), _x(4, 2))),
    "moe_token_unpermute-no-probs": lambda: (lambda p: gradops.moe_token_unpermute(p, _ORDER[:4].argsort().int()),
                                             (_x(4, 3),)),
    "moe_token_permute_with_routing_map": lambda: (
        lambda x, w: gradops.moe_token_permute_with_routing_map(x, _MAP, w, 8)[:2], (_x(4, 3), _x(4, 3))),
    "moe_token_unpermute_with_routing_map": lambda: (
        lambda p, w: gradops.moe_token_unpermute_with_routing_map(
            p, gradops.moe_token_permute_with_routing_map(torch.zeros(4, 3), _MAP, None, 8)[2], (4, 3), w, _MAP),
        (_x(8, 3), _x(4, 3))),
}


@pytest.mark.parametrize("name", MOE_FUNCTIONS)
def test_moe_second_derivatives(name, backend):
    fn, inputs = MOE_FUNCTIONS[name]()
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


@pytest.mark.parametrize("name", BACKWARD_OPS)
def test_backward_ops(name, backend):
    fn, inputs = BACKWARD_OPS[name]()
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


@pytest.fixture
def one_thread():
    """One intra-op thread: the float64 reference's ``index_add_`` (the first backward here) runs in parallel on
    two threads and, on a loaded 2-core machine, took ~60 ms a call instead of ~6 µs (2026-11-23), turning this
    test's ~1100 backward calls into minutes. The thread count changes no result."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_pytorch_embedding_dense_grad(backend, one_thread):
    """PyTorch's test_embedding_dense_grad (test/nn/test_embedding.py): gradcheck and gradgradcheck (slow mode, as
    PyTorch runs them) of an nn-style embedding's weight; it raised "no autograd formula was registered" for
    gradops.embedding_dense_backward."""
    weight = gnn.Embedding(20, 20).double().weight
    indices = torch.tensor([[0, 1, 1, 2], [3, 5, 7, 11]], dtype=torch.long)

    def fn(weight):
        return gradops.embedding(weight, indices)

    assert gradcheck(fn, (weight,))
    assert gradgradcheck(fn, (weight,))
    module = gnn.Embedding(20, 20).double()
    assert gradgradcheck(lambda w: torch.func.functional_call(module, {"weight": w}, (indices,)), (weight,))


def test_embedding_second_derivative_keeps_the_frequency_scale(backend):
    """With scale_grad_by_freq the backward is ``g_i / count[idx_i]``, and so is its derivative: a gradient
    penalty through gradops' embedding equals the same penalty on an explicit formula (index_add of the scaled
    rows), exactly the derivative ATen's double backward would give if it kept the scale (it drops it:
    FunctionsManual.cpp, "the first backward takes care of it")."""
    indices = torch.tensor([3, 1, 3, 3, 0, 1, 4])
    w0 = torch.randn(5, 4, dtype=F64)

    def penalty(lookup, weight):
        y = lookup(weight)
        (dw,) = torch.autograd.grad((y.sin() * torch.arange(1.0, 5.0, dtype=F64)).sum(), weight, create_graph=True)
        return (dw ** 3).sum()

    def explicit(weight):  # the forward with the scale spelled out in differentiable torch ops
        return _ScaledLookup.apply(weight, indices, 1)

    got_w = w0.clone().requires_grad_()
    penalty(lambda w: gradops.embedding(w, indices, 1, True), got_w).backward()
    want_w = w0.clone().requires_grad_()
    penalty(explicit, want_w).backward()
    torch.testing.assert_close(got_w.grad, want_w.grad, rtol=1e-12, atol=1e-12)


class _ScaledLookup(torch.autograd.Function):
    """``weight[indices]`` whose backward is the scaled, padded scatter-add written in differentiable torch ops
    (an oracle independent of gradops' registration)."""

    @staticmethod
    def forward(ctx, weight, indices, padding_idx):
        ctx.save_for_backward(indices)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return weight[indices]

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        counts = torch.bincount(indices, minlength=ctx.shape[0]).to(grad.dtype)
        keep = (indices != ctx.padding_idx).to(grad.dtype)[:, None]
        rows = grad * keep / counts[indices][:, None]
        return torch.zeros(ctx.shape, dtype=grad.dtype).index_add(0, indices, rows), None, None


def _penalty(module, x, params, create_graph_on):
    """A gradient penalty: ``sum(d loss / d on ** 2)`` for a non-trivial loss, backward into x and params."""
    y = module(x)
    loss = (y.sin() * torch.linspace(-1, 2, y.numel(), dtype=y.dtype).view(y.shape)).sum()
    (g,) = torch.autograd.grad(loss, create_graph_on, create_graph=True)
    (g.square().sum()).backward()
    return [p.grad for p in params]


def _pair(cls_g, cls_t, *args, **kwargs):
    torch.manual_seed(1)
    theirs = cls_t(*args, **kwargs).double()
    ours = cls_g(*args, **kwargs).double()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


PAIRS = {
}


@pytest.mark.parametrize("name", PAIRS)
def test_gradient_penalty_equals_torch_float64(name, backend):
    """Partial derivatives, not total ones: the penalty's dy depends on x (through the module's output), and the
    backward op's derivative must count x's own path once."""
    ours, theirs = PAIRS[name]()
    x0 = torch.randn(4, 8, dtype=F64) * 2
    grads = []
    for module in (ours, theirs):
        x = x0.clone().requires_grad_()
        params = [x, *module.parameters()]
        grads.append(_penalty(module, x, params, x))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_embedding_gradient_penalty_equals_torch_float64(backend):
    """Without scale_grad_by_freq ATen's double backward is the derivative, and gradops' equals it (padding row
    included)."""
    ours, theirs = _pair(gnn.Embedding, torch.nn.Embedding, 7, 4, padding_idx=2)
    idx = torch.tensor([[2, 0, 6], [6, 6, 1]])
    grads = [_penalty(m, idx, [m.weight], m.weight) for m in (ours, theirs)]
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-12, atol=1e-12)


def test_hardswish_second_derivative_at_the_kinks(backend):
    """The second derivative follows CANN's closed interval, as the first does: ``d/dx hardswish_backward(g, x)
    = g / 3`` on [-3, 3] (at -3 and 3 included; torch's formula gives 0 there), 0 outside."""
    x = torch.tensor([-3.5, -3.0, -1.0, 0.0, 3.0, 3.5], dtype=F64, requires_grad=True)
    g = torch.tensor([2.0, 3.0, -1.5, 0.75, 6.0, 9.0], dtype=F64)
    (dx,) = torch.autograd.grad(gradops.hardswish_backward(g, x), x, torch.ones_like(x))
    assert torch.equal(dx, torch.tensor([0.0, 1.0, -0.5, 0.25, 2.0, 0.0], dtype=F64))
    # through the module: d2y/dx2 = 1/3 on the closed interval
    y = gnn.Hardswish()(x)
    (d1,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), x)
    assert torch.equal(d2, torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 0.0], dtype=F64))


def test_plain_backward_builds_no_graph(backend):
    """Without create_graph the backward takes the fast path: gradients carry no graph; with it they do."""
    x = torch.randn(4, 8, requires_grad=True)
    for module in (gnn.RMSNorm(8), gnn.LayerNorm(8), gnn.Hardswish()):
        module(x).square().sum().backward()
        assert x.grad.grad_fn is None and not x.grad.requires_grad
        x.grad = None
        (g,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
        assert g.requires_grad and g.grad_fn is not None
    emb = gnn.Embedding(5, 3)
    emb(torch.tensor([1, 4, 1])).square().sum().backward()
    assert emb.weight.grad.grad_fn is None


def test_double_backward_through_the_custom_ops(backend):
    """The same derivatives through torch.library (the path tracing, modes and GRADOPS_EAGER=0 take)."""
    was = _direct._enabled
    _direct.set_enabled(False)
    try:
        for name in ("RMSNorm", "LayerNorm", "Hardswish", "Embedding-padding-scale"):
            f, tensors = _as_function(name)
            assert gradgradcheck(f, tensors), name
        fn, inputs = BACKWARD_OPS["embedding_dense_backward-padding-scale"]()
        assert gradgradcheck(fn, inputs)
    finally:
        _direct.set_enabled(was)


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "hardswish", "embedding"])
def test_second_order_under_torch_func(name, backend):
    """``jacrev(grad(f))`` (reverse over reverse) equals torch's counterpart: the registered derivatives run under
    functorch too."""
    b = torch.randn(8, dtype=F64)
    idx = torch.tensor([4, 0, 4, 2, 7])
    ours, theirs = {
        "rms_norm": (lambda x, g: gradops.rms_norm(x, g, 1e-6)[0],
                     lambda x, g: torch.nn.functional.rms_norm(x, (8,), g, 1e-6)),
        "layer_norm": (lambda x, g: gradops.layer_norm(x, g, b)[0],
                       lambda x, g: torch.nn.functional.layer_norm(x, (8,), g, b)),
        "hardswish": (lambda x, g: gradops.hardswish(x * 2) * g, lambda x, g: torch.nn.functional.hardswish(x * 2) * g),
        "embedding": (lambda x, g: gradops.embedding(x, idx, 2) * g,
                      lambda x, g: torch.nn.functional.embedding(idx, x, 2) * g),
    }[name]
    x, g = torch.randn(8, 8, dtype=F64), torch.randn(8, dtype=F64)
    got = torch.func.jacrev(torch.func.grad(lambda x, g: ours(x, g).sin().sum(), argnums=(0, 1)), argnums=(0, 1))(x, g)
    want = torch.func.jacrev(torch.func.grad(lambda x, g: theirs(x, g).sin().sum(), argnums=(0, 1)),
                             argnums=(0, 1))(x, g)
    for a, b_ in zip(got, want):
        for p, q in zip(a, b_):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- float32 on the backend named (compiled CPU kernels)
F32_PAIRS = {
}


@pytest.mark.parametrize("name", F32_PAIRS)
def test_float32_gradient_penalty_on_the_backend(name, backend):
    """float32 runs on the backend named (GRADOPS_BACKEND=cpu: the compiled kernels) for the first backward; a
    gradient penalty through the gradops module agrees with torch's module within float32 tolerance."""
    from gradops.families.rms_norm.ops import plan_rms_norm_grad

    ours, theirs = F32_PAIRS[name]()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(theirs.state_dict())
    x0 = torch.randn(16, 64) * 2
    grads = []
    for module in (ours, theirs):
        x = x0.clone().requires_grad_()
        grads.append(_penalty(module, x, [x, *module.parameters()], x))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert plan_rms_norm_grad(x0, x0, torch.ones(16), torch.ones(64)).backend.name == backend


def test_float32_embedding_penalty_on_the_backend(backend):
    ours, theirs = gnn.Embedding(50, 16, padding_idx=3), torch.nn.Embedding(50, 16, padding_idx=3)
    ours.load_state_dict(theirs.state_dict())
    idx = torch.randint(0, 50, (6, 9))
    idx[0, :2] = 3
    grads = [_penalty(m, idx, [m.weight], m.weight) for m in (ours, theirs)]
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)


OPCHECK = {
    "rms_norm_grad": lambda: (_x(3, 8), _x(3, 8), _positive(3), _x(8)),
    "layer_norm_backward": lambda: (_x(3, 8), _x(3, 8), _x(3), _positive(3), _x(8)),
    "hardswish_backward": lambda: (_x(3, 8), _hardswish_input(3, 8)),
    "embedding_dense_backward": lambda: (_x(4, 3), torch.tensor([1, 4, 1, 0]), 5, 1, True),
}


@pytest.mark.parametrize("op", OPCHECK)
def test_opcheck_backward_ops_with_grad(op):
    """The backward ops' registered derivatives pass torch.library.opcheck with inputs that require grad (the
    autograd registration, and AOT dispatch tracing the derivative). torch.compile itself refuses double backward
    ("torch.compile with aot_autograd does not currently support double backward", for torch's own modules too)."""
    torch.library.opcheck(getattr(torch.ops.gradops, op).default, OPCHECK[op]())
