"""Hardswish and aclnnHardswishBackward on the CPU: the host entries of the native kernels ``hardswish`` and
``hardswish_backward`` (hardswish.cpp: elementwise, float32 math, 8-lane vectors on torch's threads).

Byte models: forward ``2·n·s``, backward ``3·n·s``. Contiguous tensors (or two tensors sharing one dense
layout, e.g. both transposed) are processed in storage order without a copy; anything else is copied once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...cpu import _pool
from ...cpu._host import kernel
from ...cpu.programs import Program, arg
from ...spec import Impl
from .contract import hardswish_backward_results, hardswish_results


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


def _span(t: Tensor) -> Tensor:
    """A dense ``t``'s memory as one contiguous row, in storage order (strides are never negative in torch, so the
    span starts at t's first element): tensors sharing one dense layout hold each index at the same position of
    their spans, which is all an elementwise kernel needs."""
    return t if t.is_contiguous() else t.detach().as_strided((t.numel(),), (1,))


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


def hardswish(x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Hardswish of any shape and strides; result in x's dtype (and x's dense layout)."""
    if out is None and x.is_contiguous():  # the common case: no layout work
        y = _pool.empty_like(x)  # the declared result (hardswish_results): laid out like x
        kernel("hardswish", (x,), (y,))
        return y
    (xs,), buf = _layout([x], out)
    if x.numel():  # dense tensors sharing one layout: element i of each span belongs to the same index
        kernel("hardswish", (_span(xs),), (_span(buf),))
    if out is not None and buf is not out:
        out.copy_(buf)
        return out
    return buf


def hardswish_backward(grad_output: Tensor, x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """aclnnHardswishBackward (closed interval [-3, 3]); a new tensor, or ``out`` filled."""
    if out is None and x.is_contiguous() and grad_output.is_contiguous():
        buf = _pool.empty_like(x)  # the declared result (hardswish_backward_results): laid out like x
        kernel("hardswish_backward", (grad_output, x), (buf,))
        return buf
    (gs, xs), buf = _layout([grad_output, x], out)
    if x.numel():
        kernel("hardswish_backward", (_span(gs), _span(xs)), (_span(buf),))
    if out is not None and buf is not out:
        out.copy_(buf)
        return out
    return buf

# ---------------------------------------------------------------- the direct calls' programs
# Each: the Python path above as the extension replays it (see gradops.cpu.programs; the op's call plan loads
# it): the same registered kernel on outputs of the same shapes, or None where the Python path does what a
# program does not.
def program_hardswish(shape, x):
    if not x.numel():
        return None
    p = Program()
    (y,) = p.declared(hardswish_results(shape, x))
    p.kernel("hardswish", [arg(0)], [y])
    return p.returns(y)


def program_hardswish_backward(shape, grad_output, x):
    if not x.numel():
        return None
    p = Program()
    (dx,) = p.declared(hardswish_backward_results(shape, grad_output, x))
    p.kernel("hardswish_backward", [arg(0), arg(1)], [dx])
    return p.returns(dx)


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
HARDSWISH = Impl(hardswish)
HARDSWISH_BACKWARD = Impl(hardswish_backward)
