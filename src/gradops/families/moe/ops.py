"""MoeTokenPermute / MoeTokenPermuteGrad / MoeTokenUnpermute / MoeTokenUnpermuteGrad: torch.library ops, autograd,
and the public functions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...ops._direct import BODY, DirectOp, eager_path, own
from ...ops._double import reference_derivative
from ...ops._out import into
from ...ops._plan import Planner
from . import reference, spec
from .contract import check_restore_shape


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


# What each op's backends take; its results are declared in the contract, beside the check.
def _permute_views(shape, tokens: Tensor, indices: Tensor, num_out_tokens: int | None, padded_mode: bool) -> tuple:
    return tokens, indices, shape.rows


def _permute_grad_views(shape, permuted_output_grad: Tensor, sorted_indices: Tensor, num_topk: int,
                        padded_mode: bool = False) -> tuple:
    return permuted_output_grad, sorted_indices, num_topk


def _unpermute_views(shape, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                     padded_mode: bool = False) -> tuple:
    return permuted_tokens, sorted_indices, probs


def _unpermute_grad_views(shape, permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                          probs: Tensor | None, padded_mode: bool = False) -> tuple:
    return permuted_tokens, grad_unpermuted, sorted_indices, probs


def _permute_grad_2d(fn, shape, permuted_output_grad: Tensor, sorted_indices: Tensor, num_topk: int,
                     padded_mode: bool = False, *, checked: bool = False) -> Tensor:
    """The backend, which tests the indices where it reads them: a permutation of [0, T·K), or with ``checked``
    (the forward's own output, a permutation by construction) only their range, skipping the repeat test that on
    CUDA is a device sort."""
    return own(fn(*_permute_grad_views(shape, permuted_output_grad, sorted_indices, num_topk), trusted=checked))


plan_moe_token_permute_grad = Planner(spec.MOE_TOKEN_PERMUTE_GRAD,
                                      adapter=_permute_grad_2d, program=lambda: _cpu().program_moe_token_permute_grad)


def _moe_token_permute_grad_body(permuted_output_grad: Tensor, sorted_indices: Tensor, num_topk: int,
                                 padded_mode: bool) -> Tensor:
    plan = plan_moe_token_permute_grad(permuted_output_grad, sorted_indices, num_topk, padded_mode)
    return plan.run(plan.shape, permuted_output_grad, sorted_indices, num_topk, padded_mode)


_moe_token_permute_grad = DirectOp(spec.MOE_TOKEN_PERMUTE_GRAD, _moe_token_permute_grad_body,
                                   plan_moe_token_permute_grad)
# Linear in the gradient: its derivative (a second backward of moe_token_permute) is the reference's.
_backward_of, _setup_of = reference_derivative(
    lambda grad, indices, topk, padded_mode, compute: reference.moe_token_permute_grad(grad, indices, topk, compute))
_moe_token_permute_grad.register_autograd(_backward_of, setup_context=_setup_of)


def _permute_2d(fn, shape, tokens: Tensor, indices: Tensor, num_out_tokens: int | None,
                padded_mode: bool) -> tuple[Tensor, Tensor]:
    return own(*fn(*_permute_views(shape, tokens, indices, num_out_tokens, padded_mode)))


plan_moe_token_permute = Planner(spec.MOE_TOKEN_PERMUTE, adapter=_permute_2d,
                                 program=lambda: _cpu().program_moe_token_permute)


def _moe_token_permute_body(tokens: Tensor, indices: Tensor, num_out_tokens: int | None,
                            padded_mode: bool) -> tuple[Tensor, Tensor]:
    plan = plan_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)
    return plan.run(plan.shape, tokens, indices, num_out_tokens, padded_mode)


_moe_token_permute = DirectOp(spec.MOE_TOKEN_PERMUTE, _moe_token_permute_body,
                              plan_moe_token_permute)


def _setup(ctx, inputs, output):
    _, indices, _, _ = inputs
    # int(): under dynamic-shape tracing shape[1] is a SymInt, which the backward's validation (an int
    # attribute of the schema) refuses; K is a model constant, so specialising on it costs no recompiles.
    ctx.topk = int(indices.shape[1]) if indices.dim() == 2 else 1
    ctx.save_for_backward(output[1])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_permuted, _grad_sorted_indices):
    if grad_permuted is None:
        return None, None, None, None
    (sorted_indices,) = ctx.saved_tensors
    if eager_path(grad_permuted, sorted_indices) == BODY:
        # sorted_indices is this op's own forward output, a permutation by construction (autograd's saved-tensor
        # version check refuses it if changed since): no range test, so no host synchronisation on CUDA.
        plan = plan_moe_token_permute_grad(grad_permuted, sorted_indices, ctx.topk, False)
        return plan.run(plan.shape, grad_permuted, sorted_indices, ctx.topk, checked=True), None, None, None
    return _moe_token_permute_grad(grad_permuted, sorted_indices, ctx.topk, False), None, None, None


_moe_token_permute.register_autograd(_backward, setup_context=_setup)


def moe_token_permute(tokens: Tensor, indices: Tensor, num_out_tokens: int | None = None,
                      padded_mode: bool = False, *, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenPermute: group token copies by expert; differentiable w.r.t. tokens.

    Args:
        tokens: (T, H), float16 / bfloat16 / float32, or float64 (beyond CANN's table).
        indices: (T, K) or (T,) expert ids, int32 / int64, 1 <= K <= 512. Ids must be >= 0 (CANN's range): a
            negative one raises OpError 161002 (on CUDA, as for the gradient's sorted_indices, at the next
            gradops launch); ids past every expert (e.g. a routing
            sentinel) are accepted and sort last, so ``num_out_tokens`` can drop them.
        num_out_tokens: keep only the first rows of the permuted order (token dropping); None or 0 keeps all
            T*K, negative values count from the end as in a Python slice.
        padded_mode: must be False (CANN supports only False).
        out: optional preallocated ``(permuted_tokens, sorted_indices)`` (see :mod:`gradops.ops._out`; not
            differentiable).

    Returns:
        ``(permuted_tokens, sorted_indices)``: ``permuted_tokens[sorted_indices[t*K + k]] = tokens[t]``;
        sorted_indices (int32, T*K) is CANN's convention, the INVERSE of Megatron's ``sorted_indices``.
    """
    if out is not None:
        if _moe_token_permute.direct_into(out, tokens, indices, num_out_tokens, padded_mode):  # DirectOp.direct_into
            return tuple(out)
        return into(spec.MOE_TOKEN_PERMUTE, plan_moe_token_permute, ("tokens", "indices"),
                    (tokens, indices, num_out_tokens, padded_mode), out, (0,), views=_permute_views)
    return _moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def moe_token_permute_grad(permuted_output_grad: Tensor, sorted_indices: Tensor, num_topk: int,
                           padded_mode: bool = False, *, out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenPermuteGrad: ``out[t] = sum_{k<K} grad[sorted_indices[t*K + k]]`` (fp32 sum, k order).

    Args:
        permuted_output_grad: (A, H) with A <= T*K rows (fewer when the forward dropped tokens; indices >= A
            then add nothing).
        sorted_indices: (T*K,) int32 (int64 accepted), CANN's convention, a permutation of [0, T*K) (as
            :func:`moe_token_permute` returns): an entry outside it or a repeated one raises OpError 161002
            (on CUDA, where the Triton backend checks without a host synchronisation, at the next gradops
            launch or ``gradops.synchronize()``).
        num_topk: K in [1, 512].
        padded_mode: must be False.
        out: optional preallocated (T, H) in the gradient's dtype to write into (see :mod:`gradops.ops._out`).

    Returns:
        (T, H) in the gradient's dtype.
    """
    if out is not None:
        if _moe_token_permute_grad.direct_into(out, permuted_output_grad, sorted_indices, num_topk, padded_mode):
            return out
        return into(spec.MOE_TOKEN_PERMUTE_GRAD, plan_moe_token_permute_grad,
                    ("permuted_output_grad", "sorted_indices"), (permuted_output_grad, sorted_indices, num_topk,
                                                                 padded_mode), out, views=_permute_grad_views)[0]
    return _moe_token_permute_grad(permuted_output_grad, sorted_indices, num_topk, padded_mode)


# ---------------------------------------------------------------- unpermute
def _unpermute_2d(fn, shape, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                  padded_mode: bool = False) -> Tensor:
    return own(fn(*_unpermute_views(shape, permuted_tokens, sorted_indices, probs)))  # it checks the permutation


plan_moe_token_unpermute = Planner(spec.MOE_TOKEN_UNPERMUTE, adapter=_unpermute_2d,
                                   program=lambda: _cpu().program_moe_token_unpermute)


def _moe_token_unpermute_body(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                              padded_mode: bool) -> Tensor:
    plan = plan_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)
    return plan.run(plan.shape, permuted_tokens, sorted_indices, probs, padded_mode)


_moe_token_unpermute = DirectOp(spec.MOE_TOKEN_UNPERMUTE, _moe_token_unpermute_body,
                                plan_moe_token_unpermute)


def _moe_token_unpermute_grad_body(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                                   probs: Tensor | None, padded_mode: bool) -> tuple[Tensor, Tensor]:
    plan = plan_moe_token_unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode)
    return plan.run(plan.shape, permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode)


def _unpermute_grad_2d(fn, shape, permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                       probs: Tensor | None, padded_mode: bool = False, *, trusted: bool = False
                       ) -> tuple[Tensor, Tensor]:
    """The backend; ``trusted``: sorted_indices is a permutation its forward checked (the backend skips its test)."""
    return own(*fn(*_unpermute_grad_views(shape, permuted_tokens, grad_unpermuted, sorted_indices, probs),
                   trusted=trusted))


plan_moe_token_unpermute_grad = Planner(spec.MOE_TOKEN_UNPERMUTE_GRAD,
                                        adapter=_unpermute_grad_2d,
                                        program=lambda: _cpu().program_moe_token_unpermute_grad)


_moe_token_unpermute_grad = DirectOp(spec.MOE_TOKEN_UNPERMUTE_GRAD, _moe_token_unpermute_grad_body,
                                     plan_moe_token_unpermute_grad)
# Linear in the gradient and in each of permuted_tokens and probs: the derivative is the reference's.
_backward_of, _setup_of = reference_derivative(
    lambda permuted, grad, indices, probs, padded_mode, compute:
    reference.moe_token_unpermute_grad(permuted, grad, indices, probs, compute))
_moe_token_unpermute_grad.register_autograd(_backward_of, setup_context=_setup_of)


def _unpermute_setup(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, _ = inputs
    # Save only what the backward reads: permuted_tokens feeds grad_probs alone, so without probs it is not kept
    # alive until the backward (A·H elements of activation memory; torch_npu's test asserts the same).
    ctx.save_for_backward(permuted_tokens if probs is not None else None, sorted_indices, probs)
    ctx.permuted = (permuted_tokens.shape, permuted_tokens.dtype, permuted_tokens.device)
    ctx.set_materialize_grads(False)


def _unpermute_backward(ctx, grad):
    if grad is None:
        return None, None, None, None
    permuted_tokens, sorted_indices, probs = ctx.saved_tensors
    if permuted_tokens is None:
        # The backends take permuted_tokens for its shape and dtype only when there are no probs (its values are
        # never read): an uninitialised stand-in, untouched, costs an allocation and no traffic.
        shape, dtype, device = ctx.permuted
        permuted_tokens = torch.empty(shape, dtype=dtype, device=device)
    # Tested again (a permutation of [0, T·K)), as every node that addresses memory with a saved index: autograd's
    # version counter misses a change through a numpy view or ``.data``, and a repeated entry would leave a row of
    # grad_permuted unwritten (uninitialised memory, 2.5e33 and pointer bits, when this node trusted the forward's
    # test). The test is a bitmap pass over T·K entries on the CPU, a device sort without a host synchronisation on
    # CUDA.
    d_permuted, d_probs = _moe_token_unpermute_grad(permuted_tokens, grad, sorted_indices, probs, False)
    return d_permuted, None, d_probs if probs is not None else None, None


_moe_token_unpermute.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None,
                        padded_mode: bool = False, restore_shape: Sequence[int] | None = None, *,
                        out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenUnpermute: merge each token's K expert outputs, weighted by its routing probabilities::

        out[t] = sum_{k<K} probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]     (fp32, k order)

    The inverse of :func:`moe_token_permute`; differentiable w.r.t. permuted_tokens and probs (the backward is
    :func:`moe_token_unpermute_grad`).

    Args:
        permuted_tokens: (A, H) float16 / bfloat16 / float32 (or float64), A <= T*K (fewer when the permute
            dropped tokens: indices >= A then add nothing).
        sorted_indices: (T*K,) int32 (int64 accepted), CANN's convention (as :func:`moe_token_permute` returns),
            a permutation of [0, T*K): an entry outside it or a repeated one raises OpError 161002 before
            anything is read with it.
        probs: (T, K) float16 / bfloat16 / float32 (or float64) routing weights, or None: then K = 1 and the
            result is the plain inverse gather.
        padded_mode: must be False (CANN supports only False). restore_shape: read by CANN only in padded
            mode; None or a sequence of ints, ignored.
        out: optional preallocated (T, H) in permuted_tokens' dtype (see :mod:`gradops.ops._out`; not
            differentiable).

    Returns:
        (T, H) in permuted_tokens' dtype.
    """
    if restore_shape is not None:
        check_restore_shape("moe_token_unpermute", restore_shape)
    if out is not None:
        if _moe_token_unpermute.direct_into(out, permuted_tokens, sorted_indices, probs, padded_mode):
            return out
        return into(spec.MOE_TOKEN_UNPERMUTE, plan_moe_token_unpermute,
                    ("permuted_tokens", "sorted_indices", "probs"), (permuted_tokens, sorted_indices, probs,
                                                                     padded_mode), out, (0, 2),
                    views=_unpermute_views)[0]
    return _moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode)


def moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                             probs: Tensor | None = None, padded_mode: bool = False,
                             restore_shape: Sequence[int] | None = None, *,
                             out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteGrad: the gradients of :func:`moe_token_unpermute`, in fp32 then rounded once::

        grad_permuted[sorted_indices[i]] = grad_unpermuted[i // K] * probs.flat[i]          (rows < A)
        grad_probs[t, k] = sum_h grad_unpermuted[t, h] * permuted_tokens[sorted_indices[t*K + k], h]  (0 if dropped)

    Args:
        permuted_tokens: the forward's (A, H) input. grad_unpermuted: (T, H), float16 / bfloat16 / float32 / float64.
        sorted_indices: (T*K,) as for :func:`moe_token_unpermute` (a permutation of [0, T*K), else 161002).
        probs: the forward's (T, K) probs, or None (K = 1, weight 1).
        padded_mode: must be False. restore_shape: None or ints, ignored (as in the forward).
        out: optional preallocated ``(grad_permuted, grad_probs)``; without probs the second must be an empty
            (0,) tensor of permuted_tokens' dtype.

    Returns:
        ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, K) in probs' dtype)``; without probs
        the second is an empty (0,) tensor of permuted_tokens' dtype (torch_npu's schema returns two tensors).
    """
    if restore_shape is not None:
        check_restore_shape("moe_token_unpermute_grad", restore_shape)
    if out is not None:
        if _moe_token_unpermute_grad.direct_into(out, permuted_tokens, grad_unpermuted, sorted_indices, probs,
                                                 padded_mode):
            return tuple(out)
        return into(spec.MOE_TOKEN_UNPERMUTE_GRAD, plan_moe_token_unpermute_grad,
                    ("permuted_tokens", "grad_unpermuted", "sorted_indices", "probs"),
                    (permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode), out,
                    views=_unpermute_grad_views)
    return _moe_token_unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode)
