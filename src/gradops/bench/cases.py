"""What ``gradops bench`` measures: per op, the shapes, the byte floor, and every provider side by side.

Providers (all compute the same gradients from the same inputs):

- ``gradops``: the public function as a user calls it: new outputs, which on the CPU come from the recycling
  pool (:mod:`gradops.cpu._pool`), so in steady state they are memory already mapped;
- ``gradops fresh`` (CPU): the same with the pool off: every output is fresh memory and its first touch (page
  faults) is timed, as it is for eager;
- ``gradops out=``: the public function writing into preallocated outputs (no allocation in the timed call);
- ``eager``: the natural PyTorch way (autograd of ``F.rms_norm``, ``aten.native_layer_norm_backward``,
  ``aten.hardswish_backward``, ``aten.embedding_dense_backward``, Megatron's ``index_add_`` for the MoE permute,
  autograd of the gather-weight-sum for the unpermute);
- ``compile``: ``torch.compile`` of gradops' pure-torch reference of the op (inductor; C++ on CPU, Triton on GPU);
- ``liger``: Liger-Kernel's autograd function where it has the op (GPU only, when importable);
- ``copy_``: ``dst.copy_(src)`` of the op's largest tensor, the bandwidth yardstick of the same run.

Byte floors (s = element size, what each GB/s figure divides by; see docs/performance.md §1.2):

- rms_norm_grad: ``M·N·3s + 4M + N·(s + 4)``
- layer_norm_backward (fused): ``M·N·3s + 8M + N·(s + 8)``
- layer_norm_grad+beta (CANN's two ops): grad ``M·N·4s + 8M + N·s`` plus beta ``M·N·2s + 2N·s``
- hardswish_backward: ``3·n·s``
- embedding_dense_backward: ``T·D·s + V·D·s + 8T``
- moe_token_permute_grad: ``T·K·H·s + T·H·s + 4·T·K``
- moe_token_unpermute_grad: ``2·T·K·H·s + T·H·s + 4·T·K + 2·T·K·s``
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import gradops
from gradops import reference
from gradops.registry import BENCH

aten = torch.ops.aten
#: The CPU output pool's switch (gradops.cpu._pool.ENV; spelled here so the bench imports without the CPU kernels).
POOL_ENV = "GRADOPS_CPU_POOL_MB"

#: Shapes per op: issue 6 for the CPU, issue 3 (LLM shapes) for CUDA, a tiny one for ``--quick``, one LLM shape per
#: op for ``gpu-check`` (scripts/gpu_check.sh: 7 cases per dtype, each with a torch.compile of its own, fit its
#: time box where the full CUDA set's 26 would not), and toy ones for ``--dry-run`` (the Triton interpreter runs
#: them in well under a second each).
SHAPES = {
    "cpu": {
        "rms_norm_grad": [{"M": 8192, "N": 4096}],
        "layer_norm_backward": [{"M": 8192, "N": 4096}],
        "layer_norm_grad+beta": [{"M": 8192, "N": 4096}],
        "hardswish_backward": [{"n": 32 * 1024 * 1024}],
        "embedding_dense_backward": [{"T": 16384, "D": 1024, "V": 32000}, {"T": 16384, "D": 1024, "V": 256000}],
        "moe_token_permute_grad": [{"T": 8192, "K": 8, "H": 2048}],
        "moe_token_unpermute_grad": [{"T": 8192, "K": 8, "H": 2048}],
    },
    "cuda": {
        "rms_norm_grad": [{"M": m, "N": n} for m, n in ((4096, 2048), (16384, 4096), (16384, 8192), (65536, 4096),
                                                         (16384, 16384), (4096, 65536))],
        "layer_norm_backward": [{"M": m, "N": n} for m, n in ((4096, 2048), (16384, 4096), (16384, 8192),
                                                               (65536, 4096), (16384, 16384), (4096, 65536))],
        "layer_norm_grad+beta": [{"M": 16384, "N": 4096}, {"M": 65536, "N": 8192}],
        "hardswish_backward": [{"n": 16384 * 4096}, {"n": 16384 * 14336}],
        "embedding_dense_backward": [{"T": 16384, "D": 4096, "V": v} for v in (32000, 128256, 256000)],
        "moe_token_permute_grad": [{"T": 16384, "K": 2, "H": 4096}, {"T": 4096, "K": 8, "H": 7168},
                                   {"T": 8192, "K": 8, "H": 4096}],
        "moe_token_unpermute_grad": [{"T": 16384, "K": 2, "H": 4096}, {"T": 4096, "K": 8, "H": 7168},
                                     {"T": 8192, "K": 8, "H": 4096}],
    },
    "quick": {
        "rms_norm_grad": [{"M": 256, "N": 512}],
        "layer_norm_backward": [{"M": 256, "N": 512}],
        "layer_norm_grad+beta": [{"M": 256, "N": 512}],
        "hardswish_backward": [{"n": 1 << 17}],
        "embedding_dense_backward": [{"T": 512, "D": 128, "V": 2000}],
        "moe_token_permute_grad": [{"T": 256, "K": 4, "H": 256}],
        "moe_token_unpermute_grad": [{"T": 256, "K": 4, "H": 256}],
    },
    "gpu-check": {
        "rms_norm_grad": [{"M": 16384, "N": 4096}],
        "layer_norm_backward": [{"M": 16384, "N": 4096}],
        "layer_norm_grad+beta": [{"M": 16384, "N": 4096}],
        "hardswish_backward": [{"n": 16384 * 4096}],
        "embedding_dense_backward": [{"T": 16384, "D": 4096, "V": 128256}],
        "moe_token_permute_grad": [{"T": 8192, "K": 8, "H": 4096}],
        "moe_token_unpermute_grad": [{"T": 8192, "K": 8, "H": 4096}],
    },
    "dry": {
        "rms_norm_grad": [{"M": 8, "N": 64}],
        "layer_norm_backward": [{"M": 8, "N": 64}],
        "layer_norm_grad+beta": [{"M": 8, "N": 64}],
        "hardswish_backward": [{"n": 512}],
        "embedding_dense_backward": [{"T": 16, "D": 32, "V": 50}],
        "moe_token_permute_grad": [{"T": 8, "K": 2, "H": 32}],
        "moe_token_unpermute_grad": [{"T": 8, "K": 2, "H": 32}],
    },
}
OPS = BENCH  # every case, in the registry's order (tests/test_registry.py: each has shapes and a builder)


@dataclass
class Case:
    """One (op, shape, dtype): its byte floor, the tensor size copy_ is measured on, and the providers."""
    op: str
    shape: dict
    dtype: torch.dtype
    nbytes: int
    copy_numel: int
    providers: dict[str, Callable[[], object]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _compiled(fn: Callable, notes: dict[str, str]) -> Callable | None:
    """``torch.compile(fn)``; compilation itself happens at the first call (the timer's warm-up, which drops a
    provider that fails and notes why)."""
    try:
        return torch.compile(fn, dynamic=False)
    except RuntimeError as err:  # e.g. a Python version dynamo does not support
        notes["compile"] = f"torch.compile unavailable: {err}"
        return None


def _liger(module: str, name: str) -> type | None:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # not installed, or an API that moved: the provider is absent
        return None


def _rms_norm_grad(shape, dtype, device, peers) -> Case:
    m, n = shape["M"], shape["N"]
    s = torch.finfo(dtype).bits // 8
    x, dy = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
    gamma = torch.randn(n, dtype=dtype, device=device)
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
    case = Case("rms_norm_grad", shape, dtype, m * n * 3 * s + 4 * m + n * (s + 4), m * n)
    dx, dg = torch.empty_like(dy), torch.empty(n, device=device)
    case.providers["gradops"] = lambda: gradops.rms_norm_grad(dy, x, rstd, gamma)
    case.providers["gradops out="] = lambda: gradops.rms_norm_grad(dy, x, rstd, gamma, out=(dx, dg))
    xr, gr = x.detach().requires_grad_(), gamma.detach().requires_grad_()
    y = F.rms_norm(xr, (n,), gr, 1e-6)
    case.providers["eager"] = lambda: torch.autograd.grad(y, (xr, gr), dy, retain_graph=True)
    if "compile" in peers and (fn := _compiled(reference.rms_norm_grad, case.notes)):
        case.providers["compile"] = lambda: fn(dy, x, rstd, gamma)
    liger = _liger("liger_kernel.ops.rms_norm", "LigerRMSNormFunction") if device.type == "cuda" else None
    if liger is not None:
        # offset 0, Llama's casting, and in_place=False: Liger's default writes dx into dy, the input every other
        # provider of the case reads
        ly = liger.apply(xr, gr, 1e-6, 0.0, "llama", False)
        case.providers["liger"] = lambda: torch.autograd.grad(ly, (xr, gr), dy, retain_graph=True)
    return case


def _ln_inputs(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    x, dy = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
    gamma, beta = torch.randn(n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
    mean = x.float().mean(-1)
    var = (x.float() - mean[:, None]).square().mean(-1)
    return m, n, x, dy, gamma, beta, mean, var, torch.rsqrt(var + 1e-5)


def _ln_peers(case, shape, dtype, device, peers, x, dy, gamma, beta, mean, rstd):
    n = shape["N"]
    _, mean2, rstd2 = aten.native_layer_norm(x, [n], gamma, beta, 1e-5)  # the statistics torch itself keeps
    case.providers["eager"] = lambda: aten.native_layer_norm_backward(dy, x, [n], mean2, rstd2, gamma, beta,
                                                                      [True, True, True])
    if "compile" in peers and (fn := _compiled(reference.layer_norm_backward, case.notes)):
        case.providers["compile"] = lambda: fn(dy, x, mean, rstd, gamma)
    liger = _liger("liger_kernel.ops.layer_norm", "LigerLayerNormFunction") if device.type == "cuda" else None
    if liger is not None:
        xr, gr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
        ly = liger.apply(xr, gr, br, 1e-5)
        case.providers["liger"] = lambda: torch.autograd.grad(ly, (xr, gr, br), dy, retain_graph=True)


def _layer_norm_backward(shape, dtype, device, peers) -> Case:
    m, n, x, dy, gamma, beta, mean, _, rstd = _ln_inputs(shape, dtype, device)
    s = torch.finfo(dtype).bits // 8
    case = Case("layer_norm_backward", shape, dtype, m * n * 3 * s + 8 * m + n * (s + 8), m * n)
    dx, dg, db = torch.empty_like(x), torch.empty(n, device=device), torch.empty(n, device=device)
    case.providers["gradops"] = lambda: gradops.layer_norm_backward(dy, x, mean, rstd, gamma)
    case.providers["gradops out="] = lambda: gradops.layer_norm_backward(dy, x, mean, rstd, gamma, out=(dx, dg, db))
    _ln_peers(case, shape, dtype, device, peers, x, dy, gamma, beta, mean, rstd)
    return case


def _layer_norm_grad_beta(shape, dtype, device, peers) -> Case:
    m, n, x, dy, gamma, beta, mean, var, rstd = _ln_inputs(shape, dtype, device)
    s = torch.finfo(dtype).bits // 8
    nbytes = (m * n * 4 * s + 8 * m + n * s) + (m * n * 2 * s + 2 * n * s)
    case = Case("layer_norm_grad+beta", shape, dtype, nbytes, m * n)

    def fresh():
        _, res = gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5)
        return gradops.layer_norm_grad_beta(res, dy)

    pdx, res_buf = torch.empty_like(x), torch.empty_like(x)
    pg, pb = torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)

    def prealloc():
        gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5, out=(pdx, res_buf))
        return gradops.layer_norm_grad_beta(res_buf, dy, out=(pg, pb))

    case.providers["gradops"] = fresh
    case.providers["gradops out="] = prealloc
    _ln_peers(case, shape, dtype, device, peers, x, dy, gamma, beta, mean, rstd)
    return case


def _hardswish_backward(shape, dtype, device, peers) -> Case:
    n = shape["n"]
    s = torch.finfo(dtype).bits // 8
    x = (torch.randn(n, device=device) * 4).to(dtype)
    g = torch.randn(n, dtype=dtype, device=device)
    out = torch.empty_like(x)
    case = Case("hardswish_backward", shape, dtype, 3 * n * s, n)
    case.providers["gradops"] = lambda: gradops.hardswish_backward(g, x)
    case.providers["gradops out="] = lambda: gradops.hardswish_backward(g, x, out=out)
    case.providers["eager"] = lambda: aten.hardswish_backward(g, x)
    if "compile" in peers and (fn := _compiled(reference.hardswish_backward, case.notes)):
        case.providers["compile"] = lambda: fn(g, x)
    return case


def _embedding_dense_backward(shape, dtype, device, peers) -> Case:
    t, d, v = shape["T"], shape["D"], shape["V"]
    s = torch.finfo(dtype).bits // 8
    grad = torch.randn(t, d, dtype=dtype, device=device)
    idx = torch.randint(0, v, (t,), device=device)
    out = torch.empty(v, d, dtype=dtype, device=device)
    case = Case("embedding_dense_backward", shape, dtype, t * d * s + v * d * s + 8 * t, v * d)
    case.providers["gradops"] = lambda: gradops.embedding_dense_backward(grad, idx, v)
    case.providers["gradops out="] = lambda: gradops.embedding_dense_backward(grad, idx, v, out=out)
    case.providers["eager"] = lambda: aten.embedding_dense_backward(grad, idx, v, -1, False)
    if "compile" in peers and (fn := _compiled(reference.embedding_dense_backward, case.notes)):
        case.providers["compile"] = lambda: fn(grad, idx, v, -1, False)
    return case


def _moe_token_permute_grad(shape, dtype, device, peers) -> Case:
    t, k, h = shape["T"], shape["K"], shape["H"]
    s = torch.finfo(dtype).bits // 8
    grad = torch.randn(t * k, h, dtype=dtype, device=device)
    sorted_indices = torch.randperm(t * k, device=device).to(torch.int32)  # CANN's: destination row of (t, k)
    # Megatron's unfused backward: permuted row r came from token token_of_row[r]; index_add_ into zeros
    token_of_row = torch.empty(t * k, dtype=torch.long, device=device)
    token_of_row[sorted_indices.long()] = torch.arange(t * k, device=device) // k
    out = torch.empty(t, h, dtype=dtype, device=device)
    case = Case("moe_token_permute_grad", shape, dtype, t * k * h * s + t * h * s + 4 * t * k, t * k * h)
    case.providers["gradops"] = lambda: gradops.moe_token_permute_grad(grad, sorted_indices, k)
    case.providers["gradops out="] = lambda: gradops.moe_token_permute_grad(grad, sorted_indices, k, out=out)
    case.providers["eager"] = lambda: torch.zeros(t, h, dtype=dtype, device=device).index_add_(0, token_of_row, grad)
    if "compile" in peers and (fn := _compiled(reference.moe_token_permute_grad, case.notes)):
        case.providers["compile"] = lambda: fn(grad, sorted_indices, k)
    return case


def _moe_token_unpermute_grad(shape, dtype, device, peers) -> Case:
    t, k, h = shape["T"], shape["K"], shape["H"]
    s = torch.finfo(dtype).bits // 8
    permuted = torch.randn(t * k, h, dtype=dtype, device=device)
    grad = torch.randn(t, h, dtype=dtype, device=device)
    sorted_indices = torch.randperm(t * k, device=device).to(torch.int32)
    probs = torch.rand(t, k, dtype=dtype, device=device)
    outs = (torch.empty_like(permuted), torch.empty_like(probs))
    # The eager twin: autograd of the unpermute written in torch ops (gather the K copies of each token, weight,
    # sum), the graph built once and its backward replayed; index_select's backward is an index_add_ into zeros.
    p_leaf, w_leaf = permuted.clone().requires_grad_(), probs.clone().requires_grad_()
    picked = p_leaf.index_select(0, sorted_indices.long()).view(t, k, h)
    merged = (picked * w_leaf.unsqueeze(-1)).sum(1)
    nbytes = 2 * t * k * h * s + t * h * s + 4 * t * k + 2 * t * k * s
    case = Case("moe_token_unpermute_grad", shape, dtype, nbytes, t * k * h)
    case.providers["gradops"] = lambda: gradops.moe_token_unpermute_grad(permuted, grad, sorted_indices, probs)
    case.providers["gradops out="] = lambda: gradops.moe_token_unpermute_grad(permuted, grad, sorted_indices, probs,
                                                                              out=outs)
    case.providers["eager"] = lambda: torch.autograd.grad(merged, (p_leaf, w_leaf), grad, retain_graph=True)
    if "compile" in peers and (fn := _compiled(reference.moe_token_unpermute_grad, case.notes)):
        case.providers["compile"] = lambda: fn(permuted, grad, sorted_indices, probs)
    return case


#: What each case's ``eager`` provider runs: the kernel or PyTorch code the gradops function replaces.
EAGER = {
    "rms_norm_grad": "autograd of F.rms_norm", "layer_norm_backward": "aten.native_layer_norm_backward",
    "layer_norm_grad+beta": "aten.native_layer_norm_backward", "hardswish_backward": "aten.hardswish_backward",
    "embedding_dense_backward": "aten.embedding_dense_backward",
    "moe_token_permute_grad": "index_add_ into zeros (Megatron)",
    "moe_token_unpermute_grad": "autograd of index_select, weight, sum",
}

#: One builder per ``gradops bench`` case, named as :data:`gradops.registry.BENCH` names them.
BUILDERS = {
    "rms_norm_grad": _rms_norm_grad, "layer_norm_backward": _layer_norm_backward,
    "layer_norm_grad+beta": _layer_norm_grad_beta, "hardswish_backward": _hardswish_backward,
    "embedding_dense_backward": _embedding_dense_backward, "moe_token_permute_grad": _moe_token_permute_grad,
    "moe_token_unpermute_grad": _moe_token_unpermute_grad,
}


def _without_pool(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with the CPU output pool switched off for the duration of the call (fresh memory every time)."""
    def call():
        old = os.environ.get(POOL_ENV)
        os.environ[POOL_ENV] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[POOL_ENV]
            else:
                os.environ[POOL_ENV] = old
    return call


def build(op: str, shape: dict, dtype: torch.dtype, device: torch.device, peers: set[str]) -> Case:
    """The case with its providers, plus ``copy_`` on a tensor as large as the op's largest one."""
    case = BUILDERS[op](shape, dtype, device, peers)
    if device.type == "cpu":
        fresh = {"gradops fresh": _without_pool(case.providers["gradops"])}
        names = list(case.providers)
        at = names.index("gradops") + 1
        case.providers = {n: case.providers[n] for n in names[:at]} | fresh | {n: case.providers[n] for n in names[at:]}
    src = torch.randn(case.copy_numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    case.providers["copy_"] = lambda: dst.copy_(src)
    return case
