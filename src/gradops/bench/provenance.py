"""Where and with what a result was taken: the fields every record of ``gradops bench`` and ``gradops check
--results`` carries (device and its name, driver, torch / triton versions, gradops' commit, the date).

A number without them cannot be compared with another, and results are carried off the machine that took them
(benchmarks/results/). ``GRADOPS_COMMIT`` names the commit where the source has no ``.git`` (a copy of the working
tree); ``GRADOPS_DRY_RUN=1`` (``scripts/gpu_check.sh --dry-run`` sets it) marks every record ``"dry_run": true``: the
flow ran, on the CPU, and nothing in the record is a measurement of the device.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

#: The checkout gradops runs from (src/gradops/bench/provenance.py -> the repository root), when it is one.
ROOT = Path(__file__).resolve().parents[3]
DRY_RUN_ENV = "GRADOPS_DRY_RUN"
COMMIT_ENV = "GRADOPS_COMMIT"


def version(pkg: str) -> str | None:
    """The installed version of distribution ``pkg``, or None."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def dry_run() -> bool:
    """Whether this process runs a dry run (``GRADOPS_DRY_RUN=1``)."""
    return os.environ.get(DRY_RUN_ENV, "0").strip() == "1"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> dict[str, object]:
    """``{"commit": sha, "dirty": bool}``: ``GRADOPS_COMMIT`` when set, else the checkout's HEAD and whether tracked
    files differ from it; ``"unknown"`` / None where neither is available."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return {"commit": given, "dirty": None}
    if not (ROOT / ".git").exists():
        return {"commit": "unknown", "dirty": None}
    sha = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": sha or "unknown", "dirty": None if status is None else bool(status)}


def driver() -> str | None:
    """The NVIDIA driver's version (``nvidia-smi``), or None where there is no such tool."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or 'cpu'} ({os.cpu_count()} cpus)"


def environment(device: torch.device, dry: bool = False) -> dict:
    """What every record carries, so that a number says where, when and with which versions it was taken;
    ``"dry_run": true`` with ``dry`` or ``GRADOPS_DRY_RUN=1``."""
    import gradops
    from gradops.backend import select
    from gradops.registry import PROBE

    env = {
        "device": device.type, "device_name": device_name(device), "torch": torch.__version__,
        "triton": version("triton"), "liger_kernel": version("liger-kernel"),
        "gradops": gradops.__version__, "gradops_backend": select(PROBE, device)[0],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(), **commit(),
        "driver": driver() if device.type == "cuda" else None, "cuda_runtime": torch.version.cuda,
    }
    if device.type == "cpu":
        from gradops import native

        env["native"] = native.status()  # whether gradops.nn's LayerNorm / Hardswish recorded C++ nodes
    if device.type == "cpu" and hasattr(os, "getloadavg"):
        env["loadavg_1m"] = round(os.getloadavg()[0], 2)  # a shared machine shows up here
    if dry or dry_run():
        env["dry_run"] = True
    return env
