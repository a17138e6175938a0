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
(:mod:`gradops.families.moe.reference`, in ``compute``), :mod:`gradops.cpu` and :mod:`gradops.launch` on theirs, so
every backend shares the tables and differs only in its kernels: fixed summation order, no atomics. The tables
are integer work on T·E elements; reading them takes one host synchronisation per call (the number of live rows,
and the value tests: a token routed to more than K experts, an index outside its range, a row named twice), as
masked_select does in the unfused code. Values are refused here, with the op's OpError, before any kernel reads
with them; shapes were checked by :mod:`gradops.families.moe.routing_contract`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...contract._common import fail
from ...spec import Impl
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import OpError
from . import reference as moe_permute
from .contract import MAX_TOPK

PERMUTE, PERMUTE_GRAD = "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad"
UNPERMUTE, UNPERMUTE_GRAD = "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad"


class Kernels(NamedTuple):
    """A backend's permute-family functions: ``permute(tokens, expert_ids, rows)`` (the stable sort by expert and
    the row gather), and, on a completed slot table (``order``, a permutation of [0, T·W); ``trusted`` says whether
    it was tested here already), ``permute_grad(grad, order, W, trusted=)``, ``unpermute(permuted, order,
    weights)``, ``unpermute_grad(permuted, grad, order, weights, trusted=)``. The kernels test ``order`` where
    they read it (a permutation, in range) unless trusted."""

    permute: Callable[..., tuple[Tensor, Tensor]]
    permute_grad: Callable[..., Tensor]
    unpermute: Callable[..., Tensor]
    unpermute_grad: Callable[..., tuple[Tensor, Tensor]]


class Slots(NamedTuple):
    """A call's slot table: ``slots`` (T, W) int64 (-1: none), ``experts`` (T, W) the expert of each slot (E where
    it has none or it is unknown), ``order`` the completed permutation of [0, T·W) (tested here: the kernels
    need not test it again), ``live`` the rows slots name."""

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


def _ranked(routing_map: Tensor) -> Tensor:
    """(T, E): each token's routed experts ascending, then E for the rest (one sort of the rows)."""
    e = routing_map.shape[1]
    ids = torch.arange(e, device=routing_map.device)
    return torch.where(routing_map != 0, ids, e).sort(dim=1).values


def _experts_by_rank(routing_map: Tensor, topk: int) -> Tensor:
    """(T, K): each token's k-th routed expert, ascending; E past its last."""
    ranked = _ranked(routing_map)
    e = routing_map.shape[1]
    if topk > e:
        return torch.cat([ranked, ranked.new_full((ranked.shape[0], topk - e), e)], 1)
    return ranked[:, :topk]


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
    expert = _experts_by_rank(routing_map, per) if routing_map is not None else torch.full_like(slots, experts)
    # The entries >= 0 must be [0, live) in some order: sorted, the i-th of them is i.
    ordered = torch.sort(index).values
    missing = (index < 0).sum()
    position = torch.arange(n, device=index.device)
    fits = ((ordered == position - missing) | (position < missing)).all() & (ordered[:1] >= -1).all()
    live, ok = _host(n - missing, fits) if n else (0, 1)
    if not ok or live > rows:
        raise _indices_error(op, index, rows)
    return Slots(slots, expert, _complete(slots, live), live)


def _indices_error(op: str, index: Tensor, rows: int) -> Exception:
    """The OpError of non-dropping sorted indices that are not the rows [0, live) once each and -1s."""
    return fail(INVALID, op, "sorted_indices", f"the rows [0, live) each named once (live <= A = {rows}) and -1 for "
                "empty slots", _first_fault(index, rows))


def _whole(sorted_indices: Tensor, routing_map: Tensor | None, per: int, rows: int) -> bool:
    """Without dropping: whether every slot names a row (no -1: each token routed to exactly K experts, the common
    case) and the rows are all present (A = T·K), and the routing map, where given, routes each token to K
    experts (one synchronisation). The indices are then the permutation the kernels take as it is, and the map's
    pairs in token-major order are the slots' (``masked_select`` / ``masked_scatter``)."""
    n = sorted_indices.numel()
    if not n or rows != n:
        return False
    checks = [(sorted_indices < 0).any()]
    if routing_map is not None:
        checks.append(((routing_map != 0).sum(1) != per).any())
    return not any(_host(*checks))


def _tested_by_kernel(op: str, sorted_indices: Tensor, rows: int, kernel: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    """``kernel(*args)`` on the caller's indices as they are (see :func:`_whole`): the kernel tests that they are a
    permutation before it reads with them, and its refusal is this op's, naming its own argument. (On CUDA the
    Triton kernels flag it without a host synchronisation, raised at the next launch.)"""
    try:
        return kernel(*args, **kwargs)
    except OpError:
        raise _indices_error(op, sorted_indices.long(), rows) from None


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


def _rows_of(table: Slots, source: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    """(rows, H): row r holds ``source[token of r]``; rows past the live ones are zeros."""
    token = table.row_slot(table.live) // table.width
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
    if drop_and_pad:
        # Each expert's column: its routed tokens ascending, then the others (the stable descending sort Megatron
        # and op-plugin's golden use); the first C are its rows.
        chosen = torch.sort((routing_map != 0).T.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :per]
        token_of_row = chosen.reshape(-1)
        permuted = tokens.index_select(0, token_of_row)
        permuted_probs = _empty_probs(tokens) if probs is None else probs.T.gather(1, chosen).reshape(-1)
        return permuted, permuted_probs, token_of_row.int()
    ranked = _ranked(routing_map)  # each token's experts ascending, E after
    experts = ranked[:, :per] if per <= e else torch.cat([ranked, ranked.new_full((t, per - e), e)], 1)
    over = ranked[:, per] < e if per < e else torch.zeros(1, dtype=torch.bool, device=ranked.device)
    live, excess = _host((experts < e).sum(), over.any())
    if excess:
        worst = int((routing_map != 0).sum(1).argmax())
        raise fail(INVALID, PERMUTE, "routing_map", f"at most K = num_out_tokens // T = {per} routed experts per "
                   "token", f"{int((routing_map[worst] != 0).sum())} in row {worst}")
    # The family's permute: a stable sort by expert id puts the pairs expert-major, tokens ascending; the slots
    # past a token's last expert carry id E, sort after every pair and fall past the live rows.
    gathered, slot_row = kernels.permute(tokens, experts, live)
    sorted_indices = torch.where(slot_row < live, slot_row, -1)
    permuted = gathered if live == rows else torch.cat([gathered, gathered.new_zeros((rows - live, h))])
    if probs is None:
        return permuted, _empty_probs(tokens), sorted_indices
    weights = torch.cat([probs, probs.new_zeros(t, 1)], 1).gather(1, experts)  # id E: the zero column
    spread = probs.new_zeros(rows + 1)  # the last element takes the empty slots' writes
    spread.scatter_(0, torch.where(slot_row < live, slot_row.long(), rows).reshape(-1), weights.reshape(-1))
    return permuted, spread[:rows], sorted_indices


def permute_grad(kernels: Kernels, grad: Tensor, grad_probs: Tensor | None, sorted_indices: Tensor,
                 routing_map: Tensor | None, num_experts: int, num_tokens: int, drop_and_pad: bool
                 ) -> tuple[Tensor, Tensor]:
    """``(tokens_grad (T, H), probs_grad (T, E), empty without grad_probs)``."""
    rows, h = grad.shape
    if not num_tokens:
        return grad.new_zeros((0, h)), _empty_probs(grad) if grad_probs is None else grad_probs.new_zeros((0,
                                                                                                           num_experts))
    per = rows // num_experts if drop_and_pad else sorted_indices.numel() // num_tokens
    if not drop_and_pad and _whole(sorted_indices, routing_map if grad_probs is not None else None, per, rows):
        dtokens = _tested_by_kernel(PERMUTE_GRAD, sorted_indices, rows, kernels.permute_grad, grad, sorted_indices,
                                    per, trusted=False)
        if grad_probs is None:
            return dtokens, _empty_probs(grad)
        at_slot = grad_probs[sorted_indices.long()]  # a permutation of the rows: the kernel tested it
        return dtokens, grad_probs.new_zeros((num_tokens, num_experts)).masked_scatter_(routing_map != 0, at_slot)
    # The map says each slot's expert, which only the probs' gradient needs.
    table = _from_rows(PERMUTE_GRAD, sorted_indices, num_tokens, per, rows, drop_and_pad,
                       routing_map if grad_probs is not None else None, num_experts)
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
    # The map says each slot's expert, which only the weights and the probs' gradient need.
    return _from_rows(op, sorted_indices, tokens, per, rows, drop_and_pad, routing_map if probs is not None else None,
                      experts)


def unpermute(kernels: Kernels, permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape: Sequence[int],
              probs: Tensor | None, routing_map: Tensor | None, drop_and_pad: bool) -> Tensor:
    """``out (T, H)`` in permuted_tokens' dtype."""
    tokens = restore_shape[0]
    if not tokens:
        return permuted_tokens.new_zeros((0, permuted_tokens.shape[1]))
    if not drop_and_pad:
        per = sorted_indices.numel() // tokens
        if _whole(sorted_indices, routing_map if probs is not None else None, per, permuted_tokens.shape[0]):
            weights = (permuted_tokens.new_ones((tokens, per)) if probs is None else
                       probs.masked_select(routing_map != 0).view(tokens, per))
            return _tested_by_kernel(UNPERMUTE, sorted_indices, permuted_tokens.shape[0], kernels.unpermute,
                                     permuted_tokens, sorted_indices, weights)
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
    if probs is not None and not drop_and_pad:
        per = sorted_indices.numel() // tokens
        if _whole(sorted_indices, routing_map, per, rows):
            mask = routing_map != 0
            weights = probs.masked_select(mask).view(tokens, per)
            dpermuted, at_slot = _tested_by_kernel(UNPERMUTE_GRAD, sorted_indices, rows, kernels.unpermute_grad,
                                                   permuted_tokens, grad_unpermuted, sorted_indices, weights,
                                                   trusted=False)
            return dpermuted, probs.new_zeros((tokens, experts)).masked_scatter_(mask, at_slot)
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


def ops_on(kernels: Kernels) -> tuple[Callable[..., Any], ...]:
    """The four ops on a backend's ``kernels``, in the order permute, permute_grad, unpermute, unpermute_grad: what
    :mod:`gradops.cpu` and :mod:`gradops.launch` export under the ops' names."""
    return partial(permute, kernels), partial(permute_grad, kernels), partial(unpermute, kernels), \
        partial(unpermute_grad, kernels)


# ---------------------------------------------------------------- the reference backend
def _reference(compute: torch.dtype) -> Kernels:
    """The reference kernels summing in ``compute``."""
    return Kernels(*moe_permute.kernels(compute))


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


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP = Impl(moe_token_permute_with_routing_map)
MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD = Impl(moe_token_permute_with_routing_map_grad)
MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP = Impl(moe_token_unpermute_with_routing_map)
MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD = Impl(moe_token_unpermute_with_routing_map_grad)
