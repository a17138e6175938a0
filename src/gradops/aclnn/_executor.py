"""The aclOpExecutor and the two phases every aclnn operator shares.

Phase 1 (``aclnnXxxGetWorkspaceSize``) plans the call with the op's call plan (:func:`plan`, the one the functional
API runs, :mod:`gradops.ops._plan`: the op's table in :mod:`gradops.contract` in its CANN-strict form, ``cann=True``,
and the one backend decision), asks the chosen implementation how much scratch memory it needs and
returns ``(status, workspace_size, executor)``. Phase 2 (``aclnnXxx(workspace, workspaceSize, executor,
stream)``) runs the bound work and writes the results into the caller's out tensors. Neither phase raises for
bad arguments: both return a status, and :func:`aclGetRecentErrMsg` gives the message of the last refusal.

Status choices where CANN leaves the behaviour undefined (a C caller gets memory corruption, not a code):

- an out tensor whose elements share memory (a broadcast view with stride 0, or interleaved strides): 161002
  from phase 1.
- executor ``None``: 161001; an executor already run (not repeatable), destroyed, or made by another op: 161002.
- ``stream`` not ``None`` and not a ``torch.cuda.Stream`` on the tensors' device: 161002.
- workspace needed (size > 0) but ``workspace`` is ``None``: 161001. ``workspaceSize`` smaller than phase 1
  reported, a workspace tensor with fewer bytes than ``workspaceSize``, non-contiguous or on another device, or
  one whose bytes overlap an input or output of the call: 161002 (ACLNN_ERR_PARAM_INVALID: a parameter check,
  nothing has run yet, so the executor stays usable).
- a data-dependent refusal while running (e.g. an index out of range): the OpError's status (161002); any other
  failure of the implementation: 361001 (ACLNN_ERR_RUNTIME_ERROR). A run that started consumes the executor.
- a tensor phase 1 checked that changed before phase 2 (``resize_``, ``set_``, ``as_strided_``, a storage resized
  or swapped): 161002, nothing run. A C executor holds each aclTensor's address, shape and strides as phase 1 saw
  them; a Python tensor can change under the executor, and running on the changed one would read or write
  outside what was checked (``x.resize_(1 << 16)`` made the CPU kernel read past the end of ``gradOutput``).
  Phase 2 compares each tensor's address, shape, strides, offset, dtype, device and storage size with phase 1's
  (~1 µs a tensor); values may change (they are data, and data-dependent checks rerun).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from functools import partial

import torch

from .. import _runtime, backend, registry
from ..contract._common import Result, overlaps_itself
from ..ops._direct import fit
from ..ops._out import takes_out
from ..ops._plan import CallPlan, Planner
from ..spec import cann_arg
from ..status import (
    ACLNN_ERR_INNER,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
    STATUS_NAMES,
    OpError,
)

_last = threading.local()

#: ``compute(impl, kwargs)``: runs the bound implementation (kwargs: ``workspace``, ``out``) and returns its results.
Compute = Callable[[Callable, dict], object]


def aclGetRecentErrMsg() -> str:
    """The message of the most recent refused or failed aclnn call in this thread ("" if none), as
    ``aclGetRecentErrMsg()`` returns it in CANN."""
    return getattr(_last, "message", "")


def _refuse(status: int, message: str) -> int:
    _last.message = f"{message} [{STATUS_NAMES.get(status, 'UNKNOWN')} {status}]"
    return status


def cann_error(error: OpError) -> OpError:
    """``error`` with its argument in CANN's spelling (``grad_output.dtype`` -> ``gradOutput.dtype``: the op's
    :func:`gradops.spec.cann_arg`)."""
    declared = registry.BY_NAME.get(error.op)
    return error if declared is None else error.renamed(partial(cann_arg, declared))


def refused(error: OpError) -> tuple[int, int, None]:
    """Phase 1's answer to a validation failure: ``(status, 0, None)``; the message names CANN's argument."""
    _last.message = str(cann_error(error))
    return error.status, 0, None


class aclOpExecutor:  # CANN's name (not PEP 8), so ported code reads the same
    """The work phase 1 bound: inputs, outputs, implementation and workspace size.

    Single-use like CANN's executors: a second run returns 161002 unless :func:`aclSetAclOpExecutorRepeatable`
    was called first. Attributes ``op``, ``backend`` (the implementation chosen in phase 1), ``device`` and
    ``workspace_size`` (bytes) are for inspection only.
    """

    def __init__(self, op: str, backend_name: str, device: torch.device, workspace_size: int,
                 run: Callable[[torch.Tensor | None], None],
                 bound: dict[str, torch.Tensor] | None = None) -> None:
        self.op = op
        self._bound = {name: (t, _layout(t)) for name, t in (bound or {}).items() if isinstance(t, torch.Tensor)}
        self._spans: list | None = None  # the bound tensors' byte spans, for the workspace overlap check
        self.backend = backend_name
        self.device = device
        self.workspace_size = workspace_size
        self._run = run
        self.repeatable = False
        self.spent = False
        self.destroyed = False

    def __repr__(self) -> str:
        state = "destroyed" if self.destroyed else "spent" if self.spent else "ready"
        return (f"aclOpExecutor({self.op}, backend={self.backend}, device={self.device}, "
                f"workspace={self.workspace_size} B, {'repeatable, ' if self.repeatable else ''}{state})")


def _layout_python(t: torch.Tensor) -> tuple:
    """What a kernel relies on besides the values: where the elements are and how many bytes back them."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device,
            t.untyped_storage().nbytes())


#: ``_layout(t)``: :func:`_layout_python`, or the native extension's C form of it where the extension is loaded.
_layout: Callable[[torch.Tensor], tuple] = _layout_python


def _use_layout(ext) -> None:
    global _layout
    _layout = getattr(ext, "layout", None) or _layout_python


_runtime.on_extension(_use_layout)


def _changed(executor: aclOpExecutor) -> str | None:
    """The first bound tensor whose layout differs from phase 1's, described; None when none does."""
    for name, (t, before) in executor._bound.items():
        now = _layout(t)
        if now != before:
            what = ("shape", "strides", "storage offset", "dtype", "device", "storage bytes")
            diff = [f"{w} {b} -> {a}" for w, b, a in zip(what, before[1:], now[1:]) if b != a] or \
                ["memory moved (address changed)"]
            return f"{name} changed after phase 1 ({'; '.join(diff)}); call the GetWorkspaceSize phase again"
    return None


def aclSetAclOpExecutorRepeatable(executor: aclOpExecutor | None) -> int:
    """Allow ``executor`` to run any number of times (until :func:`aclDestroyAclOpExecutor`).

    Returns:
        0; 161001 for ``None``; 161002 for an executor already spent or destroyed.
    """
    if executor is None:
        return _refuse(ACLNN_ERR_PARAM_NULLPTR, "aclSetAclOpExecutorRepeatable: executor is None")
    if not isinstance(executor, aclOpExecutor) or executor.spent or executor.destroyed:
        return _refuse(ACLNN_ERR_PARAM_INVALID,
                       f"aclSetAclOpExecutorRepeatable: {executor!r} cannot be made repeatable")
    executor.repeatable = True
    return ACLNN_SUCCESS


def aclDestroyAclOpExecutor(executor: aclOpExecutor | None) -> int:
    """Release ``executor`` (the bound tensors and implementation); it cannot run afterwards.

    Returns:
        0; 161001 for ``None``; 161002 for an executor destroyed before.
    """
    if executor is None:
        return _refuse(ACLNN_ERR_PARAM_NULLPTR, "aclDestroyAclOpExecutor: executor is None")
    if not isinstance(executor, aclOpExecutor) or executor.destroyed:
        return _refuse(ACLNN_ERR_PARAM_INVALID, f"aclDestroyAclOpExecutor: {executor!r} cannot be destroyed")
    executor.destroyed = True
    executor._run = None  # drop the references to the caller's tensors, as CANN frees the executor
    executor._bound = {}
    executor._spans = None
    return ACLNN_SUCCESS


#: Alignment of the result buffers carved from the workspace (cache line; CANN aligns workspaces to 512 bytes).
_ALIGN = 64


def plan(planner: Planner, *args, **outs: torch.Tensor) -> CallPlan:
    """Phase 1's validation and backend decision: the op's call plan (:mod:`gradops.ops._plan`, the one the
    functional API runs) with the CANN-strict check of the same table and the caller's out tensors.

    Raises:
        OpError: the refusal (its status: 161001 / 161002 / 561002; 561003 when ``GRADOPS_BACKEND`` names no
            backend or one that cannot run here).
    """
    return planner(*args, cann=True, **outs)


def prepare(op: str, device: torch.device, choice: backend.Choice, size_args: Sequence, compute: Compute,
            outs: dict[str, torch.Tensor], results: Sequence[Result] | None = None,
            inputs: dict[str, torch.Tensor] | None = None) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 after validation: bind ``compute`` to the plan's implementation and size its workspace.

    The results are written straight into the caller's out tensors: an implementation that takes ``out=`` gets
    views of them in its result shapes. An out tensor that has no such view (not contiguous) gets a buffer carved
    from the workspace, copied into it after the run, and its bytes are part of the workspace size reported here,
    so that phase 2 allocates nothing the caller did not size. (The pure-torch reference, which takes no ``out=``,
    computes with torch ops and its results are copied in.)

    Args:
        op: the backend op name (``"rms_norm_grad"``, ...).
        device: the device of the tensors.
        choice: the backend the op's call plan chose (``plan.backend``): its function and workspace hook.
        size_args: the positional args the implementation will receive (stand-ins with the right metadata where
            the real ones depend on data, e.g. converted indices), passed to the workspace hook.
        compute: called at run time as ``compute(impl, kwargs)`` and returns the implementation's results;
            ``kwargs`` carries ``workspace`` (with a hook) and ``out`` (when the implementation takes it).
        outs: the out tensors by name, in the order of the implementation's results: refused (161002) when two
            elements share memory (a broadcast or interleaved view cannot hold one value per element).
        results: the op's declared results (its spec's ``results``), in the order of ``outs``: the implementation
            writes each in its ``written`` shape (the 2-D view of an N-D dx, for instance); None: in the outs' own.
        inputs: the caller's input tensors by CANN name: with ``outs``, what phase 2 re-checks for changes.

    Returns:
        ``(status, workspace_size, executor)``.
    """
    for name, t in outs.items():
        if overlaps_itself(t):
            return _refuse(ACLNN_ERR_PARAM_INVALID, f"{op}: {name} must have one memory location per element, got "
                           f"strides {tuple(t.stride())} for shape {tuple(t.shape)}"), 0, None
    name, fn, hook = choice.name, choice.fn, choice.workspace
    try:
        scratch = int(hook(*size_args)) if hook is not None else 0
    except Exception as e:
        return _refuse(ACLNN_ERR_INNER, f"{op}: {name} workspace query failed: {e!r}"), 0, None

    direct = takes_out(fn)
    targets = [(t, tuple(t.shape) if results is None else r.written)
               for t, r in zip(outs.values(), results or [None] * len(outs))]
    carved: list[tuple[int, int]] = []  # (offset past the alignment slack, bytes) per carved result
    size = scratch
    if direct and any(not t.is_contiguous() for t, _ in targets):
        size += _ALIGN  # slack: the caller's buffer may start anywhere
        for t, shape in targets:
            if not t.is_contiguous():
                size = -(-size // _ALIGN) * _ALIGN
                nbytes = math.prod(shape) * t.element_size()
                carved.append((size, nbytes))
                size += nbytes

    # The outs' views in the result shapes, made once (phase 2 runs on the layouts phase 1 saw); None: carved from
    # the workspace at run time.
    fixed = [fit(t, tuple(shape)) if direct and t.is_contiguous() else None for t, shape in targets]
    single = fixed[0] if len(fixed) == 1 and not carved else None

    def run(workspace: torch.Tensor | None) -> None:
        kw = {"workspace": workspace[:scratch] if workspace is not None and scratch else None} if hook else {}
        if not direct:
            results = compute(fn, kw)
            for (t, _), r in zip(targets, results if isinstance(results, tuple) else (results,)):
                t.copy_(r.reshape(t.shape))
            return
        if not carved:
            kw["out"] = single if single is not None else tuple(fixed)
            compute(fn, kw)
            return
        base = (-workspace.data_ptr()) % _ALIGN - _ALIGN  # offsets above include the slack
        views, pending, spots = [], [], iter(carved)
        for (t, shape), view in zip(targets, fixed):
            if view is not None:
                views.append(view)
                continue
            offset, nbytes = next(spots)
            buf = workspace[base + offset:base + offset + nbytes].view(t.dtype).view(shape)
            views.append(buf)
            pending.append((t, buf))
        kw["out"] = tuple(views) if len(views) > 1 else views[0]
        compute(fn, kw)
        for t, buf in pending:
            t.copy_(buf.reshape(t.shape))

    return ACLNN_SUCCESS, size, aclOpExecutor(op, name, device, size, run, {**(inputs or {}), **outs})


def _workspace_bytes(op: str, workspace, workspace_size, executor: aclOpExecutor) -> tuple[int, torch.Tensor | None]:
    """Validate the caller's workspace; returns ``(status, the slice the implementation gets)``."""
    need = executor.workspace_size
    if need == 0:
        return ACLNN_SUCCESS, None
    if workspace is None:
        return _refuse(ACLNN_ERR_PARAM_NULLPTR, f"{op}: workspace is None but {need} bytes are needed"), None
    if isinstance(workspace_size, bool) or not isinstance(workspace_size, int) or workspace_size < need:
        return _refuse(ACLNN_ERR_PARAM_INVALID,
                       f"{op}: workspaceSize must be >= {need} (phase 1's answer), got {workspace_size!r}"), None
    if not isinstance(workspace, torch.Tensor) or not workspace.is_contiguous() or workspace.device != executor.device:
        given = f"{type(workspace).__name__}" if not isinstance(workspace, torch.Tensor) else \
            f"a tensor on {workspace.device}, contiguous={workspace.is_contiguous()}"
        return _refuse(ACLNN_ERR_PARAM_INVALID,
                       f"{op}: workspace must be a contiguous tensor on {executor.device}, got {given}"), None
    raw = workspace if workspace.dtype is torch.uint8 and workspace.dim() == 1 else \
        workspace.reshape(-1).view(torch.uint8)  # void*: any dtype, read as bytes
    if raw.numel() < workspace_size:
        return _refuse(ACLNN_ERR_PARAM_INVALID,
                       f"{op}: workspace holds {raw.numel()} bytes, fewer than workspaceSize = {workspace_size}"), None
    return ACLNN_SUCCESS, raw[:need]


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[first, past)`` a tensor's elements span (None when it has none)."""
    return _span(t.data_ptr(), t.shape, t.stride(), t.element_size())


def _span(address: int, shape, strides, itemsize: int) -> tuple[int, int] | None:
    first = past = address
    for size, stride in zip(shape, strides):
        if size == 0:
            return None
        step = (size - 1) * stride * itemsize
        if step < 0:
            first += step
        else:
            past += step
    return first, past + itemsize


def _shares_memory(workspace: torch.Tensor | None, executor: aclOpExecutor) -> str | None:
    """The bound tensor whose bytes the workspace slice overlaps, described; None when none does. The kernels
    write scratch data into the workspace while they read the inputs and write the outputs: a workspace over an
    input overwrote the caller's data (and returned 0), one over the output made the embedding kernel read its
    own scratch as indices (a segfault)."""
    span = None if workspace is None else _extent(workspace)
    if span is None:
        return None
    if executor._spans is None:  # from the layouts phase 1 saw (phase 2 checked them unchanged), once per executor
        executor._spans = [(name, device, _span(address, shape, strides, dtype.itemsize))
                           for name, (_, (address, shape, strides, _, dtype, device, _)) in executor._bound.items()]
    for name, device, other in executor._spans:
        if other is not None and device == workspace.device and other[0] < span[1] and span[0] < other[1]:
            return (f"{name} (bytes [{other[0]:#x}, {other[1]:#x}) against the workspace's [{span[0]:#x}, "
                    f"{span[1]:#x}))")
    return None


def _stream_context(op: str, stream, executor: aclOpExecutor) -> tuple[int, contextlib.AbstractContextManager]:
    if stream is None:
        return ACLNN_SUCCESS, contextlib.nullcontext()
    if not isinstance(stream, torch.cuda.Stream) or executor.device.type != "cuda" or stream.device != executor.device:
        return _refuse(ACLNN_ERR_PARAM_INVALID, f"{op}: stream must be None or a torch.cuda.Stream on "
                       f"{executor.device}, got {stream!r}"), contextlib.nullcontext()
    return ACLNN_SUCCESS, torch.cuda.stream(stream)


def execute(op: str, workspace, workspace_size, executor: aclOpExecutor | None, stream) -> int:
    """Phase 2: check the executor, stream and workspace, then run the bound work (enqueued on ``stream``)."""
    if executor is None:
        return _refuse(ACLNN_ERR_PARAM_NULLPTR, f"{op}: executor is None")
    if not isinstance(executor, aclOpExecutor) or executor.op != op:
        return _refuse(ACLNN_ERR_PARAM_INVALID, f"{op}: executor {executor!r} was not made for {op}")
    if executor.destroyed or executor.spent:
        return _refuse(ACLNN_ERR_PARAM_INVALID, f"{op}: {executor!r} cannot run again (executors are single-use "
                       "unless aclSetAclOpExecutorRepeatable was called)")
    status, ctx = _stream_context(op, stream, executor)
    if status:
        return status
    status, ws = _workspace_bytes(op, workspace, workspace_size, executor)
    if status:
        return status
    changed = _changed(executor)
    if changed:
        return _refuse(ACLNN_ERR_PARAM_INVALID, f"{op}: {changed}")
    shared = _shares_memory(ws, executor)
    if shared:
        return _refuse(ACLNN_ERR_PARAM_INVALID, f"{op}: workspace overlaps {shared}; the workspace must be memory "
                       "of its own (a buffer of workspaceSize bytes that no input or output uses)")
    executor.spent = not executor.repeatable
    try:
        with ctx, torch.no_grad():  # writing into out tensors that require grad is the caller's business
            executor._run(ws)
    except OpError as e:  # data-dependent checks (indices) run here, on the data present at run time
        _last.message = str(cann_error(e))
        return e.status
    except Exception as e:
        return _refuse(ACLNN_ERR_RUNTIME_ERROR, f"{op}: {executor.backend} failed: {e!r}")
    return ACLNN_SUCCESS
