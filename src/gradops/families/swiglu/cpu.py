"""SwiGlu and SwiGluGrad on the CPU: the host entries of the native kernels ``swiglu`` and ``swiglu_grad``
(swiglu.cpp: row-parallel, float32 math, 8-lane vectors).

Byte models (what ``gradops bench`` divides by): forward ``3·rows·cols·s``, backward ``5·rows·cols·s``. A
non-contiguous x or y_grad is copied once (:func:`gradops.cpu._host.dense`).
"""

from __future__ import annotations

from torch import Tensor

from ...contract._common import Outputs, written
from ...cpu._host import allocate, dense, finish, kernel, output
from ...cpu.programs import Program, arg
from ...spec import Impl
from .contract import SwiGluShape, on_view, swiglu_grad_results, swiglu_results


def swiglu(x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """``y[rows, cols]`` of the 2-D view ``x[rows, 2·cols]``; ``out``: a preallocated y."""
    shape = on_view(x, dim)
    (y_spec,) = written(swiglu_results(shape, x, dim))
    y = output(out, *y_spec)
    kernel("swiglu", (dense(x),), (y,), (shape.rows, shape.cols))
    return finish(y, out)


def swiglu_shaped(outputs: Outputs, shape: SwiGluShape, x: Tensor, dim: int) -> Tensor:
    """The op on x of any shape (``shape``: its view, see :mod:`gradops.ops._plan`): y of ``shape.out_shape``."""
    (y,) = allocate(outputs, (x, dim))
    kernel("swiglu", (dense(x),), (y,), (shape.rows, shape.cols))
    return y


def swiglu_grad(y_grad: Tensor, x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """aclnnSwiGluGrad on the 2-D views: ``dx[rows, 2·cols]`` from ``y_grad[rows, cols]`` and ``x[rows, 2·cols]``."""
    shape = on_view(x, dim)
    (dx_spec,) = written(swiglu_grad_results(shape, y_grad, x, dim))
    dx = output(out, *dx_spec)
    kernel("swiglu_grad", (dense(y_grad), dense(x)), (dx,), (shape.rows, shape.cols))
    return finish(dx, out)


def swiglu_grad_shaped(outputs: Outputs, shape: SwiGluShape, y_grad: Tensor, x: Tensor, dim: int) -> Tensor:
    """The op on its own shapes: dx of x's shape."""
    (dx,) = allocate(outputs, (y_grad, x, dim))
    kernel("swiglu_grad", (dense(y_grad), dense(x)), (dx,), (shape.rows, shape.cols))
    return dx


# ---------------------------------------------------------------- the direct calls' programs
# The Python path above as the extension replays it (see gradops.cpu.programs): the same kernel on outputs of
# the same shapes; None where the Python path does what a program does not (an empty call).
def program_swiglu(shape: SwiGluShape, x: Tensor, dim: int) -> Program | None:
    if not shape.rows or not shape.cols:
        return None
    p = Program()
    (y,) = p.declared(swiglu_results(shape, x, dim))
    p.kernel("swiglu", [arg(0)], [y], [shape.rows, shape.cols])
    return p.returns(y)


def program_swiglu_grad(shape: SwiGluShape, y_grad: Tensor, x: Tensor, dim: int) -> Program | None:
    if not shape.rows or not shape.cols:
        return None
    p = Program()
    (dx,) = p.declared(swiglu_grad_results(shape, y_grad, x, dim))
    p.kernel("swiglu_grad", [arg(0), arg(1)], [dx], [shape.rows, shape.cols])
    return p.returns(dx)


# ---------------------------------------------------------------- what the family's declarations provide
SWIGLU = Impl(swiglu, shaped=swiglu_shaped)
SWIGLU_GRAD = Impl(swiglu_grad, shaped=swiglu_grad_shaped)
