"""Host side of the CPU kernels: contiguous inputs, outputs from the pool, the kernel call, the row blocks.

The kernels are C++ (``gradops/families/<family>/<family>.cpp``, the convention in ``native/kernels.h``): each takes its
inputs contiguous, its outputs allocated and contiguous, and runs on torch's own intra-op threads (serially in a
child of ``fork()``, where GNU OpenMP does not survive). Inputs that are not contiguous are copied once
(:func:`dense`: a 2-D view with a row stride costs ``2·M·N·s`` more bytes; a kernel then has one layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import _runtime, native
from ..contract._common import Outputs
from . import _pool


def kernel(name: str, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor], ints: Sequence[int] = (),
           floats: Sequence[float] = ()) -> int:
    """Run the native CPU kernel ``name`` (see gradops/native/kernels.h for the convention): ``inputs`` contiguous
    CPU tensors in the op's order (None for an absent optional one), ``outputs`` contiguous results it fills.
    Returns -1, or the position of the first value the op refuses."""
    run = _run if _run is not None else _bind()
    return run(name, inputs, outputs, ints, floats)


_run = None


def _bind():
    """The extension's ``kernel`` binding, looked up once (a call through the module costs ~0.5 µs more)."""
    global _run
    _run = native.kernels().kernel
    return _run


def _forget_binding(_extension: object) -> None:
    global _run
    _run = None


_runtime.on_extension(_forget_binding)  # a rebuilt extension is a new module

#: Items below which a kernel runs on the calling thread (kernels.h's kParallelMin, its one definition).
PARALLEL_MIN: int = native.kernels().PARALLEL_MIN


def row_blocks(rows: int, cols: int) -> int:
    """The fixed row blocks of a cross-row reduction over a ``rows x cols`` input (kernels.h's ``row_blocks``: the
    one definition, read from the extension): workspace sizes are counted in them."""
    return native.kernels().row_blocks(rows, cols)


def dense(t: Tensor) -> Tensor:
    """``t`` when it is contiguous, else a contiguous copy (the caller keeps it alive while a kernel reads it)."""
    return t if t.is_contiguous() else t.contiguous()


def output(out: Tensor | None, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The buffer a kernel writes: ``out`` itself when it is contiguous, else a new tensor from the recycling
    pool (:mod:`gradops.cpu._pool`; see :func:`finish` for a non-contiguous ``out``)."""
    if out is not None and out.is_contiguous():
        return out
    return _pool.empty(shape, dtype)


def allocate(outputs: Outputs, args: tuple) -> list[Tensor]:
    """A new contiguous tensor per declared result of the call plan (``outputs``, see
    :func:`gradops.contract._common.evaluated`) of a call on ``args``: from the recycling pool, made like the
    argument it was declared like where that one is contiguous (``empty_like``: 1.0 µs at 8 x 8 on 2 cores against
    1.5 for a shape and a dtype). The shaped entries' outputs."""
    return [_pool.empty_like(args[like]) if like >= 0 and args[like].is_contiguous() else _pool.empty(size, dtype)
            for size, dtype, like in outputs]


def finish(buf: Tensor, out: Tensor | None) -> Tensor:
    """Deliver a kernel's result: into a non-contiguous ``out`` by copy, else ``buf`` as is."""
    if out is None or buf is out:
        return buf
    out.copy_(buf.view(out.shape))
    return out
