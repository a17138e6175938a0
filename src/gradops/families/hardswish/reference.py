"""Hardswish and aclnnHardswishBackward in pure torch (elementwise, any shape and strides)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...spec import Impl

#: float32(1/3) = 0.33333334f, the constant CANN's kernels multiply by (docs/semantics.md §3).
ONE_THIRD = 0.3333333432674408


def hardswish(x: Tensor, compute: torch.dtype = torch.float32) -> Tensor:
    """``y = x * clamp(x + 3, 0, 6) / 6``."""
    xf = x.to(compute)
    return (xf * (xf + 3.0).clamp(0.0, 6.0) / 6.0).to(x.dtype)


def hardswish_backward(grad_output: Tensor, x: Tensor, compute: torch.dtype = torch.float32) -> Tensor:
    """aclnnHardswishBackward (V1): the linear branch holds on the CLOSED interval [-3, 3]::

        out = 0                    if x < -3
              g * (x / 3 + 0.5)    if -3 <= x <= 3      (d(-3) = -0.5, d(3) = 1.5)
              g                    if x > 3 or x is NaN  (NaN falls through both tests, as in CANN's 950 kernel)
    """
    xf, gf = x.to(compute), grad_output.to(compute)
    third = ONE_THIRD if compute != torch.float64 else 1.0 / 3.0
    out = torch.where(xf < -3.0, torch.zeros_like(gf), torch.where(xf <= 3.0, gf * (xf * third + 0.5), gf))
    return out.to(x.dtype)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
HARDSWISH = Impl(hardswish)
HARDSWISH_BACKWARD = Impl(hardswish_backward)
