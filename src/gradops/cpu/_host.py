"""Host side of the compiled CPU kernels: contiguous inputs, outputs, row blocks, workspace, thread and fork safety.

The kernels get each tensor by address (:mod:`gradops.cpu._views`) and view it themselves: float32 as float32,
float16 as its bits in an ``int16`` array, bfloat16 as its bits in a ``uint16`` array (numba has no bfloat16; the
kernels convert with :mod:`gradops.cpu._numeric`). Inputs that are not contiguous are copied once (:func:`dense`;
a 2-D view with a row stride costs ``2·M·N·s`` more bytes; the kernels then get one memory layout to compile for).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
from numba.np.ufunc import parallel as _parallel
from torch import Tensor

from .._compat import HAS_OPENMP
from . import _pool

#: Most row blocks of a cross-row reduction (dgamma, dbeta, LayerNormGradBeta). The count is a function of the
#: shape only (:func:`row_blocks`), so the partial sums and their order - hence the result bits - never depend on
#: the thread count. 64 blocks keep 64 threads busy while the fp32 partials stay small (64 x 4096 x 4 B = 1 MiB at
#: N = 4096, 0.6% of the traffic of an 8192 x 4096 fp32 RMSNorm backward).
ROW_BLOCKS = 64

#: Least items (rows x cols) per row block below ROW_BLOCKS blocks. Each block zeroes, accumulates and hands the
#: fold a partial row of its own, so blocks of a few rows make the partials a large share of the work: LayerNorm
#: 512 x 256 fp32 forward + backward against torch.nn.LayerNorm (native node, fresh processes alternating, 2
#: cores) was 0.91-0.94x with 64 blocks of 8 rows but 1.00-1.07x in processes where both sides ran slow
#: (about one in four), where 8 blocks of 64 rows (16 Ki items each) gave 0.87-0.92x in either (32 blocks:
#: 0.95-0.99x slow; 4 blocks: as 8). 16 Ki items is also TASK_ITEMS, the least work worth a task.
BLOCK_ITEMS = 1 << 14


#: Work (items of the main tensor) below which the entries run their loop serially: a parallel region costs ~1.6 µs
#: to start on 2 cores (numba 0.68 on GNU OpenMP: a one-task region 1.9 µs, the same loop serial
#: 0.36), which 32 Ki fp32 items (~128 KiB, ~10 µs of work) amortise. Serial and parallel loops run the same
#: per-row / per-block function, and the choice depends on the shape only.
PARALLEL_MIN = 1 << 15

#: Items per task of the Python path's parallel row loops (rows of a row-range kernel per prange iteration): 16 Ki,
#: hardswish's chunk, so that a 2048 x 512 input still gives 64 tasks for 64 threads while a task's start (a call
#: and a few slices) stays small against its ~5 µs of work.
TASK_ITEMS = 1 << 14


def kernel(name: str, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor], ints: Sequence[int] = (),
           floats: Sequence[float] = ()) -> int:
    """Run the native CPU kernel ``name`` (see gradops/native/kernels.h for the convention): ``inputs`` contiguous
    CPU tensors in the op's order (None for an absent optional one), ``outputs`` contiguous results it fills.
    Returns -1, or the position of the first value the op refuses."""
    from .. import native

    return native.kernels().kernel(name, list(inputs), list(outputs), list(ints), list(floats))


def dense(t: Tensor) -> Tensor:
    """``t`` when it is contiguous, else a contiguous copy (the caller keeps it alive while a kernel reads its
    address)."""
    return t if t.is_contiguous() else t.contiguous()


def row_blocks(rows: int, cols: int) -> int:
    """Number of fixed row blocks for a reduction over a ``rows x cols`` input: one per BLOCK_ITEMS items, rounded
    up to a power of two (an even split over 2, 4, 8 ... threads), at most ROW_BLOCKS and ``rows``, at least 1 (so
    partials exist). The shape alone decides it, hence the bits."""
    want = -(-rows * cols // BLOCK_ITEMS)
    return max(1, min(ROW_BLOCKS, rows, 1 << max(0, want - 1).bit_length()))


def output(out: Tensor | None, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The buffer a kernel writes: ``out`` itself when it is contiguous, else a new tensor from the recycling
    pool (:mod:`gradops.cpu._pool`; see :func:`finish` for a non-contiguous ``out``)."""
    if out is not None and out.is_contiguous():
        return out
    return _pool.empty(shape, dtype)


def finish(buf: Tensor, out: Tensor | None) -> Tensor:
    """Deliver a kernel's result: into a non-contiguous ``out`` by copy, else ``buf`` as is."""
    if out is None or buf is out:
        return buf
    out.copy_(buf.view(out.shape))
    return out


def scratch(workspace: Tensor | None, nbytes: int, offset: int, dtype: np.dtype, count: int) -> np.ndarray:
    """``count`` items of ``dtype`` carved from ``workspace`` at byte ``offset`` (allocated when None)."""
    if workspace is None:
        return np.empty(count, dtype=dtype)
    if workspace.dtype != torch.uint8 or workspace.device.type != "cpu" or workspace.numel() < nbytes:
        raise ValueError(f"workspace must be a CPU uint8 tensor of at least {nbytes} bytes, got "
                         f"{workspace.dtype} with {workspace.numel()} elements on {workspace.device}")
    raw = workspace.detach().numpy()[offset:offset + count * np.dtype(dtype).itemsize]
    return raw.view(dtype)


# ---------------------------------------------------------------- fork safety
#: True in a child forked after this process ran a parallel kernel on numba's GNU-OpenMP pool, or (once
#: gradops.native is loaded, when numba's regions run on torch's OpenMP runtime) may have run torch's: GNU OpenMP
#: does not survive fork; numba terminates the child at its next parallel launch ("fork() called from a process
#: already using GNU OpenMP") or, on torch's runtime, the region hangs. In such a child (a fork-started DataLoader
#: worker, a multiprocessing pool) ``GRADOPS_BACKEND=auto`` computes with the pure-torch reference (same results,
#: reference speed), and naming ``cpu`` raises (gradops.backend.usable).
_forked_omp_child = False

FORKED_WHY = ("this process was forked after the compiled CPU kernels (or torch's, sharing the runtime with them "
              "once gradops.native is loaded) ran on GNU OpenMP, which does not survive fork (start workers with "
              "'spawn', or use GRADOPS_BACKEND=auto to compute with the reference here)")


def forked_omp_child() -> bool:
    """Whether this process is a child forked after the parent ran a kernel on GNU OpenMP (see above)."""
    return _forked_omp_child


def _shares_torch_openmp() -> bool:
    """Whether numba's OpenMP layer runs on torch's GNU OpenMP runtime: once gradops.native's extension (built with
    -fopenmp against the runtime torch loaded) is loaded, that one runtime serves numba's parallel regions too, so
    torch's own regions in the parent count as well."""
    native = sys.modules.get("gradops.native")
    return native is not None and getattr(native, "_module", None) is not None


def _after_fork_in_child() -> None:
    global _forked_omp_child, _launch_lock
    if _launch_lock is not None:  # another thread may have held it at the fork: the child's copy would never open
        _launch_lock = threading.Lock()
    if getattr(_parallel, "_is_initialized", False):
        omp = _parallel.threading_layer() == "omp"
    else:  # numba's pool never started here; with the shared runtime torch's regions may have run in the parent
        omp = _shares_torch_openmp() and HAS_OPENMP
    if omp:
        _forked_omp_child = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- thread safety
#: numba's workqueue threading layer (the one left where neither TBB nor OpenMP is available: macOS by default,
#: slim containers without libgomp, or NUMBA_THREADING_LAYER=workqueue) aborts the whole process when two Python
#: threads launch parallel kernels at once ("Concurrent access has been detected"). Under it, launches take this
#: lock; under TBB and OpenMP, which are thread-safe, nothing is serialised. Decided once, at the first launch.
_launch_lock: threading.Lock | None = None
_layer_decided = False
_decide_lock = threading.Lock()


def _decide_layer() -> None:
    """Start numba's thread pool (what the first parallel kernel would do) and note whether launches must be
    serialised. The layer is numba's default choice, TBB then OpenMP then workqueue, unless the user set one."""
    global _launch_lock, _layer_decided
    with _decide_lock:
        if not _layer_decided:
            _parallel._launch_threads()
            _launch_lock = threading.Lock() if _parallel.threading_layer() == "workqueue" else None
            _layer_decided = True


def safe_entry(fn: Callable) -> Callable:
    """Wrap ``fn`` (a backend op) for the two process-level hazards of numba's thread pools: in a forked child
    whose parent ran GNU OpenMP it raises :class:`~gradops.backend.BackendUnavailable` (numba would terminate the
    process; the dispatcher never sends a call here then, so only a direct call of ``gradops.cpu`` meets this);
    under the workqueue layer its launches are serialised (see :data:`_launch_lock`). Cost on the common path: two
    global reads (~0.1 µs)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _layer_decided:
            _decide_layer()
        if _forked_omp_child:
            from ..backend import BackendUnavailable

            raise BackendUnavailable(fn.__name__, "cpu", FORKED_WHY)
        lock = _launch_lock
        if lock is None:
            return fn(*args, **kwargs)
        with lock:
            return fn(*args, **kwargs)
    return call


# ---------------------------------------------------------------- C entry points
#: Every cfunc made by :func:`c_function`: its machine code lives as long as the object, and gradops.native's nodes
#: hold only the address.
_cfuncs: list = []


def c_function(signature, body: Callable):
    """``body`` compiled as a C function of ``signature`` (a numba cfunc, cached on disk) for gradops.native; its
    ``.address`` stays valid for the life of the process. ``body`` must run serially: the nodes split the work over
    torch's threads themselves (a cached cfunc whose callee runs numba's parallel loops would also need numba's
    parallel runtime loaded first - numba 0.68 otherwise aborts: "LLVM ERROR: Symbol not found: allocate_sched")."""
    from numba import cfunc

    compiled = cfunc(signature, cache=True)(body)
    _cfuncs.append(compiled)
    return compiled


def native_launch_ok() -> bool:
    """Whether a native node may run its kernels: not in a child forked after this process ran numba's GNU OpenMP
    pool (the Python path's guards decide there, see :data:`_forked_omp_child`). The nodes' kernels are serial
    pieces on torch's own threads, so numba's threading layer does not matter to them, and asking does not load
    numba's parallel runtime."""
    return not _forked_omp_child
