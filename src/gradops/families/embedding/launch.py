"""Host launcher of EmbeddingDenseBackward (backend ``triton``): a zero fill, a device sort + segment offsets, then
one kernel that writes each row an index names, once. No host synchronisation: the range test of the indices is
reported through :func:`._common.guard`."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from ...contract._common import written
from ...launch._common import carve, guard, launch, outputs, workspace_bytes
from ...spec import Impl
from .contract import EmbeddingShape, embedding_dense_backward_results, index_error
from .kernels import EmbeddingConfig, embedding_config, embedding_dense_backward_kernel


def _specs(n: int, num_weights: int) -> list[tuple[int, torch.dtype]]:
    # sorted keys, stable argsort, searchsorted queries 0..V, segment offsets (V + 1)
    return [(n, torch.int64), (n, torch.int64), (num_weights + 1, torch.int64), (num_weights + 1, torch.int64)]


def _range_error(idx: Tensor, num_weights: int) -> Exception:
    """The OpError of the first index outside ``[0, num_weights)`` (read when the error is raised)."""
    bad = ((idx < 0) | (idx >= num_weights)).nonzero()
    if not bad.numel():  # changed again since the kernel saw it
        return index_error("a value changed again before it could be shown", -1, num_weights)
    pos = int(bad[0, 0])
    return index_error(int(idx[pos]), pos, num_weights)


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
        indices: (N,) int64; values outside [0, num_weights) are never read with and raise OpError 161002 (at once
            under the interpreter; on CUDA from the next launch or ``gradops.synchronize()``, see
            :func:`._common.guard`): no host synchronisation.
        num_weights: V. padding_idx: a row left at zero when in [0, V). scale_grad_by_freq: divide by counts.
        workspace: optional uint8 scratch of :func:`embedding_dense_backward_workspace` bytes.
        out: optional contiguous (V, E) table to write into (every row is written).
        config: block override (tests).

    Returns:
        (V, E) contiguous, grad's dtype; deterministic (stable sort, fixed-order fp32 segment sums).
    """
    n, dim = grad.shape
    idx = indices.reshape(-1).long()
    results = embedding_dense_backward_results(EmbeddingShape(n, dim), grad, indices, num_weights, padding_idx,
                                               scale_grad_by_freq)
    out = outputs(out, written(results), grad.device)[0]
    if num_weights == 0 or dim == 0:
        if n:
            guard(((idx < 0) | (idx >= num_weights)).any(), lambda: _range_error(idx, num_weights))
        return out
    # The rows no index names are zeros: torch's fill writes them at copy bandwidth, the kernel only the rest.
    out.zero_()
    keys, perm, queries, offs = carve(workspace, grad.device, _specs(n, num_weights))
    torch.sort(idx, stable=True, out=(keys, perm))
    torch.arange(num_weights + 1, out=queries)
    torch.searchsorted(keys, queries, out=offs)
    if n:
        pad = padding_idx if 0 <= padding_idx < num_weights else -1
        cfg = config or embedding_config(dim)
        launch(embedding_dense_backward_kernel, (n, triton.cdiv(dim, cfg.block_e)), grad, keys, perm, offs, out,
               num_weights, dim, grad.stride(0), grad.stride(1), pad, SCALE=bool(scale_grad_by_freq),
               BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, num_warps=cfg.num_warps)
    # The kernel sums only segments of keys in [0, V): an index outside the table never addresses memory. How many
    # there are is the count below 0 (offs[0]) plus the count >= V; flagged after the launch (see guard).
    guard(offs[0] + (n - offs[num_weights]), lambda: _range_error(idx, num_weights))
    return out


#: The range test above runs on every call (no host synchronisation): the ops layer skips its own for integer indices.
embedding_dense_backward.tests_indices = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
EMBEDDING_DENSE_BACKWARD = Impl(embedding_dense_backward, workspace=embedding_dense_backward_workspace)
