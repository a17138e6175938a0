"""The compiled kernels as C functions, for gradops.native's autograd nodes (src/gradops/native/autograd.cpp).

Each entry is a numba cfunc around an op's by-address entry (:mod:`gradops.cpu._views`) with the storage dtypes
fixed, so the C++ nodes call the very kernels the Python path runs. The signatures here are the function-pointer
types in autograd.cpp; change both together. Compiled on first use per dtype combination, cached on disk
(:func:`gradops.cpu._host.c_function`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from numba import types

from ._host import ROW_BLOCKS, c_function
from ._views import STORAGE
from .hardswish import _hardswish_backward_entry, _hardswish_entry
from .layer_norm import _backward_entry, _layer_norm_entry

_I64 = types.int64


@functools.cache
def hardswish(dtype: torch.dtype) -> tuple[int, int]:
    """The addresses of Hardswish's forward and backward for ``dtype`` (float32 / float16 / bfloat16):
    ``forward(x, y, n)`` (ElementwiseFn) and ``backward(g, x, out, n)`` (ElementwiseGradFn), each tensor by
    address, contiguous."""
    storage = STORAGE[dtype]

    def forward(x_at, y_at, n):  # pragma: no cover - compiled
        _hardswish_entry(x_at, y_at, storage, n)

    def backward(g_at, x_at, out_at, n):  # pragma: no cover - compiled
        _hardswish_backward_entry(g_at, x_at, out_at, storage, n)

    return (c_function(types.void(_I64, _I64, _I64), forward).address,
            c_function(types.void(_I64, _I64, _I64, _I64), backward).address)


@functools.cache
def layer_norm(dtype: torch.dtype, gamma_dtype: torch.dtype, beta_dtype: torch.dtype) -> tuple[int, int]:
    """The addresses of the LayerNorm forward and the fused backward for x / gamma / beta of these dtypes
    (contiguous tensors by address, statistics float32 (M,)): ``forward(x, gamma, beta, eps, y, mean, var, m, n)``
    (LayerNormFn), ``backward(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, m, n)`` (LayerNormGradFn). The backward
    allocates its dgamma / dbeta partials as :func:`gradops.cpu.layer_norm.layer_norm_backward` does
    (:func:`~gradops.cpu._host.row_blocks` rows each, written here in numba: the same count, so the same fixed
    summation order and bits) and checks no statistic (rstd comes from the node's own forward)."""
    x_s, g_s, b_s = STORAGE[dtype], STORAGE[gamma_dtype], STORAGE[beta_dtype]

    def forward(x_at, gamma_at, beta_at, eps, y_at, mean_at, var_at, m, n):  # pragma: no cover - compiled
        _layer_norm_entry(x_at, x_s, gamma_at, g_s, beta_at, b_s, eps, y_at, mean_at, var_at, m, n)

    def backward(dy_at, x_at, mean_at, rstd_at, gamma_at, dx_at, dgamma_at, dbeta_at, m, n):  # pragma: no cover
        nblk = max(1, min(ROW_BLOCKS, m))
        pg = np.empty(nblk * n, dtype=np.float32).reshape(nblk, n)
        pb = np.empty(nblk * n, dtype=np.float32).reshape(nblk, n)
        _backward_entry(dy_at, x_at, x_s, mean_at, rstd_at, gamma_at, g_s, dx_at, pg, pb, dgamma_at, dbeta_at, m, n,
                        False)

    return (c_function(types.void(_I64, _I64, _I64, types.float64, _I64, _I64, _I64, _I64, _I64), forward).address,
            c_function(types.void(*([_I64] * 10)), backward).address)
