"""aclnnMoeTokenPermute, aclnnMoeTokenPermuteGrad (seed 004), aclnnMoeTokenUnpermute and aclnnMoeTokenUnpermuteGrad
(ops-transformer ``moe/moe_token_unpermute{,_grad}``), two-phase.

Validation is :mod:`gradops.families.moe.contract` with ``cann=True``: sortedIndices / sortedIndicesOut are
int32, outputs have the input's dtype, paddedMode must be false, numTopk in [1, 512]; shapes CANN leaves
undefined are refused with 161002, and the unpermute pair's probs that do not give T*K = sortedIndices' length
(or more permuted rows than that) with 561002, where CANN's tiling finds them. Sorted indices are read when the
executor runs: entries outside [0, T*K)
return 161002 from phase 2 and leave ``out`` untouched.

CANN's ``sortedIndices[t*K + k]`` is the DESTINATION row of token t's k-th copy (the inverse of Megatron's
``sorted_indices``); see :func:`gradops.moe_token_permute`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, plan, prepare, refused
from ...status import OpError
from .contract import check_restore_shape
from .ops import (
    plan_moe_token_permute,
    plan_moe_token_permute_grad,
    plan_moe_token_unpermute,
    plan_moe_token_unpermute_grad,
)


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


def aclnnMoeTokenUnpermuteGetWorkspaceSize(permutedTokens: Tensor, sortedIndices: Tensor, probsOptional: Tensor | None,
                                           paddedMode: bool, restoreShapeOptional: Sequence[int] | None,
                                           out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenUnpermute: ``out[t] = sum_{k<K} probs[t, k] * permutedTokens[sortedIndices[t*K + k]]``
    (fp32, k order; K = probs.shape[1], 1 without probs; indices >= A add nothing).

    Args:
        permutedTokens: (A, H), A <= T*K, float16 / bfloat16 / float32.
        sortedIndices: (T*K,) int32, CANN's convention, a permutation of [0, T*K) (else 161002 from phase 2).
        probsOptional: (T, K) float16 / bfloat16 / float32, or None. paddedMode: must be False.
        restoreShapeOptional: read by CANN only in padded mode: None or ints, ignored.
        out: (T, H) in permutedTokens' dtype.

    Returns:
        ``(status, workspace_size, executor)``: 561002 when probs' T*K is not sortedIndices' length.
    """
    try:
        check_restore_shape("moe_token_unpermute", restoreShapeOptional)
        choice = plan(plan_moe_token_unpermute, permutedTokens, sortedIndices, probsOptional, paddedMode,
                      out=out).backend
    except OpError as e:
        return refused(e)
    args = (permutedTokens, sortedIndices, probsOptional)

    def compute(impl, kw):  # the backend tests sortedIndices (a permutation of [0, T*K)) before it reads with them
        return impl(*args, **kw)

    inputs = {"permutedTokens": permutedTokens, "sortedIndices": sortedIndices}
    if probsOptional is not None:
        inputs["probsOptional"] = probsOptional
    return prepare("moe_token_unpermute", permutedTokens.device, choice, args, compute, {"out": out}, inputs=inputs)


def aclnnMoeTokenUnpermute(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnMoeTokenUnpermute."""
    return execute("moe_token_unpermute", workspace, workspaceSize, executor, stream)


def aclnnMoeTokenUnpermuteGradGetWorkspaceSize(permutedTokensOptional: Tensor | None, unpermutedTokensGrad: Tensor,
                                               sortedIndices: Tensor, probsOptional: Tensor | None, paddedMode: bool,
                                               restoreShapeOptional: Sequence[int] | None,
                                               permutedTokensGradOut: Tensor, probsGradOut: Tensor | None
                                               ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenUnpermuteGrad: ``permutedTokensGradOut[sortedIndices[i]] = unpermutedTokensGrad[i // K]
    * probs.flat[i]`` (rows < A) and ``probsGradOut[t, k] = <unpermutedTokensGrad[t], permutedTokens[sortedIndices[t*K
    + k]]>`` (0 where the row is >= A), in fp32, rounded once.

    Args:
        permutedTokensOptional: the forward's (A, H) input; needed with probs only (None: A and the dtype come
            from permutedTokensGradOut).
        unpermutedTokensGrad: (T, H) float16 / bfloat16 / float32.
        sortedIndices: (T*K,) int32, a permutation of [0, T*K) (else 161002 from phase 2).
        probsOptional: (T, K) or None (K = 1). paddedMode: must be False. restoreShapeOptional: ignored.
        permutedTokensGradOut: (A, H) in permutedTokens' dtype. probsGradOut: (T, K) in probs' dtype; needed with
            probs only.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    permuted = permutedTokensOptional
    if permuted is None and probsOptional is None and isinstance(permutedTokensGradOut, Tensor):
        # Read for its shape and dtype only: a stand-in with one element of storage behind the out's metadata.
        permuted = torch.empty(1, dtype=permutedTokensGradOut.dtype, device=permutedTokensGradOut.device).expand(
            permutedTokensGradOut.shape)
    try:
        check_restore_shape("moe_token_unpermute_grad", restoreShapeOptional)
        choice = plan(plan_moe_token_unpermute_grad, permuted, unpermutedTokensGrad, sortedIndices, probsOptional,
                      paddedMode, grad_permuted=permutedTokensGradOut, grad_probs=probsGradOut).backend
    except OpError as e:
        return refused(e)
    args = (permuted, unpermutedTokensGrad, sortedIndices, probsOptional)

    def compute(impl, kw):
        if probsOptional is None and "out" in kw:  # the backends write a pair: no probs gradient, an empty second
            kw = {**kw, "out": (kw["out"], permutedTokensGradOut.new_empty(0))}
        return impl(*args, **kw)

    outs = {"permutedTokensGradOut": permutedTokensGradOut}
    if probsOptional is not None:
        outs["probsGradOut"] = probsGradOut
    inputs = {"unpermutedTokensGrad": unpermutedTokensGrad, "sortedIndices": sortedIndices}
    inputs.update({name: t for name, t in (("permutedTokensOptional", permutedTokensOptional),
                                           ("probsOptional", probsOptional)) if t is not None})
    return prepare("moe_token_unpermute_grad", unpermutedTokensGrad.device, choice, args, compute, outs,
                   inputs=inputs)


def aclnnMoeTokenUnpermuteGrad(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnMoeTokenUnpermuteGrad."""
    return execute("moe_token_unpermute_grad", workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnMoeTokenPermuteGetWorkspaceSize, aclnnMoeTokenPermute,
        "aclnn_moe_token_permute.h",
        "const aclTensor *tokens, const aclTensor *indices, int64_t numOutTokens, bool paddedMode, "
        "aclTensor *permuteTokensOut, aclTensor *sortedIndicesOut"),
    CFunction(
        aclnnMoeTokenPermuteGradGetWorkspaceSize, aclnnMoeTokenPermuteGrad,
        "aclnn_moe_token_permute_grad.h",
        "const aclTensor *permutedOutputGrad, const aclTensor *sortedIndices, int64_t numTopk, "
        "bool paddedModeOptional, aclTensor *out"),
    CFunction(
        aclnnMoeTokenUnpermuteGetWorkspaceSize, aclnnMoeTokenUnpermute,
        "aclnn_moe_token_unpermute.h",
        "const aclTensor *permutedTokens, const aclTensor *sortedIndices, const aclTensor *probsOptional, "
        "bool paddedMode, const aclIntArray *restoreShapeOptional, aclTensor *out"),
    CFunction(
        aclnnMoeTokenUnpermuteGradGetWorkspaceSize, aclnnMoeTokenUnpermuteGrad,
        "aclnn_moe_token_unpermute_grad.h",
        "const aclTensor *permutedTokensOptional, const aclTensor *unpermutedTokensGrad, "
        "const aclTensor *sortedIndices, const aclTensor *probsOptional, bool paddedMode, "
        "const aclIntArray *restoreShapeOptional, aclTensor *permutedTokensGradOut, aclTensor *probsGradOut"),
)
