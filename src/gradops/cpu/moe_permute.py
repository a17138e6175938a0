"""aclnnMoeTokenPermuteGrad and the unpermute pair as numba kernels: gather-sums of each token's K rows and the
scatter of their gradients (no zero-fill, no atomics: each output row has one writer).

Byte models: permute grad and unpermute ``T·K·H·s_in + T·H·s_out + T·K·s_idx`` (+ ``T·K·s_p`` for probs);
unpermute grad ``T·H·s_g + A·H·(s_x + s_dx) + T·K·(s_idx + s_p + s_dp)`` (the gradient row of a token is read
once per pass over its K copies, from cache).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from torch import Tensor

from ..contract.moe_permute import permutation_error, sorted_index_error
from ._host import as_array, finish, output, safe_entry
from ._numeric import ld, st

#: Tokens per parallel task (fixed, so the work split never depends on the thread count).
_TOKENS = 16


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
def _first_outside(idx, total):  # pragma: no cover - compiled
    """The first position whose entry lies outside ``[0, total)``, or -1: one serial pass over T·K indices
    (T·K·4 bytes against the kernel's T·K·H·s), before the kernel reads a row with any of them."""
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= total:
            return i
    return -1


@njit(parallel=True, cache=True)
def _permute_grad_kernel(grad, sorted_indices, topk, out):  # pragma: no cover - compiled
    """``out[t] = sum_{k<K} grad[sorted_indices[t·K + k]]`` in fp32, strictly in k order (no fastmath: the
    loops vectorize over H and need no reassociation, so the bits equal the reference's); an index ``>= A``
    (a row the forward dropped) adds nothing. Up to eight gathered rows per pass over the fp32 row sum: eight
    independent row streams keep enough loads in flight (measured side by side at T=8192 K=8 H=2048 fp32: 37% of
    copy_ with one row per pass, 70% with eight)."""
    t_count, h = out.shape
    a = grad.shape[0]
    for c in prange((t_count + _TOKENS - 1) // _TOKENS):
        acc = np.empty(h, dtype=np.float32)
        rows = np.empty(topk, dtype=np.int64)
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


@safe_entry
def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int, *,
                           out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenPermuteGrad: ``grad[A,H]``, range-checked ``sorted_indices[T·K]`` -> ``out[T,H]`` (grad's dtype).

    Args:
        grad: (A, H) float32/float16/bfloat16.
        sorted_indices: (T·K,) int32 or int64, CANN's convention; an entry outside [0, T·K) raises OpError 161002
            before anything is read with it or written (never trusted, even when the caller checked it).
        num_topk: K.
        out: optional preallocated (T, H).

    Returns:
        The (T, H) token gradient.
    """
    tokens = sorted_indices.numel() // num_topk
    h = grad.shape[1]
    idx = as_array(sorted_indices)
    bad = _first_outside(idx, idx.shape[0])
    if bad >= 0:
        raise sorted_index_error(int(idx[bad]), int(bad), idx.shape[0])
    buf = output(out, (tokens, h), grad.dtype)
    if tokens and h:
        _permute_grad_kernel(as_array(grad), idx, num_topk, as_array(buf))
    return finish(buf, out)


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


@njit(parallel=True, cache=True)
def _unpermute_kernel(x, sorted_indices, probs, out):  # pragma: no cover - compiled
    """``out[t] = sum_{k<K} probs[t, k] * x[sorted_indices[t·K + k]]`` in fp32, strictly in k order (no fastmath:
    no reassociation, no FMA, so the bits equal the reference's); an index ``>= A`` (a dropped row) adds nothing.
    Four weighted rows per pass over the fp32 row sum (four row streams in flight; see _permute_grad_kernel)."""
    t_count, h = out.shape
    topk = probs.shape[1]
    a = x.shape[0]
    for c in prange((t_count + _TOKENS - 1) // _TOKENS):
        acc = np.empty(h, dtype=np.float32)
        rows = np.empty(topk, dtype=np.int64)
        w = np.empty(topk, dtype=np.float32)
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


@njit(parallel=True, cache=True)
def _unpermute_grad_kernel(x, g, sorted_indices, probs, has_probs, dx, dp):  # pragma: no cover - compiled
    """For each (token t, copy k) whose row ``r = sorted_indices[t·K + k]`` is present (``0 <= r < A``)::

        dx[r] = g[t] * probs[t, k]         (fp32 product, rounded once; g[t] itself without probs)
        dp[t, k] = dot(g[t], x[r])         (fp32, fixed lane order; 0 for a dropped row)

    sorted_indices is a checked permutation, so every row of dx has exactly one writer (no atomics, no
    zero-fill, no race between the parallel token chunks)."""
    t_count, h = g.shape
    topk = probs.shape[1] if has_probs else 1
    a = x.shape[0]
    for c in prange((t_count + _TOKENS - 1) // _TOKENS):
        prod = np.empty(h, dtype=np.float32)
        lanes = np.empty(_LANES, dtype=np.float32)
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


def _check_permutation(idx: np.ndarray, sorted_indices: Tensor, op: str) -> None:
    if _first_not_permutation(idx) >= 0:
        raise permutation_error(sorted_indices, op)


@safe_entry
def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None, *,
                        out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenUnpermute: ``(A, H)`` rows, ``sorted_indices (T·K,)``, ``probs (T, K)`` or None (K = 1)
    -> ``out (T, H)`` in permuted_tokens' dtype.

    sorted_indices must be a permutation of [0, T·K) (CANN: no repeated index), checked here in one bitmap pass
    before anything is read with it (OpError 161002).
    """
    h = permuted_tokens.shape[1]
    idx = as_array(sorted_indices)
    _check_permutation(idx, sorted_indices, "moe_token_unpermute")
    k = 1 if probs is None else probs.shape[1]
    tokens = idx.shape[0] // k
    buf = output(out, (tokens, h), permuted_tokens.dtype)
    if tokens and h:
        if probs is None:  # weight 1: exactly the permute gradient's gather with K = 1
            _permute_grad_kernel(as_array(permuted_tokens), idx, 1, as_array(buf))
        else:
            _unpermute_kernel(as_array(permuted_tokens), idx, as_array(probs), as_array(buf))
    return finish(buf, out)


_NO_PROBS = np.zeros((1, 1), dtype=np.float32)


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
    rows, h = permuted_tokens.shape
    idx = as_array(sorted_indices)
    if not trusted:
        _check_permutation(idx, sorted_indices, "moe_token_unpermute_grad")
    tokens = grad_unpermuted.shape[0]
    dx = output(None if out is None else out[0], (rows, h), permuted_tokens.dtype)
    if probs is None:
        dp = permuted_tokens.new_empty(0)
    else:
        dp = output(None if out is None else out[1], (tokens, probs.shape[1]), probs.dtype)
    if tokens:
        _unpermute_grad_kernel(as_array(permuted_tokens), as_array(grad_unpermuted), idx,
                               _NO_PROBS if probs is None else as_array(probs), probs is not None,
                               as_array(dx), as_array(dp) if probs is not None else _NO_PROBS)
    if out is None:
        return dx, dp
    return finish(dx, out[0]), (finish(dp, out[1]) if probs is not None else dp)
