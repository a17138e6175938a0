"""Shared pieces of the norm kernels: the row-tile heuristic and the deterministic reduction of fp32 partials.

Only ``@triton.jit`` code and block-size arithmetic live in ``gradops.kernels``; allocation and launches are in
``gradops.launch``.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

#: Widest row (elements) kept whole in registers. 8192 columns with 16 warps is 16 values per thread per tensor
#: (dy, x, the fp32 dgamma accumulator): no spills. Wider rows loop over column blocks of LOOP_BLOCK_N instead of
#: growing the tile (Liger's and flash-attn's single-tile kernels spill and collapse near 64k columns,
#: docs/performance.md §4). To be re-tuned on H100/H200 (pending: no GPU in the session that wrote this).
MAX_FUSED_N = 8192
LOOP_BLOCK_N = 4096
#: Elements per register tile for narrow rows: several rows per tile so that a tile has >= 2048 elements
#: (16 per thread at 4 warps); with 128 columns that is 16 rows per step.
TILE_ELEMENTS = 2048


class RowConfig(NamedTuple):
    """How a row-wise norm kernel walks an (M, N) problem.

    ``block_m`` rows x ``block_n`` columns per register tile; ``looped`` when a row is wider than one tile
    (then ``block_m == 1`` and the kernel makes two passes over the row's column blocks).
    """

    block_m: int
    block_n: int
    looped: bool
    num_warps: int


def row_config(n_cols: int, max_block_n: int = MAX_FUSED_N, loop_block_n: int = LOOP_BLOCK_N) -> RowConfig:
    """The register tile for rows of ``n_cols`` elements (``max_block_n``/``loop_block_n`` let tests force the
    looped path on small rows)."""
    if n_cols > max_block_n:
        block_n = triton.next_power_of_2(min(loop_block_n, max_block_n))
        return RowConfig(1, block_n, True, _warps(block_n))
    block_n = triton.next_power_of_2(max(n_cols, 1))
    block_m = max(1, TILE_ELEMENTS // block_n)
    return RowConfig(block_m, block_n, False, _warps(block_m * block_n))


def _warps(tile: int) -> int:
    """8 elements per thread per loaded tensor (4 warps at 1k, 8 at 2k, 16 from 4k; 16 at 8k columns). ptxas
    for sm_90a (bf16 rms_norm_grad_kernel): 1x4096 with 8 warps needs 128 registers and spills 12 bytes, with
    16 warps 80 registers and no spill; 1x8192 at 16 warps 127 registers, no spill."""
    return max(4, min(16, tile // 256))


def persistent_programs(sm_count: int, work_items: int, cfg: RowConfig) -> int:
    """Programs of a persistent norm-backward grid: ``sm_count`` times the programs that fit one SM (64 warps
    resident, ~100-128 registers per thread: 4 programs of 4 warps, 2 of 8, 1 of 16; quack uses x16 at N <= 256
    down to x1 at N ~ 8k), never more than there are work items, at least 1. The fp32 partial buffer is
    ``programs x N x 4`` bytes: 4.3 MB at N = 4096 on 132 SMs, ~1% of a 16k x 4096 bf16 backward."""
    per_sm = max(1, 16 // cfg.num_warps)
    return max(1, min(work_items, sm_count * per_sm))


@triton.jit
def sum_partials_kernel(PA, OA, PB, OB, P, N, TWO: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column sums of fp32 partial buffers, in a fixed order (deterministic): ``OA[n] = sum_p PA[p, n]`` (and
    ``OB`` from ``PB`` when ``TWO``), cast once to the output dtype.

    Order: chunks of ``BLOCK_P`` partial rows, each reduced as a tree by ``tl.sum``, chunks added in sequence.
    Grid: ``cdiv(N, BLOCK_N)``. Bytes: ``P*N*4`` read and ``N*s_out`` written per buffer.
    """
    pid = tl.program_id(0)
    cols = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    prow = tl.arange(0, BLOCK_P)
    acc_a = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = (p0 + prow).to(tl.int64)
        offs = rows[:, None] * N + cols[None, :]
        mask = (rows < P)[:, None] & cmask[None, :]
        acc_a += tl.sum(tl.load(PA + offs, mask=mask, other=0.0), axis=0)
        if TWO:
            acc_b += tl.sum(tl.load(PB + offs, mask=mask, other=0.0), axis=0)
    tl.store(OA + cols, acc_a.to(OA.dtype.element_ty), mask=cmask)
    if TWO:
        tl.store(OB + cols, acc_b.to(OB.dtype.element_ty), mask=cmask)
