"""Validation table of the routing-map MoE ops: aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeTokenUnpermute-
WithRoutingMap and their gradients (torch_npu ``npu_moe_token_{permute,unpermute}_with_routing_map``).

Sources (docs/semantics.md §5b): the op-plugin schema and derivatives, the torch_npu API pages, hicann/ops-transformer
``moe/moe_token_{permute,unpermute}_with_routing_map{,_grad}`` (docs, aclnn CheckParams / CheckShapeValid).
``routing_map`` is (T, E) bool or int8 (nonzero: routed); ``probs`` (T, E) floating, possibly float32 beside half
tokens. Two modes:

- ``drop_and_pad=False``: K = num_out_tokens // T slots per token (num_out_tokens None: T, so K = 1), K·T permuted
  rows; ``sorted_indices`` (T·K,) holds each slot's permuted row, -1 for the slots of a token routed to fewer than
  K experts (newer CANN). A token routed to more than K experts is outside the op's domain (CANN: undefined):
  refused with 161002 where the values are read.
- ``drop_and_pad=True``: C = num_out_tokens // E rows per expert (capacity), C·E permuted rows; ``sorted_indices``
  (C·E,) holds the token of each row. C must be in [1, T]: 0 leaves no row, and above T an expert's column has
  fewer tokens than rows to fill.

Everything here reads metadata only; the values (-1 slots, a row named twice, a token id outside [0, T), a row
routed too often) are tested by :mod:`gradops.families.moe.routing_ops` before any kernel reads with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ...contract._common import (
    Result,
    fail,
    floats,
    require_dtype,
    require_int,
    require_present,
    require_rank,
    require_same_device,
    require_shape,
    shape_text,
)
from ...status import ACLNN_ERR_INNER_TILING_ERROR as TILING
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import ACLNN_ERR_PARAM_NULLPTR as NULLPTR
from .contract import INDEX_DTYPES, MAX_TOPK

MAP_DTYPES = (torch.bool, torch.int8)


class RouteShape(NamedTuple):
    tokens: int   # T
    experts: int  # E; 0 where nothing given says it (an unpermute in drop mode without probs and map)
    hidden: int   # H
    rows: int     # A: permuted rows
    per: int      # K (slots per token, drop_and_pad=False) or C (rows per expert, drop_and_pad=True)


# What each op returns, declared once (see gradops.contract._common.Result).
def moe_token_permute_with_routing_map_results(shape: RouteShape, tokens, routing_map, probs=None,
                                               num_out_tokens=None, drop_and_pad=False) -> list[Result]:
    """``(permuted (A, H) in tokens' dtype, permuted_probs (A,) in probs' dtype, sorted_indices int32)``;
    permuted_probs an empty (0,) tensor of tokens' dtype without probs."""
    slots = shape.per * (shape.experts if drop_and_pad else shape.tokens)
    return [Result((shape.rows, shape.hidden), tokens.dtype, tokens),
            Result((0,), tokens.dtype, tokens) if probs is None else Result((shape.rows,), probs.dtype, probs),
            Result((slots,), torch.int32, routing_map)]


def moe_token_permute_with_routing_map_grad_results(shape: RouteShape, permuted_tokens_grad, permuted_probs_grad,
                                                    sorted_indices, routing_map, num_experts, num_tokens,
                                                    drop_and_pad=False) -> list[Result]:
    """``(tokens_grad (T, H) in the gradient's dtype, probs_grad (T, E))``; probs_grad an empty (0,) tensor of the
    gradient's dtype without permuted_probs_grad."""
    grad, grad_probs = permuted_tokens_grad, permuted_probs_grad
    return [Result((shape.tokens, shape.hidden), grad.dtype, grad),
            Result((0,), grad.dtype, grad) if grad_probs is None else
            Result((shape.tokens, num_experts), grad_probs.dtype, grad_probs)]


def moe_token_unpermute_with_routing_map_results(shape: RouteShape, permuted_tokens, sorted_indices, restore_shape,
                                                 probs=None, routing_map=None, drop_and_pad=False) -> list[Result]:
    """``out (T, H)`` in permuted_tokens' dtype."""
    return [Result((shape.tokens, shape.hidden), permuted_tokens.dtype, permuted_tokens)]


def moe_token_unpermute_with_routing_map_grad_results(shape: RouteShape, permuted_tokens, grad_unpermuted,
                                                      sorted_indices, probs=None, routing_map=None,
                                                      drop_and_pad=False) -> list[Result]:
    """``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, E) in probs' dtype)``; grad_probs an empty
    (0,) tensor of permuted_tokens' dtype without probs."""
    return [Result((shape.rows, shape.hidden), permuted_tokens.dtype, permuted_tokens),
            Result((0,), permuted_tokens.dtype, permuted_tokens) if probs is None else
            Result((shape.tokens, shape.experts), probs.dtype, probs)]


def _bool(op: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise fail(INVALID, op, name, "a bool", type(value).__name__)


def _map_and_probs(op: str, routing_map, probs, tokens: int | None, cann: bool, map_name: str = "routing_map",
                   probs_name: str = "probs", shapes: int = INVALID) -> int:
    """The optional (T, E) routing map and probs: dtypes, ranks, T and E agreeing; returns E (0 if neither).
    ``shapes``: the status of shapes that do not agree (the unpermute gradient's 561002 under CANN)."""
    experts = 0
    if routing_map is not None:
        require_dtype(op, map_name, routing_map, MAP_DTYPES)
        require_rank(op, map_name, routing_map, 2, 2)
        if tokens is not None and routing_map.shape[0] != tokens:
            raise fail(shapes, op, f"{map_name}.shape", f"(T, E) with T = {tokens}", shape_text(routing_map.shape))
        experts = routing_map.shape[1]
    if probs is not None:
        require_dtype(op, probs_name, probs, floats(cann))
        require_rank(op, probs_name, probs, 2, 2)
        if routing_map is not None and probs.shape != routing_map.shape:
            raise fail(shapes, op, f"{probs_name}.shape", f"{shape_text(routing_map.shape)} (routing_map's shape)",
                       shape_text(probs.shape))
        if tokens is not None and probs.shape[0] != tokens:
            raise fail(shapes, op, f"{probs_name}.shape", f"(T, E) with T = {tokens}", shape_text(probs.shape))
        experts = probs.shape[1]
    return experts


def _experts_fit(op: str, name: str, experts: int) -> None:
    """Drop mode gathers each token's rows from one slot per expert: E slots, the K limit of the gather-sums."""
    if not 1 <= experts <= MAX_TOPK:
        raise fail(INVALID, op, name, f"E in [1, {MAX_TOPK}] experts (drop_and_pad: one slot per expert)",
                   str(experts))


def check_moe_token_permute_with_routing_map(tokens, routing_map, probs=None, num_out_tokens=None,
                                             drop_and_pad=False, *, cann: bool = False) -> RouteShape:
    """``(permuted_tokens (A, H), permuted_probs (A,), sorted_indices)``: A = K·T, or C·E with drop_and_pad."""
    op = "moe_token_permute_with_routing_map"
    require_present(op, tokens=tokens, routing_map=routing_map)
    if probs is not None:
        require_present(op, probs=probs)
    if num_out_tokens is not None and not isinstance(num_out_tokens, torch.SymInt):  # symbolic: traced, see below
        require_int(op, "num_out_tokens", num_out_tokens, 0)
    _bool(op, "drop_and_pad", drop_and_pad)
    require_same_device(op, tokens=tokens, routing_map=routing_map, **({} if probs is None else {"probs": probs}))
    require_dtype(op, "tokens", tokens, floats(cann))
    require_rank(op, "tokens", tokens, 2, 2)
    t, h = tokens.shape
    experts = _map_and_probs(op, routing_map, probs, t, cann)
    wanted = t if num_out_tokens is None else num_out_tokens
    if wanted > t * experts:  # CANN's CheckParams: numOutTokens in [0, T*E]
        raise fail(INVALID, op, "num_out_tokens", f"at most T*E = {t * experts} (each token once per expert)",
                   str(wanted))
    if drop_and_pad:
        _experts_fit(op, "routing_map.shape[1]", experts)
        capacity = wanted // experts
        if not 1 <= capacity <= t:
            raise fail(INVALID, op, "num_out_tokens", f"C*E with a capacity C = num_out_tokens // E in [1, T = {t}] "
                       f"(E = {experts})", f"{wanted} (capacity {capacity})")
        return RouteShape(t, experts, h, capacity * experts, capacity)
    if not t:
        return RouteShape(0, experts, h, 0, 0)
    topk = wanted // t
    if not 1 <= topk <= MAX_TOPK:
        raise fail(INVALID, op, "num_out_tokens", f"K*T with K = num_out_tokens // T in [1, {MAX_TOPK}] (T = {t})",
                   f"{wanted} (K = {topk})")
    return RouteShape(t, experts, h, topk * t, topk)


def _sorted_indices(op: str, sorted_indices, cann: bool) -> None:
    require_dtype(op, "sorted_indices", sorted_indices, (torch.int32,) if cann else INDEX_DTYPES)
    require_rank(op, "sorted_indices", sorted_indices, 1, 1)


def check_moe_token_permute_with_routing_map_grad(permuted_tokens_grad, permuted_probs_grad, sorted_indices,
                                                  routing_map, num_experts, num_tokens, drop_and_pad=False, *,
                                                  cann: bool = False) -> RouteShape:
    """``(tokens_grad (T, H), probs_grad (T, E) or None)`` from the permuted rows' gradients."""
    op = "moe_token_permute_with_routing_map_grad"
    require_present(op, permuted_tokens_grad=permuted_tokens_grad, sorted_indices=sorted_indices)
    optional = {name: t for name, t in (("permuted_probs_grad", permuted_probs_grad), ("routing_map", routing_map))
                if t is not None}
    require_present(op, **optional)
    experts = require_int(op, "num_experts", num_experts, 1)
    # A SymInt while torch.compile traces with dynamic shapes (the token count of the forward it differentiates).
    tokens = num_tokens if isinstance(num_tokens, torch.SymInt) else require_int(op, "num_tokens", num_tokens, 0)
    _bool(op, "drop_and_pad", drop_and_pad)
    require_same_device(op, permuted_tokens_grad=permuted_tokens_grad, sorted_indices=sorted_indices, **optional)
    require_dtype(op, "permuted_tokens_grad", permuted_tokens_grad, floats(cann))
    require_rank(op, "permuted_tokens_grad", permuted_tokens_grad, 2, 2)
    _sorted_indices(op, sorted_indices, cann)
    rows, h = permuted_tokens_grad.shape
    if permuted_probs_grad is not None:
        require_dtype(op, "permuted_probs_grad", permuted_probs_grad, floats(cann))
        require_shape(op, "permuted_probs_grad", permuted_probs_grad, (rows,), "(A,): one per permuted row")
        if routing_map is None and not drop_and_pad:
            raise fail(NULLPTR, op, "routing_map", "a tensor (the probs' gradient needs each row's expert)", "None")
    if routing_map is not None:
        _map_and_probs(op, routing_map, None, tokens, cann)
        if routing_map.shape[1] != experts:
            raise fail(INVALID, op, "routing_map.shape", f"(T, E) with E = num_experts = {experts}",
                       shape_text(routing_map.shape))
    total = sorted_indices.shape[0]
    if drop_and_pad:
        _experts_fit(op, "num_experts", experts)
        if total != rows or total % experts:
            raise fail(INVALID, op, "sorted_indices.shape", f"(A,) = ({rows},), A = C*E rows with E = {experts}",
                       shape_text(sorted_indices.shape))
        return RouteShape(tokens, experts, h, rows, total // experts)
    return RouteShape(tokens, experts, h, rows, _slots_per_token(op, sorted_indices, tokens, INVALID))


def _slots_per_token(op: str, sorted_indices, tokens: int, status: int) -> int:
    """Without dropping: K, from the (T*K,) sorted indices (0 without tokens); ``status`` for a length that is not
    T*K with K in [1, 512]."""
    if not tokens:
        return 0
    total = sorted_indices.shape[0]
    if total % tokens or not 1 <= total // tokens <= MAX_TOPK:
        raise fail(status, op, "sorted_indices.shape", f"(T*K,) with T = {tokens} tokens, K in [1, {MAX_TOPK}]",
                   shape_text(sorted_indices.shape))
    return total // tokens


def check_restore_shape(op: str, restore_shape: object, hidden: int) -> int:
    """restore_shape: the unpermuted (T, H), H the permuted rows' width; returns T."""
    if isinstance(restore_shape, (str, bytes)) or not isinstance(restore_shape, Sequence) or len(restore_shape) != 2 \
            or not all(isinstance(v, torch.SymInt) or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
                       for v in restore_shape):
        raise fail(INVALID, op, "restore_shape", "(T, H): two ints >= 0", repr(restore_shape))
    if restore_shape[1] != hidden:
        raise fail(INVALID, op, "restore_shape", f"(T, H) with H = permuted_tokens.shape[1] = {hidden}",
                   repr(tuple(restore_shape)))
    return restore_shape[0]


def _unpermute_plan(op: str, permuted_tokens, sorted_indices, tokens: int, probs, routing_map, drop_and_pad,
                    cann: bool, shapes: int = INVALID) -> RouteShape:
    """The unpermute pair's shared part; ``shapes``: the status of a sorted_indices shape that does not fit."""
    experts = _map_and_probs(op, routing_map, probs, tokens, cann, shapes=shapes)
    if probs is not None and routing_map is None and not drop_and_pad:
        raise fail(NULLPTR, op, "routing_map", "a tensor (with probs, each slot's expert comes from it)", "None")
    rows, h = permuted_tokens.shape
    total = sorted_indices.shape[0]
    if drop_and_pad:
        if total != rows or (experts and total % experts):
            raise fail(shapes, op, "sorted_indices.shape", f"(A,) = ({rows},): one token id per permuted row"
                       + (f", A = C*E with E = {experts}" if experts else ""), shape_text(sorted_indices.shape))
        if experts:
            _experts_fit(op, "probs.shape[1]" if probs is not None else "routing_map.shape[1]", experts)
        return RouteShape(tokens, experts, h, rows, total // experts if experts else 0)
    return RouteShape(tokens, experts, h, rows, _slots_per_token(op, sorted_indices, tokens, shapes))


def check_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs=None,
                                               routing_map=None, drop_and_pad=False, *,
                                               cann: bool = False) -> RouteShape:
    """``out (T, H)`` = restore_shape, in permuted_tokens' dtype."""
    op = "moe_token_unpermute_with_routing_map"
    require_present(op, permuted_tokens=permuted_tokens, sorted_indices=sorted_indices)
    optional = {name: t for name, t in (("probs", probs), ("routing_map", routing_map)) if t is not None}
    require_present(op, **optional)
    _bool(op, "drop_and_pad", drop_and_pad)
    require_same_device(op, permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, **optional)
    require_dtype(op, "permuted_tokens", permuted_tokens, floats(cann))
    require_rank(op, "permuted_tokens", permuted_tokens, 2, 2)
    _sorted_indices(op, sorted_indices, cann)
    tokens = check_restore_shape(op, restore_shape, permuted_tokens.shape[1])
    return _unpermute_plan(op, permuted_tokens, sorted_indices, tokens, probs, routing_map, drop_and_pad, cann)


def check_moe_token_unpermute_with_routing_map_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs=None,
                                                    routing_map=None, drop_and_pad=False, *,
                                                    cann: bool = False) -> RouteShape:
    """``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, E) in probs' dtype or None)``."""
    op = "moe_token_unpermute_with_routing_map_grad"
    require_present(op, permuted_tokens=permuted_tokens, grad_unpermuted=grad_unpermuted,
                    sorted_indices=sorted_indices)
    optional = {name: t for name, t in (("probs", probs), ("routing_map", routing_map)) if t is not None}
    require_present(op, **optional)
    _bool(op, "drop_and_pad", drop_and_pad)
    require_same_device(op, permuted_tokens=permuted_tokens, grad_unpermuted=grad_unpermuted,
                        sorted_indices=sorted_indices, **optional)
    require_dtype(op, "permuted_tokens", permuted_tokens, floats(cann))
    require_rank(op, "permuted_tokens", permuted_tokens, 2, 2)
    require_dtype(op, "grad_unpermuted", grad_unpermuted, floats(cann))
    require_rank(op, "grad_unpermuted", grad_unpermuted, 2, 2)
    _sorted_indices(op, sorted_indices, cann)
    tokens, h = grad_unpermuted.shape
    # CANN's doc gives 561002 for "the shape of an input or output does not fit" here (checked while tiling).
    shapes = TILING if cann else INVALID
    if h != permuted_tokens.shape[1]:
        raise fail(shapes, op, "grad_unpermuted.shape", f"(T, H) with H = permuted_tokens.shape[1] = "
                   f"{permuted_tokens.shape[1]}", shape_text(grad_unpermuted.shape))
    return _unpermute_plan(op, permuted_tokens, sorted_indices, tokens, probs, routing_map, drop_and_pad, cann,
                           shapes)
