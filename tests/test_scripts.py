"""The set-up script leaves the kernel cache to gradops' default, so its commands and an activated venv share it."""

from __future__ import annotations

import re
from pathlib import Path

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def test_setup_does_not_move_the_kernel_cache():
    """An export of GRADOPS_CACHE_DIR in setup.sh reaches only the processes scripts/main.sh and scripts/test.sh
    start: ``. .venv/bin/activate; python examples/...`` would build the kernels again into the default cache.
    Comments may mention the variables; no command may set them."""
    commands = [line.split("#", 1)[0] for line in SETUP.read_text().splitlines()]
    setting = [c.strip() for c in commands if re.search(r"\b(GRADOPS|NUMBA)_CACHE_DIR=", c)]
    assert not setting, f"scripts/setup.sh sets the kernel cache: {setting}"
