"""``out=``: results written into tensors the caller preallocated (no allocation, no first-touch page faults).

A fresh multi-megabyte CPU tensor costs its first touch: measured ~3-7 GB/s of page faults on a 2-core VM,
often more than the kernel itself (an 8192 x 4096 fp32 RMSNorm backward: ~18 ms with ``out=``, ~95 ms with a
fresh dx). ``out=`` runs eagerly, outside the ``torch.library`` op (whose schema stays functional for
torch.compile), through the same validation table and backend choice as the op.

Rules (checked before any kernel runs; violations raise OpError 161002 naming the out tensor):
one tensor per result (a tuple for tuple results), each of the documented shape and dtype, on the inputs'
device, one memory location per element (no broadcast or interleaved strides), its storage holding its elements
(161001 for a freed storage, see :data:`gradops.contract._common.hollow`), not requiring grad while grad mode is
on (torch's ``out=`` functions refuse it: an out= result carries no autograd history; under ``torch.no_grad()``
it is written, as torch writes it), and not overlapping any input or another out in memory - by address, so two
storages over the same memory (numpy arrays, ``torch.from_numpy``, ``from_blob``) count. Any strides: a
non-contiguous out is filled by a copy, and so is an out with the lazy negation bit (``z.conj().imag``), whose
memory holds the negated values: the copy writes them negated, so the out reads back the results.
Forward ops refuse ``out=`` when autograd would record them (as torch's ``out=`` functions do).

In a child forked after GNU OpenMP ran (see :func:`gradops.backend._serially`), the whole write runs on one torch
thread, the copies included: a parallel region there never returns.

With the native extension loaded, a public function first hands its out= call to its DirectOp's ``direct_into``,
which makes these checks in C++ and writes through the op's direct program; whatever it declines comes here
(1.3-3.1 µs per out= call at 8 x 8 fp32 that way, 6-24 with the checks below).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..backend import _forked_omp_child
from ..contract._common import dtype_name, fail, require_whole, require_writable, shape_text
from ..status import ACLNN_ERR_PARAM_INVALID

if TYPE_CHECKING:
    from ..spec import OpSpec
    from ._direct import DirectOp

Spec = tuple[Sequence[int], torch.dtype]


def _span(t: Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) of the memory t can address; (0, 0) when empty. From the data pointer
    and the strides: no storage object is built (~1.4 µs each: with five inputs and three outs, the pairwise checks
    built 36 of them, 52 µs per call of layer_norm_backward(..., out=), against 29 µs for the whole call without
    out=)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    size = t.element_size()
    if t.is_contiguous():
        end = start + t.numel() * size
    else:
        end = start + (sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 1) + 1) * size
    return (start, end)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two spans of :func:`_span` share an address. By address, not by storage: two storages can cover the
    same memory (``torch.from_numpy`` of two numpy views of one array, ``from_blob``), and a write into one is then
    a write into the other (the direct path's ``meet`` compares the same ranges). Conservative for interleaved
    views of one storage (``x[:, ::2]`` beside ``x[:, 1::2]``), which count as overlapping."""
    return a[0] != 0 and b[0] != 0 and a[0] < b[1] and b[0] < a[1]


def check_out(op: str, out: object, specs: Sequence[Spec], device: torch.device, **inputs: Tensor | None
              ) -> tuple[Tensor, ...]:
    """Validate ``out`` against the expected ``(shape, dtype)`` of each result; return it as a tuple."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    what = f"a tuple of {len(specs)} tensors" if len(specs) > 1 else "a tensor"
    if len(outs) != len(specs) or (len(specs) > 1) != isinstance(out, (tuple, list)):
        raise fail(ACLNN_ERR_PARAM_INVALID, op, "out", what, type(out).__name__ if not isinstance(out, (tuple, list))
                   else f"{len(outs)} items")
    spans: list[tuple[str, tuple[int, int]]] | None = None
    out_spans: list[tuple[int, int]] = []
    for i, (t, (shape, dtype)) in enumerate(zip(outs, specs)):
        name = f"out[{i}]" if len(specs) > 1 else "out"
        if not isinstance(t, Tensor):
            raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a torch.Tensor", type(t).__name__)
        if tuple(t.shape) != tuple(shape):
            raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.shape", shape_text(shape), shape_text(t.shape))
        if t.dtype != dtype:
            raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.dtype", dtype_name(dtype), dtype_name(t.dtype))
        if t.device != device:
            raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.device", str(device), str(t.device))
        if t.requires_grad and torch.is_grad_enabled():  # torch's rule for out= (see the module docstring)
            raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a tensor that does not require grad (out= results carry no "
                       "autograd history; write under torch.no_grad() or drop out=)", "requires_grad=True")
        require_whole(op, name, t)
        require_writable(op, name, t)
        if t.is_inference() and not torch.is_inference_mode_enabled():  # torch's rule and words, before any write
            raise RuntimeError(f"gradops.{op}: {name}: Inplace update to inference tensor outside InferenceMode is "
                               "not allowed (as for torch's out= functions); make it outside inference mode, or call "
                               "inside torch.inference_mode()")
        span = _span(t)
        if spans is None:  # each input's span once, when the first out needs them
            spans = [(arg, _span(x)) for arg, x in inputs.items() if x is not None]
        for arg, other in spans:
            if _overlap(span, other):
                raise fail(ACLNN_ERR_PARAM_INVALID, op, name, f"memory not shared with the input {arg}",
                           "an overlapping tensor")
        for j, other in enumerate(out_spans):
            if _overlap(span, other):
                raise fail(ACLNN_ERR_PARAM_INVALID, op, name, f"memory not shared with out[{j}]",
                           "an overlapping tensor")
        out_spans.append(span)
    return tuple(outs)


def refuse_autograd(op: str, *inputs: Tensor) -> None:
    """Forward ops: ``out=`` results carry no autograd history, so refuse when one would be recorded."""
    if torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in inputs):
        raise RuntimeError(f"gradops.{op}(..., out=...) does not support automatic differentiation: an input "
                           "requires grad; call it under torch.no_grad() or drop out=")


@cache
def takes_out(fn: Callable) -> bool:
    """Whether backend function ``fn`` accepts ``out=`` (it then writes its results into the given tensors)."""
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _view(t: Tensor, shape: Sequence[int]) -> Tensor | None:
    """A contiguous view of ``t`` with ``shape`` (what a backend writes through), or None if there is none: not
    contiguous, or its memory does not hold its values as they read (the lazy negation bit of ``z.conj().imag``, or
    conjugation), so a write by address would read back negated; ``copy_`` writes such an out right."""
    if not t.is_contiguous() or t.is_neg() or t.is_conj():
        return None
    return t.view(tuple(shape))


def run_into(fn: Callable, args: tuple, outs: tuple[Tensor, ...], shapes: Sequence[Sequence[int] | None],
             via: DirectOp | None = None) -> tuple[Tensor, ...]:
    """Run backend ``fn(*args)`` so that its results land in ``outs``.

    ``shapes[i]`` is the shape the backend produces for result i (its 2-D view), None for "same as out[i]".
    ``via``: the op's :class:`gradops.ops._direct.DirectOp` when ``args`` are also the op's own arguments: with the
    native extension loaded, contiguous outs are then written in place by the op's direct program (one C++ call,
    the kernels on torch's threads), as a call without ``out=`` runs. (The public functions try that first, on
    their own arguments, before check_out: see DirectOp.direct_into; this is for the calls it declined but check_out
    accepts, e.g. a float32 embedding table beside float16 grad.) Backends whose function takes ``out=`` write in
    place (a tuple for several results); others, or an out without a contiguous view (see :func:`_view`), get their
    result copied in. In a child forked after GNU OpenMP ran, all of it runs on one torch thread, the copies
    included (the backend's function alone already does there: :func:`gradops.backend._serially`); the caller's
    thread count is restored after.
    """
    if not _forked_omp_child():
        return _run_into(fn, args, outs, shapes, via)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_into(fn, args, outs, shapes, via)
    finally:
        torch.set_num_threads(threads)


def _run_into(fn: Callable, args: tuple, outs: tuple[Tensor, ...], shapes: Sequence[Sequence[int] | None],
              via: DirectOp | None) -> tuple[Tensor, ...]:
    views = [_view(o, o.shape if s is None else s) for o, s in zip(outs, shapes)]
    whole = all(v is not None for v in views)
    if whole and via is not None and via.direct_into(tuple(views) if len(views) > 1 else views[0], *args):
        return outs
    # A lazily negated input (``z.conj().imag``) reaches the kernels as its stored data: apply the sign first
    # (resolve_neg returns the tensor itself when the bit is clear).
    args = tuple(a.resolve_neg() if isinstance(a, Tensor) else a for a in args)
    if whole and takes_out(fn):
        fn(*args, out=tuple(views) if len(views) > 1 else views[0])
        for o in outs:  # written through its address: count the write as torch's out= ops do (copy_ counts its own)
            torch.autograd.graph.increment_version(o)
        return outs
    results = fn(*args)
    results = results if isinstance(results, tuple) else (results,)
    for o, r in zip(outs, results):
        o.copy_(r.reshape(o.shape))
    return outs


def into(op: OpSpec, planner: Callable[..., Any], names: Sequence[str], args: tuple, out: object,
         differentiable: Sequence[int] = (), *, views: Callable[..., tuple] | None = None,
         via: DirectOp | None = None) -> tuple[Tensor, ...]:
    """``out=`` from the op's declaration ``op`` (its ``results``): the op's plan (``planner(*args)``), the outs
    checked against the declared results (see :func:`check_out`), the plan's backend run into them
    (:func:`run_into`). ``names``: the op's argument
    names (the messages name an overlapping input); ``differentiable``: the positions of a forward op's inputs
    that autograd would record (refused under grad mode, see :func:`refuse_autograd`); ``views(shape, *args)``: the
    backend's arguments (the 2-D views the op's adapter passes), the arguments themselves when None; ``via``: the
    op's DirectOp, whose direct program writes contiguous outs in place where the extension is loaded."""
    call = planner(*args)
    if differentiable:
        refuse_autograd(op.name, *(args[i] for i in differentiable))
    expected = op.results(call.shape, *args)
    inputs = {name: a for name, a in zip(names, args) if isinstance(a, Tensor)}
    outs = check_out(op.name, out, [(r.size, r.dtype) for r in expected], expected[0].like.device, **inputs)
    backend_args = args if views is None else views(call.shape, *args)  # type: ignore[attr-defined]
    shapes = [r.view for r in expected]
    return run_into(call.backend.fn, backend_args, outs, shapes, via=via)  # type: ignore[attr-defined]
