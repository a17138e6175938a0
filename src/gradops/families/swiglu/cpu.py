"""SwiGlu and SwiGluGrad on the CPU: the host entries of the native kernels ``swiglu`` and ``swiglu_grad``
(swiglu.cpp: row-parallel, float32 math, 8-lane vectors).

Byte models (what ``gradops bench`` divides by): forward ``3·rows·cols·s``, backward ``5·rows·cols·s``. A
non-contiguous x or y_grad is copied once (:func:`gradops.cpu._host.dense`).
"""

from __future__ import annotations

from torch import Tensor

from ...cpu import _pool
from ...cpu._host import dense, finish, kernel, output
from ...cpu.programs import Program, arg
from ...spec import Impl
from .contract import SwiGluShape, on_view


def swiglu(x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """``y[rows, cols]`` of the 2-D view ``x[rows, 2·cols]``; ``out``: a preallocated y."""
    on_view(x, dim)
    rows, cols = x.shape[0], x.shape[1] // 2
    y = output(out, (rows, cols), x.dtype)
    kernel("swiglu", (dense(x),), (y,), (rows, cols))
    return finish(y, out)


def swiglu_shaped(shape: SwiGluShape, x: Tensor, dim: int) -> Tensor:
    """The op on x of any shape (``shape``: its view, see :mod:`gradops.ops._plan`): y of ``shape.out_shape``."""
    y = _pool.empty(shape.out_shape, x.dtype)
    kernel("swiglu", (dense(x),), (y,), (shape.rows, shape.cols))
    return y


def swiglu_grad(y_grad: Tensor, x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """aclnnSwiGluGrad on the 2-D views: ``dx[rows, 2·cols]`` from ``y_grad[rows, cols]`` and ``x[rows, 2·cols]``."""
    on_view(x, dim)
    rows, cols = y_grad.shape
    dx = output(out, tuple(x.shape), x.dtype)
    kernel("swiglu_grad", (dense(y_grad), dense(x)), (dx,), (rows, cols))
    return finish(dx, out)


def swiglu_grad_shaped(shape: SwiGluShape, y_grad: Tensor, x: Tensor, dim: int) -> Tensor:
    """The op on its own shapes: dx of x's shape."""
    dx = _pool.empty(x.shape, x.dtype)
    kernel("swiglu_grad", (dense(y_grad), dense(x)), (dx,), (shape.rows, shape.cols))
    return dx


# ---------------------------------------------------------------- the direct calls' programs
# The Python path above as the extension replays it (see gradops.cpu.programs): the same kernel on outputs of
# the same shapes; None where the Python path does what a program does not (an empty call).
def program_swiglu(shape: SwiGluShape, x: Tensor, dim: int) -> Program | None:
    if not shape.rows or not shape.cols:
        return None
    p = Program()
    y = p.output(shape.out_shape, x.dtype)
    p.kernel("swiglu", [arg(0)], [y], [shape.rows, shape.cols])
    return p.returns(y)


def program_swiglu_grad(shape: SwiGluShape, y_grad: Tensor, x: Tensor, dim: int) -> Program | None:
    if not shape.rows or not shape.cols:
        return None
    p = Program()
    dx = p.output(x.shape, x.dtype)
    p.kernel("swiglu_grad", [arg(0), arg(1)], [dx], [shape.rows, shape.cols])
    return p.returns(dx)


# ---------------------------------------------------------------- what the family's declarations provide
SWIGLU = Impl(swiglu, shaped=swiglu_shaped)
SWIGLU_GRAD = Impl(swiglu_grad, shaped=swiglu_grad_shaped)
