"""aclnnMoeTokenPermute, aclnnMoeTokenPermuteGrad and the unpermute pair as numba kernels: the permute's counting
sort and row gather, gather-sums of each token's K rows and the scatter of their gradients (no zero-fill, no
atomics: each output row has one writer).

Byte models: permute ``T·K·H·s + T·K·(s_idx + 4)`` (a token's row is read once per copy, from cache); permute
grad and unpermute ``T·K·H·s_in + T·H·s_out + T·K·s_idx`` (+ ``T·K·s_p`` for probs); unpermute grad
``T·H·s_g + A·H·(s_x + s_dx) + T·K·(s_idx + s_p + s_dp)`` (the gradient row of a token is read once per pass over
its K copies, from cache).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from ..contract.moe_permute import (
    MoePlan,
    expert_id_error,
    negative_id_error,
    permutation_error,
    sorted_index_error,
)
from ._host import PARALLEL_MIN, dense, finish, output, safe_entry
from ._numeric import ld, st
from ._views import STORAGE, view1, view2

#: Tokens per parallel task (fixed, so the work split never depends on the thread count).
_TOKENS = 16
#: Token copies per parallel task of the permute's gather.
_COPIES = 32


@njit(cache=True)
def _sum8(grad, rows, k, acc, first):  # pragma: no cover - compiled
    """Add rows ``rows[k:k+8]`` to the fp32 row sum, left to right (the k order)."""
    ra, rb, rc, rd, re, rf, rg, rh = rows[k], rows[k + 1], rows[k + 2], rows[k + 3], rows[k + 4], rows[k + 5], \
        rows[k + 6], rows[k + 7]
    if first:
        for j in range(acc.shape[0]):
            acc[j] = (ld(grad, (ra, j)) + ld(grad, (rb, j)) + ld(grad, (rc, j)) + ld(grad, (rd, j))
                      + ld(grad, (re, j)) + ld(grad, (rf, j)) + ld(grad, (rg, j)) + ld(grad, (rh, j)))
    else:
        for j in range(acc.shape[0]):
            acc[j] = (acc[j] + ld(grad, (ra, j)) + ld(grad, (rb, j)) + ld(grad, (rc, j)) + ld(grad, (rd, j))
                      + ld(grad, (re, j)) + ld(grad, (rf, j)) + ld(grad, (rg, j)) + ld(grad, (rh, j)))


@njit(cache=True)
def _sum2(grad, rows, k, acc, first):  # pragma: no cover - compiled
    """Add rows ``rows[k:k+2]`` to the fp32 row sum, left to right."""
    ra, rb = rows[k], rows[k + 1]
    if first:
        for j in range(acc.shape[0]):
            acc[j] = ld(grad, (ra, j)) + ld(grad, (rb, j))
    else:
        for j in range(acc.shape[0]):
            acc[j] = acc[j] + ld(grad, (ra, j)) + ld(grad, (rb, j))


@njit(cache=True)
def _sum1(grad, rows, k, acc, first):  # pragma: no cover - compiled
    r = rows[k]
    if first:
        for j in range(acc.shape[0]):
            acc[j] = ld(grad, (r, j))
    else:
        for j in range(acc.shape[0]):
            acc[j] = acc[j] + ld(grad, (r, j))


@njit(cache=True)
def _destinations(ids, inverse):  # pragma: no cover - compiled
    """CANN's sorted_indices: ``inverse[i]`` = the rank of copy ``i`` in the stable order of the expert ids (the
    destination row of token ``i // K``'s copy ``i % K``). A counting sort when the ids span at most
    ``2·n + 4096`` values (every router: ids in [0, E)), else a stable merge argsort; both give argsort(stable)'s
    ranks exactly. Serial: T·K·(s_idx + 4) bytes, small beside the gather's T·K·H·s.

    Returns -1, or the first position of a negative id (refused: expert ids are >= 0), found by the pass that
    takes the ids' span, before anything is written."""
    n = ids.shape[0]
    lo = ids[0]
    hi = ids[0]
    for i in range(1, n):
        v = ids[i]
        if v < lo:
            lo = v
        elif v > hi:
            hi = v
    if lo < 0:
        for i in range(n):
            if ids[i] < 0:
                return i
    # The span in float64 first: hi - lo of arbitrary int64 ids could overflow.
    if np.float64(hi) - np.float64(lo) < 2.0 * n + 4096.0:
        span = np.int64(hi) - np.int64(lo) + 1
        starts = np.zeros(span, dtype=np.int64)
        for i in range(n):
            starts[np.int64(ids[i]) - lo] += 1
        total = np.int64(0)
        for v in range(span):
            c = starts[v]
            starts[v] = total
            total += c
        for i in range(n):
            v = np.int64(ids[i]) - lo
            inverse[i] = starts[v]
            starts[v] += 1
    else:
        first = np.argsort(ids, kind="mergesort")
        for j in range(n):
            inverse[first[j]] = j
    return -1


@njit(cache=True)
def _gather_chunk(tokens, inverse, topk, rows, out, c):  # pragma: no cover - compiled
    """Copies ``[c·_COPIES, (c+1)·_COPIES)``: ``out[inverse[i]] = tokens[i // K]`` for the kept rows (< rows), as
    raw storage (no conversion: the bits move). Each output row has exactly one writer."""
    h = tokens.shape[1]
    for i in range(c * _COPIES, min(inverse.shape[0], (c + 1) * _COPIES)):
        d = inverse[i]
        if d < rows:
            t = i // topk
            for j in range(h):
                out[d, j] = tokens[t, j]


@njit(parallel=True, cache=True)
def _gather_parallel(tokens, inverse, topk, rows, out):  # pragma: no cover - compiled
    for c in prange((inverse.shape[0] + _COPIES - 1) // _COPIES):
        _gather_chunk(tokens, inverse, topk, rows, out, c)


@njit(cache=True)
def _permute_entry(tok_at, dtype, t_count, h, idx_at, idx_dtype, total, topk, rows, out_at,
                   inv_at):  # pragma: no cover - compiled
    """MoeTokenPermute by address (see :mod:`gradops.cpu._views`): destinations, then the gather of the kept
    rows, serially below :data:`PARALLEL_MIN` copied items. Returns -1, or the first position of a negative id
    (nothing written)."""
    if total == 0:
        return -1
    inverse = view1(inv_at, np.int32, total)
    bad = _destinations(view1(idx_at, idx_dtype, total), inverse)
    if bad >= 0 or rows == 0 or h == 0:
        return bad
    tokens, out = view2(tok_at, dtype, t_count, h), view2(out_at, dtype, rows, h)
    if rows * h < PARALLEL_MIN:
        for c in range((total + _COPIES - 1) // _COPIES):
            _gather_chunk(tokens, inverse, topk, rows, out, c)
    else:
        _gather_parallel(tokens, inverse, topk, rows, out)
    return -1


@safe_entry
def moe_token_permute(tokens: Tensor, indices: Tensor, num_rows: int, *,
                      out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenPermute: ``tokens (T, H)``, expert ids ``indices (T, K)`` or ``(T,)`` -> ``(permuted (num_rows,
    H), sorted_indices (T·K,) int32)`` with ``permuted[sorted_indices[i]] = tokens[i // K]`` for the kept rows
    (sorted_indices = the ranks of the stable sort of the flattened ids, CANN's convention).

    Args:
        tokens: (T, H) float32/float16/bfloat16.
        indices: int32 / int64 ids >= 0 (a counting sort over their span, a merge sort when it is wide); a
            negative id raises OpError 161002 before anything is written.
        num_rows: the first rows of the permuted order to keep (<= T·K).
        out: optional preallocated ``(permuted, sorted_indices)``.
    """
    t_count, h = tokens.shape
    total = indices.numel()
    k = indices.shape[1] if indices.dim() == 2 else 1
    permuted = output(None if out is None else out[0], (num_rows, h), tokens.dtype)
    inverse = output(None if out is None else out[1], (total,), torch.int32)
    x, idx = dense(tokens), dense(indices)
    bad = _permute_entry(x.data_ptr(), STORAGE[x.dtype], t_count, h, idx.data_ptr(), STORAGE[idx.dtype], total, k,
                         num_rows, permuted.data_ptr(), inverse.data_ptr())
    if bad >= 0:
        raise negative_id_error(idx) or expert_id_error("a value changed again before it could be shown", -1)
    if out is None:
        return permuted, inverse
    return finish(permuted, out[0]), finish(inverse, out[1])


@safe_entry
def moe_token_permute_shaped(plan: MoePlan, tokens: Tensor, indices: Tensor, num_out_tokens: int | None,
                             padded_mode: bool = False) -> tuple[Tensor, Tensor]:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones)."""
    return moe_token_permute(tokens, indices, plan.rows)


@njit(cache=True)
def _first_not_permutation(idx):  # pragma: no cover - compiled
    """The first position whose entry lies outside ``[0, n)`` or repeats an earlier one, or -1: ``idx`` is then a
    permutation of ``[0, n)``. One serial pass with an n-byte bitmap (T·K·(s_idx + 1) bytes)."""
    n = idx.shape[0]
    seen = np.zeros(n, dtype=np.uint8)
    for i in range(n):
        v = idx[i]
        if v < 0 or v >= n or seen[v]:
            return i
        seen[v] = 1
    return -1


@njit(cache=True)
def _permute_grad_chunk(grad, sorted_indices, topk, out, c, acc, rows):  # pragma: no cover - compiled
    """Tokens ``[c·_TOKENS, (c+1)·_TOKENS)``: ``out[t] = sum_{k<K} grad[sorted_indices[t·K + k]]`` in fp32,
    strictly in k order (no fastmath: the loops vectorize over H and need no reassociation, so the bits equal the
    reference's); an index ``>= A`` (a row the forward dropped) adds nothing. Up to eight gathered rows per pass
    over the fp32 row sum ``acc``: eight independent row streams keep enough loads in flight (measured side by
    side at T=8192 K=8 H=2048 fp32: 37% of copy_ with one row per pass, 70% with eight). ``rows``: K scratch."""
    t_count, h = out.shape
    a = grad.shape[0]
    for t in range(c * _TOKENS, min(t_count, (c + 1) * _TOKENS)):
        nv = 0
        for k in range(topk):
            r = sorted_indices[t * topk + k]
            if r < a:
                rows[nv] = r
                nv += 1
        if nv == 0:
            for j in range(h):
                st(out, (t, j), np.float32(0.0))
            continue
        k = 0
        while nv - k >= 8:
            _sum8(grad, rows, k, acc, k == 0)
            k += 8
        while nv - k >= 2:
            _sum2(grad, rows, k, acc, k == 0)
            k += 2
        if k < nv:
            _sum1(grad, rows, k, acc, k == 0)
        for j in range(h):
            st(out, (t, j), acc[j])


@njit(parallel=True, cache=True)
def _permute_grad_parallel(grad, sorted_indices, topk, out):  # pragma: no cover - compiled
    h = out.shape[1]
    for c in prange((out.shape[0] + _TOKENS - 1) // _TOKENS):
        _permute_grad_chunk(grad, sorted_indices, topk, out, c, np.empty(h, dtype=np.float32),
                            np.empty(topk, dtype=np.int64))


@njit(cache=True)
def _permute_grad_run(grad, sorted_indices, topk, out):  # pragma: no cover - compiled
    """The gather-sums, serially below :data:`PARALLEL_MIN` written items."""
    t_count, h = out.shape
    if t_count * h < PARALLEL_MIN:
        acc, rows = np.empty(h, dtype=np.float32), np.empty(topk, dtype=np.int64)
        for c in range((t_count + _TOKENS - 1) // _TOKENS):
            _permute_grad_chunk(grad, sorted_indices, topk, out, c, acc, rows)
    else:
        _permute_grad_parallel(grad, sorted_indices, topk, out)


@njit(cache=True)
def _permute_grad_entry(grad_at, dtype, a, h, idx_at, idx_dtype, total, topk, out_at):  # pragma: no cover - compiled
    """MoeTokenPermuteGrad by address (see :mod:`gradops.cpu._views`): the permutation test of the T·K indices
    first (returns the first position outside [0, T·K) or repeated, nothing written), then the gather-sums; else
    -1."""
    idx = view1(idx_at, idx_dtype, total)
    bad = _first_not_permutation(idx)
    if bad >= 0:
        return bad
    tokens = total // topk
    if tokens and h:
        _permute_grad_run(view2(grad_at, dtype, a, h), idx, topk, view2(out_at, dtype, tokens, h))
    return -1


@safe_entry
def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int, *, trusted: bool = False,
                           out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenPermuteGrad: ``grad[A,H]``, checked ``sorted_indices[T·K]`` -> ``out[T,H]`` (grad's dtype).

    Args:
        grad: (A, H) float32/float16/bfloat16.
        sorted_indices: (T·K,) int32 or int64, CANN's convention, a permutation of [0, T·K): an entry outside it
            or a repeated one raises OpError 161002 before anything is read with it or written. Never trusted,
            whatever ``trusted`` says: the kernel reads rows with the entries, and its one bitmap pass
            (T·K·(s_idx + 1) bytes against the sums' T·K·H·s) is what keeps those reads in bounds.
        num_topk: K.
        out: optional preallocated (T, H).

    Returns:
        The (T, H) token gradient.
    """
    total = sorted_indices.numel()
    a, h = grad.shape
    buf = output(out, (total // num_topk, h), grad.dtype)
    grad, idx = dense(grad), dense(sorted_indices)
    bad = _permute_grad_entry(grad.data_ptr(), STORAGE[grad.dtype], a, h, idx.data_ptr(), STORAGE[idx.dtype], total,
                              num_topk, buf.data_ptr())
    if bad >= 0:
        raise permutation_error(idx, "moe_token_permute_grad") or sorted_index_error(
            "a value changed again before it could be shown", -1, total)
    return finish(buf, out)


@safe_entry
def moe_token_permute_grad_shaped(plan: MoePlan, grad: Tensor, sorted_indices: Tensor, num_topk: int,
                                  padded_mode: bool = False, *, checked: bool = False) -> Tensor:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones). The
    permutation test runs in the kernel whatever ``checked`` says (it is cheap here)."""
    return moe_token_permute_grad(grad, sorted_indices, num_topk)


@njit(cache=True)
def _wsum4(x, rows, w, k, acc, first):  # pragma: no cover - compiled
    """Add ``w[k+i] * x[rows[k+i]]`` for i < 4 to the fp32 row sum, left to right (the k order; each product
    rounded to fp32 before it is added, as the reference does)."""
    ra, rb, rc, rd = rows[k], rows[k + 1], rows[k + 2], rows[k + 3]
    wa, wb, wc, wd = w[k], w[k + 1], w[k + 2], w[k + 3]
    if first:
        for j in range(acc.shape[0]):
            acc[j] = wa * ld(x, (ra, j)) + wb * ld(x, (rb, j)) + wc * ld(x, (rc, j)) + wd * ld(x, (rd, j))
    else:
        for j in range(acc.shape[0]):
            acc[j] = acc[j] + wa * ld(x, (ra, j)) + wb * ld(x, (rb, j)) + wc * ld(x, (rc, j)) + wd * ld(x, (rd, j))


@njit(cache=True)
def _wsum1(x, rows, w, k, acc, first):  # pragma: no cover - compiled
    r, wr = rows[k], w[k]
    if first:
        for j in range(acc.shape[0]):
            acc[j] = wr * ld(x, (r, j))
    else:
        for j in range(acc.shape[0]):
            acc[j] = acc[j] + wr * ld(x, (r, j))


@njit(cache=True)
def _unpermute_chunk(x, sorted_indices, probs, out, c, acc, rows, w):  # pragma: no cover - compiled
    """Tokens ``[c·_TOKENS, (c+1)·_TOKENS)``: ``out[t] = sum_{k<K} probs[t, k] * x[sorted_indices[t·K + k]]`` in
    fp32, strictly in k order (no fastmath: no reassociation, no FMA, so the bits equal the reference's); an index
    ``>= A`` (a dropped row) adds nothing. Four weighted rows per pass over the fp32 row sum (four row streams in
    flight; see :func:`_permute_grad_chunk`). ``acc``, ``rows``, ``w``: scratch."""
    t_count, h = out.shape
    topk = probs.shape[1]
    a = x.shape[0]
    for t in range(c * _TOKENS, min(t_count, (c + 1) * _TOKENS)):
        nv = 0
        for k in range(topk):
            r = sorted_indices[t * topk + k]
            if 0 <= r < a:
                rows[nv] = r
                w[nv] = ld(probs, (t, k))
                nv += 1
        if nv == 0:
            for j in range(h):
                st(out, (t, j), np.float32(0.0))
            continue
        k = 0
        while nv - k >= 4:
            _wsum4(x, rows, w, k, acc, k == 0)
            k += 4
        while k < nv:
            _wsum1(x, rows, w, k, acc, k == 0)
            k += 1
        for j in range(h):
            st(out, (t, j), acc[j])


@njit(parallel=True, cache=True)
def _unpermute_parallel(x, sorted_indices, probs, out):  # pragma: no cover - compiled
    h, topk = out.shape[1], probs.shape[1]
    for c in prange((out.shape[0] + _TOKENS - 1) // _TOKENS):
        _unpermute_chunk(x, sorted_indices, probs, out, c, np.empty(h, dtype=np.float32),
                         np.empty(topk, dtype=np.int64), np.empty(topk, dtype=np.float32))


@njit(cache=True)
def _unpermute_entry(x_at, dtype, a, h, idx_at, idx_dtype, total, probs_at, probs_dtype, topk,
                     out_at):  # pragma: no cover - compiled
    """MoeTokenUnpermute by address: the permutation test first (returns the first position outside [0, T·K) or
    repeated, nothing written), then the weighted gather-sums (``topk`` 0: no probs, K = 1, weight 1); else -1."""
    idx = view1(idx_at, idx_dtype, total)
    bad = _first_not_permutation(idx)
    if bad >= 0:
        return bad
    k = max(topk, 1)
    tokens = total // k
    if tokens == 0 or h == 0:
        return -1
    x, out = view2(x_at, dtype, a, h), view2(out_at, dtype, tokens, h)
    if topk == 0:  # weight 1: exactly the permute gradient's gather with K = 1
        _permute_grad_run(x, idx, 1, out)
        return -1
    probs = view2(probs_at, probs_dtype, tokens, topk)
    if tokens * h < PARALLEL_MIN:
        acc, rows, w = np.empty(h, dtype=np.float32), np.empty(topk, dtype=np.int64), np.empty(topk, np.float32)
        for c in range((tokens + _TOKENS - 1) // _TOKENS):
            _unpermute_chunk(x, idx, probs, out, c, acc, rows, w)
    else:
        _unpermute_parallel(x, idx, probs, out)
    return -1


#: Lanes of the fp32 dot products of the unpermute gradient: 16 running sums (lane l adds the products of
#: columns l, l + 16, ...), then folded pairwise. A fixed order (same bits on every run and thread count) that
#: vectorizes without fastmath: each step adds two 16-wide vectors, not a reassociated reduction.
_LANES = 16


@njit(cache=True)
def _dot_row(g, t, x, r, prod, lanes):  # pragma: no cover - compiled
    """``sum_j g[t, j] * x[r, j]`` in fp32 in the fixed lane order of :data:`_LANES` (``prod``, ``lanes``: scratch)."""
    h = prod.shape[0]
    for j in range(h):
        prod[j] = ld(g, (t, j)) * ld(x, (r, j))
    for q in range(_LANES):
        lanes[q] = np.float32(0.0)
    full = h - h % _LANES
    for j0 in range(0, full, _LANES):
        for q in range(_LANES):
            lanes[q] += prod[j0 + q]
    for j in range(full, h):
        lanes[j - full] += prod[j]
    step = _LANES // 2
    while step:
        for q in range(step):
            lanes[q] += lanes[q + step]
        step //= 2
    return lanes[0]


@njit(cache=True)
def _unpermute_grad_chunk(x, g, sorted_indices, probs, has_probs, dx, dp, c, prod, lanes):  # pragma: no cover
    """Tokens ``[c·_TOKENS, (c+1)·_TOKENS)``; for each copy k of token t whose row ``r = sorted_indices[t·K + k]``
    is present (``0 <= r < A``)::

        dx[r] = g[t] * probs[t, k]         (fp32 product, rounded once; g[t] itself without probs)
        dp[t, k] = dot(g[t], x[r])         (fp32, fixed lane order; 0 for a dropped row)

    sorted_indices is a checked permutation, so every row of dx has exactly one writer (no atomics, no
    zero-fill, no race between the parallel token chunks). ``prod``, ``lanes``: scratch."""
    t_count, h = g.shape
    topk = probs.shape[1] if has_probs else 1
    a = x.shape[0]
    for t in range(c * _TOKENS, min(t_count, (c + 1) * _TOKENS)):
        for k in range(topk):
            r = sorted_indices[t * topk + k]
            present = 0 <= r < a
            if has_probs:
                w = ld(probs, (t, k))
                if present:
                    for j in range(h):
                        st(dx, (r, j), ld(g, (t, j)) * w)
                    st(dp, (t, k), _dot_row(g, t, x, r, prod, lanes))
                else:
                    st(dp, (t, k), np.float32(0.0))
            elif present:
                for j in range(h):
                    st(dx, (r, j), ld(g, (t, j)))


@njit(parallel=True, cache=True)
def _unpermute_grad_parallel(x, g, sorted_indices, probs, has_probs, dx, dp):  # pragma: no cover - compiled
    h = g.shape[1]
    for c in prange((g.shape[0] + _TOKENS - 1) // _TOKENS):
        _unpermute_grad_chunk(x, g, sorted_indices, probs, has_probs, dx, dp, c, np.empty(h, dtype=np.float32),
                              np.empty(_LANES, dtype=np.float32))


@njit(cache=True)
def _unpermute_grad_entry(x_at, dtype, a, h, g_at, g_dtype, tokens, idx_at, idx_dtype, total, probs_at,
                          probs_dtype, topk, dx_at, dp_at, check):  # pragma: no cover - compiled
    """MoeTokenUnpermuteGrad by address: with ``check``, the permutation test first (returns the first bad
    position, nothing written); then the scatter and the probs' dot products (``topk`` 0: no probs); else -1."""
    idx = view1(idx_at, idx_dtype, total)
    if check:
        bad = _first_not_permutation(idx)
        if bad >= 0:
            return bad
    if tokens == 0:
        return -1
    has_probs = topk > 0
    k = max(topk, 1)
    x, g, dx = view2(x_at, dtype, a, h), view2(g_at, g_dtype, tokens, h), view2(dx_at, dtype, a, h)
    rows_p = tokens if has_probs else 0  # without probs: empty views (never read or written)
    probs, dp = view2(probs_at, probs_dtype, rows_p, k), view2(dp_at, probs_dtype, rows_p, k)
    if tokens * h * k < PARALLEL_MIN:
        prod, lanes = np.empty(h, dtype=np.float32), np.empty(_LANES, dtype=np.float32)
        for c in range((tokens + _TOKENS - 1) // _TOKENS):
            _unpermute_grad_chunk(x, g, idx, probs, has_probs, dx, dp, c, prod, lanes)
    else:
        _unpermute_grad_parallel(x, g, idx, probs, has_probs, dx, dp)
    return -1


@safe_entry
def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None, *,
                        out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenUnpermute: ``(A, H)`` rows, ``sorted_indices (T·K,)``, ``probs (T, K)`` or None (K = 1)
    -> ``out (T, H)`` in permuted_tokens' dtype.

    sorted_indices must be a permutation of [0, T·K) (CANN: no repeated index), checked in the kernel in one
    bitmap pass before anything is read with it (OpError 161002).
    """
    a, h = permuted_tokens.shape
    total = sorted_indices.numel()
    topk = 0 if probs is None else probs.shape[1]
    buf = output(out, (total // max(topk, 1), h), permuted_tokens.dtype)
    x, idx = dense(permuted_tokens), dense(sorted_indices)
    weights = x if probs is None else dense(probs)  # without probs: unread, a float dtype for the compiled code
    bad = _unpermute_entry(x.data_ptr(), STORAGE[x.dtype], a, h, idx.data_ptr(), STORAGE[idx.dtype], total,
                           weights.data_ptr(), STORAGE[weights.dtype], topk, buf.data_ptr())
    if bad >= 0:
        raise permutation_error(sorted_indices, "moe_token_unpermute")
    return finish(buf, out)


@safe_entry
def moe_token_unpermute_shaped(plan: MoePlan, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                               padded_mode: bool = False) -> Tensor:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones)."""
    return moe_token_unpermute(permuted_tokens, sorted_indices, probs)


@safe_entry
def moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                             probs: Tensor | None, *, trusted: bool = False,
                             out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteGrad -> ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, K) in
    probs' dtype)``; without probs the second is an empty tensor of permuted_tokens' dtype.

    sorted_indices: a permutation of [0, T·K), so that every row of grad_permuted is written once; checked here
    unless ``trusted`` (autograd's backward of this package's own forward, which checked it and whose saved copy
    autograd's version counter guards); an entry outside [0, A) is never read or written with either way.
    ``out``: optional preallocated pair (the second ignored without probs).
    """
    a, h = permuted_tokens.shape
    tokens, total = grad_unpermuted.shape[0], sorted_indices.numel()
    topk = 0 if probs is None else probs.shape[1]
    dx = output(None if out is None else out[0], (a, h), permuted_tokens.dtype)
    if probs is None:
        dp = permuted_tokens.new_empty(0)
    else:
        dp = output(None if out is None else out[1], (tokens, topk), probs.dtype)
    x, g, idx = dense(permuted_tokens), dense(grad_unpermuted), dense(sorted_indices)
    weights = x if probs is None else dense(probs)  # without probs: viewed with 0 rows, a float dtype
    bad = _unpermute_grad_entry(x.data_ptr(), STORAGE[x.dtype], a, h, g.data_ptr(), STORAGE[g.dtype], tokens,
                                idx.data_ptr(), STORAGE[idx.dtype], total, weights.data_ptr(), STORAGE[weights.dtype],
                                topk, dx.data_ptr(), (dp if probs is not None else weights).data_ptr(), not trusted)
    if bad >= 0:
        raise permutation_error(sorted_indices, "moe_token_unpermute_grad")
    if out is None:
        return dx, dp
    return finish(dx, out[0]), (finish(dp, out[1]) if probs is not None else dp)


@safe_entry
def moe_token_unpermute_grad_shaped(plan: MoePlan, permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                    sorted_indices: Tensor, probs: Tensor | None, padded_mode: bool = False, *,
                                    trusted: bool = False) -> tuple[Tensor, Tensor]:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones)."""
    return moe_token_unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs, trusted=trusted)
