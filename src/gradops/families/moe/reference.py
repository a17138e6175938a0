"""aclnnMoeTokenPermute, aclnnMoeTokenPermuteGrad, aclnnMoeTokenUnpermute and aclnnMoeTokenUnpermuteGrad in pure
torch (CANN's index convention)."""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from ...spec import Impl
from .contract import checked_expert_ids, checked_permutation, checked_sorted_indices


def moe_token_permute(tokens: Tensor, indices: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """CANN's permute: ``first = argsort(flatten(indices), stable)``, ``sorted_indices = argsort(first)`` (the
    INVERSE permutation: the destination row of token t's k-th copy), ``permuted[sorted_indices[i]] =
    tokens[i // K]``, keeping the first ``num_rows`` permuted rows. sorted_indices is int32. A negative expert id
    is refused (OpError 161002, :func:`gradops.families.moe.contract.expert_id_error`); ids past every expert sort
    last."""
    checked_expert_ids(indices)
    k = indices.shape[1] if indices.dim() == 2 else 1
    first = torch.argsort(indices.reshape(-1), stable=True)
    inverse = torch.empty_like(first)
    # index_put (accumulate=False): documented deterministic under torch.use_deterministic_algorithms.
    inverse[first] = torch.arange(first.numel(), device=first.device)
    # index_select, not tokens[index]: 27 vs 126 µs on CPU at T*K = 2048, H = 96 (advanced indexing takes
    # TensorIterator's generic index kernel).
    return tokens.index_select(0, first[:num_rows] // k), inverse.to(torch.int32)


def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int,
                           compute: torch.dtype = torch.float32, *, trusted: bool = False) -> Tensor:
    """``out[t] = sum_{k < K} grad[sorted_indices[t*K + k]]``, summed in k order in ``compute``.

    ``grad`` has A <= T*K rows; an entry in ``[A, T*K)`` names a row the forward dropped and adds nothing.
    sorted_indices must be a permutation of ``[0, T*K)`` (CANN: no repeated index): an entry outside it or a
    repeated one is refused (OpError 161002), even if the caller checked the range before. ``trusted`` (the backward
    of this package's own forward, whose output is a permutation by construction) skips the repeat test, not the
    range: a saved tensor can still be changed behind autograd's back (``.data``, a numpy view), and the gather
    below must never read outside ``grad``.
    """
    if trusted:
        checked_sorted_indices(sorted_indices)
    else:
        checked_permutation(sorted_indices, "moe_token_permute_grad")
    rows, hidden = grad.shape
    idx = sorted_indices.long().view(-1, num_topk)
    # Gather from grad plus one zero row, so dropped rows read exact zeros (no 0 * inf = NaN from masking).
    padded = torch.cat([grad.to(compute), grad.new_zeros(1, hidden, dtype=compute)])
    picked = padded.index_select(0, torch.where(idx < rows, idx, rows).view(-1)).view(*idx.shape, hidden)
    out = picked[:, 0]
    for j in range(1, num_topk):  # fixed order: k = 0, 1, ..., K-1
        out = out + picked[:, j]
    return out.to(grad.dtype)


def _kept_rows(sorted_indices: Tensor, rows: int) -> Tensor:
    """Each (token, k) copy's row in ``[rows; zero row]``: a row the forward dropped (index >= rows) reads the zero
    row appended at ``rows`` (exact zeros: no ``0 * inf = NaN`` from masking)."""
    s = sorted_indices.long()
    return torch.where(s < rows, s, rows)


def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                        compute: torch.dtype = torch.float32) -> Tensor:
    """aclnnMoeTokenUnpermute: ``out[t] = sum_{k<K} probs[t, k] * permuted[sorted_indices[t*K + k]]`` in
    ``compute``, k in order, each product rounded to ``compute`` before it is added (probs None: K = 1, weight 1).

    sorted_indices must be a permutation of ``[0, T*K)`` (CANN: no repeated index; OpError 161002 otherwise);
    entries ``>= A = permuted.shape[0]`` name dropped rows and add 0.
    """
    checked_permutation(sorted_indices, "moe_token_unpermute")
    rows, hidden = permuted_tokens.shape
    k = 1 if probs is None else probs.shape[1]
    padded = torch.cat([permuted_tokens.to(compute), permuted_tokens.new_zeros(1, hidden, dtype=compute)])
    picked = padded.index_select(0, _kept_rows(sorted_indices, rows)).view(sorted_indices.numel() // k, k, hidden)
    if probs is not None:
        picked = picked * probs.to(compute)[:, :, None]
    out = picked[:, 0]
    for j in range(1, k):  # fixed order: k = 0, 1, ..., K-1
        out = out + picked[:, j]
    return out.to(permuted_tokens.dtype)


def moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                             probs: Tensor | None, compute: torch.dtype = torch.float32, *,
                             trusted: bool = False) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteGrad, in ``compute`` then rounded once::

        grad_permuted[sorted_indices[i]] = grad_unpermuted[i // K] * probs.flat[i]        (for indices < A)
        grad_probs[t, k] = sum_h grad_unpermuted[t, h] * permuted[sorted_indices[t*K + k], h]   (0 if dropped)

    Returns ``(grad_permuted (A, H) in permuted's dtype, grad_probs (T, K) in probs' dtype)``; without probs
    (K = 1, weight 1) the second is an empty tensor of permuted's dtype. sorted_indices as in
    :func:`moe_token_unpermute` (checked unless ``trusted``: the backward of this package's own forward); being a
    permutation, every row below A receives exactly one gradient row.
    """
    if not trusted:
        checked_permutation(sorted_indices, "moe_token_unpermute_grad")
    rows, hidden = permuted_tokens.shape
    k = 1 if probs is None else probs.shape[1]
    s = sorted_indices.long()
    kept = (s < rows).nonzero().reshape(-1)  # the (token, k) copies whose row is present
    g = grad_unpermuted.to(compute)
    rows_of_copies = g.index_select(0, kept // k)
    if probs is not None:
        rows_of_copies = rows_of_copies * probs.reshape(-1).to(compute).index_select(0, kept)[:, None]
    grad_permuted = torch.empty(rows, hidden, dtype=compute, device=permuted_tokens.device)
    grad_permuted[s.index_select(0, kept)] = rows_of_copies  # index_put, no accumulation: one source per row
    if probs is None:
        return grad_permuted.to(permuted_tokens.dtype), permuted_tokens.new_empty(0)
    padded = torch.cat([permuted_tokens.to(compute), permuted_tokens.new_zeros(1, hidden, dtype=compute)])
    picked = padded.index_select(0, _kept_rows(sorted_indices, rows)).view(sorted_indices.numel() // k, k, hidden)
    grad_probs = (picked * g[:, None, :]).sum(dim=-1)
    return grad_permuted.to(permuted_tokens.dtype), grad_probs.to(probs.dtype)


def kernels(compute: torch.dtype = torch.float32) -> tuple:
    """This family's functions as the routing-map ops run them (the order of
    :class:`gradops.families.moe.routing_reference.Kernels`), the sums in ``compute``."""
    return (moe_token_permute, partial(moe_token_permute_grad, compute=compute),
            partial(moe_token_unpermute, compute=compute), partial(moe_token_unpermute_grad, compute=compute))


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
MOE_TOKEN_PERMUTE = Impl(moe_token_permute)
MOE_TOKEN_PERMUTE_GRAD = Impl(moe_token_permute_grad)
MOE_TOKEN_UNPERMUTE = Impl(moe_token_unpermute)
MOE_TOKEN_UNPERMUTE_GRAD = Impl(moe_token_unpermute_grad)
