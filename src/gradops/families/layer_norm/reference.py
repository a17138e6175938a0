"""LayerNorm, LayerNormGrad, LayerNormGradBeta and the fused backward in pure torch.

LayerNormGrad (variance in) follows AscendC's formula term by term (hiascend LayerNormGrad, docs/semantics.md §4),
including the ``sum(x - mean)`` term that vanishes only when ``mean`` really is the row mean: AscendC applies it
literally, so does gradops. The fused backward (rstd in) is aclnnLayerNormBackward, whose golden in CANN's own
test cases is ATen's ``native_layer_norm_backward``: the same formula without that term. With statistics
consistent with x the two agree to rounding; with statistics drawn independently of x (as ops-nn's case files
draw them) only the formula of the operator's own golden passes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...spec import Impl


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float,
               compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last dim; var is the biased variance.
    Returns y (x's dtype) and mean, variance of shape (rows,) in float32."""
    xf = x.to(compute)
    if x.shape[-1]:
        # The mean summed in float64 (as the C++ kernels): exact for a constant row, whose mean is then its value and
        # y = beta for any eps (xf.mean() of N copies of 0.1 misses by an ulp, which rstd ~ 1e6 at eps = 1e-12 turns
        # into |y - beta| ~ 1).
        wide = torch.promote_types(compute, torch.float64)
        mean = (x.to(wide).sum(dim=-1) / x.shape[-1]).to(compute)
        var = (xf - mean[:, None]).square().mean(dim=-1)
    else:
        mean = var = xf.new_zeros(x.shape[:-1])
    y = (xf - mean[:, None]) * torch.rsqrt(var + epsilon)[:, None] * gamma.to(compute) + beta.to(compute)
    stat = torch.promote_types(torch.float32, compute)
    # .contiguous(): elementwise results follow x's layout; the ops' fake implementations promise row-major.
    return y.to(x.dtype).contiguous(), mean.to(stat), var.to(stat)


def _grad_terms(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, compute: torch.dtype,
                mean_term: bool = True):
    """pd_x and x_hat of AscendC LayerNormGrad, given rstd = (variance + eps)^-0.5 of shape (rows, 1)::

        pd_xl   = dy * gamma
        pd_var  = sum_H(-0.5 * pd_xl * (x - mean)) * rstd^3
        pd_mean = sum_H(-pd_xl) * rstd + pd_var * (1/H) * sum_H(-2 * (x - mean))     (the last term: mean_term)
        pd_x    = pd_xl * rstd + pd_var * (2/H) * (x - mean) + pd_mean / H

    Without ``mean_term`` this is ATen's native_layer_norm_backward (aclnnLayerNormBackward).
    """
    h = max(x.shape[-1], 1)  # H = 0: the sums are empty and pd_x has no columns; 1/H must not raise on the way
    xmu = x.to(compute) - mean.to(compute)
    pd_xl = dy.to(compute) * gamma.to(compute)
    pd_var = (-0.5 * pd_xl * xmu).sum(dim=-1, keepdim=True) * rstd ** 3
    pd_mean = (-pd_xl).sum(dim=-1, keepdim=True) * rstd
    if mean_term:
        pd_mean = pd_mean + pd_var * (-2.0 * xmu).sum(dim=-1, keepdim=True) / h
    pd_x = pd_xl * rstd + pd_var * (2.0 / h) * xmu + pd_mean / h
    return pd_x, xmu * rstd


def layer_norm_grad(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float,
                    compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGrad: returns ``(pd_x, res_for_gamma = (x - mean) * rstd)``, both in x's dtype."""
    rstd = torch.rsqrt(variance.to(compute).reshape(-1, 1) + epsilon)
    pd_x, xhat = _grad_terms(dy, x, mean.reshape(-1, 1), rstd, gamma, compute)
    return pd_x.to(x.dtype).contiguous(), xhat.to(x.dtype).contiguous()


def layer_norm_grad_beta(res_for_gamma: Tensor, dy: Tensor,
                         compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGradBeta: ``pd_gamma = sum_rows(dy * res_for_gamma)``, ``pd_beta = sum_rows(dy)``,
    accumulated in float32 and cast once to the inputs' dtype."""
    dyf = dy.to(compute)
    pd_gamma = (dyf * res_for_gamma.to(compute)).sum(dim=0)
    return pd_gamma.to(dy.dtype), dyf.sum(dim=0).to(dy.dtype)


def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor,
                        compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnLayerNormBackward in one pass over dy and x: ``(dx, dgamma, dbeta)``, dx in x's dtype (ATen's formula:
    LayerNormGrad's without the ``sum(x - mean)`` term), dgamma and dbeta as LayerNormGradBeta in float32 (they
    feed parameter updates; one rounding, at the caller's cast)."""
    pd_x, xhat = _grad_terms(dy, x, mean.reshape(-1, 1), rstd.to(compute).reshape(-1, 1), gamma, compute,
                             mean_term=False)
    dyf = dy.to(compute)
    out = torch.promote_types(torch.float32, compute)
    return pd_x.to(x.dtype).contiguous(), (dyf * xhat).sum(dim=0).to(out), dyf.sum(dim=0).to(out)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
LAYER_NORM = Impl(layer_norm)
LAYER_NORM_GRAD = Impl(layer_norm_grad)
LAYER_NORM_GRAD_BETA = Impl(layer_norm_grad_beta)
LAYER_NORM_BACKWARD = Impl(layer_norm_backward)
