"""DTensor sharding rules for every gradops op, so that sequence- and tensor-parallel models run gradops modules.

A custom op that meets a DTensor needs a rule saying which input placements it accepts and what its outputs' are
(``torch.distributed.tensor.experimental.register_sharding``); without one DTensor refuses the op. The rules:

- norms and their gradients: sharded over any row (leading) dim, replicated over the normalised dims; the
  statistics follow the rows; dgamma / dbeta (and LayerNormGradBeta's sums) are ``Partial`` sums over the ranks'
  rows (float32 for the fused backwards; LayerNormGradBeta's are in the input dtype, so a sharded half sum rounds
  per rank before the reduction).
- hardswish and its backward: elementwise, any dim.
- embedding lookup: tokens sharded (indices and result alike) or columns sharded (table dim 1, result's last
  dim); its dense backward: columns sharded (as ATen's rule), or tokens sharded into a ``Partial`` table when
  ``scale_grad_by_freq`` is off (the frequency needs every rank's indices).
- MoE permute family: the hidden dim sharded, indices and probs replicated (each rank permutes its columns);
  the unpermute gradient's ``grad_probs`` is then a ``Partial`` sum over hidden slices.
- everything replicated, always.

Importing ``torch.distributed.tensor`` costs ~1 s, so gradops does not: :func:`ensure_registered` runs on the eager
op path (the only path a DTensor takes, see :mod:`gradops.ops._direct`) and registers the rules the first time it
finds DTensor loaded; :func:`register` does it unconditionally, and ``import gradops.distributed`` calls it (for a
DTensor model whose first gradops call is inside ``torch.compile``, where the registration cannot be traced).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from .._compat import lookup

_registered = False
#: Why the rules are not registered on this torch (None while they can be): DTensor then refuses gradops' ops, as
#: it refuses any custom op without a rule.
UNAVAILABLE: str | None = None


def ensure_registered() -> None:
    """Register the rules if DTensor is loaded and they are not yet (a dict lookup otherwise)."""
    if not _registered and "torch.distributed.tensor" in sys.modules:
        register()


def register() -> None:
    """Register every rule with DTensor (idempotent)."""
    global _registered, UNAVAILABLE
    if _registered:
        return
    try:  # public since torch 2.5; a torch without it (or without distributed) runs gradops without the rules
        from torch.distributed.tensor import Partial, Replicate, Shard

        importlib.import_module("torch.distributed.tensor.experimental")  # for the lookup below
    except ImportError as err:
        _registered, UNAVAILABLE = True, f"this torch {torch.__version__} lacks DTensor ({err})"
        return
    register_sharding = lookup("torch.distributed.tensor.experimental.register_sharding")
    if register_sharding is None:
        _registered, UNAVAILABLE = True, f"this torch {torch.__version__} lacks DTensor's register_sharding"
        return

    R, P = Replicate(), Partial()
    ops = torch.ops.gradops

    def rule(op: Any) -> Callable[[Callable[..., list]], Callable[..., list]]:
        return register_sharding(op.default)

    def rows(x: Any, stat: Any, normalised: int) -> range:
        """Row dims a norm may be sharded over: leading dims of x that the statistic also has."""
        return range(min(x.ndim - normalised, stat.ndim))

    @rule(ops.rms_norm)
    def _(x, gamma, epsilon):
        return [([R, R], [R, R, None])] + [([Shard(d), Shard(d)], [Shard(d), R, None])
                                          for d in range(x.ndim - gamma.ndim)]

    @rule(ops.rms_norm_grad)
    def _(dy, x, rstd, gamma):
        return [([R, R], [R, R, R, R])] + [([Shard(d), P], [Shard(d), Shard(d), Shard(d), R])
                                          for d in rows(x, rstd, gamma.ndim)]

    @rule(ops.layer_norm)
    def _(x, gamma, beta, epsilon):
        return [([R, R, R], [R, R, R, None])] + [([Shard(d)] * 3, [Shard(d), R, R, None])
                                                for d in range(x.ndim - gamma.ndim)]

    @rule(ops.layer_norm_backward)
    def _(dy, x, mean, rstd, gamma):
        return [([R, R, R], [R] * 5)] + [([Shard(d), P, P], [Shard(d)] * 4 + [R])
                                        for d in rows(x, mean, gamma.ndim)]

    @rule(ops.layer_norm_grad)
    def _(dy, x, variance, mean, gamma, epsilon):
        return [([R, R], [R] * 5 + [None])] + [([Shard(d), Shard(d)], [Shard(d)] * 4 + [R, None])
                                              for d in rows(x, variance, gamma.ndim)]

    @rule(ops.layer_norm_grad_beta)
    def _(res_for_gamma, dy):
        return [([R, R], [R, R])] + [([P, P], [Shard(d), Shard(d)]) for d in range(dy.ndim - 1)]

    @rule(ops.hardswish)
    def _(x):
        return [([R], [R])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim)]

    @rule(ops.hardswish_backward)
    def _(grad_output, x):
        return [([R], [R, R])] + [([Shard(d)], [Shard(d), Shard(d)]) for d in range(x.ndim)]

    @rule(ops.embedding)
    def _(weight, indices, padding_idx, scale_grad_by_freq):
        tokens = [([Shard(d)], [R, Shard(d), None, None]) for d in range(indices.ndim)]
        return [([R], [R, R, None, None]), ([Shard(indices.ndim)], [Shard(1), R, None, None]), *tokens]

    @rule(ops.embedding_dense_backward)
    def _(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
        found = [([R], [R, R, None, None, None]), ([Shard(1)], [Shard(grad.ndim - 1), R, None, None, None])]
        if not scale_grad_by_freq and grad.ndim == indices.ndim + 1:
            found += [([P], [Shard(d), Shard(d), None, None, None]) for d in range(indices.ndim)]
        return found

    @rule(ops.moe_token_permute)
    def _(tokens, indices, num_out_tokens, padded_mode):
        return [([R, R], [R, R, None, None]), ([Shard(1), R], [Shard(1), R, None, None])]

    @rule(ops.moe_token_permute_grad)
    def _(permuted_output_grad, sorted_indices, num_topk, padded_mode):
        return [([R], [R, R, None, None]), ([Shard(1)], [Shard(1), R, None, None])]

    @rule(ops.moe_token_unpermute)
    def _(permuted_tokens, sorted_indices, probs, padded_mode):
        p = None if probs is None else R
        return [([R], [R, R, p, None]), ([Shard(1)], [Shard(1), R, p, None])]

    @rule(ops.moe_token_unpermute_grad)
    def _(permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode):
        if probs is None:  # the second result is an empty (0,) placeholder on every rank
            return [([R, R], [R, R, R, None, None]), ([Shard(1), R], [Shard(1), Shard(1), R, None, None])]
        return [([R, R], [R, R, R, R, None]), ([Shard(1), P], [Shard(1), Shard(1), R, R, None])]

    _registered = True
