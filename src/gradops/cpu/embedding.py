"""aclnnEmbeddingDenseBackward as numba kernels: counting sort of the indices, then one pass over the table.

Each output row is written exactly once - the sum of its gradient rows in index order (fp32), or zeros - so the
zero-fill is fused into the scatter and no atomics are needed: deterministic, bitwise equal whatever the thread
count. Byte model: ``T·E·s_g + V·E·s_out + T·8`` (indices) + ``(V + T)·8`` (the sort, cache/L2 sized at V <= 256k).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from ..contract.embedding import checked_indices, index_error
from . import _pool
from ._host import PARALLEL_MIN, dense, finish, output, safe_entry, scratch
from ._numeric import ld, st
from ._views import STORAGE, view1, view2

#: Table rows per parallel task: 64 rows x 1024 x 4 B = 256 KiB written per task.
_ROWS = 64


@njit(cache=True)
def _counting_sort(idx, num_weights, offsets, order):  # pragma: no cover - compiled
    """``offsets[k]..offsets[k+1]`` delimit the positions i with ``idx[i] == k`` in ``order``, in increasing i
    (stable). Serial O(T + V): at T = 16k, V = 256k it is ~1% of the table write.

    The counting pass is also the range test: it returns the first position whose index lies outside
    ``[0, num_weights)`` (before using it to address anything), or -1. No index is trusted, not even one the
    caller checked: indices saved for a backward can change in place without autograd seeing it (numpy, .data)."""
    for k in range(num_weights + 1):
        offsets[k] = 0
    for i in range(idx.shape[0]):
        k = idx[i]
        if k < 0 or k >= num_weights:
            return i
        offsets[k + 1] += 1
    for k in range(num_weights):
        offsets[k + 1] += offsets[k]
    fill = offsets[:num_weights].copy()
    for i in range(idx.shape[0]):
        k = idx[i]
        order[fill[k]] = i
        fill[k] += 1
    return -1


@njit(cache=True)
def _term(grad, i, j, scale, cnt):  # pragma: no cover - compiled
    v = ld(grad, (i, j))
    return v / cnt if scale else v


@njit(cache=True)
def _write_row(grad, order, lo, hi, scale, out, k, acc):  # pragma: no cover - compiled
    """``out[k] = sum_{i in order[lo:hi]} grad[i] (/ (hi - lo) per term if scale)`` in fp32, strictly in the order
    of ``order`` (increasing i; no fastmath: the loops vectorize over E and need no reassociation, so the order is
    the one written here); four gradient rows per pass over the fp32 row sum ``acc`` (E items of scratch)."""
    e = out.shape[1]
    cnt = np.float32(hi - lo)
    i0 = order[lo]
    if hi - lo == 1:  # the common case at T < V: write the row straight through, no fp32 row sum
        for j in range(e):
            st(out, (k, j), _term(grad, i0, j, scale, cnt))
        return
    for j in range(e):
        acc[j] = _term(grad, i0, j, scale, cnt)
    p = lo + 1
    while p + 4 <= hi:
        ia, ib, ic, id_ = order[p], order[p + 1], order[p + 2], order[p + 3]
        for j in range(e):  # left to right: the index order
            acc[j] = (acc[j] + _term(grad, ia, j, scale, cnt) + _term(grad, ib, j, scale, cnt)
                      + _term(grad, ic, j, scale, cnt) + _term(grad, id_, j, scale, cnt))
        p += 4
    while p < hi:
        ip = order[p]
        for j in range(e):
            acc[j] = acc[j] + _term(grad, ip, j, scale, cnt)
        p += 1
    for j in range(e):
        st(out, (k, j), acc[j])


@njit(cache=True)
def _gather_block(grad, offsets, order, padding_idx, scale, out, c, acc):  # pragma: no cover - compiled
    """Table rows ``[c·_ROWS, (c+1)·_ROWS)`` from the counting sort: each row its gradient rows' sum
    (:func:`_write_row`), zero for untouched rows and for ``padding_idx``."""
    v, e = out.shape
    for k in range(c * _ROWS, min(v, (c + 1) * _ROWS)):
        lo = offsets[k]
        hi = offsets[k + 1]
        if hi == lo or k == padding_idx:
            for j in range(e):
                st(out, (k, j), np.float32(0.0))
        else:
            _write_row(grad, order, lo, hi, scale, out, k, acc)


@njit(parallel=True, cache=True)
def _gather_parallel(grad, offsets, order, padding_idx, scale, out):  # pragma: no cover - compiled
    e = out.shape[1]
    for c in prange((out.shape[0] + _ROWS - 1) // _ROWS):
        _gather_block(grad, offsets, order, padding_idx, scale, out, c, np.empty(e, dtype=np.float32))


#: Items per parallel task of the table's zero fill (256 KiB of fp32).
_ZERO_CHUNK = 1 << 16


@njit(parallel=True, cache=True)
def _zero_parallel(flat):  # pragma: no cover - compiled
    n = flat.shape[0]
    for c in prange((n + _ZERO_CHUNK - 1) // _ZERO_CHUNK):
        flat[c * _ZERO_CHUNK:min(n, (c + 1) * _ZERO_CHUNK)] = 0


@njit(cache=True)
def _first_outside(idx, num_weights):  # pragma: no cover - compiled
    """The first position whose index lies outside ``[0, num_weights)``, or -1."""
    for i in range(idx.shape[0]):
        if idx[i] < 0 or idx[i] >= num_weights:
            return i
    return -1


@njit(cache=True)
def _lookup_rows(weight, idx, out, lo, hi):  # pragma: no cover - compiled
    """The lookup ``out[i] = weight[idx[i]]`` for positions ``[lo, hi)``: a copy of storage items (16-bit floats
    as their bits), so the bits of ATen's ``index_select``. The indices passed :func:`_first_outside` first."""
    e = out.shape[1]
    for i in range(lo, hi):
        k = idx[i]
        for j in range(e):
            out[i, j] = weight[k, j]


@njit(cache=True)
def _sparse(grad, idx, num_weights, padding_idx, scale, out):  # pragma: no cover - compiled
    """The backward for few indices in a large table (T < V): the T positions sorted by index (a stable sort, so
    each row's gradient rows stay in increasing i: the counting sort's order, the same bits), the table zeroed,
    then only the touched rows written. O(T log T + V·E) with no pass over V offsets, and T·8 bytes of scratch
    instead of (V + T)·8 (T = 8, V = 32000, E = 8 fp32 on 2 cores: 181 µs per call with the counting
    sort, 81 this way, ATen's embedding_dense_backward 58-69; the 1 MiB zero fill is most of it)."""
    v, e = out.shape
    flat = out.reshape(v * e)  # zero bits are 0.0 in every storage dtype: one flat fill, vectorised
    if v * e < PARALLEL_MIN:
        flat[:] = 0
    else:
        _zero_parallel(flat)
    _sparse_rows(grad, idx, padding_idx, scale, out)


@njit(cache=True)
def _sparse_rows(grad, idx, padding_idx, scale, out):  # pragma: no cover - compiled
    """:func:`_sparse` after the zero fill: the touched rows, each the sum of its gradient rows in increasing i."""
    order = np.argsort(idx, kind="mergesort")
    _sparse_segments(grad, idx, order, padding_idx, scale, out, 0, idx.shape[0],
                     np.empty(out.shape[1], dtype=np.float32))


@njit(cache=True)
def _sparse_segments(grad, idx, order, padding_idx, scale, out, p0, p1, acc):  # pragma: no cover - compiled
    """The rows whose run of equal indices in ``order`` (sorted positions) starts at a position in ``[p0, p1)``: a
    run belongs to the piece holding its first position, so pieces write disjoint rows, each summed as a whole."""
    n = idx.shape[0]
    lo = p0
    while 0 < lo < n and idx[order[lo]] == idx[order[lo - 1]]:  # the rest of a run that started before p0
        lo += 1
    while lo < p1:
        k = idx[order[lo]]
        hi = lo + 1
        while hi < n and idx[order[hi]] == k:
            hi += 1
        if k != padding_idx:
            _write_row(grad, order, lo, hi, scale, out, k, acc)
        lo = hi


@njit(cache=True)
def _embedding_entry(grad_at, dtype, idx_at, idx_dtype, n, e, num_weights, padding_idx, scale, out_at, offsets,
                     order):  # pragma: no cover - compiled
    """The backward by address (see :mod:`gradops.cpu._views`); returns the first position whose index lies
    outside the table (nothing written), else -1. Few indices in a large table (T < V): :func:`_sparse`; else the
    counting sort (also the range test), then the table, serially below :data:`PARALLEL_MIN` written items."""
    idx = view1(idx_at, idx_dtype, n)
    if n < num_weights:
        bad = _first_outside(idx, num_weights)
        if bad >= 0 or e == 0:
            return bad
        _sparse(view2(grad_at, dtype, n, e), idx, num_weights, padding_idx, scale,
                view2(out_at, dtype, num_weights, e))
        return -1
    bad = _counting_sort(idx, num_weights, offsets, order)
    if bad >= 0 or num_weights == 0 or e == 0:
        return bad
    grad, out = view2(grad_at, dtype, n, e), view2(out_at, dtype, num_weights, e)
    if num_weights * e < PARALLEL_MIN:
        acc = np.empty(e, dtype=np.float32)
        for c in range((num_weights + _ROWS - 1) // _ROWS):
            _gather_block(grad, offsets, order, padding_idx, scale, out, c, acc)
    else:
        _gather_parallel(grad, offsets, order, padding_idx, scale, out)
    return -1


def embedding_dense_backward_workspace(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int,
                                       scale_grad_by_freq: bool) -> int:
    """Bytes of the counting sort's scratch: ``(V + 1)`` int64 offsets and ``T`` int64 positions."""
    return (num_weights + 1 + idx.numel()) * 8


def _run(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool, table: Tensor,
         workspace: Tensor | None) -> None:
    """The backward of (N, E) ``grad`` (any shape with N·E items) and N int32 / int64 ``idx`` into the
    contiguous ``table``; an index outside the table raises before anything is written."""
    n, e = idx.numel(), grad.shape[-1]
    if n < num_weights:  # the sorting path: no counting-sort scratch (it sorts into memory of its own, T·8 bytes)
        offsets = order = _NO_SCRATCH
    else:
        nbytes = (num_weights + 1 + n) * 8
        offsets = scratch(workspace, nbytes, 0, np.int64, num_weights + 1)
        order = scratch(workspace, nbytes, (num_weights + 1) * 8, np.int64, n)
    grad, idx = dense(grad), dense(idx)
    pad = padding_idx if 0 <= padding_idx < num_weights else -1
    bad = _embedding_entry(grad.data_ptr(), STORAGE[grad.dtype], idx.data_ptr(), STORAGE[idx.dtype], n, e,
                           num_weights, pad, bool(scale_grad_by_freq), table.data_ptr(), offsets, order)
    if bad >= 0:
        raise index_error(idx.reshape(-1)[bad].item(), bad, num_weights)


@safe_entry
def embedding_dense_backward(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool, *, out: Tensor | None = None,
                             workspace: Tensor | None = None) -> Tensor:
    """aclnnEmbeddingDenseBackward on ``grad[N,E]`` and checked int64 ``idx[N]``: ``out[V,E]`` in grad's dtype.

    Args:
        grad: (N, E) float32/float16/bfloat16.
        idx: (N,) int64; any value outside [0, num_weights) raises OpError 161002 before anything is written.
        num_weights: V. padding_idx: a row left at zero (any value outside [0, V) means none).
        scale_grad_by_freq: divide every term by its row's count (all occurrences, padding included).
        out: optional preallocated (V, E) output. workspace: optional uint8 scratch (see the ``_workspace`` hook).

    Returns:
        The (V, E) gradient table.
    """
    table = output(out, (num_weights, grad.shape[1]), grad.dtype)
    _run(grad, idx.long(), num_weights, padding_idx, scale_grad_by_freq, table, workspace)
    return finish(table, out)


@safe_entry
def embedding_dense_backward_shaped(plan: tuple[int, int], grad: Tensor, indices: Tensor, num_weights: int,
                                    padding_idx: int, scale_grad_by_freq: bool, *, checked: bool = False) -> Tensor:
    """The op on its own shapes (see :mod:`gradops.ops._plan`): grad (..., E), indices of the leading dims. int32
    and int64 indices are read as they are (the counting sort is the range test, so ``checked``, "tested
    already", saves nothing here); other dtypes get CANN's conversion and range test first
    (:func:`gradops.contract.embedding.checked_indices`)."""
    if indices.dtype not in _DIRECT_INDICES:
        indices = checked_indices(indices, num_weights)
    table = _pool.empty((num_weights, plan[1]), grad.dtype)
    _run(grad, indices, num_weights, padding_idx, scale_grad_by_freq, table, None)
    return table


_DIRECT_INDICES = (torch.int64, torch.int32)
_NO_SCRATCH = np.empty(0, dtype=np.int64)
