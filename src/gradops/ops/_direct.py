"""Custom ops whose eager calls skip the ``torch.library`` boundary when nothing needs it.

A call through a custom op pays torch's Python dispatch of the op, and, when autograd records it, the op's autograd
wrapper: ``gradops bench --per-call`` measures both against the direct path on your machine (on 2 cores
with torch 2.13 at 8 x 8 fp32, with the call plans: a call through the op 14-28 µs more than the direct
path, a recorded forward + backward pair 52-86 µs more). The boundary is needed only by something that watches or
transforms the call: torch.compile / export / torch.jit.trace tracing, fake and functional tensors, dispatch and
function modes, functorch transforms and the legacy vmap of batched gradients, tensor subclasses, meta tensors,
tensors with a lazy negation or conjugation bit, and the profiler (so that traces still name ``gradops::<op>``).
When none of these is active, :class:`DirectOp` runs the op body - the op's single dispatch point, which runs the
op's call plan (:mod:`gradops.ops._plan`: validation and backend) - directly, or, when autograd records the call,
on the op's native C++ autograd node where it has one and the plan allows (:mod:`gradops.native`: Hardswish on
CPU), else through a ``torch.autograd.Function`` built from the same setup_context / backward pair the op
registers. With the native extension loaded, a call that nothing records first tries :meth:`DirectOp.direct`: the
op's remembered program, replayed in one C++ call (native/direct.cpp). Results are the same bits on every path
(tests/test_direct.py, tests/test_direct_native.py).
Under torch.func, grad / vjp run the op inside a setup_context-style Function (torch.library's own autograd lacks
one), and vmap runs the op's vmap rule: the op once per sample (tests/test_func.py).

The test reads eight torch hooks, seven of them private. They are looked up once, at import: on a torch that
lacks one (renamed in a later release), every call takes the op path - slower, never wrong - and :data:`DISABLED`
says why. ``GRADOPS_EAGER=0`` (read at import) or :func:`set_enabled` turns the direct path off by choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _compat, native
from ..spec import OpSpec
from ._sharding import ensure_registered

try:  # loaded by torch itself; imported here so that the attribute walk below finds it
    import torch.utils._python_dispatch
except ImportError:  # pragma: no cover - a torch without it disables the direct path (see _resolve)
    pass

_PLAIN = (Tensor, torch.nn.Parameter)

#: What :func:`eager_path` answers: run through the op, run the body, run the autograd.Function, run the op inside
#: a setup_context-style autograd.Function (functorch transforms: see :meth:`DirectOp.register_autograd`).
OP, BODY, FUNCTION, FUNCTORCH = "op", "body", "function", "functorch"


def _resolve(path: str) -> Callable[..., Any] | None:
    """The function at dotted ``path`` (``torch._C._get_tracing_state``), or None where this torch lacks it
    (:func:`gradops._compat.resolve`: every hook is looked up there)."""
    return _compat.resolve(path)


_HOOK_PATHS = (
    "torch.compiler.is_compiling", "torch._C._len_torch_dispatch_stack",
    "torch.utils._python_dispatch.is_in_torch_dispatch_mode", "torch.autograd._profiler_enabled",
    "torch._C._is_torch_function_mode_enabled", "torch._C._functorch.peek_interpreter_stack",
    "torch._C._get_tracing_state", "torch._C._functorch.is_legacy_batchedtensor",
)
_hooks = [_resolve(p) for p in _HOOK_PATHS]
_missing = [p for p, fn in zip(_HOOK_PATHS, _hooks) if fn is None]
(_is_compiling, _dispatch_stack_len, _in_dispatch_mode, _profiling, _function_mode, _functorch_stack,
 _tracing_state, _legacy_batched) = _hooks

_transform_type = _compat.lookup("torch._C._functorch.TransformType")
#: The functorch levels that differentiate; () where TransformType is not exported (see _differentiates).
_DIFFERENTIATING = (_transform_type.Grad, _transform_type.Jvp) if _transform_type is not None else ()

#: Why the direct path is off (None while it is on).
DISABLED: str | None = (f"this torch {torch.__version__} lacks {', '.join(_missing)}" if _missing else
                        "GRADOPS_EAGER=0" if os.environ.get("GRADOPS_EAGER", "1").strip() == "0" else None)
_enabled = DISABLED is None


def set_enabled(enabled: bool) -> None:
    """Turn the direct path on or off for this process (it stays off on a torch that lacks a hook)."""
    global _enabled, DISABLED
    if enabled and _missing:
        raise RuntimeError(f"the eager fast path cannot run here: {DISABLED}")
    _enabled = bool(enabled)
    DISABLED = None if _enabled else (DISABLED or "set_enabled(False)")


def eager_path(*args: object) -> str:
    """Which path a call with ``args`` may take (see the module docstring)."""
    # Dispatch modes: the per-thread stack for user modes (the global flag _in_dispatch_mode reads can be cleared by
    # another thread leaving its mode), the flag for infra modes (fake, functional, proxy) kept beside it.
    # The profiler: the C++ state, which also sees a profiler started without torch.profiler's Python wrapper.
    if _missing:
        return _without_hooks(args)
    if _is_compiling() or _dispatch_stack_len() or _in_dispatch_mode() or _function_mode():
        return OP
    top = _functorch_stack()
    if top is not None:
        # grad / vjp / jvp need a setup_context-style Function around the op; vmap and functionalize need the op
        # itself (its vmap rule; the functional pass).
        return FUNCTORCH if _differentiates(top) else OP
    if not _enabled or _profiling() or _tracing_state() is not None:
        return OP
    grad = torch.is_grad_enabled()
    path = BODY
    for a in args:
        if isinstance(a, Tensor):
            # Exact types only: a subclass (DTensor, a user's wrapper) has its own __torch_dispatch__ to honour. The
            # op resolves a lazy negation / conjugation (``z.conj().imag``) before its body sees the data; the legacy
            # vmap of ``autograd.grad(is_grads_batched=True)`` wraps plain tensors and needs the op's batching.
            if type(a) not in _PLAIN or a.is_meta or a.is_neg() or a.is_conj() or _legacy_batched(a):
                return OP
            if grad and a.requires_grad:
                path = FUNCTION
    return path


def _differentiates(top: Any) -> bool:
    """Whether functorch interpreter ``top`` is a grad / jvp level (by the enum's name where this torch does not
    export ``TransformType``)."""
    key = top.key()
    return key in _DIFFERENTIATING if _DIFFERENTIATING else getattr(key, "name", None) in ("Grad", "Jvp")


def _without_hooks(args: tuple) -> str:
    """:func:`eager_path` on a torch that lacks a hook: the op, except inside torch.func's grad / vjp / jvp, where
    the op's own autograd cannot run (it has no setup_context) and the FUNCTORCH Function must: found from the
    interpreter stack, or where that hook is the one missing, from a functorch-wrapped argument."""
    if _functorch_stack is not None:
        top = _functorch_stack()
        return FUNCTORCH if top is not None and _differentiates(top) else OP
    if _functorch_wrapped is not None and any(isinstance(a, Tensor) and _functorch_wrapped(a) for a in args):
        return FUNCTORCH  # its Function's generated vmap rule still reaches the op's own under vmap
    return OP


def python_allows_native() -> bool:
    """The part of the native nodes' eager-path test only Python can answer: grad mode on, the direct path on, not
    tracing under torch.compile (dynamo answers ``is_compiling`` while it traces, and must never see the
    extension's calls). The rest is the extension's ``recordable``, one C++ call (see native/nodes.h)."""
    return torch.is_grad_enabled() and not _missing and _enabled and not _is_compiling()


def fit(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t.reshape(shape)``, or ``t`` itself when it has that shape already: a reshape is a new view (~1.3 µs on
    2 cores) where the comparison costs 0.3, and a 2-D input or a 1-D statistic usually has its shape."""
    return t if t.shape == shape else t.reshape(shape)


def own(*results: Tensor) -> Any:
    """A body's results as tensors that are not autograd views (``detach``: 0.3 µs each, no copy).

    Results are fresh, but often views of the backend's buffer (a 2-D result viewed in the caller's shape, a pooled
    int16 buffer viewed as float16). An op whose outputs are views refuses in-place changes to them under
    autograd ("Output 0 of rms_norm is a view and is being modified inplace"), which torch's own norms allow.
    One result comes back as a tensor, several as a tuple.
    """
    return results[0].detach() if len(results) == 1 else tuple(t.detach() for t in results)


#: autograd.Function's C++ apply (``_FunctionBase.apply``), or None on a torch without it. ``Function.apply``, the
#: Python classmethod around it, costs ~3 µs per call on 2 cores (10.9 µs against 7.9 for a
#: one-tensor Function) to unwrap tensors that escaped a functorch transform ("dead wrappers") and to bind
#: default arguments for setup_context-style Functions; the FUNCTION path's Functions take ctx in forward and no
#: transform is active there, so only the unwrap matters, and :func:`_apply` looks for such tensors first.
_c_apply = getattr(_compat.lookup("torch._C._FunctionBase"), "__dict__", {}).get("apply")
_functorch_wrapped = _resolve("torch._C._functorch.is_functorch_wrapped_tensor")


def _apply(function: type[torch.autograd.Function], args: tuple) -> Any:
    """``function.apply(*args)``, through the C++ apply unless an argument is a functorch wrapper (~0.2 µs per
    tensor to look) or this torch lacks either hook."""
    if _c_apply is None or _functorch_wrapped is None:
        return function.apply(*args)
    for a in args:
        if type(a) in _PLAIN and _functorch_wrapped(a):
            return function.apply(*args)
    return _c_apply.__get__(None, function)(*args)


def _records(args: tuple) -> bool:
    """Whether a plain tensor among ``args`` requires grad (grad mode on: autograd would record the call). Asked
    only of ops with a native node, so that each call tries the one native path that can take it (the node or the
    direct call; trying both cost a recorded Hardswish ~1.7 µs of a ~40 µs step at 8 x 8)."""
    for a in args:
        if type(a) in _PLAIN and a.requires_grad:
            return True
    return False


def _sample_by_sample(op: Callable[..., Any]) -> Callable[..., Any]:
    """The vmap rule of ``op``: the op once per sample of the batch, results stacked along dim 0.

    One rule for every op, and the only one that is right for all of them: folding the batch into the rows would
    sum a per-sample weight gradient (dgamma, dbeta, the embedding table) over the batch, and per-sample
    gradients (``vmap(grad(f))``) are what vmap is mostly used for here. Cost: one call per sample.
    """

    def rule(info: Any, in_dims: tuple[int | None, ...], *args: object) -> tuple[Any, Any]:
        if info.batch_size == 0:
            raise RuntimeError(f"{op}: vmap over an empty batch is not supported")
        results = [op(*(a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)))  # type: ignore[union-attr]
                   for i in range(info.batch_size)]
        if isinstance(results[0], tuple):
            return tuple(torch.stack(parts) for parts in zip(*results)), (0,) * len(results[0])
        return torch.stack(results), 0

    return rule


def fake_of(check: Callable[..., object], results: Callable[..., Any]) -> Callable[..., object]:
    """An op's fake (meta) kernel from its check and its results declaration ``results(shape, *args)`` (see
    :mod:`gradops.ops._out`): the check on the fake arguments, then an empty tensor per declared result (a shape of
    None: laid out like its input)."""
    def fake(*args: object) -> object:
        made = [torch.empty_like(r.like, dtype=r.dtype) if r.shape is None else r.like.new_empty(r.size, dtype=r.dtype)
                for r in results(check(*args), *args)]
        return made[0] if len(made) == 1 else tuple(made)
    return fake


class DirectOp:
    """``torch.library.custom_op("gradops::<name>")`` over ``body`` for the op ``op`` declares, callable like the op
    with an eager fast path.

    ``planner``: the op's call plan (a :class:`gradops.ops._plan.Planner`): its validation runs before the custom op
    on the paths that reach it (the op's schema would answer a None or a mistyped scalar with a bare RuntimeError
    before the body could raise OpError), and where its plans carry programs, the extension's direct path runs them
    (:meth:`direct`). ``results(shape, *args)`` (default: the declaration's): what the op returns (see
    :class:`gradops.contract._common.Result`), from which its fake kernel is registered. ``register_autograd``
    registers on the custom op and also builds the eager ``torch.autograd.Function`` from the same pair of
    functions, so both paths share one formula. ``node(ext)``:
    the extension's ``<op>_planned`` function (what a recorded call tries first, see :meth:`recorded`) where the op
    has a native autograd node (``lambda ext: ext.hardswish_planned``), else None.
    """

    def __init__(self, op: OpSpec, body: Callable[..., Any], planner: Any,
                 results: Callable[..., Any] | None = None,
                 node: Callable[[Any], Callable[..., Any]] | None = None) -> None:
        self.body = body
        self.spec = op
        self.op = torch.library.custom_op(f"gradops::{op.name}", mutates_args=())(body)
        _compat.record_every_call(self.op)  # the profiler names gradops::<op> on torch 2.14 too
        if _compat.can_register_vmap(self.op):  # torch >= 2.5; without it torch.vmap refuses the op
            self.op.register_vmap(_sample_by_sample(self.op))
        self.planner = planner
        self.validate: Callable[..., Any] = planner.validate
        results = results if results is not None else op.results
        if results is not None:
            self.op.register_fake(fake_of(planner.check, results))
        self.function: type[torch.autograd.Function] | None = None
        #: Whether the op has a native autograd node (:mod:`gradops.native`) that :meth:`recorded` calls.
        self.node = node is not None
        self._planned = node
        #: ``native(*args)``: what a recorded call tries first (:meth:`recorded` where the node returns the op's own
        #: results), else None. Set by the op's module.
        self.native: Callable[..., Any] | None = None
        self._ext: tuple[Any, int, Any] | None = None  # (extension, the op's id in it, its <op>_planned or None)
        name = self.name = op.name

        def no_derivative(ctx: Any, *grads: object) -> Any:
            raise RuntimeError(f"gradops.{name} has no derivative (the backward of a gradops backward is not "
                               "implemented)")

        # An op without a registered derivative (the backward ops) still needs a setup_context-style Function
        # under torch.func: the backward of a forward calls it with functorch-wrapped tensors.
        self.functorch = self._functorch_function(name, lambda ctx, inputs, output: None, no_derivative)

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        body = self.body

        # forward(ctx, *args) rather than a setup_context staticmethod: with the latter, Function.apply binds the
        # arguments through inspect.signature on every call (~10 µs).
        def forward(ctx: Any, *args: object) -> Any:
            output = body(*args)
            setup_context(ctx, args, output)
            return output

        name = self.name
        self.function = type(name, (torch.autograd.Function,),
                             {"forward": staticmethod(forward), "backward": staticmethod(backward)})
        self.functorch = self._functorch_function(name, setup_context, backward)

    def _functorch_function(self, name: str, setup_context: Callable[..., Any], backward: Callable[..., Any]
                            ) -> type[torch.autograd.Function]:
        """The autograd.Function that runs the op under torch.func transforms (grad, vjp, jacrev,
        functional_call inside them). The op's own autograd cannot run there: torch.library's generated
        autograd.Function has no setup_context staticmethod, which functorch requires ("... must override the
        setup_context staticmethod"). This one has; its forward calls the op one level down, so the same body
        and backward compute the same bits."""
        op = self.op

        def forward(*args: object) -> Any:
            return op(*args)

        def setup(ctx: Any, inputs: tuple, output: Any) -> None:
            setup_context(ctx, inputs, output)

        # generate_vmap_rule: under vmap(grad(f)) the forward runs batched, reaching the op's own vmap rule.
        return type(f"{name}_functorch", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
                     "backward": staticmethod(backward), "generate_vmap_rule": True})

    def direct(self, *args: object) -> Any:
        """The call on the native extension's direct path, or None where it takes the Python path.

        An eager call that nothing records or watches, on plain contiguous CPU tensors and simple scalars, whose
        arguments' metadata the extension has a program for, is one C++ call (native/direct.cpp: the eager test,
        the outputs, the kernels' pieces on torch's threads). The first call of each metadata runs the op's call
        plan here - a refused call raises its OpError as the Python path would - and hands the plan's program (or
        "no program": another backend, an empty tensor) to the extension. None also when a kernel piece found a
        value the op refuses: the Python path then raises its OpError."""
        found = self._extension()
        if found is None:
            return None
        ext, op, _ = found
        result = ext.direct(op, *args)
        if result is not ext.MISS:
            return result
        if not self._remember(ext, op, args):
            return None
        result = ext.direct(op, *args)
        return None if result is ext.MISS else result  # MISS cannot follow remember; never hand it out

    def direct_into(self, out: object, *args: object) -> bool:
        """:meth:`direct` writing the op's results into ``out`` (its ``out=`` argument as the caller gave it): True
        when done, False where the call takes the Python path - as :meth:`direct`, or an out that
        :func:`gradops.ops._out.check_out` would refuse or could take only by a copy (native/direct.cpp
        ``direct_into`` lists the checks; the Python path then raises the OpError naming the out). The same program
        as a call without ``out=``, so the same bits; a value the op refuses is found by the program's checks before
        any out is written."""
        found = self._extension()
        if found is None:
            return False
        ext, op, _ = found
        result = ext.direct_into(op, out, *args)
        if result is ext.MISS:
            if not self._remember(ext, op, args):
                return False
            result = ext.direct_into(op, out, *args)
        return result is True

    def recorded(self, *args: object) -> Any:
        """The recorded call on the op's native autograd node (:mod:`gradops.native`: the same kernels and bits as
        the Python Function, no Python in the backward), or None when it cannot take one: not an eager recorded call
        on plain tensors, no node in the call plan (another backend, the extension not loaded, an empty input, dtypes
        without a node), a tensor not contiguous, or a value the node leaves to the op to refuse (an index outside
        the table). ``args``: the op's positional arguments.

        A call whose plan the extension remembers is one C++ call after :func:`python_allows_native`; the first call
        of each argument metadata runs the Python call plan (validation, backend) and hands it to the extension
        (:meth:`_remember`, the entry the direct calls share). Under no_grad this costs one C call."""
        if not python_allows_native():  # first: under torch.compile this is all dynamo traces of the native path
            return None
        found = self._loaded()
        if found is None:
            return None
        ext, op, planned = found
        result = planned(*args)
        if result is not None or not ext.recordable(*args):
            return result
        plan = self.planner(*args)
        if plan.native is None or not all(t.is_contiguous() for t in args if isinstance(t, Tensor)):
            return None
        self._remember(ext, op, args, plan)
        return plan.native(*args)

    def _extension(self) -> tuple[Any, int, Any] | None:
        """The loaded extension, the op's id in its remembered calls and its ``<op>_planned`` (ids are per
        extension: another one may have been loaded since, see gradops.native.reset), or None where the extension
        cannot take the call."""
        if self.planner.program is None or not _enabled or _is_compiling():
            return None
        return self._loaded()

    def _loaded(self) -> tuple[Any, int, Any] | None:
        """:meth:`_extension` without the path's tests (:meth:`recorded` made them in
        :func:`python_allows_native`)."""
        ext = native.module()
        if ext is None:
            return None
        known = self._ext
        if known is None or known[0] is not ext:
            planned = self._planned(ext) if self._planned is not None else None
            known = self._ext = (ext, ext.direct_op(self.name), planned)
        return known

    def _remember(self, ext: Any, op: int, args: tuple, plan: Any = None) -> bool:
        """Plan a call with ``args``'s metadata (a refused call raises its OpError here) and hand the plan to the
        extension: whether the op's node takes recorded calls of these metadata, and the program of the others;
        False when there is no program (the Python path runs such calls)."""
        plan = self.planner(*args) if plan is None else plan
        node = self.node and plan.native is not None
        program = self.planner.program_of(plan, args)
        if program is None:
            ext.remember(op, args, node, True, [], [], [], False)
            return False
        ext.remember(op, args, node, *program.spec())
        return True

    def __call__(self, *args: object) -> Any:
        """Run the op on positional ``args`` (the body validates itself; the paths through the custom op validate
        first, see the class docstring)."""
        native = self.native
        if native is not None and torch.is_grad_enabled() and _records(args):
            result = native(*args)  # a native node (see recorded); the direct path never takes a recorded call
            if result is not None:
                return result
        elif self.planner.program is not None:
            result = self.direct(*args)
            if result is not None:
                return result
        path = eager_path(*args)
        if path == BODY:
            return self.body(*args)
        if path == FUNCTION and self.function is not None:
            return _apply(self.function, args)
        self.validate(*args)
        if path == FUNCTORCH:
            return self.functorch.apply(*args)
        if not _compat.is_compiling():  # dynamo cannot trace the registration (test_compile caught it)
            ensure_registered()  # a DTensor takes this path; its sharding rules are registered on first sight
        return self.op(*args)
