"""DTensor sharding rules for every gradops op, so that sequence- and tensor-parallel models run gradops modules.
Each op declares its rule (:attr:`gradops.spec.OpSpec.sharding`); this module registers them.

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

import torch

from .._compat import lookup
from ..registry import SPECS

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
    for spec in SPECS:  # each op declares its rule (its family's spec.py)
        if spec.sharding is not None:
            register_sharding(getattr(torch.ops.gradops, spec.name).default)(spec.sharding(R, P, Shard))
    _registered = True
