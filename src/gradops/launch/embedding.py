"""Host launcher of EmbeddingDenseBackward (backend ``triton``): device sort + segment offsets, then one kernel
that writes every table row once. No host synchronisation (the ops layer's range check is the only one)."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ..kernels.embedding import EmbeddingConfig, embedding_config, embedding_dense_backward_kernel
from ._common import carve, launch, outputs, workspace_bytes


def _specs(n: int, num_weights: int) -> list[tuple[int, torch.dtype]]:
    # sorted keys, stable argsort, searchsorted queries 0..V, segment offsets (V + 1)
    return [(n, torch.int64), (n, torch.int64), (num_weights + 1, torch.int64), (num_weights + 1, torch.int64)]


def embedding_dense_backward_workspace(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                                       scale_grad_by_freq: bool) -> int:
    """Scratch bytes of :func:`embedding_dense_backward`: ``16*N + 16*(V + 1)`` (+ alignment)."""
    if num_weights == 0 or grad.shape[-1] == 0:
        return 0
    return workspace_bytes(_specs(indices.numel(), num_weights))


def embedding_dense_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool, *, workspace: Tensor | None = None,
                             out: Tensor | None = None, config: EmbeddingConfig | None = None) -> Tensor:
    """``out[v] = sum_{i: idx[i] = v, v != padding_idx} grad[i] / (count[v] if scale_grad_by_freq else 1)``.

    Args:
        grad: (N, E) float16 / bfloat16 / float32, any strides.
        indices: (N,) int64, already checked to lie in [0, num_weights).
        num_weights: V. padding_idx: a row left at zero when in [0, V). scale_grad_by_freq: divide by counts.
        workspace: optional uint8 scratch of :func:`embedding_dense_backward_workspace` bytes.
        out: optional contiguous (V, E) table to write into (every row is written).
        config: block override (tests).

    Returns:
        (V, E) contiguous, grad's dtype; deterministic (stable sort, fixed-order fp32 segment sums).
    """
    n, dim = grad.shape
    out = outputs(out, [((num_weights, dim), grad.dtype)], grad.device)[0]
    if num_weights == 0 or dim == 0:
        return out
    keys, perm, queries, offs = carve(workspace, grad.device, _specs(n, num_weights))
    torch.sort(indices.reshape(-1).long(), stable=True, out=(keys, perm))
    torch.arange(num_weights + 1, out=queries)
    torch.searchsorted(keys, queries, out=offs)
    pad = padding_idx if 0 <= padding_idx < num_weights else -1
    cfg = config or embedding_config(dim)
    grid = (triton.cdiv(num_weights, cfg.rows_per_program), triton.cdiv(dim, cfg.block_e))
    launch(embedding_dense_backward_kernel, grid, grad, perm, offs, out, num_weights, dim, grad.stride(0),
           grad.stride(1), pad, cfg.rows_per_program, SCALE=bool(scale_grad_by_freq), BLOCK_T=cfg.block_t,
           BLOCK_E=cfg.block_e, num_warps=cfg.num_warps)
    return out
