"""The bookkeeping of ``scripts/gpu_check.sh``: what the run is (``env``) and what it found (``summary``).

``python -m gradops.bench.gpu_check env OUT [--dry-run]`` writes ``OUT/env.json``: the device, its name, driver,
torch / triton versions, gradops' commit and the date (:mod:`gradops.bench.provenance`), and every operator of
:mod:`gradops.registry` with the parts that cover it.

``python -m gradops.bench.gpu_check summary OUT`` reads what the parts left in ``OUT`` (``parts.tsv``: one line per
part, ``name  exit-status  seconds  limit  [reason]``, written by the script; the GPU tier's JUnit XML; the JSONL of
``gradops check``, ``bench``, ``bench --per-call``, ``bench --sweep``, ``bench --models`` and ``bench
--cuda-graphs``), prints one screen - pass / fail / timeout / skip per part, the worst ratio of each table - writes
it to ``OUT/summary.json`` and exits 1 when a part failed or ran out of time. A part that left no results of its
own fails even with exit status 0; a dry run's records must all say ``dry_run`` and carry no times.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: The parts, in the script's order: name -> what it runs.
PARTS = {
    "gpu-tier": "pytest tests/gpu (large shapes, > 2^31 elements, bit-for-bit repeats, no host sync)",
    "check": "gradops check: every op and dtype against the float64 reference",
    "bench": "gradops bench: backward ops vs eager, torch.compile, Liger-Kernel; GB/s and % of copy_",
    "per-call": "gradops bench --per-call: host µs per call of every public function at 8x8 vs ATen",
    "sweep": "gradops bench --sweep: modules fwd+bwd and backward functions vs torch, 8x8 to 4096x1024",
    "models": "gradops bench --models: Llama and Qwen3-MoE training steps, patched vs transformers",
    "cuda-graphs": "gradops bench --cuda-graphs: a patched training step captured in a CUDA graph, replayed",
}
#: Exit statuses of timeout(1): the limit was reached (124), or the command ignored the TERM and was killed (137).
TIMED_OUT = {124, 137}
#: Keys a dry run's records must not carry: they would be timing claims.
TIME_KEYS = ("median_ms", "gbps", "pct_copy", "speedup", "gradops_us", "torch_us", "ratio", "gradops_ms")


def _write_env(out: Path, dry: bool) -> int:
    import torch

    from ..registry import OPS
    from .provenance import environment

    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    env = environment(device, dry)
    env["ops"] = [{"name": op.name, "cann": op.cann, "backward": op.backward, "check": True, "bench": op.bench}
                  for op in OPS]
    env["parts"] = PARTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    print(f"{'DRY RUN on ' if dry else ''}{env['device_name']}: driver {env['driver']}, torch {env['torch']}, triton "
          f"{env['triton']}, liger-kernel {env['liger_kernel']}, commit {env['commit']}"
          + (" (dirty)" if env.get("dirty") else "") + f", {env['date']}")
    return 0


def _records(out: Path, pattern: str) -> list[dict]:
    rows = []
    for path in sorted(out.glob(pattern)):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def _parts(out: Path) -> dict[str, dict]:
    """parts.tsv -> name -> {"rc", "seconds", "limit", "reason"} (the last line of each name counts)."""
    found: dict[str, dict] = {}
    path = out / "parts.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            cells = line.split("\t")
            if len(cells) >= 4:
                found[cells[0]] = {"rc": cells[1], "seconds": float(cells[2]), "limit": float(cells[3]),
                                   "reason": cells[4] if len(cells) > 4 else ""}
    return found


def _junit(path: Path) -> dict[str, int] | None:
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def _shape(rec: dict) -> str:
    shape = rec.get("shape")
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    if "rows" in rec:
        return f"{rec['rows']}x{rec['cols']}"
    return ""


def _verdicts(out: Path, dry: bool) -> dict[str, dict]:
    """Each part's verdict: status (PASS, FAIL, TIMEOUT, SKIP, MISSING), what it found, its worst figures."""
    parts = _parts(out)
    verdicts: dict[str, dict] = {}
    for name in PARTS:
        p = parts.get(name)
        if p is None:
            verdicts[name] = {"status": "MISSING", "detail": "did not run (no line in parts.tsv)"}
            continue
        v: dict = {"seconds": p["seconds"], "limit": p["limit"]}
        if p["rc"] == "skip":
            v.update(status="SKIP", detail=p["reason"])
        elif p["rc"].isdigit() and int(p["rc"]) in TIMED_OUT:
            v.update(status="TIMEOUT", detail=f"stopped at its {p['limit']:.0f} s limit")
        else:
            v.update(status="PASS" if p["rc"] == "0" else "FAIL", detail=f"exit {p['rc']}")
        verdicts[name] = v

    tier = _junit(out / "gpu-tier.xml")
    v = verdicts["gpu-tier"]
    if tier is not None:
        ran = tier["tests"] - tier["skipped"]
        v["detail"] += (f"; {tier['tests']} tests: {ran - tier['failures'] - tier['errors']} passed, "
                        f"{tier['failures']} failed, {tier['errors']} errors, {tier['skipped']} skipped")
        if v["status"] == "PASS" and not dry and ran == 0:
            v.update(status="FAIL", detail=v["detail"] + " (nothing ran on the device)")
    elif v["status"] == "PASS":
        v.update(status="FAIL", detail="no gpu-tier.xml")

    tables = {"check": "check-*.jsonl", "bench": "[a-z]*-[0-9]*.jsonl", "per-call": "per-call-cuda-*.jsonl",
              "sweep": "sweep-*.jsonl", "models": "models-*.jsonl", "cuda-graphs": "cuda-graphs-*.jsonl"}
    records = {name: _records(out, pattern) for name, pattern in tables.items()}
    records["bench"] = [r for r in records["bench"] if "provider" in r]  # cpu-/cuda-<date>.jsonl only
    for name, rows in records.items():
        v = verdicts[name]
        v["records"] = len(rows)
        if v["status"] in ("PASS", "FAIL", "TIMEOUT") and not rows:
            v.update(status="FAIL" if v["status"] == "PASS" else v["status"],
                     detail=v["detail"] + "; no results written")
        if dry and rows:
            timed = [k for r in rows for k in TIME_KEYS if r.get(k) is not None]
            unmarked = sum(not r.get("dry_run") for r in rows)
            if timed or unmarked:
                v.update(status="FAIL", detail=v["detail"] + f"; dry-run records with times {sorted(set(timed))} "
                                                             f"or without the dry_run mark ({unmarked})")
    _worst(verdicts, records, dry)
    return verdicts


def _worst(verdicts: dict[str, dict], records: dict[str, list[dict]], dry: bool) -> None:
    """The worst figure of each table, in each part's ``worst`` (a list of lines)."""
    checks = records["check"]
    if checks:
        failed = [r for r in checks if not r["ok"]]
        finite = [r for r in checks if r.get("error") is not None and r["bound"] > 0]
        worst = max(finite, key=lambda r: r["error"] / r["bound"], default=None)
        lines = [f"{len(checks) - len(failed)} of {len(checks)} runs pass"]
        if worst is not None:
            lines.append(f"worst error / bound {worst['error'] / worst['bound']:.3g}: {worst['op']} {worst['dtype']} "
                         f"{worst['device']} {worst['backend']}")
        lines += [f"FAIL {r['op']} {r['dtype']} {r['device']} {r['backend']}: error {r['error']}" for r in failed[:5]]
        verdicts["check"]["worst"] = lines
        if failed and verdicts["check"]["status"] == "PASS":
            verdicts["check"]["status"] = "FAIL"
    if dry:
        for name in ("bench", "sweep", "models"):
            if records[name]:
                verdicts[name]["worst"] = [f"{len(records[name])} records, every provider ran once; no times (dry run)"]
        return
    bench = records["bench"]
    if bench:
        lines = []
        ours = [r for r in bench if r["provider"] == "gradops"]
        for peer in ("eager", "compile", "liger"):
            rows = [r for r in ours if peer in r.get("speedup", {})]
            if rows:
                r = min(rows, key=lambda r: r["speedup"][peer])
                lines.append(f"vs {peer}: worst speedup {r['speedup'][peer]:.2f}x ({r['op']} {_shape(r)} {r['dtype']})"
                             f" over {len(rows)} cases")
        rated = [r for r in ours if r.get("pct_copy") is not None]
        if rated:
            r = min(rated, key=lambda r: r["pct_copy"])
            lines.append(f"lowest share of copy_ bandwidth {r['pct_copy']:.0f}% ({r['op']} {_shape(r)} {r['dtype']}, "
                         f"{r['gbps']:.0f} GB/s)")
        verdicts["bench"]["worst"] = lines
    calls = [r for r in records["per-call"] if r.get("aten_us")]
    if calls:
        r = max(calls, key=lambda r: r["gradops_us"] / r["aten_us"])
        slowest = max(records["per-call"], key=lambda r: r["gradops_us"])
        verdicts["per-call"]["worst"] = [
            f"worst gradops / ATen host time {r['gradops_us'] / r['aten_us']:.2f}x ({r['function']}: "
            f"{r['gradops_us']:.1f} vs {r['aten_us']:.1f} µs); slowest call {slowest['function']} "
            f"{slowest['gradops_us']:.1f} µs"]
    graphs = [r for r in records["cuda-graphs"] if r.get("side") == "gradops"]
    if graphs:
        lines = [f"{sum(r['replays'] for r in graphs)} of {len(graphs)} gradops captures replay to the eager step"]
        lines += [f"FAIL {r['model']} {r['dtype']} {r['mode']}: {r.get('error') or 'differs'}"
                  for r in graphs if not r["replays"]][:4]
        verdicts["cuda-graphs"]["worst"] = lines
    for name, key, label in (("sweep", "ratio", "gradops / torch"), ("models", "ratio", "gradops / transformers")):
        rows = [r for r in records[name] if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if rows:
            r = max(rows, key=lambda r: r[key])
            what = r.get("module") or r.get("op") or r.get("model")
            verdicts[name]["worst"] = [f"worst {label} {r[key]:.3g} ({what} {_shape(r)} {r['dtype']}) over "
                                       f"{len(rows)} cases"]


def _coverage(out: Path, env: dict) -> tuple[list[str], list[str]]:
    """Lines on the registry's operators, and the names no result file mentions."""
    from ..registry import OPS

    text = " ".join(p.read_text(encoding="utf-8") for p in sorted(out.glob("*.jsonl")))
    checks = _records(out, "check-*.jsonl")
    missing, lines = [], []
    for op in OPS:
        got = [r for r in checks if r["op"] == op.name]
        if f'"{op.name}"' not in text:
            missing.append(op.name)
        verdict = ("no check" if not got else f"check {sum(r['ok'] for r in got)}/{len(got)} pass")
        lines.append(f"  {op.name:<26} {verdict}" + (f", bench {op.bench}" if op.bench else ""))
    return lines, missing


def summarize(out: Path) -> int:
    """Print the summary of the run in ``out``, write ``out/summary.json``; 1 when a part failed or timed out."""
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    dry = bool(env.get("dry_run"))
    verdicts = _verdicts(out, dry)
    coverage, missing = _coverage(out, env)
    failed = [n for n, v in verdicts.items() if v["status"] in ("FAIL", "TIMEOUT", "MISSING")]
    if missing:
        failed.append("coverage")
    lines = [f"== gpu_check summary{' (DRY RUN: CPU, Triton interpreter, no timing claims)' if dry else ''}",
             f"{env.get('device_name', '?')} | driver {env.get('driver')} | torch {env.get('torch')} | triton "
             f"{env.get('triton')} | liger-kernel {env.get('liger_kernel')} | commit {env.get('commit')}"
             f"{' (dirty)' if env.get('dirty') else ''} | {env.get('date')}"]
    for name, v in verdicts.items():
        took = f" {v['seconds']:.0f}/{v['limit']:.0f} s" if "seconds" in v else ""
        lines.append(f"{name:<9} {v['status']:<7}{took:>12}  {v['detail']}")
        lines += [f"{'':<30}{w}" for w in v.get("worst", [])]
    lines.append(f"operators ({len(coverage)} in gradops.registry):")
    lines += coverage
    if missing:
        lines.append(f"FAIL: no result names {', '.join(missing)}")
    lines.append(f"result: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    print("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"env": env, "dry_run": dry, "parts": verdicts,
                                                  "missing_ops": missing, "failed": failed}, indent=1) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradops.bench.gpu_check", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    env = sub.add_parser("env", help="write OUT/env.json")
    env.add_argument("out", type=Path)
    env.add_argument("--dry-run", action="store_true")
    summary = sub.add_parser("summary", help="print the summary of the run in OUT; exit 1 when a part failed")
    summary.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.what == "env":
        return _write_env(args.out, args.dry_run)
    return summarize(args.out)


if __name__ == "__main__":
    sys.exit(main())
