"""Recycled output buffers for the compiled CPU kernels: skip the first-touch page faults of fresh memory.

Every large fresh CPU tensor is a new ``mmap``: its first write takes a page fault per 4 KiB, measured at
~2-7 GB/s on a 2-core VM, slower than the kernels themselves (an 8192 x 4096 fp32 RMSNorm backward: ~18 ms
into a warm buffer, ~95 ms into a fresh one). A training step asks for the same output sizes every step, so
gradops keeps the memory of outputs that died and hands it out again, already mapped.

Mechanics: a block is a numpy uint8 array owned by the pool. A caller gets a torch tensor made from a numpy
*view* of the block (``torch.from_numpy``); when torch frees the tensor's storage, the view dies and a weakref
finalizer puts the block back on the free list. Nothing is ever reused while any tensor still points into it.

Limits: blocks of at least :data:`MIN_BYTES`; at most ``GRADOPS_CPU_POOL_MB`` MiB (default 2048) of *free*
blocks are kept (beyond that, a dying block is released to the OS); ``GRADOPS_CPU_POOL_MB=0`` turns the pool
off (every output is a plain ``torch.empty``). The limit is read whenever a block dies, so lowering it keeps
the blocks already held: :func:`clear` (public as ``gradops.empty_cache()``) hands them back. Pooled tensors
are ordinary CPU tensors except that their storage cannot be resized (``resize_`` to a larger size raises).
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .. import _runtime, native

ENV = "GRADOPS_CPU_POOL_MB"
#: Below 1 MiB outputs come from malloc: a numpy block and its finalizer cost ~10 µs per output, and even the
#: extension's ~1 µs blocks made a whole model slower at smaller sizes (see gradops/native/pool.cpp, whose
#: kPoolMin is the one definition: this package loads only with the extension).
MIN_BYTES: int = native.kernels().POOL_MIN
_VIEW = {torch.float32: (np.float32, None), torch.int32: (np.int32, None), torch.int64: (np.int64, None),
         torch.float16: (np.int16, torch.float16), torch.bfloat16: (np.uint16, torch.bfloat16)}

_lock = threading.Lock()
_free: dict[int, list[np.ndarray]] = {}
_free_bytes = 0
#: gradops.native's extension once loaded: its C++ pool serves :func:`empty` from then on (same rules, ~1 µs per
#: pooled tensor where this module's numpy blocks and finalizer cost ~10 on 2 cores), and the native nodes.
_native = None


def use_native(extension) -> None:
    """Serve pooled outputs from ``extension``'s pool (``pool_empty``, ``pool_clear``, ``pool_free_bytes``: see
    gradops/native/pool.cpp) from now on; blocks this module held before stay here until :func:`clear`."""
    global _native
    _native = extension


_runtime.on_extension(use_native)


def limit_bytes() -> int:
    """Most bytes of free blocks kept (read at each call, so it can be changed at run time)."""
    try:
        return int(float(os.environ.get(ENV, "2048")) * (1 << 20))
    except ValueError:
        return 0


def _release(block: np.ndarray) -> None:
    global _free_bytes
    with _lock:
        if _free_bytes + block.nbytes <= limit_bytes():
            _free.setdefault(block.nbytes, []).append(block)
            _free_bytes += block.nbytes


def _take(nbytes: int) -> np.ndarray | None:
    global _free_bytes
    with _lock:
        blocks = _free.get(nbytes)
        if not blocks:
            return None
        _free_bytes -= nbytes
        return blocks.pop()


def clear() -> int:
    """Drop every free block and return how many bytes they held (``gradops.empty_cache()``).

    The pool holds the only reference to a free block, so the memory goes back to the OS here: blocks are
    >= 1 MiB numpy arrays, which glibc maps and unmaps whole, or the extension's own mappings (measured: after
    the outputs of a few 8192 x 4096 fp32 norm backwards died, the process held 975 MiB resident, 640 MiB of it
    free blocks; 335 MiB after this).
    Blocks still in use are untouched and return to the pool when they die.
    """
    global _free_bytes
    with _lock:
        released = _free_bytes
        _free.clear()
        _free_bytes = 0
    return released + (_native.pool_clear() if _native is not None else 0)


def free_bytes() -> int:
    """Bytes currently held in free blocks."""
    return _free_bytes + (_native.pool_free_bytes() if _native is not None else 0)


def empty_like(t: Tensor) -> Tensor:
    """:func:`empty` of a contiguous ``t``'s shape and dtype; below :data:`MIN_BYTES` ``torch.empty_like`` (1.2 µs at
    8 x 8 fp32 on 2 cores, where ``torch.empty(shape, dtype=...)`` parses its arguments in 2.2)."""
    if t.nbytes < MIN_BYTES:
        return torch.empty_like(t)
    return empty(t.shape, t.dtype)


def empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """An uninitialized contiguous CPU tensor, from a recycled block when one of the exact size is free."""
    # Small outputs first (most calls of a small model): one product, no environment read (math.prod: exact,
    # and 0.2 µs where np.prod takes 3 µs).
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES or dtype not in _VIEW or limit_bytes() <= 0:
        # Sizes as separate ints: torch parses a tuple argument more slowly (1.3 µs against 2.1-3.5 for a 2-D
        # shape on 2 cores).
        return torch.empty(*shape, dtype=dtype) if shape else torch.empty((), dtype=dtype)
    if _native is not None:
        return _native.pool_empty(shape, dtype)
    shape = tuple(int(s) for s in shape)
    block = _take(nbytes)
    if block is None:
        block = np.empty(nbytes, dtype=np.uint8)
    np_dtype, torch_view = _VIEW[dtype]
    view = block.view(np_dtype).reshape(shape)
    weakref.finalize(view, _release, block)  # the finalizer holds the block until the view (and tensor) die
    t = torch.from_numpy(view)
    # A half tensor is a dtype view of the block's int16 / uint16 array; detached, it is no autograd view (whose
    # in-place changes autograd would refuse), as a fresh tensor is not.
    return t.view(torch_view).detach() if torch_view is not None else t
