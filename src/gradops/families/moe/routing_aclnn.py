"""aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeTokenPermuteWithRoutingMapGrad, aclnnMoeTokenUnpermuteWithRoutingMap
and aclnnMoeTokenUnpermuteWithRoutingMapGrad, two-phase (hicann/ops-transformer ``moe/moe_token_{permute,unpermute}
_with_routing_map{,_grad}``; docs/semantics.md §5b).

Validation is :mod:`gradops.families.moe.routing_contract` with ``cann=True`` (sorted indices int32, the floats CANN
lists) plus each out's shape and dtype: 161001 for a missing tensor (an optional out is required where its input is
given), 161002 for a dtype or shape, 561002 for a shape of the unpermute gradient (CANN finds those while tiling).
Values (sorted indices, a routing map row with more than K experts) are read when the executor runs: a bad one
returns 161002 from phase 2 with the outs untouched. The work is the PyTorch API's
(:mod:`gradops.families.moe.routing_ops`): its results are copied into the outs, so no workspace is needed.

The unpermute's extra outputs: with dropAndPad ``permuteTokenId, outIndex = sort(sortedIndices, stable)`` (values,
indices) and ``permuteProbs[r] = probs[sortedIndices[r], r // C]``, what its gradient takes back; without,
CANN leaves outIndex and permuteTokenId unwritten and gradops writes sortedIndices into both (torch_npu's autograd
passes ``(sorted_indices, sorted_indices)`` to the gradient then), and ``permuteProbs`` is each slot's probability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ... import backend, registry
from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, prepare, refused
from ...contract._common import fail, require_present, shape_text
from ...status import ACLNN_ERR_INNER_TILING_ERROR as TILING
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import ACLNN_ERR_PARAM_NULLPTR as NULLPTR
from ...status import OpError
from . import routing_contract as contract
from . import routing_ops as ops
from . import routing_reference as routing

PERMUTE, PERMUTE_GRAD = "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad"
UNPERMUTE, UNPERMUTE_GRAD = "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad"


def _outs(op: str, device: torch.device, expected: dict[str, tuple[Tensor | None, tuple, torch.dtype]],
          shapes: int = INVALID) -> None:
    """Each out present, on the inputs' device, of its shape and dtype (``shapes``: the status of a wrong shape)."""
    require_present(op, **{name: t for name, (t, _, _) in expected.items()})
    for name, (t, shape, dtype) in expected.items():
        if t.device != device:
            raise fail(INVALID, op, f"{name}.device", f"{device} (the inputs' device)", str(t.device))
        if t.dtype != dtype:
            raise fail(INVALID, op, f"{name}.dtype", str(dtype).removeprefix("torch."),
                       str(t.dtype).removeprefix("torch."))
        if tuple(t.shape) != tuple(shape):
            raise fail(shapes, op, f"{name}.shape", shape_text(shape), shape_text(t.shape))


def _choice(fn: Callable, device: torch.device) -> backend.Choice:
    """The work's implementation: the public function, under the name of the backend its kernels run on (the
    decision every op makes alike for the device; 561003 when ``GRADOPS_BACKEND`` names one that cannot run)."""
    return backend.Choice(backend.decide(registry.PROBE, device).name, fn, None)


def aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize(tokens: Tensor, routingMap: Tensor,
                                                       probsOptional: Tensor | None, numOutTokens: int,
                                                       dropAndPad: bool, permuteTokensOut: Tensor,
                                                       permuteProbsOutOptional: Tensor | None,
                                                       sortedIndicesOut: Tensor
                                                       ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenPermuteWithRoutingMap (see :func:`gradops.moe_token_permute_with_routing_map`).

    Args:
        tokens: (T, H) float16 / bfloat16 / float32. routingMap: (T, E) bool / int8.
        probsOptional: (T, E) or None. numOutTokens: K*T (C*E with dropAndPad), in [0, T*E].
        dropAndPad: the capacity mode.
        permuteTokensOut: (A, H) in tokens' dtype. permuteProbsOutOptional: (A,) in probs' dtype, required with
            probs. sortedIndicesOut: (T*K,) (C*E with dropAndPad) int32.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    try:
        shape = contract.check_moe_token_permute_with_routing_map(tokens, routingMap, probsOptional, numOutTokens,
                                                                 dropAndPad, cann=True)
        slots = shape.per * (shape.experts if dropAndPad else shape.tokens)
        outs = {"permuteTokensOut": (permuteTokensOut, (shape.rows, shape.hidden), tokens.dtype)}
        if probsOptional is not None:
            outs["permuteProbsOutOptional"] = (permuteProbsOutOptional, (shape.rows,), probsOptional.dtype)
        outs["sortedIndicesOut"] = (sortedIndicesOut, (slots,), torch.int32)
        _outs(PERMUTE, tokens.device, outs)
        choice = _choice(ops.moe_token_permute_with_routing_map, tokens.device)
    except OpError as e:
        return refused(e)

    def compute(impl, kw):  # the outs (kw["out"], in the outs' order) hold no probs without probs: a placeholder
        if probsOptional is None and "out" in kw:
            kw = {**kw, "out": (kw["out"][0], tokens.new_empty(0), kw["out"][1])}
        permuted, permuted_probs, sorted_indices = impl(tokens, routingMap, probsOptional, numOutTokens, dropAndPad,
                                                        **kw)
        return (permuted, sorted_indices) if probsOptional is None else (permuted, permuted_probs, sorted_indices)

    inputs = {"tokens": tokens, "routingMap": routingMap}
    if probsOptional is not None:
        inputs["probsOptional"] = probsOptional
    return prepare(PERMUTE, tokens.device, choice, (), compute, {name: t for name, (t, _, _) in outs.items()},
                   inputs=inputs)


def aclnnMoeTokenPermuteWithRoutingMap(workspace, workspaceSize: int, executor: aclOpExecutor | None,
                                       stream=None) -> int:
    """Phase 2 of aclnnMoeTokenPermuteWithRoutingMap."""
    return execute(PERMUTE, workspace, workspaceSize, executor, stream)


def aclnnMoeTokenPermuteWithRoutingMapGradGetWorkspaceSize(permutedTokenOutputGrad: Tensor,
                                                           permutedProbsOutputGradOptional: Tensor | None,
                                                           sortedIndices: Tensor, routingMapOptional: Tensor | None,
                                                           numExperts: int, tokensNum: int, dropAndPad: bool,
                                                           tokensGradOut: Tensor, probsGradOutOptional: Tensor | None
                                                           ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenPermuteWithRoutingMapGrad (see :func:`gradops.moe_token_permute_with_routing_map_grad`).

    Args:
        permutedTokenOutputGrad: (A, H). permutedProbsOutputGradOptional: (A,) or None. sortedIndices: the
            forward's, int32. routingMapOptional: the forward's (T, E) map (required for the probs' gradient
            without dropAndPad). numExperts: E. tokensNum: T. dropAndPad: the forward's mode.
        tokensGradOut: (T, H) in the gradient's dtype. probsGradOutOptional: (T, E) in the probs gradient's
            dtype, required with it.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    grad, grad_probs = permutedTokenOutputGrad, permutedProbsOutputGradOptional
    try:
        shape = contract.check_moe_token_permute_with_routing_map_grad(grad, grad_probs, sortedIndices,
                                                                      routingMapOptional, numExperts, tokensNum,
                                                                      dropAndPad, cann=True)
        outs = {"tokensGradOut": (tokensGradOut, (shape.tokens, shape.hidden), grad.dtype)}
        if grad_probs is not None:
            outs["probsGradOutOptional"] = (probsGradOutOptional, (shape.tokens, numExperts), grad_probs.dtype)
        _outs(PERMUTE_GRAD, grad.device, outs)
        choice = _choice(ops.moe_token_permute_with_routing_map_grad, grad.device)
    except OpError as e:
        return refused(e)

    def compute(impl, kw):
        if grad_probs is None and "out" in kw:  # one out: the second result is the empty placeholder
            kw = {**kw, "out": (kw["out"], grad.new_empty(0))}
        dtokens, dprobs = impl(grad, grad_probs, sortedIndices, routingMapOptional, numExperts, tokensNum, dropAndPad,
                               **kw)
        return (dtokens,) if grad_probs is None else (dtokens, dprobs)

    inputs = {name: t for name, t in (("permutedTokenOutputGrad", grad),
                                      ("permutedProbsOutputGradOptional", grad_probs), ("sortedIndices", sortedIndices),
                                      ("routingMapOptional", routingMapOptional)) if t is not None}
    return prepare(PERMUTE_GRAD, grad.device, choice, (), compute, {name: t for name, (t, _, _) in outs.items()},
                   inputs=inputs)


def aclnnMoeTokenPermuteWithRoutingMapGrad(workspace, workspaceSize: int, executor: aclOpExecutor | None,
                                           stream=None) -> int:
    """Phase 2 of aclnnMoeTokenPermuteWithRoutingMapGrad."""
    return execute(PERMUTE_GRAD, workspace, workspaceSize, executor, stream)


def _restore_shape(op: str, restore_shape: Sequence[int] | None, probs: Tensor | None, routing_map: Tensor | None,
                   hidden: int) -> Sequence[int]:
    """restoreShapeOptional, or (T, H) from probs / the routing map where it is None."""
    if restore_shape is not None:
        return restore_shape
    known = probs if probs is not None else routing_map
    if known is None or not isinstance(known, Tensor) or known.dim() != 2:
        raise fail(NULLPTR, op, "restore_shape", "(T, H) (or probs / routingMap to give T)", "None")
    return (known.shape[0], hidden)


def aclnnMoeTokenUnpermuteWithRoutingMapGetWorkspaceSize(permutedTokens: Tensor, sortedIndices: Tensor,
                                                         routingMapOptional: Tensor | None,
                                                         probsOptional: Tensor | None, paddedMode: bool,
                                                         restoreShapeOptional: Sequence[int] | None,
                                                         unpermutedTokens: Tensor, outIndex: Tensor | None,
                                                         permuteTokenId: Tensor | None, permuteProbs: Tensor | None
                                                         ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenUnpermuteWithRoutingMap (see :func:`gradops.moe_token_unpermute_with_routing_map`;
    ``paddedMode`` is the permute's dropAndPad).

    Args:
        permutedTokens: (A, H). sortedIndices: the permute's, int32. routingMapOptional: (T, E), required with
            probs without paddedMode. probsOptional: (T, E) or None. restoreShapeOptional: (T, H), or None where
            probs or the map give T.
        unpermutedTokens: (T, H) in permutedTokens' dtype. outIndex, permuteTokenId: (n,) int32 each (n =
            sortedIndices' length), or None. permuteProbs: (n,) in probs' dtype, or None.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    try:
        require_present(UNPERMUTE, permuted_tokens=permutedTokens, sorted_indices=sortedIndices)
        restore = _restore_shape(UNPERMUTE, restoreShapeOptional, probsOptional, routingMapOptional,
                                 permutedTokens.shape[-1])
        shape = contract.check_moe_token_unpermute_with_routing_map(permutedTokens, sortedIndices, restore,
                                                                   probsOptional, routingMapOptional, paddedMode,
                                                                   cann=True)
        n = sortedIndices.numel()
        outs = {"unpermutedTokens": (unpermutedTokens, (shape.tokens, shape.hidden), permutedTokens.dtype)}
        for name, t in (("outIndex", outIndex), ("permuteTokenId", permuteTokenId)):
            if t is not None:
                outs[name] = (t, (n,), torch.int32)
        if permuteProbs is not None and probsOptional is not None:
            outs["permuteProbs"] = (permuteProbs, (n,), probsOptional.dtype)
        _outs(UNPERMUTE, permutedTokens.device, outs)
        choice = _choice(ops.moe_token_unpermute_with_routing_map, permutedTokens.device)
    except OpError as e:
        return refused(e)

    def compute(impl, kw):  # the auxiliary outputs are copied in (prepare writes what it does not get as a view)
        unpermuted = impl(permutedTokens, sortedIndices, restore, probsOptional, routingMapOptional, paddedMode)
        results = {"unpermutedTokens": unpermuted}
        if paddedMode:
            token_id, index = torch.sort(sortedIndices, stable=True)
            results["outIndex"], results["permuteTokenId"] = index.int(), token_id.int()
        else:
            results["outIndex"] = results["permuteTokenId"] = sortedIndices
        if probsOptional is not None:
            results["permuteProbs"] = routing.slot_probs(sortedIndices, probsOptional, routingMapOptional, paddedMode)
        values = tuple(results[name] for name in outs)
        views = kw.get("out")  # the outs' views where the executor hands them over: written here
        for view, value in zip(views if isinstance(views, tuple) else (views,) if views is not None else (), values):
            view.copy_(value.reshape(view.shape))
        return values

    inputs = {name: t for name, t in (("permutedTokens", permutedTokens), ("sortedIndices", sortedIndices),
                                      ("routingMapOptional", routingMapOptional), ("probsOptional", probsOptional))
              if t is not None}
    return prepare(UNPERMUTE, permutedTokens.device, choice, (), compute, {name: t for name, (t, _, _) in outs.items()},
                   inputs=inputs)


def aclnnMoeTokenUnpermuteWithRoutingMap(workspace, workspaceSize: int, executor: aclOpExecutor | None,
                                         stream=None) -> int:
    """Phase 2 of aclnnMoeTokenUnpermuteWithRoutingMap."""
    return execute(UNPERMUTE, workspace, workspaceSize, executor, stream)


def _sorted_from(out_index: Tensor, token_id: Tensor) -> Tensor:
    """Drop mode: the token of each permuted row, from the unpermute's ``(outIndex, permuteTokenId)`` (row i of the
    token-sorted order is permuted row ``outIndex[i]``, of token ``permuteTokenId[i]``); outIndex must be a
    permutation of [0, n), read here before anything is written with it."""
    n = out_index.numel()
    index = out_index.long()
    if n and not torch.equal(torch.sort(index).values, torch.arange(n, device=index.device)):
        outside = (index < 0) | (index >= n)
        first = torch.zeros(n, dtype=torch.bool, device=index.device)
        if not bool(outside.any()):  # a repeated row: its second mention
            first[torch.sort(index, stable=True).indices[1:][torch.sort(index).values.diff() == 0]] = True
        bad = int((outside | first).nonzero()[0, 0])
        raise fail(INVALID, UNPERMUTE_GRAD, "out_index", f"a permutation of [0, {n})",
                   f"{int(index[bad])} at position {bad}")
    sorted_indices = torch.empty_like(token_id)
    sorted_indices[index] = token_id
    return sorted_indices


def aclnnMoeTokenUnpermuteWithRoutingMapGradGetWorkspaceSize(unpermutedTokensGrad: Tensor, outIndex: Tensor,
                                                             permuteTokenId: Tensor, routingMapOptional: Tensor | None,
                                                             permutedTokensOptional: Tensor | None,
                                                             probsOptional: Tensor | None, dropAndPad: bool,
                                                             restoreShapeOptional: Sequence[int] | None,
                                                             permutedTokensGradOut: Tensor,
                                                             probsGradOutOptional: Tensor | None
                                                             ) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnMoeTokenUnpermuteWithRoutingMapGrad (see
    :func:`gradops.moe_token_unpermute_with_routing_map_grad`).

    Args:
        unpermutedTokensGrad: (T, H). outIndex, permuteTokenId: the unpermute's (with dropAndPad; without, the
            permute's sortedIndices in both, as torch_npu passes them), int32. routingMapOptional: (T, E), required
            with probs without dropAndPad. permutedTokensOptional: the forward's (A, H), required with probs.
            probsOptional: (T, E) or None. restoreShapeOptional: ignored (the gradient gives (T, H)).
        permutedTokensGradOut: (A, H) in permutedTokens' dtype. probsGradOutOptional: (T, E) in probs' dtype,
            required with probs.

    Returns:
        ``(status, workspace_size, executor)``: shapes that do not fit give 561002, as CANN's doc says.
    """
    grad, probs, permuted = unpermutedTokensGrad, probsOptional, permutedTokensOptional
    if permuted is None and probs is None and isinstance(permutedTokensGradOut, Tensor):
        # Read for its shape and dtype only: a stand-in with one element of storage behind the out's metadata.
        permuted = torch.empty(1, dtype=permutedTokensGradOut.dtype, device=permutedTokensGradOut.device).expand(
            permutedTokensGradOut.shape)
    try:
        require_present(UNPERMUTE_GRAD, out_index=outIndex, permute_token_id=permuteTokenId)
        shape = contract.check_moe_token_unpermute_with_routing_map_grad(permuted, grad, outIndex, probs,
                                                                        routingMapOptional, dropAndPad, cann=True)
        if permuteTokenId.dtype != torch.int32 or permuteTokenId.shape != outIndex.shape:
            given = f"{str(permuteTokenId.dtype).removeprefix('torch.')} of shape {shape_text(permuteTokenId.shape)}"
            raise fail(INVALID, UNPERMUTE_GRAD, "permute_token_id", f"int32 of shape {shape_text(outIndex.shape)}",
                       given)
        outs = {"permutedTokensGradOut": (permutedTokensGradOut, (shape.rows, shape.hidden), permuted.dtype)}
        if probs is not None:
            outs["probsGradOutOptional"] = (probsGradOutOptional, (shape.tokens, shape.experts), probs.dtype)
        _outs(UNPERMUTE_GRAD, grad.device, outs, TILING)
        choice = _choice(ops.moe_token_unpermute_with_routing_map_grad, grad.device)
    except OpError as e:
        return refused(e)

    def compute(impl, kw):
        sorted_indices = _sorted_from(outIndex, permuteTokenId) if dropAndPad else outIndex
        if probs is None and "out" in kw:  # one out: the second result is the empty placeholder
            kw = {**kw, "out": (kw["out"], grad.new_empty(0, dtype=permuted.dtype))}
        dpermuted, dprobs = impl(permuted, grad, sorted_indices, probs, routingMapOptional, dropAndPad, **kw)
        return (dpermuted,) if probs is None else (dpermuted, dprobs)

    inputs = {name: t for name, t in (("unpermutedTokensGrad", grad), ("outIndex", outIndex),
                                      ("permuteTokenId", permuteTokenId), ("routingMapOptional", routingMapOptional),
                                      ("permutedTokensOptional", permutedTokensOptional), ("probsOptional", probs))
              if t is not None}
    return prepare(UNPERMUTE_GRAD, grad.device, choice, (), compute, {name: t for name, (t, _, _) in outs.items()},
                   inputs=inputs)


def aclnnMoeTokenUnpermuteWithRoutingMapGrad(workspace, workspaceSize: int, executor: aclOpExecutor | None,
                                             stream=None) -> int:
    """Phase 2 of aclnnMoeTokenUnpermuteWithRoutingMapGrad."""
    return execute(UNPERMUTE_GRAD, workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize, aclnnMoeTokenPermuteWithRoutingMap,
        "aclnn_moe_token_permute_with_routing_map.h",
        "const aclTensor *tokens, const aclTensor *routingMap, const aclTensor *probsOptional, "
        "int64_t numOutTokens, bool dropAndPad, aclTensor *permuteTokensOut, aclTensor *permuteProbsOutOptional, "
        "aclTensor *sortedIndicesOut"),
    CFunction(
        aclnnMoeTokenPermuteWithRoutingMapGradGetWorkspaceSize, aclnnMoeTokenPermuteWithRoutingMapGrad,
        "aclnn_moe_token_permute_with_routing_map_grad.h",
        "const aclTensor *permutedTokenOutputGrad, const aclTensor *permutedProbsOutputGradOptional, "
        "const aclTensor *sortedIndices, const aclTensor *routingMapOptional, int64_t numExperts, "
        "int64_t tokensNum, bool dropAndPad, aclTensor *tokensGradOut, aclTensor *probsGradOutOptional"),
    CFunction(
        aclnnMoeTokenUnpermuteWithRoutingMapGetWorkspaceSize, aclnnMoeTokenUnpermuteWithRoutingMap,
        "aclnn_moe_token_unpermute_with_routing_map.h",
        "const aclTensor *permutedTokens, const aclTensor *sortedIndices, const aclTensor *routingMapOptional, "
        "const aclTensor *probsOptional, bool paddedMode, const aclIntArray *restoreShapeOptional, "
        "aclTensor *unpermutedTokens, aclTensor *outIndex, aclTensor *permuteTokenId, aclTensor *permuteProbs"),
    CFunction(
        aclnnMoeTokenUnpermuteWithRoutingMapGradGetWorkspaceSize, aclnnMoeTokenUnpermuteWithRoutingMapGrad,
        "aclnn_moe_token_unpermute_with_routing_map_grad.h",
        "const aclTensor *unpermutedTokensGrad, const aclTensor *outIndex, const aclTensor *permuteTokenId, "
        "const aclTensor *routingMapOptional, const aclTensor *permutedTokensOptional, "
        "const aclTensor *probsOptional, bool dropAndPad, const aclIntArray *restoreShapeOptional, "
        "aclTensor *permutedTokensGradOut, aclTensor *probsGradOutOptional"),
)
