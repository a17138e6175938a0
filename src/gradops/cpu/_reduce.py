"""The second stage of every cross-row reduction: fold fixed row-block partials, in block order."""

from __future__ import annotations

from numba import njit

from ._numeric import FASTMATH, st


@njit(cache=True, fastmath=FASTMATH)
def fold_partials(partial, out):  # pragma: no cover - compiled
    """``out[j] = sum_b partial[b, j]`` in fp32, in a fixed pairwise order (deterministic), rounded once to out's
    dtype; folds into ``partial[0]`` (scratch). Serial on purpose: the kernels call it after their parallel
    loop, so one op is one parallel region. On a busy machine every region start can wait for a descheduled
    worker (a time slice, ~4-8 ms); a separate parallel reduction measured 16 ms extra at 8192 x 4096 under
    load, the serial fold ~0.1 ms per MiB of partials. Bytes: ``P·N·4 + N·s_out`` (P = row blocks)."""
    nblk, n = partial.shape
    # Pairwise (tree) order: block b absorbs block b + step for step = 1, 2, 4, ... Same adds as a running sum,
    # but the rounding error grows with log2(P) instead of P: a sequential fold of 64 block partials gave float32
    # dgamma errors up to 3.8x PyTorch's (its column sums are cascaded) at 64 x 520.
    step = 1
    while step < nblk:
        for b in range(0, nblk - step, 2 * step):
            acc, row = partial[b], partial[b + step]
            for j in range(n):
                acc[j] += row[j]
        step *= 2
    acc = partial[0]
    for j in range(n):
        st(out, j, acc[j])
