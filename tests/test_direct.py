"""The eager fast path of gradops.ops._direct: taken only when nothing watches the call, and indistinguishable
from the registered custom op (same bits, same gradients, same errors) when it is."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import gradops
from gradops.status import OpError
from samples import OPS, samples
from test_ops import _as_tuple, _op_args

direct = importlib.import_module("gradops.ops._direct")

CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op)]
#: Forward ops with an autograd formula, and the float inputs a loss can reach through them.
DIFFERENTIABLE = {"rms_norm": (0, 1), "layer_norm": (0, 1, 2), "hardswish": (0,), "moe_token_permute": (0,)}


@pytest.mark.parametrize("op,sample", CASES)
def test_direct_call_equals_the_custom_op(op, sample, backend):
    assert direct.eager_path(*sample.args) == direct.BODY
    ours = _as_tuple(getattr(gradops, op)(*sample.args, **sample.kwargs))
    via_op = _as_tuple(getattr(torch.ops.gradops, op)(*_op_args(op, sample)))
    for a, b in zip(ours, via_op, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)


def _grads(fn, args: tuple, wrt: tuple[int, ...]) -> list[torch.Tensor]:
    leaves = [a.detach().clone().requires_grad_(i in wrt) if isinstance(a, torch.Tensor) and i in wrt else a
              for i, a in enumerate(args)]
    outs = _as_tuple(fn(*leaves))
    # A fixed, input-independent cotangent for the float outputs (the statistics included).
    loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum()
               for o in outs if o.is_floating_point())
    loss.backward()
    return [leaves[i].grad for i in wrt]


@pytest.mark.parametrize("op,sample", [c for c in CASES if c.values[0] in DIFFERENTIABLE])
def test_eager_autograd_equals_the_custom_ops_formula(op, sample, backend):
    """The eager autograd.Function and the op's registered autograd share setup_context / backward: same bits."""
    args = _op_args(op, sample)
    wrt = tuple(i for i in DIFFERENTIABLE[op] if args[i].is_floating_point())
    requires = [args[i].detach().requires_grad_() for i in wrt]
    assert direct.eager_path(*requires) == direct.FUNCTION
    ours = _grads(getattr(gradops, op), args, wrt)
    via_op = _grads(getattr(torch.ops.gradops, op), args, wrt)
    for a, b in zip(ours, via_op, strict=True):
        assert torch.equal(a, b)


def test_embedding_gradients_equal_the_custom_ops():
    weight, idx = torch.randn(7, 5), torch.tensor([[1, 2, 2], [0, 6, 1]])
    ours = _grads(lambda w, i: gradops.embedding(w, i, 2), (weight, idx), (0,))
    via_op = _grads(lambda w, i: torch.ops.gradops.embedding(w, i, 2, False), (weight, idx), (0,))
    assert torch.equal(ours[0], via_op[0])


def test_paths():
    x, w = torch.randn(4, 8), torch.nn.Parameter(torch.randn(8))
    assert direct.eager_path(x, 1e-6) == direct.BODY
    assert direct.eager_path(x, w) == direct.FUNCTION  # a Parameter counts as a plain tensor
    with torch.no_grad():
        assert direct.eager_path(x, w) == direct.BODY
    with torch.inference_mode():
        assert direct.eager_path(x, x) == direct.BODY


class _Subclass(torch.Tensor):
    pass


class _Watching(torch.overrides.TorchFunctionMode):
    """A pass-through function mode: it sends every gradops call through the registered op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_watched_calls_go_through_the_op():
    x = torch.randn(4, 8)
    assert direct.eager_path(x.as_subclass(_Subclass)) == direct.OP
    assert direct.eager_path(torch.empty(4, 8, device="meta")) == direct.OP
    with FakeTensorMode() as mode:
        assert direct.eager_path(mode.from_tensor(x)) == direct.OP
    with torch.profiler.profile() as prof:
        assert direct.eager_path(x) == direct.OP
        gradops.hardswish_backward(x, x)
    assert any(e.name == "gradops::hardswish_backward" for e in prof.events()), "the profiler must see the op"
    seen = []
    torch.func.vmap(lambda row: seen.append(direct.eager_path(row)) or row)(x)
    torch.func.grad(lambda row: seen.append(direct.eager_path(row)) or row.sum())(x)
    torch.func.jvp(lambda row: seen.append(direct.eager_path(row)) or row, (x,), (x,))
    assert seen == [direct.OP, direct.FUNCTORCH, direct.FUNCTORCH]


def test_jit_traces_keep_the_op():
    x = torch.randn(4, 8)
    traced = torch.jit.trace(lambda g, a: gradops.hardswish_backward(g, a), (x, x))
    assert "gradops::hardswish_backward" in str(traced.graph)
    assert torch.equal(traced(x, x), gradops.hardswish_backward(x, x))


def test_compiled_graphs_keep_the_op():
    targets = []

    def record(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda g, x: gradops.hardswish_backward(g, x) * 2, backend=record, fullgraph=True)
    x = torch.randn(4, 8)
    assert torch.equal(fn(x, x), gradops.hardswish_backward(x, x) * 2)
    assert any("gradops.hardswish_backward" in t for t in targets), targets


def test_errors_are_operror_on_both_paths():
    x = torch.randn(4, 8)
    with pytest.raises(OpError) as direct_error:
        gradops.rms_norm_grad(x, x, None, torch.randn(8))
    with _Watching(), pytest.raises(OpError) as op_error:  # the op path: validated before the schema
        gradops.rms_norm_grad(x, x, None, torch.randn(8))
    assert direct_error.value.status == op_error.value.status and str(direct_error.value) == str(op_error.value)


@pytest.mark.parametrize("path", ["direct", "op"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_can_be_modified_in_place_under_autograd(path, dtype, backend):
    """torch's own norms allow ``y.mul_(2)`` on their output; ours did not while results were views of the
    backend's buffer ("Output 0 of rms_norm is a view and is being modified inplace"). Regression."""
    x = torch.randn(40, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    calls = {
        "rms_norm": (lambda a, g: gradops.rms_norm(a, g)[0], lambda a, g: torch.ops.gradops.rms_norm(a, g, 1e-6)[0]),
        "layer_norm": (lambda a, g: gradops.layer_norm(a, g, g)[0],
                       lambda a, g: torch.ops.gradops.layer_norm(a, g, g, 1e-5)[0]),
        "hardswish": (lambda a, g: gradops.hardswish(a) * g, lambda a, g: torch.ops.gradops.hardswish(a) * g),
    }
    for name, (ours, op) in calls.items():
        fn = ours if path == "direct" else op
        a, g = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(a, g)
        y.mul_(3)
        y.float().sum().backward()
        a0, g0 = x.clone().requires_grad_(), w.clone().requires_grad_()
        (fn(a0, g0) * 3).float().sum().backward()
        assert torch.equal(a.grad, a0.grad) and torch.equal(g.grad, g0.grad), name


def test_batched_gradients_go_through_the_op():
    """``autograd.grad(is_grads_batched=True)`` runs the backward under the legacy vmap, whose plain-typed batched
    tensors the op knows how to batch and the body does not (review finding: "Batching rule not implemented")."""
    x0, w = torch.randn(4, 8), torch.randn(8)
    cotangents = torch.randn(3, 4, 8)
    for fn in (lambda x: gradops.rms_norm(x, w)[0], gradops.hardswish, lambda x: gradops.layer_norm(x, w, w)[0]):
        x = x0.clone().requires_grad_()
        y = fn(x)
        (batched,) = torch.autograd.grad(y, x, cotangents, retain_graph=True, is_grads_batched=True)
        looped = torch.stack([torch.autograd.grad(y, x, c, retain_graph=True)[0] for c in cotangents])
        assert torch.equal(batched, looped)


def test_lazily_negated_inputs_are_negated(backend):
    """``z.conj().imag`` is a float32 view whose negation is a flag, not data: the kernels must see -data."""
    z = torch.randn(6, 8, dtype=torch.complex64)
    neg = z.conj().imag
    assert neg.is_neg()
    plain = neg.resolve_neg()
    assert direct.eager_path(neg) == direct.OP
    assert torch.equal(gradops.hardswish(neg), gradops.hardswish(plain))
    assert torch.equal(gradops.hardswish_backward(plain, neg), gradops.hardswish_backward(plain, plain))
    out = torch.empty_like(plain)
    assert torch.equal(gradops.hardswish_backward(neg, plain, out=out), gradops.hardswish_backward(plain, plain))


def test_eager_backward_trusts_indices_its_forward_checked(monkeypatch):
    """The embedding and MoE permute backwards reuse indices their forward validated (or produced): no second
    range test, which on CUDA is a host synchronisation per step. Through the op (here: under the profiler, which
    autograd carries into the backward) the backward checks again, as any direct call of the backward op does."""
    # The host-side tests are what the adapters of the torch and Triton backends run; the compiled CPU kernels
    # test the indices in-kernel on every call, trusted or not (free there), so they show nothing here.
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    from gradops.families.embedding import ops as emb

    # The MoE backward's full test (a permutation, a sort on CUDA) is the backend's; trusted, it tests the range.
    from gradops.families.moe import reference as moe
    calls = []
    for module, name in ((emb, "checked_indices"), (moe, "checked_permutation")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))

    weight0 = torch.randn(7, 4)

    def step():
        weight = weight0.clone().requires_grad_()
        rows = gradops.embedding(weight, torch.tensor([[1, 2, 2], [0, 6, 1]])).reshape(6, 4)
        permuted, _ = gradops.moe_token_permute(rows, torch.tensor([[0, 1], [1, 0], [2, 2], [0, 0], [1, 2], [0, 1]]))
        permuted.square().sum().backward()
        return weight.grad

    eager = step()
    assert calls == ["checked_indices"]  # the embedding forward only
    calls.clear()
    with torch.profiler.profile():
        via_op = step()
    assert calls == ["checked_indices", "checked_permutation", "checked_indices"]
    assert torch.equal(eager, via_op)


_MISSING_HOOK_CHILD = """
import torch
del torch._C._get_tracing_state  # as a later torch that renamed the hook would be
import importlib, gradops
direct = importlib.import_module("gradops.ops._direct")
x, g = torch.randn(4, 8), torch.randn(8)
y, rstd = gradops.rms_norm(x, g)
print(direct.eager_path(x), "|", direct.DISABLED, "|", torch.equal(y, torch.rms_norm(x, [8], g, 1e-6)))
"""


def test_a_torch_without_a_hook_takes_the_op_path_and_says_why():
    proc = subprocess.run([sys.executable, "-c", _MISSING_HOOK_CHILD], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    path, why, _ = (part.strip() for part in proc.stdout.strip().split("|"))
    assert path == direct.OP and "torch._C._get_tracing_state" in why


def test_gradops_eager_0_turns_the_direct_path_off():
    code = "import importlib, torch, gradops; d = importlib.import_module('gradops.ops._direct'); " \
           "print(d.eager_path(torch.randn(2)), d.DISABLED)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "GRADOPS_EAGER": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [direct.OP, "GRADOPS_EAGER=0"]


def test_set_enabled_switches_the_path_and_results_stay_the_same():
    x, g = torch.randn(4, 8), torch.randn(8)
    on = gradops.rms_norm(x, g)
    try:
        direct.set_enabled(False)
        assert direct.eager_path(x) == direct.OP and direct.DISABLED
        off = gradops.rms_norm(x, g)
    finally:
        direct.set_enabled(True)
    assert direct.eager_path(x) == direct.BODY and direct.DISABLED is None
    assert all(torch.equal(a, b) for a, b in zip(on, off))
