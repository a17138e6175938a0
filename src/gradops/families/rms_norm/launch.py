"""Host launchers of RmsNorm and RmsNormGrad (backend ``triton``): allocation, grid and tile choice."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...contract._common import written
from ...kernels.common import RowConfig, persistent_programs, row_config
from ...launch._common import carve, launch, outputs, reduce_partials, sm_count, unit_stride_rows, workspace_bytes
from ...spec import Impl
from .contract import on_rows, rms_norm_grad_results, rms_norm_results
from .kernels import rms_norm_fwd_kernel, rms_norm_grad_kernel, rms_norm_grad_looped_kernel


def rms_norm(x: Tensor, gamma: Tensor, epsilon: float, *, out: tuple[Tensor, Tensor] | None = None,
             config: RowConfig | None = None) -> tuple[Tensor, Tensor]:
    """RmsNorm forward on the (M, N) view.

    Args:
        x: (M, N), float16 / bfloat16 / float32; any row stride.
        gamma: (N,), x's dtype or float32.
        epsilon: added to mean(x^2).
        out: optional contiguous ``(y, rstd)`` to write into.
        config: tile override (tests force the looped path with it); default :func:`row_config`.

    Returns:
        ``(y, rstd)``: y (M, N) contiguous in x's dtype, rstd (M,) float32.
    """
    m, n = x.shape
    y, rstd = outputs(out, written(rms_norm_results(on_rows(m, n), x, gamma, epsilon)), x.device)
    if m == 0:
        return y, rstd
    if n == 0:  # mean of nothing is 0: rstd = eps^-0.5, as the reference
        return y, rstd.fill_(float(epsilon)).rsqrt_()
    x, gamma = unit_stride_rows(x), gamma.contiguous()
    cfg = config or row_config(n)
    launch(rms_norm_fwd_kernel, (triton.cdiv(m, cfg.block_m),), x, gamma, y, rstd, m, n, x.stride(0), y.stride(0),
           float(epsilon), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOOPED=cfg.looped, num_warps=cfg.num_warps)
    return y, rstd


def _grad_plan(x: Tensor, config: RowConfig | None) -> tuple[RowConfig, int, int]:
    """(tile config, programs P, work items per program) of the persistent backward grid."""
    m, n = x.shape
    cfg = config or row_config(n)
    work = m if cfg.looped else triton.cdiv(m, cfg.block_m)
    programs = persistent_programs(sm_count(x.device), work, cfg)
    return cfg, programs, triton.cdiv(work, programs)


def _partials_spec(x: Tensor, programs: int) -> list[tuple[int, torch.dtype]]:
    # One partial row needs no reduction: the kernel then writes dgamma (float32) directly.
    return [(programs * x.shape[1], torch.float32)] if programs > 1 else []


def rms_norm_grad_workspace(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor, *,
                            config: RowConfig | None = None) -> int:
    """Scratch bytes of :func:`rms_norm_grad`: the fp32 dgamma partials, ``P x N x 4`` (0 when P = 1)."""
    m, n = x.shape
    if m == 0 or n == 0:
        return 0
    return workspace_bytes(_partials_spec(x, _grad_plan(x, config)[1]))


def rms_norm_grad(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor, *, workspace: Tensor | None = None,
                  out: tuple[Tensor, Tensor] | None = None, config: RowConfig | None = None) -> tuple[Tensor, Tensor]:
    """aclnnRmsNormGrad on the (M, N) view: one fused persistent pass, then the fixed-order dgamma reduction.

    Args:
        dy, x: (M, N), same float dtype; any row strides.
        rstd: (M,) float32.
        gamma: (N,), x's dtype or float32.
        workspace: optional uint8 scratch of :func:`rms_norm_grad_workspace` bytes.
        out: optional contiguous ``(dx, dgamma)`` to write into.
        config: tile override (tests force the looped path with it).

    Returns:
        ``(dx, dgamma)``: dx (M, N) contiguous in dy's dtype, dgamma (N,) float32.
    """
    m, n = x.shape
    dx, dgamma = outputs(out, written(rms_norm_grad_results(on_rows(m, n), dy, x, rstd, gamma)), dy.device)
    if n == 0:
        return dx, dgamma
    if m == 0:
        return dx, dgamma.zero_()
    dy, x, rstd, gamma = unit_stride_rows(dy), unit_stride_rows(x), rstd.contiguous(), gamma.contiguous()
    cfg, programs, per_program = _grad_plan(x, config)
    scratch = carve(workspace, dy.device, _partials_spec(x, programs))
    part = scratch[0] if scratch else dgamma
    args = (dy, x, rstd, gamma, dx, part, m, n, dy.stride(0), x.stride(0), dx.stride(0), per_program)
    if cfg.looped:
        launch(rms_norm_grad_looped_kernel, (programs,), *args, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    else:
        launch(rms_norm_grad_kernel, (programs,), *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
               num_warps=cfg.num_warps)
    if scratch:
        reduce_partials(part, dgamma, None, None, programs, n)
    return dx, dgamma


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
RMS_NORM = Impl(rms_norm)
RMS_NORM_GRAD = Impl(rms_norm_grad, workspace=rms_norm_grad_workspace)
