"""aclnnEmbeddingDenseBackward on the CPU: the host entries of the native kernel ``embedding_dense_backward``
(embedding.cpp).

Each table row is written exactly once - the float32 sum of its gradient rows in index order, or zeros - so the
zero-fill is fused into the scatter and no atomics are needed: deterministic, bitwise equal whatever the thread
count. Byte model: ``T·E·s_g + V·E·s_out + T·8`` (indices) + ``(V + T)·8`` (the sort, cache/L2 sized at V <= 256k).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...contract._common import Outputs, written
from ...cpu._host import allocate, dense, finish, kernel, output
from ...cpu.programs import Program, arg
from ...spec import Impl
from .contract import EmbeddingShape, checked_indices, embedding_dense_backward_results, embedding_results, index_error


def embedding_dense_backward_workspace(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int,
                                       scale_grad_by_freq: bool) -> int:
    """Bytes of the sort's scratch: ``(V + 1)`` int64 row ends and ``T`` int64 positions for the counting sort
    (T >= V), ``2·T`` int64 for the radix sort of few indices in a large table (T < V), which fit in as many."""
    return (num_weights + 1 + idx.numel()) * 8


def _workspace(workspace: Tensor, nbytes: int) -> Tensor:
    """``workspace`` checked to hold ``nbytes`` (the kernel sorts there), as one contiguous uint8 row."""
    if workspace.dtype != torch.uint8 or workspace.device.type != "cpu" or workspace.numel() < nbytes:
        raise ValueError(f"workspace must be a CPU uint8 tensor of at least {nbytes} bytes, got "
                         f"{workspace.dtype} with {workspace.numel()} elements on {workspace.device}")
    return dense(workspace.detach()).view(-1)


def _run(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int, scale_grad_by_freq: bool, table: Tensor,
         workspace: Tensor | None) -> None:
    """The backward of (N, E) ``grad`` (any shape with N·E items) and N int32 / int64 ``idx`` into the
    contiguous ``table``; an index outside the table raises before anything is written."""
    idx = dense(idx)
    inputs = [dense(grad), idx]
    if workspace is not None:
        inputs.append(_workspace(workspace, (num_weights + 1 + idx.numel()) * 8))
    pad = padding_idx if 0 <= padding_idx < num_weights else -1
    bad = kernel("embedding_dense_backward", inputs, (table,), (num_weights, pad, int(bool(scale_grad_by_freq))))
    if bad >= 0:
        raise index_error(idx.reshape(-1)[bad].item(), bad, num_weights)


def embedding_dense_backward(grad: Tensor, idx: Tensor, num_weights: int, padding_idx: int,
                             scale_grad_by_freq: bool, *, out: Tensor | None = None,
                             workspace: Tensor | None = None) -> Tensor:
    """aclnnEmbeddingDenseBackward on ``grad[N,E]`` and checked int64 ``idx[N]``: ``out[V,E]`` in grad's dtype.

    Args:
        grad: (N, E) float32/float16/bfloat16.
        idx: (N,) int64; any value outside [0, num_weights) raises OpError 161002 before anything is written.
        num_weights: V. padding_idx: a row left at zero (any value outside [0, V) means none).
        scale_grad_by_freq: divide every term by its row's count (all occurrences, padding included).
        out: optional preallocated (V, E) output. workspace: optional uint8 scratch (see the ``_workspace`` hook).

    Returns:
        The (V, E) gradient table.
    """
    shape = EmbeddingShape(*grad.shape)
    (table_spec,) = written(embedding_dense_backward_results(shape, grad, idx, num_weights, padding_idx,
                                                             scale_grad_by_freq))
    table = output(out, *table_spec)
    _run(grad, idx.long(), num_weights, padding_idx, scale_grad_by_freq, table, workspace)
    return finish(table, out)


def embedding_dense_backward_shaped(outputs: Outputs, shape: tuple[int, int], grad: Tensor, indices: Tensor,
                                    num_weights: int,
                                    padding_idx: int, scale_grad_by_freq: bool, *, checked: bool = False) -> Tensor:
    """The op on its own shapes (see :mod:`gradops.ops._plan`): grad (..., E), indices of the leading dims. int32
    and int64 indices are read as they are (the kernel's sort is the range test, so ``checked``, "tested
    already", saves nothing here); other dtypes get CANN's conversion and range test first
    (:func:`gradops.families.embedding.contract.checked_indices`)."""
    if indices.dtype not in _DIRECT_INDICES:
        indices = checked_indices(indices, num_weights)
    (table,) = allocate(outputs, (grad, indices, num_weights, padding_idx, scale_grad_by_freq))
    _run(grad, indices, num_weights, padding_idx, scale_grad_by_freq, table, None)
    return table


_DIRECT_INDICES = (torch.int64, torch.int32)

# ---------------------------------------------------------------- the direct calls' programs
# Each: the Python path above as the extension replays it (see gradops.cpu.programs; the op's call plan loads
# it): the same registered kernel on outputs of the same shapes, or None where the Python path does what a
# program does not (indices of another dtype than _DIRECT_INDICES: it converts them first).


def program_embedding(shape, weight, indices, padding_idx, scale_grad_by_freq):
    """The lookup that nothing records: the native kernel ``embedding`` (the range test, then the rows, a copy of
    storage items: the bits of the Python path's index_select; padding and scaling only shape the backward). None
    for an empty result: the Python path's."""
    if not indices.numel() or not weight.shape[1] or indices.dtype not in _DIRECT_INDICES:
        return None
    p = Program()
    (out,) = p.declared(embedding_results(shape, weight, indices, padding_idx, scale_grad_by_freq))
    p.kernel("embedding", [arg(0), arg(1)], [out])
    return p.returns(out)


def program_embedding_dense_backward(shape, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """The backward: the native kernel ``embedding_dense_backward`` (the sort, also the range test, then every row
    of the table once). None for no index, no column or no row: the Python path's."""
    n, e = shape
    if not n or not e or not num_weights or indices.dtype not in _DIRECT_INDICES:
        return None
    p = Program()
    (out,) = p.declared(embedding_dense_backward_results(shape, grad, indices, num_weights, padding_idx,
                                                          scale_grad_by_freq))
    pad = padding_idx if 0 <= padding_idx < num_weights else -1
    p.kernel("embedding_dense_backward", [arg(0), arg(1)], [out], [num_weights, pad, int(bool(scale_grad_by_freq))])
    return p.returns(out)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
EMBEDDING_DENSE_BACKWARD = Impl(embedding_dense_backward, shaped=embedding_dense_backward_shaped,
                                workspace=embedding_dense_backward_workspace)
