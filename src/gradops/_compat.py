"""Feature detection for the torch APIs gradops reads that a torch release may lack or rename.

gradops is tested on torch 2.13 (CPU, every tier) and runs on the GPU machines' torch 2.11; its floor is torch 2.4
(``torch.library.custom_op``). Every API listed in docs/compat.md is looked up here, by attribute, never by
comparing version numbers (a nightly or a vendor build carries any version string), and each has a plain path for a
torch without it: an import never fails for want of one.

:data:`HIDDEN` names hooks to treat as absent. It is empty; tests/compat_probe.py sets it on this module before the
module body runs (and so before the rest of gradops imports it), to run gradops as on a torch without a hook that
torch's own internals need too and that therefore cannot simply be deleted from torch.

A leaf module: it imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Dotted paths treated as missing (see the module docstring); preset by tests/compat_probe.py only.
HIDDEN: frozenset[str] = frozenset(globals().get("HIDDEN", ()))


def lookup(path: str) -> Any:
    """The object at dotted ``path`` (``"torch._C._FunctionBase"``), or None where this torch lacks it (or
    :data:`HIDDEN` names it). Only attributes of modules already imported are walked: nothing is imported here."""
    if path in HIDDEN:
        return None
    obj: Any = torch
    for name in path.split(".")[1:]:
        try:
            obj = getattr(obj, name, None)
        except Exception:  # a lazy torch submodule whose import fails: the API is unusable here
            return None
        if obj is None:
            return None
    return obj


def resolve(path: str) -> Callable[..., Any] | None:
    """The callable at dotted ``path`` (``"torch._C._get_tracing_state"``), or None (see :func:`lookup`)."""
    obj = lookup(path)
    return obj if callable(obj) else None


def _never() -> bool:
    return False


#: ``torch.compiler.is_compiling`` (public since torch 2.3: below gradops' floor of 2.4 there is nothing to trace
#: gradops' Python with), else "never".
is_compiling: Callable[[], bool] = resolve("torch.compiler.is_compiling") or _never

#: Whether torch was built with OpenMP (``torch._C.has_openmp``; False where the flag is missing: the native nodes
#: then build without ``-fopenmp`` and run their parallel regions on one thread - the same results, slower).
HAS_OPENMP: bool = bool(lookup("torch._C.has_openmp"))


def record_every_call(op: object) -> None:
    """Route every call of a ``torch.library.custom_op`` through the C++ dispatcher, where the profiler records it.

    torch 2.14 gives each custom op's OpOverload a Python-object dispatch fast path
    (``OpOverload._enable_pyobj_dispatch``) that records no ``torch.profiler`` event: gradops' ops vanished from
    traces, eager calls through the op and torch.compile's graphs alike (2.11-2.13 record them). Turned off here,
    the op is called as on 2.13. A torch without the switch has no such path: nothing to do."""
    overload = getattr(op, "_opoverload", None)
    switch = None if "OpOverload._enable_pyobj_dispatch" in HIDDEN else \
        getattr(overload, "_enable_pyobj_dispatch", None)
    if callable(switch):
        switch(False)


def can_register_vmap(op: object) -> bool:
    """Whether a ``torch.library.custom_op`` object takes a vmap rule (``CustomOpDef.register_vmap``, torch 2.5).
    Without it ``torch.vmap`` over a gradops op fails as torch fails any custom op without a rule; nothing else
    changes."""
    return "CustomOpDef.register_vmap" not in HIDDEN and callable(getattr(op, "register_vmap", None))
