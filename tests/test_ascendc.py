"""gradops.ascendc: LayerNormGradBeta tiling arithmetic (semantics.md §4), the chunked computation against a
float64 sum and against AscendC's sequential float32 order, the isReuseSource side effect, every misuse error,
and LayerNormGrad against the PyTorch API."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops.ascendc import (
    GetLayerNormGradBetaMaxMinTmpSize,
    GetLayerNormGradBetaNDTilingInfo,
    LayerNormGrad,
    LayerNormGradBeta,
    LayerNormGradBetaTiling,
)
from gradops.status import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, OpError

U32 = torch.finfo(torch.float32).eps / 2
SIZE = {torch.float32: 4, torch.float16: 2}


def expected_tiling(b, s, h, type_size, nbytes):
    """semantics.md §4, transcribed: the fields GetLayerNormGradBetaNDTilingInfo must produce."""
    bsh, floats = b * s * h, nbytes // 4
    one = floats if type_size == 4 else (floats - 2 * h) // 2
    one = min(one // h * h, bsh)
    tail = bsh % one
    pos = (0, 0, 0, 0) if type_size == 4 else (0, h, 2 * h, 2 * h + one)
    return {"stackBufferSize": floats, "bLength": b, "sLength": s, "hLength": h, "originalHLength": h,
            "bshLength": bsh, "bsLength": b * s, "oneCalSize": one, "numberOfTmpBuf": 1 if type_size == 4 else 2,
            "loopRound": bsh // one, "inputTailSize": tail, "inputTailPos": bsh - tail, "bsTailSize": tail // h,
            "bshCurLength": one, "bsCurLength": one // h, "gammaTempTensorPos": pos[0], "betaTempTensorPos": pos[1],
            "inputDyTmpTensorPos": pos[2], "resForGammaTmpTensorPos": pos[3], "reserved": 0}


SHAPES = [(2, 5, 16), (1, 1, 8), (3, 7, 64), (4, 33, 32)]


@pytest.mark.parametrize("b,s,h", SHAPES)
@pytest.mark.parametrize("type_size", [4, 2])
@pytest.mark.parametrize("scale", ["min", "min+row", "3min", "max", "2max"])
def test_tiling_matches_the_formulas(b, s, h, type_size, scale):
    mx, mn = GetLayerNormGradBetaMaxMinTmpSize([b, s, h, h], type_size, False)
    k = 4 if type_size == 2 else 2
    assert (mx, mn) == (k * b * s * h * 4, k * h * 4)
    assert GetLayerNormGradBetaMaxMinTmpSize([b, s, h, h], type_size, True) == (mx, mn)  # isReuseSource ignored
    nbytes = {"min": mn, "min+row": mn + h * 4 * (3 - type_size // 2), "3min": 3 * mn, "max": mx, "2max": 2 * mx}[scale]
    tiling = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], nbytes, type_size, False)
    assert vars(tiling) == expected_tiling(b, s, h, type_size, nbytes)
    assert tiling.loopRound * tiling.oneCalSize + tiling.inputTailSize == b * s * h


def test_tiling_worked_example():
    # float, B=2 S=5 H=16, 256 bytes = 64 floats: chunks of 64 elements (4 rows), 160 = 2*64 + 32 (2-row tail).
    t = GetLayerNormGradBetaNDTilingInfo([2, 5, 16, 16], 256, 4, False)
    assert (t.oneCalSize, t.loopRound, t.inputTailSize, t.inputTailPos, t.bsTailSize, t.bsCurLength) == \
        (64, 2, 32, 128, 2, 4)
    # half, same shape, 512 bytes = 128 floats: (128 - 32) / 2 = 48 -> 3 rows; positions [0, 16, 32, 80].
    t = GetLayerNormGradBetaNDTilingInfo([2, 5, 16, 16], 512, 2, False)
    assert (t.oneCalSize, t.loopRound, t.inputTailSize, t.betaTempTensorPos, t.resForGammaTmpTensorPos) == \
        (48, 3, 16, 16, 80)


@pytest.mark.parametrize("args,status", [
    (([2, 5, 16, 16], 256, 3, False), ACLNN_ERR_PARAM_INVALID),        # typeSize not 2 or 4
    (([2, 5, 16], 256, 4, False), ACLNN_ERR_PARAM_INVALID),            # 3 dims
    (([2, 0, 16, 16], 256, 4, False), ACLNN_ERR_PARAM_INVALID),        # empty shape
    (([2, 5, 16, 16], 127, 4, False), ACLNN_ERR_INNER_TILING_ERROR),   # < 2H floats
    (([2, 5, 16, 16], 255, 2, False), ACLNN_ERR_INNER_TILING_ERROR),   # half: 2H floats but no room for a row
    (([1 << 16, 1 << 10, 64, 64], 256, 4, False), ACLNN_ERR_PARAM_INVALID),  # B*S*H beyond uint32
    (([2, 5, 16, 16], 256, 4, 1), ACLNN_ERR_PARAM_INVALID),            # isReuseSource not a bool
])
def test_tiling_errors(args, status):
    with pytest.raises(OpError) as info:
        GetLayerNormGradBetaNDTilingInfo(*args)
    assert info.value.status == status
    if status == ACLNN_ERR_PARAM_INVALID:
        with pytest.raises(OpError):
            GetLayerNormGradBetaMaxMinTmpSize(args[0], args[2], args[3])


# ------------------------------------------------------------------------------------------ chunked compute
def inputs(b, s, h, dtype):
    return torch.randn(b, s, h).to(dtype), torch.randn(b, s, h).to(dtype)  # resForGamma, dy


def run(res, dy, nbytes, shared=True, reuse=False):
    b, s, h = dy.shape
    tiling = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], nbytes, SIZE[dy.dtype], reuse)
    pd_gamma, pd_beta = torch.full((h,), float("nan"), dtype=dy.dtype), torch.full((h,), float("nan"), dtype=dy.dtype)
    buf = torch.empty(nbytes, dtype=torch.uint8) if shared else None
    LayerNormGradBeta(pd_gamma, pd_beta, res, dy, tiling, buf, isReuseSource=reuse)
    return pd_gamma, pd_beta, tiling, buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("factor", [1, 3, 1000])  # one row per chunk, chunks with a tail, one chunk
@pytest.mark.parametrize("shared", [True, False])
def test_matches_float64_sum(dtype, factor, shared):
    res, dy = inputs(3, 7, 32, dtype)
    nbytes = GetLayerNormGradBetaMaxMinTmpSize([3, 7, 32, 32], SIZE[dtype], False)[1] * factor
    pd_gamma, pd_beta, tiling, _ = run(res, dy, nbytes, shared)
    assert (tiling.loopRound == 1) == (factor == 1000) and (factor != 3 or tiling.inputTailSize > 0)
    d, r = dy.double().reshape(-1, 32), res.double().reshape(-1, 32)
    for got, terms in ((pd_gamma, d * r), (pd_beta, d)):
        ref = terms.sum(0)
        # Products round once (u32), a sequential float32 sum of n terms errs by <= (n-1) u32 sum|terms|; half
        # outputs round once more (half an ulp, eps/2 relative).
        n = terms.shape[0]
        tol = (n + 1) * U32 * terms.abs().sum(0) + torch.finfo(dtype).eps / 2 * ref.abs() + 1e-30
        assert bool(((got.double() - ref).abs() <= tol).all()), (got.double() - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sums_rows_in_ascendc_order_with_float32_accumulation(dtype):
    res, dy = inputs(2, 7, 16, dtype)
    pd_gamma, pd_beta, tiling, buf = run(res, dy, 3 * GetLayerNormGradBetaMaxMinTmpSize([2, 7, 16, 16],
                                                                                          SIZE[dtype], False)[1])
    assert tiling.inputTailSize > 0  # several chunks and a tail
    g_acc, b_acc = dy[0, 0].float() * res[0, 0].float(), dy[0, 0].float()
    for row_dy, row_res in zip(dy.reshape(-1, 16)[1:], res.reshape(-1, 16)[1:]):  # row after row, float32
        g_acc, b_acc = g_acc + row_dy.float() * row_res.float(), b_acc + row_dy.float()
    assert torch.equal(pd_gamma, g_acc.to(dtype)) and torch.equal(pd_beta, b_acc.to(dtype))
    if dtype == torch.float16:  # the float32 accumulators live in the shared buffer, the outputs are half(acc)
        stack = buf.view(torch.float32)
        assert torch.equal(stack[tiling.gammaTempTensorPos:][:16], g_acc)
        assert torch.equal(stack[tiling.betaTempTensorPos:][:16], b_acc)


def test_reuse_source_overwrites_res_for_gamma_not_input_dy():
    res, dy = inputs(2, 5, 16, torch.float32)
    res0, dy0 = res.clone(), dy.clone()
    pd_gamma, _, t, _ = run(res, dy, 256, reuse=True)  # chunks of 64, tail of 32 at 128
    expect, _, _, _ = run(res0.clone(), dy0.clone(), 256)
    assert torch.equal(pd_gamma, expect) and torch.equal(dy, dy0)  # inputDy untouched (the doc says otherwise)
    flat, flat0, dflat = res.reshape(-1), res0.reshape(-1), dy0.reshape(-1)
    tail = slice(t.inputTailPos, t.inputTailPos + t.inputTailSize)
    assert torch.equal(flat[:t.inputTailSize], dflat[tail] * flat0[tail])  # the last chunk's products
    assert torch.equal(flat[t.inputTailSize:t.oneCalSize], dflat[96:128] * flat0[96:128])  # chunk 1's leftovers
    assert torch.equal(flat[t.oneCalSize:], flat0[t.oneCalSize:])


# ------------------------------------------------------------------------------------------------ misuse
def misuse(**change):
    """Valid float arguments for B=2, S=4, H=8 (32 bytes per row), with ``change`` applied."""
    res, dy = inputs(2, 4, 8, torch.float32)
    args = {"outputPdGamma": torch.empty(8), "outputPdBeta": torch.empty(8), "resForGamma": res, "inputDy": dy,
            "tiling": GetLayerNormGradBetaNDTilingInfo([2, 4, 8, 8], 128, 4, False),
            "sharedTmpBuffer": torch.empty(128, dtype=torch.uint8), "isReuseSource": False}
    args.update(change)
    return args


def half_h8():
    res, dy = inputs(2, 4, 8, torch.float16)
    return {"outputPdGamma": torch.empty(8, dtype=torch.float16), "outputPdBeta": torch.empty(8, dtype=torch.float16),
            "resForGamma": res, "inputDy": dy, "tiling": GetLayerNormGradBetaNDTilingInfo([2, 4, 8, 8], 256, 2, False),
            "sharedTmpBuffer": torch.empty(256, dtype=torch.uint8)}


BUF = torch.empty(16)
INV = ACLNN_ERR_PARAM_INVALID
MISUSE = {  # name: (arguments, status, the argument the error must name, in AscendC's spelling: issue 12.6)
    "null output": (misuse(outputPdBeta=None), ACLNN_ERR_PARAM_NULLPTR, "outputPdBeta"),
    "null input": (misuse(inputDy=None), ACLNN_ERR_PARAM_NULLPTR, "inputDy"),
    "bfloat16": (misuse(inputDy=torch.zeros(2, 4, 8, dtype=torch.bfloat16)), INV, "inputDy.dtype"),
    "output dtype": (misuse(outputPdGamma=torch.empty(8, dtype=torch.float16)), INV, "outputPdGamma.dtype"),
    "half + isReuseSource": ({**half_h8(), "isReuseSource": True}, INV, "isReuseSource"),
    "H*sizeof(half) = 16 bytes": (half_h8(), INV, "H * sizeof(T)"),
    "H*sizeof(float) = 48 bytes": (misuse(resForGamma=torch.zeros(2, 4, 12), inputDy=torch.zeros(2, 4, 12),
                                          tiling=GetLayerNormGradBetaNDTilingInfo([2, 4, 12, 12], 192, 4, False)),
                                   INV, "H * sizeof(T)"),
    "overlapping outputs": (misuse(outputPdGamma=BUF[:8], outputPdBeta=BUF[4:12]), INV, "outputPdGamma/outputPdBeta"),
    "buffer too small": (misuse(sharedTmpBuffer=torch.empty(127, dtype=torch.uint8)), INV, "sharedTmpBuffer"),
    "buffer not uint8": (misuse(sharedTmpBuffer=torch.empty(32)), INV, "sharedTmpBuffer.dtype"),
    "inputs differ in shape": (misuse(resForGamma=torch.zeros(4, 2, 8)), INV, "resForGamma.shape"),
    "inputs vs tiling": (misuse(resForGamma=torch.zeros(4, 2, 8), inputDy=torch.zeros(4, 2, 8)), INV, "inputDy"),
    "output shape": (misuse(outputPdGamma=torch.empty(16)), INV, "outputPdGamma"),
    "originH != storageH": (misuse(tiling=GetLayerNormGradBetaNDTilingInfo([2, 4, 8, 6], 128, 4, False)), INV,
                            "tiling.originalHLength"),
    "tiling for typeSize 2": (misuse(tiling=GetLayerNormGradBetaNDTilingInfo([2, 4, 8, 8], 256, 2, False)), INV,
                              "tiling.numberOfTmpBuf"),
    "not a tiling": (misuse(tiling={"hLength": 8}), INV, "tiling"),
    "tiling edited": (misuse(tiling=LayerNormGradBetaTiling(bLength=2, sLength=4, hLength=8, originalHLength=8,
                                                            bshLength=64, oneCalSize=12, stackBufferSize=32,
                                                            numberOfTmpBuf=1)), INV, "tiling"),
}


@pytest.mark.parametrize("name", list(MISUSE))
def test_misuse_raises(name):
    args, status, arg = MISUSE[name]
    with pytest.raises(OpError) as info:
        LayerNormGradBeta(**args)
    assert (info.value.status, info.value.arg) == (status, arg), str(info.value)


def test_adjacent_outputs_in_one_buffer_and_flat_inputs_are_fine():
    buf = torch.empty(16)
    args = misuse(outputPdGamma=buf[:8], outputPdBeta=buf[8:])
    args["resForGamma"], args["inputDy"] = args["resForGamma"].reshape(-1), args["inputDy"].reshape(-1)
    LayerNormGradBeta(**args)
    d, r = args["inputDy"].double().reshape(-1, 8), args["resForGamma"].double().reshape(-1, 8)
    tol = 10 * U32 * float((d * r).abs().sum() + d.abs().sum())  # 8 rows, sequential float32 sums
    assert torch.allclose(buf[:8].double(), (d * r).sum(0), rtol=0, atol=tol)
    assert torch.allclose(buf[8:].double(), d.sum(0), rtol=0, atol=tol)


# -------------------------------------------------------------------------------------------- LayerNormGrad
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_grad_matches_api_and_feeds_grad_beta(dtype):
    x, dy, gamma = torch.randn(2, 3, 16).to(dtype), torch.randn(2, 3, 16).to(dtype), torch.randn(16).to(dtype)
    mean = x.float().mean(-1, keepdim=True)
    var = (x.float() - mean).square().mean(-1, keepdim=True)
    pdx, res = torch.empty_like(x), torch.empty_like(x)
    LayerNormGrad(pdx, res, dy, x, var, mean, gamma, 1e-5)
    epdx, eres = gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5)
    assert torch.equal(pdx, epdx) and torch.equal(res, eres)
    xhat = (x.double() - mean.double()) / torch.sqrt(var.double() + 1e-5)
    pd_gamma, _, _, _ = run(res, dy, 1 << 12)
    ref = (dy.double() * xhat).sum((0, 1))
    # res rounds to x's dtype (eps/2 relative per term) before the float32 sum of 6 rows.
    tol = (torch.finfo(dtype).eps + 8 * U32) * (dy.double() * xhat).abs().sum((0, 1)) + \
        torch.finfo(dtype).eps / 2 * ref.abs()
    assert bool(((pd_gamma.double() - ref).abs() <= tol).all())


def test_layer_norm_grad_misuse():
    x = torch.randn(2, 16)
    stats = (x.var(-1, unbiased=False), x.mean(-1), torch.ones(16), 1e-5)
    with pytest.raises(OpError) as info:
        LayerNormGrad(torch.empty(2, 16), torch.empty(2, 8), x, x, *stats)
    assert info.value.status == ACLNN_ERR_PARAM_INVALID
    both = torch.empty(3, 16)
    with pytest.raises(OpError):
        LayerNormGrad(both[:2], both[1:], x, x, *stats)  # outputs overlap
    with pytest.raises(OpError) as info:
        LayerNormGrad(None, torch.empty(2, 16), x, x, *stats)
    assert info.value.status == ACLNN_ERR_PARAM_NULLPTR


def test_layer_norm_grad_refusals_name_ascendc_arguments():
    """Issue 12.6: the shared validation table names the PyTorch API's arguments (dy, x, variance); AscendC's
    LayerNormGrad names its own (inputDy, inputX, inputVariance)."""
    from gradops.ascendc import LayerNormGrad

    x = torch.zeros(2, 4, 8)
    outs = (torch.empty(2, 4, 8), torch.empty(2, 4, 8))
    stat, gamma = torch.zeros(2, 4), torch.ones(8)
    for bad, arg in (({"inputDy": torch.zeros(2, 4, 7)}, "inputDy.shape"),
                     ({"inputVariance": torch.zeros(3, 4)}, "inputVariance.shape"),
                     ({"inputX": torch.zeros(2, 4, 8, dtype=torch.float64)}, "inputX.dtype")):
        args = {"inputDy": x, "inputX": x, "inputVariance": stat, "inputMean": stat, "inputGamma": gamma, **bad}
        with pytest.raises(OpError) as info:
            LayerNormGrad(*outs, args["inputDy"], args["inputX"], args["inputVariance"], args["inputMean"],
                          args["inputGamma"], 1e-5)
        assert (info.value.arg, info.value.op) == (arg, "LayerNormGrad"), str(info.value)
