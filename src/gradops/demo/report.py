"""The demo's verdict (loss agreement, step-time ratio) and its files: per-step CSV and the loss-curve PNG."""

from __future__ import annotations

import statistics
from pathlib import Path

from .training import History

#: Steps whose time is left out of the ratio: the first calls pay one-off costs (numba / Triton compilation,
#: allocator warm-up) that say nothing about the steady state.
WARMUP_STEPS = 5


def loss_tolerance(step: int) -> float:
    """Allowed ``|loss_gradops - loss_torch|`` (nats) at ``step``.

    Both runs compute in float32 but reduce in different orders: at first the losses agree to one float32 ulp
    (2.4e-7 nats at a loss of 2-4). Each optimizer step feeds the differences back into the weights and
    training amplifies them (measured, default run: <= 1 ulp up to step ~170, then growth to a 1e-4 - 1e-3
    nats floor, the spread of two almost equal models on one batch; largest 5.9e-4 in 300 steps and 2.1e-3 in
    500). The bound grows linearly instead: 1e-4 plus 2e-5 per step (6.1e-3 nats at step 300, 0.2% of the
    loss), at least 5x above every measured run. A wrong gradient term separates the curves by 1e-2 within
    tens of steps, above it; the step-0 gradient check (GRAD_TOLERANCE) catches it directly.
    """
    return 1e-4 + 2e-5 * step


#: Largest relative gradient difference allowed at step 0 (before any update). Both runs reduce in float32 in
#: different orders; over a reduction of n = 1024 rows the rounding error is about eps * sqrt(n) = 1.2e-7 * 32 =
#: 4e-6 relative (measured: ~1e-6). 1e-4 leaves 25x headroom and still catches any wrong term of a backward.
GRAD_TOLERANCE = 1e-4


def agreement(hist: History) -> tuple[float, int, bool]:
    """``(largest |diff|, its step, every step within loss_tolerance and step-0 gradients within
    GRAD_TOLERANCE)``."""
    diffs = [abs(g - t) for g, t in zip(hist.gradops_loss, hist.torch_loss)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    ok = all(d <= loss_tolerance(i) for i, d in enumerate(diffs)) and hist.grad_error <= GRAD_TOLERANCE
    return diffs[worst], worst, ok


def step_time_ratio(hist: History) -> tuple[float, float, float]:
    """``(gradops median s, torch median s, ratio)`` over the steps after :data:`WARMUP_STEPS`."""
    skip = WARMUP_STEPS if len(hist.gradops_s) > 2 * WARMUP_STEPS else 0
    g = statistics.median(hist.gradops_s[skip:])
    t = statistics.median(hist.torch_s[skip:])
    return g, t, g / t


def write_csv(hist: History, path: Path) -> None:
    rows = ["step,gradops_loss,torch_loss,gradops_ms,torch_ms"]
    for i, (gl, tl, gs, ts) in enumerate(zip(hist.gradops_loss, hist.torch_loss, hist.gradops_s, hist.torch_s)):
        rows.append(f"{i},{gl:.7f},{tl:.7f},{1e3 * gs:.3f},{1e3 * ts:.3f}")
    path.write_text("\n".join(rows) + "\n")


def plot(hist: History, path: Path, title: str) -> str:
    """Write the loss curves to ``path``; returns what happened (matplotlib is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return "loss curve not drawn: matplotlib is not installed (pip install 'gradops[bench]')"
    steps = range(len(hist.gradops_loss))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
    top.plot(steps, hist.torch_loss, label="PyTorch twin", linewidth=2.5, alpha=0.5)
    top.plot(steps, hist.gradops_loss, label="gradops", linewidth=1)
    top.set_ylabel("next-byte cross-entropy (nats)")
    top.set_title(title, fontsize=9)
    top.legend()
    bottom.semilogy(steps, [max(abs(g - t), 1e-9) for g, t in zip(hist.gradops_loss, hist.torch_loss)],
                    label="|gradops - torch|")
    bottom.semilogy(steps, [loss_tolerance(i) for i in steps], "--", label="tolerance")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
