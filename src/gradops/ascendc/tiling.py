"""Host-side tiling of AscendC LayerNormGradBeta (cannmirror/asc-devkit
``impl/adv_api/tiling/normalization/layernorm_grad_beta_tiling_impl.cpp``; docs/semantics.md §4).

The tiling cuts the B*S*H input into ``loopRound`` chunks of ``oneCalSize`` elements (a whole number of rows)
plus a tail of ``inputTailSize`` elements, sized so that a chunk's float32 temporaries fit the stack buffer:

- float: one temporary (the product dy*resForGamma), so ``oneCalSize = floor(stackBufferSize/4 / H) * H``;
- half: two float32 temporaries (dy and resForGamma cast up) plus two H-long float32 accumulators, so
  ``oneCalSize = floor((stackBufferSize/4 - 2H) / 2 / H) * H``;

then ``oneCalSize = min(oneCalSize, B*S*H)``. Fields are uint32 in C; a value that would wrap is refused here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..status import ACLNN_ERR_INNER_TILING_ERROR, ACLNN_ERR_PARAM_INVALID, OpError

_API = "LayerNormGradBeta"
_UINT32_MAX = (1 << 32) - 1
_FLOAT_BYTES = 4
_HALF_BYTES = 2


@dataclass
class LayerNormGradBetaTiling:
    """``LayerNormGradBetaTiling`` (all fields uint32, in elements unless the name says otherwise).

    ``stackBufferSize`` counts float32 elements of the temporary buffer; ``*Pos`` are float32 offsets into it.
    """

    stackBufferSize: int = 0
    bLength: int = 0
    sLength: int = 0
    hLength: int = 0
    originalHLength: int = 0
    bshLength: int = 0
    bsLength: int = 0
    oneCalSize: int = 0
    numberOfTmpBuf: int = 0
    loopRound: int = 0
    inputTailSize: int = 0
    inputTailPos: int = 0
    bsTailSize: int = 0
    bshCurLength: int = 0
    bsCurLength: int = 0
    gammaTempTensorPos: int = 0
    betaTempTensorPos: int = 0
    inputDyTmpTensorPos: int = 0
    resForGammaTmpTensorPos: int = 0
    reserved: int = 0


def _fail(status: int, func: str, arg: str, expected: str, given: object) -> OpError:
    return OpError(status, f"{_API}.{func}", arg, expected, str(given))


def _u32(func: str, name: str, value: int) -> int:
    if value > _UINT32_MAX:
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, name, f"<= {_UINT32_MAX} (a uint32; C would wrap)", value)
    return value


def _check_common(func: str, srcShape: Sequence[int], typeSize: int, isReuseSource: bool) -> tuple[int, ...]:
    """The host asserts of CheckLayerNormGradBetaHostCommon: typeSize 2 or 4, 4 dims, positive shape size."""
    if typeSize not in (_HALF_BYTES, _FLOAT_BYTES) or isinstance(typeSize, bool):
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, "typeSize", "2 (half) or 4 (float)", typeSize)
    if not isinstance(isReuseSource, bool):
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, "isReuseSource", "a bool", type(isReuseSource).__name__)
    try:
        dims = tuple(int(d) for d in srcShape)
    except (TypeError, ValueError):
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, "srcShape", "a sequence of 4 ints", srcShape) from None
    if len(dims) != 4:
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, "srcShape", "4 dims [B, S, storageHLength, originHLength]", dims)
    if any(d <= 0 for d in dims):
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, "srcShape", "positive dims (shape size > 0)", dims)
    return dims


def GetLayerNormGradBetaMaxMinTmpSize(srcShape: Sequence[int], typeSize: int,
                                      isReuseSource: bool) -> tuple[int, int]:
    """The temporary-buffer sizes LayerNormGradBeta can work with, in bytes.

    ``max = k * B*S*H * 4`` (the whole input in float32 temporaries at once, one chunk), ``min = k * H * 4``,
    with k = 4 for half (two casts + accumulators) and 2 for float; H is the storage H (srcShape[2]).
    isReuseSource does not change them.

    Args:
        srcShape: ``[B, S, storageHLength, originHLength]``.
        typeSize: bytes of T: 2 (half) or 4 (float).
        isReuseSource: accepted, ignored (as in CANN).

    Returns:
        ``(maxValue, minValue)`` in bytes.
    """
    func = "GetLayerNormGradBetaMaxMinTmpSize"
    b, s, h, _ = _check_common(func, srcShape, typeSize, isReuseSource)
    buffers = 4 if typeSize == _HALF_BYTES else 2
    return (_u32(func, "maxValue", buffers * _u32(func, "B*S*H*4", b * s * h * _FLOAT_BYTES)),
            _u32(func, "minValue", buffers * h * _FLOAT_BYTES))


def GetLayerNormGradBetaNDTilingInfo(srcShape: Sequence[int], stackBufferSize: int, typeSize: int,
                                     isReuseSource: bool) -> LayerNormGradBetaTiling:
    """The tiling for inputs ``[B, S, H]`` and a temporary buffer of ``stackBufferSize`` bytes.

    Args:
        srcShape: ``[B, S, storageHLength, originHLength]``.
        stackBufferSize: bytes of the temporary buffer (at least ``min`` of the function above).
        typeSize: 2 (half) or 4 (float).
        isReuseSource: accepted, ignored (as in CANN).

    Returns:
        A :class:`LayerNormGradBetaTiling`.

    Raises:
        OpError: 161002 for a bad shape or typeSize; 561002 (tiling error) when the buffer holds less than
            2*H floats or, for half, less than one row of temporaries.
    """
    func = "GetLayerNormGradBetaNDTilingInfo"
    b, s, h, oh = _check_common(func, srcShape, typeSize, isReuseSource)
    if isinstance(stackBufferSize, bool) or not isinstance(stackBufferSize, int) or stackBufferSize < 0:
        raise _fail(ACLNN_ERR_PARAM_INVALID, func, "stackBufferSize", "a byte count (uint32)", stackBufferSize)
    t = LayerNormGradBetaTiling(bLength=_u32(func, "B", b), sLength=_u32(func, "S", s), hLength=_u32(func, "H", h),
                                originalHLength=_u32(func, "originH", oh))
    t.bshLength = _u32(func, "B*S*H", b * s * h)
    t.bsLength = b * s
    t.stackBufferSize = _u32(func, "stackBufferSize", stackBufferSize) // _FLOAT_BYTES
    if t.stackBufferSize < 2 * h:
        raise _fail(ACLNN_ERR_INNER_TILING_ERROR, func, "stackBufferSize",
                    f">= 2*H floats = {8 * h} bytes (stackBufferSize is not enough)", f"{stackBufferSize} bytes")
    one, t.numberOfTmpBuf = t.stackBufferSize, 1
    if typeSize == _HALF_BYTES:  # two float32 copies per chunk, after the two H-long accumulators
        t.numberOfTmpBuf = 2
        one = (one - 2 * h) // t.numberOfTmpBuf
    one = one // h * h
    if one == 0:
        raise _fail(ACLNN_ERR_INNER_TILING_ERROR, func, "stackBufferSize",
                    f"room for one row of temporaries: >= {(2 * h + 2 * h) * _FLOAT_BYTES} bytes for half "
                    "(stackBufferSize is not enough)", f"{stackBufferSize} bytes")
    t.oneCalSize = min(one, t.bshLength)
    t.loopRound = t.bshLength // t.oneCalSize
    t.inputTailSize = t.bshLength % t.oneCalSize
    t.inputTailPos = t.bshLength - t.inputTailSize
    t.bsTailSize = t.inputTailSize // h
    t.bshCurLength = t.oneCalSize
    t.bsCurLength = t.oneCalSize // h
    if typeSize == _HALF_BYTES:  # [gamma acc: H][beta acc: H][dy as float: oneCal][resForGamma as float: oneCal]
        t.gammaTempTensorPos = 0
        t.betaTempTensorPos = h
        t.inputDyTmpTensorPos = 2 * h
        t.resForGammaTmpTensorPos = 2 * h + t.oneCalSize
    return t
