"""aclnnMoeTokenPermute (gather), aclnnMoeTokenPermuteGrad (gather-sum), aclnnMoeTokenUnpermute (weighted
gather-sum) and aclnnMoeTokenUnpermuteGrad (scatter + dot products) Triton kernels, CANN's convention:
``sorted_indices[t*K + k]`` is the permuted row holding token t's k-th copy."""

from __future__ import annotations

import triton
import triton.language as tl


def moe_blocks(hidden: int, block_h: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_H, num_warps)``: up to 2048 columns per program (4 KB of bf16 per gathered row), and
    several tokens per program for narrow rows so a step keeps >= 2048 elements (BLOCK_T independent row
    gathers) in flight; gathers are latency bound (TileOPs measured, docs/performance.md §2.5). Pending H100 tuning."""
    block_h = block_h or min(2048, triton.next_power_of_2(max(hidden, 1)))
    block_t = max(1, min(16, 2048 // block_h))
    return block_t, block_h, 4 if block_t * block_h <= 1024 else 8


@triton.jit
def moe_token_permute_grad_kernel(G, IDX, OUT, T, K, A, H, stride_g0, stride_g1,
                                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t, :] = sum_{k = 0..K-1} G[IDX[t*K + k], :]`` in fp32, k in order, one store per token row: no
    zero-fill, no atomics, deterministic (bitwise equal to a sequential fp32 sum). Rows ``IDX >= A`` (dropped by
    the forward) add nothing and are never read, nor are negative ones. K is a runtime loop bound (1..512, no
    recompiles).
    Grid ``(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))``. Bytes: ``T*K*H*s + T*H*s + T*K*s_idx`` (gather form floor).
    """
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = tok < T
    cmask = cols < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in range(K):
        r = tl.load(IDX + tok * K + k, mask=tmask, other=0).to(tl.int64)
        present = tmask & (r >= 0) & (r < A)  # an entry outside [0, T*K) is never read with (the launcher flags it)
        acc += tl.load(G + r[:, None] * stride_g0 + cols[None, :] * stride_g1,
                       mask=present[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    tl.store(OUT + tok[:, None] * H + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


@triton.jit
def moe_token_permute_kernel(TOK, FIRST, PERM, INV, TK, R, K, H, stride_t0, stride_t1,
                             BLOCK_J: tl.constexpr, BLOCK_H: tl.constexpr):
    """Gather after the host's stable argsort ``FIRST`` of the flattened expert ids::

        PERM[j, :] = TOK[FIRST[j] // K, :]     for j < R (rows kept)
        INV[FIRST[j]] = j                      for all j < T*K (int32: CANN's sorted_indices, the inverse)

    FIRST is a permutation, so each INV slot is written once (by the column-block-0 program): no atomics.
    Values are copied bit for bit (no arithmetic). Grid ``(cdiv(T*K, BLOCK_J), cdiv(H, BLOCK_H))``.
    Bytes: ``R*H*s*2 + T*K*(8 + 4)``.
    """
    j = tl.program_id(0).to(tl.int64) * BLOCK_J + tl.arange(0, BLOCK_J)
    cb = tl.program_id(1)
    cols = cb.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    jm = j < TK
    src = tl.load(FIRST + j, mask=jm, other=0).to(tl.int64)
    tl.store(INV + src, j.to(tl.int32), mask=jm & (cb == 0))
    keep = (jm & (j < R))[:, None] & (cols < H)[None, :]
    rows = src // K
    x = tl.load(TOK + rows[:, None] * stride_t0 + cols[None, :] * stride_t1, mask=keep)
    tl.store(PERM + j[:, None] * H + cols[None, :], x, mask=keep)


@triton.jit
def moe_token_unpermute_kernel(X, IDX, P, OUT, T, K, A, H, stride_x0, stride_x1,
                               HAS_PROBS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t, :] = sum_{k<K} P[t, k] * X[IDX[t*K + k], :]`` in fp32, k in order, one store per token row
    (``P`` contiguous (T, K); without probs K = 1 and the weight is 1). Rows ``IDX`` outside ``[0, A)`` add
    nothing and are never read. Grid ``(cdiv(T, BLOCK_T), cdiv(H, BLOCK_H))``. Bytes: ``T*K*H*s + T*H*s +
    T*K*(s_idx + s_p)``."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = tok < T
    cmask = cols < H
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for k in range(K):
        r = tl.load(IDX + tok * K + k, mask=tmask, other=0).to(tl.int64)
        present = tmask & (r >= 0) & (r < A)
        x = tl.load(X + r[:, None] * stride_x0 + cols[None, :] * stride_x1,
                    mask=present[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        if HAS_PROBS:
            w = tl.load(P + tok * K + k, mask=tmask, other=0.0).to(tl.float32)
            acc += w[:, None] * x
        else:
            acc += x
    tl.store(OUT + tok[:, None] * H + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


@triton.jit
def moe_token_unpermute_grad_kernel(X, G, IDX, P, DX, DP, T, K, A, H, stride_x0, stride_x1, stride_g0, stride_g1,
                                    HAS_PROBS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """For each copy (t, k) whose row ``r = IDX[t*K + k]`` lies in ``[0, A)``::

        DX[r, :] = G[t, :] * P[t, k]        (fp32 product, rounded once; G[t] itself without probs)
        DP[t, k] = sum_h G[t, h] * X[r, h]  (fp32; 0 for a dropped row)

    IDX is a checked permutation, so each DX row has one writer (no atomics, no zero-fill); DP's sum runs over
    column blocks in order, each block by tl.sum's fixed tree (deterministic). Grid ``(cdiv(T, BLOCK_T),)``, the
    columns looped so that one program owns a whole dot product. Bytes: ``T*K*H*s_g`` (G re-read per copy, from
    L2) ``+ A*H*(s_x + s_dx) + T*K*(s_idx + s_p + s_dp)``.
    """
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    for k in range(K):
        r = tl.load(IDX + tok * K + k, mask=tmask, other=0).to(tl.int64)
        present = tmask & (r >= 0) & (r < A)
        if HAS_PROBS:
            w = tl.load(P + tok * K + k, mask=tmask, other=0.0).to(tl.float32)
        dot = tl.zeros([BLOCK_T], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H).to(tl.int64)
            m = present[:, None] & (cols < H)[None, :]
            g = tl.load(G + tok[:, None] * stride_g0 + cols[None, :] * stride_g1, mask=m, other=0.0).to(tl.float32)
            if HAS_PROBS:
                x = tl.load(X + r[:, None] * stride_x0 + cols[None, :] * stride_x1, mask=m, other=0.0)
                dot += tl.sum(g * x.to(tl.float32), axis=1)
                tl.store(DX + r[:, None] * H + cols[None, :], (g * w[:, None]).to(DX.dtype.element_ty), mask=m)
            else:
                tl.store(DX + r[:, None] * H + cols[None, :], g.to(DX.dtype.element_ty), mask=m)
        if HAS_PROBS:
            tl.store(DP + tok * K + k, dot.to(DP.dtype.element_ty), mask=tmask)
