"""aclnnEmbeddingDenseBackward in pure torch."""

from __future__ import annotations

import torch
from torch import Tensor


def embedding_dense_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool, compute: torch.dtype = torch.float32) -> Tensor:
    """``out[k] = sum_{i: idx[i] = k, k != padding_idx} grad[i] / (count[k] if scale_grad_by_freq else 1)``.

    ``grad`` is (N, E); ``indices`` are N checked int64 row numbers in [0, num_weights). ``count`` counts every
    occurrence, padding included. Sums run in ``compute`` in index order (``index_put_`` with accumulate is
    serial on the CPU, hence deterministic) and are cast once to grad's dtype.
    """
    g = grad.to(compute)
    if scale_grad_by_freq:
        counts = torch.bincount(indices, minlength=num_weights).to(compute)
        g = g / counts[indices][:, None]
    if 0 <= padding_idx < num_weights:
        keep = indices != padding_idx
        g, indices = g[keep], indices[keep]
    out = torch.zeros(num_weights, grad.shape[-1], dtype=compute, device=grad.device)
    out.index_put_((indices,), g, accumulate=True)
    return out.to(grad.dtype)
