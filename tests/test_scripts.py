"""The set-up script leaves the kernel cache to gradops' default, so its commands and an activated venv share it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"


def test_setup_does_not_move_the_kernel_cache():
    """An export of GRADOPS_CACHE_DIR in setup.sh reaches only the processes scripts/main.sh and scripts/test.sh
    start: ``. .venv/bin/activate; python examples/...`` would build the kernels again into the default cache.
    Comments may mention the variables; no command may set them."""
    commands = [line.split("#", 1)[0] for line in SETUP.read_text().splitlines()]
    setting = [c.strip() for c in commands if re.search(r"\b(GRADOPS|NUMBA)_CACHE_DIR=", c)]
    assert not setting, f"scripts/setup.sh sets the kernel cache: {setting}"


ROOT = SETUP.parents[1]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_torch_range_is_the_tested_releases():
    """pyproject's torch range says only what was tested: 2.11 (the GPU machines), 2.13 (every tier), and the newest
    pip installs, which scripts/newest_torch.sh tests; README and docs/compat.md say the same range."""
    (torch_req,) = [d for d in _pyproject()["project"]["dependencies"] if d.startswith("torch")]
    assert torch_req == "torch>=2.11,<2.15"
    for page in ("README.md", "docs/compat.md"):
        text = " ".join((ROOT / page).read_text().split())
        assert "scripts/newest_torch.sh" in text and "2.14.1" in text, page
    assert "`torch>=2.11,<2.15`" in (ROOT / "README.md").read_text()
    script = (ROOT / "scripts" / "newest_torch.sh").read_text()
    assert "pip install -q --upgrade torch" in script and "tests/interpreter" in script


def test_the_transformers_extra_brings_what_its_examples_import():
    """examples/transformers_expert_parallel.py loads through transformers' distributed path, which imports
    accelerate: the extra must install it, and the examples name only extras that are not aliases of nothing."""
    extras = _pyproject()["project"]["optional-dependencies"]
    assert any(req.startswith("accelerate") for req in extras["transformers"])
    for example in (ROOT / "examples").glob("transformers_*.py"):
        named = re.findall(r"\.\[([a-z,]+)\]", example.read_text())
        for group in named:
            for extra in group.split(","):
                assert extras.get(extra), f"{example.name} names the empty extra {extra!r}"
