"""The routing-map MoE ops (aclnnMoeTokenPermuteWithRoutingMap / UnpermuteWithRoutingMap and their gradients):
their declarations (see :mod:`gradops.spec`). They run the permute family's kernels on a slot table
(:mod:`gradops.ops.moe_routing`), so no backend implements them under their own names (``kernels=False``)."""

from __future__ import annotations

import torch

from ..spec import Example, OpSpec, autograd

#: Experts in the examples, and the experts per token (Mixtral's 8 and top-2).
EXPERTS, TOP_K = 8, 2


def _routing(m, gen, device):
    """A (m, E) top-2 routing map and its probs (softmax over the chosen experts)."""
    scores = torch.rand(m, EXPERTS, generator=gen)
    chosen = scores.topk(TOP_K, dim=1).indices
    routing_map = torch.zeros(m, EXPERTS, dtype=torch.bool).scatter_(1, chosen, True)
    probs = torch.where(routing_map, scores, 0)
    return routing_map.to(device), (probs / probs.sum(1, keepdim=True)).to(device)


def _megatron_permute(tokens, routing_map, probs):
    """Megatron's unfused permute without dropping: the routed pairs expert-major, and CANN's sorted_indices (the
    row of each (token, k) slot: the stable argsort of each row's token)."""
    mask = routing_map.bool().T
    token_of_row = torch.arange(tokens.shape[0], device=tokens.device).expand_as(mask).masked_select(mask)
    return (tokens.index_select(0, token_of_row), probs.T.masked_select(mask),
            torch.argsort(token_of_row, stable=True).int())


def _megatron_unpermute(permuted, sorted_indices, probs, routing_map):
    """Megatron's unfused unpermute: each row weighted by its pair's prob, added to its token."""
    mask = routing_map.bool().T
    token_of_row = torch.arange(probs.shape[0], device=probs.device).expand_as(mask).masked_select(mask)
    weighted = permuted.float() * probs.T.masked_select(mask).float()[:, None]
    out = torch.zeros(probs.shape[0], permuted.shape[1], device=permuted.device).index_add_(0, token_of_row, weighted)
    return out.to(permuted.dtype)


def _example(op):
    def example(m, n, dtype, device, gen):
        tokens = torch.randn(m, n, generator=gen).to(dtype).to(device)
        routing_map, probs = _routing(m, gen, device)
        if op == "moe_token_permute_with_routing_map":
            return Example((tokens, routing_map, probs, TOP_K * m, False), (1, 1, 0),
                           lambda t, r, p, *_: _megatron_permute(t, r, p))
        permuted, permuted_probs, sorted_indices = _megatron_permute(tokens, routing_map, probs)
        if op == "moe_token_permute_with_routing_map_grad":
            def twin(grad, grad_probs, s, r, *_):  # autograd of Megatron's permute, both cotangents at once
                leaves = (tokens.detach().requires_grad_(), probs.detach().requires_grad_())
                with torch.enable_grad():
                    rows, row_probs, _ = _megatron_permute(leaves[0], r, leaves[1])
                    return torch.autograd.grad((rows, row_probs), leaves, (grad, grad_probs))
            return Example((permuted.clone(), permuted_probs.clone(), sorted_indices, routing_map, EXPERTS, m, False),
                           (TOP_K, 1), twin)
        if op == "moe_token_unpermute_with_routing_map":
            return Example((permuted, sorted_indices, (m, n), probs, routing_map, False), (TOP_K,),
                           lambda x, s, shape, p, r, *_: (_megatron_unpermute(x, s, p, r),))
        grad = torch.randn(m, n, generator=gen).to(dtype).to(device)
        return Example((permuted, grad, sorted_indices, probs, routing_map, False), (1, n),
                       lambda x, g, s, p, r, *_: autograd(lambda x, p: _megatron_unpermute(x, s, p, r), (x, p), g))
    return example


def _permute_rule(R, P, Shard):
    def rule(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
        p = None if probs is None else R
        return [([R, R, R], [R, R, p, None, None]), ([Shard(1), R, R], [Shard(1), R, p, None, None])]
    return rule


def _permute_grad_rule(R, P, Shard):
    def rule(grad, grad_probs, sorted_indices, routing_map, num_experts, num_tokens, drop_and_pad):
        gp, rm = (None if grad_probs is None else R), (None if routing_map is None else R)
        # Sharded over H, the probs' gradient comes from the replicated grad_probs alone: whole on every rank.
        return [([R, R], [R, gp, R, rm, None, None, None]), ([Shard(1), R], [Shard(1), gp, R, rm, None, None, None])]
    return rule


def _unpermute_rule(R, P, Shard):
    def rule(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad):
        p, rm = (None if probs is None else R), (None if routing_map is None else R)
        return [([R], [R, R, None, p, rm, None]), ([Shard(1)], [Shard(1), R, None, p, rm, None])]
    return rule


def _unpermute_grad_rule(R, P, Shard):
    def rule(permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad):
        p, rm = (None if probs is None else R), (None if routing_map is None else R)
        # Sharded over H, each rank's probs gradient is a partial sum of the dot products over its columns.
        second = R if probs is None else P
        return [([R, R], [R, R, R, p, rm, None]), ([Shard(1), second], [Shard(1), Shard(1), R, p, rm, None])]
    return rule


SPECS = (
    OpSpec("moe_token_permute_with_routing_map", "aclnnMoeTokenPermuteWithRoutingMap", False,
           example=_example("moe_token_permute_with_routing_map"), sharding=_permute_rule, kernels=False,
           cann_args={"probs": "probsOptional"}),
    OpSpec("moe_token_permute_with_routing_map_grad", "aclnnMoeTokenPermuteWithRoutingMapGrad", True,
           example=_example("moe_token_permute_with_routing_map_grad"), sharding=_permute_grad_rule, kernels=False,
           cann_args={"permuted_tokens_grad": "permutedTokenOutputGrad",
                      "permuted_probs_grad": "permutedProbsOutputGradOptional", "routing_map": "routingMapOptional",
                      "num_tokens": "tokensNum"}),
    OpSpec("moe_token_unpermute_with_routing_map", "aclnnMoeTokenUnpermuteWithRoutingMap", False,
           example=_example("moe_token_unpermute_with_routing_map"), sharding=_unpermute_rule, kernels=False,
           cann_args={"probs": "probsOptional", "routing_map": "routingMapOptional", "drop_and_pad": "paddedMode",
                      "restore_shape": "restoreShapeOptional"}),
    OpSpec("moe_token_unpermute_with_routing_map_grad", "aclnnMoeTokenUnpermuteWithRoutingMapGrad", True,
           example=_example("moe_token_unpermute_with_routing_map_grad"), sharding=_unpermute_grad_rule,
           kernels=False,
           cann_args={"grad_unpermuted": "unpermutedTokensGrad", "sorted_indices": "outIndex",
                      "permuted_tokens": "permutedTokensOptional", "probs": "probsOptional",
                      "routing_map": "routingMapOptional"}),
)
