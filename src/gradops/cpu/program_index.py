"""The programs of the indexed ops, the embedding lookup, embedding_dense_backward and the MoE token permute family,
for the extension's direct calls (see :mod:`gradops.cpu.programs`)."""

from __future__ import annotations

import torch

from .programs import Program, arg

# ---------------------------------------------------------------- embedding (the lookup) and its backward
_EMBEDDING_INDICES = (torch.int32, torch.int64)


def _embedding(plan, weight, indices, padding_idx, scale_grad_by_freq):
    """The lookup that nothing records: the native kernel ``embedding`` (the range test, then the rows, a copy of
    storage items: the bits of the Python path's index_select; padding and scaling only shape the backward). None
    for an empty result: the Python path's."""
    if not indices.numel() or not weight.shape[1] or indices.dtype not in _EMBEDDING_INDICES:
        return None
    p = Program()
    out = p.output((*indices.shape, weight.shape[1]), weight.dtype)
    p.kernel("embedding", [arg(0), arg(1)], [out])
    return p.returns(out)


def _embedding_dense_backward(plan, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """The backward: the native kernel ``embedding_dense_backward`` (the sort, also the range test, then every row
    of the table once). None for no index, no column or no row: the Python path's."""
    n, e = plan
    if not n or not e or not num_weights or indices.dtype not in _EMBEDDING_INDICES:
        return None
    p = Program()
    out = p.output((num_weights, e), grad.dtype)
    pad = padding_idx if 0 <= padding_idx < num_weights else -1
    p.kernel("embedding_dense_backward", [arg(0), arg(1)], [out], [num_weights, pad, int(bool(scale_grad_by_freq))])
    return p.returns(out)


# ---------------------------------------------------------------- MoE token permute / unpermute
# One step each: the native kernel of the Python path (gradops/native/moe_permute.cpp), so both paths give the same
# bits; a value the kernel refuses (a negative expert id, sorted_indices that are not a permutation) sends the call
# to the Python path, which raises the op's OpError.
def _moe_token_permute(plan, tokens, indices, num_out_tokens, padded_mode):
    if not indices.numel() or tokens.dim() != 2:
        return None
    p = Program()
    out, inverse = p.output((plan.rows, tokens.shape[1]), tokens.dtype), p.output((indices.numel(),), torch.int32)
    p.kernel("moe_token_permute", [arg(0), arg(1)], [out, inverse], [plan.topk])
    return p.returns(out, inverse)


def _moe_token_permute_grad(plan, grad, sorted_indices, num_topk, padded_mode):
    tokens, h = sorted_indices.numel() // num_topk, grad.shape[1]
    if not tokens or not h:
        return None
    p = Program()
    out = p.output((tokens, h), grad.dtype)
    p.kernel("moe_token_permute_grad", [arg(0), arg(1)], [out], [num_topk])
    return p.returns(out)


def _moe_token_unpermute(plan, permuted_tokens, sorted_indices, probs, padded_mode):
    h = permuted_tokens.shape[1]
    tokens = sorted_indices.numel() // (1 if probs is None else probs.shape[1])
    if not tokens or not h:
        return None
    p = Program()
    out = p.output((tokens, h), permuted_tokens.dtype)
    p.kernel("moe_token_unpermute", [arg(0), arg(1), None if probs is None else arg(2)], [out])
    return p.returns(out)


def _moe_token_unpermute_grad(plan, permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode):
    tokens = grad_unpermuted.shape[0]
    if not tokens or not permuted_tokens.shape[1]:
        return None
    p = Program()
    dx = p.output(permuted_tokens.shape, permuted_tokens.dtype)
    # Without probs: no probs gradient, an empty tensor of permuted_tokens' dtype (the Python path's).
    dp = p.output((0,), permuted_tokens.dtype) if probs is None else p.output(probs.shape, probs.dtype)
    p.kernel("moe_token_unpermute_grad", [arg(0), arg(1), arg(2), None if probs is None else arg(3)], [dx, dp], [1])
    return p.returns(dx, dp)


BUILDERS = {
    "embedding": _embedding, "embedding_dense_backward": _embedding_dense_backward,
    "moe_token_permute": _moe_token_permute, "moe_token_permute_grad": _moe_token_permute_grad,
    "moe_token_unpermute": _moe_token_unpermute, "moe_token_unpermute_grad": _moe_token_unpermute_grad,
}
