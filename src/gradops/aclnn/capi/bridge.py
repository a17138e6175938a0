"""What libnnopbase.so reads from Python when it starts (its C half: bridge.cpp): the operators' phases by CANN name,
the aclDataType -> torch dtype table, and the function that makes a tensor over the caller's memory.

Nothing here validates or computes: the phases are :mod:`gradops.aclnn`'s, unchanged.
"""

from __future__ import annotations

import ctypes

import torch

from ...native import kernels
from .. import C_API, aclDestroyAclOpExecutor, aclGetRecentErrMsg, aclSetAclOpExecutorRepeatable

#: ``{CANN name: (phase 1, phase 2, C parameter list)}``: the C layer holds each operator to the parameter list it
#: was compiled from.
ENTRIES = {f.name: (f.phase1, f.phase2, f.signature) for f in C_API}

#: aclDataType codes (CANN's acl_base.h) -> torch dtypes; None where torch has no such dtype (ACL_STRING, ACL_INT4,
#: ACL_UINT1, the gaps). Indexed by the code.
_CODES = {0: torch.float32, 1: torch.float16, 2: torch.int8, 3: torch.int32, 4: torch.uint8, 6: torch.int16,
          7: torch.uint16, 8: torch.uint32, 9: torch.int64, 10: torch.uint64, 11: torch.float64, 12: torch.bool,
          16: torch.complex64, 17: torch.complex128, 27: torch.bfloat16, 33: torch.complex32}
DTYPES = tuple(_CODES.get(code) for code in range(max(_CODES) + 1))
BYTE = torch.uint8

message = aclGetRecentErrMsg
destroy = aclDestroyAclOpExecutor
repeatable = aclSetAclOpExecutorRepeatable


def _from_address_python(address: int, dtype: torch.dtype, sizes: tuple, strides: tuple, offset: int) -> torch.Tensor:
    """:func:`from_address` without the native extension (~10x slower): a byte buffer over the span the view
    reaches, reinterpreted and strided."""
    size = torch.empty((), dtype=dtype).element_size()
    if any(s == 0 for s in sizes):
        return torch.empty(sizes, dtype=dtype)
    span = 1 + sum((s - 1) * st for s, st in zip(sizes, strides))
    raw = (ctypes.c_char * ((offset + span) * size)).from_address(address)
    flat = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
    return flat.as_strided(sizes, strides, offset)


def _native_from_address():
    try:  # the extension (`gradops cann-home` builds it where it is missing)
        return kernels().from_address
    except (ImportError, AttributeError):
        return None


#: ``(address, dtype, sizes, strides, offset) -> Tensor`` over memory the C caller owns (bridge.cpp has checked
#: the view against its storage): the native extension's where it is loaded (~0.4 µs), else the Python form.
from_address = _native_from_address() or _from_address_python
