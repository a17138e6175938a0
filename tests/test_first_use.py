"""``python -m gradops.bench.first_use`` (scripts/first_use.sh): the first-use harness of issue 39.

The real run installs torch and gradops into a fresh venv (minutes); here ``--dry-run`` runs the same flow with
this interpreter, a toy model and the pure-torch reference, so that the harness cannot rot unseen: fresh worker
processes with an empty HOME, the record's fields, the JSON line, and its refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gradops.bench import first_use


def test_dry_run_measures_each_side_in_fresh_processes_and_writes_one_record(tmp_path, capsys):
    results = tmp_path / "results"
    assert first_use.main(["--dry-run", "--results", str(results), "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    files = list(results.iterdir())
    assert len(files) == 1 and files[0].name.startswith("first-use-cpu-") and files[0].suffix == ".jsonl"
    lines = files[0].read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["bench"] == "first-use" and record["dry_run"] is True and record["mode"] == "no-install"
    for key in ("date", "device_name", "commit", "torch", "gradops", "native", "loadavg_1m_start",
                "loadavg_1m_end", "torch_first_step_s", "gradops_cold_extra_s", "gradops_warm_extra_s",
                "import_gradops_cold_s", "import_gradops_warm_s", "cache_files"):
        assert key in record, key
    assert [r["run"] for r in record["runs"]] == ["gradops cold", "gradops warm", "torch 1"]
    for r in record["runs"]:
        assert 0 < r["first_step_s"] < r["process_s"] and r["later_step_ms"] > 0
    gradops_runs = [r for r in record["runs"] if r["impl"] == "gradops"]
    assert all(r["backend"] == "torch" for r in gradops_runs)  # the dry run compiles nothing
    assert all(0 < r["import_gradops_s"] for r in gradops_runs)
    # each worker saw the empty HOME, not the caller's cache: the native library it looked for lies under it
    assert all(str(tmp_path) in r["native"] or r["native"] == "loaded" for r in gradops_runs)
    assert record["native"] != "loaded"  # HOME was empty, and the dry run (GRADOPS_BACKEND=torch) builds nothing
    assert record["gradops_env"][0].startswith("gradops ")
    assert record["gradops_cold_extra_s"] == pytest.approx(
        record["runs"][0]["first_step_s"] - record["torch_first_step_s"])
    assert "gradops cold" in out and "first step beyond torch's" in out
    assert list(tmp_path.glob("gradops-first-use-*")) == []  # the temporary folder is gone without --keep


def test_workers_get_a_new_users_environment(tmp_path, monkeypatch):
    for name in ("GRADOPS_CACHE_DIR", "NUMBA_CACHE_DIR", "GRADOPS_NATIVE", "PYTHONPATH", "GRADOPS_BACKEND"):
        monkeypatch.setenv(name, "/somewhere")
    env = first_use._user_env(tmp_path / "home", tmp_path / "venv")
    assert env["HOME"] == str(tmp_path / "home")
    assert not {"GRADOPS_CACHE_DIR", "NUMBA_CACHE_DIR", "GRADOPS_NATIVE", "PYTHONPATH", "GRADOPS_BACKEND"} & set(env)
    assert env["PATH"].split(os.pathsep)[0] == str(tmp_path / "venv" / "bin")
    assert first_use._user_env(tmp_path, None, dry=True)["GRADOPS_BACKEND"] == "torch"


def test_sweep_summary_counts_the_cases_where_gradops_is_slower(tmp_path):
    """Slower than torch at all, and beyond the 5% noise allowance of issue 39."""
    path = tmp_path / "sweep.jsonl"
    rows = [{"module": "RMSNorm", "rows": 8, "cols": 8, "dtype": "fp32", "ratio": 0.9},
            {"module": "LayerNorm", "rows": 8, "cols": 8, "dtype": "bf16", "ratio": 1.2},
            {"op": "hardswish_backward", "rows": 64, "cols": 128, "dtype": "fp32", "ratio": 1.0},
            {"op": "rms_norm_grad", "rows": 64, "cols": 128, "dtype": "fp32", "ratio": 1.04},
            {"op": "hardswish_backward", "rows": 64, "cols": 128, "dtype": "fp32", "dry_run": True}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = first_use._sweep_summary(path)
    assert summary == {"sweep_cases": 4, "sweep_not_slower": 2, "sweep_held": 3,  # 1.04 is within the noise
                       "sweep_slower": ["LayerNorm 8x8 bf16 1.20", "rms_norm_grad 64x128 fp32 1.04"]}


@pytest.mark.parametrize("argv, named", [
    (["--tokens", "8"], "--tokens"),
    (["--width", "0"], "--width"),
    (["--later", "-1"], "--later"),
    (["--torch-runs", "0"], "--torch-runs"),
])
def test_a_bad_argument_is_one_line_and_exit_2(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        first_use.main(argv)
    out, err = capsys.readouterr()
    assert stop.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and named in err and "error" in err


def test_an_unwritable_results_folder_is_refused_before_any_work(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert first_use.main(["--dry-run", "--results", str(blocked / "sub")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "--results" in err


def test_the_script_runs_the_module():
    script = Path(__file__).resolve().parents[1] / "scripts" / "first_use.sh"
    text = script.read_text()
    assert os.access(script, os.X_OK) and "gradops.bench.first_use" in text
