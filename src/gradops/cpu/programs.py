"""The public functions' eager calls as programs the native extension replays (``direct.cpp``).

After gradops' call plan validated a call and chose these kernels, :func:`build` describes what the Python path
would do for the arguments' metadata: the outputs it allocates, its scratch, and its steps - each a serial piece of
the op's kernel (a numba cfunc ``int64 piece(int64 args, int64 lo, int64 hi)`` reading its arguments from an int64
array: addresses, integers, float64 bits) run over work items ``[lo, hi)``, and how the items split over torch's
threads. The pieces call the same per-row / per-block / per-chunk functions as the Python path, and no split
changes which function computes which bits: the results are the Python path's bits (tests/test_direct_native.py).
A piece that finds a value the op refuses (an index outside the table, a negative rstd) returns its position, and
the call goes back to the Python path, which raises the op's OpError. The native autograd nodes (autograd.cpp) run
the same pieces (``*_node_pieces`` in :mod:`~gradops.cpu.program_norms` and :mod:`~gradops.cpu.program_index`): one
calling convention and one compiled copy of each kernel piece for everything the extension runs.

No program (None) where the Python path does something a program does not: an empty dimension, statistics in a
dtype the Python path first converts to float32, indices of a dtype it converts. Those calls keep the Python path.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from numba import types

from ._host import PARALLEL_MIN, c_function
from ._views import STORAGE

#: A step argument's kind: the call's input tensor i, output i, scratch buffer i, or a value (direct.cpp's Slot;
#: tests/test_direct_native.py checks they agree).
INPUT, OUTPUT, SCRATCH, VALUE, ABSENT = 0, 1, 2, 3, 4
I64, F64 = np.dtype(np.int64), np.dtype(np.float64)
_PIECE = types.int64(types.int64, types.int64, types.int64)


def _bits(value: int | float | bool) -> int:
    """A step value as the int64 the piece reads: integers as they are, floats as their float64 bits."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return int(value)


class Program:
    """What one call does, as direct.cpp replays it: outputs, scratch, steps, results."""

    def __init__(self) -> None:
        self.outputs: list[tuple[list[int], torch.dtype, bool]] = []
        self.scratch: list[tuple[list[int], torch.dtype, bool]] = []
        self.steps: list[tuple[int, list[tuple[int, int]], int, int]] = []
        self.results: list[int] = []
        self.tuple = False

    def output(self, shape: Sequence[int], dtype: torch.dtype, zero: bool = False) -> tuple[int, int]:
        """A new output tensor (zero-filled with ``zero``); its address as a step argument."""
        self.outputs.append(([int(s) for s in shape], dtype, zero))
        return OUTPUT, len(self.outputs) - 1

    def buffer(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
        """A scratch tensor, alive for the call; its address as a step argument."""
        self.scratch.append(([int(s) for s in shape], dtype, False))
        return SCRATCH, len(self.scratch) - 1

    def step(self, piece: int, args: Sequence[Any], count: int = 1, grain: int | None = None) -> None:
        """Run ``piece`` (an address) over work items [0, count) in pieces of at least ``grain`` items (default:
        one piece on the calling thread). ``args``: slots from :meth:`output` / :meth:`buffer` / :func:`arg`, or
        values."""
        slots = [a if isinstance(a, tuple) else (VALUE, _bits(a)) for a in args]
        self.steps.append((piece, slots, count, count if grain is None else max(1, grain)))

    def kernel(self, name: str, inputs: Sequence[tuple[int, int] | None], outputs: Sequence[tuple[int, int]],
               ints: Sequence[int] = (), floats: Sequence[float] = ()) -> None:
        """Run the registered CPU kernel ``name`` (see native/kernels.h) once: ``inputs`` as slots (:func:`arg`, an
        output or buffer of this program, or None for an absent optional tensor), ``outputs`` as slots, then its
        integers and floats. The kernel splits its own work over torch's threads."""
        ins = [(ABSENT, 0) if a is None else a for a in inputs]
        self.steps.append((name, ins, list(outputs), [int(i) for i in ints], [float(f) for f in floats]))

    def returns(self, *outputs: tuple[int, int]) -> Program:
        """The outputs the call returns: one tensor, or a tuple of several."""
        self.results = [index for _, index in outputs]
        self.tuple = len(outputs) > 1
        return self

    def spec(self) -> tuple:
        """The arguments of the extension's ``remember_direct`` after the op and the call."""
        return False, self.outputs, self.scratch, self.steps, self.results, self.tuple


def arg(i: int) -> tuple[int, int]:
    """The call's i-th tensor argument (counted over tensors only) as a step argument."""
    return INPUT, i


def rows_grain(m: int, n: int) -> int:
    """Rows per piece of a per-row kernel: all of them below :data:`PARALLEL_MIN` items (the Python path's serial
    loop), else at least PARALLEL_MIN items' worth."""
    return m if m * n < PARALLEL_MIN else -(-PARALLEL_MIN // n)


def chunks(items: int, per: int) -> int:
    """Pieces of ``per`` items that cover ``items``."""
    return -(-items // per)


def blocks_grain(blocks: int, items: int) -> int:
    """Blocks per piece of a blocked kernel over ``items`` items: all below PARALLEL_MIN (serial), else one."""
    return blocks if items < PARALLEL_MIN else 1


def piece(factory: Callable[..., Callable]) -> Callable[..., int]:
    """``factory(*storage dtypes) -> body`` as ``address(*torch dtypes)``: the body compiled as a piece (a cfunc,
    cached on disk) on first use for those dtypes, so that a call compiles only the pieces its program runs."""

    @functools.cache
    def address(*dtypes: torch.dtype) -> int:
        return c_function(_PIECE, factory(*(STORAGE[d] for d in dtypes))).address

    return address


@functools.cache
def _builders() -> dict[str, Callable[..., Program | None]]:
    from . import program_index, program_norms

    return {**program_norms.BUILDERS, **program_index.BUILDERS}


def build(op: str, shape: Any, *args: Any) -> Program | None:
    """The program of a call of ``op`` whose call plan answered ``shape`` (the contract's plan), or None: the call
    keeps the Python path."""
    return _builders()[op](shape, *args)
