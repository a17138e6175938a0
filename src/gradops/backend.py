"""Which implementation runs: the one decision point every operator goes through.

``GRADOPS_BACKEND`` (read at each call, so tests and users can switch at run time):

- ``auto`` (default): CUDA tensors -> ``triton``; CPU tensors -> ``cpu`` (compiled CPU kernels); whichever is
  missing -> ``torch``.
- ``torch``: the pure-torch reference on any device.
- ``triton``: the Triton kernels; on CPU tensors only with ``TRITON_INTERPRET=1`` (the interpreter, for tests).
- ``cpu``: the compiled CPU kernels (needs numba).

A backend that does not implement an op leaves it to ``torch``; a backend asked for by name that cannot run
on the device raises, so a typo or a missing dependency never passes silently.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from functools import cache
from types import ModuleType

import torch

ENV = "GRADOPS_BACKEND"
#: backend name -> module whose functions carry the op names (``rms_norm_grad``, ...).
MODULES = {"torch": "gradops.reference", "triton": "gradops.launch", "cpu": "gradops.cpu"}
CHOICES = ("auto", *MODULES)


def requested() -> str:
    name = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if name not in CHOICES:
        raise ValueError(f"{ENV}={name!r} is not a backend; choose one of {', '.join(CHOICES)}")
    return name


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (the variable must be set before triton loads)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device``, and if not, why."""
    if name == "torch":
        return True, ""
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install 'gradops[triton]')"
        if device.type == "cuda" or (device.type == "cpu" and interpreting()):
            return True, ""
        return False, f"the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors (got {device})"
    if name == "cpu":
        if device.type != "cpu":
            return False, f"the compiled CPU kernels run on CPU tensors only (got {device})"
        if importlib.util.find_spec("numba") is None:
            return False, "numba is not installed (pip install 'gradops[cpu]')"
        return True, ""
    return False, f"unknown backend {name!r}"


@cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(MODULES[name])
    except ImportError:
        return None


def candidates(device: torch.device) -> list[str]:
    """Backends to try for ``device``, best first, ending with ``torch``."""
    name = requested()
    if name == "auto":
        first = {"cuda": "triton", "cpu": "cpu"}.get(device.type)
        return [first, "torch"] if first and usable(first, device)[0] else ["torch"]
    ok, why = usable(name, device)
    if not ok:
        raise RuntimeError(f"{ENV}={name}: {why}")
    return [name, "torch"] if name != "torch" else ["torch"]


def select(op: str, device: torch.device) -> tuple[str, Callable]:
    """``(backend name, implementation)`` of ``op`` for tensors on ``device``."""
    for name in candidates(device):
        module = _module(name)
        fn = getattr(module, op, None) if module is not None else None
        if fn is not None:
            return name, fn
    raise RuntimeError(f"no implementation of {op} for {device}")  # unreachable: torch implements every op
