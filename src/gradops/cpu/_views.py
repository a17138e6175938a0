"""Kernel arguments by address: the compiled entries get each tensor as ``(data_ptr, storage dtype)`` plus its
sizes, and view the memory as an array themselves.

Why: handing numba a numpy view costs ``Tensor.numpy()`` and numba's typing of the array, ~1.2 µs per tensor on
2 cores (a 2-tensor elementwise call: 2.9 µs through numpy views, 0.6 µs by address), and a
backward passes five to seven tensors. An address is a Python int (``data_ptr()``, 0.14 µs), a storage dtype a
cached ``numpy.dtype`` (typed by numba in its fast path).

Safety: an entry sees exactly the elements its host function describes - the sizes of the contiguous tensor
whose address it got, which the host keeps alive for the call - so a kernel indexes only memory torch
allocated for that tensor, as with the numpy views before.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import carray, njit, types
from numba.extending import intrinsic

#: The dtype each torch dtype is stored as in the kernels (numba has no bfloat16 and only partial float16:
#: half tensors travel as their bits, see :mod:`gradops.cpu._numeric`).
STORAGE: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32), torch.float16: np.dtype(np.int16), torch.bfloat16: np.dtype(np.uint16),
    torch.float64: np.dtype(np.float64), torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
}
#: The storage dtype of the float32 statistics and gradients (rstd, mean, dgamma), a constant in the entries.
F32 = np.dtype(np.float32)


@intrinsic
def _pointer(typingctx, address, dtype):
    """The int ``address`` as a typed pointer to ``dtype`` items (an LLVM ``inttoptr``: no code, no check)."""
    pointer = types.CPointer(dtype.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, dtype), codegen


@njit(inline="always")
def view1(address, dtype, n):  # pragma: no cover - compiled
    """The ``n`` items at ``address`` as a C-contiguous 1-D array."""
    return carray(_pointer(address, dtype), (n,))


@njit(inline="always")
def view2(address, dtype, rows, cols):  # pragma: no cover - compiled
    """The ``rows x cols`` items at ``address`` as a C-contiguous 2-D array."""
    return carray(_pointer(address, dtype), (rows, cols))
