"""Hardswish and aclnnHardswishBackward as numba kernels: flat, chunked, vectorized elementwise loops.

Byte models: forward ``2·n·s``, backward ``3·n·s``. Contiguous tensors (or two tensors sharing one dense
layout, e.g. both transposed) are processed in storage order without a copy; anything else is copied once.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange
from torch import Tensor

from . import _pool
from ._host import PARALLEL_MIN, safe_entry
from ._numeric import FASTMATH, ld, st, two_lines
from ._views import STORAGE, view1

#: Elements per parallel task: 16 Ki x 4 B = 64 KiB per input stream. Small enough that a mid-size tensor splits
#: evenly over the threads (98 Ki elements, a 512 x 192 expert activation, gave 64 Ki + 34 Ki with 64 Ki tasks),
#: large enough to amortise a task's start; 32M elements give 2048 tasks.
_CHUNK = 1 << 14
#: float32(1/3) = 0.33333334f, CANN's constant (docs/semantics.md §3).
_THIRD = np.float32(0.3333333432674408)


@njit(cache=True, fastmath=FASTMATH)
def _hardswish_chunk(x, y):  # pragma: no cover - compiled
    """``y = x·clamp(x + 3, 0, 6) / 6`` (fp32 math, the reference's operation order) on one chunk."""
    for i in range(x.shape[0]):
        v = ld(x, i)
        t = min(max(v + np.float32(3.0), np.float32(0.0)), np.float32(6.0))
        st(y, i, v * t / np.float32(6.0))


# No 'contract' here: x·(1/3) is rounded before the + 0.5, as CANN's kernel does it with two vector instructions
# (Muls, Adds) and as the reference computes it. An FMA keeps the product unrounded: at x = -1.5 it gives
# -1.49e-8 where every other backend and the float64 golden give 0, a relative error of ~0.15·|g| against CANN's
# Threshold of 2^-7 (bf16). Elementwise, so nothing to reassociate either: the loop vectorizes without flags.
@njit(cache=True)
def _hardswish_backward_chunk(g, x, out):  # pragma: no cover - compiled
    """``out = 0 if x < -3; g·(x·0.33333334 + 0.5) if -3 <= x <= 3; g otherwise`` (a NaN x passes g through),
    written as two selects between values computed unconditionally so the loop vectorizes: with the product inside
    the conditional expression (a branch per element for LLVM) numba's loop stayed scalar, 3.1-3.5 ms for 4 Mi fp32
    elements on one thread against 1.2 ms this way (the same bits).

    In steps of two cache lines of each stream (32 fp32 items: two 512-bit vectors; 64 bf16/fp16), as ATen's
    vectorized loops go, not LLVM's own loop over the whole chunk (four vectors per stream a step, behind a runtime
    overlap test). The elements and their bits are the same; the memory traffic's shape is not. On a 2-core machine
    two threads can run slower together about half the time (two threads 1.6x one thread there, 2.5x otherwise; one
    thread alone never changes), and there, 4 Mi fp32 elements on two threads (6 processes, paired):
    LLVM's loop 0.88-1.37 ms, ATen's hardswish_backward 0.73-1.05, this loop 0.70-1.04 (0.94-1.01x ATen in every
    round of both states). Four vectors a step 0.76-1.09 ms, one vector a step 1.4-1.6; software prefetch 4 KiB
    ahead 0.79-1.07; non-temporal stores and 256-bit vectors gained nothing. Through gradops' call (its output pool)
    0.89-0.97x ATen in the slow state and 0.76-0.92x in the other (8 processes, 32 rounds), against 1.06-1.28x
    before in the slow one."""
    n = x.shape[0]
    step = two_lines(out)
    i = 0
    while i + step <= n:
        gs, xs, ds = g[i:i + step], x[i:i + step], out[i:i + step]  # zero-based: no wraparound test per index
        for k in range(step):
            st(ds, k, _grad_value(ld(gs, k), ld(xs, k)))
        i += step
    for k in range(i, n):
        st(out, k, _grad_value(ld(g, k), ld(x, k)))


@njit(cache=True)
def _hardswish_backward_inplace_chunk(g, x):  # pragma: no cover - compiled
    """:func:`_hardswish_backward_chunk` writing into g itself (element i read before it is written: the same
    bits), for the native node's incoming gradient when nothing else holds it (native/autograd.cpp). Its own loop,
    not the chunk above with ``out=g``: LLVM's runtime test finds out and g overlapping and runs the scalar loop,
    2.7 ms for 4 Mi fp32 elements on one thread, where this one takes 1.05 against 1.75 for the chunk above into a
    separate out (no read-for-ownership of a third stream)."""
    for i in range(x.shape[0]):
        st(g, i, _grad_value(ld(g, i), ld(x, i)))


@njit(inline="always")  # inlined into its callers at numba's level: nothing of its own to cache
def _grad_value(gv, v):  # pragma: no cover - compiled
    """One element of the backward, float32 math (see _hardswish_backward_chunk)."""
    r = gv * (v * _THIRD + np.float32(0.5))
    inside = r if v <= np.float32(3.0) else gv
    return np.float32(0.0) if v < np.float32(-3.0) else inside


# The parallel loops hand zero-based slices to the chunk functions: indexing a slice from 0 lets numba drop the
# negative-index wraparound test that, with ``range(lo, hi)`` indices, kept LLVM from vectorizing (measured 3x).
@njit(parallel=True, cache=True)
def _hardswish_kernel(x, y):  # pragma: no cover - compiled
    n = x.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo = c * _CHUNK
        hi = min(n, lo + _CHUNK)
        _hardswish_chunk(x[lo:hi], y[lo:hi])


@njit(parallel=True, cache=True)
def _hardswish_backward_kernel(g, x, out):  # pragma: no cover - compiled
    n = x.shape[0]
    for c in prange((n + _CHUNK - 1) // _CHUNK):
        lo = c * _CHUNK
        hi = min(n, lo + _CHUNK)
        _hardswish_backward_chunk(g[lo:hi], x[lo:hi], out[lo:hi])


@njit(cache=True)
def _hardswish_entry(x_at, y_at, dtype, n):  # pragma: no cover - compiled
    """The forward over the ``n`` items at each address (see :mod:`gradops.cpu._views`)."""
    x, y = view1(x_at, dtype, n), view1(y_at, dtype, n)
    if n < PARALLEL_MIN:  # a parallel launch (~1.6 µs) costs more than the threads save
        _hardswish_chunk(x, y)
    else:
        _hardswish_kernel(x, y)


@njit(cache=True)
def _hardswish_backward_entry(g_at, x_at, out_at, dtype, n):  # pragma: no cover - compiled
    g, x, out = view1(g_at, dtype, n), view1(x_at, dtype, n), view1(out_at, dtype, n)
    if n < PARALLEL_MIN:
        _hardswish_backward_chunk(g, x, out)
    else:
        _hardswish_backward_kernel(g, x, out)


def _dense(t: Tensor) -> bool:
    """True when t's elements tile one gap-free span of memory (contiguous in some dim order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((step, n) for n, step in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _layout(inputs: list[Tensor], out: Tensor | None) -> tuple[list[Tensor], Tensor]:
    """Inputs and an output that share the layout ``torch.empty_like(self)`` has (``self`` = the last input):
    the op's fake implementation promises exactly that layout, so compiled graphs see the strides they traced.
    Inputs already in it are used in place; the others are copied into it once."""
    self_ = inputs[-1]
    if out is None and all(t.is_contiguous() for t in inputs):  # the common case, in ~1 µs
        return inputs, _pool.empty(self_.shape, self_.dtype)
    ref = self_ if _dense(self_) else torch.empty_like(self_)  # empty_like keeps a dense tensor's strides
    inputs = [t if _dense(t) and t.stride() == ref.stride() else torch.empty_like(ref).copy_(t) for t in inputs]
    if out is not None and out.stride() == ref.stride() and _dense(out):
        return inputs, out
    if ref.is_contiguous():
        return inputs, _pool.empty(ref.shape, ref.dtype)
    return inputs, torch.empty_like(ref)


@safe_entry
def hardswish(x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Hardswish of any shape and strides; result in x's dtype (and x's dense layout)."""
    n = x.numel()
    if out is None and x.is_contiguous():  # the common case: no layout work
        y = _pool.empty_like(x)
        if n:
            _hardswish_entry(x.data_ptr(), y.data_ptr(), STORAGE[x.dtype], n)
        return y
    (xs,), buf = _layout([x], out)
    if n:  # dense tensors sharing one layout: element i of each span belongs to the same index
        _hardswish_entry(xs.data_ptr(), buf.data_ptr(), STORAGE[x.dtype], n)
    if out is not None and buf is not out:
        out.copy_(buf)
        return out
    return buf


@safe_entry
def hardswish_backward(grad_output: Tensor, x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """aclnnHardswishBackward (closed interval [-3, 3]); a new tensor, or ``out`` filled."""
    n = x.numel()
    if out is None and x.is_contiguous() and grad_output.is_contiguous():
        buf = _pool.empty_like(x)
        if n:
            _hardswish_backward_entry(grad_output.data_ptr(), x.data_ptr(), buf.data_ptr(), STORAGE[x.dtype], n)
        return buf
    (gs, xs), buf = _layout([grad_output, x], out)
    if n:
        _hardswish_backward_entry(gs.data_ptr(), xs.data_ptr(), buf.data_ptr(), STORAGE[x.dtype], n)
    if out is not None and buf is not out:
        out.copy_(buf)
        return out
    return buf
