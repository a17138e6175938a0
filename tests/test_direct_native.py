"""The native extension's direct calls (native/direct.cpp, gradops.cpu.programs): an eager call of a public function
that nothing records replays the op's program in one C++ call. The same bits as the Python path on every sample,
on one and two threads, above and below the parallel threshold; the same OpError for every value a kernel refuses;
the Python path wherever a program does not apply."""

from __future__ import annotations

import importlib

import pytest
import torch

import gradops
import gradops.native as native
from gradops.cpu import programs
from gradops.ops import _direct, _out
from gradops.status import OpError
from native_paths import on_threads, same, skip_unless_native
from samples import OPS, samples
from test_ops import _op_args

pytestmark = skip_unless_native

CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op)]


def _tuple(result) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _python_path(op: str, args: tuple, kwargs: dict):
    """The call on the Python path: the extension off (its programs forgotten); nothing here records, so no native
    node is involved either."""
    native.set_enabled(False)
    try:
        return _tuple(getattr(gradops, op)(*args, **kwargs))
    finally:
        native.set_enabled(True)


def _op(op: str) -> _direct.DirectOp:
    """The DirectOp behind the public function ``op`` (``_<op>`` in the module that defines it)."""
    return getattr(importlib.import_module(getattr(gradops, op).__module__), f"_{op}")


def _direct_args(op: str, sample) -> tuple:
    """The sample's arguments as the public function hands them to its DirectOp (positional, defaults filled)."""
    return tuple(_op_args(op, sample))


def _expects_program(op: str, args: tuple) -> bool:
    """Whether the call's program exists: an op with programs, on plain contiguous non-empty CPU tensors of the
    dtypes programs cover."""
    planner = _op(op).planner
    if planner is None or planner.program is None:
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(not t.is_contiguous() or t.dtype == torch.float64 for t in tensors):
        return False
    if any(t.numel() == 0 for t in tensors):
        return False
    if op in ("embedding", "embedding_dense_backward") and args[1].dtype not in (torch.int32, torch.int64):
        return False
    if op in ("rms_norm_grad",) and args[2].dtype != torch.float32:
        return False
    if op in ("layer_norm_grad", "layer_norm_backward") and (args[2].dtype, args[3].dtype) != (torch.float32,) * 2:
        return False
    return op != "moe_token_unpermute_grad" or args[0].dtype == args[1].dtype


@pytest.mark.parametrize("op,sample", CASES)
def test_direct_call_same_bits_as_the_python_path(op, sample):
    expected = _python_path(op, sample.args, sample.kwargs)
    ours = _tuple(getattr(gradops, op)(*sample.args, **sample.kwargs))
    same(ours, expected)
    args = _direct_args(op, sample)
    if _expects_program(op, args):  # the call above remembered it: the next one runs in C++
        ext, direct_op = native.module(), _op(op)
        replay = ext.direct(ext.direct_op(direct_op.name), *args)
        assert replay is not None and replay is not ext.MISS
        same(_tuple(replay), expected)


def test_every_op_has_samples_on_the_direct_path():
    """The comparison above is not vacuous: every op has samples whose call runs on the direct path."""
    for op in OPS:
        taken = [s.name for s in samples(op) if _expects_program(op, _direct_args(op, s))]
        assert len(taken) >= 2, (op, taken)


def _table(v: int, e: int, dtype: torch.dtype) -> torch.Tensor:
    """A (v, e) table holding NaN, +-inf and -0.0 besides random values: a lookup copies bits, whatever they are."""
    w = torch.randn(v, e, generator=torch.Generator().manual_seed(v * 131 + e))
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    w.view(-1)[:4] = special[:w.numel()]
    return w.to(dtype)


# The lookup's calls: (weight, indices, padding_idx, scale_grad_by_freq), what each one is for.
_LOOKUPS = {
    "int64-1d-fp32": lambda: (_table(10, 7, torch.float32), torch.tensor([3, 0, 9, 3, 1]), -1, False),
    "int32-2d-bf16": lambda: (_table(10, 7, torch.bfloat16), torch.randint(0, 10, (3, 4), dtype=torch.int32), 2, False),
    "int64-3d-fp16-scale": lambda: (_table(6, 5, torch.float16), torch.randint(0, 6, (2, 3, 2)), 0, True),
    "0d-index": lambda: (_table(4, 3, torch.float32), torch.tensor(2), -1, False),
    "padding-outside-table": lambda: (_table(5, 3, torch.float32), torch.tensor([4, 4, 0]), 99, False),
    "one-column": lambda: (_table(5, 1, torch.bfloat16), torch.tensor([4, 1, 0, 4]), -1, False),
    "threads-split-fp32": lambda: (_table(700, 96, torch.float32), torch.randint(0, 700, (1500,)), -1, False),
    "threads-split-bf16": lambda: (_table(700, 96, torch.bfloat16), torch.randint(0, 700, (30, 50)), -1, False),
    # no program: the Python path (its conversion of other index dtypes, empty tensors, float64)
    "int16-indices": lambda: (_table(5, 3, torch.float32), torch.tensor([4, 0], dtype=torch.int16), -1, False),
    "float-indices": lambda: (_table(5, 3, torch.float32), torch.tensor([4.7, 0.2]), -1, False),
    "no-indices": lambda: (_table(5, 3, torch.float32), torch.zeros(0, dtype=torch.int64), -1, False),
    "no-columns": lambda: (_table(5, 0, torch.float32), torch.tensor([1, 2]), -1, False),
    "float64": lambda: (_table(5, 3, torch.float64), torch.tensor([1, 2]), -1, False),
}


@pytest.mark.parametrize("case", sorted(_LOOKUPS))
def test_the_lookup_copies_the_python_paths_bits(case):
    """gradops.embedding that nothing records: the direct program (range test, then the rows, split over torch's
    threads above PARALLEL_MIN items) gives the Python path's bits (ATen's index_select) on 1 and 2 threads."""
    args = _LOOKUPS[case]()
    expected = _python_path("embedding", args, {})[0]
    if not args[1].is_floating_point():  # the Python path itself: the plain gather of the table's bits
        same((expected,), (args[0][args[1].long()],))
    one, two = on_threads([1, 2], lambda: gradops.embedding(*args))
    for got in (one, two):
        same((got,), (expected,))
    ext = native.module()
    replay = ext.direct(ext.direct_op(_op("embedding").name), *args)
    if _expects_program("embedding", args):
        assert replay is not None and replay is not ext.MISS
        same((replay,), (expected,))
    else:
        assert replay is None


def test_the_lookup_takes_the_direct_path_unless_autograd_records_it():
    """Under no_grad, or with a weight that does not require grad, the lookup is the direct call; a recorded one
    keeps the native node (the direct path never records)."""
    ext = native.module()
    op = ext.direct_op(_op("embedding").name)
    weight, idx = torch.randn(6, 4, requires_grad=True), torch.tensor([1, 5, 0])
    with torch.no_grad():
        gradops.embedding(weight, idx)  # remembered
        assert ext.direct(op, weight, idx, -1, False) is not None
    assert ext.direct(op, weight, idx, -1, False) is None
    y = gradops.embedding(weight, idx)
    assert y.grad_fn is not None
    y.sum().backward()
    assert weight.grad[[1, 5, 0]].eq(1).all() and weight.grad[[2, 3, 4]].eq(0).all()


# Shapes whose kernels split over threads (items >= PARALLEL_MIN), one per op family.
_LARGE = {
    "rms_norm_grad": lambda: (torch.randn(300, 257), torch.randn(300, 257), torch.rand(300) + 0.5, torch.randn(257)),
    "layer_norm_backward": lambda: (torch.randn(300, 257), torch.randn(300, 257), torch.randn(300),
                                    torch.rand(300) + 0.5, torch.randn(257)),
    "layer_norm_grad_beta": lambda: (torch.randn(300, 257), torch.randn(300, 257)),
    "layer_norm": lambda: (torch.randn(300, 257), torch.randn(257), torch.randn(257), 1e-5),
    "hardswish_backward": lambda: (torch.randn(70001), torch.randn(70001) * 4),
    "embedding_dense_backward": lambda: (torch.randn(5000, 33), torch.randint(0, 900, (5000,)), 900, 3, True),
    "moe_token_unpermute_grad": lambda: (torch.randn(4096, 40), torch.randn(1024, 40),
                                         torch.randperm(4096, dtype=torch.int32), torch.rand(1024, 4)),
}


@pytest.mark.parametrize("op", sorted(_LARGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parallel_pieces_same_bits_on_any_thread_count(op, dtype):
    torch.manual_seed(0)
    stats = {"rms_norm_grad": (2,), "layer_norm_backward": (2, 3)}.get(op, ())  # float32 whatever x's dtype
    args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and i not in stats else a
                 for i, a in enumerate(_LARGE[op]()))
    expected = _python_path(op, args, {})
    one, two = on_threads([1, 2], lambda: _tuple(getattr(gradops, op)(*args)))
    same(one, expected)
    same(two, expected)


def _refusal(op: str, args: tuple) -> str:
    with pytest.raises(OpError) as err:
        getattr(gradops, op)(*args)
    return f"{err.value.status}: {err.value}"


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# (op, a call of some metadata, a call of the same metadata holding a value the op refuses)
_REFUSALS = [
    ("embedding", (torch.randn(5, 4), torch.tensor([0, 1, 4]), -1, False),
     (torch.randn(5, 4), torch.tensor([0, 5, 4]), -1, False)),
    ("embedding", (torch.randn(5, 4), _i32(3, 1, 2, 0).view(2, 2), 1, True),
     (torch.randn(5, 4), _i32(3, -1, 2, 0).view(2, 2), 1, True)),
    ("embedding_dense_backward", (torch.randn(6, 4), torch.tensor([0, 1, 4, 2, 1, 0]), 5),  # the sorting path
     (torch.randn(6, 4), torch.tensor([0, 1, 7, 2, 1, 0]), 5)),
    ("embedding_dense_backward", (torch.randn(3, 4), torch.tensor([0, 9, 2]), 50),  # few indices, large table
     (torch.randn(3, 4), torch.tensor([0, -1, 2]), 50)),
    ("layer_norm_backward", (torch.randn(4, 8), torch.randn(4, 8), torch.randn(4), torch.ones(4), torch.randn(8)),
     (torch.randn(4, 8), torch.randn(4, 8), torch.randn(4), torch.tensor([1.0, -0.5, 1.0, 1.0]), torch.randn(8))),
    ("layer_norm_grad", (torch.randn(4, 8), torch.randn(4, 8), torch.ones(4), torch.randn(4), torch.randn(8), 1e-5),
     (torch.randn(4, 8), torch.randn(4, 8), torch.tensor([1.0, 1.0, -0.5, 1.0]), torch.randn(4), torch.randn(8),
      1e-5)),
    ("moe_token_permute_grad", (torch.randn(4, 4), _i32(3, 1, 2, 0), 2), (torch.randn(4, 4), _i32(0, 1, 2, 9), 2)),
    ("moe_token_unpermute", (torch.randn(4, 3), _i32(3, 1, 2, 0), torch.rand(2, 2)),
     (torch.randn(4, 3), _i32(0, 1, 1, 3), torch.rand(2, 2))),
    ("moe_token_unpermute_grad", (torch.randn(4, 3), torch.randn(2, 3), _i32(3, 1, 2, 0), torch.rand(2, 2)),
     (torch.randn(4, 3), torch.randn(2, 3), _i32(0, 5, 1, 2), torch.rand(2, 2))),
]


def _refusal(op: str, args: tuple) -> str:
    with pytest.raises(OpError) as err:
        getattr(gradops, op)(*args)
    return f"{err.value.status}: {err.value}"


@pytest.mark.parametrize("op,good,bad", _REFUSALS, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(_REFUSALS)])
def test_a_refused_value_raises_the_python_paths_error(op, good, bad):
    """A kernel piece that finds a refused value sends the call to the Python path, which raises its OpError; the
    good call first, so that the refused one meets a remembered program."""
    getattr(gradops, op)(*good)
    ext = native.module()
    assert ext.direct(ext.direct_op(_op(op).name), *good) is not None
    native.set_enabled(False)
    try:
        expected = _refusal(op, bad)
    finally:
        native.set_enabled(True)
    assert _refusal(op, bad) == expected


def test_slots_agree_with_the_extension():
    ext = native.module()
    assert (ext.INPUT, ext.OUTPUT, ext.ABSENT) == (programs.INPUT, programs.OUTPUT, programs.ABSENT)


def test_not_taken_when_autograd_records_or_a_mode_watches():
    ext = native.module()
    op = ext.direct_op(_op("hardswish").name)
    x = torch.randn(8, 8)
    gradops.hardswish(x)  # remembered
    assert ext.direct(op, x) is not None
    assert ext.direct(op, x.requires_grad_()) is None  # FUNCTION's (or the node's) call
    with torch.no_grad():
        assert ext.direct(op, x) is not None
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Watch():
        assert ext.direct(op, x.detach()) is None
    assert ext.direct(op, x.detach().t()) is None  # not contiguous
    assert ext.direct(op, torch.randn(8, 9)) is ext.MISS  # new metadata: the caller plans it


def test_forgotten_with_the_call_plans():
    ext = native.module()
    op = ext.direct_op(_op("hardswish_backward").name)
    g, x = torch.randn(4, 4), torch.randn(4, 4)
    gradops.hardswish_backward(g, x)
    assert ext.direct(op, g, x) is not None
    gradops.backend.forget()
    assert ext.direct(op, g, x) is ext.MISS


def test_another_backend_keeps_the_python_path(monkeypatch):
    ext = native.module()
    op = ext.direct_op(_op("hardswish").name)
    x = torch.randn(5, 13)
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    gradops.hardswish(x)
    assert ext.direct(op, x) is None  # remembered as "the Python path" for this environment
    monkeypatch.delenv("GRADOPS_BACKEND")
    assert ext.direct(op, x) is ext.MISS  # another environment: planned afresh


# ---------------------------------------------------------------- out=: the direct program writes into given tensors
_VIA = ("hardswish", "hardswish_backward", "rms_norm", "rms_norm_grad", "layer_norm", "layer_norm_grad",
        "layer_norm_grad_beta", "layer_norm_backward", "embedding_dense_backward", "moe_token_permute",
        "moe_token_permute_grad", "moe_token_unpermute", "moe_token_unpermute_grad")  # DirectOp.direct_into sites


def _out_like(result: tuple[torch.Tensor, ...], fill: float = 7.0) -> tuple[torch.Tensor, ...]:
    return tuple(torch.full_like(r, fill) for r in result)


def _given(outs: tuple[torch.Tensor, ...]):
    """``out=`` as a caller passes it: the tensor of a one-result op, else the tuple."""
    return outs if len(outs) > 1 else outs[0]


def _with_out(op: str, args: tuple, kwargs: dict, outs: tuple[torch.Tensor, ...]):
    return _tuple(getattr(gradops, op)(*args, **kwargs, out=_given(outs)))


@pytest.mark.parametrize("op,sample", [c for c in CASES if c.values[0] in _VIA])
def test_out_writes_the_same_bits_in_place(op, sample, monkeypatch):
    """``out=`` gives the call's own bits, in the caller's tensors (returned as given), whichever path writes them;
    where the call has a program, the direct program writes them (DirectOp.direct_into answers True), and the
    public function's out= call goes there without the Python checks (check_out not called)."""
    expected = _python_path(op, sample.args, sample.kwargs)
    outs = _out_like(expected)
    versions = [o._version for o in outs]
    got = _with_out(op, sample.args, sample.kwargs, outs)
    assert all(g is o for g, o in zip(got, outs))
    same(got, expected)
    assert all(o._version > v for o, v in zip(outs, versions))
    if _expects_program(op, _direct_args(op, sample)):
        again = _out_like(expected)
        assert _op(op).direct_into(_given(again), *_direct_args(op, sample)) is True
        same(again, expected)
        module = importlib.import_module(getattr(gradops, op).__module__)
        for where in (module, _out):  # the op's module, or gradops.ops._out where it declares its results
            if hasattr(where, "check_out"):
                monkeypatch.setattr(where, "check_out", _no_python_checks)
        third = _out_like(expected)
        assert all(g is o for g, o in zip(_with_out(op, sample.args, sample.kwargs, third), third))
        same(third, expected)


def _no_python_checks(*args, **kwargs):
    raise AssertionError("the out= call took the Python path")


def test_out_fills_what_the_program_zeroes():
    """The embedding table of few indices is zeroed by its program: a caller's out full of other values comes back
    with zeros in the untouched rows, as from a call without out=."""
    grad, idx = torch.randn(3, 4), torch.tensor([0, 9, 2])
    expected = gradops.embedding_dense_backward(grad, idx, 50)
    out = torch.full((50, 4), 7.0)
    assert gradops.embedding_dense_backward(grad, idx, 50, out=out) is out
    assert torch.equal(out, expected) and not out[1].any()


@pytest.mark.parametrize("op,good,bad", [r for r in _REFUSALS if r[0] in _VIA],
                         ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(_REFUSALS) if op in _VIA])
def test_out_untouched_by_a_refused_value(op, good, bad):
    """A value the op refuses raises its OpError and leaves the caller's out as it was: the programs' checks run
    before any out is written (and before a zero-filled one is zeroed)."""
    outs = _out_like(_tuple(getattr(gradops, op)(*good)))
    _with_out(op, good, {}, outs)  # remembered, and run in place once
    sentinel = _out_like(outs, 3.0)
    with pytest.raises(OpError):
        _with_out(op, bad, {}, sentinel)
    assert all(torch.equal(s, torch.full_like(s, 3.0)) for s in sentinel)


def test_out_not_contiguous_takes_the_python_path():
    x = torch.randn(6, 8)
    out = torch.empty(8, 6).t()
    op = _op("hardswish")
    assert op.direct_into(out, x) is False
    assert gradops.hardswish(x, out=out) is out
    assert torch.equal(out, gradops.hardswish(x))


def test_out_inference_tensor_as_torch():
    """An inference tensor as out: written inside inference mode; outside it refused before anything is written,
    with torch's RuntimeError for in-place updates of inference tensors (torch.add(..., out=) raises it too)."""
    x = torch.randn(8, 8)
    with torch.inference_mode():
        out = torch.full((8, 8), 3.0)
        assert gradops.hardswish(x, out=out) is out
    assert torch.equal(out, gradops.hardswish(x))
    with torch.inference_mode():
        out = torch.full((8, 8), 3.0)
    for call in (lambda: gradops.hardswish(x, out=out), lambda: gradops.hardswish(x.t(), out=out)):
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            call()
        assert torch.equal(out, torch.full((8, 8), 3.0))


# ---------------------------------------------------------------- out=: what the C++ checks leave to check_out
def _ln_backward_args():
    x = torch.randn(2, 3, 8)
    return (torch.randn(2, 3, 8), x, x.mean(-1), torch.rsqrt(x.var(-1, unbiased=False) + 1e-5), torch.randn(8))


_OUT_CALLS = {  # op: its arguments (a 3-D one among them: outs of the public shape, not the kernels' 2-D one)
    "hardswish_backward": lambda: (torch.randn(4, 6), torch.randn(4, 6)),
    "layer_norm_backward": _ln_backward_args,
    "rms_norm_grad": lambda: (torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.rand(2, 3) + 0.5, torch.randn(8)),
    "moe_token_permute": lambda: (torch.randn(4, 6), torch.tensor([[1, 0], [2, 1], [0, 0], [3, 2]]), None, False),
}


def _refused_outs(args: tuple, good: tuple[torch.Tensor, ...]):
    """(what is wrong, out) pairs that gradops.ops._out.check_out refuses, each from the good outs of a call."""
    first = good[0]
    one = len(good) == 1

    def swap(t):
        return t if one else (t, *good[1:])

    yield "shape", swap(first.reshape(-1))  # same elements, other sizes
    yield "dtype", swap(first.double())
    yield "device", swap(torch.empty_like(first, device="meta"))
    yield "form", good if one else good[0]  # a tuple for one result, a tensor for several
    if not one:
        yield "length", good[:-1]
        yield "other out", (first, *good[1:-1], good[-2])  # the last result written over the one before
    if args[1].shape == first.shape and args[1].dtype == first.dtype:
        yield "input", swap(args[1])
    yield "input view", swap(args[0].view(-1)[: first.numel()].view(first.shape)) if (
        args[0].dtype == first.dtype and args[0].numel() >= first.numel()) else swap(first.to(torch.int8))


@pytest.mark.parametrize("op", sorted(_OUT_CALLS))
def test_out_checks_in_cpp_refuse_what_check_out_refuses(op):
    """Every out that check_out refuses is one the extension's direct_into declines (False: the Python path runs
    and raises OpError 161002 naming the out), and the good out, as a tuple or a list, it takes."""
    args = _OUT_CALLS[op]()
    expected = _tuple(getattr(gradops, op)(*args))
    good = _out_like(expected)
    for what, bad in _refused_outs(args, good):
        assert _op(op).direct_into(bad, *args) is False, what
        with pytest.raises(OpError) as caught:
            getattr(gradops, op)(*args, out=bad)
        assert caught.value.status == 161002 and "out" in str(caught.value), what
    assert _op(op).direct_into(_given(good), *args) is True
    same(good, expected)
    if len(good) > 1:
        listed = list(_out_like(expected))
        assert _op(op).direct_into(listed, *args) is True
        same(tuple(listed), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_that_nothing_records_match_the_python_path(dtype):
    """gradops.nn modules under no_grad (eval) call the direct path straight from their forwards (LayerNorm,
    Hardswish, Embedding): the Python path's bits, no autograd node."""
    from gradops import nn as gnn

    torch.manual_seed(0)
    x = torch.randn(6, 16).to(dtype)
    cases = [(gnn.LayerNorm(16).to(dtype), x), (gnn.Hardswish(), x * 4),
             (gnn.Embedding(16, 5, padding_idx=3).to(dtype), torch.randint(0, 16, (2, 7)))]
    for module, inp in cases:
        with torch.no_grad():
            native.set_enabled(False)
            try:
                expected = module(inp)
            finally:
                native.set_enabled(True)
            got = [module(inp) for _ in range(2)]  # the second call replays the remembered program
        for y in got:
            assert y.grad_fn is None
            same((y,), (expected,))
