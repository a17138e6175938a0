"""Checks remembered per argument metadata: after the first call, a check costs one key and one dict lookup.

Every ``check_*`` of the validation tables reads metadata only (:mod:`gradops.contract._common`): each
tensor's type, layout, shape, dtype and device, and each scalar's type and value. Its answer - the plan
(rows, columns, result shapes) or a refusal - is a function of that metadata, so :func:`remembered` keeps the
plans of the shapes a program uses. Measured on the 2-core CI machine at 8 x 8 fp32: ``check_rms_norm_grad``
13-25 µs, its remembered form 2-3 µs (the key: four tensors' shape, dtype and device).

What is never remembered, so the check runs in full each time: a refusal (an OpError is raised afresh, with
the message of the arguments at hand); an argument that is not a plain tensor (a subclass or fake tensor has
its own metadata rules), a tensor that is not strided (sparse), a tensor whose storage was freed or shrunk
(:data:`gradops.contract._common.hollow`: a plan depends on metadata only, so this is asked on every call), or a
value other than None, bool, int, float, str and a list or tuple of ints (a shape); keyword arguments. A float
NaN never equals itself, so a NaN epsilon always misses (and is checked).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TypeVar

import torch

from .._compat import is_compiling
from . import _common

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (type(None), bool, int, float, str)
_SEQUENCES = (list, tuple)
_STRIDED = torch.strided
#: Plans kept per check. A training run uses a handful of shapes per op; a sweep over many shapes starts over
#: when the table is full (a clear is cheaper than an LRU's bookkeeping on every hit).
LIMIT = 256

T = TypeVar("T")


def key_of(args: tuple) -> tuple | None:
    """The metadata a check reads from ``args``, or None when some argument is not plain (see the module doc)."""
    key = []
    for a in args:
        kind = type(a)
        if kind in _PLAIN_TENSORS:
            if a.layout is not _STRIDED or _common.hollow(a):
                return None
            key.append((a.shape, a.dtype, a.device))
        elif kind in _SCALARS:
            key.append((kind, a))
        elif kind in _SEQUENCES and all(type(v) is int for v in a):  # a shape argument (restore_shape)
            key.append((kind, tuple(a)))
        else:
            return None
    return tuple(key)


def remembered(check: Callable[..., T]) -> Callable[..., T]:
    """``check`` (positional arguments only) with its plans remembered per argument metadata."""
    plans: dict[tuple, object] = {}

    @wraps(check)
    def call(*args: object) -> T:
        if is_compiling():
            # Traced by dynamo: the table is mutable state, and a guard on it recompiles the model once it grows.
            return check(*args)
        key = key_of(args)
        if key is None:
            return check(*args)
        try:
            return plans[key]  # type: ignore[return-value]
        except KeyError:
            pass
        plan = check(*args)  # a refusal raises here: never stored
        if len(plans) >= LIMIT:
            plans.clear()
        plans[key] = plan
        return plan

    call.forget = plans.clear  # type: ignore[attr-defined]
    return call
