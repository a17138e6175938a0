"""torch.library.opcheck on every gradops operator: schema, autograd registration, fake (meta) kernel, and
AOT dispatch with dynamic shapes, on several samples per op from tests/samples.py.

opcheck costs ~0.1-0.5 s per sample (it traces the op four ways), so each op runs on a few samples chosen for
distinct paths: the first (basic) cases of float32 and one half dtype, plus the op's named edge cases below.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import gradops
from gradops.registry import OPS as REGISTERED
from samples import OPS, samples

#: Per op: sample names (beyond the first float32 one and the first bfloat16 one) worth tracing.
EDGES = {
    "rms_norm": ("multidim-gamma-float32", "noncontig-float32"),
    "rms_norm_grad": ("rstd-prefix", "rstd-keepdim"),
    "layer_norm": ("noncontig-float32", "fp32-params-bfloat16"),
    "layer_norm_grad": ("stats-keepdim",),
    "layer_norm_grad_beta": ("odd-3d-float32",),
    "layer_norm_backward": ("odd-3d-float32",),
    "hardswish": ("scalar-float32", "noncontig-float32"),
    "hardswish_backward": ("scalar-float32", "boundaries-float32"),
    "embedding_dense_backward": ("padding-scale-float32", "indices-int32", "8d-grad"),
    "moe_token_permute": ("topk1-1d", "drop", "int32-indices"),
    "moe_token_permute_grad": ("dropped-rows", "convention", "int64-indices"),
    "moe_token_unpermute": ("no-probs-float32", "dropped-rows", "int64-indices", "noncontig"),
    "moe_token_unpermute_grad": ("no-probs-float32", "dropped-rows", "float32-probs-bfloat16"),
    "moe_token_permute_with_routing_map": ("drop-float32", "no-probs", "int8-map"),
    "moe_token_permute_with_routing_map_grad": ("drop-float32", "no-probs", "no-map"),
    "moe_token_unpermute_with_routing_map": ("drop-float32", "no-probs", "drop-probs-no-map"),
    "moe_token_unpermute_with_routing_map_grad": ("drop-float32", "no-probs"),
    "swiglu": ("middle-float32", "noncontig-float32", "empty-float32"),
    "swiglu_grad": ("dim0-float32", "tail-float32"),
}
#: Forward ops: their float inputs require grad so that opcheck also runs the registered backward.
FORWARDS = {op.name for op in REGISTERED if not op.backward}


def _chosen(op: str):
    picked, seen_dtypes = [], set()
    for s in samples(op):
        first_of_dtype = not s.name.startswith(("indices-",)) and s.args[0].dtype not in seen_dtypes
        if first_of_dtype and s.args[0].dtype in (torch.float32, torch.bfloat16):
            seen_dtypes.add(s.args[0].dtype)
            picked.append(s)
        elif s.name in EDGES[op]:
            picked.append(s)
    return picked


CASES = [(op, s) for op in OPS for s in _chosen(op)]


def _op_args(op: str, sample) -> list:
    """The custom op's positional arguments: the public function's, defaults filled in, in schema order."""
    public = getattr(gradops, op)
    bound = inspect.signature(public).bind(*sample.args, **sample.kwargs)
    bound.apply_defaults()
    schema = getattr(torch.ops.gradops, op).default._schema
    return [bound.arguments[a.name] for a in schema.arguments]


def _with_grad(args: list) -> list:
    return [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]


def test_every_op_has_cases():
    covered = {op for op, _ in CASES}
    assert covered == set(OPS)
    for op in OPS:  # every named edge case exists, so a renamed sample cannot silently drop coverage
        names = {s.name for s in samples(op)}
        assert set(EDGES[op]) <= names, (op, set(EDGES[op]) - names)


@pytest.mark.parametrize(("op", "sample"), CASES, ids=[f"{op}-{s.name}" for op, s in CASES])
def test_opcheck(op, sample):
    args = _op_args(op, sample)
    if op in FORWARDS:
        args = _with_grad(args)
    torch.library.opcheck(getattr(torch.ops.gradops, op).default, tuple(args))


EMBEDDING_CASES = {
    "int64-2d": (torch.randn(10, 4), torch.tensor([[1, 2, 9], [9, 0, 1]]), 9, False),
    "int32-scale": (torch.randn(6, 3), torch.tensor([0, 5, 5, 2], dtype=torch.int32), -1, True),
    "scalar-index": (torch.randn(5, 2), torch.tensor(3), 0, False),
    "bfloat16": (torch.randn(7, 8).bfloat16(), torch.tensor([[6, 0], [1, 1]]), 1, True),
}


@pytest.mark.parametrize("case", EMBEDDING_CASES)
def test_opcheck_embedding_forward(case):
    weight, indices, padding_idx, scale = EMBEDDING_CASES[case]
    torch.library.opcheck(torch.ops.gradops.embedding.default,
                          (weight.requires_grad_(), indices, padding_idx, scale))
