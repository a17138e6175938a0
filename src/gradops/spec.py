"""What an operator is, declared once: :class:`OpSpec`.

Each op family's declarations live in its folder (``families/<family>/spec.py``), and everything reads them from
:mod:`gradops.registry` or the op's own module: the runtime (each backend's implementation, :attr:`OpSpec.providers`)
and the command line (``check``, ``golden``, ``bench``, ``env``), the per-call and first-call measurements, the
size sweep, the DTensor sharding rules and the CANN spelling of argument names. None of those modules names an op;
adding one is a declaration, not an edit to each of them (docs/adding-an-op.md).

This module is a leaf: it imports torch and nothing from gradops, so that a declaration never pulls in the
runtime (the specs are read by the CLI before any kernel loads).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Example:
    """One call of an op on an ``M x N`` problem: what ``gradops check``, the per-call and the first-call
    measurements run.

    ``args`` are positional and 2-D (flat statistics, every attribute explicit), so that the public function, the
    ``torch.library`` op and each backend's function all take them as they are. ``lengths`` is the reduction length
    behind each output (the check's float32 accumulation bound). ``twin(*args)`` is PyTorch's own computation of
    the same outputs where PyTorch has one (None: it has none), and ``twin_mask`` the elements where PyTorch's
    definition is CANN's (None: all). ``kernel(*args)`` is ATen's kernel for the same work where ATen has one
    (what ``gradops bench --per-call`` times beside the op: a twin built from autograd or several ops would time
    their overhead, not a peer's)."""

    args: tuple
    lengths: tuple[int, ...]
    twin: Callable[..., tuple] | None = None
    twin_mask: Tensor | None = None
    kernel: Callable[..., object] | None = None


@dataclass(frozen=True)
class Timed:
    """A backward op's ``gradops bench`` case at one shape: the public function's ``args`` (or the arguments of
    the case's own ``run``), ``eager`` (PyTorch's way to the same gradients, ready to call), ``compiled`` (the
    pure-torch reference to ``torch.compile`` and its arguments) and ``liger`` (Liger-Kernel's function where it
    has the op, on CUDA, when importable)."""

    args: tuple
    eager: Callable[[], object]
    compiled: tuple[Callable[..., Any], tuple] | None = None
    liger: Callable[[], object] | None = None


@dataclass(frozen=True)
class Bench:
    """How ``gradops bench`` and the size sweep time a backward op (see :mod:`gradops.bench.cases`).

    ``case`` names the case (two ops timed together share one, CANN's LayerNormGrad + LayerNormGradBeta);
    ``shapes`` the shape dicts per shape set (``cpu``, ``cuda``, ``quick``, ``gpu-check``, ``dry``); ``sizes(rows,
    cols, vocab, top_k)`` the shape dict at a sweep size; ``prepare(shape, dtype, device)`` the inputs and peers;
    ``nbytes(shape, s)`` the byte floor at element size ``s`` (what a GB/s figure divides by); ``copy_numel(shape)``
    the largest tensor (the ``copy_`` yardstick); ``eager_name`` what ``eager`` runs; ``run(gradops, *args,
    out=None)`` the timed call, given the package, when it is not the op's public function alone."""

    case: str
    shapes: dict[str, list[dict]]
    sizes: Callable[[int, int, int, int], dict]
    prepare: Callable[[dict, torch.dtype, torch.device], Timed]
    nbytes: Callable[[dict, int], int]
    copy_numel: Callable[[dict], int]
    eager_name: str
    run: Callable[..., Any] | None = None


@dataclass(frozen=True)
class Golden:
    """``gradops golden``'s case for an op (see :mod:`gradops.golden.cases`).

    ``outputs``: CANN's output names. ``options``: the ``--`` options the op reads. ``inputs(shape, dtype, draw,
    opts)``: the named inputs in call order (``draw`` is the case's seeded source: see
    :class:`gradops.golden.cases.Draw`). ``oracle(ref_args, args, like)``: the golden outputs where they are not
    the reference on ``ref_args`` (the float64 inputs in CANN's 2-D views) in float64. ``peer(args)``: PyTorch's
    outputs where PyTorch has the operator, ``{output position: (tensor, source)}``. ``index_dtypes``: the index
    dtypes ``--index-dtype`` accepts (first: the default). ``views``: whether N-D inputs reach the reference in
    CANN's 2-D views (the norms' rows x H; the MoE family's inputs are 2-D as given)."""

    outputs: tuple[str, ...]
    options: tuple[str, ...] = ()
    inputs: Callable[..., dict] | None = None
    oracle: Callable[[list, list, tuple], Any] | None = None
    peer: Callable[[list], dict[int, tuple[Tensor, str]]] | None = None
    index_dtypes: tuple[str, ...] = ()
    views: bool = True


@dataclass(frozen=True)
class Impl:
    """One backend's implementation of an op: what :func:`gradops.backend.decide` hands the op's call plan.

    ``fn(*views, out=None, workspace=None)``: the op on the 2-D views its contract answers (every backend has it).
    ``shaped(outputs, shape, *args)``: the op on its own arguments in their own shapes, given the contract's answer
    ``shape`` and the call plan's declared results ``outputs`` (:func:`gradops.contract._common.evaluated`, which
    :func:`gradops.cpu._host.allocate` makes), results in the op's shapes (the compiled CPU kernels take any
    contiguous shape by address), or None: the op's
    adapter views the arguments for ``fn``. ``workspace(*views) -> bytes``: the scratch ``fn`` takes as
    ``workspace=`` (aclnn phase 1 sizes it), or None: it takes none."""

    fn: Callable[..., Any]
    shaped: Callable[..., Any] | None = None
    workspace: Callable[..., int] | None = None


@dataclass(frozen=True)
class OpSpec:
    """One operator.

    ``name`` is the public function, the ``torch.library`` op (``torch.ops.gradops.<name>``) and each backend's
    function; ``cann`` what CANN calls it; ``backward`` whether it is a backward operator; ``kernels`` whether the
    backends implement it (the embedding lookup is a gather with its backward attached: no backend has it).
    ``cann_args`` CANN's spelling of arguments that the plain camel-case of the PyTorch name does not give
    (:func:`cann_arg`). ``example(m, n, dtype, device, gen)`` one call (:class:`Example`); ``bench`` its timing
    (:class:`Bench`); ``golden`` its CANN test case (:class:`Golden`); ``sharding(R, P, Shard)`` returns its
    DTensor rule (the strategies function ``register_sharding`` takes); ``node`` whether the native extension has
    an autograd node for it (:func:`gradops.native.node`). ``check(*args, **outs) -> shape``: its validation table
    (the family's contract), ``results(shape, *args) -> list[Result]``: what it returns
    (:class:`gradops.contract._common.Result`; the fake kernel, ``out=``, the backends' outputs, the programs and the
    aclnn outs read it). ``providers``: backend name (``torch``, ``cpu``,
    ``triton``) -> a loader of that backend's :class:`Impl` of the op; a loader imports the family's module for the
    backend when first asked (ImportError: the backend cannot be had here), so that a declaration never loads a
    kernel; a backend not listed leaves the op to ``torch`` (see :mod:`gradops.backend`)."""

    name: str
    cann: str
    backward: bool
    example: Callable[[int, int, torch.dtype, torch.device, torch.Generator], Example] | None = None
    golden: Golden | None = None
    timing: Bench | None = None
    sharding: Callable[[Any, Any, Any], Callable[..., list]] | None = None
    cann_args: dict[str, str] = field(default_factory=dict)
    kernels: bool = True
    node: bool = False
    check: Callable[..., Any] | None = None
    results: Callable[..., list] | None = None
    providers: dict[str, Callable[[], Impl]] = field(default_factory=dict)

    @property
    def bench(self) -> str | None:
        """The ``gradops bench`` case that times the op (backward operators), or None."""
        return self.timing.case if self.timing is not None else None


def provided(backends: dict[str, Callable[[], Any]], select: Callable[[Any], Impl]) -> dict[str, Callable[[], Impl]]:
    """An op's ``providers`` where each backend's module of its family holds the op's :class:`Impl` under one name:
    ``backends`` maps a backend to a loader of that module (``{"cpu": _cpu, ...}``), ``select(module)`` picks the
    op's Impl there (``lambda m: m.RMS_NORM_GRAD``). Nothing is loaded until a backend is asked for."""
    return {name: (lambda load=load: select(load())) for name, load in backends.items()}


def cann_arg(spec: OpSpec, name: str) -> str:
    """CANN's spelling of argument ``name`` (``num_weights`` -> ``numWeights``): the spec's own where it has one."""
    if name in spec.cann_args:
        return spec.cann_args[name]
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def optional(module: str, name: str) -> Any:
    """``module.name`` where it can be imported, else None (an optional peer: Liger-Kernel)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # not installed, or an API that moved: the peer is absent
        return None


def autograd(fn: Callable[..., Any], inputs: tuple[Tensor, ...], grad: Tensor) -> tuple[Tensor, ...]:
    """The gradients of ``fn(*inputs)`` for cotangent ``grad`` (fresh leaves: a twin's backward)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    with torch.enable_grad():
        return torch.autograd.grad(fn(*leaves), leaves, grad)


def rows_shardable(x: Any, stat: Any, normalised: int) -> range:
    """Row dims a norm may be sharded over: the leading dims of ``x`` that its statistic also has."""
    return range(min(x.ndim - normalised, stat.ndim))
