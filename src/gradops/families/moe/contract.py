"""Validation table of aclnnMoeTokenPermute, aclnnMoeTokenPermuteGrad, aclnnMoeTokenUnpermute and
aclnnMoeTokenUnpermuteGrad.

Sources: the seed (004), hicann/ops-transformer ``moe/moe_token_{permute,unpermute}{,_grad}`` op defs and docs
(docs/semantics.md §5). CANN checks little beyond dtypes and leaves bad shapes undefined; gradops refuses them
with 161002 (the choice recommended in docs/semantics.md §5), and refuses sorted indices outside ``[0, T*K)``
before any kernel reads with them. The permute gradient and the unpermute pair also need sorted_indices to be a
permutation (CANN: "取值范围是[0, tokens_num*topK_num-1]，且没有重复索引", no repeated index): a repeated row
would sum one permuted row into several tokens and leave another without its source; each backend refuses one
(:func:`permutation_error`) in the pass over the indices its kernel makes before it writes. The permute's expert
ids must be >= 0 (CANN: "值大于等于0"); a negative one would sort before expert 0 and shift its rows, so each
backend refuses it (:func:`expert_id_error`) in its sort's first pass; ids past every expert are accepted and
sort last, where num_out_tokens drops them.
Float tensors are CANN's three dtypes on the aclnn surface (``cann=True``); the PyTorch API also takes float64.
"""

from __future__ import annotations

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
    require_same_dtype,
    require_shape,
    shape_text,
)
from ...status import ACLNN_ERR_INNER_TILING_ERROR as TILING
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import OpError

MAX_TOPK = 512
INDEX_DTYPES = (torch.int32, torch.int64)


class MoeShape(NamedTuple):
    tokens: int    # T
    topk: int      # K
    hidden: int    # H
    rows: int      # permuted rows present: num_out_tokens (forward) or grad.shape[0] (backward), <= T*K


# What each op returns, declared once (see gradops.contract._common.Result).
def moe_token_permute_results(shape: MoeShape, tokens, indices, num_out_tokens=None, padded_mode=False
                              ) -> list[Result]:
    """MoeTokenPermute's results: permuted (rows, H) in tokens' dtype, sorted_indices (T·K,) int32."""
    return [Result((shape.rows, shape.hidden), tokens.dtype, tokens),
            Result((shape.tokens * shape.topk,), torch.int32, indices)]


def moe_token_permute_grad_results(shape: MoeShape, permuted_output_grad, sorted_indices, num_topk,
                                   padded_mode=False) -> list[Result]:
    """MoeTokenPermuteGrad's result: the (T, H) token gradient in the gradient's dtype."""
    return [Result((shape.tokens, shape.hidden), permuted_output_grad.dtype, permuted_output_grad)]


def moe_token_unpermute_results(shape: MoeShape, permuted_tokens, sorted_indices, probs=None, padded_mode=False
                                ) -> list[Result]:
    """MoeTokenUnpermute's result: (T, H) in permuted_tokens' dtype."""
    return [Result((shape.tokens, shape.hidden), permuted_tokens.dtype, permuted_tokens)]


def moe_token_unpermute_grad_results(shape: MoeShape, permuted_tokens, grad_unpermuted, sorted_indices, probs=None,
                                     padded_mode=False) -> list[Result]:
    """MoeTokenUnpermuteGrad's results: the rows' gradient (rows, H) in permuted_tokens' dtype, the probs' (T, K) in
    probs' dtype; without probs an empty (0,) tensor of permuted_tokens' dtype (torch_npu's schema)."""
    d_probs = (Result((0,), permuted_tokens.dtype, permuted_tokens) if probs is None else
               Result((shape.tokens, shape.topk), probs.dtype, probs))
    return [Result((shape.rows, shape.hidden), permuted_tokens.dtype, permuted_tokens), d_probs]


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
                            sorted_indices=None, cann: bool = False) -> MoeShape:
    op = "moe_token_permute"
    outs = {"permuteTokensOut": permuted, "sortedIndicesOut": sorted_indices} if cann else {}
    require_present(op, tokens=tokens, indices=indices, **outs)
    if num_out_tokens is not None:
        require_int(op, "num_out_tokens", num_out_tokens)
    _check_padded_mode(op, padded_mode)
    require_same_device(op, tokens=tokens, indices=indices, **outs)
    require_dtype(op, "tokens", tokens, floats(cann))
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
    shape = MoeShape(t, k, h, out_rows(num_out_tokens, t * k))
    if cann:
        require_shape(op, "permuteTokensOut", permuted, (shape.rows, h), "(numOutTokens, H)")
        require_shape(op, "sortedIndicesOut", sorted_indices, (t * k,), "(T*K,)")
    return shape


def check_moe_token_permute_grad(grad, sorted_indices, num_topk, padded_mode=False, *, out=None,
                                 cann: bool = False) -> MoeShape:
    op = "moe_token_permute_grad"
    outs = {"out": out} if cann else {}
    require_present(op, permuted_output_grad=grad, sorted_indices=sorted_indices, **outs)
    require_int(op, "num_topk", num_topk, 1, MAX_TOPK)
    _check_padded_mode(op, padded_mode)
    require_same_device(op, permuted_output_grad=grad, sorted_indices=sorted_indices, **outs)
    require_dtype(op, "permuted_output_grad", grad, floats(cann))
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
    shape = MoeShape(total // num_topk, num_topk, h, rows)
    if cann:
        require_shape(op, "out", out, (shape.tokens, h), "(T, H) with T = sorted_indices.numel() / num_topk")
    return shape


def sorted_index_error(value: int, position: int, total: int, op: str = "moe_token_permute_grad") -> OpError:
    """The OpError (161002) of a sorted index ``value`` at ``position`` outside ``[0, T*K)``: one text for this
    module's check and each backend's own test where it reads the indices."""
    return fail(INVALID, op, "sorted_indices", f"values in [0, T*K) = [0, {total})", f"{value} at position {position}")


def expert_id_error(value: int | str, position: int) -> OpError:
    """The OpError (161002) of a negative expert id ``value`` at flat ``position`` of moe_token_permute's indices.

    CANN documents the ids as "值大于等于0" (>= 0; aclnnMoeTokenPermute, indices): a negative id is outside the
    op's domain, and sorting it first, as the formula's argsort would, takes expert 0's leading rows, so it is
    refused rather than given a place of its own. Ids past every expert (routing sentinels, int32's max among
    them) are accepted: the argsort puts them after every expert, where num_out_tokens drops them."""
    return fail(INVALID, "moe_token_permute", "indices", "expert ids >= 0", f"{value} at position {position}")


def negative_id_error(indices: torch.Tensor) -> OpError | None:
    """The :func:`expert_id_error` of the first negative id in ``indices`` (read on the host), or None."""
    flat = indices.detach().reshape(-1)
    negative = (flat < 0).nonzero()
    if not negative.numel():
        return None
    pos = int(negative[0, 0])
    return expert_id_error(int(flat[pos]), pos)


def checked_expert_ids(indices: torch.Tensor) -> torch.Tensor:
    """Refuse a negative expert id (one host synchronisation: the reference backend's test; the compiled backends
    test in their own sort's first pass and raise the same :func:`expert_id_error`); returns the tensor."""
    if indices.numel() and int(indices.min()) < 0:
        raise negative_id_error(indices)
    return indices


def checked_sorted_indices(sorted_indices: torch.Tensor, op: str = "moe_token_permute_grad") -> torch.Tensor:
    """Refuse entries outside ``[0, T*K)`` (one host synchronisation); returns the tensor unchanged."""
    total = sorted_indices.numel()
    if total:
        lo, hi = torch.aminmax(sorted_indices)
        if int(lo) < 0 or int(hi) >= total:
            bad = int(((sorted_indices < 0) | (sorted_indices >= total)).nonzero()[0, 0])
            raise sorted_index_error(int(sorted_indices[bad]), bad, total, op)
    return sorted_indices


def check_restore_shape(op: str, restore_shape: object) -> None:
    """restoreShapeOptional: read by CANN only in padded mode (unsupported), so any int sequence or None."""
    if restore_shape is None:
        return
    if isinstance(restore_shape, (str, bytes)) or not hasattr(restore_shape, "__iter__") or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in restore_shape):
        raise fail(INVALID, op, "restore_shape", "None or a sequence of ints", repr(restore_shape))


def _unpermute_shapes(op: str, permuted_tokens, sorted_indices, probs, cann: bool) -> MoeShape:
    """The shared part of the unpermute pair: (A, H) rows, (T*K,) indices, probs (T, K) or None (K = 1)."""
    require_dtype(op, "permuted_tokens", permuted_tokens, floats(cann))
    require_dtype(op, "sorted_indices", sorted_indices, (torch.int32,) if cann else INDEX_DTYPES)
    if probs is not None:
        require_dtype(op, "probs", probs, floats(cann))
    require_rank(op, "permuted_tokens", permuted_tokens, 2, 2)
    require_rank(op, "sorted_indices", sorted_indices, 1, 1)
    total = sorted_indices.shape[0]
    if probs is None:
        k = 1
    else:
        require_rank(op, "probs", probs, 2, 2)
        k = probs.shape[1]
        if not 1 <= k <= MAX_TOPK or probs.shape[0] * k != total:
            # CANN finds this mismatch while tiling (ops-transformer's InputParamCheck): 561002 on the aclnn surface.
            raise fail(TILING if cann else INVALID, op, "probs",
                       f"of shape (T, K) with T*K = sorted_indices.numel() = {total} and K in [1, {MAX_TOPK}]",
                       f"shape {shape_text(probs.shape)}")
    rows, h = permuted_tokens.shape
    if rows > total:
        raise fail(TILING if cann else INVALID, op, "permuted_tokens.shape",
                   f"at most T*K = sorted_indices.numel() = {total} rows (fewer when tokens were dropped)",
                   shape_text(permuted_tokens.shape))
    return MoeShape(total // k, k, h, rows)


def check_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, *, out=None,
                              cann: bool = False) -> MoeShape:
    """aclnnMoeTokenUnpermute: ``out (T, H)`` in permuted_tokens' dtype; K = probs.shape[1], or 1 without probs."""
    op = "moe_token_unpermute"
    outs = {"out": out} if cann else {}
    require_present(op, permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, **outs)
    if probs is not None:
        require_present(op, probs=probs)
    _check_padded_mode(op, padded_mode)
    require_same_device(op, permuted_tokens=permuted_tokens, sorted_indices=sorted_indices,
                        **({} if probs is None else {"probs": probs}), **outs)
    shape = _unpermute_shapes(op, permuted_tokens, sorted_indices, probs, cann)
    if cann:
        require_same_dtype(op, "out", out, "permuted_tokens", permuted_tokens)
        require_shape(op, "out", out, (shape.tokens, shape.hidden), "(T, H)")
    return shape


def check_moe_token_unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs=None, padded_mode=False,
                                   *, grad_permuted=None, grad_probs=None, cann: bool = False) -> MoeShape:
    """aclnnMoeTokenUnpermuteGrad: the gradient ``grad_unpermuted (T, H)`` of the forward's output, any float
    dtype (CANN lists float16 / bfloat16 / float32 for each tensor separately); results in permuted_tokens' and
    probs' dtypes."""
    op = "moe_token_unpermute_grad"
    outs = {"permutedTokensGradOut": grad_permuted} if cann else {}
    require_present(op, permuted_tokens=permuted_tokens, grad_unpermuted=grad_unpermuted,
                    sorted_indices=sorted_indices, **outs)
    if probs is not None:
        require_present(op, probs=probs)
    if cann and probs is not None:
        require_present(op, probsGradOut=grad_probs)
    _check_padded_mode(op, padded_mode)
    require_same_device(op, permuted_tokens=permuted_tokens, grad_unpermuted=grad_unpermuted,
                        sorted_indices=sorted_indices, **({} if probs is None else {"probs": probs}), **outs)
    shape = _unpermute_shapes(op, permuted_tokens, sorted_indices, probs, cann)
    require_dtype(op, "grad_unpermuted", grad_unpermuted, floats(cann))
    require_rank(op, "grad_unpermuted", grad_unpermuted, 2, 2)
    tokens = grad_unpermuted.shape[0]
    if probs is not None and tokens != shape.tokens and tokens and sorted_indices.shape[0] % tokens == 0:
        # The gradient fixes T, which the forward could not see: a (K, T) probs passed for (T, K) is named here.
        raise fail(INVALID, op, "probs", f"of shape (T, K) = ({tokens}, {sorted_indices.shape[0] // tokens}) "
                   f"(T from grad_unpermuted, K = sorted_indices.numel() / T)", f"shape {shape_text(probs.shape)}")
    require_shape(op, "grad_unpermuted", grad_unpermuted, (shape.tokens, shape.hidden),
                  "(T, H): the forward's output shape")
    if cann:
        require_same_dtype(op, "permutedTokensGradOut", grad_permuted, "permuted_tokens", permuted_tokens)
        require_shape(op, "permutedTokensGradOut", grad_permuted, (shape.rows, shape.hidden), "(A, H)")
        if probs is not None:
            require_same_dtype(op, "probsGradOut", grad_probs, "probs", probs)
            require_shape(op, "probsGradOut", grad_probs, (shape.tokens, shape.topk), "(T, K)")
    return shape


def permutation_error(sorted_indices: torch.Tensor, op: str) -> OpError | None:
    """The OpError (161002) of sorted indices that are not a permutation of ``[0, T*K)``, or None if they are.

    Runs on the host (a sort and a count of the T*K entries): the backends call it when their own fast test
    (a bitmap pass in the CPU kernel, a flag on the GPU) found something, so that every backend says the same."""
    total = sorted_indices.numel()
    if not total:
        return None
    s = sorted_indices.detach().reshape(-1).long().cpu()
    outside = ((s < 0) | (s >= total)).nonzero()
    if outside.numel():
        pos = int(outside[0, 0])
        return sorted_index_error(int(s[pos]), pos, total, op)
    counts = torch.bincount(s, minlength=total)
    if bool((counts == 1).all()):
        return None
    row = int((counts > 1).nonzero()[0, 0])
    return fail(INVALID, op, "sorted_indices", "a permutation of [0, T*K) naming every row once",
                f"row {row} named {int(counts[row])} times")


def checked_permutation(sorted_indices: torch.Tensor, op: str) -> torch.Tensor:
    """Refuse sorted indices that are not a permutation of ``[0, T*K)`` (one host synchronisation for the common
    case: a sorted copy equals ``arange``); returns the tensor unchanged. The torch-level test of the reference
    backend; the compiled backends test in their own way and raise the same :func:`permutation_error`."""
    total = sorted_indices.numel()
    if total:
        ordered = torch.sort(sorted_indices.reshape(-1)).values
        if not bool(torch.equal(ordered, torch.arange(total, dtype=ordered.dtype, device=ordered.device))):
            error = permutation_error(sorted_indices, op)
            if error is not None:
                raise error
    return sorted_indices
