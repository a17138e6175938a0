"""Host launchers of Hardswish and HardswishBackward (backend ``triton``): layout analysis, no input copies."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...contract._common import written
from ...launch._common import launch, outputs
from ...spec import Impl
from .contract import hardswish_backward_results, hardswish_results
from .kernels import FLAT_BLOCK, FLAT_WARPS, hardswish_flat_kernel, hardswish_strided_kernel, strided_blocks

#: Dims the strided kernel indexes (after coalescing); rarer layouts fall back to contiguous copies.
STRIDED_DIMS = 4


def _dense(t: Tensor) -> bool:
    """True when ``t``'s elements fill one storage range without gaps or overlaps (any dim order)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _coalesce(shape: tuple[int, ...], strides: list[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous with each other in every tensor."""
    keep = [i for i, s in enumerate(shape) if s != 1]
    sizes = [shape[i] for i in keep]
    strd = [[st[i] for i in keep] for st in strides]
    i = len(sizes) - 1
    while i > 0:
        if all(st[i - 1] == st[i] * sizes[i] for st in strd):
            sizes[i - 1] *= sizes[i]
            for st in strd:
                st[i - 1] = st[i]
                del st[i]
            del sizes[i]
        i -= 1
    return sizes, strd


def _run(g: Tensor | None, x: Tensor, out: Tensor | None) -> Tensor:
    # Both launches pass enable_fp_fusion=False: the backward's x·(1/3) + 0.5 must round the product first, as
    # CANN's Muls/Adds and the other backends do (an FMA gives -1.49e-8 instead of 0 at x = -1.5; see
    # gradops.families.hardswish.cpu). The interpreter ignores the option; numpy never fuses.
    backward = g is not None
    # The declared result is laid out like x: empty_like keeps x's strides when x is dense, else is contiguous; a
    # caller's out is contiguous
    results = hardswish_backward_results(None, g, x) if backward else hardswish_results(None, x)
    out = torch.empty_like(x, dtype=results[0].dtype) if out is None else outputs(out, written(results), x.device)[0]
    n = x.numel()
    if n == 0:
        return out
    tensors = (g, x, out) if backward else (x, x, out)
    if all(t.stride() == x.stride() for t in tensors) and _dense(x):
        # One storage range per tensor, same element order: a flat pass (data_ptr is the lowest address).
        launch(hardswish_flat_kernel, (triton.cdiv(n, FLAT_BLOCK),), tensors[0], x, out, n, BACKWARD=backward,
               BLOCK=FLAT_BLOCK, num_warps=FLAT_WARPS, enable_fp_fusion=False)
        return out
    sizes, strides = _coalesce(tuple(x.shape), [t.stride() for t in tensors])
    if len(sizes) > STRIDED_DIMS:  # > 4 non-mergeable dims: rare; one copy per input (and of a permuted result)
        dense = [t.contiguous() for t in tensors[:2]]
        target = out if out.is_contiguous() else None
        result = _run(dense[0] if backward else None, dense[1], target)
        return result if target is not None else out.copy_(result)
    pad = STRIDED_DIMS - len(sizes)
    sizes = [1] * pad + sizes
    strides = [[0] * pad + st for st in strides]
    rows = n // sizes[3]
    block_r, block_c, warps = strided_blocks(sizes[3])
    col_blocks = triton.cdiv(sizes[3], block_c)
    launch(hardswish_strided_kernel, (triton.cdiv(rows, block_r) * col_blocks,), *tensors, rows, sizes[3], sizes[1],
           sizes[2], col_blocks, *strides[0], *strides[1], *strides[2], BACKWARD=backward, BLOCK_R=block_r,
           BLOCK_C=block_c, num_warps=warps, enable_fp_fusion=False)
    return out


def hardswish(x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``y = x * clamp(x + 3, 0, 6) / 6`` for any shape and strides (no input copy up to 4 coalesced dims).

    Args:
        x: float16 / bfloat16 / float32 tensor. out: optional contiguous result tensor to write into.

    Returns:
        y of x's shape and dtype (x's strides when x is dense, else contiguous).
    """
    return _run(None, x, out)


def hardswish_backward(grad_output: Tensor, x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """aclnnHardswishBackward (closed interval [-3, 3], constant 0.33333334f) for any shape and strides.

    Args:
        grad_output: same shape and dtype as x, any strides. x: the forward's input.
        out: optional contiguous result tensor to write into.

    Returns:
        A new tensor of x's shape and dtype (x's strides when x is dense, else contiguous).
    """
    return _run(grad_output, x, out)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
HARDSWISH = Impl(hardswish)
HARDSWISH_BACKWARD = Impl(hardswish_backward)
