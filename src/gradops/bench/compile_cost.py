"""First-call cost of the CPU kernels: cold (an empty cache: the import builds them) vs cached, each in a fresh
process.

The kernels are C++ built once per torch, Python and CPU into the gradops cache dir (at install, or by the first
import); a later process loads the library. This module times ``import gradops.cpu`` plus the first call of every
op of :mod:`gradops.registry` on tiny fp32 and bf16 inputs, in a subprocess whose ``GRADOPS_CACHE_DIR`` is a fresh
temporary directory (cold), then again in a second subprocess on the same directory (cached).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType

import torch


def first_calls(backend: ModuleType, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """One tiny call (8 x 64) of every operator of :mod:`gradops.registry` on ``backend`` (a backend module: its
    2-D functions), its declared example in ``dtype``: what a first call loads and plans."""
    from gradops.registry import OPS

    calls = {}
    for spec in OPS:
        args = spec.example(8, 64, dtype, torch.device("cpu"), torch.Generator().manual_seed(0)).args
        fn = getattr(backend, spec.name)
        calls[spec.name] = lambda fn=fn, args=args: fn(*args)
    return calls


#: Run in the child: import, then one first call per op and dtype, each timed.
_CHILD = r"""
import json, time, torch
t0 = time.perf_counter()
import gradops.cpu as C
times = {"import": time.perf_counter() - t0}
from gradops.bench.compile_cost import first_calls
for dt in (torch.float32, torch.bfloat16):
    for name, fn in first_calls(C, dt).items():
        t = time.perf_counter()
        fn()
        times[f"{name} {str(dt)[6:]}"] = time.perf_counter() - t
print(json.dumps(times))
"""


def _child(cache: str) -> dict[str, float]:
    env = dict(os.environ, GRADOPS_CACHE_DIR=cache)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure() -> int:
    """Print the cold and cached first-call seconds per op and dtype; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="gradops-cold-") as cache:
        cold = _child(cache)
        cached = _child(cache)
    print(f"{'first call':<38} {'cold s':>8} {'cached s':>9}")
    for key in cold:
        print(f"{key:<38} {cold[key]:>8.2f} {cached[key]:>9.3f}")
    print(f"{'total':<38} {sum(cold.values()):>8.2f} {sum(cached.values()):>9.3f}")
    return 0
