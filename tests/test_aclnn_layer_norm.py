"""aclnnLayerNormBackward: ops-nn's documented example, a float64 reference over normalizedShape of one and more
dims, every outputMask, out dtypes and strides, empty inputs, and each row of the doc's status table."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import gradops
from gradops import aclnn
from gradops.aclnn import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS
from oracles import tolerance

NULL, INVALID = ACLNN_ERR_PARAM_NULLPTR, ACLNN_ERR_PARAM_INVALID
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
ALL = [True, True, True]


def run(*args) -> int:
    """Both phases as a C caller runs them; the first non-zero status (or 0)."""
    status, size, executor = aclnn.aclnnLayerNormBackwardGetWorkspaceSize(*args)
    if status:
        assert size == 0 and executor is None
        return status
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    return aclnn.aclnnLayerNormBackward(workspace, size, executor, None)


def reference(dy, x, norm, mean, rstd, weight):
    """ops-nn's formula in float64, written over the normalized dims directly (no reshaping to 2-D)."""
    dims = tuple(range(x.dim() - len(norm), x.dim()))
    keep = (*x.shape[: x.dim() - len(norm)], *([1] * len(norm)))
    n = math.prod(norm)
    w = torch.ones(norm, dtype=F64) if weight is None else weight.to(F64)
    res = (x.to(F64) - mean.to(F64).reshape(keep)) * rstd.to(F64).reshape(keep)
    g = dy.to(F64) * w
    temp1 = g.sum(dims, keepdim=True) / n
    temp2 = res * (g * res).sum(dims, keepdim=True) / n
    dx = (g - (temp1 + temp2)) * rstd.to(F64).reshape(keep)
    lead = tuple(range(x.dim() - len(norm)))

    def over_rows(t):  # torch sums every dim for an empty dim list: one row is the row itself
        return t.sum(lead) if lead else t

    return dx, over_rows(dy.to(F64) * res), over_rows(dy.to(F64))


def inputs(shape, norm, dtype=F32, weight_dtype=None, seed=0, stat_dtype=F32, keepdim=True):
    """Inputs with the forward's own statistics (rstd > 0, mean the row mean)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    dims = tuple(range(len(shape) - len(norm), len(shape)))
    mean = x.double().mean(dims, keepdim=keepdim)
    rstd = (x.double().var(dims, unbiased=False, keepdim=keepdim) + 1e-5) ** -0.5
    weight = None if weight_dtype is None else (torch.rand(norm, generator=g) + 0.5).to(weight_dtype)
    return dy, x, list(norm), mean.to(stat_dtype), rstd.to(stat_dtype), weight


def test_the_documented_example():
    """ops-nn's example (float32, 2x2, normalizedShape [2], weight ones, bias zeros): values by hand from the
    formula: row 0 xhat = (0, 4), row 1 xhat = (5, 10)."""
    dy = torch.tensor([[2.0, 3.0], [4.0, 5.0]])
    x = dy.clone()
    mean, rstd = torch.tensor([[2.0], [3.0]]), torch.tensor([[4.0], [5.0]])
    out, dw, db = torch.zeros(2, 2), torch.zeros(2), torch.zeros(2)
    assert run(dy, x, [2], mean, rstd, torch.ones(2), torch.zeros(2), ALL, out, dw, db) == ACLNN_SUCCESS
    assert out.tolist() == [[-2.0, -94.0], [-877.5, -1747.5]]
    assert dw.tolist() == [20.0, 62.0]
    assert db.tolist() == [6.0, 8.0]


@pytest.mark.parametrize("shape,norm", [((6, 16), (16,)), ((2, 3, 4, 5), (4, 5)), ((3, 4, 5), (3, 4, 5)),
                                        ((7,), (7,))])
@pytest.mark.parametrize("dtype,weight_dtype", [(F32, None), (F32, F32), (F16, F16), (F16, F32), (BF16, BF16),
                                                (BF16, None)])
def test_matches_the_float64_reference(backend, shape, norm, dtype, weight_dtype):
    dy, x, norm, mean, rstd, weight = inputs(shape, norm, dtype, weight_dtype)
    out_dtype = weight_dtype or dtype
    dx = torch.empty(shape, dtype=dtype)
    dw, db = torch.empty(norm, dtype=out_dtype), torch.empty(norm, dtype=out_dtype)
    assert run(dy, x, norm, mean, rstd, weight, None, ALL, dx, dw, db) == ACLNN_SUCCESS
    n, m = math.prod(norm), x.numel() // math.prod(norm)
    # Rounding scales with the size of the terms summed, not of the result (dx cancels exactly where a row has
    # one or two elements): |rstd·dy·w| for dx; the column sums of |dy·xhat| and |dy| for dgamma and dbeta.
    w = torch.ones(norm, dtype=F64) if weight is None else weight.to(F64)
    keep = (*x.shape[: x.dim() - len(norm)], *([1] * len(norm)))
    terms = rstd.to(F64).reshape(keep) * (dy.to(F64) * w).abs()
    xhat = (x.to(F64) - mean.to(F64).reshape(keep)) * rstd.to(F64).reshape(keep)
    col_sums = [(dy.to(F64) * xhat).abs().reshape(-1, n).sum(0), dy.to(F64).abs().reshape(-1, n).sum(0)]
    scales = (float(terms.max()), float(col_sums[0].max()), float(col_sums[1].max()))
    for got, want, length, scale in zip((dx, dw, db), reference(dy, x, norm, mean, rstd, weight), (n, m, m), scales):
        assert got.dtype == (dtype if got is dx else out_dtype)
        assert float((got.double() - want).abs().max()) <= tolerance(got.dtype, length, scale)


@pytest.mark.parametrize("mask", list(itertools.product([False, True], repeat=3)))
def test_output_mask_writes_exactly_the_asked_outputs(mask):
    """Masked-off outs may be None and are never written; asked ones equal the functional API's results."""
    dy, x, norm, mean, rstd, weight = inputs((5, 8), (8,), F32, F32)
    sentinel = -7.0
    outs = [torch.full((5, 8), sentinel), torch.full((8,), sentinel), torch.full((8,), sentinel)]
    given = [t if wanted else None for t, wanted in zip(outs, mask)]
    assert run(dy, x, norm, mean, rstd, weight, None, list(mask), *given) == ACLNN_SUCCESS
    expected = gradops.layer_norm_backward(dy, x, mean.reshape(5), rstd.reshape(5), weight)
    for wanted, got, want in zip(mask, outs, expected):
        if wanted:
            assert torch.equal(got, want.to(got.dtype))
        else:
            assert torch.all(got == sentinel)
    # an out that is given but masked off is not written either
    given = [torch.full_like(t, sentinel) for t in outs]
    assert run(dy, x, norm, mean, rstd, weight, None, list(mask), *given) == ACLNN_SUCCESS
    for wanted, got in zip(mask, given):
        assert wanted or torch.all(got == sentinel)


def test_strided_inputs_and_outs_other_dtypes_and_statistics_go_through_the_workspace():
    """Non-contiguous gradOut / input / outs, bfloat16 statistics and float16 weight gradients: the same bits as
    the functional API on contiguous float32 statistics, cast into each out; the buffers are in the workspace."""
    dy, x, norm, mean, rstd, weight = inputs((6, 10), (10,), BF16, BF16, stat_dtype=BF16, keepdim=False)
    dy_t, x_t = dy.t().contiguous().t(), x.t().contiguous().t()  # same values, column-major
    dx = torch.zeros(10, 6, dtype=BF16).t()
    dw = torch.zeros(20, dtype=F16)[::2]
    db = torch.zeros(10, dtype=F32)
    status, size, executor = aclnn.aclnnLayerNormBackwardGetWorkspaceSize(dy_t, x_t, norm, mean, rstd, weight, None,
                                                                          ALL, dx, dw, db)
    assert status == ACLNN_SUCCESS and size > 0
    assert aclnn.aclnnLayerNormBackward(torch.empty(size, dtype=torch.uint8), size, executor, None) == ACLNN_SUCCESS
    want = gradops.layer_norm_backward(dy, x, mean.float(), rstd.float(), weight)
    assert torch.equal(dx, want[0])
    assert torch.equal(dw, want[1].to(F16))
    assert torch.equal(db, want[2])


def test_empty_rows_zero_the_weight_gradients_and_empty_columns_write_nothing():
    dy, x = torch.empty(0, 4), torch.empty(0, 4)
    dw, db = torch.full((4,), 3.0), torch.full((4,), 3.0)
    assert run(dy, x, [4], torch.empty(0, 1), torch.empty(0, 1), None, None, ALL, torch.empty(0, 4), dw, db) == 0
    assert torch.all(dw == 0) and torch.all(db == 0)
    dy, x = torch.empty(3, 0), torch.empty(3, 0)
    assert run(dy, x, [0], torch.zeros(3, 1), torch.ones(3, 1), None, None, ALL, torch.empty(3, 0),
               torch.empty(0), torch.empty(0)) == ACLNN_SUCCESS


def test_a_negative_rstd_is_refused_at_run_time_with_the_outs_untouched():
    dy, x, norm, mean, rstd, weight = inputs((4, 8), (8,))
    dx = torch.full((4, 8), 5.0)
    assert run(dy, x, norm, mean, -rstd, weight, None, ALL, dx, torch.zeros(8), torch.zeros(8)) == INVALID
    assert "rstd" in aclnn.aclGetRecentErrMsg()
    assert torch.all(dx == 5.0)


def _good():
    dy, x, norm, mean, rstd, weight = inputs((2, 3, 8), (8,), F32, F32)
    return [dy, x, norm, mean, rstd, weight, torch.zeros(8), ALL, torch.empty(2, 3, 8), torch.empty(8),
            torch.empty(8)]


GRAD_OUT, INPUT, NORM, MEAN, RSTD, WEIGHT, BIAS, MASK, GRAD_INPUT, GRAD_WEIGHT, GRAD_BIAS = range(11)

# (position, value, status, why): ops-nn's status table, row by row.
CASES = [
    (GRAD_OUT, None, NULL, "gradOut null"),
    (INPUT, None, NULL, "input null"),
    (NORM, None, NULL, "normalizedShape null"),
    (MEAN, None, NULL, "mean null"),
    (RSTD, None, NULL, "rstd null"),
    (MASK, None, NULL, "outputMask null"),
    (GRAD_INPUT, None, NULL, "outputMask[0] True and gradInputOut null"),
    (GRAD_WEIGHT, None, NULL, "outputMask[1] True and gradWeightOut null"),
    (GRAD_BIAS, None, NULL, "outputMask[2] True and gradBiasOut null"),
    (GRAD_OUT, torch.zeros(2, 3, 8, dtype=F64), INVALID, "gradOut float64: not in the dtype list"),
    (MEAN, torch.zeros(2, 3, 1, dtype=torch.int32), INVALID, "mean int32"),
    (WEIGHT, torch.ones(8, dtype=F16), INVALID, "weight neither float32 nor input's dtype"),
    (BIAS, torch.zeros(8, dtype=F64), INVALID, "bias float64"),
    (GRAD_WEIGHT, torch.empty(8, dtype=F64), INVALID, "gradWeightOut float64"),
    (GRAD_OUT, torch.zeros(2, 3, 7), INVALID, "gradOut's shape not input's"),
    (NORM, [], INVALID, "normalizedShape empty"),
    (NORM, [1] * 9, INVALID, "normalizedShape longer than 8"),
    (NORM, [1, 2, 3, 8], INVALID, "normalizedShape longer than input's rank"),
    (NORM, [7], INVALID, "normalizedShape not input's trailing dim"),
    (NORM, [4, 8], INVALID, "normalizedShape's leading dim not input's"),
    (NORM, [8.0], INVALID, "normalizedShape of floats"),
    (MEAN, torch.zeros(5, 1), INVALID, "mean with 5 elements, M = 6"),
    (RSTD, torch.ones(6), INVALID, "rstd's shape not mean's"),
    (WEIGHT, torch.ones(1, 8), INVALID, "weight's shape not normalizedShape"),
    (BIAS, torch.ones(4), INVALID, "bias's shape not normalizedShape"),
    (MASK, [True, True], INVALID, "outputMask of length 2"),
    (MASK, [1, 1, 1], INVALID, "outputMask of ints"),
    (GRAD_INPUT, torch.empty(6, 8), INVALID, "gradInputOut's shape not input's"),
    (GRAD_WEIGHT, torch.empty(9), INVALID, "gradWeightOut not N elements"),
    (GRAD_BIAS, torch.empty(2, 4), None, "gradBiasOut of N elements in another shape: accepted (a numel check)"),
    (GRAD_INPUT, torch.empty(1, 1, 8).expand(2, 3, 8), INVALID, "gradInputOut whose elements share memory"),
    (INPUT, torch.zeros(()), INVALID, "input of rank 0"),
]


@pytest.mark.parametrize("pos,value,status,why", CASES, ids=[c[3] for c in CASES])
def test_status(pos, value, status, why):
    args = _good()
    args[pos] = value
    assert run(*args) == (status or ACLNN_SUCCESS), (why, aclnn.aclGetRecentErrMsg())
    if status:
        assert "aclnnLayerNormBackward" in aclnn.aclGetRecentErrMsg()


def test_the_null_check_comes_before_the_mask_length():
    args = _good()
    args[GRAD_OUT], args[MASK] = None, [True]
    assert run(*args) == NULL


def test_all_outputs_masked_off_is_success_with_nothing_to_run():
    args = _good()
    args[MASK] = [False, False, False]
    args[GRAD_INPUT] = args[GRAD_WEIGHT] = args[GRAD_BIAS] = None
    status, size, executor = aclnn.aclnnLayerNormBackwardGetWorkspaceSize(*args)
    assert (status, size) == (ACLNN_SUCCESS, 0)
    assert aclnn.aclnnLayerNormBackward(None, 0, executor, None) == ACLNN_SUCCESS
