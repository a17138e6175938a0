"""``gradops bench``: every op against PyTorch eager, torch.compile and Liger-Kernel, side by side in one run.

For each op, shape and dtype it prints median and p20/p80 times, GB/s on the op's byte floor (formulas in
:mod:`gradops.bench.cases`), % of the ``copy_`` bandwidth measured in the same run, and the speedup of gradops
(fresh outputs, and ``out=`` preallocated) over each peer. Results are appended as JSON lines to
``<results>/<device>-<date>.jsonl`` and drawn to ``<results>/<device>-<date>.png``.

``--sweep`` instead times each ``gradops.nn`` module against its ``torch.nn`` twin, forward + backward, and each
backward function against its eager twin, from 8 x 8 to 4096 x 1024 (:mod:`gradops.bench.sweep`). ``--models``
times whole transformers models, patched against unpatched (:mod:`gradops.bench.models`). ``--per-call`` measures
what one call of each public function costs at 8 x 8 fp32 (direct path, through the op, and ATen's twin:
:mod:`gradops.bench.per_call`). ``--compile-cost`` measures the first-call cost of the CPU kernels in
fresh processes, with an empty cache (cold: the first import builds them) and with the cache that run filled.

``--dry-run`` runs every provider once and records no times (each record says ``dry_run``): the whole flow at toy
sizes, under ``TRITON_INTERPRET=1`` too, for ``scripts/gpu_check.sh --dry-run``. ``--shapes gpu-check`` is the
reduced CUDA shape set that script times; ``--sweep --sizes 8x8,64x128`` picks the sweep's sizes and
``--processes 0`` measures every sweep case in this process. Records are appended case by case, so a run stopped
by a time limit keeps what it finished. Every record carries the device, driver, versions, commit and date
(:mod:`gradops.bench.provenance`).

Before any timing it refuses, in one line (exit status 2), what would waste the run: a ``--results`` folder it
cannot write (the results are written at the end), ``--device cuda`` without one, a ``--dtype`` the mode does not
time. The header gives the 1-minute load average, and one line warns when other work is using the cores: timings
then measure the contention (on a loaded 2-core VM the smallest cases sit at the scheduler's granularity).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
from pathlib import Path

import torch

from ..cli_support import (
    DTYPE_HELP,
    DTYPE_METAVAR,
    CommandError,
    dtype_name,
    int_at_least,
    load_average,
    output_dir,
    positive_float,
)
from . import provenance
from .cases import OPS, SHAPES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: Load average per CPU above which the header warns: past half the cores, another job holds cores the timed
#: threads (torch's pool uses them all) need, and a parallel kernel waits for its slowest thread.
BUSY_LOAD_PER_CPU = 0.5
PROVIDERS = ("gradops", "gradops fresh", "gradops out=", "eager", "compile", "liger", "copy_")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to run (default: cuda when available, else cpu)")
    parser.add_argument("--op", action="append", choices=OPS, help="op to time (repeatable; default: all)")
    parser.add_argument("--dtype", action="append", type=dtype_name, metavar=DTYPE_METAVAR,
                        help=f"dtype (repeatable: {DTYPE_HELP}; default: fp32 and bf16 on cpu, bf16/fp16/fp32 on "
                             "cuda)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, few rounds, no torch.compile: a smoke run (well under a minute on CPU)")
    parser.add_argument("--shapes", choices=tuple(SHAPES), default=None,
                        help="the shape set (default: the device's; quick with --quick; gpu-check: one or two LLM "
                             "shapes per op, what scripts/gpu_check.sh times)")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every provider once at the dry-run sizes and record no times (records say "
                             "dry_run): the whole flow, also under TRITON_INTERPRET=1, with no timing claim "
                             "(scripts/gpu_check.sh --dry-run); with the table, --sweep and --models")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peer")
    parser.add_argument("--reps", type=int_at_least(1), default=None,
                        help="timed rounds per case (default 15, quick 3)")
    parser.add_argument("--budget", type=positive_float, default=30.0,
                        help="seconds of timed rounds per case at most")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"),
                        help="directory for the JSONL and PNG (default benchmarks/results)")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    parser.add_argument("--compile-cost", action="store_true",
                        help="measure the CPU kernels' first-call cost, cold (built) and cached, and exit")
    parser.add_argument("--per-call", action="store_true",
                        help="measure every public function's per-call cost at 8 x 8 fp32 against ATen (on cuda: host "
                             "time per call), and exit")
    parser.add_argument("--sweep", action="store_true",
                        help="time every gradops.nn module against torch.nn (forward + backward) and every "
                        "backward function against its eager twin, from 8 x 8 to 4096 x 1024, and exit")
    parser.add_argument("--models", action="store_true",
                        help="whole Hugging Face transformers models (Llama, Qwen3-MoE), patched vs unpatched vs "
                             "transformers' experts backends, forward + backward (needs transformers >= 5.23)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="capture a patched model's training step (Llama, Qwen3-MoE) with torch.cuda.graph and "
                             "torch.compile(mode=\"reduce-overhead\"), replay it and compare with the eager step "
                             "(needs CUDA and transformers), and exit")
    parser.add_argument("--sweep-compile", action="store_true",
                        help="with --sweep: also torch.compile(torch module) (dynamic shapes) and of each function's "
                        "pure-torch reference")
    parser.add_argument("--malloc", choices=("steady", "glibc"), default=None,
                        help="with --sweep on CPU: steady (default) turns glibc's heap trimming off and serves "
                             "allocations up to 32 MiB from the heap, so that neither side's step time depends on "
                             "when free() last gave memory back (page faults that swing a 512 x 256 step by up to "
                             "2x); glibc keeps glibc's dynamic defaults")
    parser.add_argument("--processes", type=int_at_least(0), default=None,
                        help="with --sweep: fresh worker processes per case (default 3); the table reports the "
                             "median of their ratios and the range; 0 measures every case in this process")
    parser.add_argument("--sizes", type=_sizes, default=None, metavar="ROWSxCOLS[,...]",
                        help="with --sweep: these activation sizes instead of 8x8 ... 4096x1024")


def environment(device: torch.device, dry: bool = False) -> dict:
    """What every record carries (:func:`gradops.bench.provenance.environment`)."""
    return provenance.environment(device, dry)


def _release_pool() -> None:
    """Free the CPU output pool between cases (it holds the last case's outputs, up to GiBs at large V)."""
    pool = sys.modules.get("gradops.cpu._pool")
    if pool is not None:
        pool.clear()


def load_note() -> tuple[str, str | None]:
    """``("load 0.42 (1 min) on 2 cpus", warning or None)`` for the bench header; the warning is one line, given
    when the load average exceeds :data:`BUSY_LOAD_PER_CPU` per CPU. Empty text where there is no load average."""
    found = load_average()
    if found is None:
        return "", None
    load, cpus = found
    text = f"load {load:.2f} (1 min) on {cpus} cpus"
    if load <= BUSY_LOAD_PER_CPU * cpus:
        return text, None
    return text, (f"gradops bench: warning: the 1-minute load average is {load:.2f} on {cpus} cpus: other work is "
                  "running, so these times measure the contention too (small cases can sit at the timer's "
                  "granularity); rerun on an idle machine")


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``--sizes``: ``8x8,64x128`` -> ((8, 8), (64, 128)); each side an integer >= 1."""
    out = []
    for part in text.split(","):
        rows, sep, cols = part.strip().lower().partition("x")
        if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
            raise argparse.ArgumentTypeError(f"must be ROWSxCOLS[,ROWSxCOLS...] with integers >= 1, got {text!r}")
        out.append((int(rows), int(cols)))
    return tuple(out)


def _mode(args: argparse.Namespace) -> str:
    """Which of the exclusive modes runs (the first flag given, in this order), ``table`` for the main one."""
    return next((m for m in ("compile_cost", "per_call", "cuda_graphs", "models", "sweep") if getattr(args, m)),
                "table")


def _check_request(args: argparse.Namespace) -> None:
    """Refuse what would fail, or silently time nothing, only after the work: run before any of it.

    Raises:
        CommandError: one line naming the argument.
    """
    mode = _mode(args)
    if mode == "table" and os.environ.get("TRITON_INTERPRET") == "1" and not args.dry_run:
        raise CommandError("TRITON_INTERPRET=1 would time the interpreter; unset it (or --dry-run: no times)")
    if mode == "cuda_graphs" and (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) != "cuda":
        raise CommandError("--cuda-graphs needs a CUDA device (CUDA graphs have no CPU form)")
    if args.dry_run and mode in ("compile_cost", "per_call", "cuda_graphs"):
        raise CommandError(f"--dry-run applies to the table, --sweep and --models, not --{mode.replace('_', '-')}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda, but torch sees no CUDA device (use --device cpu)")
    from ..backend import decide
    from ..registry import PROBE

    # A GRADOPS_BACKEND that cannot run here (triton without a GPU) fails every mode: say so before the first case.
    decide(PROBE, torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if mode in ("models", "sweep", "cuda_graphs") and args.dtype:
        timed = importlib.import_module(f"{__name__}.{'models' if mode == 'cuda_graphs' else mode}").DTYPES
        if any(d not in timed for d in args.dtype):
            flag = mode.replace("_", "-")
            raise CommandError(f"--dtype {', '.join(d for d in args.dtype if d not in timed)}: --{flag} times "
                               f"{' and '.join(timed)} only")
    for flag, given in (("--sweep-compile", args.sweep_compile), ("--malloc", args.malloc is not None),
                        ("--processes", args.processes is not None), ("--sizes", args.sizes is not None)):
        if given and mode != "sweep":
            raise CommandError(f"{flag} applies to --sweep only")
    if mode != "compile_cost" and not args.no_save:  # --compile-cost writes nothing
        output_dir(args.results, "--results")


def run(args: argparse.Namespace) -> int:
    _check_request(args)
    load, busy = load_note()
    if busy:
        print(busy, file=sys.stderr, flush=True)
    if args.compile_cost:
        from .compile_cost import measure
        return measure()
    if args.per_call:
        from .per_call import measure as per_call
        return per_call(None if args.no_save else args.results, torch.device(args.device or "cpu"))
    dry = args.dry_run
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results = None if args.no_save else args.results
    if args.cuda_graphs:
        from . import graphs

        return graphs.run(device, list(dict.fromkeys(args.dtype)) if args.dtype else None, results,
                          environment(device))
    if args.models:
        from . import models

        dtypes = list(dict.fromkeys(args.dtype or models.DEFAULT_DTYPES[device.type]))
        return models.run(device, dtypes, args.reps or 15, args.budget, results, environment(device, dry), dry)
    if args.sweep:
        from . import sweep

        dtypes = args.dtype or ["fp32", "bf16"]
        # the workers set the allocator for themselves (this process times nothing) and report what they did
        malloc = (args.malloc or "steady") if device.type == "cpu" else None
        processes = sweep.PROCESSES if args.processes is None else args.processes
        return sweep.run(device, list(dict.fromkeys(dtypes)), args.sweep_compile, min(args.budget, 2.0), results,
                         environment(device, dry), processes, malloc, sizes=args.sizes or sweep.SIZES, dry=dry)
    from . import report
    from .cases import build
    from .timing import once, time_cpu, time_cuda

    dtypes = [DTYPES[d] for d in dict.fromkeys(args.dtype or (["fp32", "bf16"] if device.type == "cpu" else
                                                              ["bf16", "fp16", "fp32"]))]
    shapes = SHAPES[args.shapes or ("dry" if dry else "quick" if args.quick else device.type)]
    peers = set() if args.quick or args.no_compile else {"compile"}
    reps = args.reps or (3 if args.quick else 15)
    timer = once if dry else time_cuda if device.type == "cuda" else time_cpu
    env = environment(device, dry)
    rows: list[dict] = []
    stem = f"{device.type}-{datetime.date.today().isoformat()}"
    print(f"gradops bench{' --dry-run (no times)' if dry else ''} on {env['device_name']}: torch {env['torch']}, "
          f"triton {env['triton']}, liger-kernel {env['liger_kernel']}, backend "
          f"{env['gradops_backend']}, {env['threads']} threads" + (f", {load}" if load else ""), flush=True)
    for op in args.op or OPS:
        for shape in shapes[op]:
            for dtype in dtypes:
                case = build(op, shape, dtype, device, peers)
                timings = timer(case.providers, reps, args.budget, failures=case.notes)
                for name, why in case.notes.items():
                    print(f"  ({op} {name}: {why})", file=sys.stderr)
                new = report.records(case, timings, env)
                print(report.table(new).split("\n", 2)[2] if rows else report.table(new), flush=True)
                if results is not None:  # case by case: a run stopped by a time limit keeps what it measured
                    report.write_jsonl(new, results / f"{stem}.jsonl")
                rows.extend(new)
                del case, timings
                _release_pool()
    if results is not None and rows:
        drawn = report.plot(rows, results / f"{stem}.png")
        print(f"\nwrote {results / (stem + '.jsonl')}" + (f" and {stem}.png" if drawn else ""))
    return 0
