"""The public functions' eager calls as programs the native extension replays (``direct.cpp``).

After gradops' call plan validated a call and chose the CPU kernels, the op's builder (in its family's ``cpu.py``,
beside its host entries; the op's call plan names it, :class:`gradops.ops._plan.Planner`) describes what the Python
path would do for the arguments' metadata: the outputs it allocates and the registered kernel it runs on them
(native/kernels.h), with the call's integers and floats. A later call with the same metadata is one C++ call: the
key, the allocations, the kernel. The kernel is the one the Python path runs, so the results are its bits
(tests/test_direct_native.py). A kernel that finds a value the op refuses (an index outside the table, a negative
variance) returns its position, and the call goes back to the Python path, which raises the op's OpError.

No program (None) where the Python path does something a program does not: statistics in a dtype the Python path
first converts to float32, indices of a dtype it converts. Those calls keep the Python path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..contract._common import Result

#: A kernel argument's kind: the call's input tensor i, output i, or an absent optional tensor (direct.cpp's Slot;
#: tests/test_direct_native.py checks they agree).
INPUT, OUTPUT, ABSENT = 0, 1, 4


class Program:
    """What one call does, as direct.cpp replays it: outputs, kernels, results."""

    def __init__(self) -> None:
        self.outputs: list[tuple[list[int], torch.dtype]] = []
        self.steps: list[tuple] = []
        self.results: list[int] = []
        self.tuple = False

    def output(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
        """A new output tensor (not zero-filled: a kernel writes its outputs whole); the slot naming it."""
        self.outputs.append(([int(s) for s in shape], dtype))
        return OUTPUT, len(self.outputs) - 1

    def declared(self, results: Sequence[Result]) -> list[tuple[int, int]]:
        """A new output per result of the op's declaration (its shape and dtype); their slots."""
        return [self.output(r.size, r.dtype) for r in results]

    def kernel(self, name: str, inputs: Sequence[tuple[int, int] | None], outputs: Sequence[tuple[int, int]],
               ints: Sequence[int] = (), floats: Sequence[float] = ()) -> None:
        """Run the registered CPU kernel ``name`` (see native/kernels.h) once: ``inputs`` as slots (:func:`arg`, an
        output of this program, or None for an absent optional tensor), ``outputs`` as slots, then its integers
        and floats. The kernel splits its own work over torch's threads."""
        ins = [(ABSENT, 0) if a is None else a for a in inputs]
        self.steps.append((name, ins, list(outputs), [int(i) for i in ints], [float(f) for f in floats]))

    def returns(self, *outputs: tuple[int, int]) -> Program:
        """The outputs the call returns: one tensor, or a tuple of several."""
        self.results = [index for _, index in outputs]
        self.tuple = len(outputs) > 1
        return self

    def spec(self) -> tuple:
        """The arguments of the extension's ``remember`` after the op, the call and the node flag."""
        return False, self.outputs, self.steps, self.results, self.tuple


def arg(i: int) -> tuple[int, int]:
    """The call's i-th tensor argument (counted over tensors only) as a kernel input."""
    return INPUT, i
