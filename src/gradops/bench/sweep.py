"""``gradops bench --sweep``: each ``gradops.nn`` module against its ``torch.nn`` twin, forward + backward, and each
backward function against what it replaces, from 8 x 8 to the sizes where the kernels win, in one run.

What a user swaps in is a module at the size they train; this answers "is it slower there?" for every size at
once. Each case times one training-style step - forward, a dense upstream gradient (``(y * w).sum()``, so the
backward sees a contiguous gradient as it does after a Linear), backward - for gradops' module and torch's, in
alternating rounds, in a few fresh worker processes of its own (see :func:`run`), and reports each side's median
round and the ratio gradops / torch (below 1: gradops faster): per process the median over rounds of the two
sides' ratio in the same round, over processes the median of those. ``torch.compile`` of the torch twin joins
with ``--sweep-compile`` (compiled in each worker, outside the timed rounds).

The functions' part times each public backward function (``gradops bench``'s cases, :mod:`gradops.bench.cases`)
the same way against its ``eager`` provider - the ATen kernel it replaces where there is one
(``native_layer_norm_backward``, ``hardswish_backward``, ``embedding_dense_backward``), else the PyTorch code a
model runs (:data:`gradops.bench.cases.EAGER`) - and, with ``--sweep-compile``, ``torch.compile`` of gradops' pure
torch reference; each size maps to the op's shape by :func:`op_shape`.

Writes ``sweep-<device>-<date>.jsonl`` (with each process's ratio; a module's record names its ``module``, a
function's its ``op``) and, with matplotlib, ``sweep-<device>-<date>.png`` (ratio against elements, one line per
module or function and dtype).
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradops.registry import BENCH, timing

#: (rows, columns) of the activation: 8 x 8 up to 4096 x 1024 (issue 9's table, plus the per-call end).
SIZES = ((8, 8), (64, 128), (512, 256), (2048, 512), (4096, 1024))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODULES = ("RMSNorm", "LayerNorm", "Hardswish", "Embedding")
#: The backward functions, as ``gradops bench`` names its cases.
OPS = BENCH
#: Embedding: rows are tokens, columns the embedding width; the table has this many rows.
VOCAB = 32000
#: ``--dry-run``'s table: the interpreter's embedding backward at 32000 rows takes a minute.
DRY_VOCAB = 64
#: The MoE functions: rows are tokens, each routed to this many experts (Mixtral's top-2), columns the hidden size.
TOP_K = 2
#: Worker processes per case (see :func:`run`); ``--processes`` changes it.
PROCESSES = 3
#: Rounds per case and process at most: 8 x 8 cases take ~0.1 ms a step, so 2 s would allow thousands.
MAX_ROUNDS = 100


#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def steady_malloc() -> str:
    """Make this process's glibc malloc keep freed memory mapped; return what the records should say.

    With glibc's defaults, freeing a tensor can trim the heap's top (or unmap a chunk above the dynamic mmap
    threshold), and the next step's allocation of the same size takes its page faults again. Whether a step pays
    that depends on what ran before it in the process, not on the op: on 2 cores torch.nn.LayerNorm
    at 512 x 256 fp32 settled at 0 or at 54-62 faults per step (0.16 or 0.28 ms) from one process to the next,
    and gradops' module swung the same way (its 512 KiB outputs come from malloc too). A trim threshold of 1 GiB and
    a fixed mmap threshold of 32 MiB (the largest glibc takes) keep every freed block below 32 MiB mapped, as
    jemalloc and tcmalloc do: the sweep then times the ops. gradops' own outputs from 1 MiB on come from its pool
    either way (gradops/native/pool.cpp). Elsewhere than glibc nothing is changed."""
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


def _pair(name: str, cols: int, dtype: torch.dtype, device: torch.device,
          vocab: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    import gradops.nn as gnn

    torch.manual_seed(0)
    make = {
        "RMSNorm": lambda ns: ns.RMSNorm(cols, eps=1e-6),
        "LayerNorm": lambda ns: ns.LayerNorm(cols),
        "Hardswish": lambda ns: ns.Hardswish(),
        "Embedding": lambda ns: ns.Embedding(vocab, cols),
    }[name]
    twin = make(torch.nn).to(device, dtype)
    ours = make(gnn).to(device, dtype)
    ours.load_state_dict(twin.state_dict())
    return ours, twin


def op_shape(op: str, rows: int, cols: int, vocab: int) -> dict:
    """The shape of ``gradops bench`` case ``op`` at a sweep size, as the op declares it
    (:attr:`gradops.spec.Bench.sizes`: the norms' M x N, hardswish's ``rows·cols`` elements, the embedding's T
    tokens of width D into a ``vocab``-row table, the MoE functions' T tokens of hidden size H routed to
    :data:`TOP_K` experts each)."""
    if op not in BENCH:
        raise ValueError(f"no sweep shape for {op!r}")
    return timing(op)[0].sizes(rows, cols, vocab, TOP_K)


def _step(module: torch.nn.Module, x: torch.Tensor, w: torch.Tensor) -> Callable[[], None]:
    params = list(module.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        if x.requires_grad:
            x.grad = None
        (module(x) * w).sum().backward()

    return run


def _rounds(cases: dict[str, Callable[[], None]], budget_s: float, sync: Callable[[], None]) -> dict[str, list[float]]:
    """Each case's mean step time (µs) per round: at least 5 rounds, then more until ``budget_s`` (at most
    :data:`MAX_ROUNDS`). Within a round the cases run back to back, in reverse order every other round, so that
    neither side always follows the same one (the torch.compile twin leaves its own buffers in the caches)."""
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
    means: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    deadline = time.perf_counter() + budget_s
    while len(means[names[0]]) < 5 or (time.perf_counter() < deadline and len(means[names[0]]) < MAX_ROUNDS):
        for name in names if len(means[names[0]]) % 2 == 0 else reversed(names):
            fn = cases[name]
            sync()
            t0 = time.perf_counter()
            for _ in range(per_round):
                fn()
            sync()
            means[name].append((time.perf_counter() - t0) / per_round * 1e6)
    return means


def _paired(ours: list[float], theirs: list[float]) -> float:
    """Median over rounds of ours / theirs in the same round: a slow stretch of a shared VM that lands on one
    round moves both sides of that round's ratio, where the ratio of each side's own best round compares
    different moments (on 2 cores: Hardswish 4096 x 1024 fp32 1.17 by best rounds, 1.04 paired)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def _module_cases(spec: dict, device: torch.device) -> dict[str, Callable[[], None]]:
    """A module's training step for gradops' module, torch's twin and (``spec["compile"]``) the compiled twin."""
    name, rows_n, cols, dtype = spec["module"], spec["rows"], spec["cols"], DTYPES[spec["dtype"]]
    ours, twin = _pair(name, cols, dtype, device, spec["vocab"])
    g = torch.Generator(device="cpu").manual_seed(rows_n * cols)
    if name == "Embedding":
        x = torch.randint(0, spec["vocab"], (rows_n,), generator=g).to(device)
        w = torch.randn(rows_n, cols, generator=g).to(device, dtype)
    else:
        x = torch.randn(rows_n, cols, generator=g).to(device, dtype).requires_grad_()
        w = torch.randn(rows_n, cols, generator=g).to(device, dtype)
    cases = {"gradops": _step(ours, x, w), "torch": _step(twin, x, w)}
    if spec["compile"]:  # compiled here; its first calls are _rounds' warm-up, outside the timed rounds
        cases["compile"] = _step(torch.compile(twin), x, w)
    return cases


def _op_cases(spec: dict, device: torch.device) -> dict[str, Callable[[], None]]:
    """A backward function as a user calls it (new outputs), its eager twin and (``spec["compile"]``) the compiled
    reference: ``gradops bench``'s providers of the case at :func:`op_shape`."""
    from .cases import BUILDERS

    torch.manual_seed(spec["rows"] * spec["cols"])
    case = BUILDERS[spec["op"]](op_shape(spec["op"], spec["rows"], spec["cols"], spec["vocab"]),
                                DTYPES[spec["dtype"]], device, {"compile"} if spec["compile"] else set())
    cases = {"gradops": case.providers["gradops"], "torch": case.providers["eager"]}
    if spec["compile"]:
        if "compile" not in case.providers:
            raise RuntimeError(f"{spec['op']}: {case.notes.get('compile', 'no compiled twin')}")
        cases["compile"] = case.providers["compile"]
    return cases


def measure(spec: dict) -> dict:
    """One case in this process (a worker's job): ``spec`` names the module (or the backward function, ``op``),
    size, dtype, device, whether the compiled twin joins, the timing budget, the Embedding vocabulary and the
    allocator setting. Returns each side's median round (µs), the paired ratios and the number of rounds."""
    device = torch.device(spec["device"])
    malloc = {"steady": steady_malloc, "glibc": lambda: "glibc defaults"}.get(spec["malloc"], lambda: None)()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cases = (_op_cases if "op" in spec else _module_cases)(spec, device)
    if spec.get("dry_run"):  # each side's step once, nothing timed
        for fn in cases.values():
            fn()
        sync()
        return {"malloc": malloc, "rounds": 0, "ran": list(cases)}
    means = _rounds(cases, spec["budget"], sync)
    out = {"malloc": malloc, "rounds": len(means["gradops"]), "ratio": _paired(means["gradops"], means["torch"])}
    for side, values in means.items():
        out[f"{side}_us"] = statistics.median(values)
    if spec["compile"]:
        out["compile_ratio"] = _paired(means["gradops"], means["compile"])
    return out


def _worker(spec: dict) -> dict:
    """:func:`measure` in a fresh interpreter (``python -m gradops.bench.sweep SPEC``); its last stdout line."""
    done = subprocess.run([sys.executable, "-m", __name__, json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        what = spec.get("module", spec.get("op"))
        raise RuntimeError(f"sweep worker for {what} {spec['rows']}x{spec['cols']} {spec['dtype']} "
                           f"exited {done.returncode}:\n{done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _case(spec: dict, processes: int, env: dict) -> tuple[dict, str]:
    """One case in ``processes`` workers (0: in this process): its JSONL record and its table line (after the
    name)."""
    got = [_worker(spec) for _ in range(processes)] if processes else [measure(spec)]
    kind = "module" if "module" in spec else "op"
    size = f"{spec['rows']}x{spec['cols']}"
    if spec.get("dry_run"):
        rec = {**env, "bench": "sweep", kind: spec[kind], "rows": spec["rows"], "cols": spec["cols"],
               "dtype": spec["dtype"], "ran": got[0]["ran"], "processes": processes}
        return rec, f"{size:>11} {spec['dtype']:<5} ran {', '.join(got[0]['ran'])} once (dry run: no times)"
    ratios = [w["ratio"] for w in got]
    ratio = statistics.median(ratios)
    gradops_us = statistics.median(w["gradops_us"] for w in got)
    torch_us = statistics.median(w["torch_us"] for w in got)
    line = (f"{size:>11} {spec['dtype']:<5} {gradops_us:>11.1f} {torch_us:>10.1f} {ratio:>6.2f} "
            f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>11}")
    rec = {**env, "bench": "sweep", kind: spec[kind], "rows": spec["rows"], "cols": spec["cols"],
           "dtype": spec["dtype"], "gradops_us": round(gradops_us, 2), "torch_us": round(torch_us, 2),
           "ratio": float(f"{ratio:.4g}"),  # significant digits: a ratio of 0.04 keeps 4
           "ratios": [float(f"{r:.4g}") for r in ratios], "processes": processes,
           "rounds": [w["rounds"] for w in got], "estimator": "median over processes of the median paired round ratio"}
    if not processes:
        rec["estimator"] = "median paired round ratio, in the parent process"
    if kind == "op":
        from .cases import EAGER

        rec["shape"] = op_shape(spec["op"], spec["rows"], spec["cols"], spec["vocab"])
        rec["twin"] = EAGER[spec["op"]]
    if got[0]["malloc"]:
        rec["malloc"] = got[0]["malloc"]
    if spec["compile"]:
        compile_us = statistics.median(w["compile_us"] for w in got)
        compile_ratio = statistics.median(w["compile_ratio"] for w in got)
        line += f" {compile_us:>11.1f} {compile_ratio:>6.2f}"
        rec["compile_us"] = round(compile_us, 2)
        rec["compile_ratio"] = float(f"{compile_ratio:.4g}")
    return rec, line


def run(device: torch.device, dtypes: list[str], compile_twin: bool, budget_s: float, results: Path | None,
        env: dict, processes: int = PROCESSES, malloc: str | None = "steady",
        sizes: tuple[tuple[int, int], ...] | None = None, dry: bool = False) -> int:
    """Print the sweep table; write JSONL (and PNG) under ``results`` unless None. ``sizes``: (rows, columns) of
    the activations (default :data:`SIZES`); ``dry``: each case's sides run once, nothing timed (``--dry-run``).

    Every case is timed in ``processes`` fresh worker processes, one after another, and reported by the median
    of their paired ratios (with the lowest and highest). Why not all cases in one process, as before: what ran
    earlier in a process moved both sides' times by 10-50% and the ratio by up to 0.12 (four fp32 sweeps on 2
    cores, with and without ``gradops.empty_cache()`` before each case: LayerNorm 512 x 256 0.94 / 1.05,
    Hardswish 2048 x 512 1.06 / 0.90, repeatable per pattern), so a case's number depended on its place in the
    list. Why several: a fresh process still lands its buffers somewhere new, and on 2 shared cores the same case's
    paired ratio differed by up to 0.2 from one process to the next (Hardswish 2048 x 512 fp32: 0.88-1.10 over
    ten processes; a shared machine's state moves within minutes too). pyperf spawns worker processes for the same
    reason."""
    rows: list[dict] = []
    sizes = sizes or SIZES
    stem = f"sweep-{device.type}-{datetime.date.today().isoformat()}"
    where = (f"each case in {processes} fresh process{'es' if processes > 1 else ''}" if processes else
             "every case in this process")
    print(f"gradops bench --sweep{' --dry-run (no times)' if dry else ''} on {env['device_name']}: torch "
          f"{env['torch']}, backend {env['gradops_backend']}; {where}: median round, median "
          "paired ratio (range: per process)", flush=True)
    parts = (("module", MODULES, 10, "modules, forward + backward per step, against torch.nn"),
             ("op", OPS, 24, "backward functions against their eager twin (gradops.bench.cases.EAGER)"))
    for kind, names, width, title in parts:
        head = (f"{kind:<{width}} {'size':>11} {'dtype':<5} {'gradops µs':>11} {'torch µs':>10} {'ratio':>6} "
                f"{'range':>11}")
        if compile_twin:
            head += f" {'compile µs':>11} {'ratio':>6}"
        print(f"\n{title}\n{head}\n{'-' * len(head)}", flush=True)
        for name in names:
            for dname in dtypes:
                for rows_n, cols in sizes:
                    spec = {kind: name, "rows": rows_n, "cols": cols, "dtype": dname, "device": str(device),
                            "compile": compile_twin, "budget": budget_s, "vocab": DRY_VOCAB if dry else VOCAB,
                            "malloc": malloc,
                            **({"dry_run": True} if dry else {})}
                    rec, line = _case(spec, processes, env)
                    print(f"{name:<{width}} {line}", flush=True)
                    rows.append(rec)
                    if results is not None:  # case by case: a run stopped by a time limit keeps what it measured
                        results.mkdir(parents=True, exist_ok=True)
                        with (results / f"{stem}.jsonl").open("a") as f:
                            f.write(json.dumps(rec) + "\n")
    if results is not None and rows:
        drawn = plot(rows, results / f"{stem}.png")
        print(f"\nwrote {results / (stem + '.jsonl')}" + (f" and {stem}.png" if drawn else ""))
    return 0


def plot(rows: list[dict], path: Path) -> bool:
    """gradops / torch against elements per module and dtype (log x); False without matplotlib."""
    if any("ratio" not in r for r in rows):
        from .report import dry_plot

        return dry_plot(rows, path, "gradops bench --sweep")
    try:
        os.environ.setdefault("MPLBACKEND", "Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(kind, ylabel, title) for kind, ylabel, title in (
        ("module", "time gradops / torch (forward + backward)", "gradops.nn vs torch.nn"),
        ("op", "time gradops / eager twin", "backward functions vs their eager twin"),
    ) if any(kind in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(8 * len(panels), 5), squeeze=False)
    device = rows[0].get("device_name", "") if rows else ""
    for ax, (kind, ylabel, title) in zip(axes[0], panels):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if kind in r:
                series.setdefault((r[kind], r["dtype"]), []).append((r["rows"] * r["cols"], r["ratio"]))
        names = list(dict.fromkeys(name for name, _ in series))
        for (name, dtype), points in series.items():
            points.sort()
            # a colour per module or function, a line style per dtype: 14 function series would repeat the
            # default 10-colour cycle (two functions drawn alike)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{name} {dtype}",
                    color=plt.get_cmap("tab10")(names.index(name) % 10),
                    linestyle="solid" if dtype == "fp32" else "dashed")
        ax.axhline(1.0, color="black", linestyle="dashed", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("elements per activation (rows x columns)")
        ax.set_ylabel(f"{ylabel}; below 1: gradops faster")
        ax.set_title(f"{title} — {device}" if device else title)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":  # a worker of run(): one case, one JSON line
    print(json.dumps(measure(json.loads(sys.argv[1]))), flush=True)
