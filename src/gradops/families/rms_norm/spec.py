"""RmsNorm and RmsNormGrad (aclnnRmsNorm / aclnnRmsNormGrad): their declarations (see :mod:`gradops.spec`)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ...spec import Bench, Example, Golden, OpSpec, Timed, autograd, optional, provided, rows_shardable
from . import contract, reference

EPS = 1e-6


def _rstd(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    return torch.rsqrt(x.float().square().mean(-1) + eps)


def _rms_norm_example(m, n, dtype, device, gen):
    x, gamma = (torch.randn(m, n, generator=gen).to(dtype).to(device), torch.randn(n, generator=gen).to(dtype)
                .to(device))
    return Example((x, gamma, EPS), (n, n), lambda x, g, e: (F.rms_norm(x, (n,), g, e), _rstd(x, e)),
                   kernel=lambda x, g, e: torch.rms_norm(x, [n], g, e))


def _rms_norm_grad_example(m, n, dtype, device, gen):
    dy, x = (torch.randn(m, n, generator=gen).to(dtype).to(device) for _ in range(2))
    gamma = torch.randn(n, generator=gen).to(dtype).to(device)
    return Example((dy, x, _rstd(x), gamma), (n, m),
                   lambda dy, x, r, g: autograd(lambda x, g: F.rms_norm(x, (n,), g, EPS), (x, g), dy))


def _golden_inputs(op):
    def inputs(shape, dtype, draw, opts):
        draw.rows_by_h(op, shape)
        x, gamma = draw.normal(*shape), draw.weight(shape[-1])
        if op == "rms_norm":
            return {"x": x, "gamma": gamma, "epsilon": float(opts.get("epsilon", EPS))}
        rstd = torch.rsqrt(x.double().square().mean(-1, keepdim=True) + EPS).float()
        if opts.get("rstd_form", "keepdim") == "flat":
            rstd = rstd.reshape(shape[:-1])
        return {"dy": draw.normal(*shape), "x": x, "rstd": rstd, "gamma": gamma}
    return inputs


def _rms_norm_peer(args):
    x, gamma, eps = args
    return {0: (F.rms_norm(x, gamma.shape, gamma, eps), "torch.nn.functional.rms_norm")}


def _rms_norm_grad_peer(args):
    # PyTorch's rms_norm backward recomputes rstd from x (eps 1e-6, the eps of the case's rstd); gamma in float32 so
    # that dgamma comes out in float32, CANN's dgamma dtype, as PyTorch computes a float32 weight's.
    dy, x, _, gamma = args
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Mismatch dtype between input and weight": the unfused path, wanted
        dx, dgamma = autograd(lambda x, g: F.rms_norm(x, g.shape, g, EPS), (x, gamma.float()), dy)
    src = "torch.autograd of torch.nn.functional.rms_norm (rstd recomputed, eps 1e-6; float32 weight)"
    return {0: (dx, src), 1: (dgamma, src)}


def _prepare(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    x, dy = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
    gamma = torch.randn(n, dtype=dtype, device=device)
    rstd = _rstd(x)
    xr, gr = x.detach().requires_grad_(), gamma.detach().requires_grad_()
    with torch.enable_grad():
        y = F.rms_norm(xr, (n,), gr, EPS)
    liger = optional("liger_kernel.ops.rms_norm", "LigerRMSNormFunction") if device.type == "cuda" else None
    liger_run = None
    if liger is not None:
        # offset 0, Llama's casting, and in_place=False: Liger's default writes dx into dy, the input every other
        # provider of the case reads
        with torch.enable_grad():
            ly = liger.apply(xr, gr, EPS, 0.0, "llama", False)
        liger_run = lambda: torch.autograd.grad(ly, (xr, gr), dy, retain_graph=True)  # noqa: E731
    return Timed((dy, x, rstd, gamma), lambda: torch.autograd.grad(y, (xr, gr), dy, retain_graph=True),
                 (reference.rms_norm_grad, (dy, x, rstd, gamma)), liger_run)


BENCH = Bench(
    "rms_norm_grad",
    shapes={
        "cpu": [{"M": 8192, "N": 4096}],
        "cuda": [{"M": m, "N": n} for m, n in ((4096, 2048), (16384, 4096), (16384, 8192), (65536, 4096),
                                                (16384, 16384), (4096, 65536))],
        "quick": [{"M": 256, "N": 512}], "gpu-check": [{"M": 16384, "N": 4096}], "dry": [{"M": 8, "N": 64}],
    },
    sizes=lambda rows, cols, vocab, top_k: {"M": rows, "N": cols},
    prepare=_prepare,
    nbytes=lambda s, e: s["M"] * s["N"] * 3 * e + 4 * s["M"] + s["N"] * (e + 4),
    copy_numel=lambda s: s["M"] * s["N"],
    eager_name="autograd of F.rms_norm",
)


def _rms_norm_rule(R, P, Shard):
    def rule(x, gamma, epsilon):
        return [([R, R], [R, R, None])] + [([Shard(d), Shard(d)], [Shard(d), R, None])
                                          for d in range(x.ndim - gamma.ndim)]
    return rule


def _rms_norm_grad_rule(R, P, Shard):
    def rule(dy, x, rstd, gamma):
        return [([R, R], [R, R, R, R])] + [([Shard(d), P], [Shard(d), Shard(d), Shard(d), R])
                                          for d in rows_shardable(x, rstd, gamma.ndim)]
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
    OpSpec("rms_norm", "aclnnRmsNorm", False, example=_rms_norm_example,
           golden=Golden(("y", "rstd"), ("epsilon", "gamma_dtype"), _golden_inputs("rms_norm"), peer=_rms_norm_peer),
           sharding=_rms_norm_rule, check=contract.check_rms_norm, results=contract.rms_norm_results,
           providers=provided(_BACKENDS, lambda m: m.RMS_NORM)),
    OpSpec("rms_norm_grad", "aclnnRmsNormGrad", True, example=_rms_norm_grad_example,
           golden=Golden(("dx", "dgamma"), ("rstd_form", "gamma_dtype"), _golden_inputs("rms_norm_grad"),
                         peer=_rms_norm_grad_peer),
           timing=BENCH, sharding=_rms_norm_grad_rule, check=contract.check_rms_norm_grad,
           results=contract.rms_norm_grad_results, providers=provided(_BACKENDS, lambda m: m.RMS_NORM_GRAD)),
)
RMS_NORM, RMS_NORM_GRAD = SPECS
