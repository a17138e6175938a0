"""``gradops bench --sweep``: each ``gradops.nn`` module against its ``torch.nn`` twin, forward + backward, from
8 x 8 to the sizes where the kernels win, in one run.

What a user swaps in is a module at the size they train; this answers "is it slower there?" for every size at
once. Each case times one training-style step - forward, a dense upstream gradient (``(y * w).sum()``, so the
backward sees a contiguous gradient as it does after a Linear), backward - for gradops' module and torch's,
round-robin (a noisy neighbour hits both alike), and reports the best round's mean and the ratio
gradops / torch (below 1: gradops faster). ``torch.compile`` of the torch twin joins with ``--sweep-compile``
(one compilation per case, outside the timed rounds: minutes on a small CPU). Writes
``sweep-<device>-<date>.jsonl`` and, with matplotlib, ``sweep-<device>-<date>.png`` (ratio against elements, one
line per module and dtype).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

#: (rows, columns) of the activation: 8 x 8 up to 4096 x 1024 (issue 9's table, plus the per-call end).
SIZES = ((8, 8), (64, 128), (512, 256), (2048, 512), (4096, 1024))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODULES = ("RMSNorm", "LayerNorm", "Hardswish", "Embedding")
#: Embedding: rows are tokens, columns the embedding width; the table has this many rows.
VOCAB = 32000


#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_malloc() -> str:
    """Make this process's glibc malloc keep freed memory mapped; return what the records should say.

    With glibc's defaults, freeing a tensor can trim the heap's top (or unmap a chunk above the dynamic mmap
    threshold), and the next step's allocation of the same size takes its page faults again. Whether a step pays
    that depends on what ran before it in the process, not on the op: on the CI VM (2026-11-24) torch.nn.LayerNorm
    at 512 x 256 fp32 settled at 0 or at 54-62 faults per step (0.16 or 0.28 ms) from one process to the next,
    and gradops' module swung the same way (its 512 KiB outputs come from malloc too). A trim threshold of 1 GiB and
    a fixed mmap threshold of 32 MiB (the largest glibc takes) keep every freed block below 32 MiB mapped, as
    jemalloc and tcmalloc do: the sweep then times the ops. gradops' own outputs from 1 MiB on come from its pool
    either way (gradops/native/autograd.cpp). Elsewhere than glibc nothing is changed."""
    if not sys.platform.startswith("linux"):
        return "platform default"
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (OSError, AttributeError):
        return "platform default"  # musl or another libc: no mallopt to call
    if libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) and libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20):
        return f"glibc {version}: no trimming, mmap from 32 MiB"
    return f"glibc {version} defaults"


def _pair(name: str, cols: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    import gradops.nn as gnn

    torch.manual_seed(0)
    make = {
        "RMSNorm": lambda ns: ns.RMSNorm(cols, eps=1e-6),
        "LayerNorm": lambda ns: ns.LayerNorm(cols),
        "Hardswish": lambda ns: ns.Hardswish(),
        "Embedding": lambda ns: ns.Embedding(VOCAB, cols),
    }[name]
    twin = make(torch.nn).to(device, dtype)
    ours = make(gnn).to(device, dtype)
    ours.load_state_dict(twin.state_dict())
    return ours, twin


def _step(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    params = list(module.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        if x.requires_grad:
            x.grad = None
        (module(x) * w).sum().backward()

    return run


def _time(cases: dict[str, Callable[[], None]], budget_s: float, sync: Callable[[], None]) -> dict[str, float]:
    for fn in cases.values():
        for _ in range(3):
            fn()
    sync()
    # calls per round: about 20 ms of an average case (from one probe round), at least 2
    start = time.perf_counter()
    for fn in cases.values():
        fn()
    sync()
    per_round = max(2, int(0.02 / max(1e-6, (time.perf_counter() - start) / len(cases))))
    best: dict[str, float] = {}
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < 5 or (time.perf_counter() < deadline and rounds < 30):
        for name, fn in cases.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            sync()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) / per_round * 1e6)
        rounds += 1
    return best


def run(device: torch.device, dtypes: list[str], compile_twin: bool, budget_s: float, results: Path | None,
        env: dict) -> int:
    """Print the sweep table; write JSONL (and PNG) under ``results`` unless None."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    rows: list[dict] = []
    head = f"{'module':<10} {'size':>11} {'dtype':<5} {'gradops µs':>11} {'torch µs':>10} {'ratio':>6}"
    if compile_twin:
        head += f" {'compile µs':>11} {'ratio':>6}"
    print(f"gradops bench --sweep on {env['device_name']}: torch {env['torch']}, numba {env['numba']}, "
          f"backend {env['gradops_backend']}" + (f", malloc {env['malloc']}" if "malloc" in env else "")
          + "; forward + backward per step, best round's mean", flush=True)
    print(head + "\n" + "-" * len(head), flush=True)
    for name in MODULES:
        for dname in dtypes:
            dtype = DTYPES[dname]
            for rows_n, cols in SIZES:
                ours, twin = _pair(name, cols, dtype, device)
                g = torch.Generator(device="cpu").manual_seed(rows_n * cols)
                if name == "Embedding":
                    x = torch.randint(0, VOCAB, (rows_n,), generator=g).to(device)
                    w = torch.randn(rows_n, cols, generator=g).to(device, dtype)
                else:
                    x = torch.randn(rows_n, cols, generator=g).to(device, dtype).requires_grad_()
                    w = torch.randn(rows_n, cols, generator=g).to(device, dtype)
                cases = {"gradops": _step(ours, x, w), "torch": _step(twin, x, w)}
                if compile_twin:  # one compilation per case: its parameters' shapes change with the size
                    # A fresh start each time: dynamo stops compiling a function after config.recompile_limit (8)
                    # recompilations and runs it eagerly from then on (a first run from RMSNorm bf16 2048x512 on
                    # timed torch's eager module in the compile column, 2026-11-24).
                    torch._dynamo.reset()
                    cases["compile"] = _step(torch.compile(twin), x, w)
                best = _time(cases, budget_s, sync)
                ratio = best["gradops"] / best["torch"]
                line = (f"{name:<10} {f'{rows_n}x{cols}':>11} {dname:<5} {best['gradops']:>11.1f} "
                        f"{best['torch']:>10.1f} {ratio:>6.2f}")
                rec = {**env, "bench": "sweep", "module": name, "rows": rows_n, "cols": cols, "dtype": dname,
                       "gradops_us": round(best["gradops"], 2), "torch_us": round(best["torch"], 2),
                       "ratio": float(f"{ratio:.4g}")}  # significant digits: a ratio of 0.04 keeps 4
                if compile_twin:
                    line += f" {best['compile']:>11.1f} {best['gradops'] / best['compile']:>6.2f}"
                    rec["compile_us"] = round(best["compile"], 2)
                print(line, flush=True)
                rows.append(rec)
    if results is not None and rows:
        stem = f"sweep-{device.type}-{datetime.date.today().isoformat()}"
        results.mkdir(parents=True, exist_ok=True)
        with (results / f"{stem}.jsonl").open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        drawn = plot(rows, results / f"{stem}.png")
        print(f"\nwrote {results / (stem + '.jsonl')}" + (f" and {stem}.png" if drawn else ""))
    return 0


def plot(rows: list[dict], path: Path) -> bool:
    """gradops / torch against elements per module and dtype (log x); False without matplotlib."""
    try:
        os.environ.setdefault("MPLBACKEND", "Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault(f"{r['module']} {r['dtype']}", []).append((r["rows"] * r["cols"], r["ratio"]))
    for label, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.axhline(1.0, color="black", linestyle="dashed", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("elements per activation (rows x columns)")
    ax.set_ylabel("time gradops / torch (forward + backward; below 1: gradops faster)")
    ax.set_title(f"gradops.nn vs torch.nn — {rows[0].get('device_name', '')}" if rows else "gradops.nn vs torch.nn")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
