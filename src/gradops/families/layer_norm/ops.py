"""LayerNorm / LayerNormGrad / LayerNormGradBeta / fused backward: torch.library ops, autograd, public functions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ... import native
from ...ops._direct import BODY, DirectOp, _records, eager_path, fit, own
from ...ops._double import compute_dtype, partial_vjp, save_inputs
from ...ops._out import into
from ...ops._plan import Planner
from . import reference, spec
from .contract import checked_statistic


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


# What each op's backends take (2-D views); its results are declared in the contract, beside the check.
def _views(shape, x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float) -> tuple:
    return fit(x, (shape.rows, shape.cols)), gamma, beta, epsilon


def _grad_views(shape, dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float) -> tuple:
    rows, cols = shape
    return fit(dy, (rows, cols)), fit(x, (rows, cols)), fit(variance, (rows,)), fit(mean, (rows,)), gamma, epsilon


def _beta_views(shape, res_for_gamma: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    return fit(res_for_gamma, (shape.rows, shape.cols)), fit(dy, (shape.rows, shape.cols))


def _backward_views(shape, dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor) -> tuple[Tensor, ...]:
    rows, cols = shape
    return fit(dy, (rows, cols)), fit(x, (rows, cols)), fit(mean, (rows,)), fit(rstd, (rows,)), gamma


def _layer_norm_2d(fn, shape, x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    y, mean, var = fn(*_views(shape, x, gamma, beta, epsilon))
    stat = x.shape[:-1]
    return own(fit(y, x.shape), fit(mean, stat), fit(var, stat))


def _native_entry(choice, shape, x: Tensor, gamma: Tensor, beta: Tensor, *epsilon: float):
    """The native LayerNorm node, or None (an empty x; see :mod:`gradops.native`): it runs the extension's
    registered layer_norm kernels (layer_norm.cpp)."""
    if not shape.rows or not shape.cols:
        return None
    return native.node(lambda ext: (ext.LAYER_NORM, ext.layer_norm), _differentiable_backward)


plan_layer_norm = Planner(spec.LAYER_NORM, adapter=_layer_norm_2d, native=_native_entry,
                          program=lambda: _cpu().program_layer_norm)


def _layer_norm_body(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float) -> tuple[Tensor, Tensor, Tensor]:
    plan = plan_layer_norm(x, gamma, beta, epsilon)
    return plan.run(plan.shape, x, gamma, beta, epsilon)


# node: the module's call (layer_norm_output) takes the native node, which returns y alone
_layer_norm = DirectOp(spec.LAYER_NORM, _layer_norm_body, plan_layer_norm,
                       node=lambda ext: ext.layer_norm_planned)


def _layer_norm_grad_2d(fn, shape, dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor,
                        epsilon: float) -> tuple[Tensor, Tensor]:
    pdx, res = fn(*_grad_views(shape, dy, x, variance, mean, gamma, epsilon))
    # After the kernels (statistics are values, never addresses): on CUDA the flag is then raised by a later call.
    checked_statistic("layer_norm_grad", "variance", variance, float(epsilon))
    return own(fit(pdx, x.shape), fit(res, x.shape))


plan_layer_norm_grad = Planner(spec.LAYER_NORM_GRAD, adapter=_layer_norm_grad_2d,
                               program=lambda: _cpu().program_layer_norm_grad)


def _layer_norm_grad_body(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor,
                          epsilon: float) -> tuple[Tensor, Tensor]:
    plan = plan_layer_norm_grad(dy, x, variance, mean, gamma, epsilon)  # the variance: checked by the run
    return plan.run(plan.shape, dy, x, variance, mean, gamma, epsilon)


_layer_norm_grad = DirectOp(spec.LAYER_NORM_GRAD, _layer_norm_grad_body, plan_layer_norm_grad)


def _layer_norm_grad_beta_2d(fn, shape, res_for_gamma: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    return own(*fn(*_beta_views(shape, res_for_gamma, dy)))


plan_layer_norm_grad_beta = Planner(spec.LAYER_NORM_GRAD_BETA, device_arg=1,
                                    adapter=_layer_norm_grad_beta_2d,
                                    program=lambda: _cpu().program_layer_norm_grad_beta)


def _layer_norm_grad_beta_body(res_for_gamma: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    plan = plan_layer_norm_grad_beta(res_for_gamma, dy)
    return plan.run(plan.shape, res_for_gamma, dy)


_layer_norm_grad_beta = DirectOp(spec.LAYER_NORM_GRAD_BETA, _layer_norm_grad_beta_body, plan_layer_norm_grad_beta)


def _layer_norm_backward_2d(fn, shape, dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                            check_statistics: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    dx, dgamma, dbeta = fn(*_backward_views(shape, dy, x, mean, rstd, gamma))
    if check_statistics:  # after the kernels, as in _layer_norm_grad_2d
        checked_statistic("layer_norm_backward", "rstd", rstd, 0.0)
    return own(fit(dx, x.shape), dgamma, dbeta)


plan_layer_norm_backward = Planner(spec.LAYER_NORM_BACKWARD, adapter=_layer_norm_backward_2d,
                                   program=lambda: _cpu().program_layer_norm_backward)


def _layer_norm_backward_body(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                              gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    plan = plan_layer_norm_backward(dy, x, mean, rstd, gamma)  # rstd: checked by the run
    return plan.run(plan.shape, dy, x, mean, rstd, gamma)


_layer_norm_backward = DirectOp(spec.LAYER_NORM_BACKWARD, _layer_norm_backward_body, plan_layer_norm_backward)


def _layer_norm_backward_formula(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                                 gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The reference aclnnLayerNormBackward on the op's own shapes (differentiable)."""
    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    dx, dgamma, dbeta = reference.layer_norm_backward(dy.reshape(rows, cols), x.reshape(rows, cols),
                                                      mean.reshape(rows), rstd.reshape(rows), gamma,
                                                      compute_dtype(dy, x, mean, rstd, gamma))
    return dx.reshape(x.shape), dgamma, dbeta


def _layer_norm_backward_backward(ctx, ddx, ddgamma, ddbeta):
    """The derivative of aclnnLayerNormBackward with respect to dy, x, mean, rstd (both as given: independent
    inputs) and gamma (see :mod:`gradops.ops._double`)."""
    return partial_vjp(_layer_norm_backward_formula, ctx.saved_tensors, (ddx, ddgamma, ddbeta))


_layer_norm_backward.register_autograd(_layer_norm_backward_backward, setup_context=save_inputs)


def _setup(ctx, inputs, output):
    x, gamma, beta, epsilon = inputs
    _, mean, var = output
    ctx.save_for_backward(x, gamma, mean, var)
    ctx.epsilon = epsilon
    ctx.beta_dtype = beta.dtype
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dmean, dvar):
    x, gamma, mean, var = ctx.saved_tensors
    return _vjp(x, gamma, mean, var, ctx.epsilon, ctx.beta_dtype, dy, dmean, dvar)


def _vjp(x: Tensor, gamma: Tensor, mean: Tensor, var: Tensor, epsilon: float, beta_dtype: torch.dtype,
         dy: Tensor | None, dmean: Tensor | None, dvar: Tensor | None) -> tuple[Tensor | None, ...]:
    """The gradients of :func:`layer_norm` for x, gamma, beta and epsilon, from its saved tensors."""
    if dy is None and dmean is None and dvar is None:
        return None, None, None, None
    rstd = torch.rsqrt(var + epsilon)
    args = (dy if dy is not None else torch.zeros_like(x), x, mean, rstd, gamma)
    # rstd = (var + eps)^-0.5 from this op's own forward is never negative: no data check (on CUDA, no flag to
    # carry) when the call runs eagerly; through the op (tracing, modes) the op checks as any direct call does.
    if eager_path(*args) == BODY:
        plan = plan_layer_norm_backward(*args)
        dx, dgamma, dbeta = plan.run(plan.shape, *args, check_statistics=False)
    else:
        dx, dgamma, dbeta = _layer_norm_backward(*args)
    if dmean is not None or dvar is not None:  # statistics used downstream: dmean/dx = 1/H, dvar/dx = 2(x-mean)/H
        h = x.shape[-1]
        acc = var.dtype  # float32, float64 beside float64 x
        extra = x.new_zeros(x.shape, dtype=acc)
        if dmean is not None:
            extra = extra + dmean.unsqueeze(-1) / h
        if dvar is not None:
            extra = extra + dvar.unsqueeze(-1) * 2.0 * (x.to(acc) - mean.unsqueeze(-1)) / h
        dx = (dx.to(acc) + extra).to(x.dtype)
    return dx, dgamma.to(gamma.dtype), dbeta.to(beta_dtype), None


_layer_norm.register_autograd(_backward, setup_context=_setup)


def _differentiable_backward(inputs: list[Tensor], epsilon: float) -> tuple[Tensor | None, ...]:
    """The native node's backward where it does not run its kernel itself (see layer_norm.cpp), :func:`_vjp` as the
    Python path runs it. Under ``create_graph=True`` it is recorded for a second derivative: there the Python
    path's statistics are outputs of the recorded forward, so the second derivative flows through their dependence
    on x; the node keeps them as plain tensors, so they are computed again by the recorded forward (the same
    kernel: the same bits as the saved ones; beta does not enter them). ``beta_like``: an empty tensor of beta's
    dtype."""
    dy, x, gamma, mean, var, beta_like = inputs
    if torch.is_grad_enabled():
        _, mean, var = layer_norm(x, gamma, gamma.new_zeros(gamma.shape, dtype=beta_like.dtype), epsilon)
    else:  # a forked child, a gradient that is not plain (legacy vmap, a lazy negation): the saved statistics
        stat = x.shape[:-1]
        mean, var = mean.view(stat), var.view(stat)
    return _vjp(x, gamma, mean, var, epsilon, beta_like.dtype, dy, None, None)[:3]


def layer_norm_output(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float) -> Tensor:
    """``layer_norm(x, gamma, beta, epsilon)[0]``, the output torch.nn.LayerNorm returns. A recorded call on CPU runs
    on the native LayerNorm node when it can (:mod:`gradops.native`: the same kernels and bits, the statistics kept
    inside the node, no Python in the backward), a call nothing records on the direct path (one C++ call, without
    :func:`layer_norm`'s layers: 0.6 µs of a 7 µs module call at 8 x 8); everything else is :func:`layer_norm`'s
    own path."""
    if not (torch.is_grad_enabled() and _records((x, gamma, beta))):  # eval, no_grad: the direct call, if any
        found = _layer_norm.direct(x, gamma, beta, epsilon)
        if found is not None:
            return found[0]
    elif type(epsilon) in (float, int):  # another type (a str, a bool) is the call plan's to refuse, with its OpError
        y = _layer_norm.recorded(x, gamma, beta, epsilon)
        if y is not None:
            return y
    return layer_norm(x, gamma, beta, epsilon)[0]


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float = 1e-5, *,
               out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm over the last dim, differentiable through the fused :func:`layer_norm_backward`.
    ``out``: optional preallocated ``(y, mean, variance)`` (see :mod:`gradops.ops._out`; not differentiable).

    Returns:
        ``(y, mean, variance)``: y in x's dtype; mean and the biased variance in float32 (float64 for float64 x,
        which the PyTorch API takes beyond CANN's table and computes in float64) of shape ``x.shape[:-1]``
        (the statistics AscendC LayerNormGrad takes).
    """
    if out is not None:
        if _layer_norm.direct_into(out, x, gamma, beta, epsilon):  # the common out= call (see DirectOp.direct_into)
            return tuple(out)
        return into(spec.LAYER_NORM, plan_layer_norm, ("x", "gamma", "beta"), (x, gamma, beta, epsilon), out,
                    (0, 1, 2), views=_views, via=_layer_norm)
    return _layer_norm(x, gamma, beta, epsilon)


def layer_norm_grad(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor,
                    epsilon: float = 1e-5, *, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGrad: ``(pdx, res_for_gamma)`` for dy, x of shape (..., H).

    Uses ``rstd = (variance + epsilon)^-0.5`` and CANN's formula term by term (see
    :mod:`gradops.families.layer_norm.reference`); ``res_for_gamma = (x - mean) * rstd`` feeds
    :func:`layer_norm_grad_beta`. Both results in x's dtype. mean and variance: float32 or x's dtype, shape
    ``x.shape[:-1]`` (or keepdim). ``out``: optional preallocated ``(pdx, res_for_gamma)``.

    The statistics come in AscendC's order, variance before mean, where :func:`layer_norm` returns
    ``(y, mean, variance)``: pass them by keyword (``layer_norm_grad(dy, x, variance=var, mean=mean, gamma=g)``)
    to keep them apart. A variance below ``-epsilon`` (a swapped mean, typically) is refused with OpError 161002.
    """
    if out is not None:
        if _layer_norm_grad.direct_into(out, dy, x, variance, mean, gamma, epsilon):
            return tuple(out)
        args = (dy, x, variance, mean, gamma, epsilon)
        plan_layer_norm_grad(*args)  # refusals first, as the call without out=
        checked_statistic("layer_norm_grad", "variance", variance, float(epsilon))
        return into(spec.LAYER_NORM_GRAD, plan_layer_norm_grad, ("dy", "x", "variance", "mean", "gamma"),
                    args, out, views=_grad_views, via=_layer_norm_grad)
    return _layer_norm_grad(dy, x, variance, mean, gamma, epsilon)


def layer_norm_grad_beta(res_for_gamma: Tensor, dy: Tensor, *, out: tuple[Tensor, Tensor] | None = None
                         ) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGradBeta: ``pd_gamma = sum(dy * res_for_gamma)``, ``pd_beta = sum(dy)`` over every dim
    but the last; accumulated in float32, returned in the inputs' dtype (shape (H,)). ``out``: optional
    preallocated ``(pd_gamma, pd_beta)``."""
    if out is not None:
        if _layer_norm_grad_beta.direct_into(out, res_for_gamma, dy):
            return tuple(out)
        return into(spec.LAYER_NORM_GRAD_BETA, plan_layer_norm_grad_beta, ("res_for_gamma", "dy"),
                    (res_for_gamma, dy), out, views=_beta_views, via=_layer_norm_grad_beta)
    return _layer_norm_grad_beta(res_for_gamma, dy)


def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                        out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnLayerNormBackward (mean and rstd in): dx, dgamma and dbeta in one pass over dy and x (3·M·N·s bytes
    where LayerNormGrad + LayerNormGradBeta move 5). ``out``: optional preallocated ``(dx, dgamma, dbeta)`` (see
    :mod:`gradops.ops._out`).

    dx is aclnnLayerNormBackward's formula, whose golden in CANN's own tests is ATen's
    ``native_layer_norm_backward``: with ``g = dy·gamma`` and ``xhat = (x − mean)·rstd``, ``dx = rstd·(g −
    mean(g) − xhat·mean(g·xhat))``. :func:`layer_norm_grad` (variance in) keeps AscendC LayerNormGrad's
    term-by-term formula, whose extra ``Σ(x − mean)`` term is 0 only when mean is x's row mean: with statistics
    from :func:`layer_norm` the two agree to rounding, with statistics unrelated to x they differ (issue 17).

    Returns:
        ``(dx, dgamma, dbeta)``: dx in x's dtype, dgamma and dbeta in float32 (float64 for float64 x).
        ``rstd = (variance + eps)^-0.5`` (not the variance :func:`layer_norm` returns); a negative rstd (a mean
        passed in its place, typically) is refused with OpError 161002. Differentiable (double backward of
        :func:`layer_norm`) with respect to dy, x, mean, rstd and gamma, the statistics as independent inputs.
    """
    if out is not None:
        if _layer_norm_backward.direct_into(out, dy, x, mean, rstd, gamma):
            return tuple(out)
        args = (dy, x, mean, rstd, gamma)
        plan_layer_norm_backward(*args)  # refusals first, as the call without out=
        checked_statistic("layer_norm_backward", "rstd", rstd, 0.0)
        return into(spec.LAYER_NORM_BACKWARD, plan_layer_norm_backward, ("dy", "x", "mean", "rstd", "gamma"), args,
                    out, views=_backward_views, via=_layer_norm_backward)
    return _layer_norm_backward(dy, x, mean, rstd, gamma)
