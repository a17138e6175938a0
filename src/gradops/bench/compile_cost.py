"""First-call cost of the compiled CPU kernels: cold (empty numba cache) vs cached, each in a fresh process.

numba compiles a kernel for each dtype combination on its first call and, with ``cache=True``, stores the
machine code under the gradops cache dir; a later process loads it instead of compiling. This module times
``import gradops.cpu`` plus the first call of every op on tiny fp32 and bf16 inputs, in a subprocess whose
``GRADOPS_CACHE_DIR`` is a fresh temporary directory (cold), then again in a second subprocess on the same
directory (cached).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

#: Run in the child: import, then one first call per op and dtype, each timed.
_CHILD = r"""
import json, time, torch
t0 = time.perf_counter()
import gradops.cpu as C
times = {"import": time.perf_counter() - t0}
for dt in (torch.float32, torch.bfloat16):
    x, dy, g = torch.randn(8, 64).to(dt), torch.randn(8, 64).to(dt), torch.randn(64).to(dt)
    r = torch.rand(8) + 0.5
    calls = {
        "rms_norm": lambda: C.rms_norm(x, g, 1e-6),
        "rms_norm_grad": lambda: C.rms_norm_grad(dy, x, r, g),
        "layer_norm": lambda: C.layer_norm(x, g, g, 1e-5),
        "layer_norm_grad": lambda: C.layer_norm_grad(dy, x, r, r, g, 1e-5),
        "layer_norm_grad_beta": lambda: C.layer_norm_grad_beta(x, dy),
        "layer_norm_backward": lambda: C.layer_norm_backward(dy, x, r, r, g),
        "hardswish": lambda: C.hardswish(x),
        "hardswish_backward": lambda: C.hardswish_backward(dy, x),
        "embedding_dense_backward": lambda: C.embedding_dense_backward(dy, torch.arange(8), 10, -1, False),
        "moe_token_permute_grad": lambda: C.moe_token_permute_grad(dy, torch.arange(8, dtype=torch.int32), 2),
    }
    for name, fn in calls.items():
        t = time.perf_counter()
        fn()
        times[f"{name} {str(dt)[6:]}"] = time.perf_counter() - t
print(json.dumps(times))
"""


def _child(cache: str) -> dict[str, float]:
    env = dict(os.environ, GRADOPS_CACHE_DIR=cache)
    env.pop("NUMBA_CACHE_DIR", None)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure() -> int:
    """Print the cold and cached first-call seconds per op and dtype; returns the exit code."""
    with tempfile.TemporaryDirectory(prefix="gradops-numba-") as cache:
        cold = _child(cache)
        cached = _child(cache)
    print(f"{'first call':<38} {'cold s':>8} {'cached s':>9}")
    for key in cold:
        print(f"{key:<38} {cold[key]:>8.2f} {cached[key]:>9.3f}")
    print(f"{'total':<38} {sum(cold.values()):>8.2f} {sum(cached.values()):>9.3f}")
    return 0
