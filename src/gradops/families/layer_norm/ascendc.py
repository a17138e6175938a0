"""AscendC LayerNormGradBeta and its companion LayerNormGrad, kernel-level API on torch tensors.

LayerNormGradBeta follows the AscendC implementation (cannmirror/asc-devkit
``impl/adv_api/detail/normalization/layernormgrad/layernormgradbeta_common_impl.h``) chunk by chunk, in the
caller's temporary buffer, so that buffer use, summation order and side effects are CANN's:

- the input is walked in ``tiling.loopRound`` chunks of ``oneCalSize`` elements, then a tail of
  ``inputTailSize``; per chunk ``prod = dy * resForGamma`` goes to a float32 temporary, then
  ``pdGamma += prod[row]`` and ``pdBeta += dy[row]`` row after row (the first chunk starts from its row 0:
  ``ReduceSumFirstN<isClearDst=true>``), i.e. a sequential float32 sum over B*S rows;
- float: the accumulators are the outputs themselves; the temporary is ``sharedTmpBuffer`` or, with
  ``isReuseSource=True``, the first ``oneCalSize`` elements of **resForGamma** (the doc says inputDy; the code
  uses resForGamma), which therefore holds products afterwards;
- half: dy and resForGamma are cast to float32 temporaries, the accumulators are float32 (at
  ``gammaTempTensorPos`` / ``betaTempTensorPos`` in the buffer), and the outputs get ``half(accumulator)`` after
  every chunk, so the result is ``half(float32 sum)``. isReuseSource is refused for half.

That walk is this surface's own arithmetic, so LayerNormGradBeta uses the op's validation table (CANN-strict form)
and no backend; LayerNormGrad, whose tiling only schedules the formula, runs through the op's call plan like
:func:`gradops.layer_norm_grad`. Misuse raises :class:`~gradops.status.OpError` (status 161002; AscendC asserts
instead).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...ascendc.tiling import LayerNormGradBetaTiling
from ...contract._common import fail, require_dtype, require_present, require_same_device, shape_text
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import OpError
from .contract import check_layer_norm_grad_beta
from .ops import plan_layer_norm_grad

_ALIGN_BYTES = 32  # AscendC vector operands: the H axis must fill whole 32-byte blocks


#: AscendC's argument names for the validation tables' (PyTorch API) names: refusals name the caller's argument.
_GRAD_NAMES = {"dy": "inputDy", "x": "inputX", "variance": "inputVariance", "mean": "inputMean", "gamma": "inputGamma"}
_BETA_NAMES = {"res_for_gamma": "resForGamma", "dy": "inputDy"}


def _byte_range(t: Tensor) -> tuple[int, int] | None:
    if t.numel() == 0:
        return None
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors share bytes (same device, intersecting address ranges)."""
    ra, rb = _byte_range(a), _byte_range(b)
    return a.device == b.device and ra is not None and rb is not None and ra[0] < rb[1] and rb[0] < ra[1]


def _check_outputs_disjoint(op: str, **outs: Tensor) -> None:
    (na, a), (nb, b) = outs.items()
    if overlap(a, b):
        raise fail(INVALID, op, f"{na}/{nb}", "non-overlapping memory", "overlapping tensors")


def _check_tiling(op: str, t: LayerNormGradBetaTiling, item: int) -> int:
    if not isinstance(t, LayerNormGradBetaTiling):
        raise fail(INVALID, op, "tiling", "a LayerNormGradBetaTiling", type(t).__name__)
    h = t.hLength
    if h == 0 or t.originalHLength != h:
        raise fail(INVALID, op, "tiling.originalHLength", f"hLength = {h} > 0 (storage H and origin H must be equal)",
                   str(t.originalHLength))
    if t.numberOfTmpBuf != (2 if item == 2 else 1):  # positions of a float tiling would alias half's temporaries
        raise fail(INVALID, op, "tiling.numberOfTmpBuf", f"{2 if item == 2 else 1} (a tiling for typeSize = {item})",
                   str(t.numberOfTmpBuf))
    if h * item % _ALIGN_BYTES:
        raise fail(INVALID, op, "H * sizeof(T)", f"a multiple of {_ALIGN_BYTES} bytes (pad H with zeros)",
                   f"{h} * {item} = {h * item}")
    if (t.bshLength != t.bLength * t.sLength * h or t.oneCalSize == 0 or t.oneCalSize % h
            or t.loopRound * t.oneCalSize + t.inputTailSize != t.bshLength):
        raise fail(INVALID, op, "tiling", "the result of GetLayerNormGradBetaNDTilingInfo", repr(t))
    if t.resForGammaTmpTensorPos + t.oneCalSize > t.stackBufferSize:
        raise fail(INVALID, op, "tiling.stackBufferSize", f">= resForGammaTmpTensorPos + oneCalSize = "
                   f"{t.resForGammaTmpTensorPos + t.oneCalSize}", str(t.stackBufferSize))
    return h


def _stack_buffer(op: str, buf: Tensor | None, t: LayerNormGradBetaTiling, device: torch.device) -> Tensor:
    """The float32 view of the temporary buffer (allocated here when None: the framework-managed variant)."""
    need = t.stackBufferSize * 4
    if buf is None:
        return torch.empty(t.stackBufferSize, dtype=torch.float32, device=device)
    require_dtype(op, "sharedTmpBuffer", buf, (torch.uint8,))
    if buf.device != device or not buf.is_contiguous():
        raise fail(INVALID, op, "sharedTmpBuffer", f"a contiguous uint8 tensor on {device}",
                   f"device {buf.device}, contiguous={buf.is_contiguous()}")
    if buf.numel() < need:
        raise fail(INVALID, op, "sharedTmpBuffer", f">= tiling.stackBufferSize * 4 = {need} bytes",
                   f"{buf.numel()} bytes")
    return buf.reshape(-1)[:need].view(torch.float32)


def _reduce_rows(acc: Tensor, rows: Tensor, clear: bool) -> None:
    """AscendC ReduceSumFirstN: ``acc = rows[0] + 0`` when clearing, then ``acc = rows[i] + acc`` in row order."""
    start = 0
    if clear:
        torch.add(rows[0], 0.0, out=acc)
        start = 1
    for i in range(start, rows.shape[0]):
        acc.add_(rows[i])


def LayerNormGradBeta(outputPdGamma: Tensor, outputPdBeta: Tensor, resForGamma: Tensor, inputDy: Tensor,
                      tiling: LayerNormGradBetaTiling, sharedTmpBuffer: Tensor | None = None,
                      isReuseSource: bool = False) -> None:
    """``pdGamma[h] = sum_{b,s} inputDy * resForGamma``, ``pdBeta[h] = sum_{b,s} inputDy``, written in place.

    Args:
        outputPdGamma, outputPdBeta: (H,), dtype of the inputs, contiguous, not overlapping each other.
        resForGamma: (B, S, H) or flat (B*S*H,), from :func:`LayerNormGrad`; half or float.
        inputDy: same shape and dtype as resForGamma.
        tiling: from ``GetLayerNormGradBetaNDTilingInfo([B, S, H, H], bufferBytes, sizeof(T), isReuseSource)``.
        sharedTmpBuffer: uint8 tensor of at least ``tiling.stackBufferSize * 4`` bytes, or None to let the API
            allocate it.
        isReuseSource: float only; uses resForGamma as the product's temporary (resForGamma is overwritten).

    Cost: one small torch op per row (AscendC's sequential row order, reproduced exactly), i.e. an emulation for
    ported kernel code and for checking CANN's numerics; :func:`gradops.layer_norm_grad_beta` is the fast path.
    C's argument order with a buffer is ``(..., inputDy, sharedTmpBuffer, tiling)``; here tiling comes first
    because the buffer is optional.
    """
    op = "LayerNormGradBeta"
    require_present(op, outputPdGamma=outputPdGamma, outputPdBeta=outputPdBeta, resForGamma=resForGamma,
                    inputDy=inputDy)
    try:
        check_layer_norm_grad_beta(resForGamma, inputDy, cann=True)
    except OpError as e:
        raise e.renamed(_BETA_NAMES, op) from None
    dtype, device = inputDy.dtype, inputDy.device
    require_same_device(op, inputDy=inputDy, outputPdGamma=outputPdGamma, outputPdBeta=outputPdBeta)
    for name, out in (("outputPdGamma", outputPdGamma), ("outputPdBeta", outputPdBeta)):
        require_dtype(op, name, out, (dtype,))
    if not isinstance(isReuseSource, bool):
        raise fail(INVALID, op, "isReuseSource", "a bool", type(isReuseSource).__name__)
    half = dtype == torch.float16
    if half and isReuseSource:
        raise fail(INVALID, op, "isReuseSource", "False for half inputs (only float may reuse the source)", "True")
    h = _check_tiling(op, tiling, inputDy.element_size())
    expected = ((tiling.bLength, tiling.sLength, h), (tiling.bshLength,))
    for name, t in (("inputDy", inputDy), ("resForGamma", resForGamma)):
        if tuple(t.shape) not in expected or not t.is_contiguous():
            raise fail(INVALID, op, name, f"a contiguous tensor of shape {shape_text(expected[0])} or "
                       f"{shape_text(expected[1])} (the tiling's B, S, H)", f"shape {shape_text(t.shape)}")
    for name, t in (("outputPdGamma", outputPdGamma), ("outputPdBeta", outputPdBeta)):
        if tuple(t.shape) != (h,) or not t.is_contiguous():
            raise fail(INVALID, op, name, f"a contiguous tensor of shape ({h},)", f"shape {shape_text(t.shape)}")
    _check_outputs_disjoint(op, outputPdGamma=outputPdGamma, outputPdBeta=outputPdBeta)
    stack = _stack_buffer(op, sharedTmpBuffer, tiling, device)

    dy, res = inputDy.reshape(-1), resForGamma.reshape(-1)
    if half:
        gamma_acc = stack[tiling.gammaTempTensorPos:tiling.gammaTempTensorPos + h]
        beta_acc = stack[tiling.betaTempTensorPos:tiling.betaTempTensorPos + h]
    else:
        gamma_acc, beta_acc = outputPdGamma, outputPdBeta
    chunks = [(i * tiling.oneCalSize, tiling.oneCalSize) for i in range(tiling.loopRound)]
    if tiling.inputTailSize:
        chunks.append((tiling.inputTailPos, tiling.inputTailSize))
    with torch.no_grad():
        for index, (offset, n) in enumerate(chunks):
            d, r = dy[offset:offset + n], res[offset:offset + n]
            if half:  # cast up into the two float32 temporaries; the product overwrites resForGamma's copy
                d = stack[tiling.inputDyTmpTensorPos:tiling.inputDyTmpTensorPos + n].copy_(d)
                r = stack[tiling.resForGammaTmpTensorPos:tiling.resForGammaTmpTensorPos + n].copy_(r)
                prod = r
            elif isReuseSource:  # params.resForGammaTmpTensor = resForGamma (offset 0, every chunk)
                prod = res[:n]
            else:
                prod = stack[tiling.resForGammaTmpTensorPos:tiling.resForGammaTmpTensorPos + n]
            torch.mul(d, r, out=prod)
            _reduce_rows(gamma_acc, prod.view(n // h, h), clear=index == 0)
            _reduce_rows(beta_acc, d.view(n // h, h), clear=index == 0)
            if half:
                outputPdGamma.copy_(gamma_acc)
                outputPdBeta.copy_(beta_acc)


def LayerNormGrad(outputPdX: Tensor, resForGamma: Tensor, inputDy: Tensor, inputX: Tensor, inputVariance: Tensor,
                  inputMean: Tensor, inputGamma: Tensor, epsilon: float) -> None:
    """AscendC LayerNormGrad: writes ``pd_x`` and ``resForGamma = (x - mean) * (variance + epsilon)^-0.5``.

    The formula is AscendC's, term by term (``pd_var``, ``pd_mean`` with its ``sum(x - mean)`` term; see
    :mod:`gradops.families.layer_norm.reference`), validated and run by the op's call plan
    (:mod:`gradops.ops._plan`: the table's CANN-strict check and the backend :func:`gradops.layer_norm_grad` runs).
    The LayerNormGrad tiling and temporary buffer only schedule the same arithmetic on the NPU and are not ported.

    Args:
        outputPdX, resForGamma: outputs of x's shape and dtype, not overlapping each other.
        inputDy, inputX: (B, S, H) (any leading dims), half or float.
        inputVariance, inputMean: (B, S) or (B, S, 1), float32 or x's dtype (variance is biased, not rstd).
        inputGamma: (H,), x's dtype.
        epsilon: added to the variance.
    """
    op = "LayerNormGrad"
    require_present(op, outputPdX=outputPdX, resForGamma=resForGamma)
    try:
        called = plan_layer_norm_grad(inputDy, inputX, inputVariance, inputMean, inputGamma, epsilon, cann=True)
    except OpError as e:
        raise e.renamed(_GRAD_NAMES, op) from None
    require_same_device(op, inputX=inputX, outputPdX=outputPdX, resForGamma=resForGamma)
    for name, out in (("outputPdX", outputPdX), ("resForGamma", resForGamma)):
        require_dtype(op, name, out, (inputX.dtype,))
        if out.shape != inputX.shape:
            raise fail(INVALID, op, f"{name}.shape", shape_text(inputX.shape) + " (the shape of inputX)",
                       shape_text(out.shape))
    _check_outputs_disjoint(op, outputPdX=outputPdX, resForGamma=resForGamma)
    rows, cols = called.shape
    with torch.no_grad():
        pdx, res = called.backend.fn(inputDy.reshape(rows, cols), inputX.reshape(rows, cols),
                                     inputVariance.reshape(rows), inputMean.reshape(rows), inputGamma, float(epsilon))
        outputPdX.copy_(pdx.reshape(inputX.shape))
        resForGamma.copy_(res.reshape(inputX.shape))
