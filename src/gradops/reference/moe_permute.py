"""aclnnMoeTokenPermute and aclnnMoeTokenPermuteGrad in pure torch (CANN's index convention)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..contract.moe_permute import checked_sorted_indices


def moe_token_permute(tokens: Tensor, indices: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """CANN's permute: ``first = argsort(flatten(indices), stable)``, ``sorted_indices = argsort(first)`` (the
    INVERSE permutation: the destination row of token t's k-th copy), ``permuted[sorted_indices[i]] =
    tokens[i // K]``, keeping the first ``num_rows`` permuted rows. sorted_indices is int32."""
    k = indices.shape[1] if indices.dim() == 2 else 1
    first = torch.argsort(indices.reshape(-1), stable=True)
    inverse = torch.empty_like(first)
    # index_put (accumulate=False): documented deterministic under torch.use_deterministic_algorithms.
    inverse[first] = torch.arange(first.numel(), device=first.device)
    # index_select, not tokens[index]: 27 vs 126 µs on CPU at T*K = 2048, H = 96 (advanced indexing takes
    # TensorIterator's generic index kernel).
    return tokens.index_select(0, first[:num_rows] // k), inverse.to(torch.int32)


def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int,
                           compute: torch.dtype = torch.float32) -> Tensor:
    """``out[t] = sum_{k < K} grad[sorted_indices[t*K + k]]``, summed in k order in ``compute``.

    ``grad`` has A <= T*K rows; an entry in ``[A, T*K)`` names a row the forward dropped and adds nothing. An
    entry outside ``[0, T*K)`` is refused (OpError 161002), even if the caller checked it before.
    """
    checked_sorted_indices(sorted_indices)
    rows, hidden = grad.shape
    idx = sorted_indices.long().view(-1, num_topk)
    # Gather from grad plus one zero row, so dropped rows read exact zeros (no 0 * inf = NaN from masking).
    padded = torch.cat([grad.to(compute), grad.new_zeros(1, hidden, dtype=compute)])
    picked = padded.index_select(0, torch.where(idx < rows, idx, rows).view(-1)).view(*idx.shape, hidden)
    out = picked[:, 0]
    for j in range(1, num_topk):  # fixed order: k = 0, 1, ..., K-1
        out = out + picked[:, j]
    return out.to(grad.dtype)
