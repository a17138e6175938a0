"""aclnnEmbeddingDenseBackward as numba kernels: counting sort of the indices, then one pass over the table.

Each output row is written exactly once - the sum of its gradient rows in index order (fp32), or zeros - so the
zero-fill is fused into the scatter and no atomics are needed: deterministic, bitwise equal whatever the thread
count. Byte model: ``T·E·s_g + V·E·s_out + T·8`` (indices) + ``(V + T)·8`` (the sort, cache/L2 sized at V <= 256k).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange
from torch import Tensor

from ..contract.embedding import index_error
from ._host import as_array, finish, output, safe_entry, scratch
from ._numeric import ld, st

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


@njit(parallel=True, cache=True)
def _gather_rows(grad, offsets, order, padding_idx, scale, out):  # pragma: no cover - compiled
    """``out[k] = sum_{i in order[offsets[k]:offsets[k+1]]} grad[i] (/ count[k] per term if scale)`` in fp32,
    strictly in increasing i (no fastmath: the loops vectorize over E and need no reassociation, so the order is
    the one written here); zero for untouched rows and for ``padding_idx``. Four gradient rows per pass over the
    fp32 row sum."""
    v, e = out.shape
    for c in prange((v + _ROWS - 1) // _ROWS):
        acc = np.empty(e, dtype=np.float32)
        for k in range(c * _ROWS, min(v, (c + 1) * _ROWS)):
            lo = offsets[k]
            hi = offsets[k + 1]
            if hi == lo or k == padding_idx:
                for j in range(e):
                    st(out, (k, j), np.float32(0.0))
                continue
            cnt = np.float32(hi - lo)
            i0 = order[lo]
            if hi - lo == 1:  # the common case at T < V: write the row straight through, no fp32 row sum
                for j in range(e):
                    st(out, (k, j), _term(grad, i0, j, scale, cnt))
                continue
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


def embedding_dense_backward_workspace(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int,
                                       scale_grad_by_freq: bool) -> int:
    """Bytes of the counting sort's scratch: ``(V + 1)`` int64 offsets and ``T`` int64 positions."""
    return (num_weights + 1 + idx.numel()) * 8


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
    n, e = grad.shape
    table = output(out, (num_weights, e), grad.dtype)
    nbytes = embedding_dense_backward_workspace(grad, idx, num_weights, padding_idx, scale_grad_by_freq)
    offsets = scratch(workspace, nbytes, 0, np.int64, num_weights + 1)
    order = scratch(workspace, nbytes, (num_weights + 1) * 8, np.int64, n)
    flat = as_array(idx.long())
    bad = _counting_sort(flat, num_weights, offsets, order)
    if bad >= 0:
        raise index_error(int(flat[bad]), int(bad), num_weights)
    if num_weights and e:
        pad = padding_idx if 0 <= padding_idx < num_weights else -1
        _gather_rows(as_array(grad), offsets, order, pad, bool(scale_grad_by_freq), as_array(table))
    return finish(table, out)
