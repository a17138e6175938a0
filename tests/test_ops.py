"""Every op, every sample, every CPU backend: matches the float64 oracle, returns the documented dtypes, never
writes into its inputs, and repeats bit for bit."""

from __future__ import annotations

import inspect

import pytest
import torch

import gradops
from oracles import assert_matches
from samples import OPS, samples

CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op)]

F32 = torch.float32
#: Documented output dtypes, from the inputs.
OUTPUT_DTYPES = {
    "rms_norm": lambda x, *_: (x.dtype, F32),
    "rms_norm_grad": lambda dy, *_: (dy.dtype, F32),
    "layer_norm": lambda x, *_: (x.dtype, F32, F32),
    "layer_norm_grad": lambda dy, x, *_: (x.dtype, x.dtype),
    "layer_norm_grad_beta": lambda res, dy: (dy.dtype, dy.dtype),
    "layer_norm_backward": lambda dy, x, *_: (x.dtype, F32, F32),
    "hardswish": lambda x: (x.dtype,),
    "hardswish_backward": lambda g, x: (x.dtype,),
    "embedding_dense_backward": lambda grad, *_: (grad.dtype,),
    "moe_token_permute": lambda tokens, *_: (tokens.dtype, torch.int32),
    "moe_token_permute_grad": lambda grad, *_: (grad.dtype,),
}


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("op,sample", CASES)
def test_matches_oracle(op, sample, backend):
    before = sample.clone()
    fn = getattr(gradops, op)
    got = _as_tuple(fn(*sample.args, **sample.kwargs))
    assert_matches(op, got, sample)
    assert tuple(t.dtype for t in got) == OUTPUT_DTYPES[op](*sample.args)
    for a, b in zip(before.args, sample.args):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.stride() == b.stride(), f"{op} wrote into an input"
    again = _as_tuple(fn(*sample.args, **sample.kwargs))
    for x, y in zip(got, again):
        assert torch.equal(x, y), f"{op} is not bitwise repeatable"


def test_every_op_has_samples():
    assert set(OPS) == set(OUTPUT_DTYPES)
    for op in OPS:
        purposes = {s.purpose for s in samples(op)}
        assert len(purposes) >= 3, f"{op}: samples must cover several purposes"


def _op_args(op, sample) -> tuple:
    """The sample's arguments in the order of the registered op's schema (the public signature, defaults filled,
    without ``out``)."""
    bound = inspect.signature(getattr(gradops, op)).bind(*sample.args, **sample.kwargs)
    bound.apply_defaults()
    bound.arguments.pop("out", None)
    return tuple(bound.arguments.values())


@pytest.mark.parametrize("op,sample", CASES)
def test_fake_matches_real(op, sample, backend):
    """Outputs have the shapes, dtypes and strides the op's fake implementation promises: what torch.compile traces
    with. (A backend returning another layout than the fake breaks compiled graphs: found in hardswish_backward.)"""
    torch.library.opcheck(getattr(torch.ops.gradops, op).default, _op_args(op, sample), test_utils=("test_faketensor",))


def test_padding_idx_beyond_int64_means_none(backend):
    grad, idx = torch.randn(3, 2), torch.tensor([0, 1, 1])
    expected = gradops.embedding_dense_backward(grad, idx, 4, -1)
    for padding_idx in (2**64 - 1, 2**63, 10**30, -(2**70)):  # a uint64 pattern or any out-of-table value
        assert torch.equal(gradops.embedding_dense_backward(grad, idx, 4, padding_idx), expected)
