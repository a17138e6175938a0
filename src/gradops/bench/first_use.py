"""What a new user pays before gradops is fast: the documented install, then the first training step, measured.

``python -m gradops.bench.first_use`` (or ``scripts/first_use.sh``) does what README's "Installing gradops in your
own project" tells a user to do, in a fresh virtual environment under a temporary folder (no system site
packages): ``pip install torch==2.13.0``, then ``pip install <this checkout>``, with ``HOME`` pointed at an empty
temporary folder so that ``~/.cache/gradops`` starts empty (the install builds the CPU kernels into it). Then, each
in a fresh process of that environment:

- the first training step of a small model of gradops modules (Embedding -> RMSNorm -> LayerNorm -> Hardswish ->
  Linear, 8 x 64 tokens, width 128) with the cache empty (``cold``), and again with the cache that run filled
  (``warm``);
- the same model of ``torch.nn`` modules, twice: torch's own first step, the figure gradops is held to;
- ``import gradops``'s time, whether the native extension was loaded (``gradops.native.status()``) and what
  ``gradops env`` says.

Each process also times a few later steps, so that a first-step figure can be told from a slow steady state.
``--sweep`` then runs ``gradops bench --sweep`` in that environment (with only what the install gave) and counts
the cases where gradops is not slower than torch (its cases go to ``<results>/first-use-sweep-cpu-<date>.jsonl``).
One JSON line per run goes to ``<results>/first-use-cpu-<date>.jsonl`` with the machine, versions, commit and date.

``--no-install`` skips the virtual environment and measures with this interpreter (its gradops, its torch), still
with an empty cache. ``--dry-run`` is the whole flow in a few seconds, for the tests: ``--no-install``, a toy model
(2 x 4 tokens, width 8, no optimizer), and gradops' modules on the pure-torch reference (``GRADOPS_BACKEND=torch``:
nothing compiles); its record says ``"dry_run": true`` and measures nothing of the first use.

This file runs in two roles: the harness (``main``), and, as a plain script inside the measured environment, the
worker (``--worker``) that builds the model and times one process's steps. The worker imports nothing of gradops
before it times ``import gradops``, so this module imports only the standard library at its top.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

#: The model of issue 39: tokens (batch x sequence), width, and the embedding table's rows.
TOKENS = (8, 64)
WIDTH = 128
VOCAB = 1000
#: Later steps timed after the first, per process (their median is recorded).
LATER_STEPS = 20
#: What README tells a user to install first: the CPU wheel on our machines.
TORCH_REQUIREMENT = "torch==2.13.0"


def root() -> Path:
    """The repository root (src/gradops/bench/first_use.py -> the checkout), what ``pip install`` is given. A
    function: the worker's copy of this file lies in a folder with no parents to speak of."""
    return Path(__file__).resolve().parents[3]

#: Environment variables of the caller that would make the measured processes differ from a new user's.
_SCRUBBED = ("GRADOPS_CACHE_DIR", "NUMBA_CACHE_DIR", "GRADOPS_NATIVE", "GRADOPS_BACKEND", "GRADOPS_REQUIRE_NATIVE",
             "TRITON_INTERPRET", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TORCH_EXTENSIONS_DIR", "XDG_CACHE_HOME",
             "NUMBA_NUM_THREADS", "GRADOPS_DRY_RUN")


# ---------------------------------------------------------------------------------------------------------------------
# The worker: one fresh process, one model, its first step and a few later ones.

def _worker(impl: str, tokens: tuple[int, int], width: int, vocab: int, later: int, env: bool = False,
            optim: bool = True) -> dict:
    """Build the model of ``impl`` (``gradops`` or ``torch`` modules), time its first training step (forward, a
    summed loss, backward, an SGD step) and the median of ``later`` steps after it; ``env``: then record the first
    lines of ``gradops env``; ``optim=False``: the step leaves the parameters alone (``torch.optim``'s first
    optimizer imports torch._dynamo, ~2 s of a dry run's process)."""
    t0 = time.perf_counter()
    import torch

    result: dict = {"impl": impl, "import_torch_s": time.perf_counter() - t0}
    if impl == "gradops":
        t0 = time.perf_counter()
        import gradops.nn as nn_mod

        result["import_gradops_s"] = time.perf_counter() - t0
    else:
        nn_mod = torch.nn
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = torch.nn.Sequential(nn_mod.Embedding(vocab, width), nn_mod.RMSNorm(width), nn_mod.LayerNorm(width),
                                nn_mod.Hardswish(), torch.nn.Linear(width, width))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if optim else None
    indices = torch.randint(0, vocab, tokens)
    result["build_s"] = time.perf_counter() - t0  # the modules and the optimizer (torch.optim's import among them)

    def step() -> float:
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        model(indices).float().square().mean().backward()
        if optimizer is not None:
            optimizer.step()
        return time.perf_counter() - start

    result["first_step_s"] = step()
    times = sorted(step() for _ in range(later))
    result["later_step_ms"] = times[len(times) // 2] * 1e3 if times else None
    result["threads"] = torch.get_num_threads()
    result["torch"] = torch.__version__
    if impl == "gradops":
        import gradops
        from gradops import native
        from gradops.backend import select
        from gradops.registry import PROBE

        result["native"] = native.status()
        result["backend"] = select(PROBE, torch.device("cpu"))[0]
        result["gradops"] = gradops.__version__
    if impl == "gradops" and env:
        from gradops.cli import main as cli

        text = io.StringIO()
        with contextlib.redirect_stdout(text):  # after the timed steps: what `gradops env` tells this user
            cli(["env"])
        result["gradops_env"] = [line.strip() for line in text.getvalue().splitlines()[:3]]
    return result


# ---------------------------------------------------------------------------------------------------------------------
# The harness.

def _timed(cmd: list[str], env: dict, cwd: Path, log: Path | None = None) -> tuple[float, subprocess.CompletedProcess]:
    """Run ``cmd``; its wall seconds and result. Output goes to ``log`` (appended) when given. Raises on failure,
    naming the command and the end of its output."""
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if log is not None:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}):\n" + "\n".join(tail))
    return seconds, done


def _user_env(home: Path, venv: Path | None, dry: bool = False) -> dict:
    """A new user's environment: the caller's, less every gradops / torch-extension setting, HOME empty
    (so ``~/.cache`` is), the venv's bin first on PATH; ``dry``: the pure-torch reference (nothing compiles)."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env["HOME"] = str(home)
    if dry:
        env["GRADOPS_BACKEND"] = "torch"
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def _load() -> float | None:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def _machine() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or 'cpu'} ({os.cpu_count()} cpus)"


def _commit() -> dict:
    """The checkout's commit and whether tracked files differ from it (what ``pip install`` copied)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root()), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha or "unknown", "dirty": None if status is None else bool(status)}


def _run_worker(python: str, impl: str, args: argparse.Namespace, env: dict, cwd: Path, gradops_env: bool) -> dict:
    # a copy in the temporary folder: run from here, the script's folder (src/gradops/bench) would come first on
    # the worker's sys.path, and the checkout's modules beside the installed gradops
    script = cwd / "first_use_worker.py"
    if not script.exists():
        shutil.copyfile(Path(__file__).resolve(), script)
    cmd = [python, str(script), "--worker", impl, "--tokens", f"{args.tokens[0]}x{args.tokens[1]}",
           "--width", str(args.width), "--vocab", str(args.vocab), "--later", str(args.later),
           *(["--env"] if gradops_env else []), *(["--no-optim"] if args.dry_run else [])]
    wall, done = _timed(cmd, env, cwd)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = wall  # interpreter start to exit, what a user waits for a one-step script
    warnings = [line for line in done.stderr.splitlines() if line.strip()]
    if warnings:
        result["stderr"] = warnings[-5:]
    return result


#: A sweep case holds when gradops' time is at most torch's plus this share (issue 39: 5% for noise).
NOISE = 0.05


def _sweep_summary(path: Path) -> dict:
    """Cases in a ``gradops bench --sweep`` JSONL, how many have gradops at most torch's time, and how many hold
    within :data:`NOISE`."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    timed = [r for r in rows if "ratio" in r]
    slower = [f"{r.get('module') or r.get('op')} {r['rows']}x{r['cols']} {r['dtype']} {r['ratio']:.2f}"
              for r in timed if r["ratio"] > 1.0]
    held = sum(r["ratio"] <= 1.0 + NOISE for r in timed)
    return {"sweep_cases": len(timed), "sweep_not_slower": len(timed) - len(slower), "sweep_held": held,
            "sweep_slower": slower}


def measure(args: argparse.Namespace) -> dict:
    """Install (unless ``--no-install``), run the workers, and return the record."""
    top = Path(tempfile.mkdtemp(prefix="gradops-first-use-", dir=args.workdir))
    home = top / "home"
    home.mkdir()
    log = top / "install.log"
    record: dict = {"bench": "first-use", "mode": "no-install" if args.no_install else "install",
                    **({"dry_run": True} if args.dry_run else {}),
                    "model": f"Embedding({args.vocab},{args.width})-RMSNorm-LayerNorm-Hardswish-Linear on "
                             f"{args.tokens[0]}x{args.tokens[1]} tokens",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "device": "cpu", "device_name": _machine(), "python": platform.python_version(),
                    **_commit(), "loadavg_1m_start": _load()}
    try:
        if args.no_install:
            venv, python = None, sys.executable
            env = _user_env(home, None, args.dry_run)
        else:
            venv = top / "venv"
            python = str(venv / "bin" / "python")
            env = _user_env(home, venv)
            print(f"first-use: a fresh venv in {venv}", flush=True)
            record["venv_s"], _ = _timed([sys.executable, "-m", "venv", str(venv)], env, top, log)
            print(f"first-use: pip install {TORCH_REQUIREMENT}", flush=True)
            record["pip_install_torch_s"], _ = _timed([python, "-m", "pip", "install", "-q", TORCH_REQUIREMENT],
                                                      env, top, log)
            print(f"first-use: pip install {root()}", flush=True)
            record["pip_install_gradops_s"], _ = _timed([python, "-m", "pip", "install", str(root())], env, top, log)
            _, done = _timed([python, "-m", "pip", "list", "--format=json"], env, top)
            record["packages"] = {p["name"]: p["version"] for p in json.loads(done.stdout)}
            # the first import of torch reads ~1 GB of libraries from disk: done once here, so that neither side's
            # first process pays the disk for the other
            _timed([python, "-c", "import torch"], env, top)
        runs = []
        plan = [("gradops cold", "gradops"), ("gradops warm", "gradops"),
                *((f"torch {i + 1}", "torch") for i in range(args.torch_runs))]
        for label, impl in plan:
            print(f"first-use: {label}", flush=True)
            result = _run_worker(python, impl, args, env, top, label == "gradops warm")
            result["run"] = label
            runs.append(result)
        record["runs"] = runs
        by = {r["run"]: r for r in runs}
        torch_first = min(r["first_step_s"] for r in runs if r["impl"] == "torch")
        record["torch_first_step_s"] = torch_first
        record["gradops_cold_extra_s"] = by["gradops cold"]["first_step_s"] - torch_first
        record["gradops_warm_extra_s"] = by["gradops warm"]["first_step_s"] - torch_first
        record["import_gradops_cold_s"] = by["gradops cold"]["import_gradops_s"]
        record["import_gradops_warm_s"] = by["gradops warm"]["import_gradops_s"]
        warm = by["gradops warm"]
        record["native"] = warm["native"]
        record.update({k: warm[k] for k in ("torch", "gradops", "backend", "gradops_env", "threads")})
        cache = home / ".cache" / "gradops"
        record["cache_files"] = sum(1 for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
        if args.sweep:
            results = top / "sweep"
            print("first-use: gradops bench --sweep (with what the install gave)", flush=True)
            cmd = [python, "-c", "import sys; from gradops.cli import main; sys.exit(main(sys.argv[1:]))", "bench",
                   "--sweep", "--device", "cpu", "--results", str(results), *args.sweep_args]
            start = time.perf_counter()
            subprocess.run(cmd, env=env, cwd=top, check=False)
            record["sweep_s"] = time.perf_counter() - start
            record["sweep_args"] = args.sweep_args
            found = sorted(results.glob("sweep-*.jsonl"))
            record.update(_sweep_summary(found[0]) if found else {"sweep_cases": 0})
            if found and not args.no_save:  # the cases themselves, beside the record (the folder goes away)
                kept = args.results / f"first-use-sweep-cpu-{datetime.date.today().isoformat()}.jsonl"
                with kept.open("a") as f:
                    f.write(found[0].read_text())
                record["sweep_file"] = kept.name
    finally:
        record["loadavg_1m_end"] = _load()
        if args.keep:
            print(f"first-use: kept {top}", flush=True)
        else:
            shutil.rmtree(top, ignore_errors=True)
    return record


def _size(text: str) -> tuple[int, int]:
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise argparse.ArgumentTypeError(f"must be ROWSxCOLS with integers >= 1, got {text!r}")
    return int(rows), int(cols)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


class _Parser(argparse.ArgumentParser):
    """One line on stderr and exit status 2 for a bad argument, as gradops' CLI answers (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    """The harness's arguments (and the worker's, hidden)."""
    prog = "scripts/first_use.sh" if sys.argv[0].endswith("first_use.sh") else "python -m gradops.bench.first_use"
    p = _Parser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--no-install", action="store_true",
                   help="no fresh venv: measure with this interpreter's gradops and torch (the cache still empty)")
    p.add_argument("--dry-run", action="store_true",
                   help="the whole flow in seconds, measuring nothing: --no-install, a toy model, "
                        "GRADOPS_BACKEND=torch (for the tests)")
    p.add_argument("--tokens", type=_size, default=TOKENS, metavar="BATCHxSEQ", help="tokens per step (8x64)")
    p.add_argument("--width", type=_positive, default=WIDTH, help="the model's width (128)")
    p.add_argument("--vocab", type=_positive, default=VOCAB, help="the embedding table's rows (1000)")
    p.add_argument("--later", type=_count, default=LATER_STEPS, help="later steps timed per process (20)")
    p.add_argument("--torch-runs", type=_positive, default=2,
                   help="fresh processes of torch's own model; its first step is the least of them (2)")
    p.add_argument("--sweep", action="store_true", help="then run gradops bench --sweep in the fresh environment")
    p.add_argument("--sweep-args", default="", help="extra arguments of that sweep, one string "
                   "(e.g. '--processes 1 --sizes 8x8,64x128')")
    p.add_argument("--results", type=Path, default=None,
                   help="directory of first-use-cpu-<date>.jsonl (default benchmarks/results)")
    p.add_argument("--no-save", action="store_true", help="print the record only")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (venv, HOME, install log)")
    p.add_argument("--workdir", type=Path, default=None, help="where the temporary folder goes (default: TMPDIR)")
    p.add_argument("--worker", choices=("gradops", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-optim", action="store_true", help=argparse.SUPPRESS)
    return p


def _report(record: dict) -> None:
    for r in record["runs"]:
        extra = f"  import gradops {r['import_gradops_s']:.2f} s  native: {r['native']}" if "native" in r else ""
        print(f"{r['run']:<13} first step {r['first_step_s']:7.3f} s  later {r['later_step_ms']:.2f} ms  "
              f"process {r['process_s']:.2f} s{extra}")
    if "pip_install_gradops_s" in record:
        print(f"pip install torch {record['pip_install_torch_s']:.1f} s, gradops "
              f"{record['pip_install_gradops_s']:.1f} s")
    print(f"first step beyond torch's: cold {record['gradops_cold_extra_s']:+.3f} s (target <= 1), warm "
          f"{record['gradops_warm_extra_s']:+.3f} s (target <= 0.25); load {record['loadavg_1m_start']} -> "
          f"{record['loadavg_1m_end']}")
    if "sweep_cases" in record:
        print(f"sweep: {record.get('sweep_not_slower')}/{record['sweep_cases']} cases not slower than torch, "
              f"{record.get('sweep_held')}/{record['sweep_cases']} within {NOISE:.0%}")


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.tokens, args.width, args.vocab, args.later, args.env,
                                  not args.no_optim)), flush=True)
        return 0
    args.sweep_args = args.sweep_args.split()
    if args.dry_run:
        args.no_install = True
        defaults = {"tokens": TOKENS, "width": WIDTH, "vocab": VOCAB, "later": LATER_STEPS, "torch_runs": 2}
        toy = {"tokens": (2, 4), "width": 8, "vocab": 16, "later": 1, "torch_runs": 1}
        for name, value in toy.items():  # the toy sizes, unless given
            if getattr(args, name) == defaults[name]:
                setattr(args, name, value)
    args.results = args.results or root() / "benchmarks" / "results"
    if not args.no_save:
        try:
            args.results.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=args.results).close()
        except OSError as err:
            print(f"{p.prog}: error: argument --results: {args.results} is not a writable folder "
                  f"({err.strerror or err})", file=sys.stderr)
            return 2
    try:
        record = measure(args)
    except RuntimeError as err:
        print(f"first-use: {err}", file=sys.stderr)
        return 1
    _report(record)
    if not args.no_save:
        path = args.results / f"first-use-cpu-{datetime.date.today().isoformat()}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
