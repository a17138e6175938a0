"""Compatibility fix for Triton's CPU interpreter (``TRITON_INTERPRET=1``) under NumPy >= 2.4.

The interpreter (triton 3.6) holds scalars as 1-element arrays and turns them into Python ints with
``int(array)`` when a kernel loops ``for i in range(0, n)`` over a runtime ``n``; NumPy 2.4 made that a
TypeError ("only 0-dimensional arrays can be converted to Python scalars"). Every kernel with a runtime loop
bound (persistent grids, column loops, segment sums) would fail in the interpreter although it compiles and runs
on GPUs. :func:`apply` re-registers ``__index__`` through ``.reshape(-1)[0]``, which is what older NumPy did.
Compiled (GPU) launches never touch this code.
"""

from __future__ import annotations


def _needed() -> bool:
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int64))
    except TypeError:
        return True
    return False


def apply() -> None:
    """Patch the interpreter once, only when interpreting and only if this NumPy needs it."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_gradops_index_fix", False) or not _needed():
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._gradops_index_fix = True
