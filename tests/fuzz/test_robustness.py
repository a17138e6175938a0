"""Robustness sweeps (issue 36): what must never crash, hang or answer wrong, over every public function.

- a non-tensor where a module or a native node takes a tensor, in grad mode and not: OpError;
- a tensor argument whose storage was freed or shrunk after a call of the same metadata (a remembered plan, a
  direct program): OpError 161001 / 161002 naming it, nothing written;
- an out with the lazy negation bit: it reads back the results; an out that requires grad under grad mode:
  OpError naming it, nothing written;
- out= calls of every op in a child forked after a parallel region: they return.

Each runs with the native extension as loaded here and with it switched off (the Python path).
"""

from __future__ import annotations

import inspect
import multiprocessing
import os

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import gradops
import gradops.native as native
from gradops import OpError
from samples import OPS, samples

#: The first sample of each op: a call known to be valid.
VALID = {op: next(iter(samples(op))) for op in OPS}
#: Ops whose public function takes ``out=``.
OUT_OPS = tuple(op for op in OPS if op != "embedding")
NON_TENSORS = [None, 0, 2.5, True, [1.0], (1,), "x", object()]


@pytest.fixture(params=["native", "python"])
def path(request):
    if request.param == "python":
        native.set_enabled(False)
        try:
            yield "python"
        finally:
            native.set_enabled(True)
    else:
        yield "native"


def _results(op: str, args: list, kwargs: dict) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        r = getattr(gradops, op)(*args, **kwargs)
    return r if isinstance(r, tuple) else (r,)


def _optional(op: str) -> set[int]:
    """The positions of the public function's arguments that take None (optional tensors): those defaulting to it
    and those typed ``Tensor | None`` without a default (the routing-map gradient's permuted_probs_grad)."""
    params = list(inspect.signature(getattr(gradops, op)).parameters.values())
    return {i for i, p in enumerate(params) if p.kind is p.POSITIONAL_OR_KEYWORD
            and (p.default is None or "None" in str(p.annotation))}


def _out_arg(outs: list[torch.Tensor]) -> object:
    return tuple(outs) if len(outs) > 1 else outs[0]


# ---------------------------------------------------------------- non-tensor inputs


MODULES = {
    "LayerNorm": lambda: gradops.nn.LayerNorm(8), "LayerNorm-no-bias": lambda: gradops.nn.LayerNorm(8, bias=False),
    "LayerNorm-no-affine": lambda: gradops.nn.LayerNorm(8, elementwise_affine=False),
    "RMSNorm": lambda: gradops.nn.RMSNorm(8),
    "RMSNorm-no-affine": lambda: gradops.nn.RMSNorm(8, elementwise_affine=False),
    "Hardswish": lambda: gradops.nn.Hardswish(), "Embedding": lambda: gradops.nn.Embedding(5, 8),
}


@given(data=st.data(), name=st.sampled_from(sorted(MODULES)), value=st.sampled_from(NON_TENSORS),
       grad=st.booleans(), backend=st.sampled_from(["auto", "torch", "cpu"]))
def test_modules_refuse_non_tensors(path, data, name, value, grad, backend):
    module = MODULES[name]()
    good = torch.tensor([0, 4]) if name == "Embedding" else torch.randn(3, 8, requires_grad=True)
    old = os.environ.get("GRADOPS_BACKEND")
    os.environ["GRADOPS_BACKEND"] = backend
    try:
        module(good)  # the plan the native node would replay
        with torch.set_grad_enabled(grad), pytest.raises(OpError) as err:
            module(value)
    finally:
        if old is None:
            os.environ.pop("GRADOPS_BACKEND", None)
        else:
            os.environ["GRADOPS_BACKEND"] = old
    assert err.value.status in (161001, 161002), str(err.value)


@given(op=st.sampled_from(OPS), data=st.data(), grad=st.booleans())
def test_functions_refuse_non_tensors_beside_tensors_that_require_grad(path, op, data, grad):
    """The call a native node takes (an input requiring grad) with another tensor argument replaced."""
    sample = VALID[op].clone()
    args = list(sample.args)
    floats = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    for i in floats:
        args[i] = args[i].detach().requires_grad_(grad)
    getattr(gradops, op)(*args, **sample.kwargs)
    pos = data.draw(st.sampled_from(tensors), label="position")
    args[pos] = data.draw(st.sampled_from(NON_TENSORS), label="value")
    assume(args[pos] is not None or pos not in _optional(op))  # None is a valid optional tensor (probs, the map)
    with pytest.raises(OpError) as err:
        getattr(gradops, op)(*args, **sample.kwargs)
    assert err.value.status in (161001, 161002), str(err.value)


# ---------------------------------------------------------------- freed storage


@given(op=st.sampled_from(OPS), data=st.data(), shrink=st.booleans(), grad=st.booleans())
def test_freed_or_shrunk_arguments(path, op, data, shrink, grad):
    sample = VALID[op].clone()
    args = list(sample.args)
    if grad:
        args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
    getattr(gradops, op)(*args, **sample.kwargs)  # the remembered plan and program of this metadata
    pos = data.draw(st.sampled_from([i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.numel()]),
                    label="position")
    t = args[pos]
    with torch.no_grad():
        t.untyped_storage().resize_(t.element_size() * (t.numel() // 2) if shrink else 0)
    with pytest.raises(OpError) as err:
        getattr(gradops, op)(*args, **sample.kwargs)
    assert err.value.status == (161002 if shrink and t.numel() > 1 else 161001), str(err.value)


@given(op=st.sampled_from(OUT_OPS), data=st.data())
def test_freed_outs(path, op, data):
    sample = VALID[op].clone()
    args = list(sample.args)
    outs = [torch.empty_like(r) for r in _results(op, args, sample.kwargs)]
    getattr(gradops, op)(*args, **sample.kwargs, out=_out_arg(outs))
    k = data.draw(st.sampled_from([i for i, o in enumerate(outs) if o.numel()]), label="out")
    outs = [torch.empty_like(o) for o in outs]
    outs[k].untyped_storage().resize_(0)
    with pytest.raises(OpError) as err:
        getattr(gradops, op)(*args, **sample.kwargs, out=_out_arg(outs))
    assert err.value.status == 161001 and err.value.arg.startswith("out"), str(err.value)


# ---------------------------------------------------------------- outs with the negation bit, outs requiring grad


@given(op=st.sampled_from(OUT_OPS), data=st.data())
def test_neg_bit_outs(path, op, data):
    sample = VALID[op].clone()
    args = list(sample.args)
    want = _results(op, args, sample.kwargs)
    floats = [i for i, r in enumerate(want) if r.dtype == torch.float32]
    negated = set(data.draw(st.lists(st.sampled_from(floats), min_size=1, unique=True), label="negated outs"))
    # contiguous (written by address unless the bit is seen) or the strided imaginary part of a conjugate
    interleaved = data.draw(st.booleans(), label="z.conj().imag")
    def negative(shape):
        return (torch.zeros(shape, dtype=torch.complex64).conj().imag if interleaved
                else torch.zeros(shape)._neg_view())

    outs = [negative(r.shape) if i in negated else torch.empty_like(r) for i, r in enumerate(want)]
    assert all(outs[i].is_neg() for i in negated)
    for _ in range(2):  # the second call on the remembered program
        getattr(gradops, op)(*args, **sample.kwargs, out=_out_arg(outs))
        for got, expected in zip(outs, want):
            assert torch.equal(got, expected)


@given(op=st.sampled_from(OUT_OPS), data=st.data())
def test_outs_requiring_grad(path, op, data):
    sample = VALID[op].clone()
    args = list(sample.args)
    want = _results(op, args, sample.kwargs)
    getattr(gradops, op)(*args, **sample.kwargs, out=_out_arg([torch.empty_like(r) for r in want]))
    floats = [i for i, r in enumerate(want) if r.is_floating_point()]
    k = data.draw(st.sampled_from(floats), label="out")
    outs = [torch.zeros_like(r, requires_grad=i == k) for i, r in enumerate(want)]
    with pytest.raises(OpError) as err:
        getattr(gradops, op)(*args, **sample.kwargs, out=_out_arg(outs))
    assert err.value.arg == (f"out[{k}]" if len(outs) > 1 else "out"), str(err.value)
    assert not any(o.detach().any() for o in outs), "an out was written before the refusal"


# ---------------------------------------------------------------- out= in a child forked after a parallel region


def _every_out_call() -> None:
    for op in OUT_OPS:
        sample = VALID[op]
        outs = [torch.empty_like(r) for r in _results(op, list(sample.args), sample.kwargs)]
        strided = [torch.empty(tuple(reversed(o.shape)), dtype=o.dtype).t() if o.dim() == 2 else o for o in outs]
        for given_outs in (outs, strided):
            getattr(gradops, op)(*sample.args, **sample.kwargs, out=_out_arg(given_outs))
    big = torch.randn(256, 1024)  # above the parallel threshold: a copy into a strided out splits over threads
    gradops.hardswish_backward(big, big, out=torch.empty(1024, 256).t())
    os._exit(0)


def test_out_calls_of_every_op_in_a_forked_child(path):
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no parallel region to fork after")
    big = torch.randn(512, 1024)
    gradops.hardswish(big)
    gradops.layer_norm(big, torch.ones(1024), torch.zeros(1024))
    torch.randn(2048, 2048).sum()
    child = multiprocessing.get_context("fork").Process(target=_every_out_call)
    child.start()
    child.join(180)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("out= calls in a child forked after a parallel region did not return in 180 s")
    assert child.exitcode == 0
