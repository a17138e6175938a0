"""Docstrings and comments cite only documents that ship with the repository (issue 12.6)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_cited_markdown_file_is_in_the_repository():
    cited = set()
    for path in (ROOT / "src").rglob("*.py"):
        for line in path.read_text().splitlines():
            if "hicann/" in line:  # a file of an upstream repository, cited with its repository's name
                continue
            cited |= {(m, path.name) for m in re.findall(r"[\w./-]+\.md\b", line)}
    assert cited, "expected the sources to cite docs/semantics.md and docs/performance.md"
    missing = sorted((doc, where) for doc, where in cited if not (ROOT / doc).is_file())
    assert not missing, f"cited but not in the repository: {missing}"
