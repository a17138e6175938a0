"""``gradops check``: every op, dtype, device and usable backend against the float64 reference.

The oracle is :mod:`gradops.reference` run with float64 inputs and float64 math. Beside gradops' error the
table shows PyTorch's own error on the same inputs where PyTorch has the op (its eager CPU/CUDA path in the
same dtype). Error = max|out - ref| / max|ref| per output, worst output reported. A row passes when the
error is within one ulp of the output dtype plus float32 accumulation error (``8·sqrt(n)·u32`` for a length-n
reduction), or no larger than PyTorch's own.

``--results DIR`` also appends every row as a JSON line to ``DIR/check-<device>-<date>.jsonl``, with the device,
versions and commit (:mod:`gradops.bench.provenance`); a dry run's rows (``GRADOPS_DRY_RUN=1``) say so.

Exit status: 0 when every run passes, 1 when one fails, 2 when nothing could run (the one line on stderr says why:
no CUDA device, a backend that cannot run here) - a check of nothing is not a pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from . import backend
from .cli_support import (
    DTYPE_HELP,
    DTYPE_METAVAR,
    CommandError,
    dtype_name,
    int_at_least,
    output_dir,
    seed_value,
    short_dtype,
)
from .env import devices
from .registry import NAMES, spec

F32, F64 = torch.float32, torch.float64
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: ``--dtype``'s short names (what the table prints, as ``gradops bench`` does) -> the dtype.
SHORT_DTYPES = {short_dtype(dt): dt for dt in DTYPES.values()}
U32 = torch.finfo(F32).eps / 2


OPS = NAMES  # every operator of gradops.registry


def _f64(a):
    return a.to(F64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a


def _rel_error(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    if got.shape != ref.shape:  # the reference works on flat views: rstd (M,) against the op's keepdim (M, 1)
        if got.numel() != ref.numel():
            return math.inf
        ref = ref.reshape(got.shape)
    if mask is not None:
        got, ref = got[mask], ref[mask]
    if not ref.is_floating_point():
        return 0.0 if torch.equal(got.long().cpu(), ref.long().cpu()) else math.inf
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got.to(F64) - ref).abs().max()) if ref.numel() else 0.0
    return err / scale if scale else (0.0 if err == 0 else math.inf)


@contextmanager
def _backend(name: str):
    old = os.environ.get(backend.ENV)
    os.environ[backend.ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(backend.ENV, None)
        else:
            os.environ[backend.ENV] = old


@dataclass
class Row:
    op: str
    dtype: str
    device: str
    backend: str
    error: float
    torch_error: float | None
    bound: float
    ok: bool


def check_one(op: str, dtype: torch.dtype, device: torch.device, name: str, m: int, n: int, seed: int) -> Row:
    import gradops

    case = spec(op).example(m, n, dtype, device, torch.Generator().manual_seed(seed))
    with _backend(name):
        used = backend.decide(op, device).name  # what the op's call plan runs (ops/_plan.py)
        out = getattr(gradops, op)(*case.args)
    out = out if isinstance(out, tuple) else (out,)
    oracle = spec(op).providers["torch"]().fn  # the pure-torch reference, the op's declared torch provider
    # in float64 where the reference computes (a permutation only moves values: it has no compute dtype)
    wide = {"compute": F64} if "compute" in inspect.signature(oracle).parameters else {}
    ref = oracle(*map(_f64, case.args), **wide)
    ref = ref if isinstance(ref, tuple) else (ref,)
    error = max(_rel_error(o, r) for o, r in zip(out, ref))
    bound = max(torch.finfo(o.dtype).eps + 8 * math.sqrt(max(k, 1)) * U32 if o.is_floating_point() else 0.0
                for o, k in zip(out, case.lengths))
    torch_error = None
    if case.twin is not None:
        try:
            peer = case.twin(*case.args)
            torch_error = max(_rel_error(o, r, case.twin_mask) for o, r in zip(peer, ref))
        except (RuntimeError, TypeError, NotImplementedError):
            torch_error = None  # PyTorch lacks this dtype combination on this device
    ok = error <= bound or (torch_error is not None and error <= torch_error)
    label = name if used == name else f"{name}->{used}"
    return Row(op, short_dtype(dtype), str(device), label, error, torch_error, bound, ok)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", choices=OPS, help="only this op (repeatable)")
    parser.add_argument("--dtype", action="append", type=dtype_name, metavar=DTYPE_METAVAR,
                        help=f"only this dtype (repeatable): {DTYPE_HELP}")
    parser.add_argument("--backend", action="append", choices=list(backend.MODULES), help="only this backend")
    parser.add_argument("--device", action="append", choices=("cpu", "cuda"), help="only this device")
    parser.add_argument("--rows", type=int_at_least(1), default=96, help="rows (M) of the random inputs (default 96)")
    parser.add_argument("--cols", type=int_at_least(1), default=1000,
                        help="columns (N) of the random inputs (default 1000)")
    parser.add_argument("--seed", type=seed_value, default=None, help="random seed (default: fresh each run)")
    parser.add_argument("--results", type=Path, default=None,
                        help="also append the rows as JSON lines to DIR/check-<device>-<date>.jsonl, with device, "
                             "versions and commit")


def plan_runs(args: argparse.Namespace) -> tuple[list[tuple[str, torch.dtype, torch.device, str]], list[str]]:
    """The (op, dtype, device, backend) runs that ``args`` ask for and this machine can do, and one reason for each
    device or backend asked for by name that cannot run here (a default left out - Triton on a machine without a
    GPU - is no reason: "every usable backend" is what the default means)."""
    here = {d.type: d for d in devices()}
    dtypes = [SHORT_DTYPES[d] for d in dict.fromkeys(args.dtype or SHORT_DTYPES)]
    plan, skipped = [], []
    for kind in dict.fromkeys(args.device or here):
        device = here.get(kind)
        if device is None:
            skipped.append(f"--device {kind}: torch sees no {kind.upper()} device")
            continue
        for name in backend.MODULES:
            if args.backend and name not in args.backend:
                continue
            ok, why = backend.usable(name, device)
            if ok:
                plan += [(op, dt, device, name) for op in dict.fromkeys(args.op or OPS) for dt in dtypes]
            elif args.backend:
                skipped.append(f"--backend {name} on {kind}: {why}")
    return plan, skipped


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else int(time.time_ns() % 2**31)
    plan, skipped = plan_runs(args)
    if not plan:
        raise CommandError("nothing to check: " + "; ".join(skipped or ["no device and backend can run here"]))
    if args.results is not None:
        output_dir(args.results, "--results")  # refused before the runs, not after
    for why in skipped:  # what was asked for and is not in the table: said, not silently left out
        print(f"gradops check: skipped {why}", file=sys.stderr)
    print(f"gradops check: {len(plan)} runs, inputs {args.rows}x{args.cols}, seed {seed}", file=sys.stderr)
    rows, start = [], time.perf_counter()
    live = sys.stderr.isatty()  # a terminal gets one updating line; a log gets a line every tenth of the way
    for i, (op, dt, device, name) in enumerate(plan, 1):
        status = f"  [{i:>3}/{len(plan)}] {op:<26} {short_dtype(dt):<5} {device} {name:<7}"
        if live:
            print("\r" + status, end="", file=sys.stderr, flush=True)
        elif i == 1 or i == len(plan) or i % max(1, len(plan) // 10) == 0:
            print(status, file=sys.stderr, flush=True)
        rows.append(check_one(op, dt, device, name, args.rows, args.cols, seed + i))
    print(("\r" if live else "") + f"  done in {time.perf_counter() - start:.1f} s" + " " * 60, file=sys.stderr)
    width = max(26, *(len(r.op) for r in rows))  # the op column: the longest name checked
    header = (f"{'op':<{width}} {'dtype':<5} {'device':<6} {'backend':<12} {'max rel err':>11} {'torch err':>11} "
              f"{'bound':>9}  result")
    print(header)
    print("-" * len(header))
    for r in rows:
        te = f"{r.torch_error:11.2e}" if r.torch_error is not None else f"{'-':>11}"
        print(f"{r.op:<{width}} {r.dtype:<5} {r.device:<6} {r.backend:<12} {r.error:11.2e} {te} {r.bound:9.2e}  "
              f"{'pass' if r.ok else 'FAIL'}")
    failed = sum(not r.ok for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    if args.results is not None:
        for path in write_results(rows, args.results, {"seed": seed, "rows": args.rows, "cols": args.cols}):
            print(f"wrote {path}")
    return 1 if failed else 0


def write_results(rows: list[Row], results: Path, inputs: dict) -> list[Path]:
    """Append ``rows`` as JSON lines to ``results/check-<device>-<date>.jsonl``, one file per device, each line with
    the device, versions and commit (:func:`gradops.bench.provenance.environment`) and ``inputs`` (seed, sizes).
    Infinite errors (a shape or an integer result that differs) are written as null with ``"mismatch": true``."""
    from .bench.provenance import environment

    written = []
    for device in dict.fromkeys(r.device for r in rows):
        env = environment(torch.device(device))
        path = results / f"check-{torch.device(device).type}-{datetime.date.today().isoformat()}.jsonl"
        with path.open("a", encoding="utf-8") as f:
            for r in rows:
                if r.device != device:
                    continue
                rec = {"bench": "check", **dataclasses.asdict(r), **inputs, **env}
                if not math.isfinite(r.error):
                    rec["error"], rec["mismatch"] = None, True
                if r.torch_error is not None and not math.isfinite(r.torch_error):
                    rec["torch_error"] = None
                f.write(json.dumps(rec) + "\n")
        written.append(path)
    return written
