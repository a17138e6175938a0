"""What ``gradops bench`` measures: per op, the shapes, the byte floor, and every provider side by side.

Providers (all compute the same gradients from the same inputs):

- ``gradops``: the public function as a user calls it: new outputs, which on the CPU come from the recycling
  pool (:mod:`gradops.cpu._pool`), so in steady state they are memory already mapped;
- ``gradops fresh`` (CPU): the same with the pool off: every output is fresh memory and its first touch (page
  faults) is timed, as it is for eager;
- ``gradops out=``: the public function writing into preallocated outputs (no allocation in the timed call);
- ``eager``: the natural PyTorch way, the code the op replaces (:data:`EAGER` says what it runs per case);
- ``compile``: ``torch.compile`` of gradops' pure-torch reference of the op (inductor; C++ on CPU, Triton on GPU);
- ``liger``: Liger-Kernel's autograd function where it has the op (GPU only, when importable);
- ``copy_``: ``dst.copy_(src)`` of the op's largest tensor, the bandwidth yardstick of the same run.

Each op declares its shapes, inputs, peers and byte floor (what each GB/s figure divides by, s = element size;
docs/performance.md §1.2 derives them) in its family's ``spec.py`` (:class:`gradops.spec.Bench`);
this module builds the providers from that declaration.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import gradops
from gradops.registry import BENCH, timing
from gradops.spec import Bench, OpSpec

#: The CPU output pool's switch (gradops.cpu._pool.ENV; spelled here so the bench imports without the CPU kernels).
POOL_ENV = "GRADOPS_CPU_POOL_MB"
#: The shape sets: the CPU's (issue 6), CUDA's LLM shapes (issue 3), a tiny one for ``--quick``, one LLM shape per
#: case for ``gpu-check`` (scripts/gpu_check.sh: 7 cases per dtype, each with a torch.compile of its own, fit its
#: time box where the full CUDA set's 26 would not), and toy ones for ``--dry-run`` (the Triton interpreter runs
#: them in well under a second each). Each op declares its shapes per set (:class:`gradops.spec.Bench`).
SHAPE_SETS = ("cpu", "cuda", "quick", "gpu-check", "dry")
OPS = BENCH  # every case, in the registry's order (tests/test_registry.py: each has shapes and a builder)
#: Shapes per set and case.
SHAPES: dict[str, dict[str, list[dict]]] = {kind: {case: timing(case)[0].shapes[kind] for case in OPS}
                                            for kind in SHAPE_SETS}


@dataclass
class Case:
    """One (op, shape, dtype): its byte floor, the tensor size copy_ is measured on, and the providers."""
    op: str
    shape: dict
    dtype: torch.dtype
    nbytes: int
    copy_numel: int
    providers: dict[str, Callable[[], object]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _compiled(fn: Callable, notes: dict[str, str]) -> Callable | None:
    """``torch.compile(fn)``; compilation itself happens at the first call (the timer's warm-up, which drops a
    provider that fails and notes why)."""
    try:
        return torch.compile(fn, dynamic=False)
    except RuntimeError as err:  # e.g. a Python version dynamo does not support
        notes["compile"] = f"torch.compile unavailable: {err}"
        return None


def _results(result: object) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _builder(bench: Bench, op: OpSpec) -> Callable[[dict, torch.dtype, torch.device, set[str]], Case]:
    """The case's providers from its declaration: the public function as a user calls it (or the case's own
    ``run``), the same into outputs made once, and the declared peers."""
    def build_case(shape: dict, dtype: torch.dtype, device: torch.device, peers: set[str]) -> Case:
        timed = bench.prepare(shape, dtype, device)
        s = torch.finfo(dtype).bits // 8
        case = Case(bench.case, shape, dtype, bench.nbytes(shape, s), bench.copy_numel(shape))
        if bench.run is not None:
            run, args = bench.run, (gradops, *timed.args)
        else:
            run, args = getattr(gradops, op.name), timed.args
        made = _results(run(*args))
        out = tuple(torch.empty_like(t) for t in made)
        out = out if len(out) > 1 or bench.run is not None else out[0]
        case.providers["gradops"] = lambda: run(*args)
        if "out" in inspect.signature(run).parameters:  # the ops that offer out= (the routing-map ones do not)
            case.providers["gradops out="] = lambda: run(*args, out=out)
        case.providers["eager"] = timed.eager
        if "compile" in peers and timed.compiled is not None and (fn := _compiled(timed.compiled[0], case.notes)):
            compiled_args = timed.compiled[1]
            case.providers["compile"] = lambda: fn(*compiled_args)
        if timed.liger is not None:
            case.providers["liger"] = timed.liger
        return case
    return build_case


#: What each case's ``eager`` provider runs: the kernel or PyTorch code the gradops function replaces.
EAGER = {case: timing(case)[0].eager_name for case in OPS}

#: One builder per ``gradops bench`` case, named as :data:`gradops.registry.BENCH` names them.
BUILDERS = {case: _builder(*timing(case)) for case in OPS}


def _without_pool(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the CPU output pool switched off for the duration of the call (fresh memory every time)."""
    def call():
        old = os.environ.get(POOL_ENV)
        os.environ[POOL_ENV] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[POOL_ENV]
            else:
                os.environ[POOL_ENV] = old
    return call


def build(op: str, shape: dict, dtype: torch.dtype, device: torch.device, peers: set[str]) -> Case:
    """The case with its providers, plus ``copy_`` on a tensor as large as the op's largest one."""
    case = BUILDERS[op](shape, dtype, device, peers)
    if device.type == "cpu":
        fresh = {"gradops fresh": _without_pool(case.providers["gradops"])}
        names = list(case.providers)
        at = names.index("gradops") + 1
        case.providers = {n: case.providers[n] for n in names[:at]} | fresh | {n: case.providers[n] for n in names[at:]}
    src = torch.randn(case.copy_numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    case.providers["copy_"] = lambda: dst.copy_(src)
    return case
