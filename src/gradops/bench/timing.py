"""Timers of ``gradops bench``: interleaved wall-clock rounds on the CPU, ``do_bench`` / CUDA events on GPUs.

CPU: every provider of a case runs once per round, round after round, so a noisy neighbour slows all of them
alike instead of whichever happened to run during the noise; each is warmed up first (inductor and Triton
compile then, and the on-disk caches load). Interpreter timings are never taken: the benchmark refuses to run
with ``TRITON_INTERPRET=1`` (see :mod:`gradops.bench`).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Timing:
    """Milliseconds per call: median and the 20th/80th percentiles over ``reps`` calls."""
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(seconds: list[float]) -> Timing:
    ms = sorted(s * 1e3 for s in seconds)
    return Timing(statistics.median(ms), _quantile(ms, 0.2), _quantile(ms, 0.8), len(ms))


def warm_up(fns: dict[str, Callable[[], object]], warmup: int, failures: dict[str, str]) -> dict[str, Callable]:
    """Call each provider ``warmup`` times (compilation happens here); a peer that fails - torch.compile without
    a C++ compiler, a Liger API that changed - is dropped with its error in ``failures``. gradops and copy_
    failing is a bug and raises."""
    kept = {}
    for name, fn in fns.items():
        try:
            for _ in range(warmup):
                fn()
        except Exception as err:
            if name.startswith("gradops") or name == "copy_":
                raise
            failures[name] = f"{type(err).__name__}: {err}"[:300]
            continue
        kept[name] = fn
    return kept


def time_cpu(fns: dict[str, Callable[[], object]], reps: int, budget_s: float, warmup: int = 2,
             failures: dict[str, str] | None = None) -> dict[str, Timing]:
    """Interleaved rounds: at least 3 and at most ``reps`` rounds, stopping early once ``budget_s`` is spent."""
    failures = {} if failures is None else failures
    fns = warm_up(fns, warmup, failures)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # a collection inside a timed call would be charged to whichever provider triggered it
    try:
        start = time.perf_counter()
        for r in range(reps):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
            if r >= 2 and time.perf_counter() - start > budget_s:
                break
    finally:
        if was_enabled:
            gc.enable()
    return {name: summarize(s) for name, s in samples.items()}


def once(fns: dict[str, Callable[[], object]], reps: int, budget_s: float,
         failures: dict[str, str] | None = None) -> dict[str, None]:
    """A dry run's timer: each provider runs once (a peer that fails is dropped into ``failures``, gradops failing
    raises), and nothing is timed: provider -> None. ``reps`` and ``budget_s`` are the timers' signature only."""
    del reps, budget_s
    ran = warm_up(fns, 1, {} if failures is None else failures)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # an asynchronous failure belongs to this run
    return dict.fromkeys(ran)


def time_cuda(fns: dict[str, Callable[[], object]], reps: int, budget_s: float, warmup: int = 2,
              failures: dict[str, str] | None = None) -> dict[str, Timing]:
    """``triton.testing.do_bench`` (L2 flushed between calls) when Triton is installed, else CUDA events."""
    del budget_s
    fns = warm_up(fns, warmup, {} if failures is None else failures)
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    out = {}
    for name, fn in fns.items():
        torch.cuda.synchronize()
        if do_bench is not None:
            med, p20, p80 = do_bench(fn, warmup=25, rep=max(100, reps), quantiles=[0.5, 0.2, 0.8])
            out[name] = Timing(float(med), float(p20), float(p80), reps)
            continue
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name] = summarize(times)
    return out
