"""The programs of the norms and Hardswish for the extension's direct calls (see :mod:`gradops.cpu.programs`)."""

from __future__ import annotations

import numpy as np
import torch

from ._host import row_blocks
from ._reduce import fold_partials
from ._views import F32, view1, view2
from .layer_norm import (
    _backward_block,
    _backward_block_into,
    _first_below,
    _grad_beta_block,
    _layer_norm_grad_row_range,
    _layer_norm_row_range,
)
from .programs import F64 as _F64
from .programs import I64 as _I64
from .programs import Program, arg, blocks_grain, piece, rows_grain
from .rms_norm import _rms_norm_grad_block, _rms_norm_row_range


# ---------------------------------------------------------------- Hardswish
# One step each: the registered kernels of gradops/native/hardswish.cpp, the Python path's (cpu/hardswish.py).
def _hardswish(shape, x):
    if not x.numel():
        return None
    p = Program()
    y = p.output(x.shape, x.dtype)
    p.kernel("hardswish", [arg(0)], [y])
    return p.returns(y)


def _hardswish_backward(shape, grad_output, x):
    if not x.numel():
        return None
    p = Program()
    dx = p.output(x.shape, x.dtype)
    p.kernel("hardswish_backward", [arg(0), arg(1)], [dx])
    return p.returns(dx)


# ---------------------------------------------------------------- RmsNorm
@piece
def _rms_norm_rows(s, gs):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: x, gamma, y, rstd, m, n, eps
        a, f = view1(at, _I64, 7), view1(at, _F64, 7)
        m, n = a[4], a[5]
        x, gamma, y, rstd = view2(a[0], s, m, n), view1(a[1], gs, n), view2(a[2], s, m, n), view1(a[3], F32, m)
        eps = np.float32(f[6])
        _rms_norm_row_range(x, gamma, eps, y, rstd, lo, hi)
        return -1
    return body


@piece
def _rms_norm_grad_blocks(s, gs):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: dy, x, rstd, gamma, dx, partial, m, n, nblk
        a = view1(at, _I64, 9)
        m, n, nblk = a[6], a[7], a[8]
        dy, x, dx = view2(a[0], s, m, n), view2(a[1], s, m, n), view2(a[4], s, m, n)
        rstd, gamma, partial = view1(a[2], F32, m), view1(a[3], gs, n), view2(a[5], F32, nblk, n)
        for b in range(lo, hi):
            _rms_norm_grad_block(dy, x, rstd, gamma, dx, partial, b)
        return -1
    return body


@piece
def _fold(s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: partials (f32 blocks x n), out (n, in s), blocks, n
        a = view1(at, _I64, 4)
        fold_partials(view2(a[0], F32, a[2], a[3]), view1(a[1], s, a[3]))
        return -1
    return body


def _rms_norm(plan, x, gamma, epsilon):
    m, n = plan.rows, plan.cols
    if not m or not n:
        return None
    p = Program()
    y, rstd = p.output(x.shape, x.dtype), p.output(plan.rstd_shape, torch.float32)
    p.step(_rms_norm_rows(x.dtype, gamma.dtype), [arg(0), arg(1), y, rstd, m, n, float(epsilon)], m,
           rows_grain(m, n))
    return p.returns(y, rstd)


def _rms_norm_grad(plan, dy, x, rstd, gamma):
    m, n = plan.rows, plan.cols
    if not m or not n or rstd.dtype != torch.float32:
        return None
    nblk = row_blocks(m, n)
    p = Program()
    dx, dgamma = p.output(dy.shape, dy.dtype), p.output(gamma.shape, torch.float32)
    partial = p.buffer((nblk, n), torch.float32)
    p.step(_rms_norm_grad_blocks(x.dtype, gamma.dtype), [arg(0), arg(1), arg(2), arg(3), dx, partial, m, n, nblk],
           nblk, blocks_grain(nblk, m * n))
    p.step(_fold(torch.float32), [partial, dgamma, nblk, n])
    return p.returns(dx, dgamma)


# ---------------------------------------------------------------- LayerNorm
@piece
def _layer_norm_rows(s, gs, bs):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: x, gamma, beta, y, mean, var, m, n, eps
        a, f = view1(at, _I64, 9), view1(at, _F64, 9)
        m, n = a[6], a[7]
        x, y = view2(a[0], s, m, n), view2(a[3], s, m, n)
        gamma, beta, mean, var = view1(a[1], gs, n), view1(a[2], bs, n), view1(a[4], F32, m), view1(a[5], F32, m)
        eps = np.float32(f[8])
        _layer_norm_row_range(x, gamma, beta, eps, y, mean, var, lo, hi)
        return -1
    return body


@piece
def _layer_norm_grad_rows(s, gs):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: dy, x, var, mean, gamma, pdx, res, m, n, eps
        a, f = view1(at, _I64, 10), view1(at, _F64, 10)
        m, n = a[7], a[8]
        dy, x, pdx, res = view2(a[0], s, m, n), view2(a[1], s, m, n), view2(a[5], s, m, n), view2(a[6], s, m, n)
        var, mean, gamma = view1(a[2], F32, m), view1(a[3], F32, m), view1(a[4], gs, n)
        eps = np.float32(f[9])
        _layer_norm_grad_row_range(dy, x, var, mean, gamma, eps, pdx, res, lo, hi)
        return -1
    return body


@piece
def _below(s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: values, m, floor (float64)
        a, f = view1(at, _I64, 3), view1(at, _F64, 3)
        return _first_below(view1(a[0], s, a[1]), f[2])
    return body


@piece
def _layer_norm_blocks(s, gs):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: dy, x, mean, rstd, gamma, dx, pg, pb, m, n, nblk
        a = view1(at, _I64, 11)
        m, n, nblk = a[8], a[9], a[10]
        dy, x, dx = view2(a[0], s, m, n), view2(a[1], s, m, n), view2(a[5], s, m, n)
        mean, rstd, gamma = view1(a[2], F32, m), view1(a[3], F32, m), view1(a[4], gs, n)
        pg, pb = view2(a[6], F32, nblk, n), view2(a[7], F32, nblk, n)
        for b in range(lo, hi):
            _backward_block(dy, x, mean, rstd, gamma, dx, pg, pb, b)
        return -1
    return body


@piece
def _layer_norm_blocks_into(s, gs):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: g (read, then written with dx), x, mean, rstd, gamma,
        # pg, pb, m, n, nblk
        a = view1(at, _I64, 10)
        m, n, nblk = a[7], a[8], a[9]
        g, x = view2(a[0], s, m, n), view2(a[1], s, m, n)
        mean, rstd, gamma = view1(a[2], F32, m), view1(a[3], F32, m), view1(a[4], gs, n)
        pg, pb = view2(a[5], F32, nblk, n), view2(a[6], F32, nblk, n)
        for b in range(lo, hi):
            _backward_block_into(g, x, mean, rstd, gamma, pg, pb, b)
        return -1
    return body


@piece
def _grad_beta_blocks(s):
    def body(at, lo, hi):  # pragma: no cover - compiled; args: res, dy, pg, pb, m, n, nblk
        a = view1(at, _I64, 7)
        m, n, nblk = a[4], a[5], a[6]
        res, dy = view2(a[0], s, m, n), view2(a[1], s, m, n)
        pg, pb = view2(a[2], F32, nblk, n), view2(a[3], F32, nblk, n)
        for b in range(lo, hi):
            _grad_beta_block(res, dy, pg, pb, b)
        return -1
    return body


def _layer_norm(plan, x, gamma, beta, epsilon):
    m, n = plan.rows, plan.cols
    if not m or not n:
        return None
    p = Program()
    stat = x.shape[:-1]
    y, mean, var = p.output(x.shape, x.dtype), p.output(stat, torch.float32), p.output(stat, torch.float32)
    p.step(_layer_norm_rows(x.dtype, gamma.dtype, beta.dtype), [arg(0), arg(1), arg(2), y, mean, var, m, n,
                                                                float(epsilon)], m, rows_grain(m, n))
    return p.returns(y, mean, var)


def _layer_norm_grad(plan, dy, x, variance, mean, gamma, epsilon):
    m, n = plan
    if not m or not n or variance.dtype != torch.float32 or mean.dtype != torch.float32:
        return None
    p = Program()
    pdx, res = p.output(x.shape, x.dtype), p.output(x.shape, x.dtype)
    p.step(_below(torch.float32), [arg(2), m, float(epsilon)])  # the variance test, before anything is computed
    p.step(_layer_norm_grad_rows(x.dtype, gamma.dtype), [arg(0), arg(1), arg(2), arg(3), arg(4), pdx, res, m, n,
                                                         float(epsilon)], m, rows_grain(m, n))
    return p.returns(pdx, res)


def _layer_norm_grad_beta(plan, res_for_gamma, dy):
    m, n = plan
    if not m or not n:
        return None
    nblk = row_blocks(m, n)
    p = Program()
    pd_gamma, pd_beta = p.output((n,), dy.dtype), p.output((n,), dy.dtype)
    pg, pb = p.buffer((nblk, n), torch.float32), p.buffer((nblk, n), torch.float32)
    p.step(_grad_beta_blocks(dy.dtype), [arg(0), arg(1), pg, pb, m, n, nblk], nblk, blocks_grain(nblk, m * n))
    p.step(_fold(dy.dtype), [pg, pd_gamma, nblk, n])
    p.step(_fold(dy.dtype), [pb, pd_beta, nblk, n])
    return p.returns(pd_gamma, pd_beta)


def _layer_norm_backward(plan, dy, x, mean, rstd, gamma):
    m, n = plan
    if not m or not n or mean.dtype != torch.float32 or rstd.dtype != torch.float32:
        return None
    nblk = row_blocks(m, n)
    p = Program()
    dx = p.output(x.shape, x.dtype)
    dgamma, dbeta = p.output(gamma.shape, torch.float32), p.output(gamma.shape, torch.float32)
    pg, pb = p.buffer((nblk, n), torch.float32), p.buffer((nblk, n), torch.float32)
    p.step(_below(torch.float32), [arg(3), m, 0.0])  # a negative rstd, before anything is computed
    p.step(_layer_norm_blocks(x.dtype, gamma.dtype), [arg(0), arg(1), arg(2), arg(3), arg(4), dx, pg, pb, m, n, nblk],
           nblk, blocks_grain(nblk, m * n))
    p.step(_fold(torch.float32), [pg, dgamma, nblk, n])
    p.step(_fold(torch.float32), [pb, dbeta, nblk, n])
    return p.returns(dx, dgamma, dbeta)


def layer_norm_node_pieces(dtype: torch.dtype, gamma_dtype: torch.dtype, beta_dtype: torch.dtype) -> list[int]:
    """The native LayerNorm node's pieces (autograd.cpp): the forward rows, the fused backward's row blocks, the
    float32 fold of their partials - the direct calls' layer_norm / layer_norm_backward pieces - and the row blocks
    writing dx into the gradient's own memory."""
    return [_layer_norm_rows(dtype, gamma_dtype, beta_dtype), _layer_norm_blocks(dtype, gamma_dtype),
            _fold(torch.float32), _layer_norm_blocks_into(dtype, gamma_dtype)]


BUILDERS = {
    "hardswish": _hardswish, "hardswish_backward": _hardswish_backward, "rms_norm": _rms_norm,
    "rms_norm_grad": _rms_norm_grad, "layer_norm": _layer_norm, "layer_norm_grad": _layer_norm_grad,
    "layer_norm_grad_beta": _layer_norm_grad_beta, "layer_norm_backward": _layer_norm_backward,
}
