"""``gradops env``: what this machine offers and which backend each op would use."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform

import torch

from . import backend
from .registry import NAMES, SPECS

OPS = NAMES  # every operator of gradops.registry


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def devices() -> list[torch.device]:
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found.append(torch.device("cuda"))
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    del args
    import gradops

    print(f"gradops {gradops.__version__}  python {platform.python_version()}  torch {torch.__version__}  "
          f"triton {_version('triton')}  ninja {_version('ninja')}")
    print(f"{backend.ENV}={os.environ.get(backend.ENV, 'auto')}  "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}  threads={torch.get_num_threads()}")
    from . import native

    # What the extension provides, from its own list of nodes (docs/backends.md describes its parts).
    if native.built():
        try:
            native.kernels()
            why = None
        except ImportError as err:
            why = str(err)
    else:  # said, not built here: the install or the first import builds them
        why = native.kernels_failure() or "not built"
    kernels = "built" if why is None else \
        f"unavailable, CPU tensors use the reference ({why}; to fix: {native.kernels_fix()})"
    print(f"CPU kernels (C++, {native.build_dir()}): {kernels}")
    nodes = ", ".join(sorted(spec.name for spec in SPECS if spec.node))
    print(f"native path (autograd nodes: {nodes}; direct calls of the public functions): {native.status()}")
    for device in devices():
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        print(f"\n{device} ({name})")
        width = max(map(len, OPS))
        for op in OPS:
            try:
                chosen, _ = backend.select(op, device)
            except RuntimeError as err:
                chosen = f"unavailable: {err}"
            print(f"  {op:<{width}}  {chosen}")
    return 0
