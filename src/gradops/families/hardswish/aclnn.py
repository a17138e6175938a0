"""aclnnHardswishBackward (seed 002) and aclnnHardswish, two-phase.

Validation is :mod:`gradops.families.hardswish.contract` with ``cann=True``: gradOutput, self and out share dtype
(float16 / bfloat16 / float32) and shape (no broadcasting), at most 8 dims; 0-d, empty and non-contiguous
tensors are supported (an empty input succeeds and writes nothing).
"""

from __future__ import annotations

from torch import Tensor

from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, plan, prepare, refused
from ...status import OpError
from .ops import plan_hardswish, plan_hardswish_backward


def aclnnHardswishBackwardGetWorkspaceSize(gradOutput: Tensor, self: Tensor,
                                           out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnHardswishBackward: ``out = gradOutput * d(self)``, ``d = 0`` below -3, ``self/3 + 0.5`` on
    the CLOSED interval [-3, 3], 1 above 3.

    Returns:
        ``(status, workspace_size, executor)``: 161001 for a None tensor, 161002 for a dtype or shape mismatch.
    """
    try:
        choice = plan(plan_hardswish_backward, gradOutput, self, out=out).backend
    except OpError as e:
        return refused(e)

    def compute(impl, kw):
        return impl(gradOutput, self, **kw)

    return prepare("hardswish_backward", self.device, choice, (gradOutput, self), compute, {"out": out},
                   inputs={"gradOutput": gradOutput, "self": self})


def aclnnHardswishBackward(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnHardswishBackward."""
    return execute("hardswish_backward", workspace, workspaceSize, executor, stream)


def aclnnHardswishGetWorkspaceSize(self: Tensor, out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnHardswish: ``out = self * clamp(self + 3, 0, 6) / 6`` (0 at or below -3, self above 3).

    Returns:
        ``(status, workspace_size, executor)``: 161001 for a None tensor, 161002 for a dtype or shape mismatch.
    """
    try:
        choice = plan(plan_hardswish, self, out=out).backend
    except OpError as e:
        return refused(e)

    def compute(impl, kw):
        return impl(self, **kw)

    return prepare("hardswish", self.device, choice, (self,), compute, {"out": out}, inputs={"self": self})


def aclnnHardswish(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnHardswish."""
    return execute("hardswish", workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnHardswishBackwardGetWorkspaceSize, aclnnHardswishBackward,
        "aclnn_hardswish_backward.h",
        "const aclTensor *gradOutput, const aclTensor *self, aclTensor *out"),
    CFunction(
        aclnnHardswishGetWorkspaceSize, aclnnHardswish,
        "aclnn_hardswish.h",
        "const aclTensor *self, const aclTensor *out"),
)
