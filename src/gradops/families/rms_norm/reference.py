"""RmsNorm and RmsNormGrad in pure torch: the portable path and the formula of record.

Inputs arrive as the 2-D views the dispatch layer makes (rows x cols, cols = gamma.numel()). Math runs in
``compute`` (float32 by default, float64 for the CLI's oracle); results are cast once at the end.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...spec import Impl


def rms_norm(x: Tensor, gamma: Tensor, epsilon: float, compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``rstd = 1/sqrt(mean(x^2) + eps)``, ``y = x * rstd * gamma``; y in x's dtype, rstd float32 of shape (rows,)."""
    xf = x.to(compute)
    # An empty row has mean(x^2) = 0 (torch's mean of nothing is NaN): rstd = 1/sqrt(eps), inf when eps = 0.
    mean_sq = xf.square().mean(dim=-1) if x.shape[-1] else xf.new_zeros(x.shape[:-1])
    rstd = torch.rsqrt(mean_sq + epsilon)
    y = xf * rstd[:, None] * gamma.to(compute)
    # .contiguous(): elementwise results follow x's layout; the ops' fake implementations promise row-major.
    return y.to(x.dtype).contiguous(), rstd.to(torch.promote_types(torch.float32, compute))


def rms_norm_grad(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor,
                  compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """aclnnRmsNormGrad, applied literally (rstd is not re-derived from x)::

        m[r]      = mean_j(dy[r,j] * gamma[j] * x[r,j] * rstd[r])
        dx[r,j]   = (dy[r,j] * gamma[j] - x[r,j] * rstd[r] * m[r]) * rstd[r]      -> dtype of dy
        dgamma[j] = sum_r dy[r,j] * x[r,j] * rstd[r]                              -> float32
    """
    xhat = x.to(compute) * rstd.to(compute)[:, None]
    dyf = dy.to(compute)
    wdy = dyf * gamma.to(compute)
    if x.shape[-1]:
        m = (wdy * xhat).mean(dim=-1, keepdim=True)
        dx = (wdy - xhat * m) * rstd.to(compute)[:, None]
    else:
        dx = wdy
    dgamma = (dyf * xhat).sum(dim=0)
    return dx.to(dy.dtype).contiguous(), dgamma.to(torch.promote_types(torch.float32, compute))


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
RMS_NORM = Impl(rms_norm)
RMS_NORM_GRAD = Impl(rms_norm_grad)
