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

from ._host import as_array, finish, output, row_blocks, safe_entry, scratch
from ._numeric import FASTMATH, ld, st
from ._reduce import fold_partials


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _layer_norm_kernel(x, gamma, beta, eps, y, mean, var):  # pragma: no cover - compiled
    """``mean = sum(x)/N``, ``var = sum((x-mean)^2)/N`` (biased, two passes), ``y = (x-mean)·rsqrt(var+eps)·gamma
    + beta``; one row per iteration. Bytes: ``M·N·2s + 8M + N·(s_g + s_b)``."""
    m, n = x.shape
    inv_n = np.float32(1.0) / np.float32(n)
    inv_n64 = 1.0 / n
    for r in prange(m):
        # The variance sums in float64: it is an output in its own right, and a float32 sum's error depends on
        # the vector width numba picks (measured at 64 x 520: 2.4e-7 relative on AVX2 against PyTorch's 1.3e-7;
        # 0.5e-7 this way). The mean's float32 sum stays within PyTorch's error.
        t = np.float32(0.0)
        for j in range(n):
            t += ld(x, (r, j))
        mu = t * inv_n
        q = np.float64(0.0)
        for j in range(n):
            d = np.float64(ld(x, (r, j)) - mu)
            q += d * d
        v = np.float32(q * inv_n64)
        mean[r] = mu
        var[r] = v
        s = np.float32(1.0) / np.sqrt(v + eps)
        for j in range(n):
            st(y, (r, j), (ld(x, (r, j)) - mu) * s * ld(gamma, j) + ld(beta, j))


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


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _layer_norm_grad_kernel(dy, x, var, mean, gamma, eps, pdx, res):  # pragma: no cover - compiled
    """AscendC LayerNormGrad per row (rstd = (var + eps)^-0.5): ``pd_x = dy·gamma·rstd + a·(x-mean) + b`` with
    a, b from :func:`_row_terms`, ``res_for_gamma = (x-mean)·rstd``. Bytes: ``M·N·(s_dy + 3·s_x) + 8M + N·s_g``."""
    m, n = x.shape
    inv_n = np.float32(1.0) / np.float32(n)
    for r in prange(m):
        mu = mean[r]
        s = np.float32(1.0) / np.sqrt(var[r] + eps)
        a, b = _row_terms(dy, x, gamma, r, mu, s, inv_n)
        for j in range(n):
            xmu = ld(x, (r, j)) - mu
            st(pdx, (r, j), ld(dy, (r, j)) * ld(gamma, j) * s + a * xmu + b)
            st(res, (r, j), xmu * s)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _grad_beta_kernel(res, dy, pg, pb, pd_gamma, pd_beta):  # pragma: no cover - compiled
    """Fixed row blocks b: ``pg[b,j] = sum_r dy·res``, ``pb[b,j] = sum_r dy`` in fp32, four rows per partial
    update (79% -> 98% of copy_ at 8192 x 4096 fp32). Bytes: ``2·M·N·s`` (+ the partials, cache resident)."""
    m, n = dy.shape
    nblk = pg.shape[0]
    per = (m + nblk - 1) // nblk
    for b in prange(nblk):
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
    fold_partials(pg, pd_gamma)
    fold_partials(pb, pd_beta)


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _layer_norm_backward_kernel(dy, x, mean, rstd, gamma, dx, pg, pb, dgamma, dbeta):  # pragma: no cover - compiled
    """LayerNormGrad + LayerNormGradBeta in one pass over dy and x: per row pd_x as in
    :func:`_layer_norm_grad_kernel` (rstd given), and per fixed row block ``pg += dy·(x-mean)·rstd``,
    ``pb += dy`` in fp32, four rows per partial update. Bytes: ``M·N·(s_dy + s_x + s_dx) + 8M + N·s_g``."""
    m, n = x.shape
    nblk = pg.shape[0]
    per = (m + nblk - 1) // nblk
    inv_n = np.float32(1.0) / np.float32(n)
    for b in prange(nblk):
        ag = pg[b]
        ab = pb[b]
        for j in range(n):
            ag[j] = np.float32(0.0)
            ab[j] = np.float32(0.0)
        r = b * per
        end = min(m, r + per)
        while r + 4 <= end:
            u0, s0, u1, s1 = mean[r], rstd[r], mean[r + 1], rstd[r + 1]
            u2, s2, u3, s3 = mean[r + 2], rstd[r + 2], mean[r + 3], rstd[r + 3]
            a0, c0 = _row_terms(dy, x, gamma, r, u0, s0, inv_n)
            a1, c1 = _row_terms(dy, x, gamma, r + 1, u1, s1, inv_n)
            a2, c2 = _row_terms(dy, x, gamma, r + 2, u2, s2, inv_n)
            a3, c3 = _row_terms(dy, x, gamma, r + 3, u3, s3, inv_n)
            for j in range(n):
                gj = ld(gamma, j)
                x0, d0 = ld(x, (r, j)) - u0, ld(dy, (r, j))
                x1, d1 = ld(x, (r + 1, j)) - u1, ld(dy, (r + 1, j))
                x2, d2 = ld(x, (r + 2, j)) - u2, ld(dy, (r + 2, j))
                x3, d3 = ld(x, (r + 3, j)) - u3, ld(dy, (r + 3, j))
                st(dx, (r, j), d0 * gj * s0 + a0 * x0 + c0)
                st(dx, (r + 1, j), d1 * gj * s1 + a1 * x1 + c1)
                st(dx, (r + 2, j), d2 * gj * s2 + a2 * x2 + c2)
                st(dx, (r + 3, j), d3 * gj * s3 + a3 * x3 + c3)
                ag[j] += d0 * (x0 * s0) + d1 * (x1 * s1) + d2 * (x2 * s2) + d3 * (x3 * s3)
                ab[j] += d0 + d1 + d2 + d3
            r += 4
        while r < end:
            mu = mean[r]
            s = rstd[r]
            a, c = _row_terms(dy, x, gamma, r, mu, s, inv_n)
            for j in range(n):
                xmu = ld(x, (r, j)) - mu
                g = ld(dy, (r, j))
                st(dx, (r, j), g * ld(gamma, j) * s + a * xmu + c)
                ag[j] += g * (xmu * s)
                ab[j] += g
            r += 1
    fold_partials(pg, dgamma)
    fold_partials(pb, dbeta)


def _outs(out, i):
    return out[i] if out else None


@safe_entry
def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, *,
               out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(y[M,N] x.dtype, mean[M] fp32, variance[M] fp32)`` of the 2-D view x."""
    m, n = x.shape
    y = output(_outs(out, 0), (m, n), x.dtype)
    mean = output(_outs(out, 1), (m,), torch.float32)
    var = output(_outs(out, 2), (m,), torch.float32)
    if m and n:
        _layer_norm_kernel(as_array(x), as_array(gamma), as_array(beta), np.float32(epsilon), as_array(y),
                           as_array(mean), as_array(var))
    else:
        mean.zero_()
        var.zero_()
    return finish(y, _outs(out, 0)), finish(mean, _outs(out, 1)), finish(var, _outs(out, 2))


@safe_entry
def layer_norm_grad(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float, *,
                    out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGrad on the 2-D views: ``(pdx, res_for_gamma)``, both in x's dtype."""
    m, n = x.shape
    pdx = output(_outs(out, 0), (m, n), x.dtype)
    res = output(_outs(out, 1), (m, n), x.dtype)
    if m and n:
        _layer_norm_grad_kernel(as_array(dy), as_array(x), as_array(variance.float()), as_array(mean.float()),
                                as_array(gamma), np.float32(epsilon), as_array(pdx), as_array(res))
    return finish(pdx, _outs(out, 0)), finish(res, _outs(out, 1))


def layer_norm_grad_beta_workspace(res_for_gamma: Tensor, dy: Tensor) -> int:
    """Bytes of the fp32 gamma and beta partials (one row each per row block)."""
    return 2 * row_blocks(dy.shape[0]) * dy.shape[1] * 4


@safe_entry
def layer_norm_grad_beta(res_for_gamma: Tensor, dy: Tensor, *, out: tuple[Tensor, Tensor] | None = None,
                         workspace: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGradBeta: ``(pd_gamma[N], pd_beta[N])`` in the inputs' dtype, fp32 sums in fixed order."""
    m, n = dy.shape
    pd_gamma = output(_outs(out, 0), (n,), dy.dtype)
    pd_beta = output(_outs(out, 1), (n,), dy.dtype)
    nblk = row_blocks(m)
    size = nblk * n * 4
    pg = scratch(workspace, 2 * size, 0, np.float32, nblk * n).reshape(nblk, n)
    pb = scratch(workspace, 2 * size, size, np.float32, nblk * n).reshape(nblk, n)
    if n:
        _grad_beta_kernel(as_array(res_for_gamma), as_array(dy), pg, pb, as_array(pd_gamma), as_array(pd_beta))
    return finish(pd_gamma, _outs(out, 0)), finish(pd_beta, _outs(out, 1))


def layer_norm_backward_workspace(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor) -> int:
    """Bytes of the fp32 dgamma and dbeta partials."""
    return 2 * row_blocks(x.shape[0]) * x.shape[1] * 4


@safe_entry
def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                        out: tuple[Tensor, Tensor, Tensor] | None = None, workspace: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Fused LayerNorm backward on the 2-D views: ``(dx x.dtype, dgamma fp32, dbeta fp32)``, one pass over dy, x."""
    m, n = x.shape
    dx = output(_outs(out, 0), (m, n), x.dtype)
    dgamma = output(_outs(out, 1), (n,), torch.float32)
    dbeta = output(_outs(out, 2), (n,), torch.float32)
    if m == 0 or n == 0:
        dgamma.zero_()
        dbeta.zero_()
    else:
        nblk = row_blocks(m)
        size = nblk * n * 4
        pg = scratch(workspace, 2 * size, 0, np.float32, nblk * n).reshape(nblk, n)
        pb = scratch(workspace, 2 * size, size, np.float32, nblk * n).reshape(nblk, n)
        _layer_norm_backward_kernel(as_array(dy), as_array(x), as_array(mean.float()), as_array(rstd.float()),
                                    as_array(gamma), as_array(dx), pg, pb, as_array(dgamma), as_array(dbeta))
    return finish(dx, _outs(out, 0)), finish(dgamma, _outs(out, 1)), finish(dbeta, _outs(out, 2))
