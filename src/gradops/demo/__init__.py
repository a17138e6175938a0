"""``gradops demo``: train a small MoE transformer language model on gradops, beside a plain-PyTorch twin.

Both models start from the same weights and see the same batches; the command prints both losses, their
largest difference against a stated tolerance, and the step-time ratio, and writes the per-step losses
(``losses.csv``) and a loss-curve PNG (``loss_curve.png``) to ``--out``. Exit status 1 when the losses disagree.

``--ep N`` trains the gradops model expert-parallel over N local processes instead (:mod:`.parallel`) and prints
its loss beside a single-process run of the same model.

Everything that can refuse the run does so before the first step, in one line (exit status 2): argument values,
the device, a backend named in ``GRADOPS_BACKEND`` that cannot run there, too little text, an ``--out`` that cannot
be written.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .. import backend
from ..cli_support import CommandError, int_at_least, output_dir, positive_float, seed_value
from ..registry import NAMES
from .data import Batches, load_text
from .model import Config, build_pair
from .report import (
    DRIFT_TOLERANCE,
    DRIFT_WINDOW,
    GRAD_TOLERANCE,
    agreement,
    drift,
    loss_tolerance,
    plot,
    step_time_ratio,
    write_csv,
)
from .training import train

#: The operators a training step may run (the model's forwards and the backwards their autograd calls): gradops'.
OPS = NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfg = Config()
    parser.add_argument("--data", metavar="FILE", help="train on this text file instead of the Python standard "
                        "library's docstrings")
    parser.add_argument("--device", type=device_arg, default="cpu",
                        help="cpu, cuda, cuda:1, ... or auto (default: cpu)")
    parser.add_argument("--steps", type=int_at_least(1), default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--out", metavar="DIR", default="gradops-demo", help="where losses.csv and loss_curve.png "
                        "go (default: ./gradops-demo)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=16, help="sequences per step (default: 16)")
    parser.add_argument("--seq-len", type=int_at_least(2), default=cfg.seq_len,
                        help=f"bytes per sequence (default: {cfg.seq_len})")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="peak AdamW learning rate (default: 3e-3)")
    parser.add_argument("--seed", type=seed_value, default=0, help="weights and batch order (default: 0)")
    parser.add_argument("--log-every", type=int_at_least(0), default=0,
                        help="print losses every N steps (default: steps/15)")
    parser.add_argument("--ep", type=int_at_least(0), default=0, metavar="N",
                        help="train the gradops model expert-parallel over N local processes (gloo) and print its "
                             "loss beside a single-process run of the same model instead of the torch twin")


def device_arg(name: str) -> torch.device:
    """``--device``: ``cpu``, ``cuda``, ``cuda:N`` of a device torch sees, or ``auto`` (CUDA when there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name!r} is not a device here; use cpu, cuda, cuda:N or auto")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{name}, but torch sees no CUDA device (use --device cpu)")
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{name}, but torch sees {count} CUDA device(s): cuda:0 to "
                                             f"cuda:{count - 1}")
    return device


def check_backends(device: torch.device) -> None:
    """Refuse, before any work, a backend named in ``GRADOPS_BACKEND`` that cannot run the demo's operators on
    ``device`` (Triton on CPU tensors without ``TRITON_INTERPRET=1``, CPU kernels not built for ``cpu``).

    Raises:
        CommandError: the backend's reason, naming the variable.
    """
    for op in OPS:
        try:
            backend.decide(op, device)
        except backend.BackendUnavailable as err:
            raise CommandError(str(err)) from None


def run(args: argparse.Namespace) -> int:
    check_backends(torch.device("cpu") if args.ep else args.device)  # --ep trains on CPU processes
    if args.ep:
        from .parallel import run as run_expert_parallel

        return run_expert_parallel(args)
    started = time.perf_counter()
    device = args.device
    out = output_dir(Path(args.out), "--out")  # before training: the files are written only after the last step
    cfg = Config(seq_len=args.seq_len)
    text, source = load_text(args.data)
    data = Batches(text, cfg.seq_len, args.batch_size, args.seed)
    model, twin, report = build_pair(cfg, args.seed, device)
    params = sum(p.numel() for p in model.parameters())
    print(f"gradops demo: byte-level MoE transformer, {cfg.layers} layers, dim {cfg.dim}, {cfg.experts} experts "
          f"top-{cfg.topk}, {params / 1e3:.0f}k parameters, {args.batch_size}x{cfg.seq_len} bytes per step, "
          f"{args.steps} steps on {device} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print(f"corpus: {source}")
    chosen: dict[str, list[str]] = {}
    for op in OPS:
        chosen.setdefault(backend.select(op, device)[0], []).append(op)
    print("backends: " + "; ".join(f"{name} ({len(ops)} ops)" if len(chosen) == 1 else f"{name}: {', '.join(ops)}"
                                   for name, ops in chosen.items()))
    print("MoE permute / unpermute: gradops.nn.MoeTokenPermute / MoeTokenUnpermute (twin: torch argsort + gather)")
    print(report)
    print()

    hist = train(model, twin, data, args.steps, args.lr, device, args.log_every or max(1, args.steps // 15),
                 args.seed)

    worst, at, agree = agreement(hist)
    g_s, t_s, ratio = step_time_ratio(hist)
    first = sum(hist.gradops_loss[:10]) / len(hist.gradops_loss[:10])
    last = sum(hist.gradops_loss[-10:]) / len(hist.gradops_loss[-10:])
    write_csv(hist, out / "losses.csv")
    title = f"gradops demo: {args.steps} steps on {device}; median step time gradops/torch = {ratio:.2f}x"
    drawn = plot(hist, out / "loss_curve.png", title)
    print()
    print(f"loss (mean of first / last 10 steps): gradops {first:.3f} -> {last:.3f}; torch "
          f"{sum(hist.torch_loss[:10]) / len(hist.torch_loss[:10]):.3f} -> "
          f"{sum(hist.torch_loss[-10:]) / len(hist.torch_loss[-10:]):.3f}")
    print(f"held-out loss: gradops {hist.val['gradops']:.4f}, torch {hist.val['torch']:.4f}")
    print(f"step-0 gradients: largest relative difference {hist.grad_error:.1e} (tolerance {GRAD_TOLERANCE:.0e})")
    mean, start = drift(hist)
    print(f"largest mean loss difference over {DRIFT_WINDOW} steps: {mean:.1e} from step {start} (tolerance "
          f"{DRIFT_TOLERANCE:.0e})")
    print(f"largest |loss difference|: {worst:.2e} at step {at} (tolerance there {loss_tolerance(at):.1e}): "
          f"{'agree' if agree else 'DISAGREE'}")
    print("  (by design gradops' hardswish gradient at exactly x = +-3 is CANN's -0.5 / 1.5 where torch >= 2.8 "
          "gives 0 / 1; a float32 N(0, 2^2) activation is exactly +-3 with probability ~3e-8, a bfloat16 one 0.20%, "
          "a float16 one 0.025%)")
    print(f"median step time: gradops {1e3 * g_s:.1f} ms, torch {1e3 * t_s:.1f} ms, ratio gradops/torch "
          f"{ratio:.2f}x")
    print(f"wrote {out / 'losses.csv'}; {drawn}")
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0 if agree else 1
