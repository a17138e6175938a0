"""aclnnEmbeddingDenseBackward in pure torch."""

from __future__ import annotations

import torch
from torch import Tensor

from ...spec import Impl
from .contract import index_error


def embedding_dense_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool, compute: torch.dtype = torch.float32) -> Tensor:
    """``out[k] = sum_{i: idx[i] = k, k != padding_idx} grad[i] / (count[k] if scale_grad_by_freq else 1)``.

    ``grad`` is (N, E); ``indices`` are N int64 row numbers, refused (OpError 161002, nothing written) unless all
    lie in [0, num_weights): a backend never trusts an index, even one its caller checked before (indices saved
    for a backward can change in place through numpy or ``.data``). ``count`` counts every occurrence, padding
    included. Sums run in ``compute`` in index order (deterministic on the CPU; on
    CUDA, where this reference runs only without Triton, ``index_add_`` uses atomics unless
    ``torch.use_deterministic_algorithms`` is on) and are cast once to grad's dtype.
    """
    if indices.numel():
        bad = (indices < 0) | (indices >= num_weights)
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            raise index_error(int(indices[pos]), pos, num_weights)
    g = grad.to(compute)
    if scale_grad_by_freq:
        # counts of the indices present, sized by the work: bincount(minlength=V) asked for 8·V bytes, 16 GiB at
        # V = 2^31 + 1 with three indices (the CI machine killed the process)
        _, inverse, counts = torch.unique(indices, return_inverse=True, return_counts=True)
        g = g / counts.to(compute)[inverse][:, None]
    if 0 <= padding_idx < num_weights:
        keep = indices != padding_idx
        g, indices = g[keep], indices[keep]
    out = torch.zeros(num_weights, grad.shape[-1], dtype=compute, device=grad.device)
    # index_add_, not index_put_(accumulate=True): on the CPU the latter runs in parallel for large inputs and its
    # sums change bits from run to run (found by the fuzz tier at 8 x 4097 into one row); index_add_ adds the rows
    # one index after another, so each element is summed in index order, every run.
    out.index_add_(0, indices, g)
    return out.to(grad.dtype)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
EMBEDDING_DENSE_BACKWARD = Impl(embedding_dense_backward)
