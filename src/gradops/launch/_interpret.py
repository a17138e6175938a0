"""Two fixes to Triton's CPU interpreter (``TRITON_INTERPRET=1``), so that it runs what a GPU runs.

1. NumPy >= 2.4.

The interpreter (triton 3.6) holds scalars as 1-element arrays and turns them into Python ints with
``int(array)`` when a kernel loops ``for i in range(0, n)`` over a runtime ``n``; NumPy 2.4 made that a
TypeError ("only 0-dimensional arrays can be converted to Python scalars"). Every kernel with a runtime loop
bound (persistent grids, column loops, segment sums) would fail in the interpreter although it compiles and runs
on GPUs. :func:`apply` re-registers ``__index__`` through ``.reshape(-1)[0]``, which is what older NumPy did.
Compiled (GPU) launches never touch this code.

2. bfloat16 rounding. ``x.to(tl.bfloat16)`` from float32 compiles to a round-to-nearest-even conversion
(``cvt.rn.bf16.f32``), but the interpreter (triton 3.6) truncates the mantissa: up to one bf16 ulp (2^-7
relative) instead of half of one, which doubled our bf16 errors in the interpreter tier compared with the GPU.
:func:`apply` rounds float32 -> bfloat16 to nearest even on the bits (the interpreter's own RTNE converter
drops the carry into the exponent: -1.9975 became -1.0).
"""

from __future__ import annotations


def _needed() -> bool:
    import numpy as np

    try:
        int(np.zeros(1, dtype=np.int64))
    except TypeError:
        return True
    return False


def _float32_to_bfloat16_bits(values):
    """Round-to-nearest-even float32 -> bfloat16 bit patterns (uint16): add 0x7FFF plus the lowest kept bit and
    drop the low 16 bits; a carry correctly bumps the exponent (and overflows to inf). NaN stays a quiet NaN."""
    import numpy as np

    bits = np.asarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(np.asarray(values, dtype=np.float32)), quiet_nan, rounded)


def apply() -> None:
    """Patch the interpreter once, only when interpreting (the index fix only if this NumPy needs it)."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_gradops_fixed", False):
        return
    interpreter._gradops_fixed = True
    builder = interpreter.InterpreterBuilder
    truncate = builder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if dst_type.scalar == interpreter.tl.bfloat16 and src.dtype.scalar == interpreter.tl.float32:
            return interpreter.TensorHandle(_float32_to_bfloat16_bits(src.data), dst_type.scalar)
        return truncate(self, src, dst_type)

    builder.create_fp_trunc = fp_trunc
    if not _needed():
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
