"""aclnnEmbeddingDenseBackward (seed 001) and aclnnEmbedding, two-phase.

Validation is :mod:`gradops.families.embedding.contract` with ``cann=True`` (nulls 161001; dtypes, ranks, shapes 161002;
out must have grad's dtype, or float32 beside float16 / bfloat16 grad as CANN's own opapi tests expect, and shape
(numWeights, E)). Indices are read when the executor runs: values outside
``[0, numWeights)`` after CANN's conversion (floats truncated toward zero) return 161002 from phase 2 and leave
``out`` untouched. Non-contiguous grad, indices and out are supported.

``numWeights`` and ``paddingIdx`` are ``uint64_t`` in C. A C caller passing ``-1`` really passes 2**64 - 1; the
kernel reads the bits as int64, so values >= 2**63 mean negative (two's complement), i.e. no padding row.
Python's negative ints are accepted as well; values outside [-2**63, 2**64) cannot come from C and return 161002.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, plan, prepare, refused
from ...contract._memo import remembered
from ...ops._direct import fit
from ...status import ACLNN_ERR_PARAM_INVALID, ACLNN_SUCCESS, OpError
from .contract import checked_indices
from .ops import plan_embedding, plan_embedding_dense_backward

_OP = "embedding_dense_backward"
_stand_ins: dict[tuple, Tensor] = {}
_UINT64 = 1 << 64
_INT64_MIN = -(1 << 63)


def as_int64(value):
    """The int64 that the 64-bit pattern of the uint64 ``value`` denotes (two's complement); other values as
    given."""
    if isinstance(value, int) and not isinstance(value, bool) and (1 << 63) <= value < _UINT64:
        return value - _UINT64
    return value


def aclnnEmbeddingDenseBackwardGetWorkspaceSize(grad: Tensor, indices: Tensor, numWeights: int, paddingIdx: int,
                                                scaleGradByFreq: bool,
                                                out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnEmbeddingDenseBackward: ``out[k] = sum_{i: idx[i]=k, k != paddingIdx} grad[i]``, divided by
    ``count[k]`` when ``scaleGradByFreq``; sums in float32.

    Args:
        grad: (..., E), 2-8 dims, float16 / bfloat16 / float32; leading dims flatten to ``indices.numel()``.
        indices: 0-8 dims, any of the seed's nine dtypes (float, float16, double, int32, int64, int16, int8,
            uint8, bool).
        numWeights: rows of the table (uint64).
        paddingIdx: uint64 bit pattern of a signed row index; negative (>= 2**63) or >= numWeights: no padding.
        scaleGradByFreq: divide each row by its index's count.
        out: (numWeights, E) in grad's dtype, or float32 beside float16 / bfloat16 grad (the float32 sums
            unrounded); written by phase 2.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    padding = as_int64(paddingIdx)
    try:
        called = plan(plan_embedding_dense_backward, grad, indices, numWeights, padding, scaleGradByFreq, out=out)
        if numWeights >= _UINT64 or not _INT64_MIN <= padding < _UINT64:
            raise OpError(ACLNN_ERR_PARAM_INVALID, _OP, "numWeights/paddingIdx", "uint64 values",
                          f"numWeights={numWeights}, paddingIdx={paddingIdx}")
    except OpError as e:
        return refused(e)
    rows, dim = called.shape
    device = grad.device
    # A float32 out for float16 / bfloat16 grad (CANN's opapi tests, cases 5 and 6): the kernels sum in float32
    # whatever grad's dtype, so grad widened to float32 at run time gives those sums unrounded, bit for bit.
    widen = out.dtype != grad.dtype

    rows_of_grad = fit(grad, (rows, dim))  # made once: phase 2 runs on the layout phase 1 saw

    def compute(impl, kw):
        idx = checked_indices(indices, numWeights)  # reads the data present now (161002 if out of range)
        g = fit(grad.float(), (rows, dim)) if widen else rows_of_grad
        return impl(g, idx, numWeights, padding, scaleGradByFreq, **kw)

    # The converted indices exist only at run time; the workspace hook gets an int64 stand-in of their shape (one
    # element of storage, kept per shape: the hooks read metadata only).
    stand_in = remembered(_stand_ins, (rows, device),
                          lambda: torch.empty((), dtype=torch.int64, device=device).expand(rows))
    return prepare(_OP, device, called.backend, (rows_of_grad, stand_in, numWeights, padding, scaleGradByFreq),
                   compute, {"out": out},
                   inputs={"grad": grad, "indices": indices})


def aclnnEmbeddingDenseBackward(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnEmbeddingDenseBackward."""
    return execute(_OP, workspace, workspaceSize, executor, stream)


def aclnnEmbeddingGetWorkspaceSize(weight: Tensor, indices: Tensor,
                                   out: Tensor) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnEmbedding: ``out[i...] = weight[indices[i...]]``, the rows gathered (ops-nn
    ``index/embedding``).

    Args:
        weight: (V, E) of CANN's table (floats, bfloat16, integers, bool, complex); any strides.
        indices: int32 / int64, 0-7 dims; read when the executor runs: a value outside ``[0, V)`` returns 161002 from
            phase 2 with ``out`` untouched (CANN leaves such rows undefined; gradops reads nothing outside weight).
        out: ``indices.shape + (E,)`` in weight's dtype; written by phase 2.

    Returns:
        ``(status, workspace_size, executor)``: 161001 for a None tensor, 161002 for a dtype, rank or shape outside
        the table.
    """
    try:
        plan(plan_embedding, weight, indices, -1, False, out=out)  # CANN's table (check_embedding, cann=True)
    except OpError as e:
        return refused(e)
    rows = out.view(-1, weight.shape[1]) if out.is_contiguous() else None  # made once: phase 2 keeps the layout

    def run(_workspace: Tensor | None) -> None:
        idx = checked_indices(indices, weight.shape[0], op="embedding")  # the data present now (161002 if outside)
        if rows is not None:
            torch.index_select(weight, 0, idx, out=rows)
        else:
            out.copy_(weight.index_select(0, idx).view(out.shape))

    return ACLNN_SUCCESS, 0, aclOpExecutor("embedding", "torch", weight.device, 0, run,
                                           {"weight": weight, "indices": indices, "out": out})


def aclnnEmbedding(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnEmbedding."""
    return execute("embedding", workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnEmbeddingDenseBackwardGetWorkspaceSize, aclnnEmbeddingDenseBackward,
        "aclnn_embedding_dense_backward.h",
        "const aclTensor *grad, const aclTensor *indices, uint64_t numWeights, uint64_t paddingIdx, "
        "bool scaleGradByFreq, const aclTensor *out"),
    CFunction(
        aclnnEmbeddingGetWorkspaceSize, aclnnEmbedding,
        "aclnn_embedding.h",
        "const aclTensor *weight, const aclTensor *indices, const aclTensor *out"),
)
