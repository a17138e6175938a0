"""Which implementation runs: the one decision point every operator goes through.

``GRADOPS_BACKEND`` (read at each call, so tests and users can switch at run time):

- ``auto`` (default): CUDA tensors -> ``triton``; CPU tensors -> ``cpu`` (compiled CPU kernels); whichever is
  missing or cannot run here -> ``torch``.
- ``torch``: the pure-torch reference on any device.
- ``triton``: the Triton kernels; on CPU tensors only with ``TRITON_INTERPRET=1`` (the interpreter, for tests).
- ``cpu``: the CPU kernels (C++, in gradops' native extension: built when gradops is installed or first
  imported).

float64 inputs (the PyTorch API only: CANN's tables have no float64) run on the ``torch`` reference computing in
float64, whatever the variable says (:func:`wide`): no compiled kernel implements float64, and none may downcast.

A backend that does not implement an op leaves that op to ``torch`` (documented per op in ``gradops env``). A
backend asked for by name that cannot run - not installed, its import failing, the wrong device, or the compiled
CPU kernels where the extension cannot be built - raises :class:`BackendUnavailable` saying why: a typo or a
missing dependency never passes silently. Only ``auto`` falls back, and ``gradops env`` shows what it chose; when
``auto`` falls back on CPU tensors because the CPU kernels cannot be had, it also says so once per process
(:class:`SlowPathWarning`), since that path is ~10-50x slower. In a child of ``fork()`` whose parent may have run
GNU OpenMP (which does not survive fork: a parallel region there hangs), CPU calls run on one thread.

:func:`decide` is the decision, made afresh (~4 µs of import-system queries); each op's call plan remembers it
per (``GRADOPS_BACKEND``, ``TRITON_INTERPRET``, device type) beside its plans (:mod:`gradops.ops._plan`), and drops
it when the backend module it was made with is no longer the one loaded, and in a forked child.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import Any, NamedTuple

import torch

from . import _runtime, native, registry
from ._compat import HAS_OPENMP
from .spec import OpSpec
from .status import ACLNN_ERR_INNER_FIND_KERNEL_ERROR, OpError

ENV = "GRADOPS_BACKEND"
#: backend name -> the package every family's implementation for it imports (what it shares: the CPU kernels'
#: host side, which fails to import where the native extension cannot be had; the Triton launchers' common code,
#: which needs triton). An op's implementation itself comes from its declaration (:attr:`OpSpec.providers`).
MODULES = {"torch": "gradops.reference", "triton": "gradops.launch", "cpu": "gradops.cpu"}
CHOICES = ("auto", *MODULES)
_FIRST = {"cuda": "triton", "cpu": "cpu"}  # auto's first choice per device type
#: How to get the CPU kernels: what building gradops' native extension needs.
FIX = native.FIX


class SlowPathWarning(RuntimeWarning):
    """CPU tensors run on the pure-torch reference because the CPU kernels cannot be had (the native extension
    could not be built or loaded).

    Issued once per process, the first time ``GRADOPS_BACKEND=auto`` falls back for a CPU tensor: the reference
    is ~10-50x slower (rms_norm_grad at 8192 x 4096 fp32: 0.54-1.1 s against 11-44 ms compiled on 2 cores), and a
    plain fallback would leave a missing compiler unnoticed.
    ``GRADOPS_BACKEND=torch`` chooses the reference on purpose and is not warned about.
    """


_slow_path_warned = False  # one warning per process, whatever the number of ops and shapes that fall back


def _warn_slow_cpu_path(device: torch.device) -> None:
    """Issue :class:`SlowPathWarning` once, naming why the compiled CPU kernels cannot run and the fix."""
    global _slow_path_warned
    if _slow_path_warned:
        return
    ok, why = usable("cpu", device)
    if ok and _module("cpu") is not None:  # the module loaded: the op is one the CPU backend leaves to torch
        return
    _slow_path_warned = True
    if native.failure_said():  # the import said why and how to fix it, in one line: not a second time
        return
    cause = why or _import_errors.get("cpu", f"importing {MODULES['cpu']} failed")
    fix = "" if FIX in cause else f" (to fix: {FIX})"
    warnings.warn(f"gradops: the CPU kernels cannot run: {cause}{fix}. CPU tensors use the pure-torch "
                  "reference, ~10-50x slower; set GRADOPS_BACKEND=torch to choose it on purpose and silence this "
                  "warning.", SlowPathWarning, stacklevel=2)


class BackendUnavailable(OpError, RuntimeError):
    """A backend named in ``GRADOPS_BACKEND`` cannot run this op here (561003, ACLNN_ERR_INNER_FIND_KERNEL_ERROR).
    Also a RuntimeError: it is the environment, not an argument, that is wrong."""

    def __init__(self, op: str, name: str, why: str) -> None:
        super().__init__(ACLNN_ERR_INNER_FIND_KERNEL_ERROR, op, ENV, f"a backend that can run here ({why})",
                         name)
        self.args = (f"{ENV}={name}: {why} [{op}]",)

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self):
        return (_unavailable, (self.op, self.given, self.args[0]))


def _unavailable(op: str, name: str, message: str) -> BackendUnavailable:
    err = BackendUnavailable(op, name, "")
    err.args = (message,)
    return err


class Choice(NamedTuple):
    """What :func:`decide` answers: the backend's name and its :class:`~gradops.spec.Impl` of the op, unpacked:
    its function on the contract's 2-D views, its workspace hook (same positional args, returns bytes) or None,
    its shaped entry (``shaped(shape, *args)``: the op's own arguments and result shapes) or None."""

    name: str
    fn: Callable
    workspace: Callable | None
    shaped: Callable | None = None


def requested() -> str:
    name = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if name not in CHOICES:
        raise ValueError(f"{ENV}={name!r} is not a backend; choose one of {', '.join(CHOICES)}")
    return name


interpreting = _runtime.interpreting


def usable(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether backend ``name`` can run on ``device``, and if not, why."""
    if name == "torch":
        return True, ""
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install 'triton>=3.2', or the `triton` extra of gradops)"
        if device.type == "cuda" or (device.type == "cpu" and interpreting()):
            return True, ""
        return False, f"the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors (got {device})"
    if name == "cpu":
        if device.type != "cpu":
            return False, f"the compiled CPU kernels run on CPU tensors only (got {device})"
        why = native.kernels_failure()
        return (False, why) if why is not None else (True, "")
    return False, f"unknown backend {name!r}"


_import_errors: dict[str, str] = {}


@cache
def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(MODULES[name])
    except ImportError as e:
        _import_errors[name] = f"importing {MODULES[name]} failed: {e}"
        return None


def _choice(op: OpSpec, name: str) -> Choice | None:
    """Backend ``name``'s implementation of ``op``, as the op's declaration provides it, or None: the backend's
    package cannot be imported here, the op declares no provider for it, or its provider's module fails to import
    (the error is kept for the message that says why)."""
    load = op.providers.get(name)
    if load is None or _module(name) is None:
        return None
    try:
        impl = load()
    except ImportError as e:
        _import_errors[name] = f"importing {op.name}'s {name} implementation failed: {e}"
        return None
    return Choice(name, impl.fn, impl.workspace, impl.shaped)


def declared(op: OpSpec | str) -> OpSpec:
    """``op``'s declaration: ``op`` itself, or the one declared under that name (the command line and the tools ask
    by name; the ops' call plans hold their declarations)."""
    return op if isinstance(op, OpSpec) else registry.spec(op)


def decide(op: OpSpec | str, device: torch.device) -> Choice:
    """The backend that runs ``op`` (its declaration, or its name) for tensors on ``device`` (see the module
    docstring for the rules).

    Raises:
        BackendUnavailable: ``GRADOPS_BACKEND`` names no backend, or one that cannot run here.
    """
    op = declared(op)
    try:
        name = requested()
    except ValueError as e:  # the same error as a backend that cannot run: 561003 on the CANN surfaces
        raise _unavailable(op.name, os.environ.get(ENV, ""), f"{e} [{op.name}]") from None
    if name == "auto":
        first = _FIRST.get(device.type)
        chosen = _choice(op, first) if first and usable(first, device)[0] else None
        if chosen is None and first == "cpu":
            _warn_slow_cpu_path(device)
        chosen = chosen or _choice(op, "torch")
        return _serially(chosen) if device.type == "cpu" and _forked_omp_child() else chosen
    ok, why = usable(name, device)
    if not ok:
        raise BackendUnavailable(op.name, name, why)
    if name != "torch" and _module(name) is None:
        raise BackendUnavailable(op.name, name, _import_errors.get(name, f"importing {MODULES[name]} failed"))
    chosen = _choice(op, name) or _choice(op, "torch")  # an op the backend lacks is the reference's (documented)
    return _serially(chosen) if device.type == "cpu" and _forked_omp_child() else chosen


def _forked_omp_child() -> bool:
    """Whether this is a child of fork() whose parent may have run GNU OpenMP regions (torch built with OpenMP)."""
    return _runtime.forked and HAS_OPENMP


def _serially(choice: Choice) -> Choice:
    """``choice`` with its function run on one torch thread. In a child forked after GNU OpenMP ran (a fork-started
    DataLoader worker, a multiprocessing pool), any parallel region hangs: the compiled kernels' and torch's own
    (measured: a 2048 x 1024 reference call never returned); one thread enters none. The previous thread count is
    restored after each call, so the caller's own torch settings stand."""
    return choice._replace(fn=functools.wraps(choice.fn)(functools.partial(on_one_thread, choice.fn)))


def on_one_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on one torch thread, the caller's thread count restored after."""
    threads = torch.get_num_threads()
    if threads == 1:
        return fn(*args, **kwargs)
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def forked_cpu_call(device: torch.device) -> bool:
    """Whether torch work on ``device`` must run on one thread here: CPU work in a child forked after GNU OpenMP
    ran (see :func:`_serially`). Op bodies that call torch themselves, beside their backend, ask this."""
    return device.type == "cpu" and _forked_omp_child()


_wide: dict[str, Choice] = {}


def wide(op: OpSpec | str) -> Choice:
    """The backend of ``op`` for float64 inputs, on every device and whatever ``GRADOPS_BACKEND`` names: the
    pure-torch reference computing in float64. float64 is outside CANN's tables: the compiled CPU kernels and the
    Triton kernels do not implement it (as a backend that lacks an op leaves it to ``torch``), and a float32
    kernel would downcast. Only the PyTorch API gets here (the CANN surfaces refuse float64 in validation)."""
    op = declared(op)
    chosen = _wide.get(op.name)
    if chosen is None:
        fn = op.providers["torch"]().fn
        if "compute" in inspect.signature(fn).parameters:  # moe_token_permute only moves rows: nothing to compute
            fn = functools.partial(fn, compute=torch.float64)
        chosen = _wide[op.name] = Choice("torch", fn, None)
    return chosen


def wide_with_token(op: OpSpec | str, device: torch.device) -> tuple[Choice, str, ModuleType | None]:
    """:func:`wide` for tensors on ``device``, with what keeps it valid (as :func:`decide_with_token`): run on one
    torch thread in a child forked after GNU OpenMP ran (see :func:`_serially`). ``GRADOPS_BACKEND`` must still
    name a backend: a typo is refused here too (561003), as :func:`decide` refuses it."""
    op = declared(op)
    try:
        requested()
    except ValueError as e:
        raise _unavailable(op.name, os.environ.get(ENV, ""), f"{e} [{op.name}]") from None
    choice = wide(op)
    if device.type == "cpu" and _forked_omp_child():
        choice = _serially(choice)
    token = MODULES["torch"]
    return choice, token, sys.modules.get(token)


def select(op: OpSpec | str, device: torch.device) -> tuple[str, Callable]:
    """``(backend name, implementation)`` of ``op`` for tensors on ``device`` (decided afresh)."""
    chosen = decide(op, device)
    return chosen.name, chosen.fn


# The two variables are read on every call. ``os.environ.get`` encodes the key, looks it up and decodes the value
# (~1 µs each on 2 cores); CPython's ``os.environ`` keeps that raw mapping in ``_data``, which a plan's key can
# use as it is (0.06 µs). Anything that changes os.environ changes _data; elsewhere the public path is used.
_raw = getattr(os.environ, "_data", None)
if isinstance(_raw, dict) and hasattr(os.environ, "encodekey"):
    _getenv, _ENV_KEY, _INTERPRET_KEY = _raw.get, os.environ.encodekey(ENV), os.environ.encodekey("TRITON_INTERPRET")
else:  # pragma: no cover - another Python implementation
    _getenv, _ENV_KEY, _INTERPRET_KEY = os.environ.get, ENV, "TRITON_INTERPRET"


def environment_key() -> tuple:
    """What a remembered backend choice depends on besides the device and op: the two variables (raw, ~0.06 µs
    each)."""
    return _getenv(_ENV_KEY), _getenv(_INTERPRET_KEY)


def decide_with_token(op: OpSpec | str, device: torch.device) -> tuple[Choice, str, ModuleType | None]:
    """:func:`decide` and what keeps it valid: the name of the backend module it was decided for and that module
    as ``sys.modules`` holds it now. A cache of choices checks ``sys.modules.get(token) is module`` on a hit."""
    chosen = decide(op, device)
    wanted = requested()
    token = MODULES.get(_FIRST.get(device.type, "torch") if wanted == "auto" else wanted, MODULES["torch"])
    return chosen, token, sys.modules.get(token)


def forget() -> None:
    """Drop remembered choices, the ops' remembered call plans and imported backend modules (after installing or
    removing a dependency)."""
    _module.cache_clear()
    _import_errors.clear()
    _runtime.invalidate()

