"""Element access for the compiled CPU kernels: one spelling for float32, float16 and bfloat16.

numba has no bfloat16 and only partial float16 support, so half tensors reach the kernels as their raw bits:
float16 as an ``int16`` array, bfloat16 as a ``uint16`` array (see :mod:`gradops.cpu._views`). The
kernels read with :func:`ld` and write with :func:`st`; both pick the conversion from the array's numba dtype
at compile time, so the float32 path is a plain load/store and every dtype compiles to its own machine code.

- bfloat16 -> float32 is exact: the 16 bits become the top half of a float32.
- float32 -> bfloat16 rounds to nearest, ties to even (what torch's ``.to(torch.bfloat16)`` does); a NaN stays a
  (quiet) NaN instead of rounding into infinity.
- float16 <-> float32 go through LLVM's ``fpext``/``fptrunc`` on ``half`` (IEEE round-to-nearest-even; F16C
  instructions on x86), so they vectorize.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

#: fastmath flags of every kernel: reassociation lets LLVM vectorize the float32 dot products and sums. No
#: 'nnan'/'ninf': NaN and inf must propagate as in the reference. Reassociation changes bits only with the compiled
#: code, never with the thread count (each row or block is always reduced by the same code). No 'contract' either:
#: with it the machine code numba runs in the process that compiles a kernel and the code it writes to the disk
#: cache fused different multiply-adds on an AVX2 CPU with FMA (Zen 3), so LayerNorm's variance and backward
#: differed in their last bits between the first process and every later one
#: (tests/test_cpu_backend.py::test_cached_kernels_give_the_bits_of_fresh_ones). The kernels are memory-bound.
FASTMATH = {"reassoc"}


@intrinsic
def fma32(typingctx, a, b, c):
    """``a·b + c`` in float32 with one rounding (``llvm.fma``): an explicit fused multiply-add, the same
    instruction in the code a process compiles and in the code it caches, where contraction under fastmath
    'contract' was not (see FASTMATH). For accumulations whose accuracy is compared with PyTorch's, which fuses
    them (vectorized fmadd)."""
    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        fma = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fma, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret a uint32 as float32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _half_to_f32(typingctx, bits):
    """IEEE float16 bits (int16) -> float32, exact."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_half(typingctx, value):
    """float32 -> IEEE float16 bits (int16), round to nearest even."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


def bf16_bits(value):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@intrinsic
def _f32_to_bf16(typingctx, value):
    """float32 -> bfloat16 bits (uint16), round to nearest even, in 32-bit integer lanes.

    Round: add 0x7FFF plus the lowest kept bit, then keep the top 16 bits. A NaN would round into inf or another
    NaN pattern, so it takes its top bits with the quiet bit set (sign kept) instead; both are computed and one is
    selected (no branch, so the loops vectorize). Written in LLVM IR because numba widens uint32 arithmetic to
    64 bits: the same steps in numba code ran in 64-bit lanes, half as many per vector plus the widening shuffles
    (bf16 hardswish 1M elements on 2 cores: 462 µs against ATen's 202).
    """
    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        high = builder.lshr(u, ir.Constant(i32, 16))
        lsb = builder.and_(high, ir.Constant(i32, 1))
        rounded = builder.lshr(builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 16))
        quiet = builder.or_(high, ir.Constant(i32, 0x0040))
        is_nan = builder.icmp_unsigned(">", builder.and_(u, ir.Constant(i32, 0x7FFFFFFF)),
                                       ir.Constant(i32, 0x7F800000))
        return builder.trunc(builder.select(is_nan, quiet, rounded), ir.IntType(16))
    return types.uint16(types.float32), codegen


@overload(bf16_bits)
def _bf16_bits(value):
    def impl(value):
        return _f32_to_bf16(np.float32(value))
    return impl


def ld(a, i):  # pragma: no cover - replaced by the overload inside compiled code
    """``float32(a[i])`` for a float32, float16-bits (int16) or bfloat16-bits (uint16) array."""
    raise NotImplementedError


def st(a, i, v):  # pragma: no cover - replaced by the overload inside compiled code
    """``a[i] = v`` rounded to a's dtype (float32, float16 bits, bfloat16 bits)."""
    raise NotImplementedError


@overload(ld)
def _ld(a, i):
    dt = a.dtype
    if dt == types.float32:
        return lambda a, i: a[i]
    if dt == types.uint16:
        return lambda a, i: _bits_to_f32(np.uint32(a[i]) << np.uint32(16))
    if dt == types.int16:
        return lambda a, i: _half_to_f32(a[i])
    if dt in (types.float64, types.int64, types.int32):
        return lambda a, i: np.float32(a[i])
    return None


@overload(st)
def _st(a, i, v):
    dt = a.dtype
    if dt == types.float32:
        def st_f32(a, i, v):
            a[i] = v
        return st_f32
    if dt == types.uint16:
        def st_bf16(a, i, v):
            a[i] = bf16_bits(v)
        return st_bf16
    if dt == types.int16:
        def st_f16(a, i, v):
            a[i] = _f32_to_half(v)
        return st_f16
    return None


def two_lines(a):  # pragma: no cover - replaced by the overload inside compiled code
    """The number of a's items in two 64-byte cache lines (128 bytes), a compile-time constant."""
    raise NotImplementedError


@overload(two_lines)
def _two_lines(a):
    items = 128 * 8 // a.dtype.bitwidth  # bytes x bits per byte / bits per item: 32 float32, 64 bf16 / fp16
    return lambda a: items
