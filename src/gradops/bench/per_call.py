"""Per-call cost: every public function at a size where the work is nil (8 x 8 fp32), against ATen's kernel.

On CUDA the same calls measure host time: a round issues its 100 calls without waiting for the device (the queue
is drained before the round and after it, outside the timing), so a call's figure is what it costs the host to
validate, plan, allocate and launch, the cost a training step pays per op whatever the GPU does.

What a call costs before and after the kernel - validation, the backend decision, allocation, conversion and the
Python around them - is what a small model pays on every step. Each function is timed four ways where they
apply: the eager direct path (what a user gets), the same call with ``out=`` (tensors made once and reused, as a
training loop reuses its buffers), the same call through the ``torch.library`` op (``GRADOPS_EAGER=0``'s path,
:mod:`gradops.ops._direct`), and ATen's kernel for the same work where ATen has one (the op's declared example
and kernel, :class:`gradops.spec.Example`). The forwards that autograd records
are also timed as forward + backward pairs. Timing: the cases run round-robin (so a noisy
neighbour hits all of them alike), 100 calls per round, and the best round's mean is reported.
"""

from __future__ import annotations

import datetime
import inspect
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROUNDS, CALLS = 30, 100


def _cases(device: torch.device) -> dict[str, dict[str, Callable[[], object] | None]]:
    """Every declared op's 8 x 8 example (:class:`gradops.spec.Example`) on ``device`` four ways, then each forward
    as a forward + backward pair on its floating inputs (the public function, the op, ATen's kernel)."""
    import gradops
    from gradops.registry import SPECS

    def pair(fn: Callable[..., object], args: tuple) -> Callable[[], None]:
        leaves = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                       else a for a in args)

        def run() -> None:
            result = fn(*leaves)
            (result[0] if isinstance(result, tuple) else result).sum().backward()
        return run

    def into(fn: Callable[..., object], args: tuple) -> Callable[[], object]:
        """fn(*args, out=...) into tensors made once like its results (a preallocated out, as a user reuses it)."""
        result = fn(*args)
        out = tuple(torch.empty_like(r) for r in result) if isinstance(result, tuple) else torch.empty_like(result)
        return lambda: fn(*args, out=out)

    def op_args(fn: Callable[..., object], op: torch._ops.OpOverloadPacket, args: tuple) -> tuple:
        """``args`` with the public function's defaults, as many as the op's schema takes (it takes them all)."""
        bound = inspect.signature(fn).bind(*args)
        bound.apply_defaults()
        return tuple(bound.arguments.values())[:len(op.default._schema.arguments)]

    plain, pairs = {}, {}
    for spec in SPECS:
        example = spec.example(8, 8, torch.float32, device, torch.Generator().manual_seed(0))
        args, kernel = example.args, example.kernel
        fn, op = getattr(gradops, spec.name), getattr(torch.ops.gradops, spec.name)
        full = op_args(fn, op, args)
        plain[spec.name] = {"gradops": lambda fn=fn, args=args: fn(*args), "op": lambda op=op, args=full: op(*args),
                            "aten": None if kernel is None else lambda kernel=kernel, args=args: kernel(*args),
                            "out": into(fn, args) if spec.kernels else None}
        if not spec.backward:
            pairs[f"{spec.name} fwd+bwd"] = {"gradops": pair(fn, args), "op": pair(op, full),
                                            "aten": None if kernel is None else pair(kernel, args)}
    return {**plain, **pairs}


def _time(cases: dict[str, dict[str, Callable[[], object] | None]], device: torch.device
          ) -> dict[tuple[str, str], float]:
    flat = [(name, kind, fn) for name, kinds in cases.items() for kind, fn in kinds.items() if fn is not None]
    drain = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _, _, fn in flat:
        for _ in range(20):
            fn()
    best: dict[tuple[str, str], float] = {}
    for _ in range(ROUNDS):
        for name, kind, fn in flat:
            drain()
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            us = (time.perf_counter() - start) / CALLS * 1e6
            drain()
            best[name, kind] = min(best.get((name, kind), us), us)
    return best


def measure(results: Path | None, device: torch.device | None = None) -> int:
    """Print the per-call table on ``device`` (default the CPU; on CUDA host µs, see the module docstring); append it
    as JSON lines to ``<results>/per-call-<date>.jsonl`` (``per-call-cuda-<date>.jsonl`` on CUDA) unless None."""
    from .provenance import environment

    device = device or torch.device("cpu")
    env = environment(device, False)
    with torch.no_grad():
        plain = _time({k: v for k, v in _cases(device).items() if "+" not in k}, device)
    paired = _time({k: v for k, v in _cases(device).items() if "+" in k}, device)
    best = {**plain, **paired}
    names = list(dict.fromkeys(name for name, _ in best))
    what = "host µs per call" if device.type == "cuda" else "per call"
    print(f"{what}, 8 x 8 fp32, best of {ROUNDS} rounds x {CALLS} calls; {env['device_name']}, torch {env['torch']}, "
          f"backend {env['gradops_backend']}")
    print(f"{'function':28s} {'gradops µs':>10s} {'out= µs':>8s} {'via op µs':>10s} {'ATen µs':>8s} "
          f"{'gradops/ATen':>13s}")
    rows = []
    nan = float("nan")
    for name in names:
        ours, op, ref = best[name, "gradops"], best.get((name, "op")), best.get((name, "aten"))
        into = best.get((name, "out"))
        ratio = f"{ours / ref:.1f}x" if ref else "-"
        print(f"{name:28s} {ours:10.1f} {into if into is not None else nan:8.1f} {op:10.1f} "
              f"{ref if ref is not None else nan:8.1f} {ratio:>13s}")
        rows.append({**env, "bench": "per-call", "function": name, "shape": [8, 8], "dtype": "float32",
                     "host_only": device.type == "cuda",
                     "gradops_us": round(ours, 2), "out_us": round(into, 2) if into else None,
                     "op_path_us": round(op, 2) if op else None, "aten_us": round(ref, 2) if ref else None})
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        infix = "-cuda" if device.type == "cuda" else ""
        path = results / f"per-call{infix}-{datetime.date.today().isoformat()}.jsonl"
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"\nwrote {path}")
    return 0
