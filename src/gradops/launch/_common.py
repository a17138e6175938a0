"""What every host launcher shares: the launch counter, the persistent-grid size, 2-D view preparation and the
workspace carving of the ``<op>_workspace`` hook."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from functools import cache

import torch
from torch import Tensor

#: Launches per kernel name since import. Tests snapshot it to prove a Triton kernel really ran (the ops layer
#: falls back to the reference silently when a backend lacks an op).
LAUNCHES: Counter[str] = Counter()

#: Programs-per-"SM" stand-in under the interpreter: it runs programs one after another, so a small persistent
#: grid keeps several programs per partial buffer in play (exercising the cross-program reduction) at low cost.
INTERPRETER_SMS = 3

#: Workspace slices start on 256-byte boundaries (cudaMalloc's alignment), so every carved view is aligned for
#: 16-byte vector loads whatever the dtype.
ALIGN = 256


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """Launch ``kernel[grid](*args, **meta)`` and count it in :data:`LAUNCHES`; first raise the error of any
    earlier launch's index check that has completed (see :func:`guard`)."""
    if _PENDING:
        raise_pending()
    LAUNCHES[kernel.__name__] += 1
    kernel[grid](*args, **meta)


# ---------------------------------------------------------------- index checks without a host synchronisation
#: ``(pinned host flag, CUDA event, error factory)`` of index checks still in flight, oldest first.
_PENDING: deque[tuple[Tensor, object, Callable[[], Exception]]] = deque()
_PENDING_LOCK = threading.Lock()


def guard(bad: Tensor, error: Callable[[], Exception]) -> None:
    """Report ``error()`` when the 0-d tensor ``bad`` (computed on the device by the launcher from the indices the
    kernel reads) is non-zero. The kernels mask every access such an index would make, so nothing is read or
    written out of bounds whatever the flag says.

    On the CPU (the interpreter) the flag is read at once. On CUDA, reading it would synchronise the host with
    the device on every call; instead it is copied into pinned host memory behind an event, and the next gradops
    launch on any device, or :func:`raise_pending` with ``wait=True`` (``gradops.synchronize()``), raises it once the
    event has completed: the asynchronous error model of CUDA itself, minus the poisoned context. Launchers flag
    after their own launches, so that whether a call raises its own flag never depends on how fast the device
    was: a later call, or ``gradops.synchronize()``, does."""
    if bad.device.type != "cuda":
        if bool(bad):
            raise error()
        return
    if _PENDING:  # the completed flags first: a program that only records flags (inference) keeps the queue short
        raise_pending()
    flag = torch.empty((), dtype=bad.dtype, pin_memory=True)
    flag.copy_(bad, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    with _PENDING_LOCK:
        _PENDING.append((flag, event, error))


def raise_pending(wait: bool = False) -> None:
    """Raise the first error among completed index checks (all checks when ``wait``; that waits for the device).
    The flags still queued are dropped with it: one bad index is often flagged twice (the forward's range test,
    then the backward's), and a step that failed once should not fail again in the next, unrelated call."""
    while _PENDING:
        with _PENDING_LOCK:
            if not _PENDING:
                return
            flag, event, error = _PENDING[0]
            if not wait and not event.query():
                return
            _PENDING.popleft()
        event.synchronize()
        if bool(flag):
            with _PENDING_LOCK:
                _PENDING.clear()
            raise _built(error)


def _built(error: Callable[[], Exception]) -> Exception:
    """``error()`` outside ``torch.cuda.set_sync_debug_mode``: the factory reads the offending value from the
    device (a synchronisation, on the error path only), which that mode would otherwise turn into a RuntimeError
    about the read, hiding the OpError."""
    mode = torch.cuda.get_sync_debug_mode()
    if not mode:
        return error()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return error()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


@cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on H100/H200 SXM); :data:`INTERPRETER_SMS` on the CPU."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def unit_stride_rows(t: Tensor) -> Tensor:
    """``t`` (2-D) if its columns are adjacent in memory, else a contiguous copy. Row strides are kernel
    arguments, so row-sliced or padded views run in place; only column-strided layouts pay a copy."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def workspace_bytes(specs: Sequence[tuple[int, torch.dtype]]) -> int:
    """Bytes of a workspace holding one aligned slice per ``(numel, dtype)``."""
    return sum(_aligned(n * torch.empty((), dtype=d).element_size()) for n, d in specs)


def carve(workspace: Tensor | None, device: torch.device, specs: Sequence[tuple[int, torch.dtype]]) -> list[Tensor]:
    """1-D scratch tensors of the given sizes, cut from ``workspace`` (a uint8 tensor on ``device`` of at least
    :func:`workspace_bytes` bytes) or freshly allocated when it is None."""
    if workspace is None:
        return [torch.empty(n, dtype=d, device=device) for n, d in specs]
    need = workspace_bytes(specs)
    if workspace.dtype != torch.uint8 or workspace.device != device or workspace.numel() < need \
            or not workspace.is_contiguous() or workspace.data_ptr() % 16:
        raise ValueError(f"workspace must be a contiguous, 16-byte aligned uint8 tensor on {device} of at least "
                         f"{need} bytes; got "
                         f"{workspace.dtype} on {workspace.device} with {workspace.numel()} bytes")
    out, offset = [], 0
    for n, d in specs:
        size = n * torch.empty((), dtype=d).element_size()
        out.append(workspace[offset:offset + size].view(d))
        offset += _aligned(size)
    return out


def reduce_partials(part_a: Tensor, out_a: Tensor, part_b: Tensor | None, out_b: Tensor | None,
                    programs: int, n: int) -> None:
    """``out = part.view(programs, n).sum(0)`` (for one or two buffers) with the fixed-order kernel of
    :mod:`gradops.kernels.common`, cast to the outputs' dtype in the same pass."""
    import triton

    from ..kernels.common import sum_partials_kernel

    block_n = min(128, triton.next_power_of_2(n))
    block_p = min(32, triton.next_power_of_2(programs))
    two = part_b is not None
    launch(sum_partials_kernel, (triton.cdiv(n, block_n),), part_a, out_a, part_b if two else part_a,
           out_b if two else out_a, programs, n, TWO=two, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4)


def outputs(out: Tensor | Sequence[Tensor] | None, specs: Sequence[tuple[Sequence[int], torch.dtype]],
            device: torch.device) -> list[Tensor]:
    """The result tensors: the caller's ``out`` (one tensor or a tuple, as :func:`gradops.ops._out.run_into`
    passes: contiguous, of the result's shape and dtype; the kernels then write in place, no copy) or fresh ones."""
    if out is None:
        return [torch.empty(tuple(shape), dtype=d, device=device) for shape, d in specs]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if len(outs) != len(specs) or any(tuple(o.shape) != tuple(s) or o.dtype != d or o.device != device
                                       or not o.is_contiguous() for o, (s, d) in zip(outs, specs)):
        want = ", ".join(f"{tuple(s)} {d}" for s, d in specs)
        raise ValueError(f"out must be contiguous tensors on {device} of {want}")
    return outs
