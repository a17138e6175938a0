"""The demo's text: the Python standard library's own docstrings (present offline on every machine), or a file.

Bytes are the tokens (vocabulary 256, no tokenizer to download); byte 0 (NUL) is the padding id and is dropped
from the text.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from pathlib import Path

import torch

from ..cli_support import CommandError

#: Pure-Python standard-library modules present in CPython 3.10+, read in this order (deterministic corpus).
MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser", "http.client", "inspect", "ipaddress",
    "json", "logging", "mailbox", "numbers", "operator", "optparse", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "shlex", "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "traceback", "typing", "unittest.case", "urllib.parse", "uuid", "warnings",
    "weakref", "zipfile",
)
#: Enough text for a few hundred steps without repeating much; more only slows start-up.
MAX_BYTES = 1_500_000
#: Below this the interpreter probably strips docstrings (python -OO): ask for --data instead.
MIN_BYTES = 20_000


def _docstrings(module) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    docs.append(inspect.getdoc(member) or "")
    return docs


def stdlib_corpus(max_bytes: int = MAX_BYTES) -> tuple[bytes, str]:
    """Docstrings of :data:`MODULES`, deduplicated, joined by blank lines; ``(text, description)``."""
    seen: set[str] = set()
    parts: list[str] = []
    used = 0
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a trimmed Python build; the rest suffices
            continue
        used += 1
        with warnings.catch_warnings():  # reading deprecated aliases (typing.io, ...) warns; we only read text
            warnings.simplefilter("ignore", DeprecationWarning)
            docs = _docstrings(module)
        for doc in docs:
            if doc and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    text = "\n\n".join(parts).encode("utf-8")[:max_bytes]
    version = ".".join(map(str, sys.version_info[:3]))
    return text, f"Python {version} standard-library docstrings ({used} modules)"


def load_text(path: str | None) -> tuple[bytes, str]:
    """The corpus as bytes without NUL (the padding id), and a one-line description."""
    if path is None:
        text, what = stdlib_corpus()
        if len(text) < MIN_BYTES:
            raise CommandError(f"only {len(text)} bytes of docstrings found (python -OO?); pass --data FILE with "
                               "some text")
    else:
        try:
            text, what = Path(path).read_bytes(), path
        except OSError as err:
            raise CommandError(f"cannot read --data {path}: {err.strerror}") from None
    text = text.replace(b"\0", b"")
    return text, f"{what}: {len(text) / 1e6:.2f} MB"


class Batches:
    """Random windows of ``seq_len + 1`` bytes: inputs and next-byte targets. The last ``val_fraction`` of the
    text is held out; ``generator`` makes the order reproducible."""

    def __init__(self, text: bytes, seq_len: int, batch_size: int, seed: int, val_fraction: float = 0.05) -> None:
        # Checked before torch.frombuffer, which refuses an empty buffer with a ValueError of its own.
        if len(text) < 4 * (seq_len + 1):
            raise CommandError(f"the text has {len(text)} bytes (NUL bytes dropped); --seq-len {seq_len} needs at "
                               f"least {4 * (seq_len + 1)}: pass a longer --data file or a smaller --seq-len")
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        split = max(seq_len + 1, int(data.numel() * (1 - val_fraction)))
        self.train, self.val = data[:split], data[max(0, split - seq_len - 1):]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def _sample(self, data: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.randint(0, data.numel() - self.seq_len - 1, (self.batch_size,), generator=generator)
        rows = data[start[:, None] + torch.arange(self.seq_len + 1)]
        return rows[:, :-1], rows[:, 1:]

    def next_train(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._sample(self.train, self.generator)

    def validation(self, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(seed)
        return [self._sample(self.val, generator) for _ in range(count)]
