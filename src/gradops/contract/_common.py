"""Checks shared by every operator's validation table.

Each helper raises :class:`~gradops.status.OpError` with the CANN status code and a message naming the
argument, what was expected and what was given. They read only metadata (shape, dtype, device, strides), so
they also run on fake tensors while ``torch.compile`` traces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import torch

from .. import _runtime
from .._compat import is_compiling
from ..status import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, OpError

#: aclnn tensors have at most 8 dims.
MAX_RANK = 8
#: CANN's float dtypes: the aclnn / AscendC surfaces (``cann=True``) and :mod:`gradops.npu_compat` take these only.
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
#: The PyTorch API's float dtypes: CANN's plus float64, as torch's own modules take (``model.double()``,
#: ``torch.autograd.gradcheck``). float64 runs on the pure-torch reference in float64 (:func:`gradops.backend.wide`)
#: and its statistics and weight gradients stay float64 where CANN's are float32.
TORCH_FLOATS = (*FLOATS, torch.float64)

_DTYPE_NAMES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
    torch.int8: "int8", torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32",
    torch.int64: "int64", torch.bool: "bool",
}


class Result(NamedTuple):
    """One result of an op as the op's declaration gives it (``<op>_results(shape, *args)`` in the family's contract,
    beside its check): the fake kernel, ``out=``, the backends' allocations, the direct calls' programs and the aclnn
    outs all read it, so that a result's shape and dtype are written once."""

    #: The result's shape; None: ``like``'s shape and strides (``empty_like``, as an elementwise kernel writes it).
    shape: Sequence[int] | None
    dtype: torch.dtype
    #: A tensor on the result's device (the fake kernel's ``new_empty`` source).
    like: torch.Tensor
    #: The shape the backends write the result in (the 2-D view of ops whose backends take 2-D views); None: its own.
    view: Sequence[int] | None = None

    @property
    def size(self) -> tuple[int, ...]:
        """The result's shape, ``like``'s where the declaration gives None."""
        return tuple(self.like.shape if self.shape is None else self.shape)

    @property
    def written(self) -> tuple[int, ...]:
        """The shape a backend writes it in: the view, else its own."""
        return self.size if self.view is None else tuple(self.view)


#: The declared results as a call plan keeps them (:func:`evaluated`): ``(size, dtype, like)`` each.
Outputs = tuple[tuple[tuple[int, ...], torch.dtype, int], ...]


def evaluated(results: Iterable[Result], args: tuple) -> Outputs:
    """The declared results of one call plan (they depend only on what the plan is remembered by: the arguments'
    shapes, dtypes and devices), without the tensors (a remembered plan outlives the call): ``(size, dtype, like)``
    each, ``like`` the position in ``args`` of the argument of that size and dtype the result was declared like (a
    backend may make the output with ``empty_like`` from it, the cheaper call), else -1."""
    made = []
    for r in results:
        size = r.size
        like = next((i for i, a in enumerate(args) if a is r.like), -1)
        if like >= 0 and (r.dtype != r.like.dtype or size != tuple(r.like.shape)):
            like = -1
        made.append((size, r.dtype, like))
    return tuple(made)


def written(results: Iterable[Result]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """``(shape, dtype)`` of each result as the backends write it (their ``outputs`` / ``output`` specs)."""
    return [(tuple(r.view if r.view is not None else r.like.shape if r.shape is None else r.shape), r.dtype)
            for r in results]


def floats(cann: bool) -> tuple[torch.dtype, ...]:
    """The float dtypes of one surface: CANN's for ``cann=True``, else the PyTorch API's (with float64)."""
    return FLOATS if cann else TORCH_FLOATS


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype of statistics (rstd, mean, variance) and weight gradients beside inputs of ``dtype``: float32, as
    CANN's, except float64 beside float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def dtypes_text(dtypes: Iterable[torch.dtype]) -> str:
    return "one of {" + ", ".join(dtype_name(d) for d in dtypes) + "}"


def shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def fail(status: int, op: str, arg: str, expected: str, given: str) -> OpError:
    return OpError(status, op, arg, expected, given)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _reach(t: torch.Tensor) -> int:
    """The bytes of t's storage its elements need: one past the last element it addresses (strides are >= 0)."""
    last = t.storage_offset()
    for size, stride in zip(t.shape, t.stride()):
        if size > 1:
            last += (size - 1) * stride
    return (last + 1) * t.element_size()


def _hollow(t: torch.Tensor) -> bool:
    if type(t) not in _PLAIN:
        return False
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage of its own (a functorch wrapper): nothing to read here
        return False
    nbytes = storage.nbytes()
    # The common case first, in the fewest attribute reads (~0.9 µs a tensor, against ~2.5 for the general rule): a
    # contiguous view whose storage reaches past its last byte.
    if nbytes >= t.nbytes + t.storage_offset() * t.itemsize and t.is_contiguous():
        return False
    if t.is_meta or not t.numel():
        return False
    return storage.data_ptr() == 0 or nbytes < _reach(t)


#: ``hollow(t)``: whether the plain tensor ``t`` has elements its storage does not hold - the storage was freed
#: (``t.untyped_storage().resize_(0)``, as FSDP does to parameters between uses and any code may do to a saved
#: tensor; ``data_ptr()`` is then 0) or shrunk below what the view addresses. Every kernel reads its tensors by
#: address, so such a tensor is refused before one runs (torch's own kernels raise RuntimeError for it). False for
#: what is not a plain tensor (a subclass, a fake tensor under torch.compile: its metadata is its own), for a meta or
#: empty tensor, and for one without storage of its own (a functorch wrapper).
#:
#: :func:`gradops.contract._memo.key_of` asks it of every tensor of every planned call, since a remembered plan
#: depends on metadata only and the storage can be freed between two calls of the same metadata. This Python form
#: reads the storage and the view's layout (~0.9 µs a contiguous tensor); gradops.native installs its C form when it
#: loads, the same rule at ~0.1 µs (:func:`use_hollow`).
hollow: Callable[[torch.Tensor], bool] = _hollow


def use_hollow(fn: Callable[[torch.Tensor], bool] | None) -> None:
    """Install ``fn`` (the native extension's form of :data:`hollow`), or the Python form again for None."""
    global hollow
    hollow = fn if fn is not None else _hollow


_runtime.on_extension(lambda ext: use_hollow(None if ext is None else ext.hollow))


def require_whole(op: str, name: str, t: torch.Tensor) -> None:
    """161001 for a tensor whose storage was freed (a null data address), 161002 for one whose storage was shrunk
    below its elements (see :data:`hollow`). Nothing while dynamo traces: it sees fake tensors, which hold no data,
    and cannot trace the extension's C form; the traced op's body checks the real tensors when it runs."""
    if is_compiling() or not hollow(t):
        return
    nbytes = t.untyped_storage().nbytes()
    status = ACLNN_ERR_PARAM_NULLPTR if t.untyped_storage().data_ptr() == 0 else ACLNN_ERR_PARAM_INVALID
    raise fail(status, op, name, f"a tensor whose storage holds its {t.numel()} elements ({_reach(t)} bytes)",
               f"a storage of {nbytes} bytes (freed or shrunk by untyped_storage().resize_())")


def require_present(op: str, **tensors: object) -> None:
    """161001 for the first argument that is None; 161002 for one that is not a tensor; 161001 / 161002 for one
    whose storage was freed / shrunk (:func:`require_whole`)."""
    for name, t in tensors.items():
        if t is None:
            raise fail(ACLNN_ERR_PARAM_NULLPTR, op, name, "a tensor", "None")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a torch.Tensor", type(t).__name__)
        if t.layout != torch.strided:  # sparse / mkldnn: no strides to read, and no kernel here reads them
            raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.layout", "a dense (strided) tensor",
                       str(t.layout).removeprefix("torch."))
        require_whole(op, name, t)


def require_dtype(op: str, name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.dtype", dtypes_text(allowed), dtype_name(t.dtype))


def require_same_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.dtype", f"{dtype_name(ref.dtype)} (the dtype of {ref_name})",
                   dtype_name(t.dtype))


def require_rank(op: str, name: str, t: torch.Tensor, lo: int, hi: int = MAX_RANK,
                 status: int = ACLNN_ERR_PARAM_INVALID) -> None:
    if not lo <= t.dim() <= hi:
        expected = f"a tensor of {lo} to {hi} dims" if lo != hi else f"a {lo}-D tensor"
        raise fail(status, op, f"{name}.dim()", expected, f"{t.dim()} (shape {shape_text(t.shape)})")


def require_shape(op: str, name: str, t: torch.Tensor, expected: Sequence[int], why: str = "",
                  status: int = ACLNN_ERR_PARAM_INVALID) -> None:
    if tuple(t.shape) != tuple(expected):
        suffix = f" ({why})" if why else ""
        raise fail(status, op, f"{name}.shape", shape_text(expected) + suffix, shape_text(t.shape))


def require_same_device(op: str, **tensors: torch.Tensor) -> torch.device:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise fail(ACLNN_ERR_PARAM_INVALID, op, f"{name}.device", f"{first.device} (the device of {first_name})",
                       str(t.device))
    return first.device


def require_contiguous(op: str, **tensors: torch.Tensor) -> None:
    """The aclnn surfaces of ops whose seed says 'non-contiguous input not supported' call this."""
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a contiguous tensor",
                       f"strides {tuple(t.stride())} for shape {shape_text(t.shape)}")


def require_int(op: str, name: str, value: object, lo: int | None = None, hi: int | None = None,
                int64: bool = True) -> int:
    """An int (not a bool) in ``[lo, hi]``, and within int64 unless ``int64=False`` (for a value the caller
    normalises before it reaches an op schema, such as padding_idx)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "an int", type(value).__name__)
    if not int64 and lo is None and hi is None:
        return value
    # The op schemas carry int64: a larger Python int would fail there with a plain RuntimeError.
    lo = max(lo, -(2**63)) if lo is not None else -(2**63)
    hi = min(hi, 2**63 - 1) if hi is not None else 2**63 - 1
    if value < lo or value > hi:
        raise fail(ACLNN_ERR_PARAM_INVALID, op, name, f"an int in [{lo}, {hi}]", str(value))
    return value


def require_float(op: str, name: str, value: object) -> float:
    """A Python float or int (not a bool) that a float64 can hold: ``10**400`` would overflow in the kernels'
    conversion (OverflowError) instead of being refused here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a float", type(value).__name__)
    try:
        return float(value)
    except OverflowError:
        raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a float (within float64's range)",
                   f"an int of {value.bit_length()} bits") from None


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share a memory location (a broadcast view with stride 0, or strides that
    interleave), so that a result written into it would lose values. Exact: a quick sufficient test on the
    strides sorted ascending (each must step past everything the smaller ones reach), and, for the rare layouts
    it cannot clear, a count of distinct offsets (bounded: larger ones of that kind count as overlapping)."""
    if t.is_contiguous():  # the common case, without the sort (~1.5 µs per out= tensor)
        return False
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
    reach = 0  # the largest offset the dims so far reach
    for st, sz in dims:
        if st <= reach:
            break
        reach += st * (sz - 1)
    else:
        return False
    if any(st == 0 for st, _ in dims) or t.numel() > 1 << 22:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, sz in dims:
        offsets = (offsets[..., None] + torch.arange(sz) * st)
    return int(offsets.unique().numel()) != t.numel()


def require_writable(op: str, name: str, t: torch.Tensor) -> None:
    """161002 for an output whose elements share memory (see :func:`overlaps_itself`)."""
    if overlaps_itself(t):
        raise fail(ACLNN_ERR_PARAM_INVALID, op, name, "a tensor with one memory location per element",
                   f"strides {tuple(t.stride())} for shape {shape_text(t.shape)}")


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
