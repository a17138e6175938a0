"""EmbeddingDenseBackward: the torch.library op and the public function."""

from __future__ import annotations

import torch
from torch import Tensor

from ... import native
from ...backend import forked_cpu_call, on_one_thread
from ...contract._common import accumulator
from ...ops._direct import _PLAIN, BODY, DirectOp, _records, eager_path, fit, own
from ...ops._out import check_out, run_into
from ...ops._plan import Planner
from ...status import ACLNN_ERR_INNER_NULLPTR, OpError
from . import contract, spec
from .contract import checked_indices, flat_indices, no_padding_outside_table, out_dtypes


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


def _embedding_dense_backward_2d(fn, shape, grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                                 scale_grad_by_freq: bool, *, checked: bool = False) -> Tensor:
    """The backend on (N, E) grad and flat int64 indices; ``checked``: the indices passed the range test already
    (the forward's, guarded by autograd's saved-tensor version check), so only converted here. A backend that
    tests integer indices where it reads them (``tests_indices``: the Triton launcher, with no host
    synchronisation) is not given a second test: on CUDA that was six more device calls per call."""
    if checked or (getattr(fn, "tests_indices", False) and not indices.is_floating_point()):
        idx = flat_indices(indices)
    else:
        idx = checked_indices(indices, num_weights)
    return own(fn(fit(grad, shape), idx, num_weights, padding_idx, scale_grad_by_freq))


# values=(0,): float64 indices are one of CANN's nine index dtypes, not a reason to compute in float64.
plan_embedding_dense_backward = Planner(spec.EMBEDDING_DENSE_BACKWARD, adapter=_embedding_dense_backward_2d,
                                        values=(0,), program=lambda: _cpu().program_embedding_dense_backward)


def _embedding_dense_backward_body(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                                   scale_grad_by_freq: bool) -> Tensor:
    plan = plan_embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    try:
        return plan.run(plan.shape, grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    except (MemoryError, RuntimeError, ValueError) as err:
        raise too_large(err, num_weights, grad) from err


def too_large(err: BaseException, num_weights: int, grad: Tensor) -> BaseException:
    """The one input that sizes memory by itself is num_weights (the result has V rows whatever the work): an
    allocation that fails for it becomes an OpError saying how much was asked (CANN's answer to a failed
    allocation is ACLNN_ERR_INNER_NULLPTR), and so does a table of more bytes than int64 counts, whatever the
    allocator raised for it (numpy: ValueError "Maximum allowed dimension exceeded"); any other error is returned
    as it is."""
    nbytes = num_weights * grad.shape[-1] * grad.element_size()
    if not isinstance(err, MemoryError) and "alloc" not in str(err).lower() and nbytes < 2**63:
        return err
    size = next(f"{nbytes / 2 ** p:.1f} {u}" for p, u in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (0, "B"))
                if nbytes >= 2 ** p or p == 0)
    return OpError(ACLNN_ERR_INNER_NULLPTR, "embedding_dense_backward", "num_weights",
                   f"a table {grad.device} memory can hold", f"{num_weights} rows x {grad.shape[-1]} "
                   f"{str(grad.dtype).removeprefix('torch.')} = {size} ({type(err).__name__}: {err})")


_embedding_dense_backward = DirectOp(spec.EMBEDDING_DENSE_BACKWARD, _embedding_dense_backward_body,
                                     plan_embedding_dense_backward)


def embedding_dense_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, *, out: Tensor | None = None) -> Tensor:
    """aclnnEmbeddingDenseBackward: the gradient of an embedding table.

    ``out[k] = sum_{i: indices[i] = k} grad[i] / (count[k] if scale_grad_by_freq else 1)``, with the row
    ``padding_idx`` left at zero; sums in float32, deterministic.

    Args:
        grad: (..., E) with 2 to 8 dims whose leading dims flatten to ``indices.numel()``; float16 / bfloat16 /
            float32, or float64 (beyond CANN: summed in float64).
        indices: any of the seed's nine dtypes; floats are truncated toward zero, bool reads as 0/1. Every
            value must lie in ``[0, num_weights)`` (else OpError 161002; no memory is addressed with it). On
            CUDA with the Triton backend integer indices are tested on the device: the refusal comes at the next
            gradops launch or ``gradops.synchronize()``, without a host synchronisation.
        num_weights: rows of the table (V).
        padding_idx: signed; a value outside ``[0, num_weights)``, e.g. the default -1, means no padding row
            (CANN's rule: Python's ``nn.Embedding`` normalisation of negatives does not apply here).
        scale_grad_by_freq: divide by each index's count over all occurrences, padding included.
        out: optional preallocated (num_weights, E) table to write into (every row is written; see
            :mod:`gradops.ops._out`): grad's dtype, or float32 beside float16 / bfloat16 grad (the float32 sums
            unrounded, as CANN's own opapi tests accept).

    Returns:
        (num_weights, E) in grad's dtype.
    """
    if out is None:  # the direct path validates on the first call of each argument metadata, as the plan below
        table = _embedding_dense_backward.direct(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
        if table is not None:
            return table
    elif _embedding_dense_backward.direct_into(out, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
        return out  # the common out= call, checked in C++ (see DirectOp.direct_into)
    # here too: the schema would refuse a None or a bad scalar before the op body checks
    plan = plan_embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    padding_idx = no_padding_outside_table(padding_idx, num_weights)
    if out is not None:
        # A float32 out beside float16 / bfloat16 grad keeps the float32 sums unrounded (contract.out_dtypes): the
        # backends sum in float32, so grad widened to float32 gives exactly those sums.
        widen = isinstance(out, Tensor) and out.dtype != grad.dtype and out.dtype in out_dtypes(grad.dtype)
        (result,) = spec.EMBEDDING_DENSE_BACKWARD.results(plan.shape, grad, indices, num_weights, padding_idx,
                                                          scale_grad_by_freq)
        table = (result.size, out.dtype if widen else result.dtype)
        outs = check_out("embedding_dense_backward", out, [table], grad.device, grad=grad, indices=indices)
        idx = checked_indices(indices, num_weights)
        args = ((grad.float() if widen else grad).reshape(plan.shape), idx, num_weights, padding_idx,
                scale_grad_by_freq)
        return run_into(plan.backend.fn, args, outs, [None], via=_embedding_dense_backward)[0]
    return _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


# ---------------------------------------------------------------- forward: the lookup whose backward is the op above

# The native node takes eager recorded lookups on CPU (gradops.native).
_NATIVE_VALUES = (torch.float32, torch.float16, torch.bfloat16)
#: Indices the kernels read as they are; the other seven dtypes get CANN's conversion in Python first.
_NATIVE_INDICES = (torch.int32, torch.int64)


def _native_entry(choice, shape, weight: Tensor, indices: Tensor, padding_idx: int, scale_grad_by_freq: bool):
    """The native Embedding node for these dtypes, or None (see :mod:`gradops.native`). It runs the registered
    kernels ``embedding`` and ``embedding_dense_backward`` (embedding.cpp)."""
    if weight.dtype not in _NATIVE_VALUES or indices.dtype not in _NATIVE_INDICES:
        return None
    return native.node(lambda ext: (ext.EMBEDDING, ext.embedding), _differentiable_backward)


# The lookup's plan: its check, the backend of the backward the node runs (float64 weight: none), and for a call
# that nothing records the direct program "embedding" (the range test, then the rows: gradops.families.embedding.cpu).
plan_embedding = Planner(spec.EMBEDDING_DENSE_BACKWARD, contract.check_embedding, values=(0,), native=_native_entry,
                         program=lambda: _cpu().program_embedding)


def _embedding_body(weight: Tensor, indices: Tensor, padding_idx: int, scale_grad_by_freq: bool) -> Tensor:
    plan = plan_embedding(weight, indices, padding_idx, scale_grad_by_freq)
    # On CUDA with the Triton backend the range test raises asynchronously (no host synchronisation per step):
    # the backward's launch, any later gradops launch or check, or gradops.synchronize() reports it. Elsewhere
    # (CPU, the torch backend, which launches nothing that would) it refuses at once.
    defer = indices.is_cuda and plan.backend.name == "triton"
    if forked_cpu_call(weight.device):  # torch's parallel regions hang in a child forked after OpenMP ran
        return on_one_thread(_rows, weight, indices, defer)
    return _rows(weight, indices, defer)


def _rows(weight: Tensor, indices: Tensor, defer: bool) -> Tensor:
    idx = checked_indices(indices, weight.shape[0], op="embedding", defer=defer)
    return own(weight.index_select(0, idx).view(*indices.shape, weight.shape[1]))


_embedding = DirectOp(spec.EMBEDDING, _embedding_body, plan_embedding, node=lambda ext: ext.embedding_planned)


def _embedding_setup(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    # int(): a SymInt under dynamic-shape tracing; the backward op's schema takes a plain int.
    ctx.num_weights = int(weight.shape[0])
    ctx.padding_idx, ctx.scale_grad_by_freq = padding_idx, scale_grad_by_freq


def _embedding_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    # Flatten to (N, E) and (N,): a 0-d index gives a 1-D grad, which the backward's 2-to-8-dim rule refuses.
    grad, indices = grad.reshape(-1, grad.shape[-1]), indices.reshape(-1)
    args = (ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq)
    if eager_path(grad, indices) == BODY:
        # The forward refused any index outside the table, and autograd's saved-tensor version check guarantees
        # these are the same values: no second range test, so no host synchronisation in the backward on CUDA.
        plan = plan_embedding_dense_backward(grad, indices, *args)
        return plan.run(plan.shape, grad, indices, *args, checked=True), None, None, None
    return _embedding_dense_backward(grad, indices, *args), None, None, None


_embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# ------------------------------------------------- the backward's own derivative: double backward through a lookup


def embedding_dense_backward_vjp(v: Tensor, indices: Tensor, num_weights: int, padding_idx: int,
                                 scale_grad_by_freq: bool) -> Tensor:
    """The exact vector-Jacobian product of :func:`embedding_dense_backward` with ``v`` (V, E), flat (N, E).

    The op is linear in grad: ``out[k] = sum_{i: idx_i = k} w_i * grad_i`` with ``w_i = 0`` for the padding row
    (CANN's rule: padding_idx in ``[0, V)`` names a row, anything else none), else ``1 / count[idx_i]`` with
    scale_grad_by_freq (every occurrence counted, padding included), else 1. So ``d grad_i = w_i * v[idx_i]``: a
    gather, built from torch ops, hence itself differentiable (its derivative is the scatter-add, i.e. the op
    again). ATen's own double backward drops the ``1 / count`` factor (FunctionsManual.cpp: "the first backward
    takes care of it"), which is not the derivative when scale_grad_by_freq is set; this keeps it. Indices as the
    op reads them (floats truncated toward zero); they passed the op's range test, and autograd's saved-tensor
    version check guards them.
    """
    idx = flat_indices(indices)
    rows = v.index_select(0, idx)
    if scale_grad_by_freq:
        _, inverse, counts = torch.unique(idx, return_inverse=True, return_counts=True)
        acc = accumulator(v.dtype)
        rows = (rows.to(acc) / counts.to(acc)[inverse][:, None]).to(v.dtype)
    if 0 <= padding_idx < num_weights:
        rows = rows.masked_fill((idx == padding_idx)[:, None], 0)
    return rows


def _embedding_dense_backward_setup(ctx, inputs, output):
    grad, indices, num_weights, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.grad_shape = grad.shape
    ctx.args = (int(num_weights), padding_idx, scale_grad_by_freq)


def _embedding_dense_backward_backward(ctx, v):
    (indices,) = ctx.saved_tensors
    if v is None:
        return None, None, None, None, None
    return embedding_dense_backward_vjp(v, indices, *ctx.args).reshape(ctx.grad_shape), None, None, None, None


_embedding_dense_backward.register_autograd(_embedding_dense_backward_backward,
                                            setup_context=_embedding_dense_backward_setup)




def _differentiable_backward(inputs: list[Tensor], extra: tuple[int, int, bool]) -> tuple[Tensor]:
    """The native node's backward where it does not run its kernels itself (``create_graph=True``, a forked child, a
    gradient that is not plain, an index changed behind autograd's back: see embedding.cpp): the op, which records
    a second derivative, dispatches what is not plain and refuses an index outside the table."""
    grad, indices = inputs
    num_weights, padding_idx, scale_grad_by_freq = extra
    return (_embedding_dense_backward(grad.reshape(-1, grad.shape[-1]), indices.reshape(-1), num_weights,
                                      padding_idx, scale_grad_by_freq),)


def _native(weight: Tensor, indices: Tensor, padding_idx: int, scale_grad_by_freq: bool) -> Tensor | None:
    if type(padding_idx) is not int or type(scale_grad_by_freq) is not bool:  # the op's to refuse
        return None
    return _embedding.recorded(weight, indices, padding_idx, scale_grad_by_freq)


_embedding.native = _native


def embedding(weight: Tensor, indices: Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False) -> Tensor:
    """The embedding lookup ``out = weight[indices]``, differentiable through :func:`embedding_dense_backward`.

    Args:
        weight: (V, E) table, float16 / bfloat16 / float32 / float64.
        indices: 0 to 7 dims, any of the backward's nine index dtypes (floats truncated toward zero); every
            value must lie in ``[0, V)`` (else OpError 161002; on CUDA with the Triton backend, integer indices are
            tested on the device and refused at the next gradops launch or ``gradops.synchronize()``, the rows
            read meanwhile clamped into the table).
        padding_idx: CANN's rule: a value in ``[0, V)`` names the row whose gradient stays zero; any other
            value, e.g. the default -1, means none. (``gradops.nn.Embedding`` normalises Python's negative
            ``padding_idx`` as ``torch.nn.Embedding`` does before calling this.)
        scale_grad_by_freq: divide each row's gradient by its index count in the batch.

    Returns:
        ``indices.shape + (E,)`` in weight's dtype (a new tensor).
    """
    if not (torch.is_grad_enabled() and _records((weight,))):  # nothing records it: DirectOp.direct, one C++ call
        rows = _embedding.direct(weight, indices, padding_idx, scale_grad_by_freq)
        if rows is not None:
            return rows
    elif type(indices) in _PLAIN and weight.dim() == 2 and type(padding_idx) is int:  # else the check refuses it
        # Recorded: the native node straight away. Its plan validated these metadata when it was remembered (the
        # same check, below for a new one), so the Python check would only repeat it: 1.3 µs of a 7.3 µs lookup.
        rows = _native(weight, indices, no_padding_outside_table(padding_idx, weight.shape[0]), scale_grad_by_freq)
        if rows is not None:
            return rows
    _embedding.validate(weight, indices, padding_idx, scale_grad_by_freq)  # before the table size is read
    return _embedding(weight, indices, no_padding_outside_table(padding_idx, weight.shape[0]), scale_grad_by_freq)
