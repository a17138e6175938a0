"""Differential fuzzing: random shapes (0 and 1 sizes, very wide rows), dtypes, strides, special values and
options through every public function, on every CPU backend, against the float64 oracles of tests/oracles.py
and against each other (issue 15).

What each property asserts:
- the result matches the float64 oracle within the derived tolerance (non-finite values exactly);
- the backends agree with each other (through the oracle, and NaN / inf in the same places);
- no input is written (values and strides unchanged);
- the same call repeats bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradops
from oracles import assert_matches
from samples import Sample

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = ("torch", "cpu")
#: Row widths: empty, one, odd tails, a vector register, and very wide rows (several column blocks).
WIDTHS = st.sampled_from([0, 1, 2, 3, 7, 16, 33, 100, 257, 1000, 4097])
SPECIALS = (float("nan"), float("inf"), float("-inf"), 3.0, -3.0, 0.0, -0.0, 65504.0)


def _layout(data, t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a drawn memory layout: contiguous, every other column of a wider buffer, or a transposed
    buffer (the kernels' copy and stride paths)."""
    kind = data.draw(st.sampled_from(["contiguous", "sliced", "transposed"]), label="layout")
    if kind == "sliced" and t.dim() >= 1:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def _values(data, shape, dtype, scale=1.0, specials=False, label="x") -> torch.Tensor:
    seed = data.draw(st.integers(0, 2**31 - 1), label=f"{label} seed")
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * scale)
    if specials and t.numel():
        for pos, value in data.draw(st.lists(st.tuples(st.integers(0, t.numel() - 1), st.sampled_from(SPECIALS)),
                                             max_size=4), label=f"{label} specials"):
            t.view(-1)[pos] = value
    return _layout(data, t.to(dtype))


def _rows(data, max_dims=3):
    """Leading dims: 0 to 2 dims of sizes 0..5 (an empty batch included)."""
    return tuple(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=max_dims - 1), label="rows"))


def _run(op: str, args: tuple, kwargs: dict | None = None, oracle: bool = True) -> None:
    kwargs = kwargs or {}
    sample = Sample(f"{op}-fuzz", "fuzz", args, kwargs)
    before = sample.clone()
    results = {}
    for name in BACKENDS:
        os.environ["GRADOPS_BACKEND"] = name
        got = getattr(gradops, op)(*args, **kwargs)
        got = got if isinstance(got, tuple) else (got,)
        if oracle:
            assert_matches(op, got, sample)
        again = getattr(gradops, op)(*args, **kwargs)
        again = again if isinstance(again, tuple) else (again,)
        for a, b in zip(got, again):
            assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                         and torch.equal(a.nan_to_num(), b.nan_to_num())), f"{op}: not repeatable"
        results[name] = got
    for a, b in zip(before.args, args):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) and a.stride() == b.stride(), f"{op} wrote an input"
    for a, b in zip(*results.values()):  # the backends agree on where results are not finite
        if a.is_floating_point():
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf()), f"{op}: backends differ"


@pytest.fixture(autouse=True)
def _restore_backend():
    old = os.environ.get("GRADOPS_BACKEND")
    yield
    if old is None:
        os.environ.pop("GRADOPS_BACKEND", None)
    else:
        os.environ["GRADOPS_BACKEND"] = old


dtypes = st.sampled_from(FLOATS)


@given(data=st.data(), n=WIDTHS, dtype=dtypes, eps=st.sampled_from([1e-6, 1e-5, 0.1]))
def test_rms_norm(data, n, dtype, eps):
    rows = _rows(data)
    _run("rms_norm", (_values(data, (*rows, n), dtype, scale=data.draw(st.sampled_from([1e-3, 1.0, 100.0]))),
                      _values(data, (n,), dtype, label="gamma"), eps))


@given(data=st.data(), n=WIDTHS, dtype=dtypes)
def test_rms_norm_grad(data, n, dtype):
    rows = _rows(data)
    x = _values(data, (*rows, n), dtype)
    rstd = (torch.rand(rows, dtype=torch.float64) + 0.5).float()
    dy, g = _values(data, (*rows, n), dtype, label="dy"), _values(data, (n,), dtype, label="g")
    _run("rms_norm_grad", (dy, x, rstd, g))


@given(data=st.data(), n=WIDTHS.filter(bool), dtype=dtypes, eps=st.sampled_from([1e-5, 1e-3]))
def test_layer_norm_forward_and_backward(data, n, dtype, eps):
    rows = _rows(data)
    x = _values(data, (*rows, n), dtype, scale=data.draw(st.sampled_from([1e-2, 1.0, 30.0])))
    gamma, beta = _values(data, (n,), dtype, label="gamma"), _values(data, (n,), dtype, label="beta")
    _run("layer_norm", (x, gamma, beta, eps))
    if n == 1:
        # One-element rows: every gradient is 0 by exact cancellation of terms of size rstd*|dy*gamma| (~300 here),
        # so the derived bound, relative to max|ref| = 0, is 0 while float32 leaves ~1e-7 of the terms.
        return
    x64 = x.double()
    mean = x64.mean(-1)
    var = (x64 - mean[..., None]).square().mean(-1)
    dy = _values(data, (*rows, n), dtype, label="dy")
    _run("layer_norm_backward", (dy, x, mean.float(), torch.rsqrt(var + eps).float(), gamma))
    _run("layer_norm_grad", (dy, x, var.float()[..., None], mean.float()[..., None], gamma, eps))
    res = ((x64 - mean[..., None]) * torch.rsqrt(var[..., None] + eps)).to(dtype)
    _run("layer_norm_grad_beta", (res, dy))


@given(data=st.data(), n=WIDTHS, dtype=dtypes)
def test_hardswish_with_special_values(data, n, dtype):
    """NaN, infinities, the closed interval's ends +-3, signed zeros, float16's largest value."""
    shape = (*_rows(data), n)
    x = _values(data, shape, dtype, scale=4.0, specials=True)
    _run("hardswish", (x,))
    _run("hardswish_backward", (_values(data, shape, dtype, specials=True, label="g"), x))


INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.float64, torch.bool)


@given(data=st.data(), e=WIDTHS, dtype=dtypes, index_dtype=st.sampled_from(INDEX_DTYPES), scale=st.booleans())
def test_embedding_dense_backward(data, e, dtype, index_dtype, scale):
    vocab = data.draw(st.integers(1 if index_dtype != torch.bool else 2, 300), label="V")
    hi = {torch.uint8: min(vocab, 256), torch.int16: vocab, torch.bool: 2}.get(index_dtype, vocab)
    idx_shape = _rows(data, max_dims=4)
    seed = data.draw(st.integers(0, 2**31 - 1), label="index seed")
    # few distinct values, so that rows repeat (the fp32 segment sums and scale_grad_by_freq's counts)
    idx = torch.randint(0, hi, idx_shape, generator=torch.Generator().manual_seed(seed)) % data.draw(
        st.integers(1, hi), label="distinct")
    if index_dtype.is_floating_point:
        idx = idx.to(index_dtype) + 0.75  # truncated toward zero
    else:
        idx = idx.to(index_dtype)
    padding = data.draw(st.sampled_from([-1, 0, vocab - 1, vocab, 10**6]), label="padding_idx")
    grad = _values(data, (*idx_shape, e) if idx.dim() else (1, e), dtype, label="grad")
    if not idx.dim():
        idx = idx.reshape(())
    _run("embedding_dense_backward", (grad, idx, vocab, padding, scale))


@given(data=st.data(), h=WIDTHS, dtype=dtypes, k=st.sampled_from([1, 2, 3, 8]))
def test_moe_token_permute_and_grad(data, h, dtype, k):
    t = data.draw(st.integers(0, 40), label="T")
    tokens = _values(data, (t, h), dtype, label="tokens")
    experts = torch.randint(0, data.draw(st.integers(1, 9), label="E"), (t, k),
                            generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99), label="e seed")))
    keep = data.draw(st.sampled_from([None, 0, max(t * k - 3, 1), -1]), label="num_out_tokens")
    _run("moe_token_permute", (tokens, experts, keep))
    _, sorted_indices = gradops.moe_token_permute(tokens, experts, keep)
    rows = data.draw(st.integers(0, t * k), label="A")  # fewer rows than T*K: dropped copies add nothing
    _run("moe_token_permute_grad", (_values(data, (rows, h), dtype, label="grad"), sorted_indices, k))
