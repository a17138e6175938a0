"""Train the gradops model and its plain-PyTorch twin in lockstep on the same batches; time each step."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from .data import Batches
from .model import MoeLM


@dataclass
class History:
    """Per-step record of both runs (losses are the next-byte cross-entropy, in nats)."""

    gradops_loss: list[float] = field(default_factory=list)
    torch_loss: list[float] = field(default_factory=list)
    gradops_s: list[float] = field(default_factory=list)  # wall seconds of forward + backward + optimizer step
    torch_s: list[float] = field(default_factory=list)
    val: dict[str, float] = field(default_factory=dict)
    grad_error: float = 0.0  # step 0: max over parameters of max|g_gradops - g_torch| / max|g_torch|


class Progress:
    """A dependency-free progress bar on stderr: redrawn in place on a terminal, every 10% otherwise (CI logs)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.start = total, width, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.next_line = 0

    def update(self, done: int, note: str) -> None:
        if not self.tty and done < self.total and done < self.next_line:
            return
        self.next_line = done + max(1, self.total // 10)
        filled = self.width * done // self.total
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total - done) if done else 0.0
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} "
                f"{elapsed:5.1f}s eta {eta:5.1f}s  {note}")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer(model: MoeLM, lr: float) -> torch.optim.Optimizer:
    # foreach=False: one fixed update order in both runs (the multi-tensor path may group differently).
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01, foreach=False)


def _lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item()))


def _step(model: MoeLM, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, lr: float,
          device: torch.device) -> tuple[float, float]:
    _sync(device)
    start = time.perf_counter()
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    total, lm = model.loss(x, y)
    total.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
    opt.step()
    _sync(device)
    return lm.item(), time.perf_counter() - start


@torch.no_grad()
def _validate(model: MoeLM, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    model.eval()
    losses = [model.loss(x.to(device), y.to(device))[1].item() for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def gradient_error(model: MoeLM, twin: MoeLM, x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest relative gradient difference over all parameters on one batch (before any update): the direct
    check that every backward operator agrees with PyTorch's."""
    grads = []
    for m in (model, twin):
        m.zero_grad(set_to_none=True)
        m.loss(x, y)[0].backward()
        grads.append([p.grad.clone() for p in m.parameters()])
        m.zero_grad(set_to_none=True)
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(*grads))


def train(model: MoeLM, twin: MoeLM, data: Batches, steps: int, lr: float, device: torch.device,
          log_every: int, seed: int) -> History:
    """Run ``steps`` AdamW steps on both models with the same batches, alternating which one goes first so
    that cache effects do not favour either in the timings."""
    hist = History()
    opts = {"gradops": _optimizer(model, lr), "torch": _optimizer(twin, lr)}
    models = {"gradops": model, "torch": twin}
    x, y = (t.to(device) for t in data.validation(1, seed + 2)[0])
    hist.grad_error = gradient_error(model, twin, x, y)
    print(f"step-0 gradients, all {len(list(model.parameters()))} parameter tensors: largest relative difference "
          f"gradops vs torch {hist.grad_error:.1e}\n")
    bar = Progress(steps)
    print(f"{'step':>6} {'gradops':>9} {'torch':>9} {'|diff|':>9} {'gradops ms':>11} {'torch ms':>9}")
    for step in range(steps):
        x, y = (t.to(device) for t in data.next_train())
        rate = _lr_at(step, steps, lr)
        order = ("gradops", "torch") if step % 2 == 0 else ("torch", "gradops")
        for name in order:
            loss, seconds = _step(models[name], opts[name], x, y, rate, device)
            getattr(hist, f"{name}_loss").append(loss)
            getattr(hist, f"{name}_s").append(seconds)
        g, t = hist.gradops_loss[-1], hist.torch_loss[-1]
        if step % log_every == 0 or step == steps - 1:
            sys.stderr.write("\r" if bar.tty else "")
            print(f"{step:>6} {g:>9.4f} {t:>9.4f} {abs(g - t):>9.2e} {1e3 * hist.gradops_s[-1]:>11.1f} "
                  f"{1e3 * hist.torch_s[-1]:>9.1f}", flush=True)
        bar.update(step + 1, f"loss {g:.3f} / {t:.3f}")
    held_out = data.validation(8, seed + 1)
    hist.val = {name: _validate(m, held_out, device) for name, m in models.items()}
    return hist
