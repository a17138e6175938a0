"""Bad-input sweeps: any one argument of a valid call replaced by something wrong (None, another type, an int
beyond any float, NaN, a bool, sparse / complex / float64 / integer / 0-d / broadcast / empty tensors, a list).

The promise under test (issue 15): the PyTorch API answers with OpError or a result, never with another
exception from torch or Python internals; the aclnn API returns a status and never raises.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gradops
from gradops import aclnn
from samples import OPS, samples

#: The first sample of each op: a call known to be valid.
VALID = {op: next(iter(samples(op))) for op in OPS}


def _bad_values(like: object) -> list[object]:
    base = like if isinstance(like, torch.Tensor) else torch.randn(3, 4)
    values: list[object] = [None, "x", 1.5, 10**400, -(10**400), True, float("nan"), [1, 2], object()]
    values += [base.to_sparse() if base.dim() else base.reshape(1).to_sparse(), base.double(), base.long(),
               base.to(torch.complex64) if base.is_floating_point() else base, torch.tensor(1.0),
               torch.zeros(1).expand(*base.shape) if base.dim() else torch.zeros(()), torch.empty(0, 5),
               torch.empty(3, 0, 2), base.float()[..., :0] if base.dim() else base]
    return values


@pytest.fixture(autouse=True, params=["torch", "cpu"])
def _backend(request):
    old = os.environ.get("GRADOPS_BACKEND")
    os.environ["GRADOPS_BACKEND"] = request.param
    yield
    if old is None:
        os.environ.pop("GRADOPS_BACKEND", None)
    else:
        os.environ["GRADOPS_BACKEND"] = old


@given(data=st.data(), op=st.sampled_from(OPS))
def test_pytorch_api_raises_only_op_error(data, op):
    sample = VALID[op].clone()
    args = list(sample.args)
    pos = data.draw(st.integers(0, len(args) - 1), label="position")
    args[pos] = data.draw(st.sampled_from(_bad_values(args[pos])), label="bad value")
    try:
        getattr(gradops, op)(*args, **sample.kwargs)
    except gradops.OpError as e:
        assert e.status in (161001, 161002, 561002), str(e)


ACLNN = {
    "rms_norm_grad": aclnn.aclnnRmsNormGradGetWorkspaceSize,
    "rms_norm": aclnn.aclnnRmsNormGetWorkspaceSize,
    "embedding_dense_backward": aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize,
    "hardswish_backward": aclnn.aclnnHardswishBackwardGetWorkspaceSize,
    "moe_token_permute_grad": aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize,
    "moe_token_permute": aclnn.aclnnMoeTokenPermuteGetWorkspaceSize,
}
RUN = {
    "rms_norm_grad": aclnn.aclnnRmsNormGrad, "rms_norm": aclnn.aclnnRmsNorm,
    "embedding_dense_backward": aclnn.aclnnEmbeddingDenseBackward, "hardswish_backward": aclnn.aclnnHardswishBackward,
    "moe_token_permute_grad": aclnn.aclnnMoeTokenPermuteGrad, "moe_token_permute": aclnn.aclnnMoeTokenPermute,
}


def _aclnn_args(op: str) -> list:
    import test_aclnn as t

    if op == "rms_norm":
        x = torch.randn(2, 16)
        return [x, torch.randn(16), 1e-6, torch.empty(2, 16), torch.empty(2)]
    if op == "moe_token_permute":
        return [torch.randn(4, 6), torch.randint(0, 3, (4, 2)), 0, False, torch.empty(8, 6),
                torch.empty(8, dtype=torch.int32)]
    return {"rms_norm_grad": t.rms_grad_args, "embedding_dense_backward": t.emb_args,
            "hardswish_backward": t.hsw_args, "moe_token_permute_grad": t.moe_grad_args}[op]()


@given(data=st.data(), op=st.sampled_from(sorted(ACLNN)))
def test_aclnn_returns_a_status_and_never_raises(data, op):
    args = _aclnn_args(op)
    assert ACLNN[op](*args)[0] == 0, f"{op}: the base call must be valid"
    pos = data.draw(st.integers(0, len(args) - 1), label="position")
    args[pos] = data.draw(st.sampled_from(_bad_values(args[pos])), label="bad value")
    status, size, executor = ACLNN[op](*args)
    assert isinstance(status, int) and isinstance(size, int)
    if status == 0:
        workspace = torch.empty(size, dtype=torch.uint8) if size else None
        assert isinstance(RUN[op](workspace, size, executor, None), int)
