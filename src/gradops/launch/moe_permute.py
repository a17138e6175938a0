"""Host launchers of MoeTokenPermute and MoeTokenPermuteGrad (backend ``triton``)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..contract.moe_permute import sorted_index_error
from ..kernels.moe_permute import moe_blocks, moe_token_permute_grad_kernel, moe_token_permute_kernel
from ._common import carve, guard, launch, outputs, workspace_bytes


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
        indices: (T, K) or (T,) int32 / int64 expert ids.
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
    permuted, inverse = outputs(out, [((num_rows, h), tokens.dtype), ((total,), torch.int32)], tokens.device)
    if total == 0:
        return permuted, inverse
    keys, first = carve(workspace, tokens.device, _specs(indices))
    torch.sort(indices.reshape(-1), stable=True, out=(keys, first))
    block_t, block_h, warps = moe_blocks(h, block_h)
    launch(moe_token_permute_kernel, (triton.cdiv(total, block_t), triton.cdiv(max(h, 1), block_h)), tokens, first,
           permuted, inverse, total, num_rows, k, h, tokens.stride(0), tokens.stride(1), BLOCK_J=block_t,
           BLOCK_H=block_h, num_warps=warps)
    return permuted, inverse


def _range_error(sorted_indices: Tensor, total: int) -> Exception:
    """The OpError of the first entry outside ``[0, T*K)`` (read when the error is raised)."""
    bad = ((sorted_indices < 0) | (sorted_indices >= total)).nonzero()
    if not bad.numel():  # changed again since the kernel saw it
        return sorted_index_error("a value changed again before it could be shown", -1, total)
    pos = int(bad[0, 0])
    return sorted_index_error(int(sorted_indices[pos]), pos, total)


def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int, *, out: Tensor | None = None,
                           block_h: int | None = None) -> Tensor:
    """``out[t] = sum_{k<K} grad[sorted_indices[t*K + k]]`` (fp32, k order; rows >= A add nothing).

    Args:
        grad: (A, H), A <= T*K, float16 / bfloat16 / float32, any strides.
        sorted_indices: (T*K,) int32 / int64; entries outside [0, T*K) are never read with and raise OpError
            161002 (see :func:`._common.guard`).
        num_topk: K in [1, 512]. out: optional contiguous (T, H) tensor to write into.
        block_h: column block override (tests).

    Returns:
        (T, H) contiguous in grad's dtype. No workspace.
    """
    rows, h = grad.shape
    total = sorted_indices.numel()
    t = total // num_topk
    out = outputs(out, [((t, h), grad.dtype)], grad.device)[0]
    if total:
        # The kernel reads only rows in [0, A); the flag reports entries outside [0, T*K) (no host sync on CUDA).
        guard(((sorted_indices < 0) | (sorted_indices >= total)).any(),
              lambda: _range_error(sorted_indices, total))
    if t == 0 or h == 0:
        return out
    block_t, block_h, warps = moe_blocks(h, block_h)
    launch(moe_token_permute_grad_kernel, (triton.cdiv(t, block_t), triton.cdiv(h, block_h)), grad,
           sorted_indices.contiguous(), out, t, num_topk, rows, h, grad.stride(0), grad.stride(1), BLOCK_T=block_t,
           BLOCK_H=block_h, num_warps=warps)
    return out
