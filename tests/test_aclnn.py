"""gradops.aclnn: status codes in CANN's order, out tensors written, results equal to the PyTorch API's, refusals
in CANN's argument names (the executor protocol: tests/test_aclnn_executor.py)."""

from __future__ import annotations

import pytest
import torch

import gradops
import gradops.reference
import gradops.status
from gradops import aclnn
from gradops.aclnn import (
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_SUCCESS,
)
from samples import samples

NULL, INVALID, TILING = ACLNN_ERR_PARAM_NULLPTR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_INNER_TILING_ERROR
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

PHASES = {
    "rms_norm_grad": (aclnn.aclnnRmsNormGradGetWorkspaceSize, aclnn.aclnnRmsNormGrad),
    "rms_norm": (aclnn.aclnnRmsNormGetWorkspaceSize, aclnn.aclnnRmsNorm),
    "embedding_dense_backward": (aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize, aclnn.aclnnEmbeddingDenseBackward),
    "hardswish_backward": (aclnn.aclnnHardswishBackwardGetWorkspaceSize, aclnn.aclnnHardswishBackward),
    "hardswish": (aclnn.aclnnHardswishGetWorkspaceSize, aclnn.aclnnHardswish),
    "embedding": (aclnn.aclnnEmbeddingGetWorkspaceSize, aclnn.aclnnEmbedding),
    "moe_token_permute_grad": (aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize, aclnn.aclnnMoeTokenPermuteGrad),
    "moe_token_permute": (aclnn.aclnnMoeTokenPermuteGetWorkspaceSize, aclnn.aclnnMoeTokenPermute),
}


def call(op: str, *args) -> int:
    """Both phases as a C caller runs them; returns the first non-zero status (or 0)."""
    first, second = PHASES[op]
    status, size, executor = first(*args)
    if status:
        assert size == 0 and executor is None
        return status
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    return second(workspace, size, executor, None)


# ------------------------------------------------------------------------------------------------ argument sets
def rms_grad_args(dtype=F32, gamma_dtype=None, rows=(2, 1), cols=16):
    x = torch.randn(*rows, cols).to(dtype)
    rstd = (torch.rand(*rows) + 0.5).reshape(rows[0]) if rows[1:] == (1,) else torch.rand(*rows) + 0.5
    gamma = torch.randn(cols).to(gamma_dtype or dtype)
    return [torch.randn_like(x), x, rstd, gamma, torch.empty_like(x), torch.empty(cols)]


def emb_args(dtype=F32):
    return [torch.randn(2, 3, 5).to(dtype), torch.tensor([[1, 2, 2], [0, 6, 1]]), 7, 2, False,
            torch.empty(7, 5, dtype=dtype)]


def hsw_args(dtype=F32):
    x = torch.linspace(-5, 5, 24).reshape(4, 6).to(dtype)
    return [torch.randn(4, 6).to(dtype), x, torch.empty(4, 6, dtype=dtype)]


def hs_args(dtype=F32):
    return [torch.linspace(-5, 5, 24).reshape(4, 6).to(dtype), torch.empty(4, 6, dtype=dtype)]


def lookup_args(dtype=F32):
    return [torch.randn(7, 5).to(dtype), torch.tensor([[1, 6, 1], [0, 3, 2]]), torch.empty(2, 3, 5, dtype=dtype)]


def moe_grad_args(dtype=F32):
    return [torch.randn(8, 6).to(dtype), torch.randperm(8).int(), 2, False, torch.empty(4, 6, dtype=dtype)]


def with_(args, i, value):
    args = list(args)
    args[i] = value
    return args


# ------------------------------------------------------------------------------------------- status, CANN order
CASES = [
    # (op, argument maker, position, replacement, expected status, what it shows)
    *[("rms_norm_grad", rms_grad_args, i, None, NULL, f"null arg {i}") for i in range(6)],
    ("rms_norm_grad", rms_grad_args, 0, torch.zeros(2, 1, 16, dtype=torch.float64), INVALID, "dy float64"),
    ("rms_norm_grad", rms_grad_args, 1, torch.zeros(2, 1, 16, dtype=F16), INVALID, "x dtype != dy"),
    ("rms_norm_grad", rms_grad_args, 2, torch.ones(2, dtype=F16), INVALID, "rstd not float32"),
    ("rms_norm_grad", rms_grad_args, 3, torch.ones(16, dtype=BF16), INVALID, "gamma outside the table"),
    ("rms_norm_grad", rms_grad_args, 4, torch.empty(2, 1, 16, dtype=F16), INVALID, "dxOut dtype"),
    ("rms_norm_grad", rms_grad_args, 5, torch.empty(16, dtype=F16), INVALID, "dgammaOut not float32"),
    ("rms_norm_grad", rms_grad_args, 3, torch.ones(8), TILING, "gamma shape (tiling)"),
    ("rms_norm_grad", rms_grad_args, 0, torch.zeros(2, 2, 16), TILING, "dy shape != x"),
    ("rms_norm_grad", rms_grad_args, 2, torch.ones(3), TILING, "rstd shape"),
    ("rms_norm_grad", rms_grad_args, 4, torch.empty(2, 16), TILING, "dxOut shape"),
    ("rms_norm_grad", rms_grad_args, 5, torch.empty(15), TILING, "dgammaOut shape"),
    ("rms_norm_grad", rms_grad_args, 1, torch.zeros(2, 1, 32)[..., ::2], INVALID, "non-contiguous x"),
    *[("embedding_dense_backward", emb_args, i, None, NULL, f"null arg {i}") for i in (0, 1, 5)],
    ("embedding_dense_backward", emb_args, 0, torch.zeros(2, 3, 5, dtype=torch.int32), INVALID, "grad int"),
    ("embedding_dense_backward", emb_args, 1, torch.zeros(2, 3, dtype=torch.complex64), INVALID, "indices complex"),
    ("embedding_dense_backward", emb_args, 5, torch.empty(7, 5, dtype=F16), INVALID, "out dtype != grad"),
    ("embedding_dense_backward", emb_args, 0, torch.zeros(6), INVALID, "grad 1-D"),
    ("embedding_dense_backward", emb_args, 0, torch.zeros(5, 5), INVALID, "grad rows != indices.numel()"),
    ("embedding_dense_backward", emb_args, 5, torch.empty(6, 5), INVALID, "out rows != numWeights"),
    ("embedding_dense_backward", emb_args, 3, 1 << 64, INVALID, "paddingIdx beyond uint64"),
    *[("hardswish_backward", hsw_args, i, None, NULL, f"null arg {i}") for i in range(3)],
    ("hardswish_backward", hsw_args, 1, torch.zeros(4, 6, dtype=torch.float64), INVALID, "self float64"),
    ("hardswish_backward", hsw_args, 0, torch.zeros(4, 6, dtype=F16), INVALID, "gradOutput dtype != self"),
    ("hardswish_backward", hsw_args, 2, torch.empty(4, 6, dtype=F16), INVALID, "out dtype"),
    ("hardswish_backward", hsw_args, 0, torch.zeros(6, 4), INVALID, "gradOutput shape (no broadcasting)"),
    ("hardswish_backward", hsw_args, 2, torch.empty(24), INVALID, "out shape"),
    ("hardswish_backward", hsw_args, 2, torch.zeros(6).expand(4, 6), INVALID, "out a broadcast view"),
    *[("hardswish", hs_args, i, None, NULL, f"null arg {i}") for i in range(2)],
    ("hardswish", hs_args, 0, torch.zeros(4, 6, dtype=torch.float64), INVALID, "self float64"),
    ("hardswish", hs_args, 1, torch.empty(4, 6, dtype=F16), INVALID, "out dtype"),
    ("hardswish", hs_args, 1, torch.empty(6, 4), INVALID, "out shape"),
    ("hardswish", hs_args, 0, torch.zeros(*[1] * 9), INVALID, "self of 9 dims"),
    *[("embedding", lookup_args, i, None, NULL, f"null arg {i}") for i in range(3)],
    ("embedding", lookup_args, 1, torch.tensor([[1.0, 6, 1], [0, 3, 2]]), INVALID, "float indices"),
    ("embedding", lookup_args, 1, torch.tensor([[1, 6, 1], [0, 3, 2]], dtype=torch.int16), INVALID, "int16 indices"),
    ("embedding", lookup_args, 0, torch.randn(35), INVALID, "weight 1-D"),
    ("embedding", lookup_args, 2, torch.empty(2, 3, 5, dtype=F16), INVALID, "out dtype != weight"),
    ("embedding", lookup_args, 2, torch.empty(6, 5), INVALID, "out shape"),
    ("embedding", lookup_args, 2, torch.zeros(5).expand(2, 3, 5), INVALID, "out a broadcast view"),
    ("embedding", lookup_args, 1, torch.zeros(*[1] * 8, dtype=torch.int64), INVALID, "indices of 8 dims"),
    ("embedding", lookup_args, 1, torch.tensor([[1, 7, 1], [0, 3, 2]]), INVALID, "index past the table (phase 2)"),
    ("embedding", lookup_args, 1, torch.tensor([[1, -1, 1], [0, 3, 2]]), INVALID, "negative index (phase 2)"),
    *[("moe_token_permute_grad", moe_grad_args, i, None, NULL, f"null arg {i}") for i in (0, 1, 4)],
    ("moe_token_permute_grad", moe_grad_args, 2, 0, INVALID, "numTopk 0"),
    ("moe_token_permute_grad", moe_grad_args, 2, 513, INVALID, "numTopk > 512"),
    ("moe_token_permute_grad", moe_grad_args, 3, True, INVALID, "paddedMode true"),
    ("moe_token_permute_grad", moe_grad_args, 1, torch.randperm(8), INVALID, "sortedIndices int64"),
    ("moe_token_permute_grad", moe_grad_args, 4, torch.empty(4, 6, dtype=BF16), INVALID, "out dtype"),
    ("moe_token_permute_grad", moe_grad_args, 0, torch.zeros(9, 6), INVALID, "more grad rows than T*K"),
    ("moe_token_permute_grad", moe_grad_args, 4, torch.empty(8, 6), INVALID, "out shape"),
]


@pytest.mark.parametrize("op,make,pos,value,status,why", CASES, ids=[f"{c[0]}-{c[5]}" for c in CASES])
def test_status(op, make, pos, value, status, why):
    assert call(op, *with_(make(), pos, value)) == status
    if status:
        assert str(status) in aclnn.aclGetRecentErrMsg()


ORDER = [
    # two faults at once: the status of the check CANN runs first wins
    ("rms_norm_grad", rms_grad_args, {5: None, 0: torch.zeros(2, 1, 16, dtype=torch.float64)}, NULL),
    ("rms_norm_grad", rms_grad_args, {0: torch.zeros(2, 1, 16, dtype=torch.float64), 3: torch.ones(8)}, INVALID),
    ("hardswish_backward", hsw_args, {2: None, 1: torch.zeros(4, 6, dtype=torch.int32)}, NULL),
    ("embedding_dense_backward", emb_args, {0: torch.zeros(2, 3, 5, dtype=torch.int8), 5: torch.empty(3)}, INVALID),
    ("moe_token_permute_grad", moe_grad_args, {1: None, 2: 0}, NULL),
]


@pytest.mark.parametrize("op,make,faults,status", ORDER, ids=[f"{c[0]}-{i}" for i, c in enumerate(ORDER)])
def test_status_order(op, make, faults, status):
    args = make()
    for pos, value in faults.items():
        args[pos] = value
    assert call(op, *args) == status


def test_rms_norm_grad_refuses_empty_which_pytorch_api_accepts():
    args = rms_grad_args(rows=(0, 1))
    args[2] = torch.ones(0)
    assert call("rms_norm_grad", *args) == TILING
    dx, dgamma = gradops.rms_norm_grad(*args[:4])
    assert dx.shape == (0, 1, 16) and torch.equal(dgamma, torch.zeros(16))


# ------------------------------------------------------------------------------ results = the PyTorch API's
@pytest.mark.parametrize("dtype,gamma_dtype", [(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)])
def test_rms_norm_grad_matches_api(backend, dtype, gamma_dtype):
    args = rms_grad_args(dtype, gamma_dtype, rows=(3, 5), cols=48)
    args[2] = args[2].reshape(3, 5, 1)  # keepdim rstd
    args[4] = torch.full((48, 5, 3), float("nan"), dtype=dtype).permute(2, 1, 0)  # non-contiguous out view
    assert call("rms_norm_grad", *args) == ACLNN_SUCCESS
    dx, dgamma = gradops.rms_norm_grad(*args[:4])
    assert torch.equal(args[4], dx) and torch.equal(args[5], dgamma)


def test_rms_norm_matches_api(backend):
    x, gamma = torch.randn(4, 3, 32), torch.randn(3, 32)
    y, rstd = torch.empty_like(x), torch.empty(4, 1, 1)
    assert call("rms_norm", x, gamma, 1e-6, y, rstd) == ACLNN_SUCCESS
    ey, erstd = gradops.rms_norm(x, gamma, 1e-6)
    assert torch.equal(y, ey) and torch.equal(rstd, erstd)
    assert call("rms_norm", x, gamma, 1e-6, y, torch.empty(4, 1, 1, dtype=F16)) == INVALID
    assert call("rms_norm", None, gamma, 1e-6, y, rstd) == NULL


@pytest.mark.parametrize("padding,meaning", [(2, 2), ((1 << 64) - 1, -1), (1 << 63, -(1 << 63)), (-1, -1), (99, 99)])
@pytest.mark.parametrize("scale", [False, True])
def test_embedding_matches_api_with_uint64_padding(backend, padding, meaning, scale):
    grad, idx, v = torch.randn(3, 4, 8), torch.tensor([[1, 2, 2, 0], [6, 1, 2, 2], [0, 0, 3, 1]]), 7
    out = torch.full((8, 7), float("nan")).t()  # non-contiguous (7, 8) view
    assert call("embedding_dense_backward", grad, idx, v, padding, scale, out) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.embedding_dense_backward(grad, idx, v, meaning, scale))


def test_embedding_float_indices_truncate_and_empty_input():
    grad, out = torch.randn(2, 3), torch.empty(4, 3)
    assert call("embedding_dense_backward", grad, torch.tensor([1.7, 2.9]), 4, -1, False, out) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.embedding_dense_backward(grad, torch.tensor([1, 2]), 4))
    out = torch.full((4, 3), 5.0)
    assert call("embedding_dense_backward", torch.zeros(0, 3), torch.zeros(0), 4, -1, False, out) == ACLNN_SUCCESS
    assert torch.equal(out, torch.zeros(4, 3))


def test_embedding_index_out_of_range_is_refused_at_run_time_and_out_untouched():
    grad, idx, out = torch.randn(2, 3), torch.tensor([1, 4]), torch.full((4, 3), 7.0)
    status, size, executor = aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize(grad, idx, 4, -1, False, out)
    assert status == ACLNN_SUCCESS  # phase 1 reads no data
    assert aclnn.aclnnEmbeddingDenseBackward(torch.empty(size, dtype=torch.uint8), size, executor, None) == INVALID
    assert "indices" in aclnn.aclGetRecentErrMsg() and torch.equal(out, torch.full((4, 3), 7.0))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_hardswish_backward_matches_api(backend, dtype):
    grad, x, _ = hsw_args(dtype)
    x[0, :2] = torch.tensor([-3.0, 3.0])  # the closed interval: d(-3) = -0.5, d(3) = 1.5
    out = torch.empty(6, 4, dtype=dtype).t()
    assert call("hardswish_backward", grad.t().contiguous().t(), x, out) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.hardswish_backward(grad, x))
    assert out[0, 0] == (grad[0, 0].float() * -0.5).to(dtype)


def test_hardswish_backward_empty_and_scalar():
    assert call("hardswish_backward", torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3)) == ACLNN_SUCCESS
    out = torch.zeros(())
    assert call("hardswish_backward", torch.tensor(2.0), torch.tensor(3.0), out) == ACLNN_SUCCESS
    assert out.item() == pytest.approx(3.0)
    assert call("hardswish_backward", *[torch.zeros([1] * 9)] * 3) == INVALID  # more than 8 dims


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_moe_token_permute_grad_matches_api(backend, dtype):
    grad, sorted_indices, k, _, out = moe_grad_args(dtype)
    assert call("moe_token_permute_grad", grad, sorted_indices, k, False, out) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.moe_token_permute_grad(grad, sorted_indices, k))
    # CANN's convention: sortedIndices[t*K + k] is the destination row of token t's k-th copy.
    g = torch.arange(8.0).reshape(4, 2)
    out = torch.empty(2, 2)
    assert call("moe_token_permute_grad", g, torch.tensor([2, 0, 3, 1], dtype=torch.int32), 2, False, out) == 0
    assert torch.equal(out, torch.stack([g[2] + g[0], g[3] + g[1]]))


def test_moe_token_permute_grad_index_out_of_range_at_run_time():
    out = torch.full((1, 2), 3.0)
    assert call("moe_token_permute_grad", torch.ones(2, 2), torch.tensor([0, 2], dtype=torch.int32), 2, False,
                out) == INVALID
    assert torch.equal(out, torch.full((1, 2), 3.0))


def test_moe_token_permute_matches_api(backend):
    tokens, indices = torch.randn(5, 8), torch.randint(0, 4, (5, 3))
    permuted, sorted_out = torch.empty(12, 8), torch.empty(15, dtype=torch.int32)
    assert call("moe_token_permute", tokens, indices, 12, False, permuted, sorted_out) == ACLNN_SUCCESS
    ep, es = gradops.moe_token_permute(tokens, indices, 12)
    assert torch.equal(permuted, ep) and torch.equal(sorted_out, es)
    assert call("moe_token_permute", tokens, indices, 12, False, permuted, sorted_out.long()) == INVALID
    assert call("moe_token_permute", tokens, indices, 12, True, permuted, sorted_out) == INVALID
    assert call("moe_token_permute", tokens, None, 12, False, permuted, sorted_out) == NULL


# -------------------------------------------------- every sample of the PyTorch API, through the aclnn surface
def aclnn_form(op: str, sample) -> tuple[list, list]:
    """The aclnn arguments (out tensors shaped like the public result) and the public result itself."""
    a, kw = sample.args, sample.kwargs
    if op == "rms_norm_grad":
        expected = list(gradops.rms_norm_grad(*a))
        return [*a, *map(torch.empty_like, expected)], expected
    if op == "rms_norm":
        expected = list(gradops.rms_norm(*a, **kw))
        return [*a, kw.get("epsilon", 1e-6), *map(torch.empty_like, expected)], expected
    if op == "embedding_dense_backward":
        expected = [gradops.embedding_dense_backward(*a, **kw)]
        return [*a, kw.get("padding_idx", -1), kw.get("scale_grad_by_freq", False), torch.empty_like(expected[0])], \
            expected
    if op == "hardswish_backward":
        expected = [gradops.hardswish_backward(*a)]
        return [*a, torch.empty_like(expected[0])], expected
    if op == "hardswish":
        expected = [gradops.hardswish(*a)]
        return [*a, torch.empty_like(expected[0])], expected
    if op == "moe_token_permute_grad":
        expected = [gradops.moe_token_permute_grad(*a)]
        return [*a, False, torch.empty_like(expected[0])], expected
    expected = list(gradops.moe_token_permute(*a, **kw))
    return [*a, kw.get("num_out_tokens") or 0, False, *map(torch.empty_like, expected)], expected


def cann_only_refusal(op: str, sample) -> int:
    """What the seeds refuse that the PyTorch API accepts (0: nothing)."""
    if op == "rms_norm_grad":
        if sample.args[0].numel() == 0:
            return TILING
        return 0 if all(t.is_contiguous() for t in sample.args) else INVALID
    if op == "moe_token_permute_grad":
        return 0 if sample.args[1].dtype == torch.int32 else INVALID
    return 0


SAMPLED = [(op, s) for op in PHASES if op != "embedding" for s in samples(op)]  # the lookup: tests below


@pytest.mark.parametrize("op,sample", SAMPLED, ids=[f"{op}-{s.name}" for op, s in SAMPLED])
def test_pytorch_api_samples_through_aclnn(backend, op, sample):
    args, expected = aclnn_form(op, sample)
    status = call(op, *args)
    assert status == cann_only_refusal(op, sample), aclnn.aclGetRecentErrMsg()
    if status == ACLNN_SUCCESS:
        for got, want in zip(args[-len(expected):], expected):
            assert torch.equal(got, want), f"{op}[{sample.name}]"


@pytest.mark.parametrize("weight_dtype", [F32, F16, BF16, torch.float64, torch.int32, torch.int8, torch.bool,
                                          torch.complex64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_embedding_gathers_the_rows_of_any_table_dtype(weight_dtype, index_dtype):
    weight = (torch.randn(9, 4) * 3).to(weight_dtype)
    indices = torch.tensor([[8, 0, 3], [3, 3, 1]], dtype=index_dtype)
    out = torch.full((2, 3, 4), 5).to(weight_dtype)
    assert call("embedding", weight, indices, out) == ACLNN_SUCCESS
    assert torch.equal(out, weight[indices.long()])
    if weight_dtype in (F32, F16, BF16):
        assert torch.equal(out, gradops.embedding(weight, indices))


def test_embedding_strided_tables_outs_and_scalar_or_empty_indices():
    weight = torch.randn(6, 10)[:, ::2]  # non-contiguous table
    out = torch.zeros(3, 10)[:, ::2]  # a non-contiguous out: written through a copy
    assert call("embedding", weight, torch.tensor([5, 0, 2]), out) == ACLNN_SUCCESS
    assert torch.equal(out, weight[[5, 0, 2]])
    scalar_out = torch.empty(5)
    assert call("embedding", weight, torch.tensor(4), scalar_out) == ACLNN_SUCCESS
    assert torch.equal(scalar_out, weight[4])
    assert call("embedding", weight, torch.zeros(0, 3, dtype=torch.int64), torch.empty(0, 3, 5)) == ACLNN_SUCCESS


def test_lookup_index_out_of_range_is_refused_at_run_time_and_out_untouched():
    weight, out = torch.randn(4, 3), torch.full((2, 3), 7.0)
    status, size, executor = aclnn.aclnnEmbeddingGetWorkspaceSize(weight, torch.tensor([1, 4]), out)
    assert status == ACLNN_SUCCESS and size == 0
    assert aclnn.aclnnEmbedding(None, size, executor, None) == INVALID
    assert "indices" in aclnn.aclGetRecentErrMsg() and "4" in aclnn.aclGetRecentErrMsg()
    assert torch.equal(out, torch.full((2, 3), 7.0))


def test_every_status_constant_is_exported():
    names = [n for n in vars(gradops.status) if n.startswith("ACLNN_")]
    assert names and all(getattr(aclnn, n) == getattr(gradops.status, n) for n in names)


@pytest.mark.parametrize("call,cann,python", [
    (lambda: aclnn.aclnnHardswishBackwardGetWorkspaceSize(None, torch.zeros(3), torch.zeros(3)), "gradOutput",
     "grad_output"),
    (lambda: aclnn.aclnnHardswishBackwardGetWorkspaceSize(torch.zeros(3, dtype=torch.float16), torch.zeros(3),
                                                          torch.zeros(3)), "gradOutput.dtype", "grad_output"),
    (lambda: aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize(torch.zeros(2, 3), torch.tensor([0, 1]), -1, -1,
                                                               False, torch.zeros(0, 3)), "numWeights", "num_weights"),
    (lambda: aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize(torch.zeros(4, 3), torch.arange(4, dtype=torch.int32),
                                                            0, False, torch.zeros(2, 3)), "numTopk", "num_topk"),
    (lambda: aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize(torch.zeros(4, 3), torch.arange(4, dtype=torch.int32),
                                                            2, True, torch.zeros(2, 3)), "paddedModeOptional",
     "padded_mode"),
], ids=["null", "dtype", "numWeights", "numTopk", "paddedMode"])
def test_refusals_name_the_cann_arguments(call, cann, python):
    """Issue 12.6: each surface names the caller's arguments - CANN's spelling here, the PyTorch API's in
    gradops.* (tests/test_errors.py)."""
    status, _, executor = call()
    message = aclnn.aclGetRecentErrMsg()
    assert status != 0 and executor is None
    assert f": {cann} must be" in message and python not in message.split(" must be")[0], message


def test_a_run_time_refusal_names_the_cann_argument():
    si = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    out = torch.zeros(2, 3)
    status, size, executor = aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize(torch.zeros(4, 3), si, 2, False, out)
    assert status == 0
    si[1] = 9  # changed between the phases: refused at run time
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    assert aclnn.aclnnMoeTokenPermuteGrad(workspace, size, executor) == gradops.status.ACLNN_ERR_PARAM_INVALID
    assert "sortedIndices must be" in aclnn.aclGetRecentErrMsg()
