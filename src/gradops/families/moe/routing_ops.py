"""The routing-map MoE ops (aclnnMoeTokenPermuteWithRoutingMap, aclnnMoeTokenUnpermuteWithRoutingMap and their
gradients): torch.library ops, autograd and the public functions.

Each body runs its call plan (:mod:`gradops.ops._plan`: the contract's check, the backend for the device); every
backend runs the op as a slot table plus its permute-family kernels (:mod:`gradops.families.moe.routing_reference`),
so the results are the same on every path up to the kernels' own float32 rounding, with no atomics.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...ops._direct import DirectOp, own
from ...ops._double import reference_derivative
from ...ops._out import into
from ...ops._plan import Planner
from . import routing_reference as reference
from . import routing_spec as spec


def _cpu():
    """The family's CPU host entries, where the programs live: loaded once a plan chose the compiled CPU
    kernels."""
    from . import cpu

    return cpu


def _run(fn, shape, *args):
    """The backend's function on the op's own arguments (it takes them as they are: no 2-D views to make)."""
    return own(*fn(*args))


plan_moe_token_permute_with_routing_map = Planner(
    spec.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP, adapter=_run,
    program=lambda: _cpu().program_moe_token_permute_with_routing_map)
plan_moe_token_permute_with_routing_map_grad = Planner(
    spec.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD,
    adapter=_run, program=lambda: _cpu().program_moe_token_permute_with_routing_map_grad)
plan_moe_token_unpermute_with_routing_map = Planner(
    spec.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP,
    adapter=lambda fn, shape, *args: own(fn(*args)),
    program=lambda: _cpu().program_moe_token_unpermute_with_routing_map)
plan_moe_token_unpermute_with_routing_map_grad = Planner(
    spec.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD,
    adapter=_run, program=lambda: _cpu().program_moe_token_unpermute_with_routing_map_grad)


# ---------------------------------------------------------------- permute
def _moe_token_permute_with_routing_map_body(tokens: Tensor, routing_map: Tensor, probs: Tensor | None,
                                             num_out_tokens: int | None, drop_and_pad: bool
                                             ) -> tuple[Tensor, Tensor, Tensor]:
    plan = plan_moe_token_permute_with_routing_map(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    return plan.run(plan.shape, tokens, routing_map, probs, num_out_tokens, drop_and_pad)


_moe_token_permute_with_routing_map = DirectOp(
    spec.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP, _moe_token_permute_with_routing_map_body,
    plan_moe_token_permute_with_routing_map)


def _permute_setup(ctx, inputs, output):
    tokens, routing_map, probs, _, drop_and_pad = inputs
    ctx.save_for_backward(output[2], routing_map)
    # T stays symbolic under dynamic-shape tracing (the gradient's num_tokens takes a SymInt); E is a model
    # constant: int() specialises on it at no cost in recompiles.
    ctx.shape = (tuple(tokens.shape), tokens.dtype, int(routing_map.shape[1]), drop_and_pad, probs is not None)
    ctx.set_materialize_grads(False)


def _permute_backward(ctx, grad_tokens, grad_probs, _grad_indices):
    sorted_indices, routing_map = ctx.saved_tensors
    (tokens, hidden), dtype, experts, drop_and_pad, has_probs = ctx.shape
    if grad_tokens is None and grad_probs is None:
        return None, None, None, None, None
    if grad_tokens is None:  # only permuted_probs was used: the rows' gradient is zero
        grad_tokens = torch.zeros((grad_probs.shape[0], hidden), dtype=dtype, device=grad_probs.device)
    dtokens, dprobs = _moe_token_permute_with_routing_map_grad(grad_tokens, grad_probs if has_probs else None,
                                                               sorted_indices, routing_map, experts, tokens,
                                                               drop_and_pad)
    return dtokens, None, dprobs if has_probs and grad_probs is not None else None, None, None


_moe_token_permute_with_routing_map.register_autograd(_permute_backward, setup_context=_permute_setup)


def _moe_token_permute_with_routing_map_grad_body(permuted_tokens_grad: Tensor, permuted_probs_grad: Tensor | None,
                                                  sorted_indices: Tensor, routing_map: Tensor | None,
                                                  num_experts: int, num_tokens: int, drop_and_pad: bool
                                                  ) -> tuple[Tensor, Tensor]:
    args = (permuted_tokens_grad, permuted_probs_grad, sorted_indices, routing_map, num_experts, num_tokens,
            drop_and_pad)
    plan = plan_moe_token_permute_with_routing_map_grad(*args)
    return plan.run(plan.shape, *args)


_moe_token_permute_with_routing_map_grad = DirectOp(
    spec.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD, _moe_token_permute_with_routing_map_grad_body,
    plan_moe_token_permute_with_routing_map_grad)
_backward_of, _setup_of = reference_derivative(reference.moe_token_permute_with_routing_map_grad)
_moe_token_permute_with_routing_map_grad.register_autograd(_backward_of, setup_context=_setup_of)


# ---------------------------------------------------------------- unpermute
def _moe_token_unpermute_with_routing_map_body(permuted_tokens: Tensor, sorted_indices: Tensor,
                                               restore_shape: list[int], probs: Tensor | None,
                                               routing_map: Tensor | None, drop_and_pad: bool) -> Tensor:
    args = (permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad)
    plan = plan_moe_token_unpermute_with_routing_map(*args)
    return plan.run(plan.shape, *args)


_moe_token_unpermute_with_routing_map = DirectOp(
    spec.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP, _moe_token_unpermute_with_routing_map_body,
    plan_moe_token_unpermute_with_routing_map)


def _unpermute_setup(ctx, inputs, output):
    permuted_tokens, sorted_indices, _, probs, routing_map, drop_and_pad = inputs
    # permuted_tokens feeds only the probs' gradient: without probs it is not kept alive for the backward.
    ctx.save_for_backward(permuted_tokens if probs is not None else None, sorted_indices, probs, routing_map)
    ctx.permuted = (permuted_tokens.shape, permuted_tokens.dtype, permuted_tokens.device, drop_and_pad)
    ctx.set_materialize_grads(False)


def _unpermute_backward(ctx, grad):
    if grad is None:
        return None, None, None, None, None, None
    permuted_tokens, sorted_indices, probs, routing_map = ctx.saved_tensors
    shape, dtype, device, drop_and_pad = ctx.permuted
    if permuted_tokens is None:  # read for its shape and dtype only (no probs): an untouched stand-in
        permuted_tokens = torch.empty(shape, dtype=dtype, device=device)
    dpermuted, dprobs = _moe_token_unpermute_with_routing_map_grad(permuted_tokens, grad, sorted_indices, probs,
                                                                   routing_map, drop_and_pad)
    return dpermuted, None, None, dprobs if probs is not None else None, None, None


_moe_token_unpermute_with_routing_map.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def _moe_token_unpermute_with_routing_map_grad_body(permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                                    sorted_indices: Tensor, probs: Tensor | None,
                                                    routing_map: Tensor | None, drop_and_pad: bool
                                                    ) -> tuple[Tensor, Tensor]:
    args = (permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad)
    plan = plan_moe_token_unpermute_with_routing_map_grad(*args)
    return plan.run(plan.shape, *args)


_moe_token_unpermute_with_routing_map_grad = DirectOp(
    spec.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD, _moe_token_unpermute_with_routing_map_grad_body,
    plan_moe_token_unpermute_with_routing_map_grad)
_backward_of, _setup_of = reference_derivative(reference.moe_token_unpermute_with_routing_map_grad)
_moe_token_unpermute_with_routing_map_grad.register_autograd(_backward_of, setup_context=_setup_of)


# ---------------------------------------------------------------- public functions
def moe_token_permute_with_routing_map(tokens: Tensor, routing_map: Tensor, probs: Tensor | None = None,
                                       num_out_tokens: int | None = None, drop_and_pad: bool = False, *,
                                       out: tuple[Tensor, Tensor, Tensor] | None = None
                                       ) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMap: group token copies by expert from a (T, E) routing map;
    differentiable w.r.t. tokens and probs.

    Args:
        tokens: (T, H) float16 / bfloat16 / float32 (or float64).
        routing_map: (T, E) bool or int8, nonzero where token t goes to expert e.
        probs: optional (T, E) routing weights (any float dtype; float32 beside half tokens is common).
        num_out_tokens: without drop_and_pad K·T (K = num_out_tokens // T slots per token; None: T, so K = 1); with
            drop_and_pad C·E (C = num_out_tokens // E rows per expert, in [1, T]). At most T·E.
        drop_and_pad: Megatron's capacity mode (see below).
        out: optional preallocated ``(permuted_tokens, permuted_probs, sorted_indices)`` (see
            :mod:`gradops.ops._out`; not differentiable); without probs the second is an empty (0,) tensor of
            tokens' dtype.

    Returns:
        ``(permuted_tokens (A, H), permuted_probs (A,), sorted_indices int32)``; without probs permuted_probs is an
        empty (0,) tensor of tokens' dtype (gradops' placeholder, as for :func:`moe_token_unpermute_grad`;
        :func:`gradops.npu_compat.npu_moe_token_permute_with_routing_map` gives None, as torch_npu does).

        Without drop_and_pad, A = K·T: the routed (t, e) pairs in expert-major order, tokens ascending within an
        expert, fill rows [0, M); rows [M, A) are zeros (CANN leaves them unwritten). ``sorted_indices`` (T·K,) is
        CANN's convention, the row of each (token, k) slot (k: the token's k-th routed expert, ascending), -1 for
        the slots of a token routed to fewer than K experts. A token routed to more than K experts raises OpError
        161002.

        With drop_and_pad, A = C·E: expert e's rows [e·C, (e+1)·C) hold its routed tokens in ascending order,
        the C lowest when it has more (the rest are dropped), padded with the lowest tokens not routed to it
        when it has fewer; ``sorted_indices`` (C·E,) is the token of each row (Megatron's convention) and
        ``permuted_probs[r] = probs[sorted_indices[r], r // C]``, padding rows included.
    """
    args = (tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    if out is not None:
        if _moe_token_permute_with_routing_map.direct_into(out, *args):  # DirectOp.direct_into
            return tuple(out)
        written = into(spec.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP, plan_moe_token_permute_with_routing_map,
                       ("tokens", "routing_map", "probs"), args, out, differentiable=(0, 2))
        return written
    return _moe_token_permute_with_routing_map(*args)


def moe_token_permute_with_routing_map_grad(permuted_tokens_grad: Tensor, permuted_probs_grad: Tensor | None,
                                            sorted_indices: Tensor, routing_map: Tensor | None, num_experts: int,
                                            num_tokens: int, drop_and_pad: bool = False, *,
                                            out: tuple[Tensor, Tensor] | None = None
                                            ) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMapGrad: the gradients of :func:`moe_token_permute_with_routing_map`.

    Args:
        permuted_tokens_grad: (A, H), the permuted rows' gradient.
        permuted_probs_grad: (A,) the permuted probs' gradient, or None.
        sorted_indices: the forward's (its convention per mode; int32, int64 accepted).
        routing_map: the forward's (T, E) map; needed for the probs' gradient without drop_and_pad.
        num_experts: E. num_tokens: T. drop_and_pad: the forward's mode.
        out: optional preallocated ``(tokens_grad, probs_grad)``; without permuted_probs_grad the second is an
            empty (0,) tensor of the gradient's dtype.

    Returns:
        ``(tokens_grad (T, H) in permuted_tokens_grad's dtype, probs_grad (T, E) in permuted_probs_grad's dtype)``,
        without permuted_probs_grad an empty (0,) tensor of the gradient's dtype. ``tokens_grad[t]`` sums the rows
        holding token t (fp32, in slot order); ``probs_grad`` holds each row's gradient at its (token, expert)
        pair, zeros elsewhere.
    """
    args = (permuted_tokens_grad, permuted_probs_grad, sorted_indices, routing_map, num_experts, num_tokens,
            drop_and_pad)
    if out is not None:
        if _moe_token_permute_with_routing_map_grad.direct_into(out, *args):
            return tuple(out)
        return into(spec.MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD, plan_moe_token_permute_with_routing_map_grad,
                    ("permuted_tokens_grad", "permuted_probs_grad", "sorted_indices", "routing_map"), args, out)
    return _moe_token_permute_with_routing_map_grad(*args)


def moe_token_unpermute_with_routing_map(permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape: Sequence[int],
                                         probs: Tensor | None = None, routing_map: Tensor | None = None,
                                         drop_and_pad: bool = False, *, out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenUnpermuteWithRoutingMap: merge each token's expert outputs back into (T, H); differentiable
    w.r.t. permuted_tokens and probs.

    Args:
        permuted_tokens: (A, H) float16 / bfloat16 / float32 (or float64).
        sorted_indices: the permute's (int32, int64 accepted).
        restore_shape: (T, H) of the result.
        probs: optional (T, E) weights. routing_map: the permute's (T, E) map; needed with probs without
            drop_and_pad (it says each slot's expert).
        drop_and_pad: the permute's mode.
        out: optional preallocated (T, H) in permuted_tokens' dtype (not differentiable).

    Returns:
        (T, H) in permuted_tokens' dtype. Without drop_and_pad ``out[t] = sum_k w[t, k] *
        permuted_tokens[sorted_indices[t*K + k]]`` over the slots that are not -1, ``w[t, k] = probs[t, e_k]`` (e_k:
        the token's k-th routed expert) or 1; with drop_and_pad every row r adds ``w_r * permuted_tokens[r]`` to
        its token ``sorted_indices[r]``, ``w_r = probs[sorted_indices[r], r // C]`` or 1. Summed in fp32 in slot
        (then row) order, rounded once.
    """
    shape = list(restore_shape) if isinstance(restore_shape, (list, tuple, torch.Size)) else restore_shape  # int[]
    args = (permuted_tokens, sorted_indices, shape, probs, routing_map, drop_and_pad)
    if out is not None:
        if _moe_token_unpermute_with_routing_map.direct_into(out, *args):
            return out
        return into(spec.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP, plan_moe_token_unpermute_with_routing_map,
                    ("permuted_tokens", "sorted_indices", "restore_shape", "probs", "routing_map"), args, out,
                    differentiable=(0, 3))[0]
    return _moe_token_unpermute_with_routing_map(*args)


def moe_token_unpermute_with_routing_map_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                              sorted_indices: Tensor, probs: Tensor | None = None,
                                              routing_map: Tensor | None = None, drop_and_pad: bool = False, *,
                                              out: tuple[Tensor, Tensor] | None = None
                                              ) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteWithRoutingMapGrad: the gradients of :func:`moe_token_unpermute_with_routing_map`.

    Returns:
        ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, E) in probs' dtype; without probs an
        empty (0,) tensor of permuted_tokens' dtype)``. ``grad_permuted[row] = w * grad_unpermuted[token]`` for
        each row a slot names (zeros for the rest), ``grad_probs[t, e] = <grad_unpermuted[t],
        permuted_tokens[row]>`` for the pair's row (fp32), zeros for pairs without one. permuted_tokens' values are
        read only with probs. ``out``: optional preallocated pair; without probs the second is an empty (0,) tensor
        of permuted_tokens' dtype.
    """
    args = (permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad)
    if out is not None:
        if _moe_token_unpermute_with_routing_map_grad.direct_into(out, *args):
            return tuple(out)
        return into(spec.MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD, plan_moe_token_unpermute_with_routing_map_grad,
                    ("permuted_tokens", "grad_unpermuted", "sorted_indices", "probs", "routing_map"), args, out)
    return _moe_token_unpermute_with_routing_map_grad(*args)
