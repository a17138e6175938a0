"""The figures of README.md and docs/benchmarks.md, generated from ``benchmarks/results/*.jsonl``.

Every table of measured figures in the documents sits between two markers, ``<!-- figures: NAME -->`` and
``<!-- /figures -->``, and is this module's :func:`render` of ``NAME``: the newest record of each case across the
results files, with the machine, the versions, the commit that recorded the run and its date in the table. The
documents cannot drift from their harness: tests/test_readme_figures.py regenerates every table and compares.

    python -m gradops.bench.readme                  # every table, each under its name
    python -m gradops.bench.readme --table readme   # one table, as the README holds it
    python -m gradops.bench.readme --write          # rewrite the tables in README.md and docs/*.md in place

A run is the records of one results file that share a ``date`` (each ``gradops bench`` invocation stamps its
records with one). Its commit is the record's ``commit`` field where the harness wrote one, else the first commit
of the repository that added the run's records to its file (``git log -S``), else ``-`` (not a git checkout, or a
run not committed yet).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from gradops.registry import BENCH

#: The repository this module sits in (src/gradops/bench/readme.py), where the documents and results are.
ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "results"
#: The documents whose marked tables :func:`write` regenerates.
DOCUMENTS = ("README.md", "docs/*.md")
MARKER = re.compile(r"<!-- figures: ([\w-]+) -->\n(.*?)<!-- /figures -->\n", re.S)

#: The sweep's sizes, as the tables' columns (rows x columns of the activation).
SIZES = ((8, 8), (64, 128), (512, 256), (2048, 512), (4096, 1024))
#: The sizes the README's one-line summary of a module shows.
README_SIZES = ((8, 8), (512, 256), (4096, 1024))
MODULES = ("RMSNorm", "LayerNorm", "Hardswish", "Embedding")
#: The backward functions' rows: the bench cases of gradops.registry, in its order.
FUNCTIONS = BENCH
MODELS = {"llama": "Llama", "qwen3_moe": "Qwen3-MoE"}


def load(results: Path = RESULTS) -> list[dict]:
    """Every record of ``results/*.jsonl``, each with ``_file`` (the file's name) added, in file and line order.

    ``first-use-*.jsonl`` are left out: :mod:`gradops.bench.first_use` measures a fresh install (its sweep runs with
    only what the install built, one process per case), not the figures these tables show."""
    records = []
    for path in sorted(results.glob("*.jsonl")):
        if path.name.startswith("first-use-"):
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                records.append({**json.loads(line), "_file": path.name})
    return records


@functools.cache
def _git_commit(results: Path, name: str, date: str) -> str:
    """The short hash of the first commit that added the records stamped ``date`` to ``results/name``, or ``-``."""
    try:
        found = subprocess.run(
            ["git", "log", "--reverse", "--format=%h", "--abbrev=7", f'-S"date": "{date}"', "--", name],
            cwd=results, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return "-"
    hashes = found.stdout.split() if found.returncode == 0 else []
    return hashes[0] if hashes else "-"


def commit(record: dict, results: Path = RESULTS) -> str:
    """The commit of a record's run (see the module docstring)."""
    if record.get("commit"):
        return str(record["commit"])[:7]
    return _git_commit(results, record["_file"], record["date"])


def machine(record: dict) -> str:
    return f"{record.get('device_name', record.get('device', '?'))}, {record.get('threads', '?')} threads"


def versions(record: dict, *extra: str) -> str:
    names = ("torch", "numba", *extra)  # numba: the CPU kernels' compiler in records before the C++ kernels
    found = [f"{n} {record[n]}" for n in names if record.get(n)]
    if record.get("native"):
        found.append(f"native {record['native']}")
    return ", ".join(found)


def day(record: dict) -> str:
    return record["date"][:10]


def _newest(records: Iterable[dict], key: Callable[[dict], object]) -> dict[object, dict]:
    """The newest record per ``key`` (the last of equal dates, in file and line order)."""
    newest: dict[object, dict] = {}
    for r in records:
        k = key(r)
        if k is not None and (k not in newest or r["date"] >= newest[k]["date"]):
            newest[k] = r
    return newest


def _size(r: dict) -> tuple[int, int]:
    return r["rows"], r["cols"]


def on(records: Iterable[dict], device: str) -> list[dict]:
    """The records measured on ``device`` (``cpu`` or ``cuda``): each table is one device's, since a GPU run of
    a case is not newer figures for the CPU's."""
    return [r for r in records if r.get("device", "cpu") == device]


def _sweep(records: list[dict], kind: str, field: str) -> dict[tuple, dict]:
    """The newest sweep record per (module or op, dtype, size) that has ``field``."""
    return _newest((r for r in records if r.get("bench") == "sweep" and kind in r and r.get(field) is not None),
                   lambda r: (r[kind], r["dtype"], _size(r)))


def _spread(r: dict) -> str:
    ratios = r.get("ratios") or []
    if len(ratios) < 2:
        return f"{r['ratio']:.2f}"
    return f"{r['ratio']:.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def _runs_list(used: Iterable[dict], results: Path, *extra: str) -> str:
    """One line per run the table's cells come from: commit, date, machine, versions, the harness's estimator."""
    lines = []
    for r in sorted(_newest(used, lambda r: (r["_file"], r["date"])).values(), key=lambda r: (r["date"], r["_file"])):
        how = f"; {r['processes']} processes, {r['estimator']}" if r.get("estimator") else ""
        how += f"; malloc: {r['malloc']}" if r.get("malloc") else ""
        lines.append(f"- commit {commit(r, results)}: `{r['_file']}`, {r['date'][:16]}Z, "
                     f"{machine(r)}, {versions(r, *extra)}{how}")
    return "\n".join(lines)


def _grid(cells: dict[tuple, dict], names: Iterable[str], text: Callable[[dict], str], results: Path,
          label: str, quote: bool = False) -> str:
    """A table of names x dtypes (rows) by sizes (columns), a commit column, then the list of runs."""
    head = f"| {label} | dtype | " + " | ".join(f"{r}×{c}" for r, c in SIZES) + " | commit |"
    lines = [head, "|" + "---|" * (len(SIZES) + 3)]
    used = []
    for name in names:
        for dtype in ("fp32", "bf16"):
            row = [cells.get((name, dtype, size)) for size in SIZES]
            if not any(row):
                continue
            used += [r for r in row if r]
            commits = ", ".join(dict.fromkeys(commit(r, results) for r in row if r))
            shown = f"`{name}`" if quote else name
            lines.append(f"| {shown} | {dtype} | " + " | ".join(text(r) if r else "-" for r in row)
                         + f" | {commits} |")
    return "\n".join(lines) + "\n\nRuns:\n\n" + _runs_list(used, results)


def modules(records: list[dict], results: Path = RESULTS, device: str = "cpu") -> str:
    """Each module forward + backward, gradops / torch eager: median over processes (lowest–highest)."""
    return _grid(_sweep(on(records, device), "module", "ratio"), MODULES, _spread, results, "module")


def modules_compile(records: list[dict], results: Path = RESULTS, device: str = "cpu") -> str:
    """Each module forward + backward, gradops / ``torch.compile`` of the torch module."""
    return _grid(_sweep(on(records, device), "module", "compile_ratio"), MODULES,
                 lambda r: f"{r['compile_ratio']:.2f}", results, "module")


def functions(records: list[dict], results: Path = RESULTS, device: str = "cpu") -> str:
    """Each backward function, gradops / its eager twin."""
    return _grid(_sweep(on(records, device), "op", "ratio"), FUNCTIONS, _spread, results, "function", quote=True)


def functions_compile(records: list[dict], results: Path = RESULTS, device: str = "cpu") -> str:
    """Each backward function, gradops / ``torch.compile`` of gradops' pure-torch reference."""
    return _grid(_sweep(on(records, device), "op", "compile_ratio"), FUNCTIONS,
                 lambda r: f"{r['compile_ratio']:.2f}", results, "function", quote=True)


def models(records: list[dict], results: Path = RESULTS, device: str = "cpu") -> str:
    """One training step of a transformers model, gradops-patched against unpatched."""
    newest = _newest((r for r in on(records, device) if r.get("bench") == "models"),
                     lambda r: (r["model"], r["dtype"]))
    lines = ["| model | dtype | gradops | transformers | gradops / transformers | other experts backends | commit |",
             "|---|---|---|---|---|---|---|"]
    for (model, dtype), r in sorted(newest.items(), key=lambda kv: (list(MODELS).index(kv[0][0]), kv[0][1])):
        others = ", ".join(f"`{k.removeprefix('transformers_').removesuffix('_ms')}` {v:.0f} ms"
                           for k, v in sorted(r.items()) if k.startswith("transformers_") and k != "transformers_ms")
        lines.append(f"| {MODELS.get(model, model)} | {dtype} | {r['gradops_ms']:.0f} ms | "
                     f"{r['transformers_ms']:.0f} ms | {r['ratio']:.2f} | {others or '-'} | {commit(r, results)} |")
    return "\n".join(lines) + "\n\nRuns:\n\n" + _runs_list(newest.values(), results, "transformers")


def per_call(records: list[dict], results: Path = RESULTS) -> str:
    """The newest per-call run: µs per call of each public function at its shape, with ``out=``, and ATen's."""
    calls = [r for r in records if r.get("bench") == "per-call"]
    if not calls:
        return "(no per-call records)"
    last = max(calls, key=lambda r: r["date"])
    run = [r for r in calls if r["date"] == last["date"] and r["_file"] == last["_file"]]

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    lines = ["| function | shape | dtype | gradops µs | `out=` µs | through the op µs | ATen µs |",
             "|---|---|---|---|---|---|---|"]
    for r in run:
        lines.append(f"| `{r['function']}` | {'×'.join(map(str, r['shape']))} | {r['dtype']} | {us(r['gradops_us'])} "
                     f"| {us(r.get('out_us'))} | {us(r.get('op_path_us'))} | {us(r.get('aten_us'))} |")
    return "\n".join(lines) + "\n\nRun:\n\n" + _runs_list(run, results)


def _ms(value: float) -> str:
    """Milliseconds to three significant digits at least (a GPU case of 0.207 ms is not "0.2")."""
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def kernels(records: list[dict], results: Path = RESULTS, device: str = "cpu") -> str:
    """``gradops bench`` (the byte-floor cases): each op's time, speedups and ``out=``'s share of ``copy_``."""
    cases = [r for r in on(records, device) if r.get("provider") is not None]
    newest = _newest(cases, lambda r: (r["op"], json.dumps(r["shape"], sort_keys=True), r["dtype"], r["provider"]))
    keys = list(dict.fromkeys((op, shape, dtype) for op, shape, dtype, _ in newest))
    lines = ["| op | shape | dtype | gradops ms | vs eager | vs torch.compile | GB/s | `out=` % of `copy_` | commit |",
             "|---|---|---|---|---|---|---|---|---|"]
    used = []
    for op, shape, dtype in keys:
        g = newest.get((op, shape, dtype, "gradops"))
        if g is None:
            continue
        out = newest.get((op, shape, dtype, "gradops out="))
        used.append(g)
        speed = g.get("speedup", {})
        shown = " ".join(f"{k}={v}" for k, v in json.loads(shape).items())
        pct = f"{out['pct_copy']:.0f}%" if out and out.get("pct_copy") is not None else "-"
        lines.append(f"| `{op}` | {shown} | {dtype} | {_ms(g['median_ms'])} | "
                     + " | ".join(f"{speed[p]:.1f}×" if p in speed else "-" for p in ("eager", "compile"))
                     + f" | {g['gbps']:.1f} | {pct} | {commit(g, results)} |")
    return "\n".join(lines) + "\n\nRuns:\n\n" + _runs_list(used, results)


def readme(records: list[dict], results: Path = RESULTS) -> str:
    """The README's summary, fp32: each module at three sizes, then whole training steps; one row per benchmark and
    day (a module whose cells come from another run of that day names its commit beside it)."""
    groups: dict[tuple, list[tuple[str, str, str]]] = {}
    for device in ("cpu", "cuda"):
        cells = _sweep(on(records, device), "module", "ratio")
        for module in MODULES:
            row = [cells.get((module, "fp32", size)) for size in README_SIZES]
            if not all(row):
                continue
            r = row[-1]
            commits = ", ".join(dict.fromkeys(commit(c, results) for c in row))
            groups.setdefault((day(r), machine(r), versions(r)), []).append(
                (module, " / ".join(f"{c['ratio']:.2f}" for c in row), commits))
    sizes = " / ".join(f"{r}×{c}" for r, c in README_SIZES)
    lines = ["| benchmark | gradops / torch (below 1: gradops faster) | machine | versions | commit | date |",
             "|---|---|---|---|---|---|"]
    for (when, where, what), parts in groups.items():
        commits = list(dict.fromkeys(c for _, _, c in parts))
        shown = commits[0] if len(commits) == 1 else "; ".join(
            f"{c} ({', '.join(m for m, _, mc in parts if mc == c)})" for c in commits)
        lines.append(f"| `gradops bench --sweep`: module forward + backward, fp32, {sizes} | "
                     f"{'; '.join(f'{m} {v}' for m, v, _ in parts)} | {where} | {what} | {shown} | {when} |")
    steps = _newest((r for r in records if r.get("bench") == "models" and r["dtype"] == "fp32"),
                    lambda r: (r.get("device", "cpu"), r["model"]))
    for run in dict.fromkeys((r["_file"], r["date"]) for r in steps.values()):
        rows = [r for r in steps.values() if (r["_file"], r["date"]) == run]
        parts = ", ".join(f"{MODELS.get(r['model'], r['model'])} {r['ratio']:.2f}" for r in rows)
        r = rows[0]
        lines.append(f"| `gradops bench --models`: one training step of a 4-layer model, fp32 | {parts} | "
                     f"{machine(r)} | {versions(r, 'transformers')} | {commit(r, results)} | {day(r)} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[list[dict], Path], str]] = {
    "readme": readme, "modules": modules, "modules-compile": modules_compile, "functions": functions,
    "functions-compile": functions_compile, "models": models, "per-call": per_call, "kernels": kernels,
    # the same tables of the GPU runs (scripts/gpu_check.sh)
    "gpu-modules": functools.partial(modules, device="cuda"),
    "gpu-functions": functools.partial(functions, device="cuda"),
    "gpu-models": functools.partial(models, device="cuda"),
    "gpu-kernels": functools.partial(kernels, device="cuda"),
}


def render(name: str, records: list[dict] | None = None, results: Path = RESULTS) -> str:
    """The table ``name`` (a key of :data:`TABLES`) from ``records`` (default: those under ``results``)."""
    if name not in TABLES:
        raise KeyError(f"no figures table {name!r}; the tables are {', '.join(TABLES)}")
    return TABLES[name](load(results) if records is None else records, results)


def documents(root: Path = ROOT) -> list[Path]:
    """The files whose marked tables are generated here."""
    return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern)})


def regenerate(text: str, records: list[dict], results: Path = RESULTS) -> str:
    """``text`` with every marked table replaced by its rendering."""
    return MARKER.sub(lambda m: f"<!-- figures: {m.group(1)} -->\n{render(m.group(1), records, results)}\n"
                                "<!-- /figures -->\n", text)


def write(root: Path = ROOT, results: Path = RESULTS) -> list[Path]:
    """Regenerate the marked tables of :func:`documents` in place; the files that changed."""
    records, changed = load(results), []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        new = regenerate(text, records, results)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradops.bench.readme", description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=TABLES, help="print this table only (default: every table)")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"results folder (default {RESULTS})")
    parser.add_argument("--write", action="store_true", help="rewrite the marked tables of README.md and docs/*.md")
    args = parser.parse_args(argv)
    if args.write:
        for path in write(ROOT, args.results):
            print(f"rewrote the figures of {path.relative_to(ROOT)}")
        return 0
    records = load(args.results)
    for name in [args.table] if args.table else TABLES:
        if not args.table:
            print(f"<!-- figures: {name} -->")
        print(render(name, records, args.results))
        if not args.table:
            print("<!-- /figures -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
