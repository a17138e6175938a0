"""The programs of the indexed ops, the embedding lookup, embedding_dense_backward and the MoE token permute family,
for the extension's direct calls (see :mod:`gradops.cpu.programs`)."""

from __future__ import annotations

import numpy as np
import torch

from ._host import PARALLEL_MIN
from ._views import view1, view2
from .embedding import _ROWS, _counting_sort, _first_outside, _gather_block, _lookup_rows, _sparse_segments
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
from .programs import Program, arg, blocks_grain, chunks, piece, rows_grain


# ---------------------------------------------------------------- embedding (the lookup) and its backward
@piece
def _embedding_check(i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: idx, n, v
        a = view1(at, _I64, 3)
        return _first_outside(view1(a[0], i_s, a[1]), a[2])
    return body


@piece
def _embedding_sort(i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: idx, offsets, order, n, v
        a = view1(at, _I64, 5)
        n, v = a[3], a[4]
        return _counting_sort(view1(a[0], i_s, n), v, view1(a[1], _I64, v + 1), view1(a[2], _I64, n))
    return body


@piece
def _embedding_table(s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: grad, offsets, order, out, n, e, v, padding, scale
        a = view1(at, _I64, 9)
        n, e, v = a[4], a[5], a[6]
        grad, out = view2(a[0], s, n, e), view2(a[3], s, v, e)
        offsets, order = view1(a[1], _I64, v + 1), view1(a[2], _I64, n)
        acc = np.empty(e, dtype=np.float32)
        for c in range(lo, hi):
            _gather_block(grad, offsets, order, a[7], a[8] != 0, out, c, acc)
        return -1
    return body


@piece
def _embedding_order(i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: idx, order, n, v
        a = view1(at, _I64, 4)
        idx = view1(a[0], i_s, a[2])
        bad = _first_outside(idx, a[3])
        if bad < 0:
            view1(a[1], _I64, a[2])[:] = np.argsort(idx, kind="mergesort")
        return bad
    return body


@piece
def _embedding_rows(s, i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: grad, idx, order, out, n, e, v, padding, scale
        a = view1(at, _I64, 9)
        n, e, v = a[4], a[5], a[6]
        _sparse_segments(view2(a[0], s, n, e), view1(a[1], i_s, n), view1(a[2], _I64, n), a[7], a[8] != 0,
                         view2(a[3], s, v, e), lo, hi, np.empty(e, dtype=np.float32))
        return -1
    return body


@piece
def _embedding_lookup(s, i_s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: weight, idx, out, n, e, v
        a = view1(at, _I64, 6)
        n, e, v = a[3], a[4], a[5]
        _lookup_rows(view2(a[0], s, v, e), view1(a[1], i_s, n), view2(a[2], s, n, e), lo, hi)
        return -1
    return body


def _embedding(plan, weight, indices, padding_idx, scale_grad_by_freq):
    """The lookup that nothing records (the Python path: the range test, then ATen's index_select; padding and
    scaling only shape the backward)."""
    n = indices.numel()
    v, e = weight.shape
    if not n or not e or indices.dtype not in (torch.int32, torch.int64):
        return None
    p = Program()
    out = p.output((*indices.shape, e), weight.dtype)
    p.step(_embedding_check(indices.dtype), [arg(1), n, v])
    p.step(_embedding_lookup(weight.dtype, indices.dtype), [arg(0), arg(1), out, n, e, v], n, rows_grain(n, e))
    return p.returns(out)


def _embedding_dense_backward(plan, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    n, e = plan
    v = num_weights
    if not n or not e or not v or indices.dtype not in (torch.int32, torch.int64):
        return None
    pad = padding_idx if 0 <= padding_idx < v else -1
    scale = bool(scale_grad_by_freq)
    p = Program()
    if n < v:  # few indices in a large table: zero it, then the touched rows (the Python path's _sparse)
        out = p.output((v, e), grad.dtype, zero=True)
        order = p.buffer((n,), torch.int64)
        p.step(_embedding_order(indices.dtype), [arg(1), order, n, v])
        p.step(_embedding_rows(grad.dtype, indices.dtype), [arg(0), arg(1), order, out, n, e, v, pad, scale], n,
               n if n * e < PARALLEL_MIN else max(1, PARALLEL_MIN // e))
    else:  # the counting sort (also the range test), then every row of the table once, in fixed blocks
        out = p.output((v, e), grad.dtype)
        offsets, order = p.buffer((v + 1,), torch.int64), p.buffer((n,), torch.int64)
        blocks = chunks(v, _ROWS)
        p.step(_embedding_sort(indices.dtype), [arg(1), offsets, order, n, v])
        p.step(_embedding_table(grad.dtype), [arg(0), offsets, order, out, n, e, v, pad, scale], blocks,
               blocks_grain(blocks, v * e))
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


def embedding_node_pieces(dtype: torch.dtype, index_dtype: torch.dtype) -> list[int]:
    """The native Embedding node's pieces (autograd.cpp): the range test ``(idx, n, v)`` of its forward, the
    backward's counting sort, table blocks, sorted order and sorted runs, and the forward's rows - the direct calls'
    own."""
    return [_embedding_check(index_dtype), _embedding_sort(index_dtype), _embedding_table(dtype),
            _embedding_order(index_dtype), _embedding_rows(dtype, index_dtype), _embedding_lookup(dtype, index_dtype)]


BUILDERS = {
    "embedding": _embedding, "embedding_dense_backward": _embedding_dense_backward,
    "moe_token_permute": _moe_token_permute, "moe_token_permute_grad": _moe_token_permute_grad,
    "moe_token_unpermute": _moe_token_unpermute, "moe_token_unpermute_grad": _moe_token_unpermute_grad,
}
