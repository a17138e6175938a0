"""The programs of the indexed ops, the embedding lookup, embedding_dense_backward and the MoE token permute family,
for the extension's direct calls (see :mod:`gradops.cpu.programs`)."""

from __future__ import annotations

import numpy as np
import torch

from ._views import view1, view2
from .moe_permute import (
    _COPIES,
    _LANES,
    _TOKENS,
    _destinations,
    _first_not_permutation,
    _gather_chunk,
    _permute_grad_chunk,
    _unpermute_chunk,
    _unpermute_grad_chunk,
)
from .programs import I64 as _I64
from .programs import Program, arg, blocks_grain, chunks, piece

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
_I32 = np.dtype(np.int32)


@piece
def _moe_destinations(i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: ids, inverse, total
        a = view1(at, _I64, 3)
        return _destinations(view1(a[0], i_s, a[2]), view1(a[1], _I32, a[2]))  # a negative id's position, or -1
    return body


@piece
def _moe_gather(s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: tokens, inverse, out, t, h, total, topk, rows
        a = view1(at, _I64, 8)
        t, h, total, rows = a[3], a[4], a[5], a[7]
        tokens, out, inverse = view2(a[0], s, t, h), view2(a[2], s, rows, h), view1(a[1], _I32, total)
        for c in range(lo, hi):
            _gather_chunk(tokens, inverse, a[6], rows, out, c)
        return -1
    return body


@piece
def _moe_not_permutation(i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: idx, total
        a = view1(at, _I64, 2)
        return _first_not_permutation(view1(a[0], i_s, a[1]))
    return body


@piece
def _moe_sums(s, i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: grad, idx, out, a, h, total, topk
        a = view1(at, _I64, 7)
        rows_a, h, total, topk = a[3], a[4], a[5], a[6]
        grad, out = view2(a[0], s, rows_a, h), view2(a[2], s, total // topk, h)
        idx = view1(a[1], i_s, total)
        acc, rows = np.empty(h, dtype=np.float32), np.empty(topk, dtype=np.int64)
        for c in range(lo, hi):
            _permute_grad_chunk(grad, idx, topk, out, c, acc, rows)
        return -1
    return body


@piece
def _moe_weighted(s, i_s, p_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: x, idx, probs, out, a, h, total, topk
        a = view1(at, _I64, 8)
        rows_a, h, total, topk = a[4], a[5], a[6], a[7]
        tokens = total // topk
        x, out = view2(a[0], s, rows_a, h), view2(a[3], s, tokens, h)
        idx, probs = view1(a[1], i_s, total), view2(a[2], p_s, tokens, topk)
        acc, rows, w = np.empty(h, dtype=np.float32), np.empty(topk, dtype=np.int64), np.empty(topk, np.float32)
        for c in range(lo, hi):
            _unpermute_chunk(x, idx, probs, out, c, acc, rows, w)
        return -1
    return body


@piece
def _moe_unpermute_grad(s, i_s, p_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: x, g, idx, probs, dx, dp, a, h, t, total, topk
        a = view1(at, _I64, 11)
        rows_a, h, t, total, topk = a[6], a[7], a[8], a[9], a[10]
        has_probs = topk > 0
        k = max(topk, 1)
        rows_p = t if has_probs else 0  # without probs: empty views, never read or written
        x, g, dx = view2(a[0], s, rows_a, h), view2(a[1], s, t, h), view2(a[4], s, rows_a, h)
        probs, dp = view2(a[3], p_s, rows_p, k), view2(a[5], p_s, rows_p, k)
        idx = view1(a[2], i_s, total)
        prod, lanes = np.empty(h, dtype=np.float32), np.empty(_LANES, dtype=np.float32)
        for c in range(lo, hi):
            _unpermute_grad_chunk(x, g, idx, probs, has_probs, dx, dp, c, prod, lanes)
        return -1
    return body


def _moe_token_permute(plan, tokens, indices, num_out_tokens, padded_mode):
    total, rows = indices.numel(), plan.rows
    if not total or tokens.dim() != 2:
        return None
    t, h = tokens.shape
    p = Program()
    out, inverse = p.output((rows, h), tokens.dtype), p.output((total,), torch.int32)
    p.step(_moe_destinations(indices.dtype), [arg(1), inverse, total])
    if rows and h:
        pieces = chunks(total, _COPIES)
        p.step(_moe_gather(tokens.dtype), [arg(0), inverse, out, t, h, total, plan.topk, rows], pieces,
               blocks_grain(pieces, rows * h))
    return p.returns(out, inverse)


def _moe_token_permute_grad(plan, grad, sorted_indices, num_topk, padded_mode):
    total = sorted_indices.numel()
    a, h = grad.shape
    tokens = total // num_topk
    if not tokens or not h:
        return None
    p = Program()
    out = p.output((tokens, h), grad.dtype)
    p.step(_moe_not_permutation(sorted_indices.dtype), [arg(1), total])
    pieces = chunks(tokens, _TOKENS)
    p.step(_moe_sums(grad.dtype, sorted_indices.dtype), [arg(0), arg(1), out, a, h, total, num_topk], pieces,
           blocks_grain(pieces, tokens * h))
    return p.returns(out)


def _moe_token_unpermute(plan, permuted_tokens, sorted_indices, probs, padded_mode):
    a, h = permuted_tokens.shape
    total = sorted_indices.numel()
    topk = 0 if probs is None else probs.shape[1]
    tokens = total // max(topk, 1)
    if not tokens or not h:
        return None
    p = Program()
    out = p.output((tokens, h), permuted_tokens.dtype)
    p.step(_moe_not_permutation(sorted_indices.dtype), [arg(1), total])
    pieces = chunks(tokens, _TOKENS)
    grain = blocks_grain(pieces, tokens * h)
    if probs is None:  # weight 1: the permute gradient's gather with K = 1 (as the Python path)
        p.step(_moe_sums(permuted_tokens.dtype, sorted_indices.dtype), [arg(0), arg(1), out, a, h, total, 1], pieces,
               grain)
    else:
        p.step(_moe_weighted(permuted_tokens.dtype, sorted_indices.dtype, probs.dtype),
               [arg(0), arg(1), arg(2), out, a, h, total, topk], pieces, grain)
    return p.returns(out)


def _moe_token_unpermute_grad(plan, permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode):
    a, h = permuted_tokens.shape
    tokens, total = grad_unpermuted.shape[0], sorted_indices.numel()
    topk = 0 if probs is None else probs.shape[1]
    if not tokens or not h or grad_unpermuted.dtype != permuted_tokens.dtype:
        return None
    probs_dtype = permuted_tokens.dtype if probs is None else probs.dtype
    p = Program()
    dx = p.output((a, h), permuted_tokens.dtype)
    dp = p.output((0,) if probs is None else (tokens, topk), probs_dtype)
    p.step(_moe_not_permutation(sorted_indices.dtype), [arg(2), total])
    pieces = chunks(tokens, _TOKENS)
    # Without probs the probs and dp views have 0 rows (never read or written): any float address will do.
    weights, dp_at = (arg(0), dx) if probs is None else (arg(3), dp)
    p.step(_moe_unpermute_grad(permuted_tokens.dtype, sorted_indices.dtype, probs_dtype),
           [arg(0), arg(1), arg(2), weights, dx, dp_at, a, h, tokens, total, topk], pieces,
           blocks_grain(pieces, tokens * h * max(topk, 1)))
    return p.returns(dx, dp)


BUILDERS = {
    "embedding": _embedding, "embedding_dense_backward": _embedding_dense_backward,
    "moe_token_permute": _moe_token_permute, "moe_token_permute_grad": _moe_token_permute_grad,
    "moe_token_unpermute": _moe_token_unpermute, "moe_token_unpermute_grad": _moe_token_unpermute_grad,
}
