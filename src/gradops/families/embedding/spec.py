"""The embedding lookup and aclnnEmbeddingDenseBackward: their declarations (see :mod:`gradops.spec`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...spec import Bench, Example, Golden, OpSpec, Timed, provided
from . import contract, reference

aten = torch.ops.aten
#: Table rows and index values are drawn as int64: a count must stay below this.
INDEX_LIMIT = 1 << 63
#: Rows an index dtype can name exactly (float16 holds every integer up to 2048, float32 up to 2^24).
_INDEX_RANGE = {torch.int16: 1 << 15, torch.int8: 128, torch.uint8: 256, torch.bool: 2, torch.float16: 2048,
                torch.float32: 1 << 24}


def _lookup_example(m, n, dtype, device, gen):
    weight = torch.randn(m, n, generator=gen).to(dtype).to(device)
    idx = torch.randint(0, m, (m,), generator=gen).to(device)
    return Example((weight, idx, -1, False), (1,), lambda w, i, p, s: (F.embedding(i, w),),
                   kernel=lambda w, i, p, s: aten.embedding(w, i, p, s))


def _backward_example(m, n, dtype, device, gen):
    # m tokens into a table of m/2 rows (repeats to accumulate), row 1 the padding row, as a model with a pad token
    vocab = max(2, m // 2)
    grad = torch.randn(m, n, generator=gen).to(dtype).to(device)
    idx = torch.randint(0, vocab, (m,), generator=gen).to(device)
    return Example((grad, idx, vocab, 1, False), (m,),
                   lambda grad, idx, v, p, s: (aten.embedding_dense_backward(grad, idx, v, p, s),),
                   kernel=aten.embedding_dense_backward)


def _golden_inputs(shape, dtype, draw, opts):
    tokens = math.prod(shape[:-1])
    # fewer rows than tokens by default: repeats; a given --num-weights is used as given, 0 included (refused)
    vocab = int(opts["num_weights"]) if "num_weights" in opts else max(2, tokens // 2)
    if not 1 <= vocab < INDEX_LIMIT:
        draw.fail(f"embedding_dense_backward: --num-weights must be >= 1 and below 2^63 (an int64 index), got {vocab}")
    padding = int(opts.get("padding_idx", 1 if vocab > 1 else -1))
    itype = draw.index_dtype()
    top = min(vocab, _INDEX_RANGE.get(itype, vocab))  # narrow index types reach only the table's first rows
    idx = torch.randint(0, top, shape[:-1], generator=draw.gen)
    if idx.numel() and 0 <= padding < top:
        idx.view(-1)[:: 7] = padding  # padding rows in the mix
    if itype.is_floating_point:  # CANN truncates float indices toward zero: 2.7 -> 2, -0.5 -> 0
        frac = torch.rand(idx.shape, generator=draw.gen, dtype=torch.float64) * 0.9
        value = idx.double() + frac
        value.view(-1)[3::11] = -frac.view(-1)[3::11]
        stored = value.to(itype)
        # a fraction that rounds up to the next integer (float16 above 1024) must not leave the table
        indices = torch.where(stored.double() >= top, idx.to(itype), stored)
    else:
        indices = idx.to(itype)
    return {"grad": draw.normal(*shape), "indices": indices, "num_weights": vocab, "padding_idx": padding,
            "scale_grad_by_freq": bool(opts.get("scale_grad_by_freq", False))}


def _oracle(ref_args, args, like):
    # the reference takes int64 rows: CANN truncates floats toward zero
    return reference.embedding_dense_backward(ref_args[0], args[1].reshape(-1).long(), *ref_args[2:],
                                              compute=torch.float64)


def _peer(args):
    grad, idx, vocab, padding, scale = args
    pad = padding if 0 <= padding < vocab else -1  # CANN: a padding index outside the table means none
    wide = idx if idx.dtype in (torch.int32, torch.int64) else idx.long()  # truncation toward zero, as CANN
    return {0: (aten.embedding_dense_backward(grad, wide, vocab, pad, scale),
                "aten.embedding_dense_backward (padding_idx outside the table passed as -1; indices as int64)")}


def _prepare(shape, dtype, device):
    t, d, v = shape["T"], shape["D"], shape["V"]
    grad = torch.randn(t, d, dtype=dtype, device=device)
    idx = torch.randint(0, v, (t,), device=device)
    args = (grad, idx, v, -1, False)
    return Timed(args, lambda: aten.embedding_dense_backward(*args), (reference.embedding_dense_backward, args))


BENCH = Bench(
    "embedding_dense_backward",
    shapes={"cpu": [{"T": 16384, "D": 1024, "V": 32000}, {"T": 16384, "D": 1024, "V": 256000}],
            "cuda": [{"T": 16384, "D": 4096, "V": v} for v in (32000, 128256, 256000)],
            "quick": [{"T": 512, "D": 128, "V": 2000}], "gpu-check": [{"T": 16384, "D": 4096, "V": 128256}],
            "dry": [{"T": 16, "D": 32, "V": 50}]},
    sizes=lambda rows, cols, vocab, top_k: {"T": rows, "D": cols, "V": vocab},
    prepare=_prepare,
    nbytes=lambda s, e: s["T"] * s["D"] * e + s["V"] * s["D"] * e + 8 * s["T"],
    copy_numel=lambda s: s["V"] * s["D"],
    eager_name="aten.embedding_dense_backward",
)


def _lookup_rule(R, P, Shard):
    def rule(weight, indices, padding_idx, scale_grad_by_freq):
        tokens = [([Shard(d)], [R, Shard(d), None, None]) for d in range(indices.ndim)]
        return [([R], [R, R, None, None]), ([Shard(indices.ndim)], [Shard(1), R, None, None]), *tokens]
    return rule


def _backward_rule(R, P, Shard):
    def rule(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
        found = [([R], [R, R, None, None, None]), ([Shard(1)], [Shard(grad.ndim - 1), R, None, None, None])]
        if not scale_grad_by_freq and grad.ndim == indices.ndim + 1:
            found += [([P], [Shard(d), Shard(d), None, None, None]) for d in range(indices.ndim)]
        return found
    return rule


def _cpu():
    """The family's compiled CPU kernels (importing them loads or builds the native extension)."""
    from . import cpu

    return cpu


def _triton():
    """The family's Triton launchers (importing them needs triton)."""
    from . import launch

    return launch


#: The family's module for each backend: where each op's implementation (gradops.spec.Impl) is.
_BACKENDS = {"torch": lambda: reference, "cpu": _cpu, "triton": _triton}


#: The family's declarations, in the tables' order; each is also the module's constant of its name.
SPECS = (
    OpSpec("embedding_dense_backward", "aclnnEmbeddingDenseBackward", True, example=_backward_example,
           golden=Golden(("out",), ("num_weights", "padding_idx", "scale_grad_by_freq", "index_dtype"),
                         _golden_inputs, oracle=_oracle, peer=_peer,
                         index_dtypes=("int64", "int32", "int16", "int8", "uint8", "bool", "float64", "float32",
                                       "float16")),
           timing=BENCH, sharding=_backward_rule, check=contract.check_embedding_dense_backward,
           results=contract.embedding_dense_backward_results,
           providers=provided(_BACKENDS, lambda m: m.EMBEDDING_DENSE_BACKWARD)),
    OpSpec("embedding", "aclnnEmbedding", False, example=_lookup_example, sharding=_lookup_rule, kernels=False,
           node=True, check=contract.check_embedding, results=contract.embedding_results),
)
EMBEDDING_DENSE_BACKWARD, EMBEDDING = SPECS
