"""``gradops demo`` with few steps: it runs, both models agree, the loss falls, the files appear."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys

from gradops.cli import main
from gradops.demo.data import Batches, stdlib_corpus
from gradops.demo.report import loss_tolerance


def _losses(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [float(r["gradops_loss"]) for r in rows], [float(r["torch_loss"]) for r in rows]


def test_demo_trains_and_agrees(tmp_path, capsys):
    steps = 12
    assert main(["demo", "--steps", str(steps), "--batch-size", "8", "--seq-len", "32", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gradops.patch: swapped" in out and "ratio gradops/torch" in out and "): agree" in out
    ours, twin = _losses(tmp_path / "losses.csv")
    assert len(ours) == len(twin) == steps
    assert all(abs(a - b) <= loss_tolerance(i) for i, (a, b) in enumerate(zip(ours, twin)))
    # From ln(256) = 5.55 nats (uniform over bytes) the first steps learn the byte frequencies.
    assert sum(ours[-5:]) / 5 < ours[0] - 1.0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "loss_curve.png").stat().st_size > 10_000


def test_python_dash_m_with_a_data_file(tmp_path):
    text = tmp_path / "fox.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    result = subprocess.run([sys.executable, "-m", "gradops", "demo", "--data", str(text), "--steps", "3",
                             "--batch-size", "2", "--seq-len", "16", "--out", str(tmp_path / "out")],
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert str(text) in result.stdout and "held-out loss" in result.stdout
    assert (tmp_path / "out" / "losses.csv").read_text().count("\n") == 1 + 3


def test_stdlib_corpus_is_deterministic_text():
    text, what = stdlib_corpus(max_bytes=200_000)
    assert len(text) == 200_000 and b"\0" not in text and "standard-library" in what
    assert stdlib_corpus(max_bytes=200_000)[0] == text
    a = Batches(text, 16, 4, seed=5).next_train()
    b = Batches(text, 16, 4, seed=5).next_train()
    assert all(map(lambda u, v: bool((u == v).all()), a, b))
    assert bool((a[0][:, 1:] == a[1][:, :-1]).all())  # targets are the inputs shifted by one byte


def _history(diffs, grad_error=1e-6):
    from gradops.demo.training import History

    base = [3.0 - 0.001 * i for i in range(len(diffs))]
    return History(gradops_loss=[b + d for b, d in zip(base, diffs)], torch_loss=base, grad_error=grad_error)


def test_runs_that_part_after_a_routing_flip_agree():
    """The measured shape of two valid float32 runs: ulps, then +-2e-3 per batch in either direction."""
    from gradops.demo.report import agreement, drift

    diffs = [2.4e-7] * 60 + [(2e-3 if i % 3 else -2.5e-3) for i in range(240)]
    assert drift(_history(diffs))[0] < 1e-3
    assert agreement(_history(diffs))[2]


def test_a_systematic_difference_disagrees_even_within_the_per_step_bound():
    from gradops.demo.report import DRIFT_TOLERANCE, agreement, drift, loss_tolerance

    diffs = [min(2e-3, loss_tolerance(i) / 2) for i in range(300)]  # every step within its bound, all one sign
    assert all(d <= loss_tolerance(i) for i, d in enumerate(diffs))
    mean, start = drift(_history(diffs))
    assert mean > DRIFT_TOLERANCE and start > 0
    assert not agreement(_history(diffs))[2]


def test_a_wrong_step_0_gradient_disagrees():
    from gradops.demo.report import agreement

    assert not agreement(_history([0.0] * 10, grad_error=1e-3))[2]
