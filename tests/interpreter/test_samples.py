"""Every op on every shared sample through the public API with ``GRADOPS_BACKEND=triton``: the Triton kernels
(interpreted) match the float64 oracle, leave inputs untouched and repeat bit for bit, and a kernel really ran."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch

import gradops
from oracles import assert_matches
from samples import OPS, samples

CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op)]
#: Ops whose kernel runs even when an input is empty (the output still has rows to write). Not the embedding
#: backward: without indices its table is torch's zero fill alone.
WRITE_EMPTY = {"moe_token_permute_grad", "moe_token_permute"}
#: Calls that only copy rows, which the routing-map ops do with torch's index_select (one read and one write per
#: row, deterministic) on every backend: the permute, and the unpermute's gradient without probs.
GATHERS = {"moe_token_permute_with_routing_map"}


def _gathers_only(op: str, sample) -> bool:
    return op in GATHERS or (op == "moe_token_unpermute_with_routing_map_grad" and sample.args[3] is None)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (torch.equal treats NaN != NaN)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("op,sample", CASES)
def test_sample(op, sample, launches):
    pristine = sample.clone()
    got = getattr(gradops, op)(*sample.args, **sample.kwargs)
    assert_matches(op, got, sample)
    for a, b in zip(sample.args, pristine.args):
        if isinstance(a, torch.Tensor):
            assert same(a, b), f"{op} wrote into an input"
    outs = got if isinstance(got, tuple) else (got,)
    tensors = [a for a in sample.args if isinstance(a, torch.Tensor)]
    must_run = (all(t.numel() for t in tensors) or (op in WRITE_EMPTY and outs[0].numel() > 0)) and \
        not _gathers_only(op, sample)
    if must_run:
        assert sum(launches().values()) > 0, f"{op}: no Triton kernel ran (fell back to the reference?)"
    again = getattr(gradops, op)(*sample.args, **sample.kwargs)
    for a, b in zip(outs, again if isinstance(again, tuple) else (again,)):
        assert same(a, b), f"{op}: not bitwise reproducible"


@pytest.mark.parametrize("op,sample", CASES)
def test_fake_matches_real(op, sample):
    """The kernels' outputs have the shapes, dtypes and strides of the ops' fake implementations (what
    torch.compile traces with), as on the CPU backends (tests/test_ops.py)."""
    from test_ops import _op_args

    torch.library.opcheck(getattr(torch.ops.gradops, op).default, _op_args(op, sample), test_utils=("test_faketensor",))
