"""aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeTokenUnpermuteWithRoutingMap and their gradients in pure torch,
over a backend's permute-family kernels (docs/semantics.md §5b).

Each op is a slot table plus the permute family's kernels. A *slot* is one (token, k) place: ``slots[t, w]`` is
the permuted row it names, -1 for none; W is K without dropping (slot k: the token's k-th routed expert, ascending)
and, with drop_and_pad, one slot per expert (the token's row in that expert's column, if it got one). The table
is completed into a permutation of [0, T·W) by giving the empty slots the rows past the ``live`` ones (the rows
some slot names), so the permute family's fused gather-sums run on it unchanged, skipping every row >= live:

- token gradient (permute backward): ``moe_token_permute_grad`` (sum of a token's W rows, k order);
- unpermute: ``moe_token_unpermute`` (weighted sum, k order);
- unpermute backward: ``moe_token_unpermute_grad`` (each row's weighted gradient, each slot's dot product);
- permuted rows (permute forward, unpermute backward without probs): ``index_select`` by the token of each row.

:class:`Kernels` names the three functions: this module's public functions run them on the reference's
(:mod:`gradops.reference.moe_permute`, in ``compute``), :mod:`gradops.cpu` and :mod:`gradops.launch` on theirs, so
every backend shares the tables and differs only in its kernels: fixed summation order, no atomics. The tables
are integer work on T·E elements; reading them takes one host synchronisation per call (the number of live rows,
and the value tests: a token routed to more than K experts, an index outside its range, a row named twice), as
masked_select does in the unfused code. Values are refused here, with the op's OpError, before any kernel reads
with them; shapes were checked by :mod:`gradops.contract.moe_routing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from ..contract._common import fail
from ..contract.moe_permute import MAX_TOPK
from ..status import ACLNN_ERR_PARAM_INVALID as INVALID
from . import moe_permute

PERMUTE, PERMUTE_GRAD = "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad"
UNPERMUTE, UNPERMUTE_GRAD = "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad"


class Kernels(NamedTuple):
    """A backend's permute-family functions, called on a completed slot table (``order``, a permutation of
    [0, T·W) built here: ``trusted`` where the function takes it): ``permute_grad(grad, order, W, trusted=True)``,
    ``unpermute(permuted, order, weights)``, ``unpermute_grad(permuted, grad, order, weights, trusted=True)``."""

    permute_grad: Callable[..., Tensor]
    unpermute: Callable[..., Tensor]
    unpermute_grad: Callable[..., tuple[Tensor, Tensor]]


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
        if width > MAX_TOPK:
            raise fail(INVALID, op, "sorted_indices", f"each token on at most {MAX_TOPK} rows",
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



# ---------------------------------------------------------------- the four ops on a backend's kernels
def _empty_probs(like: Tensor) -> Tensor:
    """The placeholder of a probs result without probs (the op schemas return tensors)."""
    return like.new_empty(0)


def permute(kernels: Kernels, tokens: Tensor, routing_map: Tensor, probs: Tensor | None, num_out_tokens: int | None,
            drop_and_pad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(permuted_tokens, permuted_probs (empty without probs), sorted_indices int32)``."""
    t, h = tokens.shape
    e = routing_map.shape[1]
    wanted = t if num_out_tokens is None else num_out_tokens
    per = wanted // e if drop_and_pad else (wanted // t if t else 0)
    rows = per * (e if drop_and_pad else t)
    if not t:
        return (tokens.new_zeros((0, h)), _empty_probs(tokens) if probs is None else probs.new_zeros(0),
                torch.zeros(0, dtype=torch.int32, device=tokens.device))
    table = _from_map(PERMUTE, routing_map, drop_and_pad, per)
    row_slot = table.row_slot(rows)
    permuted = _rows_of(table, tokens, rows, tokens.dtype, row_slot)
    permuted_probs = _empty_probs(tokens) if probs is None else _weights(table, probs, probs).reshape(-1)[row_slot]
    if drop_and_pad:
        sorted_indices = (row_slot // table.width).int()  # the token of each row
    else:
        sorted_indices = table.slots.reshape(-1).int()
    return permuted, permuted_probs, sorted_indices


def permute_grad(kernels: Kernels, grad: Tensor, grad_probs: Tensor | None, sorted_indices: Tensor,
                 routing_map: Tensor | None, num_experts: int, num_tokens: int, drop_and_pad: bool
                 ) -> tuple[Tensor, Tensor]:
    """``(tokens_grad (T, H), probs_grad (T, E), empty without grad_probs)``."""
    rows, h = grad.shape
    if not num_tokens:
        return grad.new_zeros((0, h)), _empty_probs(grad) if grad_probs is None else grad_probs.new_zeros((0,
                                                                                                           num_experts))
    per = rows // num_experts if drop_and_pad else sorted_indices.numel() // num_tokens
    table = _from_rows(PERMUTE_GRAD, sorted_indices, num_tokens, per, rows, drop_and_pad, routing_map, num_experts)
    dtokens = kernels.permute_grad(grad[:table.live], table.order, table.width, trusted=True)
    if grad_probs is None:
        return dtokens, _empty_probs(grad)
    spare = torch.cat([grad_probs, grad_probs.new_zeros(1)])
    at_slot = spare[torch.where(table.slots >= 0, table.slots, rows)]
    return dtokens, _probs_grad(table, at_slot, num_experts)


def _unpermute_table(op: str, permuted: Tensor, sorted_indices: Tensor, tokens: int, probs: Tensor | None,
                     routing_map: Tensor | None, drop_and_pad: bool) -> Slots:
    rows = permuted.shape[0]
    known = probs if probs is not None else routing_map
    experts = known.shape[1] if known is not None else 0
    if drop_and_pad:
        per = rows // experts if experts else 0
    else:
        per = sorted_indices.numel() // tokens
    return _from_rows(op, sorted_indices, tokens, per, rows, drop_and_pad, routing_map, experts)


def unpermute(kernels: Kernels, permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape: Sequence[int],
              probs: Tensor | None, routing_map: Tensor | None, drop_and_pad: bool) -> Tensor:
    """``out (T, H)`` in permuted_tokens' dtype."""
    tokens = restore_shape[0]
    if not tokens:
        return permuted_tokens.new_zeros((0, permuted_tokens.shape[1]))
    table = _unpermute_table(UNPERMUTE, permuted_tokens, sorted_indices, tokens, probs, routing_map, drop_and_pad)
    weights = _weights(table, probs, permuted_tokens)
    return kernels.unpermute(permuted_tokens[:table.live], table.order, weights)


def unpermute_grad(kernels: Kernels, permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                   probs: Tensor | None, routing_map: Tensor | None, drop_and_pad: bool) -> tuple[Tensor, Tensor]:
    """``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, E) in probs', empty without probs)``."""
    rows, h = permuted_tokens.shape
    tokens = grad_unpermuted.shape[0]
    experts = probs.shape[1] if probs is not None else 0
    if not tokens:
        return permuted_tokens.new_zeros((rows, h)), (_empty_probs(permuted_tokens) if probs is None
                                                      else probs.new_zeros((0, experts)))
    table = _unpermute_table(UNPERMUTE_GRAD, permuted_tokens, sorted_indices, tokens, probs, routing_map,
                             drop_and_pad)
    if probs is None:
        return _rows_of(table, grad_unpermuted, rows, permuted_tokens.dtype), _empty_probs(permuted_tokens)
    weights = _weights(table, probs, permuted_tokens)
    live_rows, at_slot = kernels.unpermute_grad(permuted_tokens[:table.live], grad_unpermuted, table.order, weights,
                                                trusted=True)
    if table.live < rows:
        live_rows = torch.cat([live_rows, live_rows.new_zeros((rows - table.live, h))])
    return live_rows, _probs_grad(table, at_slot, experts)


# ---------------------------------------------------------------- the reference backend
def _reference(compute: torch.dtype) -> Kernels:
    """The reference kernels summing in ``compute``."""
    return Kernels(partial(moe_permute.moe_token_permute_grad, compute=compute),
                   partial(moe_permute.moe_token_unpermute, compute=compute),
                   partial(moe_permute.moe_token_unpermute_grad, compute=compute))


def moe_token_permute_with_routing_map(tokens: Tensor, routing_map: Tensor, probs: Tensor | None,
                                       num_out_tokens: int | None, drop_and_pad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMap (rows are moved, nothing is computed: no compute dtype)."""
    return permute(_reference(torch.float32), tokens, routing_map, probs, num_out_tokens, drop_and_pad)


def moe_token_permute_with_routing_map_grad(grad: Tensor, grad_probs: Tensor | None, sorted_indices: Tensor,
                                            routing_map: Tensor | None, num_experts: int, num_tokens: int,
                                            drop_and_pad: bool, compute: torch.dtype = torch.float32
                                            ) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMapGrad, each token's rows summed in ``compute``."""
    return permute_grad(_reference(compute), grad, grad_probs, sorted_indices, routing_map, num_experts, num_tokens,
                        drop_and_pad)


def moe_token_unpermute_with_routing_map(permuted_tokens: Tensor, sorted_indices: Tensor,
                                         restore_shape: Sequence[int], probs: Tensor | None,
                                         routing_map: Tensor | None, drop_and_pad: bool,
                                         compute: torch.dtype = torch.float32) -> Tensor:
    """aclnnMoeTokenUnpermuteWithRoutingMap, summed in ``compute``."""
    return unpermute(_reference(compute), permuted_tokens, sorted_indices, restore_shape, probs, routing_map,
                     drop_and_pad)


def moe_token_unpermute_with_routing_map_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                              sorted_indices: Tensor, probs: Tensor | None,
                                              routing_map: Tensor | None, drop_and_pad: bool,
                                              compute: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteWithRoutingMapGrad, in ``compute``."""
    return unpermute_grad(_reference(compute), permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map,
                          drop_and_pad)
