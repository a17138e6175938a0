"""The call plan: what an op's validation and backend decision answer for one call, remembered per argument
metadata - the one cache of what a call will do.

Every surface of an op runs the same two steps before its kernel: the contract's check (which refuses or answers
the 2-D view the backends work on) and the backend decision for the tensors' device. Both depend only on the
arguments' metadata (each tensor's shape, dtype, device; each scalar's value) and on ``GRADOPS_BACKEND`` /
``TRITON_INTERPRET``, so the op's :class:`Planner` keeps their joint answer, a :class:`CallPlan`, per key: after
the first call of a shape, planning is one key and one lookup (at 8 x 8 fp32 on 2 cores: the check and
the choice apart 3.3 µs, the remembered plan 1.1 µs for one tensor). The planner also keeps its backend choice per
(environment, device type), so that a new shape - a MoE expert's row count, a sequence length - pays the check and
not the decision's ~4 µs of import-system queries. Both tables are the planner's, dropped together by
:func:`gradops._runtime.invalidate` (a forked child, a backend or extension switch); the native extension's copy of
a plan (its program or node permission, :mod:`gradops.native`) is dropped at the same point.

float64 arguments (the PyTorch API's superset of CANN's tables) are planned onto :func:`gradops.backend.wide`,
the reference computing in float64, when the plan is made: a remembered plan costs the same for every dtype.

The CANN surfaces' strict form (``cann=True`` and the out tensors as keywords) is remembered apart, under a key
that also holds each tensor's strides and the outs' metadata.

What is never remembered, so the check runs in full each time: a refusal (an OpError is raised afresh, with the
message of the arguments at hand); an argument that is not a plain tensor or a simple scalar (see
:func:`gradops.contract._memo.key_of`). A plan also lapses when
the backend module it was decided for is no longer the one loaded (see :func:`gradops.backend.decide_with_token`).
Nothing here is read while torch.compile traces: dynamo would guard the mutable tables and recompile once they grow
(:meth:`Planner.validate` checks afresh there).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from .. import _runtime
from .._compat import is_compiling
from ..backend import Choice, decide_with_token, declared, environment_key, wide_with_token
from ..contract._common import evaluated
from ..contract._memo import LIMIT, key_of
from ..spec import OpSpec


class CallPlan(NamedTuple):
    """One call's plan: ``shape``, the contract's answer (rows, columns, result shapes); ``backend``, the
    :class:`~gradops.backend.Choice` for the tensors' device (``backend.fn`` runs the op on the 2-D views);
    ``run(shape, *args)``, the op on its own arguments, results in the op's shapes: the backend's shaped entry
    where it has one (the compiled CPU kernels take any contiguous shape by address: no view, reshape or detach
    per tensor, each ~0.6-1.3 µs), else the op's adapter around ``backend.fn``; ``native``, the op's native
    autograd node or extension function that runs these arguments (see :mod:`gradops.native`), or None where
    the call takes the Python path (no native node for the op, another backend, the extension not loaded). Where
    the extension is loaded it keeps its copy of the plan: whether the node takes recorded calls, and the program
    that replays the others (:meth:`Planner.program_of`)."""

    shape: Any
    backend: Choice
    run: Callable[..., Any]
    native: Any = None


def forget_all() -> None:
    """Drop every remembered decision: each planner's plans, the backend choices, the native extension's copies
    (:func:`gradops._runtime.invalidate`; also run in a child of fork(), where a backend decided in the parent may
    not run)."""
    _runtime.invalidate()


class Planner:
    """``planner(*args) -> CallPlan`` for one op: ``check(*args)`` then the backend for ``args[device_arg]``'s device
    (among the providers ``op``, the op's declaration or its name, lists), remembered (see the module docstring).
    ``check`` (default: the declaration's) must take the op's positional arguments only;
    ``adapter(fn, shape, *args)`` runs a backend's 2-D function ``fn`` on the op's arguments (views in, results
    back in the op's shapes); None for an op whose body calls ``backend.fn`` itself. ``values``: the positions of
    the arguments whose float64 dtype means "compute in float64" (default: every tensor argument; embedding's
    float64 indices are only indices). ``native(choice, shape, *args)``: the plan's ``native`` entry, asked only
    for the compiled CPU backend. ``program``: a loader of the op's program builder, ``(shape, *args) ->
    Program | None`` (:mod:`gradops.cpu.programs`), which lives in the family's CPU module and is loaded the
    first time a plan chose the compiled CPU kernels (see :meth:`program_of`); None: no program."""

    def __init__(self, op: OpSpec | str, check: Callable[..., Any] | None = None, device_arg: int = 0,
                 adapter: Callable[..., Any] | None = None, values: tuple[int, ...] | None = None,
                 native: Callable[..., Any] | None = None,
                 program: Callable[[], Callable[..., Any]] | None = None) -> None:
        self.spec = declared(op)
        self.op = self.spec.name
        # The declaration's results go with the declaration's check (a planner given another check - the embedding
        # lookup's, which plans onto its backward's backends - runs no shaped entry).
        self.results = self.spec.results if check is None else None
        check = check if check is not None else self.spec.check
        if check is None:
            raise TypeError(f"{self.op}: no check given or declared")
        self.check, self.device_arg, self.adapter, self.values = check, device_arg, adapter, values
        self.native, self.program = native, program
        self._plans: dict[tuple, tuple[CallPlan, str, object]] = {}
        self._cann: dict[tuple, tuple[CallPlan, str, object]] = {}  # the CANN surfaces' strict plans
        self._choices: dict[tuple, tuple[Choice, str, object]] = {}  # (environment, device type, float64)
        _runtime.register_cache(self.forget)

    def __call__(self, *args: Any, **options: Any) -> CallPlan:
        """The plan for a call with positional ``args``. ``options`` go to the check as keywords: the CANN
        surfaces (aclnn phase 1, AscendC) pass ``cann=True`` and their out tensors, so that they validate with the
        strict form of the same table and run the same backend decision; such a plan is remembered apart
        (:meth:`_strict`), its key holding the strides and the outs."""
        if options:
            return self._strict(args, options)
        key = key_of(args)
        if key is not None:
            key = (environment_key(), key)
            hit = self._plans.get(key)
            if hit is not None and sys.modules.get(hit[1]) is hit[2]:
                return hit[0]
        entry = self._plan(self.check(*args), args)  # a refusal raises in the check: never remembered
        if key is not None:
            if len(self._plans) >= LIMIT:
                self._plans.clear()
            self._plans[key] = entry
        return entry[0]

    def _strict(self, args: tuple, options: dict) -> CallPlan:
        """The CANN-strict plan (``options``: ``cann=True`` and the out tensors), remembered under the arguments'
        and outs' metadata with their strides (what the strict check reads besides the lax one's). An aclnn phase 1
        of a shape already planned costs the key (~0.4 µs a tensor) instead of the check (13-25 µs at 8 x 8)."""
        key = key_of(args, strides=True)
        outs = key_of(tuple(options.values()), strides=True) if key is not None else None
        if outs is None:
            return self._plan(self.check(*args, **options), args, native=False)[0]
        key = (environment_key(), tuple(options), key, outs)
        hit = self._cann.get(key)
        if hit is not None and sys.modules.get(hit[1]) is hit[2]:
            return hit[0]
        entry = self._plan(self.check(*args, **options), args, native=False)
        if len(self._cann) >= LIMIT:
            self._cann.clear()
        self._cann[key] = entry
        return entry[0]

    def validate(self, *args: Any) -> Any:
        """The contract's answer for positional ``args`` (a refusal raises its OpError): the remembered plan's where
        a call with these metadata was planned, else the check, not remembered (the callers are the op's boundary
        paths - a traced, transformed or profiled call, a meta or subclass tensor - whose body plans the call
        itself where it runs). While torch.compile traces, the check alone."""
        if not is_compiling():
            key = key_of(args)
            if key is not None:
                hit = self._plans.get((environment_key(), key))
                if hit is not None:
                    return hit[0].shape
        return self.check(*args)

    def _plan(self, shape: Any, args: tuple, native: bool = True) -> tuple[CallPlan, str, object]:
        device = args[self.device_arg].device
        wide = self._float64(args)
        choice, token, module = self._choose(device, wide)
        run = None if wide or self.results is None else choice.shaped  # the float64 reference has no shaped entries
        if run is not None:  # its outputs: the declared results, evaluated once per plan
            run = partial(run, evaluated(self.results(shape, *args), args))
        elif self.adapter is not None:
            run = partial(self.adapter, choice.fn)
        entry = (self.native(choice, shape, *args) if native and self.native is not None and choice.name == "cpu"
                 else None)
        return CallPlan(shape, choice, run, entry), token, module

    def _choose(self, device: torch.device, wide: bool) -> tuple[Choice, str, object]:
        """The backend for ``device`` (``wide``: float64 arguments) with what keeps it valid, remembered per
        environment and device type while the backend module it was decided for is the one loaded."""
        key = (environment_key(), device.type, wide)
        hit = self._choices.get(key)
        if hit is not None and sys.modules.get(hit[1]) is hit[2]:
            return hit
        entry = (wide_with_token if wide else decide_with_token)(self.spec, device)
        self._choices[key] = entry
        return entry

    def program_of(self, plan: CallPlan, args: tuple) -> Any:
        """The call as the native extension replays it (a :class:`gradops.cpu.programs.Program` for ``args``, all of
        the op's positional arguments, whose plan is ``plan``), or None: the op has no program, the plan chose
        another backend than the compiled CPU kernels, or the program does not apply."""
        if self.program is None or plan.backend.name != "cpu":
            return None
        return self.program()(plan.shape, *args)

    def _float64(self, args: tuple) -> bool:
        picked = args if self.values is None else [args[i] for i in self.values]
        return any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in picked)

    def forget(self) -> None:
        """Drop the remembered plans and backend choices."""
        self._plans.clear()
        self._cann.clear()
        self._choices.clear()
