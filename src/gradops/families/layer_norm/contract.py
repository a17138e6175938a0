"""Validation table of LayerNorm, LayerNormGrad and LayerNormGradBeta (AscendC kernel APIs).

AscendC's own table is T in {half, float}; the PyTorch API also takes bfloat16 (what LLM training runs in),
and gamma/beta in float32 beside half inputs, as RmsNormGrad's table allows, and float64 (gamma/beta float64
too; statistics and weight gradients then float64), as torch's own LayerNorm does. ``cann=True`` restricts to
AscendC's table. Statistics (mean, variance, rstd) are float32 or the dtype of x, with shape ``x.shape[:-1]``
or its keepdim form ``x.shape[:-1] + (1,)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...contract._common import (
    MAX_RANK,
    TORCH_FLOATS,
    Result,
    accumulator,
    dtype_name,
    dtypes_text,
    fail,
    numel,
    require_dtype,
    require_float,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    require_shape,
    shape_text,
)
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import OpError

ASCENDC_DTYPES = (torch.float16, torch.float32)


class LayerNormShape(NamedTuple):
    """The 2-D view every backend works on: x as ``rows`` x ``cols`` (cols: its last dim)."""

    rows: int
    cols: int


# What each op returns, declared once (see gradops.contract._common.Result): x-shaped results are written as the
# rows x cols view, statistics as rows.
def layer_norm_results(shape: LayerNormShape, x, gamma, beta, epsilon: float = 1e-5) -> list[Result]:
    """LayerNorm's results: y (x's shape and dtype), mean and variance (the accumulator dtype, ``x.shape[:-1]``)."""
    stat, acc = x.shape[:-1], accumulator(x.dtype)
    return [Result(x.shape, x.dtype, x, shape)] + [Result(stat, acc, x, (shape.rows,))] * 2


def layer_norm_grad_results(shape: LayerNormShape, dy, x, variance, mean, gamma, epsilon: float = 1e-5
                            ) -> list[Result]:
    """LayerNormGrad's results: pdx and res_for_gamma, both of x's shape and dtype."""
    return [Result(x.shape, x.dtype, x, shape)] * 2


def layer_norm_grad_beta_results(shape: LayerNormShape, res_for_gamma, dy) -> list[Result]:
    """LayerNormGradBeta's results: pd_gamma and pd_beta of ``dy.shape[-1:]`` in dy's dtype."""
    return [Result(dy.shape[-1:], dy.dtype, dy)] * 2


def layer_norm_backward_results(shape: LayerNormShape, dy, x, mean, rstd, gamma) -> list[Result]:
    """The fused backward's results: dx (x's shape and dtype), dgamma and dbeta (the accumulator dtype, gamma's
    shape)."""
    acc = accumulator(x.dtype)
    return [Result(x.shape, x.dtype, x, shape), Result(gamma.shape, acc, gamma), Result(gamma.shape, acc, gamma)]


def _dtypes(cann: bool) -> tuple[torch.dtype, ...]:
    return ASCENDC_DTYPES if cann else TORCH_FLOATS


def _check_param_dtype(op: str, name: str, p: torch.Tensor, x: torch.Tensor, cann: bool) -> None:
    # float32 parameters beside half x (CANN's mixed precision); float64 x takes float64 parameters only.
    same_only = cann or x.dtype == torch.float64
    allowed = (x.dtype,) if same_only else tuple(dict.fromkeys((x.dtype, torch.float32)))
    if p.dtype not in allowed:
        raise fail(INVALID, op, f"{name}.dtype", f"{dtypes_text(allowed)} for x of {dtype_name(x.dtype)}",
                   dtype_name(p.dtype))


def _check_stat(op: str, name: str, s: torch.Tensor, x: torch.Tensor) -> None:
    allowed = tuple(dict.fromkeys((torch.float32, x.dtype)))
    require_dtype(op, name, s, allowed)
    rows = tuple(x.shape[:-1])
    if tuple(s.shape) not in (rows, (*rows, 1)):
        raise fail(INVALID, op, f"{name}.shape", f"{shape_text(rows)} or {shape_text((*rows, 1))}",
                   shape_text(s.shape))


def _check_x(op: str, x: torch.Tensor, cann: bool) -> LayerNormShape:
    require_dtype(op, "x", x, _dtypes(cann))
    require_rank(op, "x", x, 1, MAX_RANK)
    return LayerNormShape(numel(x.shape[:-1]), x.shape[-1])


def check_layer_norm(x, gamma, beta, epsilon: float = 1e-5) -> LayerNormShape:
    """Validate ``layer_norm(x, gamma, beta, epsilon)`` (normalised over the last dim)."""
    op = "layer_norm"
    require_present(op, x=x, gamma=gamma, beta=beta)
    require_float(op, "epsilon", epsilon)
    require_same_device(op, x=x, gamma=gamma, beta=beta)
    shape = _check_x(op, x, False)
    _check_param_dtype(op, "gamma", gamma, x, False)
    _check_param_dtype(op, "beta", beta, x, False)
    require_shape(op, "gamma", gamma, x.shape[-1:], "(H,) with H = x.shape[-1]")
    require_shape(op, "beta", beta, x.shape[-1:], "(H,) with H = x.shape[-1]")
    return shape


def check_layer_norm_grad(dy, x, variance, mean, gamma, epsilon: float = 1e-5, *, cann: bool = False) -> LayerNormShape:
    """Validate ``layer_norm_grad(dy, x, variance, mean, gamma, epsilon)`` (AscendC LayerNormGrad)."""
    op = "layer_norm_grad"
    require_present(op, dy=dy, x=x, variance=variance, mean=mean, gamma=gamma)
    require_float(op, "epsilon", epsilon)
    require_same_device(op, dy=dy, x=x, variance=variance, mean=mean, gamma=gamma)
    shape = _check_x(op, x, cann)
    require_same_dtype(op, "dy", dy, "x", x)
    _check_param_dtype(op, "gamma", gamma, x, cann)
    require_shape(op, "dy", dy, x.shape, "the shape of x")
    _check_stat(op, "variance", variance, x)
    _check_stat(op, "mean", mean, x)
    require_shape(op, "gamma", gamma, x.shape[-1:], "(H,) with H = x.shape[-1]")
    return shape


def check_layer_norm_backward(dy, x, mean, rstd, gamma) -> LayerNormShape:
    """Validate the fused ``layer_norm_backward(dy, x, mean, rstd, gamma)``."""
    op = "layer_norm_backward"
    require_present(op, dy=dy, x=x, mean=mean, rstd=rstd, gamma=gamma)
    require_same_device(op, dy=dy, x=x, mean=mean, rstd=rstd, gamma=gamma)
    shape = _check_x(op, x, False)
    require_same_dtype(op, "dy", dy, "x", x)
    _check_param_dtype(op, "gamma", gamma, x, False)
    require_shape(op, "dy", dy, x.shape, "the shape of x")
    _check_stat(op, "mean", mean, x)
    _check_stat(op, "rstd", rstd, x)
    require_shape(op, "gamma", gamma, x.shape[-1:], "(H,) with H = x.shape[-1]")
    return shape


def check_layer_norm_grad_beta(res_for_gamma, dy, *, cann: bool = False) -> LayerNormShape:
    """Validate ``layer_norm_grad_beta(res_for_gamma, dy)`` (AscendC LayerNormGradBeta)."""
    op = "layer_norm_grad_beta"
    require_present(op, res_for_gamma=res_for_gamma, dy=dy)
    require_same_device(op, res_for_gamma=res_for_gamma, dy=dy)
    require_dtype(op, "dy", dy, _dtypes(cann))
    require_same_dtype(op, "res_for_gamma", res_for_gamma, "dy", dy)
    require_rank(op, "dy", dy, 1, MAX_RANK)
    require_shape(op, "res_for_gamma", res_for_gamma, dy.shape, "the shape of dy")
    return LayerNormShape(numel(dy.shape[:-1]), dy.shape[-1])


def checked_statistic(op: str, name: str, values: torch.Tensor, floor: float) -> None:
    """Refuse a LayerNorm statistic the formula cannot use (161002): ``values + floor < 0`` anywhere, i.e. a
    variance below ``-epsilon`` (``(variance + epsilon)^-0.5`` would be NaN) or, with ``floor = 0``, a negative
    rstd (``(variance + eps)^-0.5`` never is). The statistics are float32 tensors of one shape, so a swapped pair
    - :func:`gradops.layer_norm` returns ``(mean, variance)``, LayerNormGrad takes ``(variance, mean)`` - passes
    every metadata check; its values give it away as soon as one mean is below ``-epsilon``. NaN passes (computed
    with, as CANN does), and a refused value is refused whatever else the tensor holds, NaN included. Passing the
    statistics by keyword (``variance=..., mean=...``) avoids the swap.

    Cost: one reduction and, on the CPU, one read of its result (~3 µs at small sizes). On CUDA the answer is
    checked without a host synchronisation when the Triton launchers are present
    (:func:`gradops.launch._common.guard`: raised by the next gradops launch or ``gradops.synchronize()``).
    """
    if values.numel() == 0:
        return

    def error() -> OpError:
        return statistic_error(op, name, values, floor)

    if values.device.type == "cuda":
        try:
            from ...launch._common import guard
        except ImportError:  # no Triton: the reference runs, and this check synchronises once
            guard = None
        if guard is not None:
            guard((values.float() + floor < 0).any(), error)  # float(): a no-op on the float32 statistics
            return
    # Any entry, in float64 as the C++ kernels test it: min() is NaN when one entry is, and a refused value beside
    # a NaN passed here while the kernels refused it.
    if bool((values.double() + floor < 0).any()):
        raise error()


def statistic_error(op: str, name: str, values: torch.Tensor, floor: float) -> OpError:
    """The OpError of :func:`checked_statistic` for ``values`` that have an entry with ``values + floor < 0``:
    one text for that check and for the compiled CPU kernels, which test the statistics as they read them."""
    flat = values.reshape(-1)
    pos = int(((flat.double() + floor) < 0).nonzero()[0, 0])
    what = ("a variance, >= -epsilon (were mean and variance swapped? LayerNormGrad takes variance first)"
            if floor else "an rstd = (variance + epsilon)^-0.5, >= 0 (was mean passed as rstd?)")
    return fail(INVALID, op, name, what, f"{flat[pos].item()} at row {pos}")
