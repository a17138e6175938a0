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
family) gradops' own kernel on ``device``. The manifest names the source per output.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import reference
from ..registry import NAMES
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


def _names(op: str) -> tuple[str, ...]:
    return {
        "rms_norm": ("y", "rstd"), "rms_norm_grad": ("dx", "dgamma"), "layer_norm": ("y", "mean", "variance"),
        "layer_norm_grad": ("pd_x", "res_for_gamma"), "layer_norm_grad_beta": ("pd_gamma", "pd_beta"),
        "layer_norm_backward": ("dx", "dgamma", "dbeta"), "hardswish": ("out",), "hardswish_backward": ("out",),
        "embedding_dense_backward": ("out",), "moe_token_permute": ("permuted_tokens", "sorted_indices"),
        "moe_token_permute_grad": ("out",), "moe_token_unpermute": ("out",),
        "moe_token_unpermute_grad": ("grad_permuted_tokens", "grad_probs"),
    }[op]


def _inputs(op: str, shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, opts: dict) -> dict:
    def normal(*s, scale=1.0):
        return (torch.randn(s, generator=g, dtype=torch.float64) * scale).to(dtype)

    def f32_or(d):
        return torch.float32 if opts.get("stat_dtype", "float32") == "float32" else d

    if (op.startswith(("rms_norm", "layer_norm"))) and len(shape) < 2:
        raise CaseError(f"{op}: --shape must be rows x H (at least two sizes; H is normalised), got {shape[0]}")
    h = shape[-1]
    rows = math.prod(shape[:-1])
    param = torch.float32 if opts.get("gamma_dtype") == "float32" else dtype  # the tables' float32 gamma/beta

    def weight(n):
        return normal(n).to(param)

    if op in ("rms_norm", "rms_norm_grad"):
        x, gamma = normal(*shape), weight(h)
        if op == "rms_norm":
            return {"x": x, "gamma": gamma, "epsilon": float(opts.get("epsilon", 1e-6))}
        rstd = torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-6).float()
        if opts.get("rstd_form", "keepdim") == "flat":
            rstd = rstd.reshape(shape[:-1])
        return {"dy": normal(*shape), "x": x, "rstd": rstd, "gamma": gamma}
    if op.startswith("layer_norm"):
        x, gamma, beta, dy = normal(*shape, scale=2.0), weight(h), weight(h), normal(*shape)
        eps = float(opts.get("epsilon", 1e-5))
        x64 = x.double()
        mean, var = x64.mean(-1), x64.var(-1, unbiased=False)
        if op == "layer_norm":
            return {"x": x, "gamma": gamma, "beta": beta, "epsilon": eps}
        if op == "layer_norm_grad":
            return {"dy": dy, "x": x, "variance": var.to(f32_or(dtype)), "mean": mean.to(f32_or(dtype)),
                    "gamma": gamma, "epsilon": eps}
        if op == "layer_norm_backward":
            return {"dy": dy, "x": x, "mean": mean.float(), "rstd": torch.rsqrt(var + eps).float(), "gamma": gamma}
        res = ((x64 - mean[..., None]) * torch.rsqrt(var[..., None] + eps)).to(dtype)
        return {"res_for_gamma": res, "dy": dy}
    if op in ("hardswish", "hardswish_backward"):
        x = torch.rand(shape, generator=g, dtype=torch.float64) * 12 - 6
        flat = x.view(-1)
        picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 16),), generator=g) if flat.numel() else None
        if picks is not None:  # a sixteenth of the elements on CANN's edges: -3, +3, 0
            flat[picks] = torch.tensor([-3.0, 3.0, 0.0], dtype=torch.float64)[torch.arange(picks.numel()) % 3]
        x = x.to(dtype)
        return {"self": x} if op == "hardswish" else {"grad_output": normal(*shape), "self": x}
    if op == "embedding_dense_backward":
        tokens = rows
        # fewer rows than tokens by default: repeats; a given --num-weights is used as given, 0 included (refused)
        vocab = int(opts["num_weights"]) if "num_weights" in opts else max(2, tokens // 2)
        if not 1 <= vocab < INDEX_LIMIT:
            raise CaseError(f"{op}: --num-weights must be >= 1 and below 2^63 (an int64 index), got {vocab}")
        padding = int(opts.get("padding_idx", 1 if vocab > 1 else -1))
        itype = _index_dtype(op, opts)
        top = min(vocab, _INDEX_RANGE.get(itype, vocab))  # narrow index types reach only the table's first rows
        idx = torch.randint(0, top, shape[:-1], generator=g)
        if idx.numel() and 0 <= padding < top:
            idx.view(-1)[:: 7] = padding  # padding rows in the mix
        if itype.is_floating_point:  # CANN truncates float indices toward zero: 2.7 -> 2, -0.5 -> 0
            frac = torch.rand(idx.shape, generator=g, dtype=torch.float64) * 0.9
            value = idx.double() + frac
            value.view(-1)[3::11] = -frac.view(-1)[3::11]
            stored = value.to(itype)
            # a fraction that rounds up to the next integer (float16 above 1024) must not leave the table
            indices = torch.where(stored.double() >= top, idx.to(itype), stored)
        else:
            indices = idx.to(itype)
        return {"grad": normal(*shape), "indices": indices, "num_weights": vocab, "padding_idx": padding,
                "scale_grad_by_freq": bool(opts.get("scale_grad_by_freq", False))}
    if len(shape) != 2:
        raise CaseError(f"{op}: --shape must be TxH (tokens x hidden), got {'x'.join(map(str, shape))}")
    t, h = shape
    k = int(opts.get("topk", 2))
    experts = int(opts.get("experts", 8))
    if not 1 <= k <= 512 or not 1 <= experts < INDEX_LIMIT:
        raise CaseError(f"{op}: --topk must be in [1, 512] and --experts >= 1 (below 2^63), got {k} and {experts}")
    ids = torch.randint(0, experts, (t, k), generator=g)
    if t > 1:
        ids[1::5, :] = ids[1::5, :1]  # duplicate experts within a token: ties keep token order
    if op == "moe_token_permute":
        return {"tokens": normal(t, h), "indices": ids.to(_index_dtype(op, opts)),
                "num_out_tokens": int(opts.get("num_out_tokens", 0))}
    sorted_indices = reference.moe_token_permute(torch.zeros(t, 0), ids, 0)[1]
    if op == "moe_token_permute_grad":
        return {"permuted_output_grad": normal(t * k, h), "sorted_indices": sorted_indices, "num_topk": k}
    probs = torch.softmax(torch.randn(t, k, generator=g, dtype=torch.float64), -1).to(dtype)
    if op == "moe_token_unpermute":
        return {"permuted_tokens": normal(t * k, h), "sorted_indices": sorted_indices, "probs": probs}
    return {"permuted_tokens": normal(t * k, h), "grad_unpermuted": normal(t, h), "sorted_indices": sorted_indices,
            "probs": probs}


#: Table rows and expert ids are drawn as int64: a count must stay below this.
INDEX_LIMIT = 1 << 63
#: Index dtypes by op: aclnnEmbeddingDenseBackward takes nine (docs/semantics.md §2), the MoE permute two.
INDEX_DTYPES = {"embedding_dense_backward": ("int64", "int32", "int16", "int8", "uint8", "bool", "float64", "float32",
                                            "float16"),
                "moe_token_permute": ("int64", "int32")}
#: Rows an index dtype can name exactly (float16 holds every integer up to 2048, float32 up to 2^24).
_INDEX_RANGE = {torch.int16: 1 << 15, torch.int8: 128, torch.uint8: 256, torch.bool: 2, torch.float16: 2048,
                torch.float32: 1 << 24}


def _index_dtype(op: str, opts: dict) -> torch.dtype:
    name = opts.get("index_dtype", "int64")
    if name not in INDEX_DTYPES[op]:
        raise CaseError(f"{op}: --index-dtype {name!r}: one of {', '.join(INDEX_DTYPES[op])}")
    return FILE_DTYPES[name][0]


def _f64(v: object) -> object:
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v


def _golden(op: str, args: list, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The reference in float64 on float64 inputs, each output rounded once to ``like``'s dtype and shape."""
    ref_args = [_f64(a) for a in args]
    if (not op.startswith("moe") and args[0].dim() > 2) or any(isinstance(a, torch.Tensor) and a.dim() == 2
                                                               and a.shape[-1] == 1 for a in args):
        # The reference works on CANN's 2-D view: activations (rows, H), statistics (rows,), gamma (H,).
        h = args[0].shape[-1]
        rows = args[0].numel() // max(h, 1)
        ref_args = [a.reshape(rows, h) if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.numel() == rows * h
                    and a.shape[-1] == h else a.reshape(rows) if isinstance(a, torch.Tensor) and a.dim() >= 1
                    and a.numel() == rows and a.shape[-1] != h else a for a in ref_args]
    if op == "embedding_dense_backward":  # the reference takes int64 rows: CANN truncates floats toward zero
        ref_args[1] = args[1].reshape(-1).long()
    if op == "moe_token_permute":
        t, k = args[1].shape[0], args[1].shape[1] if args[1].dim() == 2 else 1
        ref_args = [ref_args[0], ref_args[1], like[0].shape[0] if t * k else 0]
    out = getattr(reference, op)(*ref_args, compute=torch.float64) if op != "moe_token_permute" else \
        getattr(reference, op)(*ref_args)
    out = out if isinstance(out, tuple) else (out,)
    return tuple(o.reshape(ref.shape).to(ref.dtype) for o, ref in zip(out, like))


def _torch_peer(op: str, args: list) -> dict[int, tuple[torch.Tensor, str]]:
    """PyTorch's output where PyTorch has the operator (``output position -> (tensor, source)``), computing CANN's
    output in CANN's output dtype. Statistics PyTorch does not take are derived the way PyTorch's own forward
    would hand them over; the source string says what was done."""
    aten = torch.ops.aten
    if op == "rms_norm":
        x, gamma, eps = args
        return {0: (F.rms_norm(x, gamma.shape, gamma, eps), "torch.nn.functional.rms_norm")}
    if op == "layer_norm":
        x, gamma, beta, eps = args
        return {0: (F.layer_norm(x, gamma.shape, gamma, beta, eps), "torch.nn.functional.layer_norm")}
    if op == "hardswish":
        return {0: (F.hardswish(args[0]), "torch.nn.functional.hardswish")}
    if op == "rms_norm_grad":
        # PyTorch's rms_norm backward recomputes rstd from x (eps 1e-6, the eps of the case's rstd); gamma in
        # float32 so that dgamma comes out in float32, CANN's dgamma dtype, as PyTorch computes a float32 weight's.
        dy, x, _, gamma = args
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Mismatch dtype between input and weight": the unfused path, wanted
            xr, gr = x.detach().requires_grad_(), gamma.detach().float().requires_grad_()
            dx, dgamma = torch.autograd.grad(F.rms_norm(xr, gr.shape, gr, 1e-6), (xr, gr), dy)
        src = "torch.autograd of torch.nn.functional.rms_norm (rstd recomputed, eps 1e-6; float32 weight)"
        return {0: (dx, src), 1: (dgamma, src)}
    if op in ("layer_norm_backward", "layer_norm_grad"):
        if op == "layer_norm_backward":
            dy, x, mean, rstd, gamma = args
            src = "aten.native_layer_norm_backward"
        else:  # AscendC LayerNormGrad's pd_x: ATen's backward on rstd = rsqrt(variance + eps) in float32
            dy, x, var, mean, gamma, eps = args
            rstd = torch.rsqrt(var.float() + eps)
            src = "aten.native_layer_norm_backward (rstd = rsqrt(variance + epsilon) in float32)"
        stat, w = (*x.shape[:-1], 1), gamma.float()  # float32 weight: dgamma/dbeta in float32, CANN's dtype
        # the bias is only read for its presence (dbeta's shape); ATen refuses None beside an output mask
        outs = aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean.float().reshape(stat),
                                               rstd.float().reshape(stat), w, torch.zeros_like(w),
                                               [True, op == "layer_norm_backward", op == "layer_norm_backward"])
        if op == "layer_norm_grad":
            return {0: (outs[0], src)}
        return {0: (outs[0], src), 1: (outs[1], src), 2: (outs[2], src)}
    if op == "hardswish_backward":
        # torch >= 2.8 takes the open interval at x = +-3 (d(-3) = 0, d(3) = 1); CANN's V1 the closed one. At those
        # two points the third party gets CANN's values, as torch_npu patches them for its users.
        g, x = args
        out = aten.hardswish_backward(g, x)
        closed = torch.where(x == -3, g.float() * -0.5, g.float() * 1.5).to(g.dtype)
        return {0: (torch.where((x == 3) | (x == -3), closed, out),
                    "aten.hardswish_backward (CANN's closed-interval values at x = -3, 3)")}
    if op == "embedding_dense_backward":
        grad, idx, vocab, padding, scale = args
        pad = padding if 0 <= padding < vocab else -1  # CANN: a padding index outside the table means none
        wide = idx if idx.dtype in (torch.int32, torch.int64) else idx.long()  # truncation toward zero, as CANN
        return {0: (aten.embedding_dense_backward(grad, wide, vocab, pad, scale),
                    "aten.embedding_dense_backward (padding_idx outside the table passed as -1; indices as int64)")}
    return {}


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
    if op not in NAMES:
        raise CaseError(f"unknown op {op!r}; one of: {', '.join(NAMES)}")
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
    elements = math.prod(dims) * (int(opts.get("topk") or 2) if op.startswith("moe") else 1)
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

    g = torch.Generator().manual_seed(seed)
    inputs = _inputs(op, dims, FLOATS[dtype], g, {k: v for k, v in opts.items() if v is not None})
    args = list(inputs.values())
    try:
        ours = getattr(gradops, op)(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args])
    except gradops.OpError as err:
        raise CaseError(f"{op}: {err}") from None
    ours = tuple(o.cpu() for o in (ours if isinstance(ours, tuple) else (ours,)))
    golden = _golden(op, args, ours)
    names = _names(op)
    third, source = {}, {}
    peers = _torch_peer(op, [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]) \
        if third_party == "torch" else {}
    for i, name in enumerate(names):
        if i in peers:
            third[name], source[name] = peers[i][0].cpu(), peers[i][1]
        else:
            third[name], source[name] = ours[i], f"gradops.{op} ({device}, backend "  \
                f"{gradops.backend.choose(op, dev).name})"
    attributes = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
    return Case(op, inputs, dict(zip(names, golden)), third, source, attributes)


#: The options each op reads, for the CLI's help and checks.
OPTIONS: dict[str, tuple[str, ...]] = {
    "rms_norm": ("epsilon", "gamma_dtype"), "rms_norm_grad": ("rstd_form", "gamma_dtype"),
    "layer_norm": ("epsilon", "gamma_dtype"), "layer_norm_grad": ("epsilon", "stat_dtype", "gamma_dtype"),
    "layer_norm_grad_beta": ("epsilon",), "layer_norm_backward": ("epsilon", "gamma_dtype"),
    "hardswish": (), "hardswish_backward": (),
    "embedding_dense_backward": ("num_weights", "padding_idx", "scale_grad_by_freq", "index_dtype"),
    "moe_token_permute": ("topk", "experts", "num_out_tokens", "index_dtype"),
    "moe_token_permute_grad": ("topk", "experts"), "moe_token_unpermute": ("topk", "experts"),
    "moe_token_unpermute_grad": ("topk", "experts"),
}
