"""gradops golden + gradops verify on gradops' own outputs: every op, every dtype, ten seeds (issue 36).

A single case is one draw. On outputs of a few dozen float32 elements with cancellation (dgamma / dbeta: H sums of
rows; LayerNorm's y near -beta/gamma) the Ratio of two correct implementations is noisy: one element's rounding
decides MARE, and gradops and PyTorch sum in different orders (over 20 seeds at 64x256 the median MERE ratio of
LayerNorm's and RmsNorm's float32 dgamma is 0.98 - 1.23, the largest 3 - 4.6). CANN's standard answers a failing
case with its re-check (COMMERCIAL_OPS_PRECISION_DOCS §4.5.2, §5.3.4): re-run over new seeds, bootstrap the median
of the ratio (2,000 resamples), and fail only when the 95% interval's lower end is above 1.0 - systematically worse
than the third party. This test applies it with the ten seeds it has (the standard asks for >= 200 before it
judges; ten keep the test under a minute): every case passes, or, for an output with a failing case, each of its
ratios (MARE, MERE, RMSE, small values) passes the re-check over the ten seeds. A kernel worse than its third party
on every seed fails that; an integer output must pass every case.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from golden_runs import gradops_outputs
from gradops.golden import make, verdict, write_case
from gradops.golden.verify import verify
from gradops.registry import NAMES

SEEDS = range(10)
DTYPES = ("float32", "float16", "bfloat16")


def _shape(op: str) -> str:
    return "32x16" if op.startswith("moe") else "16x64"


def _ratios(v: verdict.Verdict) -> tuple[float, ...]:
    return (*v.ratios, v.small_ratio)


def recheck_lower(samples: list[float], resamples: int = 2000, seed: int = 0) -> float:
    """CANN's re-check statistic: the 2.5% quantile of the medians of ``resamples`` bootstrap resamples of
    ``samples`` (with replacement), as §5.3.4 describes it."""
    rng = np.random.default_rng(seed)
    data = np.asarray(samples, dtype=np.float64)
    medians = np.median(rng.choice(data, size=(resamples, data.size), replace=True), axis=1)
    return float(np.quantile(medians, 0.025))


def test_recheck_fails_only_a_systematically_worse_kernel():
    assert recheck_lower([0.9, 1.1, 0.8, 1.3, 1.0, 0.95, 6.5, 1.05, 0.7, 1.2]) <= 1.0  # one outlier
    assert recheck_lower([1.3, 1.5, 1.2, 2.1, 1.4, 1.6, 1.25, 1.9, 1.35, 1.45]) > 1.0  # worse on every seed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", NAMES)
def test_verify_passes_gradops_own_outputs_over_ten_seeds(tmp_path, op, dtype):
    by_output: dict[str, list[verdict.Verdict]] = {}
    for seed in SEEDS:
        directory = tmp_path / str(seed)
        write_case(make(op, _shape(op), dtype, seed=seed), directory, shape=_shape(op), dtype=dtype, seed=seed)
        manifest = json.loads((directory / "manifest.json").read_text())
        for v in verify(directory, gradops_outputs(directory, manifest)):
            by_output.setdefault(v.name, []).append(v)
    for name, verdicts in by_output.items():
        failed = [seed for seed, v in zip(SEEDS, verdicts) if not v.passed]
        if not failed:
            continue
        assert not verdicts[0].exact, (op, dtype, name, failed)  # integers: every case, bit for bit
        ratios = np.array([_ratios(v) for v in verdicts])
        lower = [recheck_lower(list(column)) for column in ratios.T]
        assert max(lower) <= 1.0, (op, dtype, name, failed, lower)
