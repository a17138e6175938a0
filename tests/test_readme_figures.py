"""The figures of README.md and docs/*.md are gradops.bench.readme's rendering of benchmarks/results (issue 40):
a number typed into a table, or a results file changed without regenerating the tables, fails here."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from gradops.bench import readme

ROOT = Path(__file__).resolve().parents[1]


def _git_history() -> bool:
    """Whether the checkout has the history the commit column is read from (not a tarball, not a shallow clone)."""
    try:
        found = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return found.returncode == 0 and found.stdout.strip() == "false"


def _marked(path: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in readme.MARKER.finditer(path.read_text(encoding="utf-8"))]


def test_the_readme_holds_the_summary_table_and_the_docs_every_other():
    names = {name for path in readme.documents(ROOT) for name, _ in _marked(path)}
    assert [name for name, _ in _marked(ROOT / "README.md")] == ["readme"]
    assert names == set(readme.TABLES), f"tables no document holds: {set(readme.TABLES) - names}"


@pytest.mark.skipif(not _git_history(), reason="the commit column needs the repository's git history")
@pytest.mark.parametrize("path", readme.documents(ROOT), ids=lambda p: p.name)
def test_every_marked_table_is_the_rendering_of_the_results(path):
    records = readme.load()
    for name, shown in _marked(path):
        expected = readme.render(name, records) + "\n"
        assert shown == expected, (f"{path.relative_to(ROOT)}: the table {name!r} is not what "
                                   f"`python -m gradops.bench.readme --table {name}` prints; run "
                                   "`python -m gradops.bench.readme --write`")


def _record(date: str, ratio: float, **extra) -> dict:
    return {"bench": "sweep", "module": "RMSNorm", "dtype": "fp32", "rows": 8, "cols": 8, "ratio": ratio,
            "date": date, "device_name": "a CPU", "threads": 2, "torch": "2.13.0", **extra}


def test_each_cell_is_the_newest_record_with_its_commit(tmp_path):
    """A newer run replaces an older one cell by cell; the record's own commit wins over git's answer; outside a git
    checkout a run's commit is '-'."""
    lines = [_record("2026-01-01T00:00:00+00:00", 0.5), _record("2026-02-01T00:00:00+00:00", 0.25, commit="abcdef0123")]
    (tmp_path / "sweep-cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = readme.render("modules", results=tmp_path)
    assert "| RMSNorm | fp32 | 0.25 | - | - | - | - | abcdef0 |" in table, table
    assert "0.50" not in table
    lines.append(_record("2026-03-01T00:00:00+00:00", 0.75, rows=4096, cols=1024))
    (tmp_path / "sweep-cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    table = readme.render("modules", results=tmp_path)
    assert "| RMSNorm | fp32 | 0.25 | - | - | - | 0.75 | abcdef0, - |" in table, table



def test_a_gpu_run_is_not_newer_figures_for_the_cpu(tmp_path):
    """Each table is one device's: a later CUDA run of the same case fills the gpu-* tables and leaves the CPU's
    cells as they were; the README's summary shows both machines, a row each."""
    lines = [_record("2026-01-01T00:00:00+00:00", 0.5, device="cpu", commit="c0ffee0000"),
             _record("2026-02-01T00:00:00+00:00", 3.25, device="cuda", device_name="a GPU", commit="9e9e9e9e9e")]
    (tmp_path / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cpu, gpu = readme.render("modules", results=tmp_path), readme.render("gpu-modules", results=tmp_path)
    assert "| RMSNorm | fp32 | 0.50 | - | - | - | - | c0ffee0 |" in cpu and "3.25" not in cpu, cpu
    assert "| RMSNorm | fp32 | 3.25 | - | - | - | - | 9e9e9e9 |" in gpu and "0.50" not in gpu, gpu

def test_write_regenerates_a_hand_edited_table(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "sweep-cpu.jsonl").write_text(json.dumps(_record("2026-01-01T00:00:00+00:00", 0.5)) + "\n")
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("before\n<!-- figures: modules -->\n| typed | 0.10 |\n<!-- /figures -->\nafter\n")
    assert readme.write(tmp_path, results) == [page]
    text = page.read_text()
    assert "0.10" not in text and "| RMSNorm | fp32 | 0.50 |" in text and text.endswith("<!-- /figures -->\nafter\n")
    assert readme.write(tmp_path, results) == []  # regenerated: nothing more to change


def test_an_unknown_table_is_refused():
    with pytest.raises(KeyError, match="no figures table"):
        readme.render("nowhere", records=[])


def test_the_command_prints_the_readme_table(capsys, tmp_path):
    shutil.copy(ROOT / "benchmarks" / "results" / "models-cpu-2026-11-23.jsonl", tmp_path)
    assert readme.main(["--table", "readme", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| benchmark |") and "Llama 0.96, Qwen3-MoE 0.93" in out
