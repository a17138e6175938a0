"""``scripts/gpu_check.sh --dry-run``: the GPU check's whole flow on the CPU (Triton's interpreter, toy sizes, no
times), so that the one command a short GPU window runs cannot have rotted; and the summary's verdicts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradops.bench import gpu_check
from gradops.registry import NAMES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
#: What every record and env.json must say: where, with what, from which commit, when.
PROVENANCE = ("device", "device_name", "driver", "torch", "triton", "commit", "date")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, float]:
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    for name in ("GRADOPS_BACKEND", "TRITON_INTERPRET", "GRADOPS_DRY_RUN", "GRADOPS_COMMIT"):
        env.pop(name, None)
    start = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=420)
    return done, out, time.monotonic() - start


def test_dry_run_passes_within_its_limits(dry_run):
    done, out, seconds = dry_run
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    summary = done.stdout[done.stdout.index("== gpu_check summary"):]
    assert "DRY RUN" in summary and "result: PASS" in summary
    parts = [line.split("\t") for line in (out / "parts.tsv").read_text().splitlines()]
    assert [p[0] for p in parts] == ["env", *gpu_check.PARTS]
    limits = sum(float(p[3]) for p in parts)
    assert limits <= 300 - 10, f"the parts' limits add up to {limits} s: the dry run may take over 5 minutes"
    assert seconds < 300


def test_every_part_at_its_limit_still_fits_the_window():
    """The GPU run's limits add up to at most 8 minutes (a GPU window is ~15 minutes with the machine's start-up and
    a rerun), the dry run's to at most 5 (it runs inside the test command)."""
    arrays = re.findall(r"limits=\(([\d ]+)\)", SCRIPT.read_text())
    dry, gpu = ([int(x) for x in a.split()] for a in arrays)
    assert len(dry) == len(gpu) == 9
    assert sum(dry) <= 300 and sum(gpu) <= 480, (sum(dry), sum(gpu))


def test_dry_run_files_name_every_op_with_device_versions_and_commit(dry_run):
    _, out, _ = dry_run
    env = json.loads((out / "env.json").read_text())
    assert env["dry_run"] is True and env["device"] == "cpu"
    for key in PROVENANCE:
        assert key in env, key
    assert env["commit"] not in ("", "unknown") and env["torch"] and env["triton"]
    assert [op["name"] for op in env["ops"]] == list(NAMES)
    records = []
    for path in sorted(out.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert rows, path
        records += rows
    for r in records:  # every record: marked, located, versioned, and no time in it
        assert r.get("dry_run") is True, r
        for key in PROVENANCE:
            assert key in r, (key, r)
        assert r["commit"] == env["commit"]
        assert not [k for k in gpu_check.TIME_KEYS if r.get(k) is not None], r
    checked = {r["op"] for r in records if r.get("bench") == "check"}
    assert checked == set(NAMES)  # every registry op, by the numeric check
    assert {r["dtype"] for r in records if r.get("bench") == "check"} == {"fp32", "bf16", "fp16"}
    text = " ".join(p.read_text() for p in out.glob("*.jsonl"))
    assert all(f'"{name}"' in text for name in NAMES)
    for stem in ("cpu-", "sweep-cpu-"):
        assert list(out.glob(f"{stem}*.png")), f"no {stem}*.png"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True and summary["failed"] == [] and summary["missing_ops"] == []


def _run_dir(tmp_path: Path, parts: dict[str, str], dry: bool = False) -> Path:
    """An OUT folder as the script leaves it: parts.tsv with ``parts`` (name -> exit status), env.json, and one
    passing check record per registry op."""
    (tmp_path / "env.json").write_text(json.dumps({"device_name": "H100", "dry_run": dry, "commit": "abc"}))
    (tmp_path / "parts.tsv").write_text("".join(f"{n}\t{rc}\t1\t10\n" for n, rc in parts.items()))
    rec = {"bench": "check", "dtype": "bf16", "device": "cuda", "backend": "triton", "error": 1e-3, "bound": 1e-2,
           "ok": True, **({"dry_run": True} if dry else {})}
    (tmp_path / "check-cuda-x.jsonl").write_text("".join(json.dumps({**rec, "op": op}) + "\n" for op in NAMES))
    (tmp_path / "gpu-tier.xml").write_text('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1"/>'
                                           "</testsuites>")
    return tmp_path


def test_summary_fails_a_part_that_failed_timed_out_or_wrote_nothing(tmp_path, capsys):
    _run_dir(tmp_path, {"gpu-tier": "0", "check": "0", "bench": "124", "sweep": "1", "models": "skip",
                        "per-call": "skip", "cuda-graphs": "skip"})
    assert gpu_check.summarize(tmp_path) == 1
    out = capsys.readouterr().out
    assert "bench     TIMEOUT" in out and "sweep     FAIL" in out and "models    SKIP" in out
    assert "gpu-tier  PASS" in out and "check     PASS" in out
    assert out.rstrip().splitlines()[-1] == "result: FAIL (bench, sweep)"


def test_summary_passes_when_every_part_passed_or_was_skipped(tmp_path, capsys):
    _run_dir(tmp_path, {"gpu-tier": "0", "check": "0", "bench": "0", "sweep": "0", "models": "skip",
                          "per-call": "skip", "cuda-graphs": "skip"})
    for name, rec in (("cuda-2026-01-01.jsonl", {"provider": "gradops", "op": "rms_norm_grad", "dtype": "bf16",
                                        "speedup": {"eager": 1.5, "liger": 0.9}, "pct_copy": 80.0, "gbps": 2600.0}),
                      ("sweep-cuda-2026-01-01.jsonl", {"module": "RMSNorm", "rows": 8, "cols": 8, "dtype": "bf16",
                                              "ratio": 1.2})):
        (tmp_path / name).write_text(json.dumps(rec) + "\n")
    assert gpu_check.summarize(tmp_path) == 0
    out = capsys.readouterr().out
    assert "vs liger: worst speedup 0.90x" in out and "worst gradops / torch 1.2" in out
    assert out.rstrip().endswith("result: PASS")


def test_summary_fails_a_gpu_tier_that_ran_nothing_and_dry_records_with_times(tmp_path, capsys):
    run = _run_dir(tmp_path, {"gpu-tier": "0", "check": "0", "bench": "0", "sweep": "0", "models": "skip",
                          "per-call": "skip", "cuda-graphs": "skip"})
    (run / "gpu-tier.xml").write_text('<testsuite tests="2" failures="0" errors="0" skipped="2"/>')
    (run / "cuda-2026-01-01.jsonl").write_text(json.dumps({"provider": "gradops", "op": "x", "dtype": "bf16"}) + "\n")
    sweep = {"module": "RMSNorm", "dtype": "bf16", "ratio": 1}
    (run / "sweep-cuda-2026-01-01.jsonl").write_text(json.dumps(sweep) + "\n")
    assert gpu_check.summarize(run) == 1
    assert "(nothing ran on the device)" in capsys.readouterr().out
    env = json.loads((run / "env.json").read_text())
    (run / "env.json").write_text(json.dumps({**env, "dry_run": True}))
    assert gpu_check.summarize(run) == 1  # a dry run's records must say so and carry no times
    assert "without the dry_run mark" in capsys.readouterr().out


def test_script_refuses_a_bad_argument_in_one_line():
    done = subprocess.run(["bash", str(SCRIPT), "--frobnicate", "x"], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown option --frobnicate" in done.stderr
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("usage:")


def test_summary_reports_host_time_and_fails_a_capture_that_does_not_replay(tmp_path, capsys):
    """The per-call part's worst host-time ratio, and the CUDA-graph part: a gradops row that does not replay fails
    it (the transformers control rows are reported by the part's own log only)."""
    _run_dir(tmp_path, {"gpu-tier": "0", "check": "0", "bench": "skip", "per-call": "0", "sweep": "skip",
                        "models": "skip", "cuda-graphs": "1"})
    calls = [{"function": "rms_norm_grad", "gradops_us": 12.0, "aten_us": 6.0},
             {"function": "hardswish", "gradops_us": 30.0, "aten_us": 20.0}]
    (tmp_path / "per-call-cuda-2026-01-01.jsonl").write_text("".join(json.dumps(r) + "\n" for r in calls))
    graphs = [{"side": "gradops", "model": "llama", "dtype": "bf16", "mode": "cuda.graph", "replays": False,
               "error": "RuntimeError: CUDA error: operation not permitted when stream is capturing"},
              {"side": "transformers", "model": "llama", "dtype": "bf16", "mode": "cuda.graph", "replays": True}]
    (tmp_path / "cuda-graphs-2026-01-01.jsonl").write_text("".join(json.dumps(r) + "\n" for r in graphs))
    assert gpu_check.summarize(tmp_path) == 1
    out = capsys.readouterr().out
    assert "worst gradops / ATen host time 2.00x (rms_norm_grad: 12.0 vs 6.0 µs); slowest call hardswish 30.0" in out
    assert "0 of 1 gradops captures replay to the eager step" in out
    assert "FAIL llama bf16 cuda.graph: RuntimeError: CUDA error: operation not permitted" in out
    assert out.rstrip().splitlines()[-1] == "result: FAIL (cuda-graphs)"


def test_cuda_graph_rows_put_the_slow_compile_last():
    from gradops.bench import graphs

    rows = graphs.cases(["bf16", "fp32"])
    assert [r[2] for r in rows].count("reduce-overhead") == 1 and rows[-1] == ("llama", "bf16", "reduce-overhead",
                                                                                True)
    assert {(r[0], r[1], r[3]) for r in rows[:-1]} == {(m, d, p) for m in ("llama", "qwen3_moe")
                                                       for d in ("bf16", "fp32") for p in (True, False)}


def test_cuda_graph_check_compares_with_the_eager_step_and_keeps_a_failed_capture(monkeypatch):
    """The check's plumbing on the CPU (the capture itself needs CUDA): a mode that reruns the eager step replays
    bit for bit; a mode that raises gives the error's first line, not the run's end."""
    pytest.importorskip("transformers")
    from gradops.bench import graphs, models

    monkeypatch.setattr(graphs, "MODELS", models.DRY_MODELS)
    monkeypatch.setattr(graphs, "TOKENS", (1, 8))

    def refuse(model, ids):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(graphs, "MODES", {"again": graphs._eager, "refused": refuse})
    cpu = torch.device("cpu")
    got = graphs.check_one("llama", torch.float32, "again", True, cpu)
    assert got["replays"] and got["bitwise"] and got["max_abs_diff"] == 0.0
    got = graphs.check_one("llama", torch.float32, "refused", True, cpu)
    assert got == {"replays": False, "error": "RuntimeError: operation not permitted when stream is capturing"}
