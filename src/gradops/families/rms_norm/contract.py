"""Validation table of RmsNorm (aclnnRmsNorm) and RmsNormGrad (aclnnRmsNormGrad).

Sources: the seed (000), hicann/ops-nn ``norm/rms_norm_grad/op_host/rms_norm_grad_def.cpp`` (dtype table) and
``rms_norm_grad_tiling.cpp`` (shape rules, which surface as 561002 because CANN checks them while tiling).
The PyTorch API also takes float64 throughout (x, dy, gamma float64; rstd and dgamma float64 too, rstd float32
accepted); ``cann=True`` keeps the seed's table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...contract._common import (
    MAX_RANK,
    Result,
    accumulator,
    dtype_name,
    dtypes_text,
    fail,
    floats,
    numel,
    require_contiguous,
    require_dtype,
    require_float,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    require_shape,
    shape_text,
)
from ...status import ACLNN_ERR_INNER_TILING_ERROR as TILING
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID

#: (dy/x dtype, gamma dtype) pairs of the seed's A2/A3 table. rstd and dgamma are float32, dx has dy's dtype.
DTYPE_TABLE: frozenset[tuple[torch.dtype, torch.dtype]] = frozenset({
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
})
#: The PyTorch API's table: the seed's plus float64 x with float64 gamma (float32 gamma only beside half x).
TORCH_DTYPE_TABLE = DTYPE_TABLE | {(torch.float64, torch.float64)}


class RmsNormShape(NamedTuple):
    """The 2-D view every backend works on: ``rows`` x ``cols`` with ``cols = gamma.numel()``."""

    rows: int
    cols: int
    rstd_shape: tuple[int, ...]  # the keepdim shape the forward returns: x.shape[:k] + (1,) * gamma.dim()


def rms_norm_results(shape: RmsNormShape, x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                     ) -> list[Result]:
    """RmsNorm's results: y of x's shape and dtype (written rows x cols), rstd in the accumulator dtype (float32;
    float64 beside float64 x) of the keepdim shape ``shape.rstd_shape`` (written as rows)."""
    return [Result(x.shape, x.dtype, x, (shape.rows, shape.cols)),
            Result(shape.rstd_shape, accumulator(x.dtype), x, (shape.rows,))]


def rms_norm_grad_results(shape: RmsNormShape, dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                          gamma: torch.Tensor) -> list[Result]:
    """RmsNormGrad's results: dx of dy's shape and dtype (written rows x cols), dgamma in the accumulator dtype of
    gamma's shape (written as cols)."""
    return [Result(dy.shape, dy.dtype, dy, (shape.rows, shape.cols)),
            Result(gamma.shape, accumulator(dy.dtype), gamma, (shape.cols,))]


def _check_gamma_dtype(op: str, x: torch.Tensor, gamma: torch.Tensor) -> None:
    """After x's dtype passed its surface's check: float64 x reaches here on the PyTorch API only."""
    if (x.dtype, gamma.dtype) not in TORCH_DTYPE_TABLE:
        allowed = sorted({g for xd, g in TORCH_DTYPE_TABLE if xd == x.dtype}, key=str)
        raise fail(INVALID, op, "gamma.dtype", f"{dtypes_text(allowed)} for x of {dtype_name(x.dtype)}",
                   dtype_name(gamma.dtype))


def on_rows(m: int, n: int) -> RmsNormShape:
    """The view of the backends' own call, on 2-D x (m, n) and gamma (n,): what :func:`shape_of` answers for it,
    without reading the tensors again (0.2 µs against 1.8 per launch)."""
    return RmsNormShape(m, n, (m, 1))


def shape_of(x: torch.Tensor, gamma: torch.Tensor) -> RmsNormShape:
    """The view of a call on x and gamma (checked)."""
    k = x.dim() - gamma.dim()
    return RmsNormShape(numel(x.shape[:k]), numel(gamma.shape), tuple(x.shape[:k]) + (1,) * gamma.dim())


def _check_ranks(op: str, x: torch.Tensor, gamma: torch.Tensor, status: int) -> None:
    require_rank(op, "x", x, 1, MAX_RANK, status)
    require_rank(op, "gamma", gamma, 1, x.dim(), status)


def _check_gamma_trailing(op: str, x: torch.Tensor, gamma: torch.Tensor, status: int) -> None:
    require_shape(op, "gamma", gamma, x.shape[x.dim() - gamma.dim():], "the trailing dims of x", status)


def _check_gamma_shape(op: str, x: torch.Tensor, gamma: torch.Tensor, status: int) -> None:
    _check_ranks(op, x, gamma, status)
    _check_gamma_trailing(op, x, gamma, status)


def check_rms_norm(x, gamma, epsilon: float = 1e-6, *, y=None, rstd=None, cann: bool = False) -> RmsNormShape:
    """Validate ``rms_norm(x, gamma, epsilon)``; with ``cann=True`` also the outputs yOut/rstdOut."""
    op = "rms_norm"
    outs = {"yOut": y, "rstdOut": rstd} if cann else {}
    require_present(op, x=x, gamma=gamma, **outs)
    require_float(op, "epsilon", epsilon)
    require_same_device(op, x=x, gamma=gamma, **outs)
    require_dtype(op, "x", x, floats(cann))
    _check_gamma_dtype(op, x, gamma)
    if cann:
        require_same_dtype(op, "yOut", y, "x", x)
        require_dtype(op, "rstdOut", rstd, (torch.float32,))
    _check_gamma_shape(op, x, gamma, INVALID)
    shape = shape_of(x, gamma)
    if cann:
        require_shape(op, "yOut", y, x.shape)
        if tuple(rstd.shape) not in (shape.rstd_shape, tuple(x.shape[: x.dim() - gamma.dim()])):
            raise fail(INVALID, op, "rstdOut.shape", f"{shape_text(shape.rstd_shape)}", shape_text(rstd.shape))
    return shape


def _check_rstd_shape(op: str, x: torch.Tensor, rstd: torch.Tensor, k: int, rows: int) -> None:
    """CANN's 'broadcast' rule for rstd (rms_norm_grad_tiling.cpp CheckRstdShape)."""
    require_rank(op, "rstd", rstd, 0, MAX_RANK, TILING)
    rs, xs = tuple(rstd.shape), tuple(x.shape)
    expected = f"x.shape[:{k}] = {shape_text(xs[:k])}, a prefix of it whose skipped dims are 1, or the keepdim form"
    if rstd.dim() < k:
        ok = rs == xs[: rstd.dim()] and all(s == 1 for s in xs[rstd.dim():k])
    else:
        ok = rs[:k] == xs[:k] and numel(rs) == rows
    if not ok:
        raise fail(TILING, op, "rstd.shape", expected, shape_text(rs))


def check_rms_norm_grad(dy, x, rstd, gamma, *, dx=None, dgamma=None, cann: bool = False) -> RmsNormShape:
    """Validate ``rms_norm_grad(dy, x, rstd, gamma)`` in CANN's order: nulls, dtypes, shapes (561002).

    With ``cann=True`` (the aclnn surface) the outputs dxOut/dgammaOut are checked too, and what the seed does
    not support is refused: empty tensors (561002) and non-contiguous inputs (161002). The PyTorch API accepts
    both: empty rows give an empty dx and a zero dgamma.
    """
    op = "rms_norm_grad"
    outs = {"dxOut": dx, "dgammaOut": dgamma} if cann else {}
    require_present(op, dy=dy, x=x, rstd=rstd, gamma=gamma, **outs)
    require_same_device(op, dy=dy, x=x, rstd=rstd, gamma=gamma, **outs)
    require_dtype(op, "dy", dy, floats(cann))
    require_same_dtype(op, "x", x, "dy", dy)
    require_dtype(op, "rstd", rstd, tuple(dict.fromkeys((torch.float32, accumulator(x.dtype)))))
    _check_gamma_dtype(op, x, gamma)
    if cann:
        require_same_dtype(op, "dxOut", dx, "dy", dy)
        require_dtype(op, "dgammaOut", dgamma, (torch.float32,))
    # CANN's tiling order (rms_norm_grad_tiling.cpp): the dims, then dy against x, then gamma against x's
    # trailing dims; so dy (4, 8) beside x (4, 7) and gamma (8,) is reported as the dy/x mismatch it is first.
    _check_ranks(op, x, gamma, TILING)
    require_shape(op, "dy", dy, x.shape, "the shape of x", TILING)
    _check_gamma_trailing(op, x, gamma, TILING)
    shape = shape_of(x, gamma)
    _check_rstd_shape(op, x, rstd, x.dim() - gamma.dim(), shape.rows)
    if cann:
        require_shape(op, "dxOut", dx, dy.shape, "the shape of dy", TILING)
        require_shape(op, "dgammaOut", dgamma, gamma.shape, "the shape of gamma", TILING)
        if dy.numel() == 0:
            raise fail(TILING, op, "dy", "a non-empty tensor (empty tensors are not supported)", shape_text(dy.shape))
        require_contiguous(op, dy=dy, x=x, rstd=rstd, gamma=gamma)
    return shape
