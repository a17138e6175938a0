"""SwiGlu and SwiGluGrad (aclnnSwiGlu / aclnnSwiGluGrad): their declarations (see :mod:`gradops.spec`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...spec import Bench, Example, Golden, OpSpec, Timed, autograd, optional, provided
from . import contract, reference


def _silu_mul(x: torch.Tensor) -> torch.Tensor:
    """PyTorch's SwiGLU on x's last dim: ``silu(A) * B``."""
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


def _swiglu_example(m, n, dtype, device, gen):
    x = torch.randn(m, 2 * n, generator=gen).to(dtype).to(device)
    return Example((x, -1), (1,), lambda x, dim: (_silu_mul(x),))


def _swiglu_grad_example(m, n, dtype, device, gen):
    x = torch.randn(m, 2 * n, generator=gen).to(dtype).to(device)
    g = torch.randn(m, n, generator=gen).to(dtype).to(device)
    return Example((g, x, -1), (1,), lambda g, x, dim: autograd(_silu_mul, (x,), g))


def _golden_inputs(op):
    def inputs(shape, dtype, draw, opts):
        if shape[-1] % 2:
            draw.fail(f"{op}: --shape's last size is split in two halves (dim -1): it must be even, got {shape[-1]}")
        x = draw.normal(*shape, scale=2.0)  # sigmoid's curved range, both signs
        if op == "swiglu":
            return {"x": x, "dim": -1}
        return {"y_grad": draw.normal(*shape[:-1], shape[-1] // 2), "x": x, "dim": -1}
    return inputs


def _oracle(op):
    """The golden outputs: the reference in float64 on x's (rows, 2·cols) view (the golden's 2-D views are rows x H,
    which y_grad's halved last dim does not fit)."""
    def oracle(ref_args, args, like):
        x = args[1] if op == "swiglu_grad" else args[0]
        x64 = x.double().reshape(-1, x.shape[-1])
        if op == "swiglu":
            return (reference.swiglu(x64, -1, torch.float64),)
        g64 = args[0].double().reshape(-1, x.shape[-1] // 2)
        return (reference.swiglu_grad(g64, x64, -1, torch.float64),)
    return oracle


def _swiglu_peer(args):
    return {0: (_silu_mul(args[0]), "torch.nn.functional.silu(A) * B")}


def _swiglu_grad_peer(args):
    g, x, _ = args
    return {0: (autograd(_silu_mul, (x,), g)[0], "torch.autograd of torch.nn.functional.silu(A) * B")}


def _prepare(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    x = (torch.randn(m, 2 * n, device=device) * 2).to(dtype)
    g = torch.randn(m, n, dtype=dtype, device=device)
    xr = x.detach().requires_grad_()
    with torch.enable_grad():
        y = _silu_mul(xr)
    liger = optional("liger_kernel.ops.swiglu", "LigerSiLUMulFunction") if device.type == "cuda" else None
    liger_run = None
    if liger is not None:  # Liger takes A and B as two tensors (an MLP's gate and up projections)
        a, b = (t.contiguous().requires_grad_() for t in x.chunk(2, dim=-1))
        with torch.enable_grad():
            ly = liger.apply(a, b)
        liger_run = lambda: torch.autograd.grad(ly, (a, b), g, retain_graph=True)  # noqa: E731
    return Timed((g, x, -1), lambda: torch.autograd.grad(y, (xr,), g, retain_graph=True),
                 (reference.swiglu_grad, (g, x, -1)), liger_run)


BENCH = Bench(
    "swiglu_grad",
    shapes={
        "cpu": [{"M": 4096, "N": 4096}],
        "cuda": [{"M": m, "N": n} for m, n in ((4096, 11008), (16384, 14336), (16384, 4096))],
        "quick": [{"M": 256, "N": 512}], "gpu-check": [{"M": 16384, "N": 14336}], "dry": [{"M": 8, "N": 64}],
    },
    sizes=lambda rows, cols, vocab, top_k: {"M": rows, "N": cols},
    prepare=_prepare,
    nbytes=lambda s, e: 5 * s["M"] * s["N"] * e,
    copy_numel=lambda s: 2 * s["M"] * s["N"],
    eager_name="autograd of F.silu(A) * B",
)


def _rule(R, P, Shard):
    def rule(x, dim):
        d = dim % x.ndim
        return [([R], [R, None])] + [([Shard(k)], [Shard(k), None]) for k in range(x.ndim) if k != d]
    return rule


def _grad_rule(R, P, Shard):
    def rule(y_grad, x, dim):
        d = dim % x.ndim
        return [([R], [R, R, None])] + [([Shard(k)], [Shard(k), Shard(k), None]) for k in range(x.ndim) if k != d]
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
    OpSpec("swiglu", "aclnnSwiGlu", False, example=_swiglu_example,
           golden=Golden(("out",), (), _golden_inputs("swiglu"), _oracle("swiglu"), _swiglu_peer, views=False),
           sharding=_rule, check=contract.check_swiglu, results=contract.swiglu_results,
           providers=provided(_BACKENDS, lambda m: m.SWIGLU)),
    OpSpec("swiglu_grad", "aclnnSwiGluGrad", True, example=_swiglu_grad_example,
           golden=Golden(("out",), (), _golden_inputs("swiglu_grad"), _oracle("swiglu_grad"), _swiglu_grad_peer,
                         views=False),
           timing=BENCH, sharding=_grad_rule, cann_args={"y_grad": "yGrad"}, check=contract.check_swiglu_grad,
           results=contract.swiglu_grad_results, providers=provided(_BACKENDS, lambda m: m.SWIGLU_GRAD)),
)
SWIGLU, SWIGLU_GRAD = SPECS
