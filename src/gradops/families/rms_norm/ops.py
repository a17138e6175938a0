"""RmsNorm / RmsNormGrad: torch.library ops, autograd, and the public functions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...ops._direct import DirectOp, fit, own
from ...ops._double import compute_dtype, partial_vjp, save_inputs
from ...ops._out import into
from ...ops._plan import Planner
from . import reference, spec


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


# What each op's backends take (its results are declared in the contract, beside the check). Every call pays one
# key and one lookup for its validation and backend (ops/_plan.py).
def _grad_views(shape, dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor) -> tuple[Tensor, ...]:
    rows, cols, _ = shape
    return fit(dy, (rows, cols)), fit(x, (rows, cols)), fit(rstd, (rows,)), fit(gamma, (cols,))


def _views(shape, x: Tensor, gamma: Tensor, epsilon: float) -> tuple:
    rows, cols, _ = shape
    return fit(x, (rows, cols)), fit(gamma, (cols,)), epsilon


def _rms_norm_grad_2d(fn, shape, dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    dx, dgamma = fn(*_grad_views(shape, dy, x, rstd, gamma))
    return own(fit(dx, x.shape), fit(dgamma, gamma.shape))


plan_rms_norm_grad = Planner(spec.RMS_NORM_GRAD, adapter=_rms_norm_grad_2d,
                             program=lambda: _cpu().program_rms_norm_grad)


def _rms_norm_grad_body(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    plan = plan_rms_norm_grad(dy, x, rstd, gamma)
    return plan.run(plan.shape, dy, x, rstd, gamma)


_rms_norm_grad = DirectOp(spec.RMS_NORM_GRAD, _rms_norm_grad_body, plan_rms_norm_grad)


def _rms_norm_grad_formula(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor) -> tuple[Tensor, Tensor]:
    """The reference RmsNormGrad on the op's own shapes (differentiable: views and the reference's torch ops)."""
    cols = gamma.numel()
    rows = math.prod(x.shape[:x.dim() - gamma.dim()])
    dx, dgamma = reference.rms_norm_grad(dy.reshape(rows, cols), x.reshape(rows, cols), rstd.reshape(rows),
                                         gamma.reshape(cols), compute_dtype(dy, x, rstd, gamma))
    return dx.reshape(x.shape), dgamma.reshape(gamma.shape)


def _rms_norm_grad_backward(ctx, ddx, ddgamma):
    """The derivative of RmsNormGrad with respect to dy, x, rstd (as given: an independent input) and gamma
    (see :mod:`gradops.ops._double`)."""
    return partial_vjp(_rms_norm_grad_formula, ctx.saved_tensors, (ddx, ddgamma))


_rms_norm_grad.register_autograd(_rms_norm_grad_backward, setup_context=save_inputs)


def _rms_norm_2d(fn, shape, x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    y, rstd = fn(*_views(shape, x, gamma, epsilon))
    return own(fit(y, x.shape), fit(rstd, shape.rstd_shape))


plan_rms_norm = Planner(spec.RMS_NORM, adapter=_rms_norm_2d,
                        program=lambda: _cpu().program_rms_norm)


def _rms_norm_body(x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    plan = plan_rms_norm(x, gamma, epsilon)
    return plan.run(plan.shape, x, gamma, epsilon)


_rms_norm = DirectOp(spec.RMS_NORM, _rms_norm_body, plan_rms_norm)


def _setup(ctx, inputs, output):
    x, gamma, _ = inputs
    ctx.save_for_backward(x, gamma, output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, drstd):
    x, gamma, rstd = ctx.saved_tensors
    if dy is None and drstd is None:
        return None, None, None
    dx, dgamma = _rms_norm_grad(dy if dy is not None else torch.zeros_like(x), x, rstd, gamma)
    if drstd is not None:  # rstd used downstream: d rstd / dx = -rstd^3 * x / D
        d = gamma.numel()
        acc = rstd.dtype  # float32, float64 beside float64 x
        dx = (dx.to(acc) - drstd * rstd ** 3 * x.to(acc) / d).to(x.dtype)
    return dx, dgamma.to(gamma.dtype), None


_rms_norm.register_autograd(_backward, setup_context=_setup)


def rms_norm(x: Tensor, gamma: Tensor, epsilon: float = 1e-6, *, out: tuple[Tensor, Tensor] | None = None
             ) -> tuple[Tensor, Tensor]:
    """RmsNorm forward (aclnnRmsNorm), differentiable through :func:`rms_norm_grad`.

    Args:
        x: input of 1 to 8 dims, float16 / bfloat16 / float32, or float64 (beyond CANN: computed in float64).
        gamma: scale, shape ``x.shape[-gamma.dim():]``; dtype of x, or float32 with half x.
        epsilon: added to ``mean(x^2)`` under the square root.
        out: optional preallocated ``(y, rstd)`` to write into (see :mod:`gradops.ops._out`; not differentiable).

    Returns:
        ``(y, rstd)``: y in x's dtype; ``rstd = 1/sqrt(mean(x^2) + epsilon)`` in float32 (float64 for float64 x)
        of shape ``x.shape[:-gamma.dim()] + (1,) * gamma.dim()``.
    """
    if out is not None:
        if _rms_norm.direct_into(out, x, gamma, epsilon):  # the common out= call (see DirectOp.direct_into)
            return tuple(out)
        return into(spec.RMS_NORM, plan_rms_norm, ("x", "gamma"), (x, gamma, epsilon), out, (0, 1),
                    views=_views, via=_rms_norm)
    return _rms_norm(x, gamma, epsilon)


def rms_norm_grad(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor, *, out: tuple[Tensor, Tensor] | None = None
                  ) -> tuple[Tensor, Tensor]:
    """RmsNorm backward (aclnnRmsNormGrad): one fused pass for dx and dgamma.

    Args:
        dy: gradient of y, shape and dtype of x.
        x: the forward's input, 1 to 8 dims.
        rstd: float32 (or float64 beside float64 x), ``x.shape[:k]`` with ``k = x.dim() - gamma.dim()``, its
            keepdim form, or a shorter prefix when the skipped dims of x are 1. Used as given (eps is already
            inside it).
        gamma: the forward's scale, shape ``x.shape[k:]``; dtype of x or float32 (with half x).
        out: optional preallocated ``(dx, dgamma)`` to write into (see :mod:`gradops.ops._out`).

    Returns:
        ``(dx, dgamma)``: dx in dy's dtype; dgamma float32 (float64 for float64 dy) in gamma's shape.
        Differentiable (double backward of :func:`rms_norm`) with respect to dy, x, gamma and rstd, which is an
        independent input here: its gradient is not folded into x's (through :func:`rms_norm` it reaches x as
        the forward's ``drstd``).

    Raises:
        OpError: 161001 for a missing tensor, 161002 for a dtype outside the seed's table (plus float64 throughout,
            the PyTorch API's superset; :mod:`gradops.aclnn` keeps the seed's), 561002 for a shape
            rule (CANN checks shapes while tiling).
    """
    if out is not None:
        if _rms_norm_grad.direct_into(out, dy, x, rstd, gamma):
            return tuple(out)
        return into(spec.RMS_NORM_GRAD, plan_rms_norm_grad, ("dy", "x", "rstd", "gamma"),
                    (dy, x, rstd, gamma), out, views=_grad_views, via=_rms_norm_grad)
    return _rms_norm_grad(dy, x, rstd, gamma)
