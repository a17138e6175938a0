"""Shared fixtures. ``tests/interpreter`` runs only in its own process with TRITON_INTERPRET=1 set before
import (the variable is read when ``@triton.jit`` runs), so the main tier leaves it out."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

collect_ignore = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interpreter"]


def _cpu_backend_available() -> bool:
    """Whether the CPU kernels (the native extension) load here; where scripts/setup.sh built them
    (``GRADOPS_REQUIRE_NATIVE=1``) a failure to load them is an error, not a skip."""
    try:
        importlib.import_module("gradops.cpu")
        return True
    except ImportError:
        if os.environ.get("GRADOPS_REQUIRE_NATIVE") == "1":
            raise
        return False


#: Backends the CPU tiers test: the reference always, the CPU kernels where they are built.
CPU_BACKENDS = ["torch", "cpu"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=CPU_BACKENDS)
def backend(request, monkeypatch):
    """Run the test once per CPU backend, selected through GRADOPS_BACKEND as a user would."""
    if request.param == "cpu" and not _cpu_backend_available():
        pytest.skip("the CPU kernels are not built here (python -m gradops.native)")
    monkeypatch.setenv("GRADOPS_BACKEND", request.param)
    return request.param


@pytest.fixture
def decided(monkeypatch):
    """``decided(name, module)``: make the one backend decision (:func:`gradops.backend.decide`, which every
    surface's call plan runs) answer backend ``name`` with ``module``'s functions, for this test only. The
    remembered choices and call plans are dropped on the way in and out, so no other test sees the substitute."""
    from gradops import backend

    def use(name, module):
        def decide(op, device):  # op: a declaration (the call plans) or a name (the tools)
            op = getattr(op, "name", op)
            return backend.Choice(name, getattr(module, op), getattr(module, f"{op}_workspace", None))

        monkeypatch.setattr(backend, "decide", decide)
        backend.forget()

    yield use
    monkeypatch.undo()
    backend.forget()
