"""Hardswish and aclnnHardswishBackward (V1, closed interval) as elementwise Triton kernels.

Two layouts: a flat kernel over one dense storage range (contiguous, channels-last, any permutation of a dense
tensor: inputs and output share the strides) and a strided kernel over up to 4 coalesced dims (row-sliced,
expanded or otherwise non-dense views) that reads every tensor through its own strides, so no input is copied.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Elements per program of the flat kernels: 16 per thread at 8 warps, i.e. two 16-byte vectors per tensor in
#: 16-bit dtypes. Pending H100 tuning.
FLAT_BLOCK = 4096
FLAT_WARPS = 8


@triton.jit
def _hardswish(x):
    """``x * clamp(x + 3, 0, 6) / 6`` in fp32 (same operation order as the reference)."""
    return x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0


@triton.jit
def _hardswish_grad(g, x):
    """``0`` if x < -3; ``g * (x * 0.33333334 + 0.5)`` if -3 <= x <= 3 (closed: d(-3) = -0.5, d(3) = 1.5);
    ``g`` above 3 and for NaN x (both comparisons false), as CANN's 950 kernel. The literal is float32(1/3) =
    0.33333334f, CANN's constant (docs/semantics.md §3); Triton rounds Python float literals to fp32."""
    return tl.where(x < -3.0, 0.0, tl.where(x <= 3.0, g * (x * 0.3333333432674408 + 0.5), g))


@triton.jit
def hardswish_flat_kernel(G, X, OUT, n, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """Elementwise over ``n`` densely stored elements: ``OUT = hardswish(X)``, or with BACKWARD
    ``OUT = hardswish_grad(G, X)``. Grid ``cdiv(n, BLOCK)``; int64 offsets (n may exceed 2^31).
    Bytes: ``2*n*s`` forward, ``3*n*s`` backward: the copy floor.
    """
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        y = _hardswish_grad(g, x)
    else:
        y = _hardswish(x)
    tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def hardswish_strided_kernel(G, X, OUT, rows, cols, d1, d2, col_blocks,
                             sg0, sg1, sg2, sg3, sx0, sx1, sx2, sx3, so0, so1, so2, so3,
                             BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """The same elementwise math over a 4-D index space ``(d0, d1, d2, cols)`` with per-tensor strides (dims
    coalesced on the host; unused dims have size 1). ``rows = d0*d1*d2`` flattened rows are split back into
    (i0, i1, i2) once per row. Grid ``cdiv(rows, BLOCK_R) * col_blocks`` on axis 0 (axis 1 is limited to 65535
    programs; a 1-D strided view can have 10^8 columns), split back into (row block, column block). Bytes as the
    flat kernel: nothing is copied; only the access pattern is strided.
    """
    pid = tl.program_id(0).to(tl.int64)
    r = (pid // col_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (pid % col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    i2 = r % d2
    i1 = (r // d2) % d1
    i0 = r // (d2 * d1)
    ox = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None] + c[None, :] * sx3
    oo = (i0 * so0 + i1 * so1 + i2 * so2)[:, None] + c[None, :] * so3
    x = tl.load(X + ox, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        og = (i0 * sg0 + i1 * sg1 + i2 * sg2)[:, None] + c[None, :] * sg3
        g = tl.load(G + og, mask=mask, other=0.0).to(tl.float32)
        y = _hardswish_grad(g, x)
    else:
        y = _hardswish(x)
    tl.store(OUT + oo, y.to(OUT.dtype.element_ty), mask=mask)


def strided_blocks(cols: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)`` of the strided kernel: up to 256 columns per row strip, 2048 elements
    per tile."""
    block_c = min(256, triton.next_power_of_2(max(cols, 1)))
    return max(1, 2048 // block_c), block_c, 8
