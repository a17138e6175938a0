"""Validation table of SwiGlu (aclnnSwiGlu) and SwiGluGrad (aclnnSwiGluGrad).

Source: the CANN operator documents of aclnnSwiGlu / aclnnSwiGluGrad (hicann/ops-nn ``activation/swi_glu`` and
``swi_glu_grad``): x of 1 to 8 dims, float16 / bfloat16 / float32, split into two halves along ``dim`` in
``[-x.dim(), x.dim() - 1]`` whose size must be even; yGrad has x's shape with that dim halved and x's dtype; out is
y (the forward) or x's shape (the gradient), x's dtype. CANN supports neither empty nor non-contiguous tensors;
the PyTorch API takes both (an empty x gives an empty result) and float64 (computed in float64). Every refusal is
161002 (ACLNN_ERR_PARAM_INVALID), 161001 for a missing tensor.
"""

from __future__ import annotations

from typing import NamedTuple

from ...contract._common import (
    MAX_RANK,
    Result,
    fail,
    floats,
    numel,
    require_contiguous,
    require_dtype,
    require_int,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    require_shape,
    shape_text,
)
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID


class SwiGluShape(NamedTuple):
    """The 2-D view every backend works on: x as ``rows`` x ``2·cols`` (rows: the dims before ``dim``; a row is
    the split dim and the dims after it, A its first ``cols`` items, B the rest), y as ``rows`` x ``cols``."""

    rows: int
    cols: int
    dim: int  # the split dim, in [0, x.dim())
    out_shape: tuple[int, ...]  # y's shape: x's with dim halved


def swiglu_results(shape: SwiGluShape, x, dim: int = -1) -> list[Result]:
    """SwiGlu's result: y of x's shape with dim halved, x's dtype (written rows x cols)."""
    return [Result(shape.out_shape, x.dtype, x, (shape.rows, shape.cols))]


def swiglu_grad_results(shape: SwiGluShape, y_grad, x, dim: int = -1) -> list[Result]:
    """SwiGluGrad's result: dx of x's shape and dtype (written rows x 2·cols)."""
    return [Result(x.shape, x.dtype, x, (shape.rows, 2 * shape.cols))]


def _split(op: str, x, dim) -> SwiGluShape:
    require_rank(op, "x", x, 1, MAX_RANK)
    d = require_int(op, "dim", dim, -x.dim(), x.dim() - 1)
    d = d + x.dim() if d < 0 else d
    size = x.shape[d]
    if size % 2:
        raise fail(INVALID, op, "x.shape[dim]", f"an even size (x is split in two halves along dim {dim})",
                   f"{size} (shape {shape_text(x.shape)})")
    out_shape = (*x.shape[:d], size // 2, *x.shape[d + 1:])
    return SwiGluShape(numel(x.shape[:d]), size // 2 * numel(x.shape[d + 1:]), d, out_shape)


def _cann_inputs(op: str, **tensors) -> None:
    """What CANN does not support and the PyTorch API does: empty and non-contiguous tensors."""
    for name, t in tensors.items():
        if t.numel() == 0:
            raise fail(INVALID, op, name, "a non-empty tensor (empty tensors are not supported)", shape_text(t.shape))
    require_contiguous(op, **tensors)


def check_swiglu(x, dim: int = -1, *, out=None, cann: bool = False) -> SwiGluShape:
    """Validate ``swiglu(x, dim)``; with ``cann=True`` also the output ``out``."""
    op = "swiglu"
    outs = {"out": out} if cann else {}
    require_present(op, x=x, **outs)
    require_same_device(op, x=x, **outs)
    require_dtype(op, "x", x, floats(cann))
    if cann:
        require_same_dtype(op, "out", out, "x", x)
    shape = _split(op, x, dim)
    if cann:
        require_shape(op, "out", out, shape.out_shape, "x's shape with dim halved")
        _cann_inputs(op, x=x)
    return shape


def check_swiglu_grad(y_grad, x, dim: int = -1, *, out=None, cann: bool = False) -> SwiGluShape:
    """Validate ``swiglu_grad(y_grad, x, dim)``; with ``cann=True`` also the output ``out``."""
    op = "swiglu_grad"
    outs = {"out": out} if cann else {}
    require_present(op, y_grad=y_grad, x=x, **outs)
    require_same_device(op, y_grad=y_grad, x=x, **outs)
    require_dtype(op, "x", x, floats(cann))
    require_same_dtype(op, "y_grad", y_grad, "x", x)
    if cann:
        require_same_dtype(op, "out", out, "x", x)
    shape = _split(op, x, dim)
    require_shape(op, "y_grad", y_grad, shape.out_shape, "x's shape with dim halved")
    if cann:
        require_shape(op, "out", out, x.shape, "the shape of x")
        _cann_inputs(op, y_grad=y_grad, x=x)
    return shape


def on_view(x, dim: int) -> SwiGluShape:
    """What the backends' functions take: the 2-D view the call plan makes (:class:`SwiGluShape`), split along its
    last dim (ValueError for anything else: a caller of the backends, not of the op, got it wrong); its shape."""
    if x.dim() != 2 or dim not in (-1, 1):
        raise ValueError(f"the swiglu backends take x as a 2-D view split along its last dim, got {x.dim()}-D x "
                         f"and dim {dim}")
    rows, cols = x.shape[0], x.shape[1] // 2
    return SwiGluShape(rows, cols, 1, (rows, cols))
