"""The programs of the norms and Hardswish for the extension's direct calls (see :mod:`gradops.cpu.programs`)."""

from __future__ import annotations

import torch

from .programs import Program, arg


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
def _rms_norm(plan, x, gamma, epsilon):
    m, n = plan.rows, plan.cols
    if not m or not n:
        return None
    p = Program()
    y, rstd = p.output(x.shape, x.dtype), p.output(plan.rstd_shape, torch.float32)
    p.kernel("rms_norm", [arg(0), arg(1)], [y, rstd], [m, n], [float(epsilon)])
    return p.returns(y, rstd)


def _rms_norm_grad(plan, dy, x, rstd, gamma):
    m, n = plan.rows, plan.cols
    if not m or not n or rstd.dtype != torch.float32:
        return None
    p = Program()
    dx, dgamma = p.output(dy.shape, dy.dtype), p.output(gamma.shape, torch.float32)
    p.kernel("rms_norm_grad", [arg(0), arg(1), arg(2), arg(3)], [dx, dgamma], [m, n])
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
