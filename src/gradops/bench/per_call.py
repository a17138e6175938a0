"""Per-call cost: every public function at a size where the work is nil (8 x 8 fp32), against its ATen twin.

What a call costs before and after the kernel - validation, the backend decision, allocation, conversion and the
Python around them - is what a small model pays on every step. Each function is timed four ways where they
apply: the eager direct path (what a user gets), the same call with ``out=`` (tensors made once and reused, as a
training loop reuses its buffers), the same call through the ``torch.library`` op (``GRADOPS_EAGER=0``'s path,
:mod:`gradops.ops._direct`), and ATen's kernel for the same work. The forwards
that autograd records are also timed as forward + backward pairs. Timing: the cases run round-robin (so a noisy
neighbour hits all of them alike), 100 calls per round, and the best round's mean is reported.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROUNDS, CALLS = 30, 100


def _cases() -> dict[str, dict[str, Callable[[], object] | None]]:
    import gradops

    g = torch.Generator().manual_seed(0)
    x, dy, gamma, beta = (torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g),
                          torch.randn(8, generator=g))
    _, rstd = gradops.rms_norm(x, gamma)
    _, mean, var = gradops.layer_norm(x, gamma, beta, 1e-5)
    ln_rstd = torch.rsqrt(var + 1e-5)
    idx = torch.randint(0, 8, (8,), generator=g)
    experts = torch.randint(0, 4, (8, 2), generator=g)
    _, sorted_idx = gradops.moe_token_permute(x, experts)
    perm_grad = torch.randn(16, 8, generator=g)
    probs = torch.rand(8, 2, generator=g)
    pg, probs_g = perm_grad.clone().requires_grad_(), probs.clone().requires_grad_()
    ops = torch.ops.gradops
    aten = torch.ops.aten
    xg, wg = x.clone().requires_grad_(), torch.randn(8, 8, generator=g).requires_grad_()
    gg, bg = gamma.clone().requires_grad_(), beta.clone().requires_grad_()

    def pair(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        return lambda: fn().sum().backward()

    def into(fn: Callable[..., object], *args: object) -> Callable[[], object]:
        """fn(*args, out=...) into tensors made once like its results (a preallocated out, as a user reuses it)."""
        result = fn(*args)
        out = tuple(torch.empty_like(r) for r in result) if isinstance(result, tuple) else torch.empty_like(result)
        return lambda: fn(*args, out=out)

    return {
        "rms_norm": {"gradops": lambda: gradops.rms_norm(x, gamma), "op": lambda: ops.rms_norm(x, gamma, 1e-6),
                     "aten": lambda: torch.rms_norm(x, [8], gamma, 1e-6),
                     "out": into(gradops.rms_norm, x, gamma)},
        "rms_norm_grad": {"gradops": lambda: gradops.rms_norm_grad(dy, x, rstd, gamma),
                          "op": lambda: ops.rms_norm_grad(dy, x, rstd, gamma), "aten": None,
                          "out": into(gradops.rms_norm_grad, dy, x, rstd, gamma)},
        "layer_norm": {"gradops": lambda: gradops.layer_norm(x, gamma, beta, 1e-5),
                       "op": lambda: ops.layer_norm(x, gamma, beta, 1e-5),
                       "aten": lambda: torch.native_layer_norm(x, [8], gamma, beta, 1e-5),
                       "out": into(gradops.layer_norm, x, gamma, beta, 1e-5)},
        "layer_norm_backward": {
            "gradops": lambda: gradops.layer_norm_backward(dy, x, mean, ln_rstd, gamma),
            "op": lambda: ops.layer_norm_backward(dy, x, mean, ln_rstd, gamma),
            "aten": lambda: aten.native_layer_norm_backward(dy, x, [8], mean[:, None], ln_rstd[:, None], gamma, beta,
                                                            [True, True, True]),
            "out": into(gradops.layer_norm_backward, dy, x, mean, ln_rstd, gamma)},
        "layer_norm_grad": {"gradops": lambda: gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5),
                            "op": lambda: ops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5), "aten": None,
                            "out": into(gradops.layer_norm_grad, dy, x, var, mean, gamma, 1e-5)},
        "layer_norm_grad_beta": {"gradops": lambda: gradops.layer_norm_grad_beta(x, dy),
                                 "op": lambda: ops.layer_norm_grad_beta(x, dy), "aten": None,
                                 "out": into(gradops.layer_norm_grad_beta, x, dy)},
        "hardswish": {"gradops": lambda: gradops.hardswish(x), "op": lambda: ops.hardswish(x),
                      "aten": lambda: aten.hardswish(x), "out": into(gradops.hardswish, x)},
        "hardswish_backward": {"gradops": lambda: gradops.hardswish_backward(dy, x),
                               "op": lambda: ops.hardswish_backward(dy, x),
                               "aten": lambda: aten.hardswish_backward(dy, x),
                               "out": into(gradops.hardswish_backward, dy, x)},
        "embedding": {"gradops": lambda: gradops.embedding(x, idx), "op": lambda: ops.embedding(x, idx, -1, False),
                      "aten": lambda: aten.embedding(x, idx)},
        "embedding_dense_backward": {
            "gradops": lambda: gradops.embedding_dense_backward(dy, idx, 8),
            "op": lambda: ops.embedding_dense_backward(dy, idx, 8, -1, False),
            "aten": lambda: aten.embedding_dense_backward(dy, idx, 8, -1, False),
            "out": into(gradops.embedding_dense_backward, dy, idx, 8)},
        "moe_token_permute": {"gradops": lambda: gradops.moe_token_permute(x, experts),
                              "op": lambda: ops.moe_token_permute(x, experts, None, False), "aten": None,
                              "out": into(gradops.moe_token_permute, x, experts)},
        "moe_token_permute_grad": {"gradops": lambda: gradops.moe_token_permute_grad(perm_grad, sorted_idx, 2),
                                   "op": lambda: ops.moe_token_permute_grad(perm_grad, sorted_idx, 2, False),
                                   "aten": None, "out": into(gradops.moe_token_permute_grad, perm_grad, sorted_idx, 2)},
        "moe_token_unpermute": {"gradops": lambda: gradops.moe_token_unpermute(perm_grad, sorted_idx, probs),
                                "op": lambda: ops.moe_token_unpermute(perm_grad, sorted_idx, probs, False),
                                "aten": None, "out": into(gradops.moe_token_unpermute, perm_grad, sorted_idx, probs)},
        "moe_token_unpermute_grad": {
            "gradops": lambda: gradops.moe_token_unpermute_grad(perm_grad, x, sorted_idx, probs),
            "op": lambda: ops.moe_token_unpermute_grad(perm_grad, x, sorted_idx, probs, False), "aten": None,
            "out": into(gradops.moe_token_unpermute_grad, perm_grad, x, sorted_idx, probs)},
        "rms_norm fwd+bwd": {"gradops": pair(lambda: gradops.rms_norm(xg, gg)[0]),
                             "op": pair(lambda: ops.rms_norm(xg, gg, 1e-6)[0]),
                             "aten": pair(lambda: torch.rms_norm(xg, [8], gg, 1e-6))},
        "layer_norm fwd+bwd": {"gradops": pair(lambda: gradops.layer_norm(xg, gg, bg, 1e-5)[0]),
                               "op": pair(lambda: ops.layer_norm(xg, gg, bg, 1e-5)[0]),
                               "aten": pair(lambda: torch.nn.functional.layer_norm(xg, [8], gg, bg, 1e-5))},
        "hardswish fwd+bwd": {"gradops": pair(lambda: gradops.hardswish(xg)), "op": pair(lambda: ops.hardswish(xg)),
                              "aten": pair(lambda: torch.nn.functional.hardswish(xg))},
        "embedding fwd+bwd": {"gradops": pair(lambda: gradops.embedding(wg, idx)),
                              "op": pair(lambda: ops.embedding(wg, idx, -1, False)),
                              "aten": pair(lambda: torch.nn.functional.embedding(idx, wg))},
        "moe_token_unpermute fwd+bwd": {"gradops": pair(lambda: gradops.moe_token_unpermute(pg, sorted_idx, probs_g)),
                                        "op": pair(lambda: ops.moe_token_unpermute(pg, sorted_idx, probs_g, False)),
                                        "aten": None},
    }


def _time(cases: dict[str, dict[str, Callable[[], object] | None]]) -> dict[tuple[str, str], float]:
    flat = [(name, kind, fn) for name, kinds in cases.items() for kind, fn in kinds.items() if fn is not None]
    for _, _, fn in flat:
        for _ in range(20):
            fn()
    best: dict[tuple[str, str], float] = {}
    for _ in range(ROUNDS):
        for name, kind, fn in flat:
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            us = (time.perf_counter() - start) / CALLS * 1e6
            best[name, kind] = min(best.get((name, kind), us), us)
    return best


def measure(results: Path | None) -> int:
    """Print the per-call table; append it as JSON lines to ``<results>/per-call-<date>.jsonl`` unless None."""
    from .provenance import environment

    env = environment(torch.device("cpu"), False)
    with torch.no_grad():
        plain = _time({k: v for k, v in _cases().items() if "+" not in k})
    paired = _time({k: v for k, v in _cases().items() if "+" in k})
    best = {**plain, **paired}
    names = list(dict.fromkeys(name for name, _ in best))
    print(f"per call, 8 x 8 fp32, best of {ROUNDS} rounds x {CALLS} calls; {env['device_name']}, torch {env['torch']}, "
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
                     "gradops_us": round(ours, 2), "out_us": round(into, 2) if into else None,
                     "op_path_us": round(op, 2) if op else None, "aten_us": round(ref, 2) if ref else None})
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        path = results / f"per-call-{datetime.date.today().isoformat()}.jsonl"
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"\nwrote {path}")
    return 0
