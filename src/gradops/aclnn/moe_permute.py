"""aclnnMoeTokenPermute and aclnnMoeTokenPermuteGrad, two-phase (seed 004).

Validation is :mod:`gradops.contract.moe_permute` with ``cann=True``: sortedIndices / sortedIndicesOut are
int32, outputs have the input's dtype, paddedMode must be false, numTopk in [1, 512]; shapes CANN leaves
undefined are refused with 161002. Sorted indices are read when the executor runs: entries outside [0, T*K)
return 161002 from phase 2 and leave ``out`` untouched.

CANN's ``sortedIndices[t*K + k]`` is the DESTINATION row of token t's k-th copy (the inverse of Megatron's
``sorted_indices``); see :func:`gradops.moe_token_permute`.
"""

from __future__ import annotations

from torch import Tensor

from ..ops.moe_permute import plan_moe_token_permute, plan_moe_token_permute_grad
from ..status import OpError
from ._executor import aclOpExecutor, execute, plan, prepare, refused


def aclnnMoeTokenPermuteGradGetWorkspaceSize(permutedOutputGrad: Tensor, sortedIndices: Tensor, numTopk: int,
                                             paddedModeOptional: bool,
                                             out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenPermuteGrad: ``out[t] = sum_{k<K} permutedOutputGrad[sortedIndices[t*K + k]]``.

    Args:
        permutedOutputGrad: (A, H), A <= T*K rows, float16 / bfloat16 / float32.
        sortedIndices: (T*K,) int32, CANN's convention.
        numTopk: K in [1, 512].
        paddedModeOptional: must be False.
        out: (T, H) in the gradient's dtype; written by phase 2.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    try:
        choice = plan(plan_moe_token_permute_grad, permutedOutputGrad, sortedIndices, numTopk, paddedModeOptional,
                      out=out).backend
    except OpError as e:
        return refused(e)
    args = (permutedOutputGrad, sortedIndices, numTopk)

    def compute(impl, kw):  # the backend tests sortedIndices (a permutation of [0, T*K)) where it reads them
        return impl(*args, **kw)

    return prepare("moe_token_permute_grad", permutedOutputGrad.device, choice, args, compute, {"out": out},
                   inputs={"permutedOutputGrad": permutedOutputGrad, "sortedIndices": sortedIndices})


def aclnnMoeTokenPermuteGrad(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnMoeTokenPermuteGrad."""
    return execute("moe_token_permute_grad", workspace, workspaceSize, executor, stream)


def aclnnMoeTokenPermuteGetWorkspaceSize(tokens: Tensor, indices: Tensor, numOutTokens: int, paddedMode: bool,
                                         permuteTokensOut: Tensor,
                                         sortedIndicesOut: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenPermute: ``sortedIndicesOut = argsort(argsort(flatten(indices), stable))`` (int32),
    ``permuteTokensOut[sortedIndicesOut[i]] = tokens[i // K]`` for the first ``numOutTokens`` rows.

    Args:
        tokens: (T, H), float16 / bfloat16 / float32.
        indices: (T, K) or (T,) expert ids, int32 / int64, K <= 512.
        numOutTokens: rows kept (0 keeps all T*K; negative counts from the end, as a Python slice).
        paddedMode: must be False.
        permuteTokensOut: (rows kept, H) in tokens' dtype. sortedIndicesOut: (T*K,) int32.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    try:
        called = plan(plan_moe_token_permute, tokens, indices, numOutTokens, paddedMode, permuted=permuteTokensOut,
                      sorted_indices=sortedIndicesOut)
    except OpError as e:
        return refused(e)
    args = (tokens, indices, called.shape.rows)

    def compute(impl, kw):
        return impl(*args, **kw)

    return prepare("moe_token_permute", tokens.device, called.backend, args, compute,
                   {"permuteTokensOut": permuteTokensOut, "sortedIndicesOut": sortedIndicesOut},
                   inputs={"tokens": tokens, "indices": indices})


def aclnnMoeTokenPermute(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnMoeTokenPermute."""
    return execute("moe_token_permute", workspace, workspaceSize, executor, stream)
