"""SwiGlu / SwiGluGrad: torch.library ops, autograd, and the public functions."""

from __future__ import annotations

from torch import Tensor

from ... import native
from ...ops._direct import DirectOp, fit, own
from ...ops._double import compute_dtype, partial_vjp, save_inputs
from ...ops._out import into
from ...ops._plan import Planner
from . import contract, reference, spec
from .contract import SwiGluShape


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


# What each op's backends take (its results are declared in the contract, beside the check).
def _views(shape: SwiGluShape, x: Tensor, dim: int) -> tuple[Tensor, int]:
    return fit(x, (shape.rows, 2 * shape.cols)), -1


def _grad_views(shape: SwiGluShape, y_grad: Tensor, x: Tensor, dim: int) -> tuple[Tensor, Tensor, int]:
    return fit(y_grad, (shape.rows, shape.cols)), fit(x, (shape.rows, 2 * shape.cols)), -1


# The results are contiguous, as the fake kernel declares them: the reference on a non-contiguous view would
# return its layout.
def _swiglu_2d(fn, shape: SwiGluShape, x: Tensor, dim: int) -> Tensor:
    return own(fit(fn(*_views(shape, x, dim)).contiguous(), shape.out_shape))


def _swiglu_grad_2d(fn, shape: SwiGluShape, y_grad: Tensor, x: Tensor, dim: int) -> Tensor:
    return own(fit(fn(*_grad_views(shape, y_grad, x, dim)).contiguous(), x.shape))


def _native_entry(choice, shape: SwiGluShape, x: Tensor, dim: int):
    """The native SwiGLU node, or None (an empty x; see :mod:`gradops.native`): it runs the extension's registered
    ``swiglu`` / ``swiglu_grad`` kernels (swiglu.cpp)."""
    if not shape.rows or not shape.cols:
        return None
    return native.node(lambda ext: (ext.SWIGLU, ext.swiglu), _differentiable_backward)


plan_swiglu = Planner(spec.SWIGLU, adapter=_swiglu_2d, native=_native_entry,
                      program=lambda: _cpu().program_swiglu)
plan_swiglu_grad = Planner(spec.SWIGLU_GRAD, device_arg=1, adapter=_swiglu_grad_2d,
                           program=lambda: _cpu().program_swiglu_grad)


def _swiglu_grad_body(y_grad: Tensor, x: Tensor, dim: int) -> Tensor:
    plan = plan_swiglu_grad(y_grad, x, dim)
    return plan.run(plan.shape, y_grad, x, dim)


_swiglu_grad = DirectOp(spec.SWIGLU_GRAD, _swiglu_grad_body, plan_swiglu_grad)


def _swiglu_grad_formula(y_grad: Tensor, x: Tensor, dim: int) -> tuple[Tensor]:
    """The reference SwiGluGrad on the op's own shapes (differentiable: views and the reference's torch ops)."""
    shape = contract.check_swiglu_grad(y_grad, x, dim)
    dx = reference.swiglu_grad(y_grad.reshape(shape.rows, shape.cols), x.reshape(shape.rows, 2 * shape.cols), -1,
                               compute_dtype(y_grad, x))
    return (dx.reshape(x.shape),)


def _swiglu_grad_backward(ctx, ddx):
    """The derivative of SwiGluGrad with respect to y_grad and x (see :mod:`gradops.ops._double`)."""
    y_grad, x = ctx.saved_tensors
    return (*partial_vjp(lambda g, v: _swiglu_grad_formula(g, v, ctx.dim), (y_grad, x), (ddx,)), None)


def _save_grad_inputs(ctx, inputs, output):
    save_inputs(ctx, inputs, output)
    ctx.dim = inputs[2]


_swiglu_grad.register_autograd(_swiglu_grad_backward, setup_context=_save_grad_inputs)


def _swiglu_body(x: Tensor, dim: int) -> Tensor:
    plan = plan_swiglu(x, dim)
    return plan.run(plan.shape, x, dim)


_swiglu = DirectOp(spec.SWIGLU, _swiglu_body, plan_swiglu, node=lambda ext: ext.swiglu_planned)


def _setup(ctx, inputs, output):
    x, dim = inputs
    ctx.save_for_backward(x)
    ctx.dim = dim


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return _swiglu_grad(grad.contiguous(), x, ctx.dim), None


_swiglu.register_autograd(_backward, setup_context=_setup)


def _differentiable_backward(inputs: list[Tensor], extra: object) -> tuple[Tensor]:
    """The native node's backward where it does not run its kernel itself (``create_graph=True``, a forked child, a
    gradient that is not plain: see gradops/native/nodes.h): the op, which records a second derivative and
    dispatches batched or lazily negated gradients. ``extra``: the split dim."""
    grad, x = inputs
    return (_swiglu_grad(grad.contiguous(), x, extra),)


_swiglu.native = _swiglu.recorded


def swiglu(x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """SwiGlu (aclnnSwiGlu; torch_npu ``npu_swiglu``): x split into halves ``A, B`` along ``dim``, ``y = silu(A) * B``
    with ``silu(a) = a * sigmoid(a)``; differentiable through :func:`swiglu_grad`.

    Args:
        x: 1 to 8 dims, float16 / bfloat16 / float32 (or float64, beyond CANN: computed in float64), an even size
            along ``dim``; any strides (a non-contiguous x is read through one copy).
        dim: the dim to split, in ``[-x.dim(), x.dim() - 1]`` (default: the last).
        out: optional preallocated y to write into (see :mod:`gradops.ops._out`; not differentiable).

    Returns:
        y of x's shape with ``dim`` halved, in x's dtype (float32 math).

    Raises:
        OpError: 161001 for a missing x, 161002 for a dtype, a dim out of range or an odd size along it.
    """
    if out is not None:
        if _swiglu.direct_into(out, x, dim):
            return out
        return into(spec.SWIGLU, plan_swiglu, ("x",), (x, dim), out, (0,), views=_views, via=_swiglu)[0]
    return _swiglu(x, dim)


def swiglu_grad(y_grad: Tensor, x: Tensor, dim: int = -1, *, out: Tensor | None = None) -> Tensor:
    """SwiGluGrad (aclnnSwiGluGrad): the gradient of :func:`swiglu` with respect to x, ``[dA, dB]`` along ``dim``
    with ``dA = g * B * s * (1 + A * (1 - s))`` and ``dB = g * A * s``, ``s = sigmoid(A)``: the derivative of
    ``silu(A) * B`` (CANN's document prints ``s + s * (1 - s * A)`` for dA's factor, a misplaced parenthesis;
    docs/semantics.md §7).

    Args:
        y_grad: the gradient of y: x's shape with ``dim`` halved, x's dtype.
        x: the forward's input (see :func:`swiglu`).
        dim: the forward's split dim.
        out: optional preallocated result (x's shape and dtype) to write into.

    Returns:
        dx of x's shape and dtype. Differentiable (double backward of :func:`swiglu`) with respect to y_grad and x.
    """
    if out is not None:
        if _swiglu_grad.direct_into(out, y_grad, x, dim):
            return out
        return into(spec.SWIGLU_GRAD, plan_swiglu_grad, ("y_grad", "x"), (y_grad, x, dim), out,
                    views=_grad_views, via=_swiglu_grad)[0]
    return _swiglu_grad(y_grad, x, dim)
