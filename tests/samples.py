"""One ``samples()`` generator per op: inputs for the PUBLIC function ``gradops.<op>``, each case tagged with
the purpose it serves (dtype, code path, edge case, regression). Deterministic: every call yields the same
tensors (a generator seeded per op), so pytest ids and values are stable.

Consumed by the correctness tests of every backend, opcheck, the aclnn tests and the interpreter tier.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# The seed's RmsNormGrad table: (dy/x dtype, gamma dtype).
RMS_DTYPES = ((torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float32), (torch.bfloat16, torch.float32))
EMBEDDING_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                          torch.float32, torch.float16, torch.float64)


@dataclass
class Sample:
    name: str
    purpose: str
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def clone(self) -> Sample:
        """A deep copy of the tensors (keeping strides), to prove that an op did not write into its inputs."""
        def copy(a):
            if isinstance(a, torch.Tensor):
                out = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                return out.copy_(a)
            return a
        return Sample(self.name, self.purpose, tuple(copy(a) for a in self.args),
                      {k: copy(v) for k, v in self.kwargs.items()})


class _Rand:
    def __init__(self, op: str, device: str):
        self.g = torch.Generator().manual_seed(zlib.crc32(op.encode()))
        self.device = device

    def normal(self, *shape, dtype=torch.float32, scale=1.0, offset=0.0):
        return (torch.randn(shape, generator=self.g) * scale + offset).to(dtype).to(self.device)

    def uniform(self, *shape, lo, hi, dtype=torch.float32):
        return (torch.rand(shape, generator=self.g) * (hi - lo) + lo).to(dtype).to(self.device)

    def ints(self, lo, hi, *shape, dtype=torch.int64):
        return torch.randint(lo, hi, shape, generator=self.g).to(dtype).to(self.device)

    def perm(self, n, dtype=torch.int32):
        return torch.randperm(n, generator=self.g).to(dtype).to(self.device)


def _wanted(dtype, dtypes) -> bool:
    return dtypes is None or dtype in dtypes


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (column-major storage)."""
    return t.t().contiguous().t()


# ---------------------------------------------------------------- RmsNorm
def _rstd(x: torch.Tensor, k: int, eps: float = 1e-6) -> torch.Tensor:
    dims = tuple(range(k, x.dim()))
    return torch.rsqrt(x.float().square().mean(dim=dims) + eps) if dims else torch.rsqrt(x.float().square().mean() + eps)


def _rms_norm(r: _Rand, dtypes):
    for xd, gd in RMS_DTYPES:
        if _wanted(xd, dtypes):
            yield Sample(f"{xd}-{gd}".replace("torch.", ""), "dtype", (r.normal(4, 64, dtype=xd), r.normal(64, dtype=gd)))
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield Sample(f"odd-3d-{tag}", "odd N, 3-D x", (r.normal(3, 5, 100, dtype=d), r.normal(100, dtype=d)), {"epsilon": 1e-5})
        yield Sample(f"multidim-gamma-{tag}", "multi-dim gamma", (r.normal(2, 3, 4, 5, dtype=d), r.normal(4, 5, dtype=d)))
        yield Sample(f"one-row-{tag}", "1 row", (r.normal(1, 37, dtype=d), r.normal(37, dtype=d)))
        yield Sample(f"wide-{tag}", "N beyond one block", (r.normal(2, 4099, dtype=d), r.normal(4099, dtype=d)))
        yield Sample(f"noncontig-{tag}", "non-contiguous x", (_transposed(r.normal(16, 24, dtype=d)), r.normal(24, dtype=d)))
        yield Sample(f"empty-rows-{tag}", "empty rows", (r.normal(0, 8, dtype=d), r.normal(8, dtype=d)))
        yield Sample(f"gamma-is-x-{tag}", "gamma.dim == x.dim (one row)", (r.normal(3, 7, dtype=d), r.normal(3, 7, dtype=d)))


def _rms_norm_grad(r: _Rand, dtypes):
    for s in _rms_norm(r, dtypes):
        x, gamma = s.args
        k = x.dim() - gamma.dim()
        dy = r.normal(*x.shape, dtype=x.dtype)
        rstd = _rstd(x, k).to(x.device)
        yield Sample(s.name, s.purpose, (dy, x, rstd, gamma))
    if _wanted(torch.float32, dtypes):
        x = r.normal(2, 1, 16)
        yield Sample("rstd-prefix", "rstd shorter than x.shape[:k] (skipped dims are 1)",
                     (r.normal(2, 1, 16), x, r.uniform(2, lo=0.5, hi=2.0), r.normal(16)))
        x = r.normal(2, 3, 8)
        yield Sample("rstd-keepdim", "rstd in the forward's keepdim form", (r.normal(2, 3, 8), x, _rstd(x, 2)[..., None], r.normal(8)))
        yield Sample("rstd-arbitrary", "rstd not derived from x (applied literally)",
                     (r.normal(6, 20), r.normal(6, 20), r.uniform(6, lo=0.1, hi=3.0), r.normal(20)))
        x = r.normal(200, 48)
        yield Sample("many-rows", "dgamma reduced over many rows", (r.normal(200, 48), x, _rstd(x, 1), r.normal(48)))


# ---------------------------------------------------------------- LayerNorm
def _ln_inputs(r: _Rand, dtypes):
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield f"basic-{tag}", "dtype", r.normal(4, 64, dtype=d, scale=2.0, offset=0.5), d
        yield f"odd-3d-{tag}", "odd N, 3-D x", r.normal(3, 5, 100, dtype=d), d
        yield f"one-row-{tag}", "1 row", r.normal(1, 33, dtype=d), d
        yield f"wide-{tag}", "N beyond one block", r.normal(2, 4099, dtype=d), d
        yield f"noncontig-{tag}", "non-contiguous x", _transposed(r.normal(16, 24, dtype=d)), d
        yield f"empty-rows-{tag}", "empty rows", r.normal(0, 8, dtype=d), d
        if d in HALF:
            yield f"fp32-params-{tag}", "float32 gamma/beta with half x", r.normal(5, 40, dtype=d), torch.float32
    if _wanted(torch.float32, dtypes):
        yield "many-rows", "dgamma/dbeta reduced over many rows", r.normal(300, 32), torch.float32


def _stats(x: torch.Tensor):
    xf = x.float()
    return xf.mean(-1), (xf - xf.mean(-1, keepdim=True)).square().mean(-1)


def _layer_norm(r, dtypes):
    for name, purpose, x, pd in _ln_inputs(r, dtypes):
        n = x.shape[-1]
        yield Sample(name, purpose, (x, r.normal(n, dtype=pd), r.normal(n, dtype=pd)), {"epsilon": 1e-5})


def _layer_norm_grad(r, dtypes):
    for name, purpose, x, pd in _ln_inputs(r, dtypes):
        mean, var = _stats(x)
        yield Sample(name, purpose, (r.normal(*x.shape, dtype=x.dtype), x, var, mean, r.normal(x.shape[-1], dtype=pd)),
                     {"epsilon": 1e-5})
    if _wanted(torch.float32, dtypes):
        x = r.normal(6, 20)
        yield Sample("stats-arbitrary", "mean/variance not derived from x (CANN's formula applied literally)",
                     (r.normal(6, 20), x, r.uniform(6, lo=0.2, hi=2.0), r.normal(6, scale=0.3), r.normal(20)), {"epsilon": 1e-5})
        mean, var = _stats(x)
        yield Sample("stats-keepdim", "statistics in keepdim form", (r.normal(6, 20), x, var[:, None], mean[:, None], r.normal(20)))


def _layer_norm_backward(r, dtypes):
    for s in _layer_norm_grad(r, dtypes):
        dy, x, var, mean, gamma = s.args
        yield Sample(s.name, s.purpose, (dy, x, mean, torch.rsqrt(var + 1e-5), gamma))


def _layer_norm_grad_beta(r, dtypes):
    for name, purpose, x, _ in _ln_inputs(r, dtypes):
        yield Sample(name, purpose, (r.normal(*x.shape, dtype=x.dtype), x))


# ---------------------------------------------------------------- Hardswish
def _hardswish_inputs(r, dtypes):
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield f"range-{tag}", "all three branches", r.uniform(5, 37, lo=-6.0, hi=6.0, dtype=d)
        boundary = torch.tensor([-3.0, 3.0, -3.0001, 3.0001, -2.9999, 2.9999, 0.0, -0.0, -100.0, 100.0])
        yield f"boundaries-{tag}", "exact +-3 (closed interval) and their neighbours", boundary.to(d).to(r.device)
        # 10 x 21 = 210 items: 26 steps of 8 items in the CPU kernel's vector loop and a tail of 2, each value in four
        # of the eight lanes - the 10 boundaries above put each value in one lane.
        yield (f"boundaries-steps-{tag}", "+-3 and neighbours inside the stepped vector loop and its tail",
               boundary.repeat(21).to(d).to(r.device))
        yield f"scalar-{tag}", "0-d tensor", r.uniform(lo=-4.0, hi=4.0, dtype=d)
        yield f"empty-{tag}", "empty tensor", r.normal(0, 3, dtype=d)
        yield f"noncontig-{tag}", "non-contiguous (transposed, sliced)", r.uniform(8, 12, lo=-5.0, hi=5.0, dtype=d).t()[::2]
        yield f"4d-{tag}", "4-D tensor", r.uniform(2, 3, 4, 5, lo=-5.0, hi=5.0, dtype=d)


def _hardswish(r, dtypes):
    for name, purpose, x in _hardswish_inputs(r, dtypes):
        yield Sample(name, purpose, (x,))


def _hardswish_backward(r, dtypes):
    for name, purpose, x in _hardswish_inputs(r, dtypes):
        g = r.normal(*x.shape, dtype=x.dtype)
        if x.dim() == 2 and not x.is_contiguous():
            g = _transposed(g)
        yield Sample(name, purpose, (g, x))
    if _wanted(torch.float32, dtypes):
        yield Sample("seed-example", "the seed's example: self = gradOutput = 0..7",
                     (torch.arange(8.0).view(4, 2).to(r.device), torch.arange(8.0).view(4, 2).to(r.device)))


# ---------------------------------------------------------------- Embedding
def _embedding_dense_backward(r, dtypes):
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield Sample(f"basic-{tag}", "dtype, duplicates", (r.normal(64, 16, dtype=d), r.ints(0, 10, 64), 10))
        yield Sample(f"padding-scale-{tag}", "padding row stays 0, scale counts padding too",
                     (r.normal(4, 8, 12, dtype=d), r.ints(0, 6, 4, 8), 6), {"padding_idx": 2, "scale_grad_by_freq": True})
        yield Sample(f"heavy-duplicates-{tag}", "one row hit 500 times (fp32 accumulation)",
                     (r.normal(500, 8, dtype=d), torch.zeros(500, dtype=torch.int64, device=r.device), 3))
    if not _wanted(torch.float32, dtypes):
        return
    for idt in EMBEDDING_INDEX_DTYPES:
        hi = 2 if idt == torch.bool else 7
        idx = r.ints(0, hi, 3, 5).to(idt)
        yield Sample(f"indices-{str(idt).removeprefix('torch.')}", "index dtype", (r.normal(3, 5, 4), idx, 7))
    yield Sample("float-truncation", "float indices truncated toward zero (2.7 -> 2, -0.5 -> 0)",
                 (r.normal(4, 3), torch.tensor([2.7, -0.5, 0.99, 3.0], device=r.device), 4))
    yield Sample("padding-negative", "negative padding_idx means none", (r.normal(20, 4), r.ints(0, 5, 20), 5), {"padding_idx": -1})
    yield Sample("padding-beyond", "padding_idx >= num_weights means none", (r.normal(20, 4), r.ints(0, 5, 20), 5),
                 {"padding_idx": 392092, "scale_grad_by_freq": True})
    yield Sample("padding-last", "padding_idx = num_weights - 1", (r.normal(20, 4), r.ints(0, 5, 20), 5), {"padding_idx": 4})
    yield Sample("untouched-rows", "large table, few indices", (r.normal(5, 4), r.ints(0, 1000, 5), 1000))
    yield Sample("empty-indices", "no indices: all-zero table", (r.normal(0, 4), r.ints(0, 3, 0), 3))
    yield Sample("8d-grad", "grad with 8 dims", (r.normal(1, 2, 1, 2, 1, 2, 1, 3), r.ints(0, 4, 1, 2, 1, 2, 1, 2, 1), 4))
    yield Sample("noncontig", "non-contiguous grad and indices", (_transposed(r.normal(6, 10)), r.ints(0, 4, 6, 2)[:, 0], 4))
    yield Sample("seed-example", "the seed's example", (torch.tensor([[1.0, 2, 3], [4, 5, 6]], device=r.device),
                                                        torch.tensor([1, 2], device=r.device), 4), {"padding_idx": 0})


# ---------------------------------------------------------------- MoE token permute
def _moe_token_permute(r, dtypes):
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield Sample(f"topk2-{tag}", "dtype, ties between experts", (r.normal(16, 12, dtype=d), r.ints(0, 4, 16, 2)))
    if not _wanted(torch.float32, dtypes):
        return
    yield Sample("topk1-1d", "1-D indices (K = 1)", (r.normal(10, 6), r.ints(0, 3, 10)))
    yield Sample("int32-indices", "int32 expert ids", (r.normal(9, 5), r.ints(0, 8, 9, 4, dtype=torch.int32)))
    yield Sample("drop", "num_out_tokens < T*K drops the tail", (r.normal(12, 6), r.ints(0, 4, 12, 2)), {"num_out_tokens": 15})
    yield Sample("drop-negative", "negative num_out_tokens slices from the end", (r.normal(12, 6), r.ints(0, 4, 12, 2)),
                 {"num_out_tokens": -5})
    yield Sample("large-k", "K = 512", (r.normal(2, 8), r.ints(0, 64, 2, 512)))
    yield Sample("empty", "no tokens", (r.normal(0, 8), r.ints(0, 4, 0, 2)))
    yield Sample("noncontig", "non-contiguous tokens", (_transposed(r.normal(10, 7)), r.ints(0, 3, 10, 2)))
    yield Sample("parallel", "CPU: T*K*H above PARALLEL_MIN, the parallel gather",
                 (r.normal(600, 64), r.ints(0, 16, 600, 2)), {"num_out_tokens": 1100})
    # Negative ids are refused (tests/test_errors.py, tests/test_moe_refusals.py); ids past every expert sort last.
    ids = r.ints(0, 4, 8, 2, dtype=torch.int32)
    ids[ids == 3] = 2**31 - 1
    yield Sample("sentinel-ids", "ids past every expert (int32's max) sort last, num_out_tokens drops them",
                 (r.normal(8, 5), ids), {"num_out_tokens": int((ids < 3).sum())})
    yield Sample("wide-span", "ids spanning far more values than copies: CPU's merge-sort path",
                 (r.normal(6, 5), r.ints(0, 2**41, 6, 3)))


def _moe_token_permute_grad(r, dtypes):
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield Sample(f"topk2-{tag}", "dtype", (r.normal(32, 12, dtype=d), r.perm(32), 2))
        yield Sample(f"topk8-{tag}", "K = 8, wider rows", (r.normal(64, 130, dtype=d), r.perm(64), 8))
    if not _wanted(torch.float32, dtypes):
        return
    yield Sample("int64-indices", "int64 sorted_indices", (r.normal(12, 5), r.perm(12, dtype=torch.int64), 3))
    yield Sample("topk1", "K = 1", (r.normal(7, 5), r.perm(7), 1))
    yield Sample("large-k", "K = 512", (r.normal(1024, 4), r.perm(1024), 512))
    yield Sample("dropped-rows", "A < T*K: indices >= A add nothing", (r.normal(9, 6), r.perm(16), 4))
    yield Sample("all-dropped", "A = 0", (r.normal(0, 6), r.perm(8), 2))
    yield Sample("empty", "T = 0", (r.normal(0, 6), r.perm(0), 2))
    yield Sample("convention", "distinguishes CANN's inverse permutation from Megatron's",
                 (torch.tensor([[1.0, 0], [0, 10], [100, 0], [0, 1000]], device=r.device),
                  torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=r.device), 2))
    yield Sample("noncontig", "non-contiguous grad", (_transposed(r.normal(12, 9)), r.perm(12), 3))
    yield Sample("seed-example", "the seed's example", (torch.tensor([[1.0, 2], [3, 4]], device=r.device),
                                                        torch.tensor([0, 1], dtype=torch.int32, device=r.device), 2))


# ---------------------------------------------------------------- MoE token unpermute
def _unpermute_inputs(r, d, t, k, rows=None, probs_dtype=None):
    """(permuted (rows, H=12), sorted_indices (T*K,) int32, probs (T, K)) for T tokens and top-k K."""
    rows = t * k if rows is None else rows
    return r.normal(rows, 12, dtype=d), r.perm(t * k), r.uniform(t, k, lo=0.0, hi=1.0, dtype=probs_dtype or d)


def _convention_unpermute():
    """Rows 0..3 hold 1, 10, 100, 1000; sorted_indices [2, 0, 3, 1]: token 0 takes rows 2 and 0 (101), token 1
    rows 3 and 1 (1010). Megatron's convention (the inverse permutation [1, 3, 0, 2]) gives 1010 and 101."""
    permuted = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])
    return permuted, torch.tensor([2, 0, 3, 1], dtype=torch.int32), torch.ones(2, 2)


def _moe_token_unpermute(r, dtypes):
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield Sample(f"topk2-{tag}", "dtype", _unpermute_inputs(r, d, 16, 2))
        yield Sample(f"no-probs-{tag}", "probs None: K = 1, the plain inverse gather", _unpermute_inputs(r, d, 10, 1)[:2])
        if d != torch.float32:
            yield Sample(f"float32-probs-{tag}", "probs' dtype independent of the tokens'",
                         _unpermute_inputs(r, d, 8, 4, probs_dtype=torch.float32))
    if not _wanted(torch.float32, dtypes):
        return
    f = torch.float32
    perm64, idx64, probs64 = _unpermute_inputs(r, f, 6, 3)
    yield Sample("int64-indices", "int64 sorted_indices", (perm64, idx64.long(), probs64))
    yield Sample("topk8-wide", "K = 8, rows wider than a vector (130)",
                 (r.normal(64, 130), r.perm(64), r.uniform(8, 8, lo=0.0, hi=1.0)))
    yield Sample("topk5", "K not a multiple of the kernels' 4-row passes", _unpermute_inputs(r, f, 7, 5))
    yield Sample("large-k", "K = 512", (r.normal(1024, 4), r.perm(1024), r.uniform(2, 512, lo=0.0, hi=1.0)))
    yield Sample("dropped-rows", "A < T*K: indices >= A add nothing", _unpermute_inputs(r, f, 4, 4, rows=9))
    yield Sample("all-dropped", "A = 0: every token 0", _unpermute_inputs(r, f, 4, 2, rows=0))
    yield Sample("empty", "T = 0", _unpermute_inputs(r, f, 0, 2))
    yield Sample("signed-probs", "negative and zero weights", (r.normal(12, 12), r.perm(12),
                                                               r.normal(4, 3) * (r.uniform(4, 3, lo=0, hi=1) > 0.3)))
    yield Sample("noncontig", "non-contiguous tokens and probs",
                 (_transposed(r.normal(12, 9)), r.perm(12), _transposed(r.uniform(4, 3, lo=0.0, hi=1.0))))
    yield Sample("convention", "distinguishes CANN's inverse permutation from Megatron's",
                 tuple(t.to(r.device) for t in _convention_unpermute()))
    yield Sample("cann-doc-example", "aclnnMoeTokenUnpermute's documented example: [[1, 2], [3, 4]] -> [[4, 6]]",
                 (torch.tensor([[1.0, 2], [3, 4]], device=r.device), torch.tensor([0, 1], dtype=torch.int32,
                                                                                  device=r.device),
                  torch.ones(1, 2, device=r.device)))


def _moe_token_unpermute_grad(r, dtypes):
    def case(d, t, k, rows=None, probs=True, probs_dtype=None):
        permuted, idx, p = _unpermute_inputs(r, d, t, k, rows, probs_dtype)
        return (permuted, r.normal(t, 12, dtype=d), idx) + ((p,) if probs else ())

    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield Sample(f"topk2-{tag}", "dtype", case(d, 16, 2))
        yield Sample(f"no-probs-{tag}", "probs None: the gradient rows scattered back, no probs gradient",
                     case(d, 10, 1, probs=False))
        if d != torch.float32:
            yield Sample(f"float32-probs-{tag}", "probs' gradient in probs' dtype",
                         case(d, 8, 4, probs_dtype=torch.float32))
    if not _wanted(torch.float32, dtypes):
        return
    f = torch.float32
    permuted, grad, idx, p = case(f, 6, 3)
    yield Sample("int64-indices", "int64 sorted_indices", (permuted, grad, idx.long(), p))
    yield Sample("topk8-wide", "K = 8, rows wider than the 16 dot-product lanes (130)",
                 (r.normal(64, 130), r.normal(8, 130), r.perm(64), r.uniform(8, 8, lo=0.0, hi=1.0)))
    yield Sample("long-rows", "H = 4099: long fp32 dot products", (r.normal(6, 4099), r.normal(3, 4099), r.perm(6),
                                                                     r.uniform(3, 2, lo=0.0, hi=1.0)))
    yield Sample("dropped-rows", "A < T*K: dropped copies get probs gradient 0", case(f, 4, 4, rows=9))
    yield Sample("all-dropped", "A = 0", case(f, 4, 2, rows=0))
    yield Sample("empty", "T = 0", case(f, 0, 2))
    yield Sample("noncontig", "non-contiguous tokens, gradient and probs",
                 (_transposed(r.normal(12, 9)), _transposed(r.normal(4, 9)), r.perm(12),
                  _transposed(r.uniform(4, 3, lo=0.0, hi=1.0))))
    permuted, idx, probs = (t.to(r.device) for t in _convention_unpermute())
    yield Sample("convention", "distinguishes CANN's inverse permutation from Megatron's",
                 (permuted, torch.tensor([[1.0], [2.0]], device=r.device), idx, probs))


# ---------------------------------------------------------------- routing-map MoE (docs/semantics.md §5b)
def _routing(r, t, e, k, dtype, probs_dtype=None, fewer=True, nowhere=True, map_dtype=torch.bool):
    """A (t, e) top-k routing map with probs: every 5th token routed to one expert fewer (-1 slots), token 1
    routed nowhere, the last expert empty (when e > k); int8 maps hold nonzero values other than 1."""
    scores = r.uniform(t, e, lo=0.0, hi=1.0).cpu()
    if e > k:
        scores[:, -1] = -1.0
    chosen = scores.topk(min(k, e), dim=1).indices
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter_(1, chosen, True)
    if fewer and k > 1:
        rows = torch.arange(0, t, 5)
        routing_map[rows, chosen[rows, -1]] = False
    if nowhere and t > 1:
        routing_map[1] = False
    probs = torch.where(routing_map, scores, 0.0).to(probs_dtype or dtype)
    if map_dtype == torch.int8:
        routing_map = routing_map.to(torch.int8) * torch.tensor([3, -1, 1, 7], dtype=torch.int8).repeat(e)[:e]
    return routing_map.to(r.device), probs.to(r.device)


def _routing_permute_cases(r, dtypes):
    """(name, purpose, (tokens, routing_map, probs), num_out_tokens, drop_and_pad) of the permute's cases."""
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        rm, probs = _routing(r, 12, 6, 2, d)
        yield f"topk2-{tag}", "dtype; fewer than K experts (-1 slots), a token routed nowhere, an empty expert", \
            (r.normal(12, 10, dtype=d), rm, probs), 24, False
        rm, probs = _routing(r, 12, 6, 2, d, probs_dtype=torch.float32 if d != torch.float32 else None)
        yield f"drop-{tag}", "drop_and_pad: C = 3 of a busier and an idler expert (drops and pads); fp32 probs", \
            (r.normal(12, 10, dtype=d), rm, probs), 18, True
    if not _wanted(torch.float32, dtypes):
        return
    f = torch.float32
    rm, probs = _routing(r, 10, 4, 2, f)
    yield "no-probs", "probs None: no permuted probs", (r.normal(10, 6), rm, None), 20, False
    yield "drop-no-probs", "drop_and_pad without probs", (r.normal(10, 6), rm, None), 8, True
    rm, probs = _routing(r, 9, 5, 2, f, map_dtype=torch.int8)
    yield "int8-map", "an int8 routing map (nonzero is routed)", (r.normal(9, 4), rm, probs), 18, False
    rm, probs = _routing(r, 8, 4, 1, f, fewer=False)
    yield "k-default", "num_out_tokens None: K = T // T = 1", (r.normal(8, 5), rm, probs), None, False
    rm, probs = _routing(r, 8, 6, 2, f)
    yield "k-above-routed", "K = 3 while tokens route to at most 2: a third -1 slot each", \
        (r.normal(8, 5), rm, probs), 24, False
    yield "capacity-one", "drop_and_pad with C = 1: most pairs dropped", (r.normal(8, 5), rm, probs), 6, True
    yield "capacity-all", "drop_and_pad with C = T: every expert padded to all tokens", (r.normal(8, 5), rm, probs), \
        48, True
    rm, probs = _routing(r, 40, 64, 8, f)
    yield "wide", "E = 64, K = 8", (r.normal(40, 33), rm, probs), 320, False
    yield "empty", "T = 0", (r.normal(0, 5), torch.zeros(0, 4, dtype=torch.bool, device=r.device),
                              torch.zeros(0, 4, device=r.device)), None, False
    rm, probs = _routing(r, 10, 4, 2, f)
    yield "noncontig", "non-contiguous tokens and probs", (_transposed(r.normal(10, 7)), rm,
                                                           _transposed(probs.contiguous())), 20, False


def _moe_token_permute_with_routing_map(r, dtypes):
    for name, purpose, (tokens, rm, probs), n, drop in _routing_permute_cases(r, dtypes):
        yield Sample(name, purpose, (tokens, rm, probs, n, drop))


def _permuted_inputs(tokens, rm, probs, n, drop):
    from gradops import reference  # the inputs of the backward ops: a real permute's outputs

    return reference.moe_token_permute_with_routing_map(tokens, rm, probs, n, drop)


def _moe_token_permute_with_routing_map_grad(r, dtypes):
    for name, purpose, (tokens, rm, probs), n, drop in _routing_permute_cases(r, dtypes):
        permuted, permuted_probs, si = _permuted_inputs(tokens.contiguous(), rm, probs, n, drop)
        grad = r.normal(*permuted.shape, dtype=tokens.dtype)
        grad_probs = None if probs is None else r.normal(permuted_probs.numel(), dtype=probs.dtype)
        yield Sample(name, purpose, (grad, grad_probs, si, rm, rm.shape[1], rm.shape[0], drop))
    if _wanted(torch.float32, dtypes):
        rm, probs = _routing(r, 10, 4, 2, torch.float32)
        _, _, si = _permuted_inputs(r.normal(10, 6), rm, probs, 20, False)
        yield Sample("no-map", "the tokens' gradient alone needs no routing map", (r.normal(20, 6), None, si, None, 4,
                                                                                  10, False))
        yield Sample("int64-indices", "int64 sorted_indices", (r.normal(20, 6), r.normal(20), si.long(), rm, 4, 10,
                                                               False))


def _moe_token_unpermute_with_routing_map(r, dtypes):
    for name, purpose, (tokens, rm, probs), n, drop in _routing_permute_cases(r, dtypes):
        permuted, _, si = _permuted_inputs(tokens.contiguous(), rm, probs, n, drop)
        rows = r.normal(*permuted.shape, dtype=tokens.dtype)
        yield Sample(name, purpose, (rows, si, list(tokens.shape), probs, rm if probs is not None else None, drop))
    if _wanted(torch.float32, dtypes):
        rm, probs = _routing(r, 10, 4, 2, torch.float32)
        _, _, si = _permuted_inputs(r.normal(10, 6), rm, probs, 8, True)
        yield Sample("drop-probs-no-map", "drop_and_pad: the weights come from probs alone", (r.normal(8, 6), si,
                                                                                             [10, 6], probs, None,
                                                                                             True))


def _moe_token_unpermute_with_routing_map_grad(r, dtypes):
    for name, purpose, (tokens, rm, probs), n, drop in _routing_permute_cases(r, dtypes):
        permuted, _, si = _permuted_inputs(tokens.contiguous(), rm, probs, n, drop)
        rows = r.normal(*permuted.shape, dtype=tokens.dtype)
        grad = r.normal(*tokens.shape, dtype=tokens.dtype)
        yield Sample(name, purpose, (rows, grad, si, probs, rm if probs is not None else None, drop))


# ---------------------------------------------------------------- SwiGlu
def _swiglu_inputs(r, dtypes):
    """(name, purpose, x, dim) per dtype: each split dim, both halves' layouts, the kernels' tails and sigmoid's
    saturation (non-finite values: tests/test_swiglu.py, as the samples' users compare with torch.equal)."""
    edges = torch.tensor([-104.0, -89.0, -88.0, -20.0, -1.2785, -0.0, 0.0, 1e-4, 20.0, 88.0, 89.0, 104.0,
                          -60.0, 60.0, -8.0, 3.0])
    for d in FLOATS:
        if not _wanted(d, dtypes):
            continue
        tag = str(d).removeprefix("torch.")
        yield f"last-{tag}", "split the last dim (an MLP's gate and up halves)", r.normal(4, 64, dtype=d, scale=2.0), -1
        yield f"tail-{tag}", "halves of 13 columns: the vector loop's tail", r.normal(3, 26, dtype=d, scale=2.0), -1
        yield f"dim0-{tag}", "split dim 0: one row, halves of the whole tensor", r.normal(6, 5, dtype=d), 0
        yield f"middle-{tag}", "split a middle dim: halves strided by the trailing dims", r.normal(2, 6, 5, dtype=d), 1
        yield f"negative-dim-{tag}", "dim counted from the end", r.normal(2, 4, 3, dtype=d), -2
        yield f"1d-{tag}", "1-D x", r.normal(18, dtype=d), 0
        yield f"noncontig-{tag}", "non-contiguous x (transposed)", _transposed(r.normal(12, 16, dtype=d)), -1
        yield f"saturation-{tag}", "sigmoid's saturation and exp's overflow edges in A and B", \
            torch.cat((edges, edges.flip(0))).view(1, 32).repeat(3, 1).to(d).to(r.device), -1
        yield f"empty-{tag}", "no rows", r.normal(0, 8, dtype=d), -1
        yield f"wide-{tag}", "rows of 4099 columns: beyond one Triton block", r.normal(2, 8198, dtype=d), -1


def _swiglu(r, dtypes):
    for name, purpose, x, dim in _swiglu_inputs(r, dtypes):
        yield Sample(name, purpose, (x, dim))


def _swiglu_grad(r, dtypes):
    for name, purpose, x, dim in _swiglu_inputs(r, dtypes):
        half = list(x.shape)
        half[dim] //= 2
        yield Sample(name, purpose, (r.normal(*half, dtype=x.dtype), x, dim))


_GENERATORS = {
    "rms_norm": _rms_norm, "rms_norm_grad": _rms_norm_grad, "layer_norm": _layer_norm,
    "layer_norm_grad": _layer_norm_grad, "layer_norm_grad_beta": _layer_norm_grad_beta,
    "layer_norm_backward": _layer_norm_backward, "hardswish": _hardswish, "hardswish_backward": _hardswish_backward,
    "embedding_dense_backward": _embedding_dense_backward, "moe_token_permute": _moe_token_permute,
    "moe_token_permute_grad": _moe_token_permute_grad, "moe_token_unpermute": _moe_token_unpermute,
    "moe_token_unpermute_grad": _moe_token_unpermute_grad,
    "moe_token_permute_with_routing_map": _moe_token_permute_with_routing_map,
    "moe_token_permute_with_routing_map_grad": _moe_token_permute_with_routing_map_grad,
    "moe_token_unpermute_with_routing_map": _moe_token_unpermute_with_routing_map,
    "moe_token_unpermute_with_routing_map_grad": _moe_token_unpermute_with_routing_map_grad,
    "swiglu": _swiglu, "swiglu_grad": _swiglu_grad,
}
OPS = tuple(_GENERATORS)


def samples(op: str, dtypes=None, device: str = "cpu") -> Iterator[Sample]:
    """The cases of ``op``; ``dtypes`` keeps only cases whose main dtype is listed."""
    yield from _GENERATORS[op](_Rand(op, device), dtypes)
