"""gradops' C++ extension: the CPU kernels (``kernels.h`` and one file per op family), the native autograd nodes
(``autograd.cpp``) and the direct calls (``direct.cpp``).

The kernels are what :mod:`gradops.cpu` runs (:func:`kernels`). A ``torch.autograd.Function`` costs a Python call
per forward and per backward; around ATen's own kernels it is already 1.3-1.4x torch's native node at 64 x 128
(fwd + bwd, 2 cores). The nodes are C++ autograd nodes written as torch's generated ones are, and call the same
registered kernels as the Python path, so results are the same bits; see ``autograd.cpp`` for what stays in Python
(validation, the double backward). The same extension replays the public functions' eager calls that nothing
records from programs remembered per argument metadata (``direct.cpp``, :mod:`gradops.cpu.programs`).

The extension is built once per (source, torch, Python, CPU) into ``<cache>/native/<tag>`` (``GRADOPS_CACHE_DIR``,
else ``~/.cache/gradops``): by gradops' install, else by the first ``import gradops`` (:func:`ensure_built`, ~2 min
with g++ on 2 cores), or by hand with ``python -m gradops.native``. ``GRADOPS_NATIVE=0`` takes the Python path of
each call (the same results, ~50-60 µs more per training step at small sizes; the kernels are the extension's
either way). :func:`status` says which path runs and why.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .. import _runtime
from .._compat import HAS_OPENMP

_HERE = Path(__file__).parent
#: The extension's sources: the CPU kernels (kernels.cpp: their registry; one file per op family), the autograd
#: nodes, the direct calls of the public functions, what they share.
SOURCES = tuple(sorted(_HERE.glob("*.cpp")))
HEADERS = tuple(sorted(_HERE.glob("*.h")))
ENV = "GRADOPS_NATIVE"

_module: ModuleType | None = None
_why: str = "not loaded yet"
_tried = False
_switched_off = False
_registered: set[str] = set()


#: With torch's OpenMP backend, at::parallel_for is inlined into the extension as an OpenMP region: compiled with
#: -fopenmp, it links libgomp.so.1, the runtime torch has loaded already, so the nodes' kernels run on ATen's own
#: thread pool. (Without the flag the region would run on one thread.) A torch with the native backend runs it in
#: libtorch: no flag.
_OPENMP = ("-fopenmp",) if HAS_OPENMP else ()


#: -O3 -march=native: the kernels are vectorized for the CPU that builds them (the tag names it, so a cache shared
#: by two kinds of CPU holds one build each); -ffp-contract=off: no fused multiply-add the source does not write,
#: so a kernel's bits do not depend on the instruction set.
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", *_OPENMP)


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and flags (Linux), else the platform's processor name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        import platform

        return platform.machine() + platform.processor()


def _tag() -> str:
    """What the built library depends on: the sources, their flags, torch's version (its C++ ABI) and the Python
    ABI."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{torch.__version__}|{sysconfig.get_config_var('SOABI')}|{sys.platform}|{CFLAGS}|{_cpu()}".encode())
    return digest.hexdigest()[:16]


def name() -> str:
    """The extension's module name (one per tag, so that two builds never shadow each other)."""
    return f"gradops_native_{_tag()}"


def build_dir() -> Path:
    """Where the extension is built and loaded from."""
    base = os.environ.get("GRADOPS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gradops")
    return Path(base) / "native" / _tag()


def _library() -> Path:
    return build_dir() / f"{name()}.so"  # torch.utils.cpp_extension's name for it, whatever the Python


def built() -> bool:
    """Whether the extension is built for this torch, Python and CPU (loaded, or its library in the cache)."""
    return _loaded is not None or _library().exists()


def enabled() -> bool:
    """Whether the native nodes may be used: ``GRADOPS_NATIVE`` is not ``0`` (read at first use) and
    :func:`set_enabled` did not turn them off."""
    return not _switched_off and os.environ.get(ENV, "1").strip() != "0"


def set_enabled(flag: bool) -> None:
    """Turn the native nodes on or off for this process (the next call of every op plans afresh)."""
    global _switched_off
    _switched_off = not flag
    reset()


#: A build holding torch's build lock longer than this is taken for dead (the build takes ~2 min on 2 cores): a
#: process killed while building (a timeout's SIGTERM runs no cleanup) leaves the lock file behind, and torch's
#: builder would wait for it forever.
STALE_LOCK_S = 900
#: Where a failed build says why, beside the library it did not make: later imports read it instead of failing
#: the same build again (a compile error costs a minute each time); ``python -m gradops.native`` retries.
FAILED = "failed.txt"


def build(verbose: bool = False) -> Path:
    """Compile the extension (torch.utils.cpp_extension: needs a C++ compiler and ninja) unless it is built
    already; returns the library's path. Raises what the build raises, after noting it in ``FAILED``."""
    library = _library()
    if library.exists():
        return library
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            warnings.warn(f"gradops: removed a build lock older than {STALE_LOCK_S} s in {directory} (a build "
                          "was killed)", RuntimeWarning, stacklevel=2)
    except FileNotFoundError:
        pass
    (directory / FAILED).unlink(missing_ok=True)
    # A TERM (timeout(1), a job scheduler) ends Python without cleanup and would leave the lock: raised as SystemExit
    # instead, torch's builder releases it on the way out (main thread only, where handlers can be set).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main else None
    # No torch/extension.h (the whole C++ API), which triples the build time for nothing used here.
    try:
        load(name(), [str(p) for p in SOURCES], build_directory=str(directory), extra_cflags=list(CFLAGS),
             extra_ldflags=list(_OPENMP), verbose=verbose)
    except Exception as err:
        (directory / FAILED).write_text(f"{_build_error(err)}\n")
        raise
    finally:
        if main:  # None: a handler set outside Python, i.e. the default
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return library


def _build_error(err: Exception) -> str:
    """A failed build in a few lines: the exception's first line (torch's builder puts the whole compiler command
    there) cut to 200 characters, then the compiler's own ``error:`` lines (the first 8), which say what to fix."""
    lines = str(err).strip().splitlines() or [""]
    errors = [line.strip() for line in lines[1:] if "error" in line.lower()][:8]
    return "\n".join([f"{type(err).__name__}: {lines[0][:200]}", *errors])


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


_loaded: ModuleType | None = None
#: Why the kernels cannot be had in this process (a failed build or load), or None. Decided once.
_failure: str | None = None
FIX = "install a C++ compiler (g++ or clang++) and ninja (pip install ninja), then run python -m gradops.native"


def ensure_built() -> str | None:
    """Build the extension now unless it is built for this torch, Python and CPU: what the first import of gradops
    does, so that no training step ever waits for a compiler. Says so in one line before and after (the build
    takes ~1-2 min on 2 cores); on failure one line says what runs instead and how to fix it. Returns why the
    kernels cannot be had, or None."""
    global _failure
    if _loaded is not None or _failure is not None or _library().exists():
        return _failure
    try:
        earlier = (build_dir() / FAILED).read_text().strip()
    except OSError:
        earlier = None
    if earlier is not None:  # failed before for these sources, torch and CPU: said, not tried again here
        _failure = f"the native CPU kernels could not be built ({earlier}; {build_dir() / FAILED})"
        print(f"gradops: {_failure}; CPU tensors use the pure-torch reference, ~10-50x slower. To fix: {FIX}",
              file=sys.stderr)
        return _failure
    start = time.perf_counter()
    print(f"gradops: building the native CPU kernels into {build_dir()} (once per torch version, ~1-2 min)",
          file=sys.stderr, flush=True)
    try:
        build()
    except Exception as err:  # the compiler's or ninja's failure, whatever it is
        _failure = f"the native CPU kernels could not be built ({_build_error(err)})"
        print(f"gradops: {_failure}; CPU tensors use the pure-torch reference, ~10-50x slower. To fix: {FIX}",
              file=sys.stderr)
        return _failure
    print(f"gradops: native CPU kernels built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return None


def kernels() -> ModuleType:
    """The extension as the CPU kernels' home, whatever ``GRADOPS_NATIVE`` says (that switch chooses the path of a
    call, not where its kernels come from): loaded on first call, built first when needed (:func:`ensure_built`).

    Raises:
        ImportError: the extension cannot be built or loaded here (:func:`kernels_failure` says why).
    """
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    why = ensure_built()
    if why is None:
        try:
            _loaded = _load(_library())
            return _loaded
        except Exception as err:  # built against another torch, a damaged file: rebuilt once, then given up
            why = _rebuild(err)
            if why is None:
                return _loaded  # type: ignore[return-value]
    raise ImportError(why)


def _rebuild(err: Exception) -> str | None:
    """A library that does not load (a damaged cache entry): removed, rebuilt and loaded, with one warning."""
    global _loaded, _failure
    import shutil

    warnings.warn(f"gradops: the native library in {build_dir()} does not load ({type(err).__name__}: {err}); "
                  "rebuilding it", RuntimeWarning, stacklevel=3)
    shutil.rmtree(build_dir(), ignore_errors=True)
    why = ensure_built()
    if why is not None:
        return why
    try:
        _loaded = _load(_library())
    except Exception as again:
        _failure = f"the native library does not load ({type(again).__name__}: {again})"
        return _failure
    return None


def kernels_failure() -> str | None:
    """Why the native CPU kernels cannot run in this process, or None (they are loaded, or not tried yet)."""
    return _failure


def _load(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name(), library)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    loaded.set_plain_types(torch.Tensor, torch.nn.Parameter)
    forget = loaded.forget
    _runtime.register_cache(forget)  # the extension's plans and programs, dropped with gradops' own
    _runtime.set_extension(loaded)  # the output pool and the storage test use its C forms from now on
    return loaded


def module() -> ModuleType | None:
    """The extension for the native path, or None (see :func:`status`): loaded on first call when it is built (a
    library that does not load is rebuilt, see :func:`kernels`); never built here, inside a call: that is the
    install's or the first import's."""
    global _module, _why, _tried
    if _tried:
        return _module
    _tried = True
    if not enabled():
        _why = "set_enabled(False)" if _switched_off else f"{ENV}=0"
        return None
    library = _library()
    if _loaded is None and not library.exists():
        _why = f"not built ({library} is missing): run python -m gradops.native"
        return None
    try:
        loaded = kernels()
    except ImportError as err:  # built against another torch and not rebuildable, no compiler: the Python path
        _why = str(err)
        return None
    _module, _why = loaded, "loaded"
    return _module


def node(op: str, differentiable: Callable[[list[Tensor], object], Sequence[Tensor | None]]) -> Callable | None:
    """The extension's function for ``op`` (``hardswish``, ``layer_norm``, ``embedding``), or None when the native
    nodes are not used here (see :func:`module`). ``differentiable(inputs, extra)`` is the op's Python backward, for
    the backwards the kernels do not run (``create_graph=True``, a forked child, a gradient that is not a plain
    tensor: see autograd.cpp), registered with the extension on first use."""
    ext = module()
    if ext is None:
        return None
    if op not in _registered:
        ext.set_differentiable(getattr(ext, op.upper()), differentiable)  # the extension's constant naming the op
        _registered.add(op)
    return getattr(ext, op)


def function(name: str) -> Callable | None:
    """The extension's function ``name`` for the public functions' eager calls (``hardswish_backward``: the
    registered kernel on torch's threads, no autograd), or None where :func:`node` would be None."""
    ext = module()
    return None if ext is None else getattr(ext, name)


def status() -> str:
    """``loaded`` or why the native nodes are not used."""
    module()
    return _why


def reset() -> None:
    """Forget the load decision (after changing ``GRADOPS_NATIVE``) and every remembered plan, gradops' own
    included (:func:`gradops._runtime.invalidate`)."""
    global _module, _why, _tried
    _module, _why, _tried = None, "not loaded yet", False
    _registered.clear()
    _runtime.invalidate()
