"""The interpreter tier: Triton kernels run on CPU tensors through ``TRITON_INTERPRET=1``.

Run in its own process with the variable set before anything imports triton (``@triton.jit`` reads it at
decoration time)::

    TRITON_INTERPRET=1 GRADOPS_BACKEND=triton python -m pytest tests/interpreter -q -p no:cacheprovider

Every test here selects ``GRADOPS_BACKEND=triton`` (so the public ops dispatch to :mod:`gradops.launch`) and
proves a kernel ran through :data:`gradops.launch.LAUNCHES`.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

READY = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
WHY = "needs triton and TRITON_INTERPRET=1 set before import"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.interpreter)
            if not READY:
                item.add_marker(pytest.mark.skip(reason=WHY))


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "triton")


@pytest.fixture
def launches():
    """``launches()`` -> kernel names launched since the fixture was created (a Counter difference)."""
    from gradops.launch import LAUNCHES

    before = LAUNCHES.copy()
    return lambda: LAUNCHES - before
