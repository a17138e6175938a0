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
    """One tiny call of every operator of :mod:`gradops.registry` on ``backend`` (a backend module: its 2-D
    functions), inputs in ``dtype``: what a first call compiles."""
    g = torch.Generator().manual_seed(0)
    x, dy, gamma = (torch.randn(8, 64, generator=g).to(dtype), torch.randn(8, 64, generator=g).to(dtype),
                    torch.randn(64, generator=g).to(dtype))
    stat = torch.rand(8, generator=g) + 0.5
    experts = torch.randint(0, 4, (4, 2), generator=g)
    sorted_indices = torch.randperm(8, generator=g).to(torch.int32)
    probs = torch.rand(4, 2, generator=g).to(dtype)
    return {
        "rms_norm": lambda: backend.rms_norm(x, gamma, 1e-6),
        "rms_norm_grad": lambda: backend.rms_norm_grad(dy, x, stat, gamma),
        "layer_norm": lambda: backend.layer_norm(x, gamma, gamma, 1e-5),
        "layer_norm_grad": lambda: backend.layer_norm_grad(dy, x, stat, stat, gamma, 1e-5),
        "layer_norm_grad_beta": lambda: backend.layer_norm_grad_beta(x, dy),
        "layer_norm_backward": lambda: backend.layer_norm_backward(dy, x, stat, stat, gamma),
        "hardswish": lambda: backend.hardswish(x),
        "hardswish_backward": lambda: backend.hardswish_backward(dy, x),
        "embedding_dense_backward": lambda: backend.embedding_dense_backward(dy, torch.arange(8), 10, -1, False),
        "moe_token_permute": lambda: backend.moe_token_permute(x[:4], experts, 8),
        "moe_token_permute_grad": lambda: backend.moe_token_permute_grad(dy, sorted_indices, 2),
        "moe_token_unpermute": lambda: backend.moe_token_unpermute(dy, sorted_indices, probs),
        "moe_token_unpermute_grad": lambda: backend.moe_token_unpermute_grad(dy, x[:4], sorted_indices, probs),
    }


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
