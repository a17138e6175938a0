"""One test case per operator: seeded inputs with the edge values CANN's contracts single out, the golden outputs
(:mod:`gradops.reference` in float64, rounded once to each output's dtype) and a third-party output.

Shapes: ``--shape`` is the activation ``R0xR1x...xH`` (norms normalise the last dimension; embedding: the
token-gradient shape ``...xD``; MoE: ``TxH``). Edge mixes (a fixed share of the elements, seeded):

- hardswish: exact -3, +3 (CANN's closed interval), 0, and values beyond +-3;
- embedding: a padding row (``padding_idx``, signed; out of table means none) and repeated indices;
- MoE: routers with duplicate experts (ties keep token order); sorted_indices from a real permute;
- rms_norm_grad: rstd in both accepted forms (``--rstd-form keepdim`` (R, 1), or ``flat`` (R,));
- norms: gamma (and beta) in the activations' dtype or, as the dtype tables allow beside half activations,
  ``--gamma-dtype float32``.

The third party is PyTorch on ``device`` where it has the operator: the forwards' y (``F.rms_norm``,
``F.layer_norm``, ``F.hardswish``), rms_norm_grad (autograd of ``F.rms_norm``), the LayerNorm dx / dgamma / dbeta
and LayerNormGrad's pd_x (``aten.native_layer_norm_backward``), ``aten.hardswish_backward`` and
``aten.embedding_dense_backward``; else (the statistics, LayerNormGrad's res_for_gamma, LayerNormGradBeta, the MoE
family) gradops' own kernel on ``device``. The manifest names the source per output. Each op declares its inputs,
options and third party in its family's ``spec.py`` (:class:`gradops.spec.Golden`).
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

import torch

from ..registry import OPS
from ..spec import OpSpec
from .files import DTYPES as FILE_DTYPES

FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SHAPE = re.compile(r"^[0-9]+(x[0-9]+)*$")


class CaseError(ValueError):
    """A bad request for a case (unknown op, bad shape string, option out of range): one line saying why."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``"64x128"`` -> (64, 128)."""
    if not _SHAPE.match(text.strip()):
        raise CaseError(f"--shape {text!r}: expected sizes joined by 'x', e.g. 64x128")
    return tuple(int(v) for v in text.strip().split("x"))


@dataclass
class Case:
    """A generated case: named inputs (in call order), CANN attributes, outputs and their goldens."""
    op: str
    inputs: dict[str, object]        # tensors and attribute values, in the public function's order
    outputs: dict[str, torch.Tensor]  # golden, in each output's dtype
    third: dict[str, torch.Tensor]
    third_source: dict[str, str]
    attributes: dict[str, object]


class Draw:
    """A case's seeded source of inputs, handed to each op's :attr:`gradops.spec.Golden.inputs`: ``gen`` (the
    generator), :meth:`normal` values in the case's dtype, :meth:`weight` (gamma / beta in the dtype
    ``--gamma-dtype`` asks for), :meth:`index_dtype`, and :meth:`fail` / :meth:`rows_by_h` (a bad request)."""

    def __init__(self, op: OpSpec, dtype: torch.dtype, gen: torch.Generator, opts: dict) -> None:
        self.op, self.dtype, self.gen, self.opts = op, dtype, gen, opts
        # the tables' float32 gamma / beta beside half activations
        self.param = torch.float32 if opts.get("gamma_dtype") == "float32" else dtype

    def normal(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.gen, dtype=torch.float64) * scale).to(self.dtype)

    def weight(self, n: int) -> torch.Tensor:
        return self.normal(n).to(self.param)

    def index_dtype(self) -> torch.dtype:
        """``--index-dtype`` (default int64), one of the op's :attr:`gradops.spec.Golden.index_dtypes`."""
        allowed = self.op.golden.index_dtypes
        name = self.opts.get("index_dtype", "int64")
        if name not in allowed:
            self.fail(f"{self.op.name}: --index-dtype {name!r}: one of {', '.join(allowed)}")
        return FILE_DTYPES[name][0]

    def rows_by_h(self, op: str, shape: tuple[int, ...]) -> None:
        """Refuse a norm's shape without rows (H alone)."""
        if len(shape) < 2:
            self.fail(f"{op}: --shape must be rows x H (at least two sizes; H is normalised), got {shape[0]}")

    def fail(self, message: str) -> NoReturn:
        raise CaseError(message)


def _f64(v: object) -> object:
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _golden(op: OpSpec, args: list, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The reference in float64 on float64 inputs, each output rounded once to ``like``'s dtype and shape."""
    ref_args = [_f64(a) for a in args]
    if op.golden.views and (args[0].dim() > 2 or any(isinstance(a, torch.Tensor) and a.dim() == 2
                                                     and a.shape[-1] == 1 for a in args)):
        # The reference works on CANN's 2-D view: activations (rows, H), statistics (rows,), gamma (H,).
        h = args[0].shape[-1]
        rows = args[0].numel() // max(h, 1)
        ref_args = [a.reshape(rows, h) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.numel() == rows * h
                    and a.shape[-1] == h else a.reshape(rows) if isinstance(a, torch.Tensor) and a.dim() >= 1
                    and a.numel() == rows and a.shape[-1] != h else a for a in ref_args]
    if op.golden.oracle is not None:
        out = op.golden.oracle(ref_args, args, like)
    else:
        out = op.providers["torch"]().fn(*ref_args, compute=torch.float64)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o.reshape(ref.shape).to(ref.dtype) for o, ref in zip(out, like))


#: Who computes the third-party outputs (``make(third_party=...)``, ``gradops golden --third-party``).
THIRD_PARTIES = ("torch", "gradops")


def make(op: str, shape: str | tuple[int, ...], dtype: str = "float32", seed: int = 0, device: str = "cpu",
         third_party: str = "torch", **opts: object) -> Case:
    """Generate the case: inputs, goldens and third-party outputs (see the module docstring).

    Args:
        op: an operator of :data:`gradops.registry.NAMES`.
        shape: ``"64x128"`` or a tuple; its meaning per op in the module docstring.
        dtype: float32 / float16 / bfloat16 (the activations' dtype).
        seed: the generator's seed: the same arguments give the same files.
        device: where the third-party kernel runs.
        third_party: "torch" (PyTorch where it has the operator, else gradops' kernel) or "gradops".
        opts: op options (epsilon, rstd_form, stat_dtype, gamma_dtype, num_weights, padding_idx,
            scale_grad_by_freq, index_dtype, topk, experts, num_out_tokens).

    Raises:
        CaseError: unknown op or dtype, bad shape, seed or device, option out of range, not enough memory.
    """
    if op not in GOLDEN:
        raise CaseError(f"unknown op {op!r}; one of: {', '.join(GOLDEN)}")
    if dtype not in FLOATS:
        raise CaseError(f"--dtype {dtype!r}: one of {', '.join(FLOATS)}")
    if third_party not in THIRD_PARTIES:
        raise CaseError(f"--third-party {third_party!r}: one of {', '.join(THIRD_PARTIES)}")
    dims = parse_shape(shape) if isinstance(shape, str) else _integers(shape)
    if not dims or any(d < 0 for d in dims):
        raise CaseError(f"--shape {shape!r}: at least one size, each an integer >= 0")
    if math.prod(dims) > MAX_ELEMENTS:
        raise CaseError(f"--shape {'x'.join(map(str, dims))}: {math.prod(dims)} elements; at most 2^31 "
                        f"(CANN's precision standard's largest case)")
    seeds = _integers((seed,))
    if not seeds or not 0 <= seeds[0] < SEED_LIMIT:
        raise CaseError(f"--seed {seed!r}: an integer from 0 to 2^63 - 1")
    seed = seeds[0]
    dev = _device(device)
    _check_memory(op, dims, opts)
    with _memory(dims):
        return _build(op, dims, dtype, seed, dev, device, third_party, opts)


#: The largest activation a case generates: CANN's precision standard (COMMERCIAL_OPS_PRECISION_DOCS §2) caps a
#: case at 2^31 elements in total.
MAX_ELEMENTS = 1 << 31
#: Seeds beyond this overflow torch's generator (gradops.cli_support.SEED_LIMIT, the CLI's bound).
SEED_LIMIT = 1 << 63


def _integers(values: object) -> tuple[int, ...]:
    """``values`` as Python ints (numpy and torch integers included); () when one is not an integer (a float, a
    bool, a string) or ``values`` is not a sequence."""
    out = []
    try:
        for v in values:
            if isinstance(v, bool):
                return ()
            out.append(operator.index(v))
    except TypeError:
        return ()
    return tuple(out)


def _device(device: str) -> torch.device:
    """``--device``: cpu or cuda[:N] present here (meta tensors hold no values to write, other devices run no
    gradops backend)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise CaseError(f"--device {device!r}: expected cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise CaseError(f"--device {device!r}: the third party runs on cpu or cuda[:N]")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CaseError(f"--device {device}: no CUDA device here")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CaseError(f"--device {device}: {torch.cuda.device_count()} CUDA device(s) here")
    return dev


#: Peak host bytes per element of a case's largest tensor while it is built (inputs, float64 golden, gradops'
#: and the third party's outputs): measured 133 (rms_norm_grad), 150 (layer_norm_backward), 88 per permuted element
#: (moe_token_unpermute_grad) at 2048x1024 float32; rounded up.
BYTES_PER_ELEMENT = 160


def _check_memory(op: str, dims: tuple[int, ...], opts: dict) -> None:
    """Refuse a case that cannot fit in the memory available now (Linux's MemAvailable; elsewhere unchecked):
    with overcommit the allocation itself succeeds and the kernel's OOM killer ends the process instead."""
    elements = math.prod(dims) * (int(opts.get("topk") or 2) if "topk" in OPTIONS[op] else 1)
    need = elements * BYTES_PER_ELEMENT
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    if need > available:
        raise CaseError(f"--shape {'x'.join(map(str, dims))}: needs about {need / 2**30:.1f} GiB of memory, "
                        f"{available / 2**30:.1f} GiB available")


@contextlib.contextmanager
def _memory(dims: tuple[int, ...]) -> Iterator[None]:
    """An allocation that fails (host or device memory) becomes a :class:`CaseError` naming the shape; any other
    RuntimeError is a bug and keeps its traceback."""
    try:
        yield
    except (MemoryError, RuntimeError) as err:
        text = str(err)
        if not isinstance(err, MemoryError) and "allocate" not in text and "out of memory" not in text:
            raise
        reason = text.splitlines()[0][:120] if text else "out of memory"
        raise CaseError(f"--shape {'x'.join(map(str, dims))}: not enough memory for this case ({reason})") from None


def _build(op: str, dims: tuple[int, ...], dtype: str, seed: int, dev: torch.device, device: str,
           third_party: str, opts: dict) -> Case:
    import gradops

    spec = GOLDEN[op]
    given = {k: v for k, v in opts.items() if v is not None}
    inputs = spec.golden.inputs(dims, FLOATS[dtype], Draw(spec, FLOATS[dtype], torch.Generator().manual_seed(seed),
                                                           given), given)
    args = list(inputs.values())
    try:
        ours = getattr(gradops, op)(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args])
    except gradops.OpError as err:
        raise CaseError(f"{op}: {err}") from None
    ours = tuple(o.cpu() for o in (ours if isinstance(ours, tuple) else (ours,)))
    golden = _golden(spec, args, ours)
    names = spec.golden.outputs
    third, source = {}, {}
    peer = spec.golden.peer if third_party == "torch" else None
    peers = peer([a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]) if peer is not None else {}
    for i, name in enumerate(names):
        if i in peers:
            third[name], source[name] = peers[i][0].cpu(), peers[i][1]
        else:
            third[name], source[name] = ours[i], f"gradops.{op} ({device}, backend "  \
                f"{gradops.backend.decide(op, dev).name})"
    attributes = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    return Case(op, inputs, dict(zip(names, golden)), third, source, attributes)


#: The ops with a golden case (every op of :data:`gradops.registry.OPS` declares one).
GOLDEN: dict[str, OpSpec] = {op.name: op for op in OPS if op.golden is not None}
#: The options each op reads, for the CLI's help and checks.
OPTIONS: dict[str, tuple[str, ...]] = {name: op.golden.options for name, op in GOLDEN.items()}
#: Index dtypes by op, for ``--index-dtype``: aclnnEmbeddingDenseBackward takes nine (docs/semantics.md §2), the MoE
#: permute two.
INDEX_DTYPES: dict[str, tuple[str, ...]] = {name: op.golden.index_dtypes for name, op in GOLDEN.items()
                                            if op.golden.index_dtypes}
