"""Host launchers of SwiGlu and SwiGluGrad (backend ``triton``) on the 2-D views: rows with unit column stride are
read in place (a row stride is passed to the kernel), anything else is copied once."""

from __future__ import annotations

import triton
from torch import Tensor

from ...contract._common import written
from ...launch._common import launch, outputs
from ...spec import Impl
from .contract import on_view, swiglu_grad_results, swiglu_results
from .kernels import BLOCK, WARPS, swiglu_grad_kernel, swiglu_kernel


def _rows(t: Tensor) -> Tensor:
    """``t`` (2-D) with unit column stride, copied where it has another."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def swiglu(x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """``y[rows, cols] = silu(x[:, :cols]) * x[:, cols:]`` of the 2-D view ``x[rows, 2·cols]``."""
    shape = on_view(x, dim)
    cols = shape.cols
    y = outputs(out, written(swiglu_results(shape, x, dim)), x.device)[0]
    x = _rows(x)
    n = shape.rows * cols
    if n:
        launch(swiglu_kernel, (triton.cdiv(n, BLOCK),), x, y, cols, n, x.stride(0), BLOCK=BLOCK, num_warps=WARPS)
    return y


def swiglu_grad(y_grad: Tensor, x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """aclnnSwiGluGrad on the 2-D views: ``dx[rows, 2·cols]`` (dA then dB in each row)."""
    shape = on_view(x, dim)
    cols = shape.cols
    dx = outputs(out, written(swiglu_grad_results(shape, y_grad, x, dim)), x.device)[0]
    y_grad, x = _rows(y_grad), _rows(x)
    n = shape.rows * cols
    if n:
        launch(swiglu_grad_kernel, (triton.cdiv(n, BLOCK),), y_grad, x, dx, cols, n, y_grad.stride(0), x.stride(0),
               BLOCK=BLOCK, num_warps=WARPS)
    return dx


# ---------------------------------------------------------------- what the family's declarations provide
SWIGLU = Impl(swiglu)
SWIGLU_GRAD = Impl(swiglu_grad)
