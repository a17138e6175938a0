"""Validation table of aclnnEmbeddingDenseBackward.

Sources: the seed (001) and hicann/ops-nn ``index/embedding_dense_grad_v2/op_api/aclnn_embedding_dense_backward.cpp``.
Order: nulls (161001), dtypes, ranks, shapes (161002). The PyTorch API also takes a float64 grad / weight (as
torch's embedding does); ``cann=True`` keeps CANN's three. Beyond CANN, which leaves out-of-range indices
undefined, gradops refuses them (161002), and no memory is ever addressed with one: before any kernel runs, or
on CUDA with the Triton backend from the device without a host synchronisation (:func:`checked_indices`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...contract._common import (
    MAX_RANK,
    TORCH_FLOATS,
    Result,
    dtype_name,
    fail,
    floats,
    numel,
    require_dtype,
    require_int,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    require_shape,
    require_writable,
    shape_text,
)
from ...status import ACLNN_ERR_PARAM_INVALID as INVALID
from ...status import OpError

#: The nine index dtypes of the seed. Float indices are truncated toward zero, bool reads as 0/1 (CANN Cast).
INDEX_DTYPES = (torch.float32, torch.float16, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8,
                torch.uint8, torch.bool)


class EmbeddingShape(NamedTuple):
    rows: int  # N = indices.numel(): rows of the 2-D grad view
    dim: int   # E = grad.shape[-1]


def embedding_dense_backward_results(shape: EmbeddingShape, grad, indices, num_weights: int, padding_idx: int = -1,
                                     scale_grad_by_freq: bool = False) -> list[Result]:
    """EmbeddingDenseBackward's result: the (num_weights, E) table in grad's dtype (``out=`` also takes float32
    beside half grad: :func:`out_dtypes`)."""
    return [Result((num_weights, grad.shape[-1]), grad.dtype, grad)]


def embedding_results(shape: None, weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False
                      ) -> list[Result]:
    """The lookup's result: ``indices.shape + (E,)`` in weight's dtype."""
    return [Result((*indices.shape, weight.shape[1]), weight.dtype, weight)]


def check_embedding_dense_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False, *,
                                   out=None, cann: bool = False) -> EmbeddingShape:
    op = "embedding_dense_backward"
    outs = {"out": out} if cann else {}
    require_present(op, grad=grad, indices=indices, **outs)
    require_int(op, "num_weights", num_weights, lo=0)
    require_int(op, "padding_idx", padding_idx, int64=False)  # any int: outside [0, V) means none
    if not isinstance(scale_grad_by_freq, bool):
        raise fail(INVALID, op, "scale_grad_by_freq", "a bool", type(scale_grad_by_freq).__name__)
    require_same_device(op, grad=grad, indices=indices, **outs)
    require_dtype(op, "grad", grad, floats(cann))
    require_dtype(op, "indices", indices, INDEX_DTYPES)
    if cann:
        require_out_dtype(op, "out", out, grad)
    require_rank(op, "grad", grad, 2, MAX_RANK)
    require_rank(op, "indices", indices, 0, MAX_RANK)
    dim = grad.shape[-1]
    if dim != 0 and numel(grad.shape[:-1]) != indices.numel():
        raise fail(INVALID, op, "grad.shape",
                   f"leading dims whose product is indices.numel() = {indices.numel()}", shape_text(grad.shape))
    if cann:
        require_shape(op, "out", out, (num_weights, dim), "(numWeights, grad.shape[-1])")
    return EmbeddingShape(indices.numel(), dim)


def out_dtypes(grad_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The table dtypes a ``grad`` of this dtype may be written into: its own, and float32 beside float16 /
    bfloat16 grad. The seed's table says out has grad's dtype; CANN's own opapi unit tests for
    aclnnEmbeddingDenseBackward (cases 5 and 6) expect a float32 out for float16 / bfloat16 grad to succeed, and it
    only keeps more of the float32 sums (issue 17): accepted on both surfaces."""
    return (grad_dtype, torch.float32) if grad_dtype in (torch.float16, torch.bfloat16) else (grad_dtype,)


def require_out_dtype(op: str, name: str, out, grad) -> None:
    """``out`` (the (V, E) table) in one of :func:`out_dtypes` of grad's dtype (OpError 161002 otherwise)."""
    allowed = out_dtypes(grad.dtype)
    if out.dtype not in allowed:
        raise fail(INVALID, op, f"{name}.dtype", f"grad's dtype {dtype_name(grad.dtype)}"
                   + (" or float32" if len(allowed) > 1 else ""), dtype_name(out.dtype))


#: aclnnEmbedding's weight dtypes (hicann/ops-nn's ``index/embedding/docs/aclnnEmbedding.md``): a gather, so
#: integers, bool and complex tables too; its indices are int32 or int64.
CANN_WEIGHT_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                      torch.uint8, torch.bool, torch.float64, torch.complex64, torch.complex128)
CANN_INDEX_DTYPES = (torch.int32, torch.int64)


def check_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, *, out=None,
                    cann: bool = False) -> None:
    """Validate the lookup ``embedding(weight, indices, padding_idx, scale_grad_by_freq)`` whose backward is
    aclnnEmbeddingDenseBackward: weight (V, E) float (float64 too: a PyTorch API only), indices of the nine index
    dtypes with at most 7 dims (the output ``indices.shape + (E,)`` stays within 8).

    With ``cann=True``, aclnnEmbedding's table (weight, indices, out): 161001 for a None tensor; 161002 for a weight
    dtype outside :data:`CANN_WEIGHT_DTYPES`, indices not int32 / int64, out not of weight's dtype, a weight not
    2-D, more than 7 index dims, an out not of shape ``indices.shape + (E,)`` or whose elements share memory."""
    op = "embedding"
    outs = {"out": out} if cann else {}
    require_present(op, weight=weight, indices=indices, **outs)
    require_int(op, "padding_idx", padding_idx, int64=False)  # any int: outside [0, V) means none
    if not isinstance(scale_grad_by_freq, bool):
        raise fail(INVALID, op, "scale_grad_by_freq", "a bool", type(scale_grad_by_freq).__name__)
    require_same_device(op, weight=weight, indices=indices, **outs)
    require_dtype(op, "weight", weight, CANN_WEIGHT_DTYPES if cann else TORCH_FLOATS)
    require_dtype(op, "indices", indices, CANN_INDEX_DTYPES if cann else INDEX_DTYPES)
    if cann:
        require_same_dtype(op, "out", out, "weight", weight)
    require_rank(op, "weight", weight, 2, 2)
    require_rank(op, "indices", indices, 0, MAX_RANK - 1)
    if cann:
        require_shape(op, "out", out, (*indices.shape, weight.shape[1]), "indices' shape + (weight.shape[1],)")
        require_writable(op, "out", out)


def no_padding_outside_table(padding_idx: int, num_weights: int) -> int:
    """CANN's rule as one value: a padding_idx outside ``[0, num_weights)`` names no row, so it becomes -1
    (which also keeps a uint64 pattern such as ``2**64 - 1`` inside the int64 the op schema carries)."""
    return padding_idx if 0 <= padding_idx < num_weights else -1


def flat_indices(indices: torch.Tensor) -> torch.Tensor:
    """Flat int64 indices after CANN's conversion (floats truncated toward zero, bool as 0 / 1), unchecked: for
    indices already refused or accepted by :func:`checked_indices`."""
    flat = indices.reshape(-1)
    if flat.is_floating_point():
        return flat.double().trunc().long()  # exact for float16/32/64 values; -0.5 -> -0.0 -> row 0 as in CANN
    return flat.long()


def index_error(value: object, position: int, num_weights: int, op: str = "embedding_dense_backward") -> OpError:
    """The OpError (161002) of an index ``value`` at flat ``position`` outside ``[0, num_weights)``: one text for
    every place that tests the range (this module's check, and each backend's own test where it reads the
    indices)."""
    return fail(INVALID, op, "indices", f"values in [0, num_weights) = [0, {num_weights}) after truncation toward zero",
                f"{value} at flat position {position}")


def checked_indices(indices: torch.Tensor, num_weights: int, op: str = "embedding_dense_backward", *,
                    defer: bool = False) -> torch.Tensor:
    """Flat int64 indices after CANN's conversion (floats truncated toward zero), refused unless all lie in
    ``[0, num_weights)``: one host synchronisation (the range test); NaN and inf are refused too. With ``defer``
    (a caller whose later work runs gradops' Triton launches, which raise deferred refusals), integer indices on
    CUDA are tested without one: clamped into ``[0, num_weights)`` for the kernels, the refusal raised
    asynchronously (see the comment inside)."""
    flat = indices.reshape(-1)
    if flat.is_floating_point():
        flat = flat.double().trunc()  # tested in float64: NaN and inf must fail the range test, not wrap in int64
        if flat.numel():
            bad = ~((flat >= 0) & (flat < num_weights))  # NaN fails both comparisons
            if bool(bad.any()):
                _refuse(indices, bad, num_weights, op)
        return flat.long()
    flat = flat.long()
    if defer and flat.numel() and num_weights > 0 and flat.device.type == "cuda":
        guard = _device_guard()
        if guard is not None:
            # CUDA: no host synchronisation. The rows read or written are clamped into the table, and the range
            # test is flagged on the device (raised by the next gradops launch or gradops.synchronize(), see
            # gradops.launch._common.guard): a synchronisation per call costs a training step the overlap of
            # host and device (an H100's 8 x 8 Embedding step ran 1.29 ms against torch's 0.37 with it).
            safe = flat.clamp(0, num_weights - 1)
            guard((safe != flat).any(), lambda: _refusal(indices, (flat < 0) | (flat >= num_weights), num_weights,
                                                         op))
            return safe
    if flat.numel():
        # Integers: one reduction and one synchronisation (~3 µs on CPU at small sizes, where the five ops of the
        # float test took ~20); the position is looked for only once a value is known to be outside.
        lo, hi = torch.aminmax(flat)
        if lo.item() < 0 or hi.item() >= num_weights:
            _refuse(indices, (flat < 0) | (flat >= num_weights), num_weights, op)
    return flat


def _device_guard():
    """:func:`gradops.launch._common.guard`, or None where Triton (and so the launchers) is missing: then the test
    synchronises once per call, as on the CPU."""
    try:
        from ...launch._common import guard
    except ImportError:
        return None
    return guard


def _refusal(indices: torch.Tensor, bad: torch.Tensor, num_weights: int, op: str) -> OpError:
    """The OpError of the first ``bad`` position (read from the device; an error path), or one saying the values
    changed again where none is bad any more."""
    hits = bad.nonzero()
    if not hits.numel():
        return index_error("a value changed again before it could be shown", -1, num_weights, op)
    pos = int(hits[0, 0])
    return index_error(indices.reshape(-1)[pos].item(), pos, num_weights, op)


def _refuse(indices: torch.Tensor, bad: torch.Tensor, num_weights: int, op: str) -> None:
    raise _refusal(indices, bad, num_weights, op)
