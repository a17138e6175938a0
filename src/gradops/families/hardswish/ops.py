"""Hardswish / HardswishBackward: torch.library ops, autograd, and the public functions."""

from __future__ import annotations

from torch import Tensor

from ... import native
from ...ops._direct import DirectOp, own
from ...ops._double import compute_dtype, partial_vjp, save_inputs
from ...ops._out import into
from ...ops._plan import Planner
from . import reference, spec


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


def _native_entry(choice, shape, x: Tensor):
    """The native Hardswish node, or None (see :mod:`gradops.native`): it runs the extension's registered
    ``hardswish`` / ``hardswish_backward`` kernels (and records nothing where autograd does not record the call:
    the op's body runs it too)."""
    return native.node(lambda ext: (ext.HARDSWISH, ext.hardswish), _differentiable_backward)


def _backward_entry(choice, shape, grad_output: Tensor, self: Tensor):
    """The extension's ``hardswish_backward`` (the registered kernel on torch's threads), or None (see
    :func:`gradops.native.function`)."""
    return native.function(lambda ext: ext.hardswish_backward)


# Every call pays one key and one lookup for its validation and backend (ops/_plan.py).
plan_hardswish = Planner(spec.HARDSWISH, native=_native_entry,
                         program=lambda: _cpu().program_hardswish)
plan_hardswish_backward = Planner(spec.HARDSWISH_BACKWARD, device_arg=1,
                                  native=_backward_entry, program=lambda: _cpu().program_hardswish_backward)


def _run(plan, *args: Tensor) -> Tensor:
    """The plan's kernels on ``args``: through the extension (on torch's threads) where the plan has it and the
    tensors are contiguous, else the backend (any layout)."""
    if plan.native is not None and all(t.is_contiguous() for t in args):
        return plan.native(*args)
    return own(plan.backend.fn(*args))


def _hardswish_backward_body(grad_output: Tensor, self: Tensor) -> Tensor:
    return _run(plan_hardswish_backward(grad_output, self), grad_output, self)


_hardswish_backward = DirectOp(spec.HARDSWISH_BACKWARD, _hardswish_backward_body, plan_hardswish_backward)


def _hardswish_backward_formula(grad_output: Tensor, self: Tensor) -> tuple[Tensor]:
    return (reference.hardswish_backward(grad_output, self, compute_dtype(grad_output, self)),)


def _hardswish_backward_backward(ctx, dd):
    """The derivative of HardswishBackward: ``dd * d(x)`` for grad_output, ``dd * grad_output / 3`` for x on the
    closed interval [-3, 3] (0 elsewhere), the same interval as the first derivative (torch's own formula uses
    the open one for both)."""
    return partial_vjp(_hardswish_backward_formula, ctx.saved_tensors, (dd,))


_hardswish_backward.register_autograd(_hardswish_backward_backward, setup_context=save_inputs)


def _hardswish_body(self: Tensor) -> Tensor:
    return _run(plan_hardswish(self), self)


_hardswish = DirectOp(spec.HARDSWISH, _hardswish_body, plan_hardswish, node=lambda ext: ext.hardswish_planned)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return _hardswish_backward(grad, x)


_hardswish.register_autograd(_backward, setup_context=_setup)


def _differentiable_backward(inputs: list[Tensor], extra: object) -> tuple[Tensor]:
    """The native node's backward where it does not run its kernel itself (``create_graph=True``, a forked child, a
    gradient that is not plain: see hardswish.cpp): :func:`_backward`'s op, which records a second derivative and
    dispatches batched or lazily negated gradients."""
    grad, x = inputs
    return (_hardswish_backward(grad, x),)


_hardswish.native = _hardswish.recorded


def hardswish(self: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``y = x * clamp(x + 3, 0, 6) / 6``; differentiable through :func:`hardswish_backward` (CANN's closed
    interval at +-3, see there). float16 / bfloat16 / float32 (or float64, beyond CANN), 0 to 8 dims, any strides.
    ``out``: optional preallocated result of self's shape and dtype, any strides (see :mod:`gradops.ops._out`; not
    differentiable)."""
    if out is not None:
        if _hardswish.direct_into(out, self):  # the common out= call, checked in C++ (see DirectOp.direct_into)
            return out
        return into(spec.HARDSWISH, plan_hardswish, ("self",), (self,), out, (0,), via=_hardswish)[0]
    return _hardswish(self)


def hardswish_output(x: Tensor) -> Tensor:
    """:func:`hardswish` as ``gradops.nn.Hardswish`` calls it: a recorded eager call on CPU goes to the native node
    straight away (the op's own dispatch in front of it cost ~0.6 µs more: the module's forward at 8 x 8 fp32 took
    3.9 µs that way against torch.nn.Hardswish's 3.3, on 2 cores); every other call is :func:`hardswish`."""
    if isinstance(x, Tensor) and x.requires_grad:  # anything else is hardswish's to refuse, with its OpError
        y = _hardswish.recorded(x)
    else:  # nothing records it (eval, no_grad): the direct call, without hardswish()'s and DirectOp's layers
        y = _hardswish.direct(x)
    return hardswish(x) if y is None else y


def hardswish_backward(grad_output: Tensor, self: Tensor, *, out: Tensor | None = None) -> Tensor:
    """aclnnHardswishBackward: ``grad_output * d(self)`` with ``d = 0`` below -3, ``x/3 + 0.5`` on the CLOSED
    interval [-3, 3] (so ``d(-3) = -0.5`` and ``d(3) = 1.5``, where PyTorch >= 2.8 gives 0 and 1), 1 above 3.

    Args:
        grad_output: gradient of the forward's output, dtype and shape of ``self`` (no broadcasting).
        self: the forward's input, float16 / bfloat16 / float32 (or float64, computed in float64), 0 to 8 dims.
        out: optional preallocated result (self's shape and dtype, any strides) to write into.

    Returns:
        A new tensor (or ``out``) of self's shape and dtype. A NaN in ``self`` passes grad_output through (CANN's
        950 kernel). Differentiable (double backward of :func:`hardswish`) with respect to both arguments; the
        derivative with respect to self follows the same closed interval: ``grad_output / 3`` on [-3, 3], 0 outside
        (torch's formula: the open interval).
    """
    if out is not None:
        if _hardswish_backward.direct_into(out, grad_output, self):
            return out
        return into(spec.HARDSWISH_BACKWARD, plan_hardswish_backward, ("grad_output", "self"),
                    (grad_output, self), out, via=_hardswish_backward)[0]
    return _hardswish_backward(grad_output, self)
