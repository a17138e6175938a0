"""LayerNorm forward, AscendC LayerNormGrad / LayerNormGradBeta and the fused backward on the CPU: the host entries
of the native kernels ``layer_norm``, ``layer_norm_grad``, ``layer_norm_grad_beta`` and ``layer_norm_backward``
(layer_norm.cpp: formulas, float32 math, row-parallel, deterministic column sums).

LayerNormGrad follows AscendC's formula term by term, including the ``sum(x - mean)`` term (see
:mod:`gradops.families.layer_norm.reference`). Byte models: grad ``M·N·(s_dy + s_x + 2·s_x) + 8M + N·s_g`` (pdx and
res_for_gamma written); grad_beta ``2·M·N·s + 2·N·s``; fused backward ``M·N·(s_dy + s_x + s_dx) + 8M + N·(s_g + 8)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...contract._common import Outputs, written
from ...cpu._host import allocate, dense, finish, kernel, output, row_blocks
from ...cpu.programs import Program, arg
from ...spec import Impl
from .contract import (
    LayerNormShape,
    layer_norm_backward_results,
    layer_norm_grad_beta_results,
    layer_norm_grad_results,
    layer_norm_results,
    statistic_error,
)


def _outs(out, i):
    return out[i] if out else None


def _workspace(workspace: Tensor | None, nbytes: int) -> Tensor | None:
    """``workspace`` checked to hold ``nbytes`` (the kernel puts its float32 partials there), contiguous; None stays
    None (the kernel allocates its own). ~1 µs: no detach / view (~2 µs more, a sixth of a 64 x 128 backward),
    which the kernel, reading the bytes by address, does not need."""
    if workspace is None:
        return None
    if workspace.dtype != torch.uint8 or not workspace.is_cpu or workspace.numel() < nbytes:
        raise ValueError(f"workspace must be a CPU uint8 tensor of at least {nbytes} bytes, got "
                         f"{workspace.dtype} with {workspace.numel()} elements on {workspace.device}")
    return dense(workspace)


def _layer_norm_run(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, y: Tensor, mean: Tensor, var: Tensor,
                    m: int, n: int) -> None:
    """The forward into contiguous y (m·n items), mean and var (m items each; zeros for rows of no columns)."""
    kernel("layer_norm", (dense(x), dense(gamma), dense(beta)), (y, mean, var), (m, n), (float(epsilon),))


def layer_norm(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float, *,
               out: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(y[M,N] x.dtype, mean[M] fp32, variance[M] fp32)`` of the 2-D view x."""
    m, n = x.shape
    specs = written(layer_norm_results(LayerNormShape(m, n), x, gamma, beta, epsilon))
    y, mean, var = (output(_outs(out, i), *spec) for i, spec in enumerate(specs))
    _layer_norm_run(x, gamma, beta, epsilon, y, mean, var, m, n)
    return finish(y, _outs(out, 0)), finish(mean, _outs(out, 1)), finish(var, _outs(out, 2))


def layer_norm_shaped(outputs: Outputs, shape: LayerNormShape, x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """The op on x of any shape (see :mod:`gradops.ops._plan`): y of x's shape, mean and variance float32 of
    ``x.shape[:-1]``."""
    y, mean, var = allocate(outputs, (x, gamma, beta, epsilon))
    _layer_norm_run(x, gamma, beta, epsilon, y, mean, var, shape.rows, shape.cols)
    return y, mean, var


def _layer_norm_grad_run(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float,
                         pdx: Tensor, res: Tensor, m: int, n: int, check: bool) -> None:
    """LayerNormGrad into contiguous pdx, res; with ``check``, a variance below -epsilon raises the contract's
    OpError (161002) before anything is written (the kernel finds it)."""
    variance = dense(variance.float())  # (M,) or the keepdim (M, 1): the kernel reads M values
    inputs = (dense(dy), dense(x), variance, dense(mean.float()), dense(gamma))
    if kernel("layer_norm_grad", inputs, (pdx, res), (m, n, int(check)), (float(epsilon),)) >= 0:
        raise statistic_error("layer_norm_grad", "variance", variance, float(epsilon))


def layer_norm_grad(dy: Tensor, x: Tensor, variance: Tensor, mean: Tensor, gamma: Tensor, epsilon: float, *,
                    out: tuple[Tensor, Tensor] | None = None, check_statistics: bool = False
                    ) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGrad on the 2-D views: ``(pdx, res_for_gamma)``, both in x's dtype. A variance below
    -epsilon gives NaN rows as in AscendC, or with ``check_statistics`` raises the contract's OpError (161002)
    before anything is written."""
    m, n = x.shape
    specs = written(layer_norm_grad_results(LayerNormShape(m, n), dy, x, variance, mean, gamma, epsilon))
    pdx, res = (output(_outs(out, i), *spec) for i, spec in enumerate(specs))
    _layer_norm_grad_run(dy, x, variance, mean, gamma, epsilon, pdx, res, m, n, check_statistics)
    return finish(pdx, _outs(out, 0)), finish(res, _outs(out, 1))


def layer_norm_grad_shaped(outputs: Outputs, shape: LayerNormShape, dy: Tensor, x: Tensor, variance: Tensor,
                           mean: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """The op on its own shapes (see :func:`layer_norm_shaped`): pdx and res_for_gamma of x's shape; the
    variance checked (as the public function promises)."""
    pdx, res = allocate(outputs, (dy, x, variance, mean, gamma, epsilon))
    _layer_norm_grad_run(dy, x, variance, mean, gamma, epsilon, pdx, res, shape.rows, shape.cols, True)
    return pdx, res


def layer_norm_grad_beta_workspace(res_for_gamma: Tensor, dy: Tensor) -> int:
    """Bytes of the fp32 gamma and beta partials (one row each per row block)."""
    return 2 * row_blocks(*dy.shape) * dy.shape[1] * 4


def _grad_beta_run(res_for_gamma: Tensor, dy: Tensor, pd_gamma: Tensor, pd_beta: Tensor, m: int, n: int,
                   workspace: Tensor | None) -> None:
    """LayerNormGradBeta into contiguous pd_gamma, pd_beta (n items; zeros when m = 0)."""
    ws = _workspace(workspace, 2 * row_blocks(m, n) * n * 4) if n else None
    kernel("layer_norm_grad_beta", (dense(res_for_gamma), dense(dy), ws), (pd_gamma, pd_beta), (m, n))


def layer_norm_grad_beta(res_for_gamma: Tensor, dy: Tensor, *, out: tuple[Tensor, Tensor] | None = None,
                         workspace: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """AscendC LayerNormGradBeta: ``(pd_gamma[N], pd_beta[N])`` in the inputs' dtype, fp32 sums in fixed order."""
    m, n = dy.shape
    specs = written(layer_norm_grad_beta_results(LayerNormShape(m, n), res_for_gamma, dy))
    pd_gamma, pd_beta = (output(_outs(out, i), *spec) for i, spec in enumerate(specs))
    _grad_beta_run(res_for_gamma, dy, pd_gamma, pd_beta, m, n, workspace)
    return finish(pd_gamma, _outs(out, 0)), finish(pd_beta, _outs(out, 1))


def layer_norm_grad_beta_shaped(outputs: Outputs, shape: LayerNormShape, res_for_gamma: Tensor,
                                dy: Tensor) -> tuple[Tensor, Tensor]:
    """The op on its own shapes: pd_gamma and pd_beta of ``dy.shape[-1:]`` in dy's dtype."""
    pd_gamma, pd_beta = allocate(outputs, (res_for_gamma, dy))
    _grad_beta_run(res_for_gamma, dy, pd_gamma, pd_beta, shape.rows, shape.cols, None)
    return pd_gamma, pd_beta


def layer_norm_backward_workspace(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor) -> int:
    """Bytes of the fp32 dgamma and dbeta partials."""
    return 2 * row_blocks(*x.shape) * x.shape[1] * 4


def _backward_run(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, dx: Tensor, dgamma: Tensor,
                  dbeta: Tensor, m: int, n: int, workspace: Tensor | None, check: bool) -> None:
    """The fused backward into contiguous dx, dgamma, dbeta; with ``check``, a negative rstd raises the
    contract's OpError (161002) before anything is written (the kernel finds it)."""
    # rstd as the contract takes it: (M,), the keepdim (M, 1), or 0-d for a 1-D x; the kernel reads M values.
    rstd = dense(rstd.float())
    ws = _workspace(workspace, 2 * row_blocks(m, n) * n * 4) if m and n else None
    inputs = (dense(dy), dense(x), dense(mean.float()), rstd, dense(gamma), ws)
    if kernel("layer_norm_backward", inputs, (dx, dgamma, dbeta), (m, n, int(check))) >= 0:
        raise statistic_error("layer_norm_backward", "rstd", rstd, 0.0)


def layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, gamma: Tensor, *,
                        out: tuple[Tensor, Tensor, Tensor] | None = None, workspace: Tensor | None = None,
                        check_statistics: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Fused LayerNorm backward on the 2-D views: ``(dx x.dtype, dgamma fp32, dbeta fp32)``, one pass over dy, x.
    With ``check_statistics`` a negative rstd raises the contract's OpError (161002) before anything is written."""
    m, n = x.shape
    specs = written(layer_norm_backward_results(LayerNormShape(m, n), dy, x, mean, rstd, gamma))
    dx, dgamma, dbeta = (output(_outs(out, i), *spec) for i, spec in enumerate(specs))
    _backward_run(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, m, n, workspace, check_statistics)
    return finish(dx, _outs(out, 0)), finish(dgamma, _outs(out, 1)), finish(dbeta, _outs(out, 2))


def layer_norm_backward_shaped(outputs: Outputs, shape: LayerNormShape, dy: Tensor, x: Tensor, mean: Tensor,
                               rstd: Tensor,
                               gamma: Tensor, *, check_statistics: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The op on its own shapes: dx of x's shape, dgamma and dbeta float32 of gamma's; rstd checked unless it comes
    from this package's own forward (``check_statistics=False``: ``(variance + eps)^-0.5`` is never negative)."""
    dx, dgamma, dbeta = allocate(outputs, (dy, x, mean, rstd, gamma))
    _backward_run(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, shape.rows, shape.cols, None, check_statistics)
    return dx, dgamma, dbeta

# ---------------------------------------------------------------- the direct calls' programs
# Each: the Python path above as the extension replays it (see gradops.cpu.programs; the op's call plan loads
# it): the same registered kernel on outputs of the same shapes, or None where the Python path does what a
# program does not.
def program_layer_norm(shape, x, gamma, beta, epsilon):
    m, n = shape.rows, shape.cols
    if not m or not n:
        return None
    p = Program()
    y, mean, var = p.declared(layer_norm_results(shape, x, gamma, beta, epsilon))
    p.kernel("layer_norm", [arg(0), arg(1), arg(2)], [y, mean, var], [m, n], [float(epsilon)])
    return p.returns(y, mean, var)


def program_layer_norm_grad(shape, dy, x, variance, mean, gamma, epsilon):
    m, n = shape
    if not m or not n or variance.dtype != torch.float32 or mean.dtype != torch.float32:
        return None
    p = Program()
    pdx, res = p.declared(layer_norm_grad_results(shape, dy, x, variance, mean, gamma, epsilon))
    # check = 1: a variance below -epsilon is refused before anything is computed (the call takes the Python path,
    # which raises the op's OpError).
    p.kernel("layer_norm_grad", [arg(0), arg(1), arg(2), arg(3), arg(4)], [pdx, res], [m, n, 1], [float(epsilon)])
    return p.returns(pdx, res)


def program_layer_norm_grad_beta(shape, res_for_gamma, dy):
    m, n = shape
    if not m or not n:
        return None
    p = Program()
    pd_gamma, pd_beta = p.declared(layer_norm_grad_beta_results(shape, res_for_gamma, dy))
    p.kernel("layer_norm_grad_beta", [arg(0), arg(1), None], [pd_gamma, pd_beta], [m, n])
    return p.returns(pd_gamma, pd_beta)


def program_layer_norm_backward(shape, dy, x, mean, rstd, gamma):
    m, n = shape
    if not m or not n or mean.dtype != torch.float32 or rstd.dtype != torch.float32:
        return None
    p = Program()
    dx, dgamma, dbeta = p.declared(layer_norm_backward_results(shape, dy, x, mean, rstd, gamma))
    # check = 1: a negative rstd is refused before anything is computed.
    p.kernel("layer_norm_backward", [arg(0), arg(1), arg(2), arg(3), arg(4), None], [dx, dgamma, dbeta], [m, n, 1])
    return p.returns(dx, dgamma, dbeta)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
LAYER_NORM = Impl(layer_norm, shaped=layer_norm_shaped)
LAYER_NORM_GRAD = Impl(layer_norm_grad, shaped=layer_norm_grad_shaped)
LAYER_NORM_GRAD_BETA = Impl(layer_norm_grad_beta, shaped=layer_norm_grad_beta_shaped,
                            workspace=layer_norm_grad_beta_workspace)
LAYER_NORM_BACKWARD = Impl(layer_norm_backward, shaped=layer_norm_backward_shaped,
                           workspace=layer_norm_backward_workspace)
