"""RmsNorm forward and RmsNormGrad (aclnnRmsNormGrad) Triton kernels on the (M, N) row view.

All math in fp32 after each load (also what the interpreter needs: it has no bf16 arithmetic); int64 offsets;
every load and store masked; runtime sizes, strides and eps are plain arguments, only tile sizes are constexpr
(no recompilation per M). The column stride of the 2-D views is 1 (the launcher guarantees it); row strides are
arguments, so row-sliced views run without a copy.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(X, G, Y, RSTD, M, N, stride_x, stride_y, eps,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr):
    """``rstd[r] = 1 / sqrt(mean_j x[r,j]^2 + eps)``, ``y[r,j] = x[r,j] * rstd[r] * g[j]``.

    Grid: ``cdiv(M, BLOCK_M)``, one tile of rows per program. Single-tile rows read x once; LOOPED rows
    (N > BLOCK_N, BLOCK_M == 1) read it twice, the second time from L2 (a 64k-column bf16 row is 128 KB).
    Bytes: ``M*N*(s_x + s_y) + N*s_g + 4*M``.
    """
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    if not LOOPED:
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / N + eps)
        g = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * g[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = rmask[:, None] & (c < N)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=1) / N + eps)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            cmask = c < N
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + c, mask=cmask, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * g[None, :]
            tl.store(Y + rows[:, None] * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def rms_norm_grad_kernel(DY, X, RSTD, G, DX, PART, M, N, stride_dy, stride_x, stride_dx, tiles_per_program,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One fused pass for dx and dgamma, rows that fit one register tile (N <= BLOCK_N)::

        xhat = x * rstd[r];  wdy = dy * g[j]
        m[r] = mean_j(wdy * xhat);   dx = (wdy - xhat * m[r]) * rstd[r]          (stored in dy's dtype)
        PART[p, j] = sum over this program's rows of dy * xhat                    (fp32, in registers)

    Persistent grid of P programs; program p takes row tiles p, p + P, ... (``tiles_per_program`` of them, the
    last possibly past M and fully masked). dgamma = column sums of PART in a fixed order (second kernel), so the
    result is deterministic for a given P. Bytes: ``M*N*(s_dy + s_x + s_dx) + 4*M + N*s_g + P*N*4`` (+ the
    reduction's ``P*N*4 + 4*N``): the 3*M*N*s floor plus ~2% at 16k x 4096 bf16.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
    dg = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(tiles_per_program):
        rows = (pid + i * nprog).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * g[None, :]
        m = tl.sum(wdy * xhat, axis=1) / N
        dx = (wdy - xhat * m[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dg += tl.sum(dy * xhat, axis=0)
    tl.store(PART + pid.to(tl.int64) * N + cols, dg, mask=cmask)


@triton.jit
def rms_norm_grad_looped_kernel(DY, X, RSTD, G, DX, PART, M, N, stride_dy, stride_x, stride_dx, rows_per_program,
                                BLOCK_N: tl.constexpr):
    """rms_norm_grad for rows wider than a register tile (same formula as :func:`rms_norm_grad_kernel`).

    Per row, pass 1 accumulates ``sum_j dy*g*x`` over column blocks; pass 2 reloads dy and x (the row was just
    read: one 16-warp program per SM, a 64k-column bf16 row pair is 256 KB, ~34 MB over 132 SMs, within H100's
    50 MB L2 together with the partial rows only partly; worst case 5*M*N*s instead of 3), writes dx and adds
    ``dy * xhat`` into the program's own fp32 partial row ``PART[p]`` (read-modify-write by one program only: no
    atomics; the first row stores). P <= M, so every partial row is written.
    Bytes: ``3..5 * M*N*s + 8*N per row (L2) + P*N*4``.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    part = PART + pid.to(tl.int64) * N
    for i in range(rows_per_program):
        row = (pid + i * nprog).to(tl.int64)
        live = row < M
        rstd = tl.load(RSTD + row, mask=live, other=0.0)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = (c < N) & live
            dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + c, mask=mask, other=0.0).to(tl.float32)
            acc += dy * g * x
        m = tl.sum(acc, axis=0) * rstd / N
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = (c < N) & live
            dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + c, mask=mask, other=0.0).to(tl.float32)
            xhat = x * rstd
            dx = (dy * g - xhat * m) * rstd
            tl.store(DX + row * stride_dx + c, dx.to(DX.dtype.element_ty), mask=mask)
            prev = tl.load(part + c, mask=mask & (i > 0), other=0.0)
            tl.store(part + c, prev + dy * xhat, mask=mask)
