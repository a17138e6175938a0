"""What the ``gradops`` subcommands share to refuse a request in one line instead of a traceback.

- argparse types (:func:`int_at_least`, :func:`positive_float`, :func:`dtype_name`) that reject a nonsensical
  value while the arguments are parsed, naming what is accepted;
- :class:`CommandError`, raised by a subcommand that cannot do what it was asked (no CUDA device, an output folder
  it cannot write, nothing to check): :func:`gradops.cli.main` prints ``gradops <command>: error: <message>`` and
  exits 2, the status argparse gives a bad argument;
- :func:`output_dir`, which makes sure results can be written *before* the work that produces them starts.

Nothing here imports torch at module level: ``gradops verify`` loads this module too and needs no torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


class CommandError(SystemExit):
    """A subcommand cannot run as asked; the message is one line that names the argument or variable at fault and
    what would be accepted.

    A SystemExit, so that where no :func:`gradops.cli.main` formats it (an example script that uses
    :class:`gradops.demo.data.Batches`) Python still ends with the message alone, status 1, as the demo's earlier
    ``SystemExit("gradops demo: ...")`` did, instead of a traceback."""


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for an integer ``>= low`` (a zero or negative count, size or interval is refused at
    parse time, in one line, instead of failing deep inside the run)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


#: Seeds above this overflow torch's generators (their range ends at 2^64, and runs add their index to the seed).
SEED_LIMIT = 2**63


def seed_value(text: str) -> int:
    """An argparse ``type`` for a random seed: an integer in ``[0, 2^63)``."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2^63 - 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type`` for a finite number ``> 0`` (a learning rate, a time budget)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


#: Every spelling a command accepts for a floating dtype -> the short name every command prints (and that
#: ``gradops bench`` has always written to its JSON lines, so old and new results compare).
DTYPE_SPELLINGS = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16",
                   "bfloat16": "bf16"}
#: The short names with their long spelling, as the help and the error messages list them.
DTYPE_HELP = "fp32 (float32), fp16 (float16), bf16 (bfloat16)"
DTYPE_METAVAR = "{fp32,fp16,bf16}"


def dtype_name(text: str) -> str:
    """An argparse ``type``: any spelling of :data:`DTYPE_SPELLINGS` (``float32``, ``fp32``, ``torch.float32``, any
    case) -> its short name (``fp32``)."""
    short = DTYPE_SPELLINGS.get(text.strip().lower().removeprefix("torch."))
    if short is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a dtype; choose from {DTYPE_HELP}")
    return short


def short_dtype(dtype: object) -> str:
    """``torch.float32`` -> ``fp32`` (a dtype without a short name keeps torch's: ``float64``)."""
    long = str(dtype).removeprefix("torch.")
    return DTYPE_SPELLINGS.get(long, long)


def output_dir(path: Path, flag: str) -> Path:
    """Create ``path`` (and its parents) and prove a file can be written in it, so that a run which ends by writing
    results there cannot lose its work to the write; returns ``path``.

    Raises:
        CommandError: naming ``flag`` and why (the folder cannot be created, or is not writable).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Permission bits alone do not answer (root passes os.access, /proc refuses root): try a real file.
        tempfile.TemporaryFile(dir=path).close()
    except FileExistsError:
        raise CommandError(f"{flag} {path}: exists and is not a directory; give a directory to write to") from None
    except OSError as err:
        raise CommandError(f"{flag} {path}: cannot write there ({err.strerror or err}); give a writable "
                           "directory") from None
    return path


def check_backend_variable() -> None:
    """Refuse a ``GRADOPS_BACKEND`` that names no backend before any work starts.

    Raises:
        CommandError: ``GRADOPS_BACKEND='bogus' is not a backend; choose one of auto, torch, triton, cpu``.
    """
    from . import backend

    try:
        backend.requested()
    except ValueError as err:
        raise CommandError(str(err)) from None


def refusal(err: BaseException) -> str | None:
    """The one-line message of an error that means "this cannot run here" rather than a bug: a
    :class:`CommandError`, or a :class:`gradops.backend.BackendUnavailable` (a backend named in
    ``GRADOPS_BACKEND`` that cannot run: Triton without a GPU, CPU kernels not built). None for anything else."""
    if isinstance(err, CommandError):
        return str(err)
    backend = sys.modules.get("gradops.backend")  # loaded whenever one of its errors exists
    if backend is not None and isinstance(err, backend.BackendUnavailable):
        return str(err)
    return None


def load_average() -> tuple[float, int] | None:
    """``(1-minute load average, CPU count)``, or None where the platform has no load average (Windows)."""
    if not hasattr(os, "getloadavg"):
        return None
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except OSError:  # the platform has the call but cannot answer
        return None
