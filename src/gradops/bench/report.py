"""Results of ``gradops bench``: records (one JSON line per case and provider), the table, the plot."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from .timing import Timing

#: Peers every gradops provider is compared with (those present in the case).
PEERS = ("eager", "compile", "liger")
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def shape_text(shape: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def records(case, timings: dict[str, Timing | None], env: dict) -> list[dict]:
    """One record per provider: times, GB/s on the op's byte floor, % of copy_, speedup of gradops vs peers. A dry
    run's providers (timing None: run once, not timed) get ``"ran": true`` and no time, rate or speedup."""
    if any(t is None for t in timings.values()):
        return [{"op": case.op, "shape": case.shape, "dtype": DTYPE_NAMES.get(str(case.dtype), str(case.dtype)),
                 "provider": name, "ran": True, "bytes": case.nbytes, **({"note": case.notes[name]}
                                                                          if name in case.notes else {}), **env}
                for name in timings]
    copy_bytes = 2 * case.copy_numel * _itemsize(case)  # copy_ reads and writes the op's largest tensor
    copy = timings.get("copy_")
    copy_gbps = copy_bytes / (copy.median_ms * 1e-3) / 1e9 if copy else None
    out = []
    for name, t in timings.items():
        nbytes = copy_bytes if name == "copy_" else case.nbytes
        gbps = nbytes / (t.median_ms * 1e-3) / 1e9
        rec = {
            "op": case.op, "shape": case.shape, "dtype": DTYPE_NAMES.get(str(case.dtype), str(case.dtype)),
            "provider": name, "median_ms": round(t.median_ms, 6), "p20_ms": round(t.p20_ms, 6),
            "p80_ms": round(t.p80_ms, 6), "reps": t.reps, "bytes": nbytes, "gbps": float(f"{gbps:.5g}"),
            "pct_copy": round(100 * gbps / copy_gbps, 1) if copy_gbps else None,
        }
        if name.startswith("gradops"):
            rec["speedup"] = {p: round(timings[p].median_ms / t.median_ms, 3) for p in PEERS if p in timings}
        if name in case.notes:
            rec["note"] = case.notes[name]
        rec.update(env)
        out.append(rec)
    return out


def _itemsize(case) -> int:
    return {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}[str(case.dtype)]


def table(rows: Iterable[dict]) -> str:
    """A fixed-width table: one line per (case, provider), speedups on the gradops lines."""
    head = (f"{'op':<26} {'shape':<22} {'dtype':<5} {'provider':<13} {'median ms':>10} {'p20-p80 ms':>17} "
            f"{'GB/s':>7} {'%copy':>6}  speedup vs peers")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "median_ms" not in r:  # a dry run: ran once, not timed
            lines.append(f"{r['op']:<26} {shape_text(r['shape']):<22} {r['dtype']:<5} {r['provider']:<13} "
                         f"{'ran once (dry run: no times)':>44}")
            continue
        spread = f"{r['p20_ms']:.2f}-{r['p80_ms']:.2f}"
        pct = f"{r['pct_copy']:.0f}%" if r.get("pct_copy") is not None else "-"
        speed = "  ".join(f"{v:.2f}x {k}" for k, v in r.get("speedup", {}).items())
        lines.append(f"{r['op']:<26} {shape_text(r['shape']):<22} {r['dtype']:<5} {r['provider']:<13} "
                     f"{r['median_ms']:>10.3f} {spread:>17} {r['gbps']:>7.2f} {pct:>6}  {speed}")
    return "\n".join(lines)


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def plot(rows: list[dict], path: Path) -> bool:
    """Grouped bars of GB/s per case and provider, copy_ as a dashed tick per case. False if no matplotlib."""
    try:
        os.environ.setdefault("MPLBACKEND", "Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if any("gbps" not in r for r in rows):
        return dry_plot(rows, path, "gradops bench")
    cases: dict[str, dict[str, float]] = {}
    for r in rows:
        label = f"{r['op']}\n{shape_text(r['shape'])} {r['dtype']}"
        cases.setdefault(label, {})[r["provider"]] = r["gbps"]
    providers = sorted({p for c in cases.values() for p in c if p != "copy_"})
    width = 0.8 / max(1, len(providers))
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(cases)), 5.5))
    for i, p in enumerate(providers):
        xs = [j + i * width for j, c in enumerate(cases.values()) if p in c]
        ys = [c[p] for c in cases.values() if p in c]
        ax.bar(xs, ys, width, label=p)
    for j, c in enumerate(cases.values()):
        if "copy_" in c:
            ax.hlines(c["copy_"], j - width / 2, j + 0.8 - width / 2, colors="black", linestyles="dashed")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], list(cases), fontsize=6, rotation=30, ha="right")
    ax.set_ylabel("GB/s on the byte floor (dashed: copy_)")
    device = rows[0].get("device_name", "") if rows else ""
    ax.set_title(f"gradops bench — {device}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def dry_plot(rows: list[dict], path: Path, what: str) -> bool:
    """A dry run's figure: what ran, and in large letters that nothing was timed (a file where the real run writes
    its plot, so the flow's files are the same). False without matplotlib."""
    try:
        os.environ.setdefault("MPLBACKEND", "Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(dict.fromkeys(str(r.get("op") or r.get("module") or r.get("model")) for r in rows))
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.axis("off")
    ax.text(0.5, 0.8, f"{what}: DRY RUN - nothing timed", ha="center", fontsize=16, weight="bold")
    first = rows[0] if rows else {}
    ax.text(0.5, 0.65, f"{first.get('device_name', '')}, torch {first.get('torch')}, commit {first.get('commit')}",
            ha="center", fontsize=9)
    ax.text(0.5, 0.05, "ran once each:\n" + "\n".join(names), ha="center", va="bottom", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
