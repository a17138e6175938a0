"""Validation table of aclnnMoeTokenPermute and aclnnMoeTokenPermuteGrad.

Sources: the seed (004), hicann/ops-transformer ``moe/moe_token_permute{,_grad}`` op defs and docs. CANN checks
little beyond dtypes and leaves bad shapes undefined; gradops refuses them with 161002 (the choice recommended in
docs/semantics.md §5), and refuses sorted indices outside ``[0, T*K)`` before any kernel reads with them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..status import ACLNN_ERR_PARAM_INVALID as INVALID
from ..status import OpError
from ._common import (
    FLOATS,
    fail,
    require_dtype,
    require_int,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    require_shape,
    shape_text,
)

MAX_TOPK = 512
INDEX_DTYPES = (torch.int32, torch.int64)


class MoePlan(NamedTuple):
    tokens: int    # T
    topk: int      # K
    hidden: int    # H
    rows: int      # permuted rows present: num_out_tokens (forward) or grad.shape[0] (backward), <= T*K


def _check_padded_mode(op: str, padded_mode: object) -> None:
    if not isinstance(padded_mode, bool):
        raise fail(INVALID, op, "padded_mode", "a bool", type(padded_mode).__name__)
    if padded_mode:
        raise fail(INVALID, op, "padded_mode", "False (CANN supports only paddedMode=false)", "True")


def out_rows(num_out_tokens: int | None, total: int) -> int:
    """Rows kept by the forward: 0 or None keeps all T*K; otherwise ``sorted[:num_out_tokens]`` with Python's
    slice rules, negative values included (aclnnMoeTokenPermute numOutTokens)."""
    if not num_out_tokens:
        return total
    return len(range(total)[:num_out_tokens])


def check_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False, *, permuted=None,
                            sorted_indices=None, cann: bool = False) -> MoePlan:
    op = "moe_token_permute"
    outs = {"permuteTokensOut": permuted, "sortedIndicesOut": sorted_indices} if cann else {}
    require_present(op, tokens=tokens, indices=indices, **outs)
    if num_out_tokens is not None:
        require_int(op, "num_out_tokens", num_out_tokens)
    _check_padded_mode(op, padded_mode)
    require_same_device(op, tokens=tokens, indices=indices, **outs)
    require_dtype(op, "tokens", tokens, FLOATS)
    require_dtype(op, "indices", indices, INDEX_DTYPES)
    if cann:
        require_same_dtype(op, "permuteTokensOut", permuted, "tokens", tokens)
        require_dtype(op, "sortedIndicesOut", sorted_indices, (torch.int32,))
    require_rank(op, "tokens", tokens, 2, 2)
    require_rank(op, "indices", indices, 1, 2)
    t, h = tokens.shape
    if indices.shape[0] != t:
        raise fail(INVALID, op, "indices.shape", f"({t},) or ({t}, K) with T = tokens.shape[0]",
                   shape_text(indices.shape))
    k = indices.shape[1] if indices.dim() == 2 else 1
    if not 1 <= k <= MAX_TOPK:
        raise fail(INVALID, op, "indices.shape[1]", f"a top-k in [1, {MAX_TOPK}]", str(k))
    plan = MoePlan(t, k, h, out_rows(num_out_tokens, t * k))
    if cann:
        require_shape(op, "permuteTokensOut", permuted, (plan.rows, h), "(numOutTokens, H)")
        require_shape(op, "sortedIndicesOut", sorted_indices, (t * k,), "(T*K,)")
    return plan


def check_moe_token_permute_grad(grad, sorted_indices, num_topk, padded_mode=False, *, out=None,
                                 cann: bool = False) -> MoePlan:
    op = "moe_token_permute_grad"
    outs = {"out": out} if cann else {}
    require_present(op, permuted_output_grad=grad, sorted_indices=sorted_indices, **outs)
    require_int(op, "num_topk", num_topk, 1, MAX_TOPK)
    _check_padded_mode(op, padded_mode)
    require_same_device(op, permuted_output_grad=grad, sorted_indices=sorted_indices, **outs)
    require_dtype(op, "permuted_output_grad", grad, FLOATS)
    require_dtype(op, "sorted_indices", sorted_indices, (torch.int32,) if cann else INDEX_DTYPES)
    if cann:
        require_same_dtype(op, "out", out, "permuted_output_grad", grad)
    require_rank(op, "permuted_output_grad", grad, 2, 2)
    require_rank(op, "sorted_indices", sorted_indices, 1, 1)
    total = sorted_indices.shape[0]
    if total % num_topk:
        raise fail(INVALID, op, "sorted_indices.shape", f"(T*K,) with K = num_topk = {num_topk}",
                   shape_text(sorted_indices.shape))
    rows, h = grad.shape
    if rows > total:
        raise fail(INVALID, op, "permuted_output_grad.shape",
                   f"at most T*K = {total} rows (fewer when tokens were dropped)", shape_text(grad.shape))
    plan = MoePlan(total // num_topk, num_topk, h, rows)
    if cann:
        require_shape(op, "out", out, (plan.tokens, h), "(T, H) with T = sorted_indices.numel() / num_topk")
    return plan


def sorted_index_error(value: int, position: int, total: int, op: str = "moe_token_permute_grad") -> OpError:
    """The OpError (161002) of a sorted index ``value`` at ``position`` outside ``[0, T*K)``: one text for this
    module's check and each backend's own test where it reads the indices."""
    return fail(INVALID, op, "sorted_indices", f"values in [0, T*K) = [0, {total})", f"{value} at position {position}")


def checked_sorted_indices(sorted_indices: torch.Tensor, op: str = "moe_token_permute_grad") -> torch.Tensor:
    """Refuse entries outside ``[0, T*K)`` (one host synchronisation); returns the tensor unchanged."""
    total = sorted_indices.numel()
    if total:
        lo, hi = torch.aminmax(sorted_indices)
        if int(lo) < 0 or int(hi) >= total:
            bad = int(((sorted_indices < 0) | (sorted_indices >= total)).nonzero()[0, 0])
            raise sorted_index_error(int(sorted_indices[bad]), bad, total, op)
    return sorted_indices
