"""LayerNorm forward, AscendC LayerNormGrad / LayerNormGradBeta, and the fused backward, as Triton kernels on the
(M, N) row view (N = H, the normalised dim).

fp32 math after every load; int64 offsets; masked loads and stores; eps, sizes and strides are runtime
arguments. Column stride 1 (the launcher guarantees it), row strides are arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def layer_norm_fwd_kernel(X, G, B, Y, MEAN, VAR, M, N, stride_x, stride_y, eps,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr):
    """``mean = sum(x)/N``, ``var = sum((x - mean)^2)/N`` (biased), ``y = (x - mean) / sqrt(var + eps) * g + b``.

    Grid ``cdiv(M, BLOCK_M)``. Single-tile rows: two-pass statistics in registers. LOOPED rows (BLOCK_M = 1):
    per column block a local mean and M2, merged with Chan's parallel update (one pass, no E[x^2] - E[x]^2
    cancellation), then a second pass for y. A tile's mean is summed in float64: exact for a constant row, whose
    mean is then its value and y = b for any eps, as in the C++ kernels and the reference (a float32 sum missed 45
    copies of 0.1 by an ulp, which rstd ~ 1e6 at eps = 1e-12 turned into |y - b| ~ 1). Bytes:
    ``M*N*(s_x + s_y) + N*(s_g + s_b) + 8*M``.
    """
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    if not LOOPED:
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = (tl.sum(x.to(tl.float64), axis=1) / N).to(tl.float32)
        xmu = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xmu * xmu, axis=1) / N
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        g = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xmu * rstd[:, None] * g[None, :] + b[None, :]
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = rmask[:, None] & (c < N)[None, :]
            x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            nb = tl.minimum(N - c0, BLOCK_N).to(tl.float32)
            bmean = (tl.sum(x.to(tl.float64), axis=1) / nb).to(tl.float32)
            bd = tl.where(mask, x - bmean[:, None], 0.0)
            na = c0 * 1.0  # elements merged so far (float: c0 is a Python int in the interpreter)
            delta = bmean - mean
            mean += delta * (nb / (na + nb))
            m2 += tl.sum(bd * bd, axis=1) + delta * delta * (na * nb / (na + nb))
        var = m2 / N
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            cmask = c < N
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + c, mask=cmask, other=0.0).to(tl.float32)
            b = tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None] * g[None, :] + b[None, :]
            tl.store(Y + rows[:, None] * stride_y + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(VAR + rows, var, mask=rmask)


@triton.jit
def _row_stats(MEAN, STAT, rows, rmask, eps, FROM_VAR: tl.constexpr):
    """(mean, rstd) of the rows; STAT is the variance (rstd = (var + eps)^-0.5) or rstd itself."""
    mean = tl.load(MEAN + rows, mask=rmask, other=0.0).to(tl.float32)
    stat = tl.load(STAT + rows, mask=rmask, other=0.0).to(tl.float32)
    if FROM_VAR:
        stat = 1.0 / tl.sqrt_rn(stat + eps)
    return mean, stat


@triton.jit
def layer_norm_bwd_kernel(DY, X, MEAN, STAT, G, DX, RES, PG, PB, M, N, stride_dy, stride_x, stride_dx, stride_res,
                          eps, tiles_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          FROM_VAR: tl.constexpr, WRITE_RES: tl.constexpr, PARTIALS: tl.constexpr,
                          MEAN_TERM: tl.constexpr):
    """AscendC LayerNormGrad term by term (rows within one register tile), optionally fused with GradBeta::

        xmu = x - mean;  pd_xl = dy * g
        pd_var  = -0.5 * rstd^3 * sum(pd_xl * xmu)
        pd_mean = -rstd * sum(pd_xl) + pd_var * (1/N) * (-2 * sum(xmu))        (MEAN_TERM: AscendC keeps it)
        pd_x    = pd_xl * rstd + pd_var * (2/N) * xmu + pd_mean / N            -> DX (x's dtype)
        res     = xmu * rstd                                                   -> RES if WRITE_RES
        PG[p] += sum_rows dy * res,  PB[p] += sum_rows dy                      (fp32 partials if PARTIALS)

    FROM_VAR: STAT is the variance and rstd = (var + eps)^-0.5 (LayerNormGrad); else STAT is rstd (fused op).
    MEAN_TERM: AscendC LayerNormGrad's ``sum(xmu)`` term, 0 only when mean is the row's mean; the fused op
    (aclnnLayerNormBackward, whose golden is ATen's ``native_layer_norm_backward``) leaves it out.
    Persistent grid: program p takes tiles p, p + P, ... Bytes (fused): ``M*N*(s_dy + s_x + s_dx) + 8*M + N*s_g +
    2*P*N*4``; LayerNormGrad: ``M*N*(s_dy + s_x + 2*s_x) + 8*M + N*s_g``.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    g = tl.load(G + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(tiles_per_program):
        rows = (pid + i * nprog).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean, rstd = _row_stats(MEAN, STAT, rows, rmask, eps, FROM_VAR)
        xmu = tl.where(mask, x - mean[:, None], 0.0)
        pd_xl = dy * g[None, :]
        pd_var = -0.5 * rstd * rstd * rstd * tl.sum(pd_xl * xmu, axis=1)
        pd_mean = -rstd * tl.sum(pd_xl, axis=1)
        if MEAN_TERM:
            pd_mean += pd_var * (-2.0 * tl.sum(xmu, axis=1)) / N
        pd_x = pd_xl * rstd[:, None] + (pd_var * (2.0 / N))[:, None] * xmu + (pd_mean / N)[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], pd_x.to(DX.dtype.element_ty), mask=mask)
        res = xmu * rstd[:, None]
        if WRITE_RES:
            tl.store(RES + rows[:, None] * stride_res + cols[None, :], res.to(RES.dtype.element_ty), mask=mask)
        if PARTIALS:
            acc_g += tl.sum(dy * res, axis=0)
            acc_b += tl.sum(dy, axis=0)
    if PARTIALS:
        tl.store(PG + pid.to(tl.int64) * N + cols, acc_g, mask=cmask)
        tl.store(PB + pid.to(tl.int64) * N + cols, acc_b, mask=cmask)


@triton.jit
def layer_norm_bwd_looped_kernel(DY, X, MEAN, STAT, G, DX, RES, PG, PB, M, N, stride_dy, stride_x, stride_dx,
                                 stride_res, eps, rows_per_program, BLOCK_N: tl.constexpr, FROM_VAR: tl.constexpr,
                                 WRITE_RES: tl.constexpr, PARTIALS: tl.constexpr, MEAN_TERM: tl.constexpr):
    """:func:`layer_norm_bwd_kernel` for rows wider than a register tile: per row, pass 1 accumulates the three
    row sums over column blocks, pass 2 reloads dy and x (L2), writes pd_x (and res) and adds into the
    program's own fp32 partial rows (first row stores; P <= M so every partial row is written). Bytes as
    the tiled kernel plus the pass-2 re-read (L2 or, worst case, ``2*M*N*s`` more) and ``16*N`` per row of
    partial read-modify-write (L2).
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    pg = PG + pid.to(tl.int64) * N
    pb = PB + pid.to(tl.int64) * N
    for i in range(rows_per_program):
        row = (pid + i * nprog).to(tl.int64)
        live = row < M
        mean, rstd = _row_stats(MEAN, STAT, row, live, eps, FROM_VAR)
        s1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        s2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        s3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = (c < N) & live
            dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + c, mask=mask, other=0.0).to(tl.float32)
            xmu = tl.where(mask, x - mean, 0.0)
            pd_xl = dy * g
            s1 += pd_xl * xmu
            s2 += pd_xl
            if MEAN_TERM:
                s3 += xmu
        pd_var = -0.5 * rstd * rstd * rstd * tl.sum(s1, axis=0)
        pd_mean = -rstd * tl.sum(s2, axis=0)
        if MEAN_TERM:
            pd_mean += pd_var * (-2.0 * tl.sum(s3, axis=0)) / N
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols
            mask = (c < N) & live
            dy = tl.load(DY + row * stride_dy + c, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + c, mask=mask, other=0.0).to(tl.float32)
            xmu = tl.where(mask, x - mean, 0.0)
            pd_x = dy * g * rstd + pd_var * (2.0 / N) * xmu + pd_mean / N
            tl.store(DX + row * stride_dx + c, pd_x.to(DX.dtype.element_ty), mask=mask)
            res = xmu * rstd
            if WRITE_RES:
                tl.store(RES + row * stride_res + c, res.to(RES.dtype.element_ty), mask=mask)
            if PARTIALS:
                first = mask & (i > 0)
                tl.store(pg + c, tl.load(pg + c, mask=first, other=0.0) + dy * res, mask=mask)
                tl.store(pb + c, tl.load(pb + c, mask=first, other=0.0) + dy, mask=mask)


@triton.jit
def layer_norm_grad_beta_kernel(RES, DY, PG, PB, M, N, stride_res, stride_dy, rows_per_split,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """AscendC LayerNormGradBeta column sums: ``PG[s, j] = sum_r dy[r,j] * res[r,j]``, ``PB[s, j] = sum_r dy[r,j]``
    over split s's rows ``[s*rows_per_split, (s+1)*rows_per_split)``, fp32 (BLOCK_M lanes per column, each summing
    every BLOCK_M-th row in order, then a tree over lanes: a fixed order), stored in PG/PB's dtype (the final
    outputs when there is one split, else fp32 partials reduced in a fixed order afterwards).

    Grid ``(cdiv(N, BLOCK_N), S)``. Bytes: ``2*M*N*s + S*N*8`` (+ the reduction) ``+ 2*N*s_out``.
    """
    cb = tl.program_id(0)
    split = tl.program_id(1).to(tl.int64)
    cols = cb.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    r_start = split * rows_per_split
    # Lane-wise accumulators, tree-summed once at the end: with a cross-warp sum per step 16384 x 4096 bf16 took
    # 0.39 ms on an H100 (~0.7 TB/s of reads), with these 0.14 ms.
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rows_per_split, BLOCK_M):
        local = r0 + tl.arange(0, BLOCK_M)
        rows = r_start + local
        mask = ((local < rows_per_split) & (rows < M))[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        res = tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc_g += dy * res
        acc_b += dy
    tl.store(PG + split * N + cols, tl.sum(acc_g, axis=0).to(PG.dtype.element_ty), mask=cmask)
    tl.store(PB + split * N + cols, tl.sum(acc_b, axis=0).to(PB.dtype.element_ty), mask=cmask)


def grad_beta_config(m: int, n: int, sm_count: int, block_n: int = 128, block_m: int = 32) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, S)`` for :func:`layer_norm_grad_beta_kernel`: 128-column strips (256 B rows in bf16,
    full 128 B sectors), 32-row steps, and S row splits so that the grid has ~4 programs per SM (a 4096-column
    problem has only 32 strips); every split gets at least one BLOCK_M step."""
    block_n = min(block_n, triton.next_power_of_2(max(n, 1)))
    strips = triton.cdiv(n, block_n)
    splits = max(1, min(triton.cdiv(4 * sm_count, strips), triton.cdiv(m, block_m)))
    return block_m, block_n, splits
