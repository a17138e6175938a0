"""Host launchers of LayerNorm, LayerNormGrad, LayerNormGradBeta and the fused LayerNorm backward (backend
``triton``)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...contract._common import written
from ...kernels.common import RowConfig, persistent_programs, row_config
from ...launch._common import carve, launch, outputs, reduce_partials, sm_count, unit_stride_rows, workspace_bytes
from ...spec import Impl
from .contract import (
    LayerNormShape,
    layer_norm_backward_results,
    layer_norm_grad_beta_results,
    layer_norm_grad_results,
    layer_norm_results,
)
from .kernels import (
    grad_beta_config,
    layer_norm_bwd_kernel,
    layer_norm_bwd_looped_kernel,
    layer_norm_fwd_kernel,
    layer_norm_grad_beta_kernel,
)


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, *,
               out: tuple[Tensor, Tensor, Tensor] | None = None,
               config: RowConfig | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm forward on the (M, N) view.

    Args:
        x: (M, N) float16 / bfloat16 / float32, any row stride. gamma, beta: (N,), x's dtype or float32.
        epsilon: added to the biased variance. out: optional contiguous ``(y, mean, variance)`` to write into.
        config: tile override (tests force the looped path).

    Returns:
        ``(y, mean, variance)``: y (M, N) in x's dtype; mean and biased variance (M,) float32.
    """
    m, n = x.shape
    y, mean, var = outputs(out, written(layer_norm_results(LayerNormShape(m, n), x, gamma, beta, epsilon)), x.device)
    if m == 0 or n == 0:  # statistics of empty rows are 0, as the reference
        return y, mean.zero_(), var.zero_()
    x = unit_stride_rows(x)
    cfg = config or row_config(n)
    launch(layer_norm_fwd_kernel, (triton.cdiv(m, cfg.block_m),), x, gamma.contiguous(), beta.contiguous(), y, mean,
           var, m, n, x.stride(0), y.stride(0), float(epsilon), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
           LOOPED=cfg.looped, num_warps=cfg.num_warps)
    return y, mean, var


def _plan(x: Tensor, config: RowConfig | None) -> tuple[RowConfig, int, int]:
    """(tile config, programs P, work items per program) of the persistent backward grid."""
    m, n = x.shape
    cfg = config or row_config(n)
    work = m if cfg.looped else triton.cdiv(m, cfg.block_m)
    programs = persistent_programs(sm_count(x.device), work, cfg)
    return cfg, programs, triton.cdiv(work, programs)


def _backward(dy: Tensor, x: Tensor, mean: Tensor, stat: Tensor, gamma: Tensor, eps: float, dx: Tensor,
              res: Tensor | None, parts: tuple[Tensor, Tensor] | None, cfg: RowConfig, programs: int,
              per_program: int) -> None:
    m, n = x.shape
    dy, x = unit_stride_rows(dy), unit_stride_rows(x)
    pg, pb = parts if parts is not None else (dx, dx)  # unused pointers when PARTIALS is False
    out_res = res if res is not None else dx
    args = (dy, x, mean.contiguous(), stat.contiguous(), gamma.contiguous(), dx, out_res, pg, pb, m, n, dy.stride(0),
            x.stride(0), dx.stride(0), out_res.stride(0), float(eps), per_program)
    # LayerNormGrad (variance in, res out) is AscendC's formula, sum(x - mean) term included; the fused
    # backward (rstd in) is aclnnLayerNormBackward's, without it.
    ascendc = res is not None
    flags = {"FROM_VAR": ascendc, "WRITE_RES": ascendc, "PARTIALS": parts is not None, "MEAN_TERM": ascendc,
             "num_warps": cfg.num_warps}
    if cfg.looped:
        launch(layer_norm_bwd_looped_kernel, (programs,), *args, BLOCK_N=cfg.block_n, **flags)
    else:
        launch(layer_norm_bwd_kernel, (programs,), *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, **flags)


def layer_norm_grad(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float, *,
                    out: tuple[Tensor, Tensor] | None = None, config: RowConfig | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGrad on the (M, N) view (CANN's formula term by term, rstd = (variance + eps)^-0.5).

    Args:
        dy, x: (M, N), same dtype. variance, mean: (M,), float32 or x's dtype. gamma: (N,). epsilon: float.
        out: optional contiguous ``(pd_x, res_for_gamma)`` to write into. config: tile override.

    Returns:
        ``(pd_x, res_for_gamma)``, both (M, N) in x's dtype.
    """
    m, n = x.shape
    results = layer_norm_grad_results(LayerNormShape(m, n), dy, x, variance, mean, gamma, epsilon)
    dx, res = outputs(out, written(results), x.device)
    if m == 0 or n == 0:
        return dx, res
    cfg, programs, per_program = _plan(x, config)
    _backward(dy, x, mean, variance, gamma, epsilon, dx, res, None, cfg, programs, per_program)
    return dx, res


def _partials_spec(x: Tensor, programs: int) -> list[tuple[int, torch.dtype]]:
    return [(programs * x.shape[1], torch.float32)] * 2 if programs > 1 else []


def layer_norm_backward_workspace(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                                  config: RowConfig | None = None) -> int:
    """Scratch bytes of :func:`layer_norm_backward`: dgamma and dbeta fp32 partials, ``2 x P x N x 4``."""
    if x.shape[0] == 0 or x.shape[1] == 0:
        return 0
    return workspace_bytes(_partials_spec(x, _plan(x, config)[1]))


def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                        workspace: Tensor | None = None, out: tuple[Tensor, Tensor, Tensor] | None = None,
                        config: RowConfig | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNormGrad + LayerNormGradBeta in one pass over dy and x (3*M*N*s bytes instead of 5*M*N*s).

    Args:
        dy, x: (M, N), same dtype. mean, rstd: (M,), float32 or x's dtype. gamma: (N,).
        workspace: optional uint8 scratch of :func:`layer_norm_backward_workspace` bytes.
        out: optional contiguous ``(dx, dgamma, dbeta)`` to write into. config: tile override.

    Returns:
        ``(dx, dgamma, dbeta)``: dx (M, N) in x's dtype; dgamma, dbeta (N,) float32.
    """
    m, n = x.shape
    results = layer_norm_backward_results(LayerNormShape(m, n), dy, x, mean, rstd, gamma)
    dx, dgamma, dbeta = outputs(out, written(results), x.device)
    if m == 0 or n == 0:
        return dx, dgamma.zero_(), dbeta.zero_()
    cfg, programs, per_program = _plan(x, config)
    scratch = carve(workspace, x.device, _partials_spec(x, programs))
    parts = (scratch[0], scratch[1]) if scratch else (dgamma, dbeta)
    _backward(dy, x, mean, rstd, gamma, 0.0, dx, None, parts, cfg, programs, per_program)
    if scratch:
        reduce_partials(parts[0], dgamma, parts[1], dbeta, programs, n)
    return dx, dgamma, dbeta


def _beta_plan(dy: Tensor, block: tuple[int, int] | None) -> tuple[int, int, int]:
    m, n = dy.shape
    return grad_beta_config(m, n, sm_count(dy.device), *(block or ()))


def layer_norm_grad_beta_workspace(res_for_gamma: Tensor, dy: Tensor, *, block: tuple[int, int] | None = None) -> int:
    """Scratch bytes of :func:`layer_norm_grad_beta`: ``2 x S x N x 4`` fp32 split partials (0 for one split)."""
    m, n = dy.shape
    if m == 0 or n == 0:
        return 0
    splits = _beta_plan(dy, block)[2]
    return workspace_bytes([(splits * n, torch.float32)] * 2) if splits > 1 else 0


def layer_norm_grad_beta(res_for_gamma: Tensor, dy: Tensor, *, workspace: Tensor | None = None,
                         out: tuple[Tensor, Tensor] | None = None,
                         block: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGradBeta on the (M, N) view: column sums in fp32, fixed order, cast once.

    Args:
        res_for_gamma, dy: (M, N), same dtype. workspace: optional uint8 scratch of
        :func:`layer_norm_grad_beta_workspace` bytes. out: optional contiguous ``(pd_gamma, pd_beta)``.
        block: ``(BLOCK_N, BLOCK_M)`` override (tests).

    Returns:
        ``(pd_gamma, pd_beta)``, (N,) each, in dy's dtype.
    """
    m, n = dy.shape
    pd_gamma, pd_beta = outputs(out, written(layer_norm_grad_beta_results(LayerNormShape(m, n), res_for_gamma, dy)),
                                dy.device)
    if m == 0 or n == 0:
        return pd_gamma.zero_(), pd_beta.zero_()
    res_for_gamma, dy = unit_stride_rows(res_for_gamma), unit_stride_rows(dy)
    block_m, block_n, splits = _beta_plan(dy, block)
    scratch = carve(workspace, dy.device, [(splits * n, torch.float32)] * 2 if splits > 1 else [])
    pg, pb = (scratch[0], scratch[1]) if scratch else (pd_gamma, pd_beta)
    launch(layer_norm_grad_beta_kernel, (triton.cdiv(n, block_n), splits), res_for_gamma, dy, pg, pb, m, n,
           res_for_gamma.stride(0), dy.stride(0), triton.cdiv(m, splits), BLOCK_M=block_m, BLOCK_N=block_n,
           num_warps=8)  # 32x128 tile, two lane-wise fp32 accumulators: 80 registers at 8 warps (ptxas sm_90a)
    if scratch:
        reduce_partials(pg, pd_gamma, pb, pd_beta, splits, n)
    return pd_gamma, pd_beta


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
LAYER_NORM = Impl(layer_norm)
LAYER_NORM_GRAD = Impl(layer_norm_grad)
LAYER_NORM_GRAD_BETA = Impl(layer_norm_grad_beta, workspace=layer_norm_grad_beta_workspace)
LAYER_NORM_BACKWARD = Impl(layer_norm_backward, workspace=layer_norm_backward_workspace)
