"""Expert parallelism: send each token copy to the rank that owns its expert, and bring the results back.

The all-to-all token dispatcher of Megatron (``MoEAlltoAllTokenDispatcher``), DeepEP's dispatch / combine and
MindSpeed on Ascend (through ``npu_moe_token_permute`` / ``npu_moe_token_unpermute``) share one shape: permute the
(token, k) copies locally so that copies bound for one rank are contiguous, exchange them with
``all_to_all_single``, regroup what arrived by local expert, run the experts, and undo the three steps. Here the
permutes are gradops' own (:func:`gradops.moe_token_permute` / :func:`gradops.moe_token_unpermute`, CANN's
convention), so the backward is their gradients plus the reverse exchange.

Layout: ``num_experts`` experts split evenly and contiguously over the ``W`` ranks of ``group``, expert ``e`` on
rank ``e // (num_experts / W)``. On a rank, the rows handed to the experts are grouped by local expert, and within
one expert ordered by source rank, then by the source's (token, k) order: every rank sees the same order on every
run, so results are bitwise repeatable (no atomics; all-to-all moves bytes, it does not add them).

Cost per call beyond the local permutes: one all-to-all of the per-expert counts (``num_experts`` int64 per rank)
and one host sync to read the split sizes, as in Megatron's dispatcher; then one all-to-all of the rows each way.
With world size 1 (or no initialised process group) nothing is exchanged and dispatch / combine are exactly the
local permute / unpermute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .contract._common import dtype_name, shape_text
from .families.moe.ops import moe_token_permute, moe_token_unpermute
from .ops._sharding import register as register_sharding_rules
from .status import ACLNN_ERR_PARAM_INVALID, OpError

_INDEX_DTYPES = (torch.int32, torch.int64)

if torch.distributed.is_available():
    register_sharding_rules()  # DTensor's rules for every gradops op (see gradops.ops._sharding)


def world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (the default group when None); 1 when no process group is initialised."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _rank(group: Any = None) -> int:
    dist = torch.distributed
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; its backward is the same exchange with the splits
    swapped (each row's gradient goes back to the rank the row came from)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        torch.distributed.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        torch.distributed.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass(frozen=True)
class Handle:
    """What :func:`combine` needs to undo a :func:`dispatch`.

    Attributes:
        sorted_indices: the local permute's (T*K,) int32 indices (CANN's convention: destination row per copy).
        regroup: the received rows' permute into local-expert order ((rows received,) int32); None when nothing
            was exchanged (world size 1).
        send_splits, recv_splits: rows sent to / received from each rank.
        tokens, topk: T and K of the dispatched tokens.
        group: the process group.
    """

    sorted_indices: Tensor
    regroup: Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    tokens: int
    topk: int
    group: Any = None


def _require_num_experts(op: str, num_experts: object, world: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or num_experts % world:
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "num_experts", f"a positive multiple of the world size {world}",
                      repr(num_experts))


def _check(tokens: Tensor, topk_ids: Tensor, num_experts: int, world: int) -> int:
    """Refuse what the exchange cannot carry; returns K."""
    op = "dispatch"
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        given = shape_text(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "tokens", "a 2-D (T, H) tensor", given)
    if not isinstance(topk_ids, Tensor) or topk_ids.dtype not in _INDEX_DTYPES:
        given = dtype_name(topk_ids.dtype) if isinstance(topk_ids, Tensor) else type(topk_ids).__name__
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "topk_ids", "an int32 / int64 tensor", given)
    if topk_ids.dim() not in (1, 2) or topk_ids.shape[0] != tokens.shape[0]:
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "topk_ids.shape", f"({tokens.shape[0]}, K) or "
                      f"({tokens.shape[0]},) (one row per token)", shape_text(topk_ids.shape))
    _require_num_experts(op, num_experts, world)
    if topk_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids))  # one sync, before anything is indexed with them
        if lo < 0 or hi >= num_experts:
            raise OpError(ACLNN_ERR_PARAM_INVALID, op, "topk_ids", f"expert ids in [0, {num_experts})",
                          f"values in [{lo}, {hi}]")
    return topk_ids.shape[1] if topk_ids.dim() == 2 else 1


def dispatch_local(tokens: Tensor, topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Handle]:
    """The (token, k) copies grouped by expert on this rank, nothing exchanged: what :func:`dispatch` does at world
    size 1, without its checks and its host sync (what a model's experts run every step; the ops check their own
    arguments).

    Args:
        tokens: (T, H) tokens.
        topk_ids: (T, K) or (T,) expert ids; ids ``>= num_experts`` (sentinels for experts on other ranks, as
            transformers' expert parallelism writes them) sort to the tail and are not counted.
        num_experts: E.

    Returns:
        ``(rows, offsets, handle)``: the (T*K, H) rows expert by expert (stable in token order); ``offsets`` (E,)
        int32, the end row of each expert (a grouped matmul's offsets); the handle for :func:`combine`.
        Differentiable w.r.t. ``tokens``.
    """
    rows, sorted_indices = moe_token_permute(tokens, topk_ids)
    # Rows per expert by histc, as transformers' "grouped_mm" counts them: a fixed-size result (no host sync,
    # CUDA-graph and torch.compile friendly) that drops the sentinels (> max) from the counts; CPU's histc takes
    # only floats (exact for ids < 2**24), CUDA's deterministic histc only integers.
    ids = topk_ids.reshape(-1)
    counted = ids.float() if ids.device.type in ("cpu", "mps") else ids.int()
    offsets = torch.cumsum(torch.histc(counted, bins=num_experts, min=0, max=num_experts - 1), 0, dtype=torch.int32)
    n = rows.shape[0]
    topk = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    return rows, offsets, Handle(sorted_indices, None, [n], [n], tokens.shape[0], topk)


def dispatch(tokens: Tensor, topk_ids: Tensor, num_experts: int, group: Any = None) -> tuple[Tensor, Tensor, Handle]:
    """Send each (token, k) copy to the rank owning expert ``topk_ids[t, k]``, grouped by local expert.

    Args:
        tokens: (T, H) this rank's tokens (T may differ between ranks, and may be 0).
        topk_ids: (T, K) or (T,) int32 / int64 expert ids in ``[0, num_experts)`` (OpError 161002 otherwise).
        num_experts: E, a multiple of the world size W; rank r owns experts ``[r*E/W, (r+1)*E/W)``.
        group: the process group (default: the default group; none initialised: world size 1).

    Returns:
        ``(expert_tokens, tokens_per_local_expert, handle)``: the rows for this rank's experts, expert by expert
        (expert ``r*E/W + j`` owns the ``tokens_per_local_expert[j]`` rows after the previous experts'; int64 on
        the tokens' device), and the handle for :func:`combine`. Differentiable w.r.t. ``tokens``.
    """
    world = world_size(group)
    k = _check(tokens, topk_ids, num_experts, world)
    permuted, sorted_indices = moe_token_permute(tokens, topk_ids)
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=num_experts)
    if world == 1:
        n = permuted.shape[0]
        return permuted, counts, Handle(sorted_indices, None, [n], [n], tokens.shape[0], k, group)
    local = num_experts // world
    received_counts = torch.empty_like(counts)  # [source rank, local expert]
    torch.distributed.all_to_all_single(received_counts, counts, group=group)
    both = torch.stack([counts.view(world, local).sum(1), received_counts.view(world, local).sum(1)]).tolist()
    send_splits, recv_splits = both
    received = _AllToAll.apply(permuted, recv_splits, send_splits, group)
    # Arrived in (source rank, local expert) blocks; a stable permute by local expert keeps source order within one.
    local_ids = torch.arange(local, device=tokens.device).repeat(world).repeat_interleave(received_counts)
    expert_tokens, regroup = moe_token_permute(received, local_ids)
    handle = Handle(sorted_indices, regroup, send_splits, recv_splits, tokens.shape[0], k, group)
    return expert_tokens, received_counts.view(world, local).sum(0), handle


def combine(expert_output: Tensor, handle: Handle, probs: Tensor | None = None) -> Tensor:
    """Bring the experts' rows back to their tokens' ranks and merge each token's K copies.

    Args:
        expert_output: (rows, H') the experts' results, in :func:`dispatch`'s row order (H' may differ from H).
        handle: from the :func:`dispatch` of the same step.
        probs: (T, K) routing weights, or None (each copy weighs 1).

    Returns:
        (T, H'): ``sum_k probs[t, k] * row of copy (t, k)``, summed in float32 in k order (as
        :func:`gradops.moe_token_unpermute`). Differentiable w.r.t. ``expert_output`` and ``probs``.
    """
    rows = sum(handle.recv_splits)
    if not isinstance(expert_output, Tensor) or expert_output.dim() != 2 or expert_output.shape[0] != rows:
        given = shape_text(expert_output.shape) if isinstance(expert_output, Tensor) else type(expert_output).__name__
        raise OpError(ACLNN_ERR_PARAM_INVALID, "combine", "expert_output", f"a 2-D tensor of {rows} rows (what "
                      "dispatch handed to the experts)", given)
    back = expert_output
    if handle.regroup is not None:
        back = moe_token_unpermute(back, handle.regroup)  # local-expert order -> arrival order
        back = _AllToAll.apply(back, handle.send_splits, handle.recv_splits, handle.group)
    if probs is None and handle.topk > 1:
        probs = back.new_ones((handle.tokens, handle.topk))
    return moe_token_unpermute(back, handle.sorted_indices, probs)


class TokenDispatcher:
    """The dispatcher a model's MoE block holds: :meth:`dispatch` then :meth:`combine` once per step.

    Args:
        num_experts: E, a multiple of the world size of ``group``.
        group: the expert-parallel process group (default group when None).

    Attributes:
        local_experts: ``range`` of the expert ids this rank owns (all of them at world size 1).
    """

    def __init__(self, num_experts: int, group: Any = None) -> None:
        world = world_size(group)
        _require_num_experts("TokenDispatcher", num_experts, world)
        self.num_experts, self.group = num_experts, group
        per, rank = num_experts // world, _rank(group)
        self.local_experts = range(rank * per, (rank + 1) * per)
        self._handle: Handle | None = None

    def dispatch(self, tokens: Tensor, topk_ids: Tensor) -> tuple[Tensor, Tensor]:
        """:func:`dispatch` with this dispatcher's experts and group; returns ``(expert_tokens,
        tokens_per_local_expert)`` and keeps the handle for :meth:`combine`."""
        expert_tokens, counts, self._handle = dispatch(tokens, topk_ids, self.num_experts, self.group)
        return expert_tokens, counts

    def combine(self, expert_output: Tensor, probs: Tensor | None = None) -> Tensor:
        """:func:`combine` with the handle of the last :meth:`dispatch` (each dispatch is combined once)."""
        if self._handle is None:
            raise RuntimeError("TokenDispatcher.combine: no dispatch to combine (call dispatch first, once per "
                               "combine)")
        handle, self._handle = self._handle, None
        return combine(expert_output, handle, probs)

    def __repr__(self) -> str:
        return (f"TokenDispatcher(num_experts={self.num_experts}, world_size={world_size(self.group)}, "
                f"local_experts={self.local_experts.start}..{self.local_experts.stop - 1})")
