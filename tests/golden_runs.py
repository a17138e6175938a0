"""gradops' own outputs for a golden case: what the verify tests judge as "the kernel"."""

from __future__ import annotations

from pathlib import Path

import gradops
from gradops.golden import files


def gradops_outputs(directory: Path, manifest: dict) -> list[Path]:
    """Run ``gradops.<op>`` on the case's input files and write its outputs as ``ours_<name>.bin``; their paths."""
    args = [files.read(directory / e["bin"], e["dtype"], e["shape"]) if "bin" in e else e["value"]
            for e in manifest["inputs"]]
    result = getattr(gradops, manifest["op"])(*args)
    paths = []
    for value, entry in zip(result if isinstance(result, tuple) else (result,), manifest["outputs"]):
        files.write(directory, f"ours_{entry['name']}", value)
        paths.append(directory / f"ours_{entry['name']}.bin")
    return paths
