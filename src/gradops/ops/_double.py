"""Derivatives of the backward ops: double backward (gradient penalties, ``gradgradcheck``) through gradops.

A forward op's backward calls its backward op (``rms_norm`` -> ``rms_norm_grad``, ...). A backward that runs
without a graph (the usual ``loss.backward()``: grad mode is off inside it) takes the op's fast path, unchanged.
With ``create_graph=True`` grad mode is on inside the backward and the saved inputs require grad, so
:func:`gradops.ops._direct.eager_path` sends the backward op through its autograd.Function (or, under tracing and
modes, through the custom op, where the same formula is registered): the backward op's result then carries a
graph, and its own derivative is the one registered here.

Each backward op's derivative is the derivative of the op's pure-torch reference (:mod:`gradops.reference`), the
formula the kernels compute, recomputed in float32 (float64 beside float64 inputs, as the op itself computes) and
differentiated by autograd: :func:`partial_vjp`. Correct by construction, and itself differentiable: the
vector-Jacobian product is a graph of the original inputs and incoming gradients when grad mode is on (a third
backward, ``gradgradcheck`` of a backward op) or under an enclosing torch.func transform. Every floating-point
tensor argument is an independent input with its own gradient: ``rms_norm_grad``'s rstd and
``layer_norm_backward``'s mean and rstd included (taken as given, not re-derived from x). Through a forward op this
gives the true total derivative: those statistics are the forward op's outputs, so their gradients flow back into
the forward op's backward as ``drstd`` / ``dmean`` / ``dvar``, whose terms that backward already has.

``embedding_dense_backward`` is linear in grad and has a hand-written gather instead (see
:mod:`gradops.families.embedding.ops`). ``hardswish_backward``'s derivative keeps CANN's closed interval: ``g / 3``
for x on [-3, 3], kinks included, where torch's formula has the open interval.

The MoE backward ops (``moe_token_permute_grad``, ``moe_token_unpermute_grad`` and the routing-map pair) move
and weight rows by their indices: :func:`reference_derivative` differentiates their references with respect to
their floating-point tensors, the indices held as given (and tested again by the reference).

Not covered: AscendC's ``layer_norm_grad`` / ``layer_norm_grad_beta`` (their torch counterparts, if any, are not
what the modules call), which still raise "has no derivative" on a second backward;
forward-mode AD (``jvp``, ``torch.func.hessian``), which no gradops op implements; and torch.compile, whose
aot_autograd refuses double backward for every op ("does not currently support double backward"; torch 2.13).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._direct import _functorch_stack


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype the op computes in for these inputs: float64 when any is float64 (the reference in float64, as
    the op's plan routes it), else float32 (CANN's accumulator, also for half inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def partial_vjp(formula: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor],
                grads: Sequence[Tensor | None]) -> tuple[Tensor | None, ...]:
    """``sum_k <grads[k], d formula(*inputs)[k] / d inputs[j]>`` for every j: the partial derivatives, each input
    an independent argument whatever history the inputs share (a gradient penalty's dy depends on x); None where
    an input reaches no graded output. Differentiable with respect to ``inputs`` and ``grads`` when grad mode is
    on (``create_graph``: a third backward).

    Eagerly: ``torch.autograd.grad`` at stand-ins for the inputs: a view of the input when a graph is being built
    and it requires grad (so that the result stays a function of the input), else a detached leaf. A view is a
    node of its own that no other input descends from, so a gradient taken at it counts only the paths through
    this argument. Under a torch.func transform (``jacrev(grad(f))``), where ``requires_grad_`` is refused:
    ``torch.func.vjp``, which differentiates with respect to the arguments and composes with the transform
    (the same derivative, more overhead: on 2 cores a 64 x 128 fp32 Hardswish gradient penalty
    step took 1.5 ms that way against 0.77 ms this way).
    """
    if _functorch_stack is None or _functorch_stack() is not None:
        outputs, vjp = torch.func.vjp(formula, *inputs)
        return vjp(tuple(g if g is not None else torch.zeros_like(o) for o, g in zip(outputs, grads)))
    create = torch.is_grad_enabled()
    with torch.enable_grad():
        stand_ins = [t.view_as(t) if create and t.requires_grad else t.detach().requires_grad_() for t in inputs]
        outputs = formula(*stand_ins)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return (None,) * len(inputs)
        return torch.autograd.grad([o for o, _ in pairs], stand_ins, [g for _, g in pairs], create_graph=create,
                                   allow_unused=True)


def save_inputs(ctx, inputs: tuple, output: object) -> None:
    """setup_context of a backward op differentiated by :func:`partial_vjp`: keep every argument (tensors saved,
    so that autograd's version check guards them)."""
    ctx.save_for_backward(*(a for a in inputs if isinstance(a, Tensor)))


def reference_derivative(formula: Callable[..., Any]) -> tuple[Callable[..., tuple], Callable[..., None]]:
    """``(backward, setup_context)`` for a backward op whose derivative is its reference's: ``formula(*args,
    compute=dtype)`` is the reference on the op's own arguments. Every floating-point tensor argument is
    differentiated (:func:`partial_vjp`); integer tensors (indices, a routing map) and scalars are held as given
    and get no gradient."""

    def setup(ctx, inputs: tuple, output: object) -> None:
        ctx.save_for_backward(*(a if isinstance(a, Tensor) else None for a in inputs))
        ctx.scalars = tuple(None if isinstance(a, Tensor) else a for a in inputs)

    def backward(ctx, *grads: Tensor | None) -> tuple:
        args = [t if t is not None else v for t, v in zip(ctx.saved_tensors, ctx.scalars)]
        live = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.is_floating_point()]

        def at(*values: Tensor) -> tuple:
            full = list(args)
            for i, v in zip(live, values):
                full[i] = v
            out = formula(*full, compute=compute_dtype(*values))
            return out if isinstance(out, tuple) else (out,)

        found = partial_vjp(at, [args[i] for i in live], grads)
        result: list[Tensor | None] = [None] * len(args)
        for i, g in zip(live, found):
            result[i] = g
        return tuple(result)

    return backward, setup
