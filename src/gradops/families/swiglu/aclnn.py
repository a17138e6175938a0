"""aclnnSwiGlu and aclnnSwiGluGrad, two-phase.

Validation is :mod:`gradops.families.swiglu.contract` with ``cann=True``: what CANN refuses and the PyTorch API
accepts is refused here, i.e. empty and non-contiguous inputs (161002). Out tensors may be non-contiguous views
(results go through a buffer in the workspace and are copied in; see :func:`gradops.aclnn._executor.prepare`).
"""

from __future__ import annotations

from torch import Tensor

from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, plan, prepare, refused
from ...ops._direct import fit
from ...status import OpError
from .ops import plan_swiglu, plan_swiglu_grad


def aclnnSwiGluGetWorkspaceSize(x: Tensor, dim: int, out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnSwiGlu: x split into halves A, B along ``dim``, ``out = silu(A) * B``.

    Args:
        x: 1-8 dims, float16 / bfloat16 / float32, contiguous, non-empty, an even size along ``dim``.
        dim: in ``[-x.dim(), x.dim() - 1]``.
        out: written with y (x's dtype; x's shape with dim halved).

    Returns:
        ``(status, workspace_size, executor)``: 0 and an executor, or (161001 | 161002, 0, None).
    """
    try:
        called = plan(plan_swiglu, x, dim, out=out)
    except OpError as e:
        return refused(e)
    rows, cols = called.shape.rows, called.shape.cols

    views = fit(x, (rows, 2 * cols)), -1  # made once: phase 2 runs only on the layout phase 1 saw

    def compute(impl, kw):
        return impl(*views, **kw)

    return prepare("swiglu", x.device, called.backend, views, compute, {"out": out},
                   plan_swiglu.spec.results(called.shape, x, dim), inputs={"x": x})


def aclnnSwiGlu(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnSwiGlu: run ``executor`` on ``stream`` (None or a torch.cuda.Stream)."""
    return execute("swiglu", workspace, workspaceSize, executor, stream)


def aclnnSwiGluGradGetWorkspaceSize(yGrad: Tensor, x: Tensor, dim: int,
                                    out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnSwiGluGrad: ``out = [dA, dB]`` along ``dim`` (the derivative of silu(A) * B).

    Args:
        yGrad: x's shape with dim halved, x's dtype, contiguous, non-empty.
        x: the forward's input (see :func:`aclnnSwiGluGetWorkspaceSize`).
        dim: the forward's split dim.
        out: written with dx (x's shape and dtype).

    Returns:
        ``(status, workspace_size, executor)``.
    """
    try:
        called = plan(plan_swiglu_grad, yGrad, x, dim, out=out)
    except OpError as e:
        return refused(e)
    rows, cols = called.shape.rows, called.shape.cols

    views = fit(yGrad, (rows, cols)), fit(x, (rows, 2 * cols)), -1

    def compute(impl, kw):
        return impl(*views, **kw)

    return prepare("swiglu_grad", x.device, called.backend, views, compute, {"out": out},
                   plan_swiglu_grad.spec.results(called.shape, yGrad, x, dim), inputs={"yGrad": yGrad, "x": x})


def aclnnSwiGluGrad(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnSwiGluGrad."""
    return execute("swiglu_grad", workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnSwiGluGetWorkspaceSize, aclnnSwiGlu,
        "aclnn_swi_glu.h",
        "const aclTensor *x, int64_t dim, aclTensor *out"),
    CFunction(
        aclnnSwiGluGradGetWorkspaceSize, aclnnSwiGluGrad,
        "aclnn_swi_glu_grad.h",
        "const aclTensor *yGrad, const aclTensor *x, int64_t dim, aclTensor *out"),
)
