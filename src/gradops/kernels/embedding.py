"""aclnnEmbeddingDenseBackward as a deterministic segment-sum Triton kernel over sorted indices."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl


class EmbeddingConfig(NamedTuple):
    rows_per_program: int  # output rows (V) one program walks
    block_t: int           # gathered grad rows per step (memory-level parallelism inside a segment)
    block_e: int           # columns per program
    num_warps: int


def embedding_config(dim: int, rows_per_program: int = 8, block_t: int | None = None,
                     block_e: int | None = None) -> EmbeddingConfig:
    """Up to 512 columns per program (a heavy segment, e.g. one token repeated thousands of times, is then split
    over E/512 programs), BLOCK_T gathered rows per step so that a step has ~4096 elements in flight, 8 output
    rows per program (untouched rows cost one 16-byte offset load and one row store). Pending H100 tuning."""
    block_e = block_e or min(512, triton.next_power_of_2(max(dim, 1)))
    block_t = block_t or max(1, min(16, 4096 // block_e))
    return EmbeddingConfig(rows_per_program, block_t, block_e, 8 if block_t * block_e >= 2048 else 4)


@triton.jit
def embedding_dense_backward_kernel(G, PERM, OFFS, OUT, V, E, stride_g0, stride_g1, padding_idx, rows_per_program,
                                    SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """Every output row written exactly once (the zero-fill of untouched rows is fused)::

        out[v, :] = 0                                               if v == padding_idx or v is never indexed
                  = (sum_{j in [OFFS[v], OFFS[v+1])} G[PERM[j], :]) / (count[v] if SCALE else 1)   otherwise

    PERM is a STABLE argsort of the indices and OFFS[v] = first sorted position >= v (so count[v] = OFFS[v+1] -
    OFFS[v], padding occurrences included, as CANN). Sums in fp32: BLOCK_T rows per step accumulated lane-wise in
    index order, lanes tree-summed at the end: a fixed order, so results are bitwise reproducible; no atomics.
    Grid ``(cdiv(V, rows_per_program), cdiv(E, BLOCK_E))``.
    Bytes: ``N*E*s_g + V*E*s_out + N*8 (PERM) + V*8 (OFFS)`` (+ the sort, ~``4*N*8``).
    """
    pid_v = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    lanes = tl.arange(0, BLOCK_T)
    for i in range(rows_per_program):
        v = pid_v * rows_per_program + i
        live = v < V
        start = tl.load(OFFS + v, mask=live, other=0)
        end = tl.load(OFFS + v + 1, mask=live, other=0)
        stop = tl.where(v == padding_idx, start, end)  # the padding row sums nothing
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for j0 in range(start, stop, BLOCK_T):
            j = j0 + lanes
            jm = j < stop
            src = tl.load(PERM + j, mask=jm, other=0)
            acc += tl.load(G + src[:, None] * stride_g0 + cols[None, :] * stride_g1,
                           mask=jm[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0)
        if SCALE:
            total = total / tl.maximum(end - start, 1).to(tl.float32)
        tl.store(OUT + v * E + cols, total.to(OUT.dtype.element_ty), mask=cmask & live)
