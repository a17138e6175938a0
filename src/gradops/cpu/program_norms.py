"""The programs of the norms and Hardswish for the extension's direct calls (see :mod:`gradops.cpu.programs`)."""

from __future__ import annotations

import numpy as np
import torch

from ._host import row_blocks
from ._reduce import fold_partials
from ._views import F32, view1, view2
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
# One step each: the registered kernels of gradops/native/layer_norm.cpp, the Python path's (cpu/layer_norm.py).
def _layer_norm(plan, x, gamma, beta, epsilon):
    m, n = plan.rows, plan.cols
    if not m or not n:
        return None
    p = Program()
    stat = x.shape[:-1]
    y, mean, var = p.output(x.shape, x.dtype), p.output(stat, torch.float32), p.output(stat, torch.float32)
    p.kernel("layer_norm", [arg(0), arg(1), arg(2)], [y, mean, var], [m, n], [float(epsilon)])
    return p.returns(y, mean, var)


def _layer_norm_grad(plan, dy, x, variance, mean, gamma, epsilon):
    m, n = plan
    if not m or not n or variance.dtype != torch.float32 or mean.dtype != torch.float32:
        return None
    p = Program()
    pdx, res = p.output(x.shape, x.dtype), p.output(x.shape, x.dtype)
    # check = 1: a variance below -epsilon is refused before anything is computed (the call takes the Python path,
    # which raises the op's OpError).
    p.kernel("layer_norm_grad", [arg(0), arg(1), arg(2), arg(3), arg(4)], [pdx, res], [m, n, 1], [float(epsilon)])
    return p.returns(pdx, res)


def _layer_norm_grad_beta(plan, res_for_gamma, dy):
    m, n = plan
    if not m or not n:
        return None
    p = Program()
    pd_gamma, pd_beta = p.output((n,), dy.dtype), p.output((n,), dy.dtype)
    p.kernel("layer_norm_grad_beta", [arg(0), arg(1), None], [pd_gamma, pd_beta], [m, n])
    return p.returns(pd_gamma, pd_beta)


def _layer_norm_backward(plan, dy, x, mean, rstd, gamma):
    m, n = plan
    if not m or not n or mean.dtype != torch.float32 or rstd.dtype != torch.float32:
        return None
    p = Program()
    dx = p.output(x.shape, x.dtype)
    dgamma, dbeta = p.output(gamma.shape, torch.float32), p.output(gamma.shape, torch.float32)
    # check = 1: a negative rstd is refused before anything is computed.
    p.kernel("layer_norm_backward", [arg(0), arg(1), arg(2), arg(3), arg(4), None], [dx, dgamma, dbeta], [m, n, 1])
    return p.returns(dx, dgamma, dbeta)


BUILDERS = {
    "hardswish": _hardswish, "hardswish_backward": _hardswish_backward, "rms_norm": _rms_norm,
    "rms_norm_grad": _rms_norm_grad, "layer_norm": _layer_norm, "layer_norm_grad": _layer_norm_grad,
    "layer_norm_grad_beta": _layer_norm_grad_beta, "layer_norm_backward": _layer_norm_backward,
}
