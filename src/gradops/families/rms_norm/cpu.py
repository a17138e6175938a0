"""RmsNorm forward and RmsNormGrad on the CPU: the host entries of the native kernels ``rms_norm`` and
``rms_norm_grad`` (rms_norm.cpp: row-parallel, fp32 math, deterministic dgamma).

Byte model of the backward (what ``gradops bench`` divides by): ``M·N·(s_dy + s_x + s_dx) + 4·M + N·(s_g + 4)``;
the fp32 dgamma partials (``row_blocks(M, N) x N x 4`` bytes, written and read once) stay in cache at LLM shapes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...contract._common import Outputs, written
from ...cpu._host import allocate, dense, finish, kernel, output, row_blocks
from ...cpu.programs import Program, arg
from ...spec import Impl
from .contract import RmsNormShape, on_rows, rms_norm_grad_results, rms_norm_results


def _rms_norm_run(x: Tensor, gamma: Tensor, epsilon: float, y: Tensor, rstd: Tensor, m: int, n: int) -> None:
    """The forward into contiguous ``y`` (m·n items) and ``rstd`` (m items); rows of no columns get
    ``rsqrt(eps)`` (inf when eps = 0, as the reference)."""
    kernel("rms_norm", (dense(x), dense(gamma)), (y, rstd), (m, n), (float(epsilon),))


def rms_norm(x: Tensor, gamma: Tensor, epsilon: float, *, out: tuple[Tensor, Tensor] | None = None
             ) -> tuple[Tensor, Tensor]:
    """``(y[M,N] x.dtype, rstd[M] fp32)`` of the 2-D view ``x``; ``out`` = preallocated ``(y, rstd)``."""
    m, n = x.shape
    y_spec, rstd_spec = written(rms_norm_results(on_rows(m, n), x, gamma, epsilon))
    y, rstd = output(out[0] if out else None, *y_spec), output(out[1] if out else None, *rstd_spec)
    _rms_norm_run(x, gamma, epsilon, y, rstd, m, n)
    return finish(y, out[0] if out else None), finish(rstd, out[1] if out else None)


def rms_norm_shaped(outputs: Outputs, shape: RmsNormShape, x: Tensor, gamma: Tensor, epsilon: float) -> tuple[Tensor,
                    Tensor]:
    """The op on x of any shape (``shape``: its rows x cols view, see :mod:`gradops.ops._plan`): ``y`` of x's
    shape, ``rstd`` float32 of ``shape.rstd_shape``."""
    y, rstd = allocate(outputs, (x, gamma, epsilon))
    _rms_norm_run(x, gamma, epsilon, y, rstd, shape.rows, shape.cols)
    return y, rstd


def rms_norm_grad_workspace(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor) -> int:
    """Bytes of scratch :func:`rms_norm_grad` needs: the fp32 dgamma partials, one row per row block."""
    m, n = x.shape
    return row_blocks(m, n) * n * 4


def _workspace(workspace: Tensor, nbytes: int) -> Tensor:
    """``workspace`` checked to hold ``nbytes`` (the kernel puts its dgamma partials there), as one contiguous
    uint8 row."""
    if workspace.dtype != torch.uint8 or workspace.device.type != "cpu" or workspace.numel() < nbytes:
        raise ValueError(f"workspace must be a CPU uint8 tensor of at least {nbytes} bytes, got "
                         f"{workspace.dtype} with {workspace.numel()} elements on {workspace.device}")
    return dense(workspace.detach()).view(-1)


def _rms_norm_grad_run(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor, dx: Tensor, dgamma: Tensor, m: int,
                       n: int, workspace: Tensor | None) -> None:
    """The backward into contiguous ``dx`` (m·n items) and ``dgamma`` (n items; zeros when m·n = 0)."""
    inputs = [dense(dy), dense(x), dense(rstd.float()), dense(gamma)]
    if workspace is not None and m and n:
        inputs.append(_workspace(workspace, row_blocks(m, n) * n * 4))
    kernel("rms_norm_grad", inputs, (dx, dgamma), (m, n))


def rms_norm_grad(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor, *, out: tuple[Tensor, Tensor] | None = None,
                  workspace: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """aclnnRmsNormGrad on the 2-D views: ``(dx[M,N] dy.dtype, dgamma[N] fp32)`` (formulas: rms_norm.cpp).

    Args:
        dy, x: (M, N); rstd: (M,) (cast to fp32 if needed); gamma: (N,).
        out: optional preallocated ``(dx, dgamma)`` (validated by the caller).
        workspace: optional uint8 CPU tensor of at least :func:`rms_norm_grad_workspace` bytes.

    Returns:
        ``(dx, dgamma)``.
    """
    m, n = x.shape
    dx_spec, dgamma_spec = written(rms_norm_grad_results(on_rows(m, n), dy, x, rstd, gamma))
    dx, dgamma = output(out[0] if out else None, *dx_spec), output(out[1] if out else None, *dgamma_spec)
    _rms_norm_grad_run(dy, x, rstd, gamma, dx, dgamma, m, n, workspace)
    return finish(dx, out[0] if out else None), finish(dgamma, out[1] if out else None)


def rms_norm_grad_shaped(outputs: Outputs, shape: RmsNormShape, dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor
                         ) -> tuple[Tensor, Tensor]:
    """The op on its own shapes (see :func:`rms_norm_shaped`): dx of dy's shape, dgamma float32 of gamma's."""
    dx, dgamma = allocate(outputs, (dy, x, rstd, gamma))
    _rms_norm_grad_run(dy, x, rstd, gamma, dx, dgamma, shape.rows, shape.cols, None)
    return dx, dgamma

# ---------------------------------------------------------------- the direct calls' programs
# Each: the Python path above as the extension replays it (see gradops.cpu.programs; the op's call plan loads
# it): the same registered kernel on outputs of the same shapes, or None where the Python path does what a
# program does not.
def program_rms_norm(shape, x, gamma, epsilon):
    m, n = shape.rows, shape.cols
    if not m or not n:
        return None
    p = Program()
    y, rstd = p.declared(rms_norm_results(shape, x, gamma, epsilon))
    p.kernel("rms_norm", [arg(0), arg(1)], [y, rstd], [m, n], [float(epsilon)])
    return p.returns(y, rstd)


def program_rms_norm_grad(shape, dy, x, rstd, gamma):
    m, n = shape.rows, shape.cols
    if not m or not n or rstd.dtype != torch.float32:
        return None
    p = Program()
    dx, dgamma = p.declared(rms_norm_grad_results(shape, dy, x, rstd, gamma))
    p.kernel("rms_norm_grad", [arg(0), arg(1), arg(2), arg(3)], [dx, dgamma], [m, n])
    return p.returns(dx, dgamma)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
RMS_NORM = Impl(rms_norm, shaped=rms_norm_shaped)
RMS_NORM_GRAD = Impl(rms_norm_grad, shaped=rms_norm_grad_shaped, workspace=rms_norm_grad_workspace)
