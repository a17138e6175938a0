"""aclnnEmbeddingDenseBackward as a deterministic segment-sum Triton kernel over sorted indices."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl


class EmbeddingConfig(NamedTuple):
    block_t: int    # gathered grad rows per step (memory-level parallelism inside a segment)
    block_e: int    # columns per program
    num_warps: int


def embedding_config(dim: int, block_t: int | None = None, block_e: int | None = None) -> EmbeddingConfig:
    """Up to 1024 columns per program (a heavy segment, e.g. one token repeated thousands of times, is then split
    over E/1024 programs) and BLOCK_T gathered rows per step so that a step has ~4096 elements in flight, at 4 warps.
    Kernel alone on an H100, bf16 / fp32 µs (BLOCK_T x BLOCK_E): T=16384 E=4096 V=128256: 4x1024 576 / 962,
    4x512 1048 / 988, 8x256 2701 / 1210 (ATen 1351 / 1709, its fill alone 321 / 644); T=8192 E=1024 V=32000:
    4x1024 244 / 264, 4x512 316 / 235; T=4096 E=4096 V=151936: 4x1024 486 / 880, 4x512 611 / 882."""
    block_e = block_e or min(1024, triton.next_power_of_2(max(dim, 1)))
    block_t = block_t or max(1, min(16, 4096 // block_e))
    return EmbeddingConfig(block_t, block_e, 4)


@triton.jit
def embedding_dense_backward_kernel(G, KEYS, PERM, OFFS, OUT, V, E, stride_g0, stride_g1, padding_idx,
                                    SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """The rows of the table that some index names, each written exactly once by the program of its segment's
    first sorted position (OUT is zero-filled beforehand: untouched rows and the padding row stay zero)::

        out[v, :] = (sum_{j in [OFFS[v], OFFS[v+1])} G[PERM[j], :]) / (count[v] if SCALE else 1)

    KEYS are the indices sorted, PERM a STABLE argsort of them and OFFS[v] the first sorted position >= v (so
    count[v] = OFFS[v+1] - OFFS[v], padding occurrences included, as CANN). A key outside [0, V) heads no segment:
    it never addresses OFFS or OUT. Sums in fp32: BLOCK_T rows per step accumulated lane-wise in index order, lanes
    tree-summed at the end: a fixed order, so results are bitwise reproducible; no atomics.
    Grid ``(N, cdiv(E, BLOCK_E))``: one program per sorted position; those that head no segment stop after two loads.
    Bytes: ``N*E*s_g + U*E*s_out + N*8*3 + U*8`` for U distinct indices (+ the fill ``V*E*s_out`` and the sort).
    """
    j = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    key = tl.load(KEYS + j)
    prev = tl.load(KEYS + j - 1, mask=j > 0, other=-1)
    if ((j == 0) | (prev != key)) & (key >= 0) & (key < V) & (key != padding_idx):
        end = tl.load(OFFS + key + 1)
        lanes = tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for j0 in range(j, end, BLOCK_T):
            rows = j0 + lanes
            live = rows < end
            src = tl.load(PERM + rows, mask=live, other=0)
            acc += tl.load(G + src[:, None] * stride_g0 + cols[None, :] * stride_g1,
                           mask=live[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0)
        if SCALE:
            total = total / (end - j).to(tl.float32)
        tl.store(OUT + key * E + cols, total.to(OUT.dtype.element_ty), mask=cmask)
