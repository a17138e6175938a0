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
import json
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import backend, reference
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
from .registry import NAMES

F32, F64 = torch.float32, torch.float64
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: ``--dtype``'s short names (what the table prints, as ``gradops bench`` does) -> the dtype.
SHORT_DTYPES = {short_dtype(dt): dt for dt in DTYPES.values()}
U32 = torch.finfo(F32).eps / 2


@dataclass
class Case:
    args: tuple                 # arguments of the public function gradops.<op>
    ref_args: tuple             # arguments of gradops.reference.<op> (defaults to args)
    lengths: tuple[int, ...]    # reduction length behind each output (for the tolerance)
    peer: Callable | None       # PyTorch's own implementation, same inputs, same outputs
    peer_mask: torch.Tensor | None = None  # elements where PyTorch's definition is the same as CANN's


def _rstd(x, eps=1e-6):
    return torch.rsqrt(x.float().square().mean(-1) + eps)


def _autograd(fn, inputs, grad):
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return torch.autograd.grad(out, leaves, grad)


def _cases(op: str, dtype: torch.dtype, device: torch.device, m: int, n: int, gen: torch.Generator) -> Case:
    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(shape, generator=gen) * scale).to(dt).to(device)

    if op == "rms_norm":
        x, g = rnd(m, n), rnd(n)
        return Case((x, g, 1e-6), (x, g, 1e-6), (n, n),
                    lambda x, g, e: (F.rms_norm(x, (n,), g, e), _rstd(x, e)))
    if op == "rms_norm_grad":
        dy, x, g = rnd(m, n), rnd(m, n), rnd(n)
        r = _rstd(x)
        return Case((dy, x, r, g), (dy, x, r, g), (n, m),
                    lambda dy, x, r, g: _autograd(lambda x, g: F.rms_norm(x, (n,), g, 1e-6), (x, g), dy))
    if op in ("layer_norm", "layer_norm_grad", "layer_norm_backward", "layer_norm_grad_beta"):
        x, g, b, dy = rnd(m, n, scale=2.0), rnd(n), rnd(n), rnd(m, n)
        xf = x.float()
        mean, var = xf.mean(-1), (xf - xf.mean(-1, keepdim=True)).square().mean(-1)

        def ln_grads(*_):
            return _autograd(lambda x, g, b: F.layer_norm(x, (n,), g, b, 1e-5), (x, g, b), dy)
        if op == "layer_norm":
            return Case((x, g, b, 1e-5), (x, g, b, 1e-5), (n, n, n),
                        lambda x, g, b, e: (F.layer_norm(x, (n,), g, b, e), xf.mean(-1), var))
        if op == "layer_norm_grad":
            res = ((xf - mean[:, None]) * torch.rsqrt(var[:, None] + 1e-5)).to(dtype)
            return Case((dy, x, var, mean, g, 1e-5), (dy, x, var, mean, g, 1e-5), (n, 1),
                        lambda *a: (ln_grads()[0], res))
        if op == "layer_norm_backward":
            rstd = torch.rsqrt(var + 1e-5)
            return Case((dy, x, mean, rstd, g), (dy, x, mean, rstd, g), (n, m, m), ln_grads)
        res = ((xf - mean[:, None]) * torch.rsqrt(var[:, None] + 1e-5)).to(dtype)
        return Case((res, dy), (res, dy), (m, m), lambda res, dy: ((dy * res).sum(0), dy.sum(0)))
    if op in ("hardswish", "hardswish_backward"):
        x = (torch.rand(m, n, generator=gen) * 12 - 6).to(dtype).to(device)
        if op == "hardswish":
            return Case((x,), (x,), (1,), lambda x: (F.hardswish(x),))
        g = rnd(m, n)
        # PyTorch >= 2.8 uses the open interval at +-3 (CANN: closed): compare it off those two points only.
        return Case((g, x), (g, x), (1,), lambda g, x: (torch.ops.aten.hardswish_backward(g, x),),
                    peer_mask=x.abs() != 3)
    if op == "embedding_dense_backward":
        vocab = 4 * m
        grad, idx = rnd(8 * m, n), torch.randint(0, vocab, (8 * m,), generator=gen).to(device)
        return Case((grad, idx, vocab, 3, True), (grad, idx, vocab, 3, True), (8 * m,),
                    lambda grad, idx, v, p, s: (torch.ops.aten.embedding_dense_backward(grad, idx, v, p, s),))
    k = 4
    if op == "moe_token_permute":
        tokens, experts = rnd(m, n), torch.randint(0, 8, (m, k), generator=gen).to(device)
        rows = m * k - 3
        return Case((tokens, experts, rows), (tokens, experts, rows), (1, 0),
                    lambda t, e, r: (t[torch.argsort(e.flatten(), stable=True)[:r] // k],
                                     torch.argsort(torch.argsort(e.flatten(), stable=True)).int()))
    if op in ("moe_token_unpermute", "moe_token_unpermute_grad"):
        rows = m * k - 3  # three (token, k) copies dropped by the forward's capacity
        permuted, probs = rnd(rows, n), torch.rand(m, k, generator=gen).to(dtype).to(device)
        perm = torch.randperm(m * k, generator=gen).int().to(device)

        def unpermute(permuted, perm, probs):  # Megatron's unfused path: gather rows, weight, sum over k
            padded = torch.cat([permuted, permuted.new_zeros(1, n)])
            rows_of = torch.where(perm.long() < rows, perm.long(), rows)
            return (padded[rows_of].view(m, k, n).float() * probs.float()[:, :, None]).sum(1).to(permuted.dtype)
        if op == "moe_token_unpermute":
            return Case((permuted, perm, probs), (permuted, perm, probs), (k,), lambda *a: (unpermute(*a),))
        dy = rnd(m, n)
        return Case((permuted, dy, perm, probs), (permuted, dy, perm, probs), (1, n),
                    lambda p, dy, s, pr: _autograd(lambda p, pr: unpermute(p, s, pr), (p, pr), dy))
    grad, perm = rnd(m * k, n), torch.randperm(m * k, generator=gen).int().to(device)

    def index_add(grad, perm, k):  # Megatron's unfused backward: scatter-add rows to their tokens
        token_of_row = torch.empty_like(perm, dtype=torch.long)
        token_of_row[perm.long()] = torch.arange(perm.numel(), device=perm.device) // k
        return (torch.zeros(m, n, dtype=grad.dtype, device=grad.device).index_add_(0, token_of_row, grad),)
    return Case((grad, perm, k), (grad, perm, k), (k,), index_add)


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

    case = _cases(op, dtype, device, m, n, torch.Generator().manual_seed(seed))
    with _backend(name):
        used = backend.choose(op, device).name  # what the op's call plan runs (ops/_plan.py)
        out = getattr(gradops, op)(*case.args)
    out = out if isinstance(out, tuple) else (out,)
    ref = getattr(reference, op)(*map(_f64, case.ref_args), **({} if op == "moe_token_permute" else {"compute": F64}))
    ref = ref if isinstance(ref, tuple) else (ref,)
    error = max(_rel_error(o, r) for o, r in zip(out, ref))
    bound = max(torch.finfo(o.dtype).eps + 8 * math.sqrt(max(k, 1)) * U32 if o.is_floating_point() else 0.0
                for o, k in zip(out, case.lengths))
    torch_error = None
    if case.peer is not None:
        try:
            peer = case.peer(*case.args)
            torch_error = max(_rel_error(o, r, case.peer_mask) for o, r in zip(peer, ref))
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
    header = (f"{'op':<26} {'dtype':<5} {'device':<6} {'backend':<12} {'max rel err':>11} {'torch err':>11} "
              f"{'bound':>9}  result")
    print(header)
    print("-" * len(header))
    for r in rows:
        te = f"{r.torch_error:11.2e}" if r.torch_error is not None else f"{'-':>11}"
        print(f"{r.op:<26} {r.dtype:<5} {r.device:<6} {r.backend:<12} {r.error:11.2e} {te} {r.bound:9.2e}  "
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
