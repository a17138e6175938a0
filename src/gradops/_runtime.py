"""What gradops' layers share at run time, and nothing else: imports nothing from gradops.

- The remembered per-call decisions (the backend choices, the call plans, the native extension's plans and
  programs) each register their ``clear`` here; :func:`invalidate` drops them all, at one point: in a child of
  ``fork()``, when the backend or the extension is switched, when a dependency is installed or removed.
- The native extension, once loaded, registers itself (:func:`set_extension`); the layers that use its C forms (the
  storage test of every planned call, the output pool) read :data:`extension` instead of importing
  :mod:`gradops.native`, so the extension depends on none of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

_caches: list[Callable[[], None]] = []
_users: list[Callable[[ModuleType | None], None]] = []

#: The loaded native extension, or None (set by :mod:`gradops.native`).
extension: ModuleType | None = None
#: True in a child of fork() (set at the fork): GNU OpenMP does not survive fork, so CPU work runs on one thread.
forked = False


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (the variable must be set before triton loads)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def register_cache(clear: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`invalidate` call ``clear``; returns it (usable as a decorator)."""
    _caches.append(clear)
    return clear


def invalidate() -> None:
    """Drop every remembered decision: the next call of each op validates, chooses and plans afresh."""
    for clear in _caches:
        clear()


def on_extension(use: Callable[[ModuleType | None], None]) -> None:
    """Have ``use(extension)`` called now and whenever the extension is registered or unregistered: how a layer
    installs the extension's C form of one of its functions without importing the extension's loader."""
    _users.append(use)
    use(extension)


def set_extension(module: ModuleType | None) -> None:
    """Register the loaded native extension (None: unloaded); remembered decisions made without it lapse."""
    global extension
    extension = module
    for use in _users:
        use(module)
    invalidate()


def _after_fork_in_child() -> None:
    global forked
    forked = True
    invalidate()


os.register_at_fork(after_in_child=_after_fork_in_child)
