"""aclnnRmsNorm and aclnnRmsNormGrad, two-phase (seed 000).

Validation is :mod:`gradops.families.rms_norm.contract` with ``cann=True``: what the seed refuses and the PyTorch API
accepts is refused here, i.e. empty tensors (561002) and non-contiguous inputs (161002); shape rules are
tiling checks in CANN and return 561002. Out tensors may be non-contiguous views (results go through a buffer in
the workspace and are copied in; see :func:`gradops.aclnn._executor.prepare`).
"""

from __future__ import annotations

from torch import Tensor

from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, plan, prepare, refused
from ...ops._direct import fit
from ...status import OpError
from .ops import plan_rms_norm, plan_rms_norm_grad


def aclnnRmsNormGradGetWorkspaceSize(dy: Tensor, x: Tensor, rstd: Tensor, gamma: Tensor, dxOut: Tensor,
                                     dgammaOut: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnRmsNormGrad: ``dx = (dy*g - x*rstd*mean(dy*g*x*rstd)) * rstd``, ``dgamma = sum(dy*x*rstd)``.

    Args:
        dy, x: same shape (1-8 dims) and dtype (float16 / bfloat16 / float32), contiguous.
        rstd: float32, ``x.shape[:k]`` (k = x.dim() - gamma.dim()), a prefix of it or its keepdim form.
        gamma: ``x.shape[k:]``; dtype of x, or float32 with half x.
        dxOut: written with dx (dy's dtype and shape). dgammaOut: written with dgamma (float32, gamma's shape).

    Returns:
        ``(status, workspace_size, executor)``: 0 and an executor, or (161001 | 161002 | 561002, 0, None).
    """
    try:
        called = plan(plan_rms_norm_grad, dy, x, rstd, gamma, dx=dxOut, dgamma=dgammaOut)
    except OpError as e:
        return refused(e)
    rows, cols, _ = called.shape
    # Views made once: phase 2 runs only on tensors whose layout phase 1 saw (gradops.aclnn._executor._changed).
    views = fit(dy, (rows, cols)), fit(x, (rows, cols)), fit(rstd, (rows,)), fit(gamma, (cols,))

    def compute(impl, kw):
        return impl(*views, **kw)

    return prepare("rms_norm_grad", x.device, called.backend, views, compute, {"dxOut": dxOut, "dgammaOut": dgammaOut},
                   plan_rms_norm_grad.spec.results(called.shape, dy, x, rstd, gamma),
                   inputs={"dy": dy, "x": x, "rstd": rstd, "gamma": gamma})


def aclnnRmsNormGrad(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnRmsNormGrad: run ``executor`` on ``stream`` (None or a torch.cuda.Stream)."""
    return execute("rms_norm_grad", workspace, workspaceSize, executor, stream)


def aclnnRmsNormGetWorkspaceSize(x: Tensor, gamma: Tensor, epsilon: float, yOut: Tensor,
                                 rstdOut: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnRmsNorm: ``rstd = 1/sqrt(mean(x^2) + epsilon)`` over gamma's dims, ``y = x*rstd*gamma``.

    Args:
        x: 1-8 dims, float16 / bfloat16 / float32. gamma: ``x.shape[k:]``, dtype of x or float32 with half x.
        epsilon: float.
        yOut: written with y (x's dtype and shape). rstdOut: float32, ``x.shape[:k]`` or its keepdim form.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    try:
        called = plan(plan_rms_norm, x, gamma, epsilon, y=yOut, rstd=rstdOut)
    except OpError as e:
        return refused(e)
    rows, cols, _ = called.shape
    views = fit(x, (rows, cols)), fit(gamma, (cols,)), float(epsilon)

    def compute(impl, kw):
        return impl(*views, **kw)

    return prepare("rms_norm", x.device, called.backend, views, compute, {"yOut": yOut, "rstdOut": rstdOut},
                   plan_rms_norm.spec.results(called.shape, x, gamma, epsilon), inputs={"x": x, "gamma": gamma})


def aclnnRmsNorm(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnRmsNorm."""
    return execute("rms_norm", workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnRmsNormGetWorkspaceSize, aclnnRmsNorm,
        "aclnn_rms_norm.h",
        "const aclTensor *x, const aclTensor *gamma, double epsilon, const aclTensor *yOut, const aclTensor *rstdOut"),
    CFunction(
        aclnnRmsNormGradGetWorkspaceSize, aclnnRmsNormGrad,
        "aclnn_rms_norm_grad.h",
        "const aclTensor *dy, const aclTensor *x, const aclTensor *rstd, const aclTensor *gamma, "
        "const aclTensor *dxOut, const aclTensor *dgammaOut"),
)
