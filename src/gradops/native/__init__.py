"""gradops' C++ extension: the CPU kernels (``kernels.h``), the native autograd nodes (``nodes.h``), both in one
file per op family (``families/<family>/*.cpp``), the direct calls (``direct.cpp``) and the output pool
(``pool.cpp``); ``autograd.cpp`` makes the module.

The kernels are what :mod:`gradops.cpu` runs (:func:`kernels`). A ``torch.autograd.Function`` costs a Python call
per forward and per backward; around ATen's own kernels it is already 1.3-1.4x torch's native node at 64 x 128
(fwd + bwd, 2 cores). The nodes are C++ autograd nodes written as torch's generated ones are, and call the same
registered kernels as the Python path, so results are the same bits; see ``nodes.h`` for what stays in Python
(validation, the double backward). The same extension replays the public functions' eager calls that nothing
records from programs remembered per argument metadata (``direct.cpp``, :mod:`gradops.cpu.programs`).

The extension is built once per (source, torch, Python, CPU) into ``<cache>/native/<tag>`` (``GRADOPS_CACHE_DIR``,
else ``~/.cache/gradops``): by gradops' install, else by the first ``import gradops`` (:func:`ensure_built`, ~2 min
with g++ on 2 cores), or by hand with ``python -m gradops.native``. ``GRADOPS_NATIVE=0`` takes the Python path of
each call (the same results, ~50-60 µs more per training step at small sizes; the kernels are the extension's
either way). :func:`status` says which path runs and why.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import signal
import struct
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
#: The extension's sources: what the families share here (kernels.cpp: the kernels' registry; autograd.cpp: the
#: module and the nodes' shared part; the direct calls of the public functions, the output pool, the vector layer),
#: and each family's kernels and node in its own folder (``families/<family>/*.cpp``, which include this folder's
#: headers).
SOURCES = tuple(sorted(_HERE.glob("*.cpp"))) + tuple(sorted(_HERE.parent.glob("families/*/*.cpp")))
HEADERS = tuple(sorted(_HERE.glob("*.h"))) + tuple(sorted(_HERE.parent.glob("families/*/*.h")))
ENV = "GRADOPS_NATIVE"

_module: ModuleType | None = None
_why: str = "not loaded yet"
_tried = False
_switched_off = False
_registered: set[int] = set()  # the ops (the extension's constants) whose Python backward is registered


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


#: Held (``flock``) by the process that builds into a folder, for the whole build: the kernel releases it when
#: that process ends, however it ends (SIGKILL, the OOM killer, a CI timeout), so a later import waits exactly as
#: long as a live build runs. torch's builder keeps a lock file of its own, ``lock``, that a killed build leaves
#: behind and that it waits on forever; whoever holds ``build.lock`` knows no build is running and removes it.
BUILD_LOCK = "build.lock"
#: Where flock is missing (not POSIX): a ``lock`` left older than this is taken for a killed build's (the build
#: takes ~2 min on 2 cores).
STALE_LOCK_S = 900
#: Where a failed build says why, beside the library it did not make: later imports read it instead of failing
#: the same build again (a compile error costs a minute each time), until the compiler changes (``TOOLCHAIN``
#: records which one failed) or ``python -m gradops.native`` retries. A missing compiler or an unwritable cache
#: is no failed build: found before building, in a few milliseconds, and tried again by every import.
FAILED = "failed.txt"
TOOLCHAIN = "toolchain.txt"


class BuildRefused(RuntimeError):
    """The build cannot start here: no C++ compiler, or a cache folder that cannot be written. ``fix`` says what
    to do about it."""

    def __init__(self, cause: str, fix: str) -> None:
        super().__init__(cause)
        self.fix = fix


def _compiler() -> str:
    """The C++ compiler torch's extension builder runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "").strip() or "c++"


def toolchain() -> str:
    """What a build depends on outside the sources: the compiler's path, size and time, and ninja's path."""
    found = shutil.which(_compiler())
    try:
        stat = os.stat(found) if found else None
    except OSError:
        stat = None
    made = f"{stat.st_size}:{int(stat.st_mtime)}" if stat else "-"
    return f"{_compiler()}={found or '-'}:{made}; ninja={shutil.which('ninja') or '-'}"


def _preflight(directory: Path) -> None:
    """Raise :class:`BuildRefused` when no build can run: no compiler on PATH, or a cache folder that cannot be
    made or written."""
    if shutil.which(_compiler()) is None:
        named = "CXX=" + _compiler() if os.environ.get("CXX", "").strip() else "c++"
        raise BuildRefused(f"no C++ compiler: {named} is not on PATH",
                           "install one (g++ or clang++, e.g. apt-get install g++) or point CXX at it; the next "
                           "import builds the kernels")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise BuildRefused(f"the build cache {directory} cannot be written ({err.strerror or err})",
                           "set GRADOPS_CACHE_DIR to a writable folder (or make this one writable); the next import "
                           "builds the kernels") from err


@contextlib.contextmanager
def _build_lock(directory: Path):
    """Hold ``BUILD_LOCK`` in ``directory`` (waiting, with one line, while another process builds), and clear the
    lock file a killed build of torch's builder left behind."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the age rule alone
        fcntl = None
    if fcntl is None:
        _clear_stale(directory / "lock", STALE_LOCK_S)
        yield
        return
    with open(directory / BUILD_LOCK, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"gradops: waiting for another process building the native CPU kernels in {directory}",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            _clear_stale(directory / "lock", 0)  # no build runs: any lock of torch's is a killed build's
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clear_stale(lock: Path, older_than: float) -> None:
    try:
        if time.time() - lock.stat().st_mtime >= older_than:
            lock.unlink()
            warnings.warn(f"gradops: removed the build lock of a build that was killed ({lock})", RuntimeWarning,
                          stacklevel=4)
    except FileNotFoundError:
        pass


def build(verbose: bool = False) -> Path:
    """Compile the extension (torch.utils.cpp_extension: needs a C++ compiler and ninja) unless it is built
    already; returns the library's path. Raises :class:`BuildRefused` when no build can run here, else what the
    build raises, after noting it in ``FAILED``."""
    library = _library()
    if library.exists() and _damaged(library) is None:
        return library
    from torch.utils.cpp_extension import load

    directory = build_dir()
    _preflight(directory)
    with _build_lock(directory):
        if library.exists() and _damaged(library) is None:  # built by the process this one waited for
            return library
        library.unlink(missing_ok=True)
        (directory / FAILED).unlink(missing_ok=True)
        # A TERM (timeout(1), a job scheduler) ends Python without cleanup: raised as SystemExit instead, torch's
        # builder releases its lock on the way out (main thread only, where handlers can be set).
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _terminate) if main else None
        # No torch/extension.h (the whole C++ API), which triples the build time for nothing used here.
        try:
            load(name(), [str(p) for p in SOURCES], build_directory=str(directory), extra_cflags=list(CFLAGS),
                 extra_ldflags=list(_OPENMP), extra_include_paths=[str(_HERE)], verbose=verbose)
        except Exception as err:
            (directory / FAILED).write_text(f"{_build_error(err)}\n")
            (directory / TOOLCHAIN).write_text(f"{toolchain()}\n")
            raise
        finally:
            if main:  # None: a handler set outside Python, i.e. the default
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    return library


def _build_error(err: Exception) -> str:
    """A failed build in a few lines: the exception's first line (torch's builder puts the whole compiler command
    there) cut to 200 characters, then the lines that say what failed (the compiler's ``error:`` lines, a tool
    ``not found``; the first 8)."""
    lines = str(err).strip().splitlines() or [""]
    said = ("error", "not found", "fatal", "killed")
    errors = [line.strip() for line in lines[1:] if any(word in line.lower() for word in said)][:8]
    return "\n".join([f"{type(err).__name__}: {lines[0][:200]}", *errors])


def _fix_of(err: Exception) -> str:
    if isinstance(err, BuildRefused):
        return err.fix
    if "ninja" in str(err).lower() and "required" in str(err).lower():
        return "pip install ninja, then import gradops again"
    return FIX


def _damaged(library: Path) -> str | None:
    """Why ``library`` cannot be mapped safely, or None. A truncated ELF file (a full disk, an interrupted copy of
    the cache) maps and then faults with SIGBUS on the first page past its end, which kills the process at
    ``import gradops``: its segments and section table must lie inside the file. Other formats are not read."""
    try:
        size = library.stat().st_size
        with open(library, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return "not an ELF file" if sys.platform.startswith("linux") else None
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if len(head) < (64 if wide else 52):
                return f"truncated to {size} bytes"
            if wide:
                phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
                phsize, phnum, shsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
            else:
                phoff, shoff = struct.unpack_from(order + "II", head, 28)
                phsize, phnum, shsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
            ends = [phoff + phsize * phnum, shoff + shsize * shnum]
            if ends[0] <= size:
                f.seek(phoff)
                table = f.read(phsize * phnum)
                for k in range(phnum):
                    entry = table[k * phsize:(k + 1) * phsize]
                    kind = struct.unpack_from(order + "I", entry, 0)[0]
                    offset, filesz = (struct.unpack_from(order + "Q", entry, o)[0] for o in (8, 32)) if wide else \
                        (struct.unpack_from(order + "I", entry, o)[0] for o in (4, 16))
                    if kind == 1:  # PT_LOAD: mapped from the file
                        ends.append(offset + filesz)
    except (OSError, struct.error) as err:
        return f"unreadable ({err})"
    past = max(ends)
    return f"truncated: {size} bytes where its headers need {past}" if past > size else None


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


_loaded: ModuleType | None = None
#: Why the kernels cannot be had in this process (a failed build or load), or None. Decided once.
_failure: str | None = None
#: Whether this process printed its line about the failure (the slow path's warning then says nothing more).
_said = False
FIX = "install a C++ compiler (g++ or clang++) and ninja (pip install ninja), then run python -m gradops.native"
#: What fixes ``_failure``: FIX, or the fix of the cause found (an unwritable cache folder, no compiler, ninja).
_fix = FIX


def _say_failure(cause: str, fix: str) -> str:
    global _failure, _said, _fix
    _failure, _fix = f"the native CPU kernels could not be built ({cause})", fix
    print(f"gradops: {_failure}; CPU tensors use the pure-torch reference, ~10-50x slower. To fix: {fix}",
          file=sys.stderr)
    _said = True
    return _failure


def failure_said() -> bool:
    """Whether this process already printed why the kernels cannot be had (:func:`ensure_built`)."""
    return _said


def ensure_built() -> str | None:
    """Build the extension now unless it is built for this torch, Python and CPU: what the first import of gradops
    does, so that no training step ever waits for a compiler. Says so in one line before and after (the build
    takes ~1-2 min on 2 cores); on failure one line says why, what runs instead and how to fix it. Returns why the
    kernels cannot be had, or None."""
    if _loaded is not None or _failure is not None or _library().exists():
        return _failure  # a damaged library is found where it is loaded (_load), and rebuilt there
    directory = build_dir()
    try:
        earlier = (directory / FAILED).read_text().strip()
    except OSError:
        earlier = None
    if earlier is not None:
        try:
            failed_with = (directory / TOOLCHAIN).read_text().strip()
        except OSError:
            failed_with = None
        if failed_with is None or failed_with == toolchain():
            # failed before for these sources, torch, CPU and compiler: said, not tried again here
            return _say_failure(f"{earlier}; {directory / FAILED}", FIX)
    start = time.perf_counter()
    try:
        _preflight(directory)
    except BuildRefused as err:
        return _say_failure(str(err), err.fix)
    print(f"gradops: building the native CPU kernels into {directory} (once per torch version, ~1-2 min)",
          file=sys.stderr, flush=True)
    try:
        build()
    except Exception as err:  # the compiler's or ninja's failure, whatever it is
        return _say_failure(_build_error(err), _fix_of(err))
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


def kernels_fix() -> str:
    """What fixes :func:`kernels_failure` (a compiler, a writable cache folder, ninja, ...)."""
    return _fix


def kernels_failure() -> str | None:
    """Why the native CPU kernels cannot run in this process, or None (they are loaded, or not tried yet)."""
    return _failure


def _load(library: Path) -> ModuleType:
    damaged = _damaged(library)
    if damaged is not None:  # mapped as it is, it would fault with SIGBUS past its end and kill the process
        raise ImportError(f"{library.name} is damaged ({damaged})")
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


def node(select: Callable[[ModuleType], tuple[int, Callable]],
         differentiable: Callable[[list[Tensor], object], Sequence[Tensor | None]]) -> Callable | None:
    """An op's native autograd node function, or None when the native nodes are not used here (see
    :func:`module`). ``select(ext)`` picks the extension's constant naming the op and its function
    (``lambda ext: (ext.HARDSWISH, ext.hardswish)``). ``differentiable(inputs, extra)`` is the op's Python backward,
    for the backwards the kernels do not run (``create_graph=True``, a forked child, a gradient that is not a plain
    tensor: see nodes.h), registered with the extension on first use."""
    ext = module()
    if ext is None:
        return None
    op, fn = select(ext)
    if op not in _registered:
        ext.set_differentiable(op, differentiable)
        _registered.add(op)
    return fn


def function(select: Callable[[ModuleType], Callable]) -> Callable | None:
    """The extension's function ``select(ext)`` for the public functions' eager calls (``lambda ext:
    ext.hardswish_backward``: the registered kernel on torch's threads, no autograd), or None where :func:`node` would
    be None."""
    ext = module()
    return None if ext is None else select(ext)


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
