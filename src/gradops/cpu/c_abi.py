"""The compiled kernels as C functions, for gradops.native's autograd nodes (src/gradops/native/autograd.cpp).

Each entry is a numba cfunc around the serial piece of an op's kernel (a span of items, a range of rows or row
blocks: the functions the Python path's loops run), tensors by address (:mod:`gradops.cpu._views`) with the storage
dtypes fixed. The C++ nodes split the pieces over torch's own threads, so they compute the same bits as the Python
path. The signatures here are the function-pointer
types in autograd.cpp; change both together. Compiled on first use per dtype combination, cached on disk
(:func:`gradops.cpu._host.c_function`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import types

from ._host import c_function
from ._reduce import fold_partials
from ._views import F32, STORAGE, view1, view2
from .embedding import _ROWS, _counting_sort, _first_outside, _gather_block, _sparse_segments
from .hardswish import _hardswish_backward_chunk, _hardswish_chunk
from .layer_norm import _backward_block, _layer_norm_row

_I64 = types.int64


@functools.cache
def hardswish(dtype: torch.dtype) -> tuple[int, int]:
    """The addresses of Hardswish's forward and backward for ``dtype`` (float32 / float16 / bfloat16):
    ``forward(x, y, n)`` (ElementwiseFn) and ``backward(g, x, out, n)`` (ElementwiseGradFn), each tensor by
    address, contiguous. Serial: the node splits the items over torch's own threads (see autograd.cpp)."""
    storage = STORAGE[dtype]

    def forward(x_at, y_at, n):  # pragma: no cover - compiled
        _hardswish_chunk(view1(x_at, storage, n), view1(y_at, storage, n))

    def backward(g_at, x_at, out_at, n):  # pragma: no cover - compiled
        _hardswish_backward_chunk(view1(g_at, storage, n), view1(x_at, storage, n), view1(out_at, storage, n))

    return (c_function(types.void(_I64, _I64, _I64), forward).address,
            c_function(types.void(_I64, _I64, _I64, _I64), backward).address)


@functools.cache
def layer_norm(dtype: torch.dtype, gamma_dtype: torch.dtype, beta_dtype: torch.dtype) -> tuple[int, int, int]:
    """The addresses of the LayerNorm kernels for x / gamma / beta of these dtypes (contiguous tensors by address,
    statistics float32 (M,)), each serial: the node splits the work over torch's own threads (see autograd.cpp).

    - ``forward(x, gamma, beta, eps, y, mean, var, m, n)`` (LayerNormFn): the ``m`` rows at these addresses.
    - ``backward(dy, x, mean, rstd, gamma, dx, pg, pb, m, n, blocks, b0, b1)`` (LayerNormBlocksFn): row blocks
      ``b0 <= b < b1`` of the fused backward, of ``blocks`` fixed blocks over the m rows (see
      :func:`~gradops.cpu._host.row_blocks`): dx of the block's rows, its dgamma / dbeta partials in rows b of the
      float32 ``pg`` / ``pb`` (blocks x n). No statistic is checked (rstd comes from the node's own forward).
    - ``fold(pg, pb, dgamma, dbeta, blocks, n)`` (FoldFn): the partials summed in the fixed order of
      :func:`~gradops.cpu._reduce.fold_partials` into float32 dgamma / dbeta.

    The blocks and the fold are the Python path's (:func:`gradops.cpu.layer_norm.layer_norm_backward`), so the
    results are the same bits whichever thread runs which block."""
    x_s, g_s, b_s = STORAGE[dtype], STORAGE[gamma_dtype], STORAGE[beta_dtype]

    def forward(x_at, gamma_at, beta_at, eps, y_at, mean_at, var_at, m, n):  # pragma: no cover - compiled
        x, y = view2(x_at, x_s, m, n), view2(y_at, x_s, m, n)
        gamma, beta = view1(gamma_at, g_s, n), view1(beta_at, b_s, n)
        mean, var = view1(mean_at, F32, m), view1(var_at, F32, m)
        eps32 = np.float32(eps)
        for r in range(m):
            _layer_norm_row(x, gamma, beta, eps32, y, mean, var, r)

    def backward(dy_at, x_at, mean_at, rstd_at, gamma_at, dx_at, pg_at, pb_at, m, n, blocks, b0, b1
                 ):  # pragma: no cover - compiled
        dy, x, dx = view2(dy_at, x_s, m, n), view2(x_at, x_s, m, n), view2(dx_at, x_s, m, n)
        mean, rstd, gamma = view1(mean_at, F32, m), view1(rstd_at, F32, m), view1(gamma_at, g_s, n)
        pg, pb = view2(pg_at, F32, blocks, n), view2(pb_at, F32, blocks, n)
        for b in range(b0, b1):
            _backward_block(dy, x, mean, rstd, gamma, dx, pg, pb, b)

    def fold(pg_at, pb_at, dgamma_at, dbeta_at, blocks, n):  # pragma: no cover - compiled
        fold_partials(view2(pg_at, F32, blocks, n), view1(dgamma_at, F32, n))
        fold_partials(view2(pb_at, F32, blocks, n), view1(dbeta_at, F32, n))

    return (c_function(types.void(_I64, _I64, _I64, types.float64, _I64, _I64, _I64, _I64, _I64), forward).address,
            c_function(types.void(*([_I64] * 13)), backward).address,
            c_function(types.void(*([_I64] * 6)), fold).address)


@functools.cache
def embedding(dtype: torch.dtype, index_dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """The addresses of the embedding backward's pieces for a gradient / table of ``dtype`` (float32 / float16 /
    bfloat16) and indices of ``index_dtype`` (int32 / int64), tensors contiguous by address: the Python path's
    :func:`gradops.cpu.embedding.embedding_dense_backward` taken apart, so that the node runs the table's blocks on
    torch's threads. Each returns -1, or the first position whose index lies outside ``[0, v)`` (then the table is
    not what the op returns, and the node hands the call to the op, which raises its OpError).

    - ``check(idx, n, v)`` (CheckFn): the range test alone (the forward's, before ATen's row gather).
    - ``sort(idx, n, v, offsets, order)`` (SortFn): the counting sort (int64 ``offsets`` (v + 1), ``order`` (n)),
      for n >= v.
    - ``blocks(grad, offsets, order, padding, scale, out, n, e, v, c0, c1)`` (BlocksFn): table row blocks
      ``c0 <= c < c1`` of ``ceil(v / ROWS)`` from the sort (returns -1).
    - ``sparse_order(idx, n, v, order)`` (CheckFn's test, then the positions sorted by index into int64 ``order``
      (n), stably) and ``sparse_rows(grad, idx, order, padding, scale, out, n, e, v, p0, p1)`` (SegmentsFn, returns
      -1): for n < v, the touched rows of a table the node zeroed - each run of equal indices whose first sorted
      position lies in ``[p0, p1)``."""
    storage, index_storage = STORAGE[dtype], STORAGE[index_dtype]
    i64 = np.dtype(np.int64)

    def check(idx_at, n, v):  # pragma: no cover - compiled
        return _first_outside(view1(idx_at, index_storage, n), v)

    def sort(idx_at, n, v, offsets_at, order_at):  # pragma: no cover - compiled
        return _counting_sort(view1(idx_at, index_storage, n), v, view1(offsets_at, i64, v + 1),
                              view1(order_at, i64, n))

    def blocks(grad_at, offsets_at, order_at, padding, scale, out_at, n, e, v, c0, c1):  # pragma: no cover
        grad, out = view2(grad_at, storage, n, e), view2(out_at, storage, v, e)
        offsets, order = view1(offsets_at, i64, v + 1), view1(order_at, i64, n)
        acc = np.empty(e, dtype=np.float32)
        for c in range(c0, c1):
            _gather_block(grad, offsets, order, padding, scale != 0, out, c, acc)
        return -1

    def sparse_order(idx_at, n, v, order_at):  # pragma: no cover - compiled
        idx = view1(idx_at, index_storage, n)
        bad = _first_outside(idx, v)
        if bad < 0:
            view1(order_at, i64, n)[:] = np.argsort(idx, kind="mergesort")
        return bad

    def sparse_rows(grad_at, idx_at, order_at, padding, scale, out_at, n, e, v, p0, p1):  # pragma: no cover
        _sparse_segments(view2(grad_at, storage, n, e), view1(idx_at, index_storage, n), view1(order_at, i64, n),
                         padding, scale != 0, view2(out_at, storage, v, e), p0, p1, np.empty(e, dtype=np.float32))
        return -1

    return (c_function(_I64(_I64, _I64, _I64), check).address,
            c_function(_I64(_I64, _I64, _I64, _I64, _I64), sort).address,
            c_function(_I64(*([_I64] * 11)), blocks).address,
            c_function(_I64(_I64, _I64, _I64, _I64), sparse_order).address,
            c_function(_I64(*([_I64] * 11)), sparse_rows).address)


#: Table rows per block of :func:`embedding`'s ``blocks`` (the Python path's parallel task).
EMBEDDING_ROWS = _ROWS
