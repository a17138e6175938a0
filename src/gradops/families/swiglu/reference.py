"""SwiGlu and SwiGluGrad in pure torch: any shape and split dim (the call plan hands the 2-D view of
:class:`~.contract.SwiGluShape`, x: rows x 2·cols split along its last dim)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...spec import Impl


def swiglu(x: Tensor, dim: int = -1, compute: torch.dtype = torch.float32) -> Tensor:
    """``y = silu(A) * B`` with A, B the halves of x along ``dim``, ``silu(a) = a * sigmoid(a)``."""
    a, b = x.to(compute).chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(x.dtype)


def swiglu_grad(y_grad: Tensor, x: Tensor, dim: int = -1, compute: torch.dtype = torch.float32) -> Tensor:
    """aclnnSwiGluGrad: ``[dA, dB]`` with ``dA = g * B * s * (1 + A * (1 - s))``, ``dB = g * A * s``,
    ``s = sigmoid(A)``: the derivative of ``silu(A) * B`` (CANN's document prints ``s + s * (1 - s * A)`` for dA's
    factor, which is not that derivative; docs/semantics.md §7)."""
    a, b = x.to(compute).chunk(2, dim=dim)
    g = y_grad.to(compute)
    s = torch.sigmoid(a)
    return torch.cat((g * b * (s * (1 + a * (1 - s))), g * (a * s)), dim=dim).to(x.dtype)


# ---------------------------------------------------------------- what the family's declarations provide
SWIGLU = Impl(swiglu)
SWIGLU_GRAD = Impl(swiglu_grad)
