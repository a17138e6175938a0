"""The routing-map MoE ops (aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeTokenUnpermuteWithRoutingMap and their
gradients): torch.library ops, autograd and the public functions.

Each op is a slot table plus the permute family's kernels. A *slot* is one (token, k) place: ``slots[t, w]`` is
the permuted row it names, -1 for none; W is K without dropping (slot k: the token's k-th routed expert, ascending)
and, with drop_and_pad, one slot per expert (the token's row in that expert's column, if it got one). The table
is completed into a permutation of [0, T·W) by giving the empty slots the rows past the ``live`` ones (the rows
some slot names), so the permute family's fused gather-sums run on it unchanged, skipping every row >= live:

- token gradient (permute backward): :func:`~gradops.moe_token_permute_grad` (sum of a token's W rows, k order);
- unpermute: :func:`~gradops.moe_token_unpermute` (weighted sum, fp32, k order);
- unpermute backward: :func:`~gradops.moe_token_unpermute_grad` (each row's weighted gradient, each slot's dot);
- permuted rows (permute forward, unpermute backward without probs): ``index_select`` by the token of each row.

So every path runs the backend its device chooses (the CPU kernels, Triton, or the float64 reference), with a
fixed summation order and no atomics; the tables are integer work on T·E elements. Reading them takes one
host synchronisation per call (the number of live rows, and the value tests: a row routed to more than K
experts, an index outside its range, a row named twice), as masked_select does in the unfused code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..contract import moe_routing as contract
from ..contract._common import fail
from ..contract._memo import remembered
from ..status import ACLNN_ERR_PARAM_INVALID as INVALID
from ._direct import DirectOp, own
from .moe_permute import moe_token_permute_grad, moe_token_unpermute, moe_token_unpermute_grad

check_permute = remembered(contract.check_moe_token_permute_with_routing_map)
check_permute_grad = remembered(contract.check_moe_token_permute_with_routing_map_grad)
check_unpermute = remembered(contract.check_moe_token_unpermute_with_routing_map)
check_unpermute_grad = remembered(contract.check_moe_token_unpermute_with_routing_map_grad)


class Slots(NamedTuple):
    """A call's slot table: ``slots`` (T, W) int64 (-1: none), ``experts`` (T, W) the expert of each slot (E where
    it has none or it is unknown), ``order`` the completed permutation of [0, T·W), ``live`` the rows slots name."""

    slots: Tensor
    experts: Tensor
    order: Tensor
    live: int

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    def row_slot(self, rows: int) -> Tensor:
        """The slot (flat, t·W + w) of each of the first ``rows`` permuted rows (rows >= live: an empty slot)."""
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        return inverse[:rows]


def _host(*values: Tensor) -> list[int]:
    """Device scalars read in one synchronisation."""
    return [int(v) for v in torch.stack([v.reshape(()).long() for v in values]).tolist()]


def _complete(slots: Tensor, live: int) -> Tensor:
    """The permutation of [0, T·W): each slot's row, the empty ones numbered from ``live`` in slot order."""
    flat = slots.reshape(-1)
    empty = flat < 0
    return torch.where(empty, live + torch.cumsum(empty, 0) - 1, flat)


def _routed(routing_map: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """Without dropping: ``(k, row)`` per (t, e) pair, k its rank among the token's experts (ascending), row its
    permuted row (expert-major, tokens ascending within an expert). Entries of unrouted pairs are meaningless."""
    mask = routing_map != 0
    counts = mask.long()
    column = counts.sum(0)
    row = (torch.cumsum(column, 0) - column) + torch.cumsum(counts, 0) - 1
    return torch.cumsum(counts, 1) - 1, row


def _scatter_slots(mask: Tensor, rank: Tensor, values: Tensor, topk: int, empty: int) -> Tensor:
    """(T, K): ``values[t, e]`` at the slot ``rank[t, e]`` of each routed pair, ``empty`` elsewhere (pairs ranked
    past K land in a spare column that is dropped)."""
    t = mask.shape[0]
    table = torch.full((t, topk + 1), empty, dtype=values.dtype, device=mask.device)
    where = torch.where(mask & (rank < topk), rank, topk)
    table.scatter_(1, where, torch.where(mask, values, empty))
    return table[:, :topk]


def _experts_by_rank(routing_map: Tensor, topk: int) -> Tensor:
    """(T, K): each token's k-th routed expert, ascending; E past its last."""
    mask = routing_map != 0
    rank = torch.cumsum(mask.long(), 1) - 1
    e = routing_map.shape[1]
    ids = torch.arange(e, device=mask.device).expand_as(mask)
    return _scatter_slots(mask, rank, ids, topk, e)


def _from_map(op: str, routing_map: Tensor, drop_and_pad: bool, per: int) -> Slots:
    """The permute's slots, from the routing map."""
    mask = routing_map != 0
    t, e = mask.shape
    ids = torch.arange(e, device=mask.device)
    if drop_and_pad:
        counts = mask.long()
        column = counts.sum(0)
        # An expert's column: its routed tokens ascending, then the others ascending (a stable descending sort of
        # the column); the first C take its rows.
        place = torch.where(mask, torch.cumsum(counts, 0) - 1, column + torch.cumsum(1 - counts, 0) - 1)
        slots = torch.where(place < per, ids * per + place, -1)
        return Slots(slots, ids.expand(t, e), _complete(slots, per * e), per * e)
    rank, row = _routed(routing_map, per)
    over = mask & (rank >= per)
    live, excess = _host(mask.sum(), over.any())
    if excess:
        worst = int(mask.sum(1).argmax())
        raise fail(INVALID, op, "routing_map", f"at most K = num_out_tokens // T = {per} routed experts per token",
                   f"{int(mask[worst].sum())} in row {worst}")
    slots = _scatter_slots(mask, rank, row, per, -1)
    experts = _scatter_slots(mask, rank, ids.expand(t, e), per, e)
    return Slots(slots, experts, _complete(slots, live), live)


def _from_rows(op: str, sorted_indices: Tensor, tokens: int, per: int, rows: int, drop_and_pad: bool,
               routing_map: Tensor | None, experts: int) -> Slots:
    """The slots of a gradient or unpermute, from the sorted indices: without dropping each slot's row (-1: none),
    which must name rows [0, live) once each; with drop_and_pad each row's token, in [0, T)."""
    index = sorted_indices.long()
    n = index.numel()
    if drop_and_pad:
        counts = torch.bincount(index.clamp(0, max(tokens - 1, 0)), minlength=tokens)
        width = 1
        if n:  # the range and the widest token in one synchronisation
            low, high, width = _host(index.min(), index.max(), counts.max())
            if low < 0 or high >= tokens:
                bad = int(((index < 0) | (index >= tokens)).nonzero()[0, 0])
                raise fail(INVALID, op, "sorted_indices", f"token ids in [0, T) = [0, {tokens})",
                           f"{int(index[bad])} at position {bad}")
        if width > contract.MAX_TOPK:
            raise fail(INVALID, op, "sorted_indices", f"each token on at most {contract.MAX_TOPK} rows",
                       f"token {int(counts.argmax())} on {width} rows")
        by_token = torch.sort(index, stable=True).indices
        first = torch.cumsum(counts, 0) - counts
        place = torch.arange(n, device=index.device) - first[index[by_token]]
        slots = torch.full((tokens, width), -1, dtype=torch.long, device=index.device)
        slots[index[by_token], place] = by_token
        expert = torch.where(slots >= 0, slots // per, experts) if per else torch.full_like(slots, experts)
        return Slots(slots, expert, _complete(slots, n), n)
    slots = index.reshape(tokens, per)
    # The entries >= 0 must be [0, live) in some order: sorted, the i-th of them is i.
    ordered = torch.sort(index).values
    missing = (index < 0).sum()
    position = torch.arange(n, device=index.device)
    fits = ((ordered == position - missing) | (position < missing)).all() & (ordered[:1] >= -1).all()
    live, ok = _host(n - missing, fits) if n else (0, 1)
    if not ok or live > rows:
        raise fail(INVALID, op, "sorted_indices", f"the rows [0, live) each named once (live <= A = {rows}) and -1 "
                   "for empty slots", _first_fault(index, rows))
    expert = _experts_by_rank(routing_map, per) if routing_map is not None else torch.full_like(slots, experts)
    return Slots(slots, expert, _complete(slots, live), live)


def _first_fault(index: Tensor, rows: int) -> str:
    """What is wrong with non-dropping sorted indices, for the message."""
    outside = ((index < -1) | (index >= rows)).nonzero()
    if outside.numel():
        pos = int(outside[0, 0])
        return f"{int(index[pos])} at position {pos}"
    valid = index[index >= 0]
    counts = torch.bincount(valid, minlength=rows)
    if bool((counts > 1).any()):
        row = int((counts > 1).nonzero()[0, 0])
        return f"row {row} named {int(counts[row])} times"
    return f"{valid.numel()} rows named, but not rows 0..{valid.numel() - 1}"


def _weights(table: Slots, probs: Tensor | None, like: Tensor) -> Tensor:
    """(T, W): each slot's probability (0 for an empty slot or one without an expert), 1 without probs."""
    live = table.slots >= 0
    if probs is None:
        return live.to(like.dtype)
    spare = torch.cat([probs, probs.new_zeros(probs.shape[0], 1)], 1)
    return torch.where(live, spare.gather(1, table.experts), 0)


def _probs_grad(table: Slots, slot_values: Tensor, experts: int) -> Tensor:
    """(T, E): each live slot's value at its expert, zeros elsewhere."""
    t = table.slots.shape[0]
    live = table.slots >= 0
    out = slot_values.new_zeros(t * experts + 1)  # the last element takes the empty slots' writes
    at = torch.arange(t, device=live.device)[:, None] * experts + table.experts
    out[torch.where(live & (table.experts < experts), at, t * experts)] = torch.where(live, slot_values, 0)
    return out[:-1].view(t, experts)


def _rows_of(table: Slots, source: Tensor, rows: int, dtype: torch.dtype, row_slot: Tensor | None = None) -> Tensor:
    """(rows, H): row r holds ``source[token of r]``; rows past the live ones are zeros. ``row_slot``: the table's
    :meth:`Slots.row_slot` where the caller has it."""
    token = (table.row_slot(table.live) if row_slot is None else row_slot[:table.live]) // table.width
    out = source.new_zeros((rows, source.shape[1]), dtype=dtype) if table.live < rows else \
        source.new_empty((rows, source.shape[1]), dtype=dtype)
    if dtype == source.dtype:
        torch.index_select(source, 0, token, out=out[:table.live])
    else:
        out[:table.live] = source.index_select(0, token)
    return out


# ---------------------------------------------------------------- permute
def _moe_token_permute_with_routing_map_body(tokens: Tensor, routing_map: Tensor, probs: Tensor | None,
                                             num_out_tokens: int | None, drop_and_pad: bool
                                             ) -> tuple[Tensor, Tensor, Tensor]:
    op = "moe_token_permute_with_routing_map"
    plan = contract.check_moe_token_permute_with_routing_map(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    table = _from_map(op, routing_map, drop_and_pad, plan.per) if plan.tokens else None
    if table is None:
        return (tokens.new_zeros((0, plan.hidden)), tokens.new_empty(0) if probs is None else probs.new_zeros(0),
                torch.zeros(0, dtype=torch.int32, device=tokens.device))
    row_slot = table.row_slot(plan.rows)
    permuted = _rows_of(table, tokens, plan.rows, tokens.dtype, row_slot)
    permuted_probs = tokens.new_empty(0) if probs is None else _weights(table, probs, probs).reshape(-1)[row_slot]
    if drop_and_pad:
        sorted_indices = (row_slot // table.width).int()  # the token of each row
    else:
        sorted_indices = table.slots.reshape(-1).int()
    return own(permuted, permuted_probs, sorted_indices)


_permute = DirectOp("gradops::moe_token_permute_with_routing_map", _moe_token_permute_with_routing_map_body)


@_permute.register_fake
def _(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    plan = check_permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    slots = plan.per * plan.experts if drop_and_pad else plan.per * plan.tokens
    return (tokens.new_empty((plan.rows, plan.hidden)),
            tokens.new_empty(0) if probs is None else probs.new_empty(plan.rows),
            routing_map.new_empty(slots, dtype=torch.int32))


def _permute_setup(ctx, inputs, output):
    tokens, routing_map, probs, _, drop_and_pad = inputs
    ctx.save_for_backward(output[2], routing_map)
    # T stays symbolic under dynamic-shape tracing (the gradient's num_tokens takes a SymInt); E is a model
    # constant: int() specialises on it at no cost in recompiles.
    ctx.shape = (tuple(tokens.shape), tokens.dtype, int(routing_map.shape[1]), drop_and_pad, probs is not None)
    ctx.set_materialize_grads(False)


def _permute_backward(ctx, grad_tokens, grad_probs, _grad_indices):
    sorted_indices, routing_map = ctx.saved_tensors
    (tokens, hidden), dtype, experts, drop_and_pad, has_probs = ctx.shape
    if grad_tokens is None and grad_probs is None:
        return None, None, None, None, None
    if grad_tokens is None:  # only permuted_probs was used: the rows' gradient is zero
        grad_tokens = torch.zeros((grad_probs.shape[0], hidden), dtype=dtype, device=grad_probs.device)
    dtokens, dprobs = _permute_grad(grad_tokens, grad_probs if has_probs else None, sorted_indices, routing_map,
                                    experts, tokens, drop_and_pad)
    return dtokens, None, dprobs if has_probs and grad_probs is not None else None, None, None


_permute.register_autograd(_permute_backward, setup_context=_permute_setup)


def _moe_token_permute_with_routing_map_grad_body(permuted_tokens_grad: Tensor, permuted_probs_grad: Tensor | None,
                                                  sorted_indices: Tensor, routing_map: Tensor | None,
                                                  num_experts: int, num_tokens: int, drop_and_pad: bool
                                                  ) -> tuple[Tensor, Tensor]:
    op = "moe_token_permute_with_routing_map_grad"
    plan = contract.check_moe_token_permute_with_routing_map_grad(permuted_tokens_grad, permuted_probs_grad,
                                                                  sorted_indices, routing_map, num_experts,
                                                                  num_tokens, drop_and_pad)
    probs_dtype = None if permuted_probs_grad is None else permuted_probs_grad.dtype
    if not plan.tokens:
        return (permuted_tokens_grad.new_zeros((0, plan.hidden)),
                permuted_tokens_grad.new_empty(0) if probs_dtype is None else
                permuted_probs_grad.new_zeros((0, num_experts)))
    table = _from_rows(op, sorted_indices, plan.tokens, plan.per, plan.rows, drop_and_pad, routing_map, num_experts)
    dtokens = moe_token_permute_grad(permuted_tokens_grad[:table.live], table.order, table.width)
    if permuted_probs_grad is None:
        return own(dtokens, permuted_tokens_grad.new_empty(0))
    spare = torch.cat([permuted_probs_grad, permuted_probs_grad.new_zeros(1)])
    at_slot = spare[torch.where(table.slots >= 0, table.slots, plan.rows)]
    return own(dtokens, _probs_grad(table, at_slot, num_experts))


_permute_grad = DirectOp("gradops::moe_token_permute_with_routing_map_grad",
                         _moe_token_permute_with_routing_map_grad_body)


@_permute_grad.register_fake
def _(permuted_tokens_grad, permuted_probs_grad, sorted_indices, routing_map, num_experts, num_tokens, drop_and_pad):
    plan = check_permute_grad(permuted_tokens_grad, permuted_probs_grad, sorted_indices, routing_map, num_experts,
                              num_tokens, drop_and_pad)
    return (permuted_tokens_grad.new_empty((plan.tokens, plan.hidden)),
            permuted_tokens_grad.new_empty(0) if permuted_probs_grad is None else
            permuted_probs_grad.new_empty((plan.tokens, num_experts)))


# ---------------------------------------------------------------- unpermute
def _moe_token_unpermute_with_routing_map_body(permuted_tokens: Tensor, sorted_indices: Tensor,
                                               restore_shape: list[int], probs: Tensor | None,
                                               routing_map: Tensor | None, drop_and_pad: bool) -> Tensor:
    op = "moe_token_unpermute_with_routing_map"
    plan = contract.check_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs,
                                                               routing_map, drop_and_pad)
    if not plan.tokens:
        return permuted_tokens.new_zeros((0, plan.hidden))
    table = _from_rows(op, sorted_indices, plan.tokens, plan.per, plan.rows, drop_and_pad, routing_map,
                       plan.experts)
    weights = _weights(table, probs, permuted_tokens)
    return own(moe_token_unpermute(permuted_tokens[:table.live], table.order, weights))


_unpermute = DirectOp("gradops::moe_token_unpermute_with_routing_map", _moe_token_unpermute_with_routing_map_body)


@_unpermute.register_fake
def _(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad):
    plan = check_unpermute(permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad)
    return permuted_tokens.new_empty((plan.tokens, plan.hidden))


def _unpermute_setup(ctx, inputs, output):
    permuted_tokens, sorted_indices, _, probs, routing_map, drop_and_pad = inputs
    # permuted_tokens feeds only the probs' gradient: without probs it is not kept alive for the backward.
    ctx.save_for_backward(permuted_tokens if probs is not None else None, sorted_indices, probs, routing_map)
    ctx.permuted = (permuted_tokens.shape, permuted_tokens.dtype, permuted_tokens.device, drop_and_pad)
    ctx.set_materialize_grads(False)


def _unpermute_backward(ctx, grad):
    if grad is None:
        return None, None, None, None, None, None
    permuted_tokens, sorted_indices, probs, routing_map = ctx.saved_tensors
    shape, dtype, device, drop_and_pad = ctx.permuted
    if permuted_tokens is None:  # read for its shape and dtype only (no probs): an untouched stand-in
        permuted_tokens = torch.empty(shape, dtype=dtype, device=device)
    dpermuted, dprobs = _unpermute_grad(permuted_tokens, grad, sorted_indices, probs, routing_map, drop_and_pad)
    return dpermuted, None, None, dprobs if probs is not None else None, None, None


_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def _moe_token_unpermute_with_routing_map_grad_body(permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                                    sorted_indices: Tensor, probs: Tensor | None,
                                                    routing_map: Tensor | None, drop_and_pad: bool
                                                    ) -> tuple[Tensor, Tensor]:
    op = "moe_token_unpermute_with_routing_map_grad"
    plan = contract.check_moe_token_unpermute_with_routing_map_grad(permuted_tokens, grad_unpermuted, sorted_indices,
                                                                    probs, routing_map, drop_and_pad)
    if not plan.tokens:
        return (permuted_tokens.new_zeros((plan.rows, plan.hidden)),
                permuted_tokens.new_empty(0) if probs is None else probs.new_zeros((0, plan.experts)))
    table = _from_rows(op, sorted_indices, plan.tokens, plan.per, plan.rows, drop_and_pad, routing_map,
                       plan.experts)
    if probs is None:
        return own(_rows_of(table, grad_unpermuted, plan.rows, permuted_tokens.dtype), permuted_tokens.new_empty(0))
    weights = _weights(table, probs, permuted_tokens)
    live_rows, at_slot = moe_token_unpermute_grad(permuted_tokens[:table.live], grad_unpermuted, table.order, weights)
    dpermuted = live_rows if table.live == plan.rows else torch.cat(
        [live_rows, live_rows.new_zeros((plan.rows - table.live, plan.hidden))])
    return own(dpermuted, _probs_grad(table, at_slot, plan.experts))


_unpermute_grad = DirectOp("gradops::moe_token_unpermute_with_routing_map_grad",
                           _moe_token_unpermute_with_routing_map_grad_body)


@_unpermute_grad.register_fake
def _(permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad):
    plan = check_unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad)
    return (permuted_tokens.new_empty((plan.rows, plan.hidden)),
            permuted_tokens.new_empty(0) if probs is None else probs.new_empty((plan.tokens, plan.experts)))


def slot_probs(sorted_indices: Tensor, probs: Tensor, routing_map: Tensor | None, drop_and_pad: bool) -> Tensor:
    """Each entry of ``sorted_indices``' probability, as aclnnMoeTokenUnpermuteWithRoutingMap writes ``permuteProbs``:
    with drop_and_pad row r's ``probs[sorted_indices[r], r // C]``; without, slot (t, k)'s ``probs[t, e_k]`` (the
    token's k-th routed expert; token-major, as ``probs.masked_select(routing_map)``), 0 for a -1 slot. The indices
    are those the op itself accepted (in range)."""
    tokens, experts = probs.shape
    index = sorted_indices.long()
    if drop_and_pad:
        per = index.numel() // experts
        return probs[index, torch.arange(index.numel(), device=index.device) // per]
    topk = index.numel() // tokens if tokens else 0
    spare = torch.cat([probs, probs.new_zeros(tokens, 1)], 1)
    picked = spare.gather(1, _experts_by_rank(routing_map, topk)).reshape(-1)
    return torch.where(index >= 0, picked, 0)


# ---------------------------------------------------------------- public functions
def moe_token_permute_with_routing_map(tokens: Tensor, routing_map: Tensor, probs: Tensor | None = None,
                                       num_out_tokens: int | None = None, drop_and_pad: bool = False
                                       ) -> tuple[Tensor, Tensor | None, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMap: group token copies by expert from a (T, E) routing map;
    differentiable w.r.t. tokens and probs.

    Args:
        tokens: (T, H) float16 / bfloat16 / float32 (or float64).
        routing_map: (T, E) bool or int8, nonzero where token t goes to expert e.
        probs: optional (T, E) routing weights (any float dtype; float32 beside half tokens is common).
        num_out_tokens: without drop_and_pad K·T (K = num_out_tokens // T slots per token; None: T, so K = 1); with
            drop_and_pad C·E (C = num_out_tokens // E rows per expert, in [1, T]). At most T·E.
        drop_and_pad: Megatron's capacity mode (see below).

    Returns:
        ``(permuted_tokens (A, H), permuted_probs (A,) or None without probs, sorted_indices int32)``.

        Without drop_and_pad, A = K·T: the routed (t, e) pairs in expert-major order, tokens ascending within an
        expert, fill rows [0, M); rows [M, A) are zeros (CANN leaves them unwritten). ``sorted_indices`` (T·K,) is
        CANN's convention, the row of each (token, k) slot (k: the token's k-th routed expert, ascending), -1 for
        the slots of a token routed to fewer than K experts. A token routed to more than K experts raises OpError
        161002.

        With drop_and_pad, A = C·E: expert e's rows [e·C, (e+1)·C) hold its routed tokens in ascending order,
        the C lowest when it has more (the rest are dropped), padded with the lowest tokens not routed to it
        when it has fewer; ``sorted_indices`` (C·E,) is the token of each row (Megatron's convention) and
        ``permuted_probs[r] = probs[sorted_indices[r], r // C]``, padding rows included.
    """
    if probs is None:
        permuted, _, sorted_indices = _permute(tokens, routing_map, None, num_out_tokens, drop_and_pad,
                                               check=check_permute)
        return permuted, None, sorted_indices
    return _permute(tokens, routing_map, probs, num_out_tokens, drop_and_pad, check=check_permute)


def moe_token_permute_with_routing_map_grad(permuted_tokens_grad: Tensor, permuted_probs_grad: Tensor | None,
                                            sorted_indices: Tensor, routing_map: Tensor | None, num_experts: int,
                                            num_tokens: int, drop_and_pad: bool = False
                                            ) -> tuple[Tensor, Tensor | None]:
    """aclnnMoeTokenPermuteWithRoutingMapGrad: the gradients of :func:`moe_token_permute_with_routing_map`.

    Args:
        permuted_tokens_grad: (A, H), the permuted rows' gradient.
        permuted_probs_grad: (A,) the permuted probs' gradient, or None.
        sorted_indices: the forward's (its convention per mode; int32, int64 accepted).
        routing_map: the forward's (T, E) map; needed for the probs' gradient without drop_and_pad.
        num_experts: E. num_tokens: T. drop_and_pad: the forward's mode.

    Returns:
        ``(tokens_grad (T, H) in permuted_tokens_grad's dtype, probs_grad (T, E) in permuted_probs_grad's dtype or
        None)``: ``tokens_grad[t]`` sums the rows holding token t (fp32, in slot order); ``probs_grad`` holds each
        row's gradient at its (token, expert) pair, zeros elsewhere.
    """
    dtokens, dprobs = _permute_grad(permuted_tokens_grad, permuted_probs_grad, sorted_indices, routing_map,
                                    num_experts, num_tokens, drop_and_pad, check=check_permute_grad)
    return dtokens, None if permuted_probs_grad is None else dprobs


def moe_token_unpermute_with_routing_map(permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape: Sequence[int],
                                         probs: Tensor | None = None, routing_map: Tensor | None = None,
                                         drop_and_pad: bool = False) -> Tensor:
    """aclnnMoeTokenUnpermuteWithRoutingMap: merge each token's expert outputs back into (T, H); differentiable
    w.r.t. permuted_tokens and probs.

    Args:
        permuted_tokens: (A, H) float16 / bfloat16 / float32 (or float64).
        sorted_indices: the permute's (int32, int64 accepted).
        restore_shape: (T, H) of the result.
        probs: optional (T, E) weights. routing_map: the permute's (T, E) map; needed with probs without
            drop_and_pad (it says each slot's expert).
        drop_and_pad: the permute's mode.

    Returns:
        (T, H) in permuted_tokens' dtype. Without drop_and_pad ``out[t] = sum_k w[t, k] *
        permuted_tokens[sorted_indices[t*K + k]]`` over the slots that are not -1, ``w[t, k] = probs[t, e_k]`` (e_k:
        the token's k-th routed expert) or 1; with drop_and_pad every row r adds ``w_r * permuted_tokens[r]`` to
        its token ``sorted_indices[r]``, ``w_r = probs[sorted_indices[r], r // C]`` or 1. Summed in fp32 in slot
        (then row) order, rounded once.
    """
    shape = list(restore_shape) if isinstance(restore_shape, (list, tuple, torch.Size)) else restore_shape  # int[]
    return _unpermute(permuted_tokens, sorted_indices, shape, probs, routing_map, drop_and_pad, check=check_unpermute)


def moe_token_unpermute_with_routing_map_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                              sorted_indices: Tensor, probs: Tensor | None = None,
                                              routing_map: Tensor | None = None, drop_and_pad: bool = False
                                              ) -> tuple[Tensor, Tensor | None]:
    """aclnnMoeTokenUnpermuteWithRoutingMapGrad: the gradients of :func:`moe_token_unpermute_with_routing_map`.

    Returns:
        ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, E) in probs' dtype or None without
        probs)``: ``grad_permuted[row] = w * grad_unpermuted[token]`` for each row a slot names (zeros for the
        rest), ``grad_probs[t, e] = <grad_unpermuted[t], permuted_tokens[row]>`` for the pair's row (fp32), zeros
        for pairs without one. permuted_tokens' values are read only with probs.
    """
    dpermuted, dprobs = _unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map,
                                        drop_and_pad, check=check_unpermute_grad)
    return dpermuted, None if probs is None else dprobs
