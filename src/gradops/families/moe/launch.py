"""Host launchers of MoeTokenPermute, MoeTokenPermuteGrad, MoeTokenUnpermute and MoeTokenUnpermuteGrad (backend
``triton``)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...contract._common import written
from ...launch._common import carve, guard, launch, outputs, workspace_bytes
from ...spec import Impl
from . import routing_reference as routing
from .contract import (
    MoeShape,
    expert_id_error,
    moe_token_permute_grad_results,
    moe_token_permute_results,
    moe_token_unpermute_grad_results,
    moe_token_unpermute_results,
    negative_id_error,
    permutation_error,
    sorted_index_error,
)
from .kernels import (
    moe_blocks,
    moe_token_permute_grad_kernel,
    moe_token_permute_kernel,
    moe_token_unpermute_grad_kernel,
    moe_token_unpermute_kernel,
)


def _specs(indices: Tensor) -> list[tuple[int, torch.dtype]]:
    return [(indices.numel(), indices.dtype), (indices.numel(), torch.int64)]  # sorted keys, stable argsort


def moe_token_permute_workspace(tokens: Tensor, indices: Tensor, num_rows: int) -> int:
    """Scratch bytes of :func:`moe_token_permute`: the sort's keys and argsort, ``T*K*(s_idx + 8)``."""
    return workspace_bytes(_specs(indices)) if indices.numel() else 0


def moe_token_permute(tokens: Tensor, indices: Tensor, num_rows: int, *, workspace: Tensor | None = None,
                      out: tuple[Tensor, Tensor] | None = None, block_h: int | None = None) -> tuple[Tensor, Tensor]:
    """CANN's permute: stable argsort of the flattened expert ids on the device, then one gather kernel.

    Args:
        tokens: (T, H) float16 / bfloat16 / float32, any strides.
        indices: (T, K) or (T,) int32 / int64 expert ids, >= 0: a negative one is flagged (OpError 161002, see
            :func:`._common.guard`; no host synchronisation on CUDA). The kernel's accesses do not depend on the
            ids' values (it reads the sort's permutation), so nothing is out of bounds whatever the flag says.
        num_rows: permuted rows kept (<= T*K).
        workspace: optional uint8 scratch of :func:`moe_token_permute_workspace` bytes.
        out: optional contiguous ``(permuted, sorted_indices)`` to write into. block_h: tests.

    Returns:
        ``(permuted (num_rows, H), sorted_indices (T*K,) int32)`` with ``permuted[sorted_indices[i]] =
        tokens[i // K]``.
    """
    h = tokens.shape[1]
    k = indices.shape[1] if indices.dim() == 2 else 1
    total = indices.numel()
    results = moe_token_permute_results(MoeShape(total // k, k, h, num_rows), tokens, indices)
    permuted, inverse = outputs(out, written(results), tokens.device)
    if total == 0:
        return permuted, inverse
    keys, first = carve(workspace, tokens.device, _specs(indices))
    torch.sort(indices.reshape(-1), stable=True, out=(keys, first))
    block_t, block_h, warps = moe_blocks(h, block_h)
    launch(moe_token_permute_kernel, (triton.cdiv(total, block_t), triton.cdiv(max(h, 1), block_h)), tokens, first,
           permuted, inverse, total, num_rows, k, h, tokens.stride(0), tokens.stride(1), BLOCK_J=block_t,
           BLOCK_H=block_h, num_warps=warps)
    # The smallest id is the sorted keys' first: one element read on the device, no pass of its own. Flagged after
    # the launch, so that a later call reports it (see guard).
    guard(keys[0] < 0, lambda: negative_id_error(indices) or expert_id_error(
        "a value changed again before it could be shown", -1))
    return permuted, inverse


def _guard_permutation(sorted_indices: Tensor, op: str) -> None:
    """Flag sorted indices that are not a permutation of ``[0, T*K)`` (a sorted copy differs from ``arange``: one
    device sort of T*K ints, no host synchronisation on CUDA; see :func:`._common.guard`). The kernels read and
    write only rows in ``[0, A)`` whatever the flag says; a repeated row would sum one row into several tokens
    (the permute gradient) or leave a gradient row unwritten (the unpermute gradient)."""
    total = sorted_indices.numel()
    if total:
        ordered = torch.sort(sorted_indices).values
        bad = (ordered != torch.arange(total, dtype=ordered.dtype, device=ordered.device)).any()
        guard(bad, lambda: permutation_error(sorted_indices, op) or sorted_index_error(
            "a value changed again before it could be shown", -1, total, op))


def _guard_range(sorted_indices: Tensor, op: str) -> None:
    """Flag entries outside ``[0, T*K)`` (one elementwise pass, no host synchronisation on CUDA): what a trusted
    call still tests, since a saved tensor can be changed behind autograd's back (``.data``, a numpy view)."""
    total = sorted_indices.numel()
    if total:
        def error() -> Exception:
            bad = ((sorted_indices < 0) | (sorted_indices >= total)).nonzero()
            if not bad.numel():  # changed again since the flag was raised
                return sorted_index_error("a value changed again before it could be shown", -1, total, op)
            pos = int(bad[0, 0])
            return sorted_index_error(int(sorted_indices[pos]), pos, total, op)

        guard(((sorted_indices < 0) | (sorted_indices >= total)).any(), error)


def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int, *, trusted: bool = False,
                           out: Tensor | None = None, block_h: int | None = None) -> Tensor:
    """``out[t] = sum_{k<K} grad[sorted_indices[t*K + k]]`` (fp32, k order; rows >= A add nothing).

    Args:
        grad: (A, H), A <= T*K, float16 / bfloat16 / float32, any strides.
        sorted_indices: (T*K,) int32 / int64, a permutation of [0, T*K): flagged otherwise as OpError 161002 (see
            :func:`_guard_permutation`); ``trusted`` (the backward of this package's own forward) flags only entries
            outside the range (:func:`_guard_range`). The kernel never reads a row outside [0, A) either way.
        num_topk: K in [1, 512]. out: optional contiguous (T, H) tensor to write into.
        block_h: column block override (tests).

    Returns:
        (T, H) contiguous in grad's dtype. No workspace.
    """
    rows, h = grad.shape
    total = sorted_indices.numel()
    t = total // num_topk
    results = moe_token_permute_grad_results(MoeShape(t, num_topk, h, rows), grad, sorted_indices, num_topk)
    out = outputs(out, written(results), grad.device)[0]
    if t and h:
        block_t, block_h, warps = moe_blocks(h, block_h)
        launch(moe_token_permute_grad_kernel, (triton.cdiv(t, block_t), triton.cdiv(h, block_h)), grad,
               sorted_indices.contiguous(), out, t, num_topk, rows, h, grad.stride(0), grad.stride(1),
               BLOCK_T=block_t, BLOCK_H=block_h, num_warps=warps)
    if trusted:
        _guard_range(sorted_indices, "moe_token_permute_grad")
    else:
        _guard_permutation(sorted_indices, "moe_token_permute_grad")
    return out


def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None, *,
                        out: Tensor | None = None, block_h: int | None = None) -> Tensor:
    """``out[t] = sum_{k<K} probs[t, k] * permuted[sorted_indices[t*K + k]]`` (fp32, k order; rows >= A add
    nothing; probs None: K = 1, weight 1).

    Args:
        permuted_tokens: (A, H) float16 / bfloat16 / float32, any strides.
        sorted_indices: (T*K,) int32 / int64, a permutation of [0, T*K) (flagged otherwise, OpError 161002).
        probs: (T, K) float16 / bfloat16 / float32, or None. out: optional contiguous (T, H). block_h: tests.

    Returns:
        (T, H) contiguous in permuted_tokens' dtype. No workspace.
    """
    rows, h = permuted_tokens.shape
    k = 1 if probs is None else probs.shape[1]
    t = sorted_indices.numel() // k
    results = moe_token_unpermute_results(MoeShape(t, k, h, rows), permuted_tokens, sorted_indices, probs)
    out = outputs(out, written(results), permuted_tokens.device)[0]
    if t and h:
        block_t, block_h, warps = moe_blocks(h, block_h)
        weights = probs.contiguous() if probs is not None else sorted_indices  # unread without probs
        launch(moe_token_unpermute_kernel, (triton.cdiv(t, block_t), triton.cdiv(h, block_h)), permuted_tokens,
               sorted_indices.contiguous(), weights, out, t, k, rows, h, permuted_tokens.stride(0),
               permuted_tokens.stride(1), HAS_PROBS=probs is not None, BLOCK_T=block_t, BLOCK_H=block_h,
               num_warps=warps)
    _guard_permutation(sorted_indices, "moe_token_unpermute")
    return out


def moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                             probs: Tensor | None, *, trusted: bool = False,
                             out: tuple[Tensor, Tensor] | None = None,
                             block_h: int | None = None) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`moe_token_unpermute`: ``grad_permuted[r] = grad[t] * probs[t, k]`` for the copy
    (t, k) on row r < A, ``grad_probs[t, k] = sum_h grad[t, h] * permuted[r, h]`` (fp32, rounded once).

    Args:
        permuted_tokens: (A, H); grad_unpermuted: (T, H); both any strides.
        sorted_indices: (T*K,), a permutation of [0, T*K): flagged otherwise unless ``trusted`` (the backward of
            this package's own forward); the kernel never reads or writes a row outside [0, A) either way.
        probs: (T, K) or None. out: optional contiguous pair (the second unused without probs). block_h: tests.

    Returns:
        ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, K) in probs' dtype)``, the second an
        empty tensor of permuted_tokens' dtype without probs. No workspace.
    """
    rows, h = permuted_tokens.shape
    t = grad_unpermuted.shape[0]
    k = 1 if probs is None else probs.shape[1]
    device = permuted_tokens.device
    dx_spec, dp_spec = written(moe_token_unpermute_grad_results(MoeShape(t, k, h, rows), permuted_tokens,
                                                                grad_unpermuted, sorted_indices, probs))
    dx = outputs(None if out is None else out[0], [dx_spec], device)[0]
    dp = outputs(None if out is None or probs is None else out[1], [dp_spec], device)[0]  # no probs: out[1] unused
    if t:
        block_t, block_h, warps = moe_blocks(h, block_h)
        weights = probs.contiguous() if probs is not None else sorted_indices  # unread without probs
        launch(moe_token_unpermute_grad_kernel, (triton.cdiv(t, block_t),), permuted_tokens, grad_unpermuted,
               sorted_indices.contiguous(), weights, dx, dp if probs is not None else dx, t, k, rows, h,
               permuted_tokens.stride(0), permuted_tokens.stride(1), grad_unpermuted.stride(0),
               grad_unpermuted.stride(1), HAS_PROBS=probs is not None, BLOCK_T=block_t,
               BLOCK_H=block_h, num_warps=warps)
    if not trusted:
        _guard_permutation(sorted_indices, "moe_token_unpermute_grad")
    return dx, dp


# ---------------------------------------------------------------- the routing-map ops
# The permute family's kernels above on the slot tables of routing_reference.py (docs/semantics.md §5b).
(moe_token_permute_with_routing_map, moe_token_permute_with_routing_map_grad, moe_token_unpermute_with_routing_map,
 moe_token_unpermute_with_routing_map_grad) = routing.ops_on(routing.Kernels(
    moe_token_permute, moe_token_permute_grad, moe_token_unpermute, moe_token_unpermute_grad))


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
MOE_TOKEN_PERMUTE = Impl(moe_token_permute, workspace=moe_token_permute_workspace)
MOE_TOKEN_PERMUTE_GRAD = Impl(moe_token_permute_grad)
MOE_TOKEN_UNPERMUTE = Impl(moe_token_unpermute)
MOE_TOKEN_UNPERMUTE_GRAD = Impl(moe_token_unpermute_grad)
MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP = Impl(moe_token_permute_with_routing_map)
MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD = Impl(moe_token_permute_with_routing_map_grad)
MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP = Impl(moe_token_unpermute_with_routing_map)
MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD = Impl(moe_token_unpermute_with_routing_map_grad)
