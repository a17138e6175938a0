"""SwiGlu and SwiGluGrad as row-tiled Triton kernels over the 2-D view x[rows, 2·cols] (A: the first cols columns
of a row, B: the rest), float32 math.

Bytes: forward ``3·rows·cols·s``, backward ``5·rows·cols·s`` (each input read once, each result written once).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Items per program: 16 per thread at 8 warps.
BLOCK = 4096
WARPS = 8


@triton.jit
def _sigmoid(a):
    return 1.0 / (1.0 + tl.exp(-a))


@triton.jit
def swiglu_kernel(X, Y, cols, n, sx, BLOCK: tl.constexpr):
    """``Y[r, c] = silu(X[r, c]) * X[r, cols + c]`` over ``n = rows·cols`` items of contiguous Y; X's rows are
    ``sx`` items apart. Grid ``cdiv(n, BLOCK)``; int64 offsets."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // cols
    c = offs - r * cols
    a = tl.load(X + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + r * sx + cols + c, mask=mask, other=0.0).to(tl.float32)
    y = (a * _sigmoid(a)) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_grad_kernel(G, X, DX, cols, n, sg, sx, BLOCK: tl.constexpr):
    """``DX[r, c] = g·B·s·(1 + A·(1 - s))``, ``DX[r, cols + c] = g·A·s`` (s = sigmoid(A)) for the ``n = rows·cols``
    items (r, c); G's and X's rows are ``sg`` and ``sx`` items apart, DX contiguous (rows x 2·cols)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = offs // cols
    c = offs - r * cols
    g = tl.load(G + r * sg + c, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(X + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(X + r * sx + cols + c, mask=mask, other=0.0).to(tl.float32)
    s = _sigmoid(a)
    da = g * b * (s * (1.0 + a * (1.0 - s)))
    db = g * (a * s)
    row = DX + r * (2 * cols)
    tl.store(row + c, da.to(DX.dtype.element_ty), mask=mask)
    tl.store(row + cols + c, db.to(DX.dtype.element_ty), mask=mask)
