"""The routing-map MoE ops (aclnnMoeTokenPermuteWithRoutingMap / UnpermuteWithRoutingMap and their gradients):
their declarations (see :mod:`gradops.spec`). Every backend runs them as slot tables over its permute-family
kernels (:mod:`gradops.families.moe.routing_reference`)."""

from __future__ import annotations

import torch

from ...spec import Bench, Example, Golden, OpSpec, Timed, autograd, provided
from . import routing_contract, routing_reference
from . import routing_reference as reference

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


def _golden_routing(t, draw, opts):
    """A top-K router over E experts (``--topk``, ``--experts``) with CANN's edge mixes: every 7th token routed to
    one expert fewer (-1 slots without drop_and_pad; none with K = 1), the last expert empty when E > K, probs a
    softmax over the chosen experts; ``num_out_tokens`` K*T, or with ``--drop-and-pad`` C*E with C the mean load
    (so the busier experts drop and the others pad), unless ``--num-out-tokens`` says otherwise."""
    k, experts = int(opts.get("topk", 2)), int(opts.get("experts", 8))
    if not 1 <= k <= min(experts, 512) or experts > 512:
        draw.fail(f"--topk must be in [1, min(E, 512)] and --experts in [1, 512], got {k} and {experts}")
    scores = torch.rand(t, experts, generator=draw.gen, dtype=torch.float64)
    if experts > k:
        scores[:, -1] = -1.0  # never chosen: an empty expert
    chosen = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(t, experts, dtype=torch.bool).scatter_(1, chosen, True)
    fewer = torch.arange(0, t, 7)
    routing_map[fewer, chosen[fewer, -1]] = False  # with K = 1: routed nowhere
    probs = torch.where(routing_map, scores.exp(), 0.0)
    probs = (probs / probs.sum(1, keepdim=True).clamp_min(1e-30)).to(draw.dtype)
    drop = bool(opts.get("drop_and_pad", False))
    default = max(-(-t * k // experts), 1) * experts if drop else k * t
    given = opts.get("num_out_tokens")
    if given is not None and int(given) < 0:  # the forward's range: the gradients' cases are made by the forward
        draw.fail(f"--num-out-tokens must be >= 0 (the permuted rows the forward keeps), got {given}")
    return routing_map, probs, int(given or default), drop


def _golden_inputs(op):
    def inputs(shape, dtype, draw, opts):
        if len(shape) != 2:
            draw.fail(f"{op}: --shape must be TxH (tokens x hidden), got {'x'.join(map(str, shape))}")
        t, h = shape
        routing_map, probs, num_out_tokens, drop = _golden_routing(t, draw, opts)
        tokens = draw.normal(t, h)
        if op == "moe_token_permute_with_routing_map":
            return {"tokens": tokens, "routing_map": routing_map, "probs": probs, "num_out_tokens": num_out_tokens,
                    "drop_and_pad": drop}
        permuted, permuted_probs, sorted_indices = reference.moe_token_permute_with_routing_map(
            tokens, routing_map, probs, num_out_tokens, drop)
        if op == "moe_token_permute_with_routing_map_grad":
            return {"permuted_tokens_grad": draw.normal(*permuted.shape), "permuted_probs_grad":
                    draw.normal(permuted_probs.numel()), "sorted_indices": sorted_indices, "routing_map": routing_map,
                    "num_experts": routing_map.shape[1], "num_tokens": t, "drop_and_pad": drop}
        if op == "moe_token_unpermute_with_routing_map":
            return {"permuted_tokens": draw.normal(*permuted.shape), "sorted_indices": sorted_indices,
                    "restore_shape": [t, h], "probs": probs, "routing_map": routing_map, "drop_and_pad": drop}
        return {"permuted_tokens": draw.normal(*permuted.shape), "grad_unpermuted": draw.normal(t, h),
                "sorted_indices": sorted_indices, "probs": probs, "routing_map": routing_map, "drop_and_pad": drop}
    return inputs


def _permute_oracle(ref_args, args, like):
    """Rows and probabilities are moved, not computed: the reference on the float64 inputs."""
    return reference.moe_token_permute_with_routing_map(*ref_args)


_OPTIONS = ("topk", "experts", "num_out_tokens", "drop_and_pad")


def _timed_routing(shape, dtype, device):
    t, k, e = shape["T"], shape["K"], shape["E"]
    scores = torch.rand(t, e, device=device)
    routing_map = torch.zeros(t, e, dtype=torch.bool, device=device).scatter_(1, scores.topk(k, dim=1).indices, True)
    return routing_map, (scores * routing_map).to(dtype)


def _prepare_permute_grad(shape, dtype, device):
    routing_map, probs = _timed_routing(shape, dtype, device)
    tokens = torch.randn(shape["T"], shape["H"], dtype=dtype, device=device)
    _, permuted_probs, sorted_indices = reference.moe_token_permute_with_routing_map(
        tokens, routing_map, probs, shape["K"] * shape["T"], False)
    grad = torch.randn(shape["K"] * shape["T"], shape["H"], dtype=dtype, device=device)
    grad_probs = torch.randn_like(permuted_probs)
    # The eager twin: autograd of Megatron's permute (masked_select, index_select), the graph built once and its
    # backward replayed: index_select's backward is an index_add_ into zeros, masked_select's a masked_scatter.
    t_leaf, p_leaf = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    with torch.enable_grad():
        rows, row_probs, _ = _megatron_permute(t_leaf, routing_map, p_leaf)
    args = (grad, grad_probs, sorted_indices, routing_map, shape["E"], shape["T"], False)
    return Timed(args, lambda: torch.autograd.grad((rows, row_probs), (t_leaf, p_leaf), (grad, grad_probs),
                                                   retain_graph=True),
                 (reference.moe_token_permute_with_routing_map_grad, args))


def _prepare_unpermute_grad(shape, dtype, device):
    routing_map, probs = _timed_routing(shape, dtype, device)
    t, h = shape["T"], shape["H"]
    tokens = torch.randn(t, h, dtype=dtype, device=device)
    permuted, _, sorted_indices = reference.moe_token_permute_with_routing_map(tokens, routing_map, probs,
                                                                               shape["K"] * t, False)
    grad = torch.randn(t, h, dtype=dtype, device=device)
    x_leaf, p_leaf = permuted.clone().requires_grad_(), probs.clone().requires_grad_()
    with torch.enable_grad():
        merged = _megatron_unpermute(x_leaf, sorted_indices, p_leaf, routing_map)
    args = (permuted, grad, sorted_indices, probs, routing_map, False)
    return Timed(args, lambda: torch.autograd.grad(merged, (x_leaf, p_leaf), grad, retain_graph=True),
                 (reference.moe_token_unpermute_with_routing_map_grad, args))


_SHAPES = {
    "cpu": [{"T": 8192, "K": 8, "E": 64, "H": 2048}],
    "cuda": [{"T": 16384, "K": 2, "E": 8, "H": 4096}, {"T": 4096, "K": 8, "E": 256, "H": 7168},
             {"T": 8192, "K": 8, "E": 64, "H": 4096}],
    "quick": [{"T": 256, "K": 4, "E": 16, "H": 256}], "gpu-check": [{"T": 8192, "K": 8, "E": 64, "H": 4096}],
    "dry": [{"T": 8, "K": 2, "E": 4, "H": 32}],
}


def _sizes(rows, cols, vocab, top_k):
    return {"T": rows, "K": top_k, "E": 4 * top_k, "H": cols}


def _copies(s):
    return s["T"] * s["K"] * s["H"]


#: Byte floors (s: element size; int32 indices; the (T, E) map and probs): the permute gradient reads the T·K rows
#: and writes T rows, plus the indices, map and probs; the unpermute gradient reads the T·K permuted rows and T
#: gradient rows and writes T·K rows, plus the same small tensors.
PERMUTE_GRAD = Bench("moe_token_permute_with_routing_map_grad", _SHAPES, _sizes, _prepare_permute_grad,
                     lambda s, e: (s["T"] * s["K"] * s["H"] * e + s["T"] * s["H"] * e + 4 * s["T"] * s["K"]
                                   + s["T"] * s["E"] * (1 + e) + s["T"] * s["K"] * e), _copies,
                     "autograd of masked_select + index_select (Megatron)")
UNPERMUTE_GRAD = Bench("moe_token_unpermute_with_routing_map_grad", _SHAPES, _sizes, _prepare_unpermute_grad,
                       lambda s, e: (2 * s["T"] * s["K"] * s["H"] * e + s["T"] * s["H"] * e + 4 * s["T"] * s["K"]
                                     + s["T"] * s["E"] * (1 + 2 * e)), _copies,
                       "autograd of index_select, weight, index_add (Megatron)")


def _cpu():
    """The family's compiled CPU kernels (importing them loads or builds the native extension)."""
    from . import cpu

    return cpu


def _triton():
    """The family's Triton launchers (importing them needs triton)."""
    from . import launch

    return launch


#: The family's module for each backend: where each op's implementation (gradops.spec.Impl) is.
_BACKENDS = {"torch": lambda: routing_reference, "cpu": _cpu, "triton": _triton}


#: The family's declarations, in the tables' order; each is also the module's constant of its name.
SPECS = (
    OpSpec("moe_token_permute_with_routing_map", "aclnnMoeTokenPermuteWithRoutingMap", False,
           example=_example("moe_token_permute_with_routing_map"),
           golden=Golden(("permuted_tokens", "permuted_probs", "sorted_indices"), _OPTIONS,
                         _golden_inputs("moe_token_permute_with_routing_map"), oracle=_permute_oracle, views=False),
           sharding=_permute_rule, cann_args={"probs": "probsOptional"},
           check=routing_contract.check_moe_token_permute_with_routing_map,
           results=routing_contract.moe_token_permute_with_routing_map_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP)),
    OpSpec("moe_token_permute_with_routing_map_grad", "aclnnMoeTokenPermuteWithRoutingMapGrad", True,
           example=_example("moe_token_permute_with_routing_map_grad"),
           golden=Golden(("tokens_grad", "probs_grad"), _OPTIONS,
                         _golden_inputs("moe_token_permute_with_routing_map_grad"), views=False),
           timing=PERMUTE_GRAD, sharding=_permute_grad_rule,
           cann_args={"permuted_tokens_grad": "permutedTokenOutputGrad",
                      "permuted_probs_grad": "permutedProbsOutputGradOptional", "routing_map": "routingMapOptional",
                      "num_tokens": "tokensNum"},
           check=routing_contract.check_moe_token_permute_with_routing_map_grad,
           results=routing_contract.moe_token_permute_with_routing_map_grad_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD)),
    OpSpec("moe_token_unpermute_with_routing_map", "aclnnMoeTokenUnpermuteWithRoutingMap", False,
           example=_example("moe_token_unpermute_with_routing_map"),
           golden=Golden(("unpermuted_tokens",), _OPTIONS, _golden_inputs("moe_token_unpermute_with_routing_map"),
                         views=False),
           sharding=_unpermute_rule,
           cann_args={"probs": "probsOptional", "routing_map": "routingMapOptional", "drop_and_pad": "paddedMode",
                      "restore_shape": "restoreShapeOptional"},
           check=routing_contract.check_moe_token_unpermute_with_routing_map,
           results=routing_contract.moe_token_unpermute_with_routing_map_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP)),
    OpSpec("moe_token_unpermute_with_routing_map_grad", "aclnnMoeTokenUnpermuteWithRoutingMapGrad", True,
           example=_example("moe_token_unpermute_with_routing_map_grad"),
           golden=Golden(("permuted_tokens_grad", "probs_grad"), _OPTIONS,
                         _golden_inputs("moe_token_unpermute_with_routing_map_grad"), views=False),
           timing=UNPERMUTE_GRAD, sharding=_unpermute_grad_rule,
           cann_args={"grad_unpermuted": "unpermutedTokensGrad", "sorted_indices": "outIndex",
                      "permuted_tokens": "permutedTokensOptional", "probs": "probsOptional",
                      "routing_map": "routingMapOptional"},
           check=routing_contract.check_moe_token_unpermute_with_routing_map_grad,
           results=routing_contract.moe_token_unpermute_with_routing_map_grad_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD)),
)
(MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP, MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD, MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP,
 MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD) = SPECS
