"""The surfaces of the routing-map MoE ops and the unpermute pair beyond their values (those are
tests/test_moe_routing.py's, against independent float64 references): the torch.library ops (opcheck, compile
without recompiles) and the aclnn names (good calls equal the PyTorch API, each status the docs give).
"""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops import aclnn
from gradops.status import ACLNN_ERR_INNER_TILING_ERROR as TILING
from gradops.status import ACLNN_ERR_PARAM_INVALID as INVALID
from gradops.status import ACLNN_ERR_PARAM_NULLPTR as NULL

T, E, H = 6, 4, 3


def _case(seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    routing_map = torch.rand(T, E, generator=gen) < 0.5
    routing_map[0] = False  # routed nowhere
    return x, routing_map, torch.rand(T, E, generator=gen)


def _num_out(routing_map: torch.Tensor, drop: bool) -> int:
    return 2 * E if drop else int(routing_map.sum(1).max()) * T


# ------------------------------------------------------------------------------------------------ torch.library
@pytest.mark.parametrize("drop", [False, True], ids=["nodrop", "drop"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_opcheck(drop, with_probs):
    """Schema, fake kernel (shapes, strides), autograd registration and AOT dispatch of each of the four ops."""
    x, routing_map, probs = _case()
    probs = probs if with_probs else None
    n = _num_out(routing_map, drop)
    ops = torch.ops.gradops
    permuted, permuted_probs, sorted_indices = ops.moe_token_permute_with_routing_map(x, routing_map, probs, n, drop)
    grad_probs = None if probs is None else torch.randn_like(permuted_probs)
    calls = [
        (ops.moe_token_permute_with_routing_map,
         (x.requires_grad_(), routing_map, None if probs is None else probs.requires_grad_(), n, drop)),
        (ops.moe_token_permute_with_routing_map_grad,
         (torch.randn_like(permuted), grad_probs, sorted_indices, routing_map, E, T, drop)),
        (ops.moe_token_unpermute_with_routing_map,
         (permuted.detach().requires_grad_(), sorted_indices, [T, H], probs, routing_map, drop)),
        (ops.moe_token_unpermute_with_routing_map_grad,
         (permuted.detach(), torch.randn(T, H), sorted_indices, None if probs is None else probs.detach(),
          routing_map, drop)),
    ]
    for op, args in calls:
        torch.library.opcheck(op.default, args)


def test_a_compiled_moe_step_does_not_recompile():
    """permute -> experts -> unpermute under torch.compile(fullgraph=True): the same values and gradients as
    eager, and no recompilation on later steps (nothing the trace reads is gradops' mutable state)."""
    torch._dynamo.reset()

    def step(x, routing_map, probs, w):
        permuted, permuted_probs, sorted_indices = gradops.moe_token_permute_with_routing_map(
            x, routing_map, probs, 2 * x.shape[0])
        y = gradops.moe_token_unpermute_with_routing_map(permuted @ w, sorted_indices, x.shape, probs, routing_map)
        return y.square().sum() + permuted_probs.sum()

    compiled = torch.compile(step, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _steps(compiled, step)


def _steps(compiled, step):
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        x, scores = torch.randn(8, 4, generator=gen), torch.rand(8, E, generator=gen)
        routing_map = torch.zeros(8, E, dtype=torch.bool).scatter_(1, scores.topk(2).indices, True)
        w = torch.randn(4, 4, generator=gen)
        leaves = [[t.clone().requires_grad_() for t in (x, scores * routing_map, w)] for _ in range(2)]
        ours = compiled(leaves[0][0], routing_map, leaves[0][1], leaves[0][2])
        eager = step(leaves[1][0], routing_map, leaves[1][1], leaves[1][2])
        ours.backward()
        eager.backward()
        torch.testing.assert_close(ours, eager)
        for a, b in zip(leaves[0], leaves[1]):
            torch.testing.assert_close(a.grad, b.grad)


def test_dynamic_token_counts_compile_once():
    """With dynamic shapes, a new token count (a new batch or sequence length) reuses the graph: T stays symbolic
    through the ops' checks, results and saved context."""
    torch._dynamo.reset()

    def step(x, routing_map, probs):
        permuted, _, sorted_indices = gradops.moe_token_permute_with_routing_map(x, routing_map, probs,
                                                                                 2 * x.shape[0])
        return gradops.moe_token_unpermute_with_routing_map(permuted * 2, sorted_indices, x.shape, probs,
                                                            routing_map).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _token_counts(compiled)


def _token_counts(compiled):
    for tokens in (8, 12, 20):
        gen = torch.Generator().manual_seed(tokens)
        x, scores = torch.randn(tokens, 4, generator=gen), torch.rand(tokens, E, generator=gen)
        routing_map = torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, scores.topk(2).indices, True)
        leaf = x.clone().requires_grad_()
        compiled(leaf, routing_map, scores * routing_map).backward()
        torch.testing.assert_close(leaf.grad, 2 * (scores * routing_map).sum(1, keepdim=True).expand(-1, 4))


# ------------------------------------------------------------------------------------------------ aclnn
def _run(first, second, *args) -> int:
    status, size, executor = first(*args)
    if status:
        assert size == 0 and executor is None
        return status
    return second(torch.empty(size, dtype=torch.uint8) if size else None, size, executor, None)


@pytest.mark.parametrize("drop", [False, True], ids=["nodrop", "drop"])
def test_aclnn_routing_map_names_equal_the_pytorch_api(drop):
    x, routing_map, probs = _case(1)
    n = _num_out(routing_map, drop)
    permuted, permuted_probs, sorted_indices = gradops.moe_token_permute_with_routing_map(x, routing_map, probs, n,
                                                                                          drop)
    outs = [torch.full_like(t, -7) for t in (permuted, permuted_probs, sorted_indices)]
    assert _run(aclnn.aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize, aclnn.aclnnMoeTokenPermuteWithRoutingMap,
                x, routing_map, probs, n, drop, *outs) == 0
    for got, want in zip(outs, (permuted, permuted_probs, sorted_indices)):
        assert torch.equal(got, want)

    grad, grad_probs = torch.randn_like(permuted), torch.randn_like(permuted_probs)
    want = gradops.moe_token_permute_with_routing_map_grad(grad, grad_probs, sorted_indices, routing_map, E, T, drop)
    outs = [torch.empty_like(t) for t in want]
    assert _run(aclnn.aclnnMoeTokenPermuteWithRoutingMapGradGetWorkspaceSize,
                aclnn.aclnnMoeTokenPermuteWithRoutingMapGrad, grad, grad_probs, sorted_indices, routing_map, E, T,
                drop, *outs) == 0
    assert all(torch.equal(a, b) for a, b in zip(outs, want))

    y = gradops.moe_token_unpermute_with_routing_map(permuted, sorted_indices, (T, H), probs, routing_map, drop)
    out, out_index, token_id = torch.empty_like(y), torch.empty_like(sorted_indices), torch.empty_like(sorted_indices)
    slot_probs = torch.empty(sorted_indices.numel())
    assert _run(aclnn.aclnnMoeTokenUnpermuteWithRoutingMapGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermuteWithRoutingMap,
                permuted, sorted_indices, routing_map, probs, drop, (T, H), out, out_index, token_id, slot_probs) == 0
    assert torch.equal(out, y)
    if drop:  # the token-sorted order and each row's own probability (docs/semantics.md §5b)
        assert torch.equal(token_id, sorted_indices.sort(stable=True).values)
        assert torch.equal(sorted_indices[out_index.long()], token_id)
        assert torch.equal(slot_probs, permuted_probs)
    else:
        assert torch.equal(out_index, sorted_indices) and torch.equal(token_id, sorted_indices)

    dy = torch.randn(T, H)
    want = gradops.moe_token_unpermute_with_routing_map_grad(permuted, dy, sorted_indices, probs, routing_map, drop)
    outs = [torch.empty_like(t) for t in want]
    assert _run(aclnn.aclnnMoeTokenUnpermuteWithRoutingMapGradGetWorkspaceSize,
                aclnn.aclnnMoeTokenUnpermuteWithRoutingMapGrad, dy, out_index, token_id, routing_map, permuted, probs,
                drop, (T, H), *outs) == 0
    assert all(torch.equal(a, b) for a, b in zip(outs, want))


def test_aclnn_routing_map_statuses():
    x, routing_map, probs = _case(2)
    n = _num_out(routing_map, False)
    permuted, permuted_probs, sorted_indices = gradops.moe_token_permute_with_routing_map(x, routing_map, probs, n)
    first = aclnn.aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize
    outs = (torch.empty_like(permuted), torch.empty_like(permuted_probs), torch.empty_like(sorted_indices))
    assert first(None, routing_map, probs, n, False, *outs)[0] == NULL
    assert first(x, routing_map, probs, n, False, outs[0], None, outs[2])[0] == NULL  # probs given, its out not
    assert first(x, routing_map.float(), probs, n, False, *outs)[0] == INVALID
    assert first(x, routing_map, probs[:, :2], n, False, *outs)[0] == INVALID
    assert first(x, routing_map, probs, T * E + 1, False, *outs)[0] == INVALID  # numOutTokens past T*E
    assert first(x, routing_map, probs, n, False, outs[0][:-1], *outs[1:])[0] == INVALID
    assert first(x, routing_map, probs, n, False, *outs[:2], outs[2].long())[0] == INVALID
    assert "permuteProbsOutOptional" in aclnn.aclGetRecentErrMsg() or "sortedIndicesOut" in aclnn.aclGetRecentErrMsg()

    grad_first = aclnn.aclnnMoeTokenPermuteWithRoutingMapGradGetWorkspaceSize
    grad, grad_probs = torch.randn_like(permuted), torch.randn_like(permuted_probs)
    gouts = (torch.empty(T, H), torch.empty(T, E))
    assert grad_first(grad, grad_probs, sorted_indices, None, E, T, False, *gouts)[0] == NULL  # the map is needed
    assert grad_first(grad, grad_probs.view(-1, 1), sorted_indices, routing_map, E, T, False, *gouts)[0] == INVALID
    assert grad_first(grad, grad_probs, sorted_indices.long(), routing_map, E, T, False, *gouts)[0] == INVALID

    un_first = aclnn.aclnnMoeTokenUnpermuteWithRoutingMapGetWorkspaceSize
    out = torch.empty(T, H)
    assert un_first(permuted, None, routing_map, probs, False, (T, H), out, None, None, None)[0] == NULL
    assert un_first(permuted, sorted_indices, None, probs, False, (T, H), out, None, None, None)[0] == NULL
    assert un_first(permuted.double(), sorted_indices, routing_map, probs, False, (T, H), out, None, None,
                    None)[0] == INVALID  # CANN's floats only
    assert un_first(permuted, sorted_indices, routing_map, probs, False, (T, H + 1), out, None, None, None)[0] \
        == INVALID

    ug_first = aclnn.aclnnMoeTokenUnpermuteWithRoutingMapGradGetWorkspaceSize
    dy = torch.randn(T, H)
    assert ug_first(dy, sorted_indices, sorted_indices, routing_map, None, probs, False, None,
                    torch.empty_like(permuted), torch.empty(T, E))[0] == NULL  # probs need permuted tokens
    assert ug_first(dy, sorted_indices[:-1], sorted_indices[:-1], routing_map, permuted, probs, False, None,
                    torch.empty_like(permuted), torch.empty(T, E))[0] == TILING  # "shape does not fit": 561002
    assert ug_first(dy, sorted_indices, sorted_indices, routing_map, permuted, probs, False, None,
                    torch.empty_like(permuted), torch.empty(T, E + 1))[0] == TILING
    # probs of another shape than the map's, or another T: a shape too (561002; was 161002)
    assert ug_first(dy, sorted_indices, sorted_indices, routing_map, permuted, probs[:, :-1], False, None,
                    torch.empty_like(permuted), torch.empty(T, E - 1))[0] == TILING
    assert ug_first(dy, sorted_indices, sorted_indices, routing_map, permuted, probs[:-1], False, None,
                    torch.empty_like(permuted), torch.empty(T - 1, E))[0] == TILING
    assert ug_first(dy, sorted_indices, sorted_indices, routing_map[:-1], permuted, probs[:-1], False, None,
                    torch.empty_like(permuted), torch.empty(T - 1, E))[0] == TILING


def test_aclnn_routing_map_values_are_refused_when_the_executor_runs():
    x, routing_map, probs = _case(3)
    routing_map[1] = True  # row 1 routed to all E experts: more than K
    outs = (torch.zeros(2 * T, H), torch.zeros(2 * T), torch.zeros(2 * T, dtype=torch.int32))
    status, size, executor = aclnn.aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize(x, routing_map, probs, 2 * T,
                                                                                       False, *outs)
    assert status == 0
    before = outs[0].clone()
    assert aclnn.aclnnMoeTokenPermuteWithRoutingMap(None, size, executor) == INVALID
    assert "routingMap" in aclnn.aclGetRecentErrMsg() and torch.equal(outs[0], before)


def test_aclnn_unpermute_pair():
    gen = torch.Generator().manual_seed(4)
    k = 2
    permuted, sorted_indices = torch.randn(T * k, H, generator=gen), torch.randperm(T * k, generator=gen).int()
    probs, dy = torch.rand(T, k, generator=gen), torch.randn(T, H, generator=gen)
    out = torch.empty(T, H)
    assert _run(aclnn.aclnnMoeTokenUnpermuteGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermute, permuted, sorted_indices,
                probs, False, None, out) == 0
    assert torch.equal(out, gradops.moe_token_unpermute(permuted, sorted_indices, probs))
    dx, dp = torch.empty_like(permuted), torch.empty(T, k)
    assert _run(aclnn.aclnnMoeTokenUnpermuteGradGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermuteGrad, permuted, dy,
                sorted_indices, probs, False, None, dx, dp) == 0
    want = gradops.moe_token_unpermute_grad(permuted, dy, sorted_indices, probs)
    assert torch.equal(dx, want[0]) and torch.equal(dp, want[1])
    # Without probs: K = 1, permutedTokensOptional may be None (read for its shape only), probsGradOut None.
    single = sorted_indices[:T].argsort().int()
    dx1 = torch.empty(T, H)
    assert _run(aclnn.aclnnMoeTokenUnpermuteGradGetWorkspaceSize, aclnn.aclnnMoeTokenUnpermuteGrad, None, dy, single,
                None, False, None, dx1, None) == 0
    assert torch.equal(dx1, gradops.moe_token_unpermute_grad(torch.empty(T, H), dy, single)[0])
    # Statuses: probs whose T*K is not sortedIndices' length is found while tiling (561002), as is a permuted
    # input with more rows than T*K; a null is 161001, a dtype 161002, a repeated row 161002 from phase 2.
    first = aclnn.aclnnMoeTokenUnpermuteGetWorkspaceSize
    assert first(permuted, sorted_indices, torch.rand(T, k + 1), False, None, out)[0] == TILING
    assert first(torch.randn(T * k + 1, H), sorted_indices, probs, False, None, out)[0] == TILING
    assert first(None, sorted_indices, probs, False, None, out)[0] == NULL
    assert first(permuted, sorted_indices.long(), probs, False, None, out)[0] == INVALID
    assert first(permuted, sorted_indices, probs, True, None, out)[0] == INVALID
    assert "probsOptional" not in aclnn.aclGetRecentErrMsg() and "paddedMode" in aclnn.aclGetRecentErrMsg()
    bad = sorted_indices.clone()
    bad[0] = bad[1]
    assert _run(first, aclnn.aclnnMoeTokenUnpermute, permuted, bad, probs, False, None, out) == INVALID
    grad_first = aclnn.aclnnMoeTokenUnpermuteGradGetWorkspaceSize
    assert grad_first(None, dy, sorted_indices, probs, False, None, dx, dp)[0] == NULL
    assert "permutedTokensOptional" in aclnn.aclGetRecentErrMsg()
    assert grad_first(permuted, dy, sorted_indices, probs, False, None, dx, None)[0] == NULL
    assert grad_first(permuted, dy, sorted_indices, probs, False, None, dx, dp.double())[0] == INVALID
