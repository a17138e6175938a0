"""EmbeddingDenseBackward: the torch.library op and the public function."""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import select
from ..contract._common import require_present
from ..contract.embedding import check_embedding_dense_backward, checked_indices


@torch.library.custom_op("gradops::embedding_dense_backward", mutates_args=())
def _embedding_dense_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                              scale_grad_by_freq: bool) -> Tensor:
    rows, dim = check_embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    idx = checked_indices(indices, num_weights)
    _, impl = select("embedding_dense_backward", grad.device)
    return impl(grad.reshape(rows, dim), idx, num_weights, padding_idx, scale_grad_by_freq)


@_embedding_dense_backward.register_fake
def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    check_embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    return grad.new_empty((num_weights, grad.shape[-1]))


def embedding_dense_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False) -> Tensor:
    """aclnnEmbeddingDenseBackward: the gradient of an embedding table.

    ``out[k] = sum_{i: indices[i] = k} grad[i] / (count[k] if scale_grad_by_freq else 1)``, with the row
    ``padding_idx`` left at zero; sums in float32, deterministic.

    Args:
        grad: (..., E) with 2 to 8 dims whose leading dims flatten to ``indices.numel()``; float16 / bfloat16 /
            float32.
        indices: any of the seed's nine dtypes; floats are truncated toward zero, bool reads as 0/1. Every
            value must lie in ``[0, num_weights)`` (else OpError 161002; nothing is read or written).
        num_weights: rows of the table (V).
        padding_idx: signed; a value outside ``[0, num_weights)``, e.g. the default -1, means no padding row
            (CANN's rule: Python's ``nn.Embedding`` normalisation of negatives does not apply here).
        scale_grad_by_freq: divide by each index's count over all occurrences, padding included.

    Returns:
        (num_weights, E) in grad's dtype.
    """
    require_present("embedding_dense_backward", grad=grad, indices=indices)
    return _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
