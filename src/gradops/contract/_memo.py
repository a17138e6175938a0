"""The key of a call's argument metadata: what every ``check_*`` of the validation tables reads.

Every check reads metadata only (:mod:`gradops.contract._common`): each tensor's type, layout, shape, dtype and
device, and each scalar's type and value. Its answer - the shape (rows, columns, result shapes) or a refusal - is a
function of that metadata, so an op's call plan (:class:`gradops.ops._plan.Planner`) remembers it under
:func:`key_of`. Measured on the 2-core CI machine at 8 x 8 fp32: ``check_rms_norm_grad`` 13-25 µs, a remembered
answer 2-3 µs (the key: four tensors' shape, dtype and device).

What has no key, so the check runs in full each time: an argument that is not a plain tensor (a subclass or fake
tensor has its own metadata rules), a tensor that is not strided (sparse), a tensor whose storage was freed or
shrunk (:data:`gradops.contract._common.hollow`: a plan depends on metadata only, so this is asked on every call),
or a value other than None, bool, int, float, str and a list or tuple of ints (a shape) or of bools (a mask). A
float NaN never equals itself, so a NaN epsilon always misses (and is checked).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _common

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SCALARS = (type(None), bool, int, float, str)
_SEQUENCES = (list, tuple)
_STRIDED = torch.strided
#: Plans kept per op. A training run uses a handful of shapes per op; a sweep over many shapes starts over
#: when the table is full (a clear is cheaper than an LRU's bookkeeping on every hit).
LIMIT = 256


def remembered(table: dict, key: object, make: Callable[[], Any]) -> Any:
    """``table[key]``, made by ``make()`` the first time (a refusal ``make`` raises is never remembered); the table
    starts over when it holds :data:`LIMIT` entries."""
    hit = table.get(key)
    if hit is None:
        hit = make()
        if len(table) >= LIMIT:
            table.clear()
        table[key] = hit
    return hit


def key_of(args: tuple, strides: bool = False) -> tuple | None:
    """The metadata a check reads from ``args``, or None when some argument is not plain (see the module doc).
    ``strides``: each tensor's strides too, for the CANN-strict checks (which refuse non-contiguous inputs and
    outputs whose elements share memory)."""
    key = []
    for a in args:
        kind = type(a)
        if kind in _PLAIN_TENSORS:
            if a.layout is not _STRIDED or _common.hollow(a):
                return None
            key.append((a.shape, a.dtype, a.device, a.stride()) if strides else (a.shape, a.dtype, a.device))
        elif kind in _SCALARS:
            key.append((kind, a))
        elif kind in _SEQUENCES and all(type(v) is int for v in a):  # a shape argument (restore_shape)
            key.append((kind, tuple(a)))
        elif kind in _SEQUENCES and a and all(type(v) is bool for v in a):  # a mask (outputMask): not ints
            key.append((kind, bool, tuple(a)))
        else:
            return None
    return tuple(key)
