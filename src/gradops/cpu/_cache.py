"""numba's on-disk kernel cache, made to behave as a cache: a damaged entry is recompiled, never fatal.

numba reads a kernel's index (``*.nbi``) and machine code (``*.nbc``) with ``pickle``; a file truncated by a full
disk or a killed process, or written by another numba, raises ``EOFError`` / ``UnpicklingError`` from the first
call of the kernel, in every process, until someone deletes the folder. :func:`harden` gives each cached kernel
of this package a :class:`TolerantCache`: a load or save that fails drops that kernel's index (so the next save
writes a fresh one), says so once per process, and the kernel compiles as if nothing were cached.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType

from numba.core.caching import FunctionCache
from numba.core.dispatcher import Dispatcher

_told = False


def _tell(where: str, name: str, err: BaseException) -> None:
    """One warning per process, naming the first damaged entry."""
    global _told
    if not _told:
        _told = True
        warnings.warn(f"gradops: damaged kernel cache entries in {where} (first: {name}, {type(err).__name__}: "
                      f"{err}) are discarded and those kernels compiled again", RuntimeWarning, stacklevel=2)


class TolerantCache(FunctionCache):
    """numba's per-function cache whose failures are misses (see the module docstring)."""

    def _discard(self, err: BaseException) -> None:
        index = getattr(self._cache_file, "_index_path", None)
        func = getattr(self, "_py_func", None)
        _tell(self._cache_path, getattr(func, "__qualname__", self._name), err)
        if index:
            try:
                os.unlink(index)
            except OSError:
                pass

    def load_overload(self, sig, target_context):
        try:
            return super().load_overload(sig, target_context)
        except Exception as err:  # whatever a damaged pickle raises: EOFError, UnpicklingError, ValueError, ...
            self._discard(err)
            return None

    def save_overload(self, sig, data):
        try:
            super().save_overload(sig, data)
        except Exception as err:  # a damaged index read before the write, a full disk: run uncached
            self._discard(err)


def harden(prefix: str) -> int:
    """Give every cached numba kernel in the loaded modules named ``prefix*`` a :class:`TolerantCache`; returns
    how many. Only the class changes (no new state), so it costs nothing at import."""
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or not isinstance(module, ModuleType):
            continue
        for obj in vars(module).values():
            if isinstance(obj, Dispatcher) and type(obj._cache) is FunctionCache:
                obj._cache.__class__ = TolerantCache
                count += 1
    return count
