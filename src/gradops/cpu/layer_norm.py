"""LayerNorm forward, AscendC LayerNormGrad / LayerNormGradBeta and the fused backward as numba kernels.

LayerNormGrad follows AscendC's formula term by term, including the ``sum(x - mean)`` term (see
:mod:`gradops.reference.layer_norm`). Byte models: grad ``M·N·(s_dy + s_x + 2·s_x) + 8M + N·s_g`` (pdx and
res_for_gamma written); grad_beta ``2·M·N·s + 2·N·s``; fused backward ``M·N·(s_dy + s_x + s_dx) + 8M + N·(s_g + 8)``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from ..contract.layer_norm import LayerNormPlan, statistic_error
from . import _pool
from ._host import PARALLEL_MIN, TASK_ITEMS, dense, finish, output, row_blocks, safe_entry, scratch
from ._numeric import FASTMATH, fma32, ld, st
from ._reduce import fold_partials
from ._views import F32, STORAGE, view1, view2

#: Squares per float32 partial sum of the forward's variance (see _layer_norm_row_range).
_VAR_BLOCK = 128


@njit(cache=True, fastmath=FASTMATH)
def _layer_norm_row_range(x, gamma, beta, eps, y, mean, var, lo, hi):  # pragma: no cover - compiled
    """``mean = sum(x)/N``, ``var = sum((x-mean)^2)/N`` (biased, two passes), ``y = (x-mean)·rsqrt(var+eps)·gamma
    + beta`` for rows lo..hi-1. The loop over rows is here, not in the callers: the same body called once per row
    took 57 µs at 512 x 256 fp32 on one thread, against 34 with the loop inside - ~45 ns a
    row, that numba's ``inline="always"`` did not win back either (45 µs)."""
    n = x.shape[1]
    for r in range(lo, hi):
        t = np.float32(0.0)
        for j in range(n):
            t += ld(x, (r, j))
        mu = t * (np.float32(1.0) / np.float32(n))
        # The variance is an output in its own right (LayerNormGrad's input), so its error must not grow with N or
        # depend on the vector width numba picks: float32 partial sums of _VAR_BLOCK squares each (a loop of fixed
        # trip count over a zero-based slice, vectorized at full float32 width), added in float64. Measured (AVX-512,
        # max relative error over the rows against float64, 512 x N; time of mean + variance, one thread,
        # 512 x 256): one float32 sum 1.3-2.9e-7 (2.9 at N = 520 and 1000, where the remainder loop adds the tail;
        # 2.4e-7 at 520 on AVX2), every term in float64 0.6-0.8e-7 at 19.1 µs, these blocks 0.7-1.5e-7 at 11.7 µs
        # (PyTorch's: 1.3e-7). The mean's float32 sum stays within PyTorch's error.
        blocks = n // _VAR_BLOCK
        q = np.float64(0.0)
        for b in range(blocks):
            block = x[r, b * _VAR_BLOCK:]
            p = np.float32(0.0)
            for k in range(_VAR_BLOCK):
                d = ld(block, k) - mu
                p += d * d
            q += np.float64(p)
        tail = x[r, blocks * _VAR_BLOCK:]
        p = np.float32(0.0)
        for k in range(n - blocks * _VAR_BLOCK):
            d = ld(tail, k) - mu
            p += d * d
        v = np.float32((q + np.float64(p)) * (1.0 / n))
        mean[r] = mu
        var[r] = v
        s = np.float32(1.0) / np.sqrt(v + eps)
        for j in range(n):
            st(y, (r, j), (ld(x, (r, j)) - mu) * s * ld(gamma, j) + ld(beta, j))


@njit(parallel=True, cache=True)
def _layer_norm_parallel(x, gamma, beta, eps, y, mean, var):  # pragma: no cover - compiled
    m = x.shape[0]
    per = max(1, TASK_ITEMS // x.shape[1])
    for c in prange((m + per - 1) // per):
        _layer_norm_row_range(x, gamma, beta, eps, y, mean, var, c * per, min(m, c * per + per))


@njit(cache=True)
def _layer_norm_entry(x_at, dtype, gamma_at, gamma_dtype, beta_at, beta_dtype, eps, y_at, mean_at, var_at, m,
                      n):  # pragma: no cover - compiled
    """The forward by address (see :mod:`gradops.cpu._views`), one row per iteration (serial below
    :data:`PARALLEL_MIN` items). Bytes: ``M·N·2s + 8M + N·(s_g + s_b)``."""
    x, y = view2(x_at, dtype, m, n), view2(y_at, dtype, m, n)
    gamma, beta = view1(gamma_at, gamma_dtype, n), view1(beta_at, beta_dtype, n)
    mean, var = view1(mean_at, F32, m), view1(var_at, F32, m)
    eps = np.float32(eps)
    if m * n < PARALLEL_MIN:
        _layer_norm_row_range(x, gamma, beta, eps, y, mean, var, 0, m)
    else:
        _layer_norm_parallel(x, gamma, beta, eps, y, mean, var)


@njit(cache=True)
def _first_below(values, floor):  # pragma: no cover - compiled
    """The first row whose statistic has ``values + floor < 0`` (float64, as the host check), or -1; NaN passes."""
    for r in range(values.shape[0]):
        if np.float64(values[r]) + floor < 0.0:
            return r
    return -1


@njit(fastmath=FASTMATH, cache=True)
def _row_terms(dy, x, gamma, r, mu, s, inv_n):  # pragma: no cover - compiled
    """AscendC's per-row constants, with ``xmu = x - mean`` and ``pd_xl = dy·gamma``::

        pd_var  = sum(-0.5·pd_xl·xmu)·rstd^3
        pd_mean = sum(-pd_xl)·rstd + pd_var·sum(-2·xmu)/N
    returns ``(pd_var·2/N, pd_mean/N)`` so that ``pd_x = pd_xl·rstd + a·xmu + b``."""
    n = x.shape[1]
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    for j in range(n):
        xmu = ld(x, (r, j)) - mu
        pd_xl = ld(dy, (r, j)) * ld(gamma, j)
        s1 += np.float32(-0.5) * pd_xl * xmu
        s2 -= pd_xl
        s3 += np.float32(-2.0) * xmu
    pd_var = s1 * s * s * s
    pd_mean = s2 * s + pd_var * s3 * inv_n
    return pd_var * np.float32(2.0) * inv_n, pd_mean * inv_n


@njit(fastmath=FASTMATH, cache=True)
def _layer_norm_grad_row_range(dy, x, var, mean, gamma, eps, pdx, res, lo, hi):  # pragma: no cover - compiled
    """AscendC LayerNormGrad of rows lo..hi-1 (rstd = (var + eps)^-0.5): ``pd_x = dy·gamma·rstd + a·(x-mean) + b``
    with a, b from :func:`_row_terms`, ``res_for_gamma = (x-mean)·rstd``."""
    n = x.shape[1]
    for r in range(lo, hi):
        mu = mean[r]
        s = np.float32(1.0) / np.sqrt(var[r] + eps)
        a, b = _row_terms(dy, x, gamma, r, mu, s, np.float32(1.0) / np.float32(n))
        for j in range(n):
            xmu = ld(x, (r, j)) - mu
            st(pdx, (r, j), ld(dy, (r, j)) * ld(gamma, j) * s + a * xmu + b)
            st(res, (r, j), xmu * s)


@njit(parallel=True, cache=True)
def _layer_norm_grad_parallel(dy, x, var, mean, gamma, eps, pdx, res):  # pragma: no cover - compiled
    m = x.shape[0]
    per = max(1, TASK_ITEMS // x.shape[1])
    for c in prange((m + per - 1) // per):
        _layer_norm_grad_row_range(dy, x, var, mean, gamma, eps, pdx, res, c * per, min(m, c * per + per))


@njit(cache=True)
def _layer_norm_grad_entry(dy_at, x_at, dtype, var_at, mean_at, gamma_at, gamma_dtype, eps, pdx_at, res_at, m, n,
                           check):  # pragma: no cover - compiled
    """LayerNormGrad by address; with ``check``, first the row of a variance below -epsilon (nothing computed),
    else -1. Bytes: ``M·N·(s_dy + 3·s_x) + 8M + N·s_g``."""
    var, mean = view1(var_at, F32, m), view1(mean_at, F32, m)
    if check:
        bad = _first_below(var, eps)
        if bad >= 0:
            return bad
    dy, x = view2(dy_at, dtype, m, n), view2(x_at, dtype, m, n)
    pdx, res = view2(pdx_at, dtype, m, n), view2(res_at, dtype, m, n)
    gamma = view1(gamma_at, gamma_dtype, n)
    eps32 = np.float32(eps)
    if m * n < PARALLEL_MIN:
        _layer_norm_grad_row_range(dy, x, var, mean, gamma, eps32, pdx, res, 0, m)
    else:
        _layer_norm_grad_parallel(dy, x, var, mean, gamma, eps32, pdx, res)
    return -1


@njit(cache=True, fastmath=FASTMATH)
def _grad_beta_block(res, dy, pg, pb, b):  # pragma: no cover - compiled
    """Row block b: ``pg[b,j] = sum_r dy·res``, ``pb[b,j] = sum_r dy`` in fp32, four rows per partial update
    (79% -> 98% of copy_ at 8192 x 4096 fp32)."""
    m, n = dy.shape
    nblk = pg.shape[0]
    per = (m + nblk - 1) // nblk
    ag = pg[b]
    ab = pb[b]
    for j in range(n):
        ag[j] = np.float32(0.0)
        ab[j] = np.float32(0.0)
    r = b * per
    end = min(m, r + per)
    while r + 4 <= end:
        for j in range(n):
            g0, g1, g2, g3 = ld(dy, (r, j)), ld(dy, (r + 1, j)), ld(dy, (r + 2, j)), ld(dy, (r + 3, j))
            ag[j] += (g0 * ld(res, (r, j)) + g1 * ld(res, (r + 1, j)) + g2 * ld(res, (r + 2, j))
                      + g3 * ld(res, (r + 3, j)))
            ab[j] += g0 + g1 + g2 + g3
        r += 4
    while r < end:
        for j in range(n):
            g = ld(dy, (r, j))
            ag[j] += g * ld(res, (r, j))
            ab[j] += g
        r += 1


@njit(parallel=True, cache=True)
def _grad_beta_parallel(res, dy, pg, pb):  # pragma: no cover - compiled
    for b in prange(pg.shape[0]):
        _grad_beta_block(res, dy, pg, pb, b)


@njit(cache=True)
def _grad_beta_entry(res_at, dy_at, dtype, pg, pb, gamma_at, beta_at, m, n):  # pragma: no cover - compiled
    """LayerNormGradBeta by address: the fixed row blocks, then their partials folded in block order. Bytes:
    ``2·M·N·s`` (+ the partials, cache resident)."""
    res, dy = view2(res_at, dtype, m, n), view2(dy_at, dtype, m, n)
    if m * n < PARALLEL_MIN:
        for b in range(pg.shape[0]):
            _grad_beta_block(res, dy, pg, pb, b)
    else:
        _grad_beta_parallel(res, dy, pg, pb)
    fold_partials(pg, view1(gamma_at, dtype, n))
    fold_partials(pb, view1(beta_at, dtype, n))


@njit(fastmath=FASTMATH, inline="always")
def _backward_rows(dy, x, mean, rstd, gamma, dx, pg, pb, b):  # pragma: no cover - compiled
    """Row block b of the fused backward (rstd given), per row aclnnLayerNormBackward's (ATen
    ``native_layer_norm_backward``'s) constants - :func:`_row_terms` without AscendC's ``sum(x - mean)`` term::

        a = -sum(pd_xl·xmu)·rstd^3/N,  c = -sum(pd_xl)·rstd/N,  pd_x = pd_xl·rstd + a·xmu + c

    (``xmu = x - mean``, ``pd_xl = dy·gamma``), and ``pg[b] += dy·xmu·rstd``, ``pb[b] += dy`` in fp32.

    One row at a time with the row's two sums written out here: a function for the sums called per row, four rows
    per partial update, took 62-65 µs at 512 x 256 fp32 (one thread) against 46-47 this way,
    550-780 against 330-390 at 2048 x 512, and the same at 8192 x 4096 (35-36 ms). (Four rows with the sums inlined
    were 39-41 µs against 46-48 compiled alone, but 41 against 39 inside the native node's piece.)

    Inlined into its two callers, so that :func:`_backward_block_into`, which passes one array as dy and dx, is
    compiled knowing they are the same memory: LLVM then vectorizes the loop that reads an element and writes it
    back, where two arrays it cannot tell apart leave it the scalar fallback when they overlap (123 µs)."""
    m, n = x.shape
    nblk = pg.shape[0]
    per = (m + nblk - 1) // nblk
    inv_n = np.float32(1.0) / np.float32(n)
    ag = pg[b]
    ab = pb[b]
    for j in range(n):
        ag[j] = np.float32(0.0)
        ab[j] = np.float32(0.0)
    for r in range(b * per, min(m, b * per + per)):
        mu = mean[r]
        s = rstd[r]
        s1 = np.float32(0.0)
        s2 = np.float32(0.0)
        for j in range(n):
            pd_xl = ld(dy, (r, j)) * ld(gamma, j)
            s1 += pd_xl * (ld(x, (r, j)) - mu)
            s2 += pd_xl
        a = -s1 * s * s * s * inv_n
        c = -s2 * s * inv_n
        for j in range(n):
            xmu = ld(x, (r, j)) - mu
            g = ld(dy, (r, j))
            st(dx, (r, j), g * ld(gamma, j) * s + a * xmu + c)
            ag[j] = fma32(g, xmu * s, ag[j])  # one rounding per row, as ATen's vectorized fmadd
            ab[j] += g


@njit(cache=True, fastmath=FASTMATH)
def _backward_block(dy, x, mean, rstd, gamma, dx, pg, pb, b):  # pragma: no cover - compiled
    """Row block b of the fused backward into dx (see :func:`_backward_rows`)."""
    _backward_rows(dy, x, mean, rstd, gamma, dx, pg, pb, b)


@njit(cache=True, fastmath=FASTMATH)
def _backward_block_into(g, x, mean, rstd, gamma, pg, pb, b):  # pragma: no cover - compiled
    """Row block b of the fused backward with dx written over g, the incoming gradient (each element is read, by
    both loops of its row, before it is written): the bits of :func:`_backward_block`."""
    _backward_rows(g, x, mean, rstd, gamma, g, pg, pb, b)


@njit(parallel=True, cache=True)
def _backward_parallel(dy, x, mean, rstd, gamma, dx, pg, pb):  # pragma: no cover - compiled
    for b in prange(pg.shape[0]):
        _backward_block(dy, x, mean, rstd, gamma, dx, pg, pb, b)


@njit(cache=True)
def _backward_entry(dy_at, x_at, dtype, mean_at, rstd_at, gamma_at, gamma_dtype, dx_at, pg, pb, dgamma_at, dbeta_at,
                    m, n, check):  # pragma: no cover - compiled
    """LayerNormGrad + LayerNormGradBeta in one pass over dy and x, by address; with ``check``, first the row of a
    negative rstd (nothing computed) or -1. Bytes: ``M·N·(s_dy + s_x + s_dx) + 8M + N·s_g``."""
    mean, rstd = view1(mean_at, F32, m), view1(rstd_at, F32, m)
    if check:
        bad = _first_below(rstd, 0.0)
        if bad >= 0:
            return bad
    dy, x, dx = view2(dy_at, dtype, m, n), view2(x_at, dtype, m, n), view2(dx_at, dtype, m, n)
    gamma = view1(gamma_at, gamma_dtype, n)
    if m * n < PARALLEL_MIN:
        for b in range(pg.shape[0]):
            _backward_block(dy, x, mean, rstd, gamma, dx, pg, pb, b)
    else:
        _backward_parallel(dy, x, mean, rstd, gamma, dx, pg, pb)
    fold_partials(pg, view1(dgamma_at, F32, n))
    fold_partials(pb, view1(dbeta_at, F32, n))
    return -1


def _outs(out, i):
    return out[i] if out else None


def _layer_norm_run(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, y: Tensor, mean: Tensor, var: Tensor,
                    m: int, n: int) -> None:
    if m and n:
        x, gamma, beta = dense(x), dense(gamma), dense(beta)
        _layer_norm_entry(x.data_ptr(), STORAGE[x.dtype], gamma.data_ptr(), STORAGE[gamma.dtype], beta.data_ptr(),
                          STORAGE[beta.dtype], float(epsilon), y.data_ptr(), mean.data_ptr(), var.data_ptr(), m, n)
    else:
        mean.zero_()
        var.zero_()


@safe_entry
def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, *,
               out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(y[M,N] x.dtype, mean[M] fp32, variance[M] fp32)`` of the 2-D view x."""
    m, n = x.shape
    y = output(_outs(out, 0), (m, n), x.dtype)
    mean = output(_outs(out, 1), (m,), torch.float32)
    var = output(_outs(out, 2), (m,), torch.float32)
    _layer_norm_run(x, gamma, beta, epsilon, y, mean, var, m, n)
    return finish(y, _outs(out, 0)), finish(mean, _outs(out, 1)), finish(var, _outs(out, 2))


@safe_entry
def layer_norm_shaped(plan: LayerNormPlan, x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """The op on x of any shape (see :mod:`gradops.ops._plan`): y of x's shape, mean and variance float32 of
    ``x.shape[:-1]``."""
    x = dense(x)
    stat = x.shape[:-1]
    y, mean, var = _pool.empty_like(x), _pool.empty(stat, torch.float32), _pool.empty(stat, torch.float32)
    _layer_norm_run(x, gamma, beta, epsilon, y, mean, var, plan.rows, plan.cols)
    return y, mean, var


def _layer_norm_grad_run(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float,
                         pdx: Tensor, res: Tensor, m: int, n: int, check: bool) -> None:
    """LayerNormGrad into contiguous pdx, res; with ``check``, a variance below -epsilon raises the contract's
    OpError (161002) before anything is written (the kernel finds it)."""
    if not m:
        return
    variance, mean, dy, x, gamma = dense(variance.float()), dense(mean.float()), dense(dy), dense(x), dense(gamma)
    if n:
        bad = _layer_norm_grad_entry(dy.data_ptr(), x.data_ptr(), STORAGE[x.dtype], variance.data_ptr(),
                                     mean.data_ptr(), gamma.data_ptr(), STORAGE[gamma.dtype], float(epsilon),
                                     pdx.data_ptr(), res.data_ptr(), m, n, check)
    else:
        bad = _first_below(variance.numpy().reshape(-1), float(epsilon)) if check else -1  # (M,) or (M, 1)
    if bad >= 0:
        raise statistic_error("layer_norm_grad", "variance", variance, float(epsilon))


@safe_entry
def layer_norm_grad(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float, *,
                    out: tuple[Tensor, Tensor] | None = None, check_statistics: bool = False
                    ) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGrad on the 2-D views: ``(pdx, res_for_gamma)``, both in x's dtype. A variance below
    -epsilon gives NaN rows as in AscendC, or with ``check_statistics`` raises the contract's OpError (161002)
    before anything is written."""
    m, n = x.shape
    pdx = output(_outs(out, 0), (m, n), x.dtype)
    res = output(_outs(out, 1), (m, n), x.dtype)
    _layer_norm_grad_run(dy, x, variance, mean, gamma, epsilon, pdx, res, m, n, check_statistics)
    return finish(pdx, _outs(out, 0)), finish(res, _outs(out, 1))


@safe_entry
def layer_norm_grad_shaped(plan: LayerNormPlan, dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor,
                           gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """The op on its own shapes (see :func:`layer_norm_shaped`): pdx and res_for_gamma of x's shape; the
    variance checked (as the public function promises)."""
    x = dense(x)
    pdx, res = _pool.empty_like(x), _pool.empty_like(x)
    _layer_norm_grad_run(dy, x, variance, mean, gamma, epsilon, pdx, res, plan.rows, plan.cols, True)
    return pdx, res


def layer_norm_grad_beta_workspace(res_for_gamma: Tensor, dy: Tensor) -> int:
    """Bytes of the fp32 gamma and beta partials (one row each per row block)."""
    return 2 * row_blocks(*dy.shape) * dy.shape[1] * 4


def _grad_beta_run(res_for_gamma: Tensor, dy: Tensor, pd_gamma: Tensor, pd_beta: Tensor, m: int, n: int,
                   workspace: Tensor | None) -> None:
    if not n:
        return
    nblk = row_blocks(m, n)
    size = nblk * n * 4
    pg = scratch(workspace, 2 * size, 0, np.float32, nblk * n).reshape(nblk, n)
    pb = scratch(workspace, 2 * size, size, np.float32, nblk * n).reshape(nblk, n)
    res_for_gamma, dy = dense(res_for_gamma), dense(dy)
    _grad_beta_entry(res_for_gamma.data_ptr(), dy.data_ptr(), STORAGE[dy.dtype], pg, pb, pd_gamma.data_ptr(),
                     pd_beta.data_ptr(), m, n)


@safe_entry
def layer_norm_grad_beta(res_for_gamma: Tensor, dy: Tensor, *, out: tuple[Tensor, Tensor] | None = None,
                         workspace: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGradBeta: ``(pd_gamma[N], pd_beta[N])`` in the inputs' dtype, fp32 sums in fixed order."""
    m, n = dy.shape
    pd_gamma = output(_outs(out, 0), (n,), dy.dtype)
    pd_beta = output(_outs(out, 1), (n,), dy.dtype)
    _grad_beta_run(res_for_gamma, dy, pd_gamma, pd_beta, m, n, workspace)
    return finish(pd_gamma, _outs(out, 0)), finish(pd_beta, _outs(out, 1))


@safe_entry
def layer_norm_grad_beta_shaped(plan: LayerNormPlan, res_for_gamma: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    """The op on its own shapes: pd_gamma and pd_beta of ``dy.shape[-1:]`` in dy's dtype."""
    n = plan.cols
    pd_gamma, pd_beta = _pool.empty((n,), dy.dtype), _pool.empty((n,), dy.dtype)
    _grad_beta_run(res_for_gamma, dy, pd_gamma, pd_beta, plan.rows, n, None)
    return pd_gamma, pd_beta


def layer_norm_backward_workspace(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor) -> int:
    """Bytes of the fp32 dgamma and dbeta partials."""
    return 2 * row_blocks(*x.shape) * x.shape[1] * 4


def _backward_run(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, dx: Tensor, dgamma: Tensor,
                  dbeta: Tensor, m: int, n: int, workspace: Tensor | None, check: bool) -> None:
    """The fused backward into contiguous dx, dgamma, dbeta; with ``check``, a negative rstd raises the
    contract's OpError (161002) before anything is written (the kernel finds it)."""
    mean, rstd = dense(mean.float()), dense(rstd.float())
    if m == 0 or n == 0:
        # rstd as the contract takes it: (M,), the keepdim (M, 1), or 0-d for a 1-D x; the kernel reads it flat.
        if check and m and _first_below(rstd.numpy().reshape(-1), 0.0) >= 0:
            raise statistic_error("layer_norm_backward", "rstd", rstd, 0.0)
        dgamma.zero_()
        dbeta.zero_()
        return
    nblk = row_blocks(m, n)
    size = nblk * n * 4
    pg = scratch(workspace, 2 * size, 0, np.float32, nblk * n).reshape(nblk, n)
    pb = scratch(workspace, 2 * size, size, np.float32, nblk * n).reshape(nblk, n)
    dy, x, gamma = dense(dy), dense(x), dense(gamma)
    bad = _backward_entry(dy.data_ptr(), x.data_ptr(), STORAGE[x.dtype], mean.data_ptr(), rstd.data_ptr(),
                          gamma.data_ptr(), STORAGE[gamma.dtype], dx.data_ptr(), pg, pb, dgamma.data_ptr(),
                          dbeta.data_ptr(), m, n, check)
    if bad >= 0:
        raise statistic_error("layer_norm_backward", "rstd", rstd, 0.0)


@safe_entry
def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                        out: tuple[Tensor, Tensor, Tensor] | None = None, workspace: Tensor | None = None,
                        check_statistics: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Fused LayerNorm backward on the 2-D views: ``(dx x.dtype, dgamma fp32, dbeta fp32)``, one pass over dy, x.
    With ``check_statistics`` a negative rstd raises the contract's OpError (161002) before anything is written."""
    m, n = x.shape
    dx = output(_outs(out, 0), (m, n), x.dtype)
    dgamma = output(_outs(out, 1), (n,), torch.float32)
    dbeta = output(_outs(out, 2), (n,), torch.float32)
    _backward_run(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, m, n, workspace, check_statistics)
    return finish(dx, _outs(out, 0)), finish(dgamma, _outs(out, 1)), finish(dbeta, _outs(out, 2))


@safe_entry
def layer_norm_backward_shaped(plan: LayerNormPlan, dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor,
                               gamma: Tensor, *, check_statistics: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The op on its own shapes: dx of x's shape, dgamma and dbeta float32 of gamma's; rstd checked unless it comes
    from this package's own forward (``check_statistics=False``: ``(variance + eps)^-0.5`` is never negative)."""
    x = dense(x)
    dx, dgamma, dbeta = (_pool.empty_like(x), _pool.empty(gamma.shape, torch.float32),
                         _pool.empty(gamma.shape, torch.float32))
    _backward_run(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, plan.rows, plan.cols, None, check_statistics)
    return dx, dgamma, dbeta
