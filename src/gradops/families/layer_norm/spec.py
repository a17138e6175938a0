"""LayerNorm, its fused backward (aclnnLayerNormBackward) and CANN's pair LayerNormGrad + LayerNormGradBeta
(AscendC): their declarations (see :mod:`gradops.spec`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...spec import Bench, Example, Golden, OpSpec, Timed, autograd, optional, provided, rows_shardable
from . import contract, reference

EPS = 1e-5
aten = torch.ops.aten


def _example(op):
    def example(m, n, dtype, device, gen):
        def rnd(*shape, scale=1.0):
            return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

        x, g, b, dy = rnd(m, n, scale=2.0), rnd(n), rnd(n), rnd(m, n)
        xf = x.float()
        mean, var = xf.mean(-1), (xf - xf.mean(-1, keepdim=True)).square().mean(-1)
        res = ((xf - mean[:, None]) * torch.rsqrt(var[:, None] + EPS)).to(dtype)

        def grads(*_):
            return autograd(lambda x, g, b: F.layer_norm(x, (n,), g, b, EPS), (x, g, b), dy)
        if op == "layer_norm":
            return Example((x, g, b, EPS), (n, n, n), lambda x, g, b, e: (F.layer_norm(x, (n,), g, b, e), mean, var),
                           kernel=lambda x, g, b, e: torch.native_layer_norm(x, [n], g, b, e))
        if op == "layer_norm_grad":
            return Example((dy, x, var, mean, g, EPS), (n, 1), lambda *a: (grads()[0], res))
        if op == "layer_norm_backward":
            return Example((dy, x, mean, torch.rsqrt(var + EPS), g), (n, m, m), grads,
                           kernel=lambda dy, x, mean, rstd, g: aten.native_layer_norm_backward(
                               dy, x, [n], mean[:, None], rstd[:, None], g, b, [True, True, True]))
        return Example((res, dy), (m, m), lambda res, dy: ((dy * res).sum(0), dy.sum(0)))
    return example


def _golden_inputs(op):
    def inputs(shape, dtype, draw, opts):
        draw.rows_by_h(op, shape)
        h = shape[-1]
        x, gamma, beta, dy = draw.normal(*shape, scale=2.0), draw.weight(h), draw.weight(h), draw.normal(*shape)
        eps = float(opts.get("epsilon", EPS))
        x64 = x.double()
        mean, var = x64.mean(-1), x64.var(-1, unbiased=False)
        stat = torch.float32 if opts.get("stat_dtype", "float32") == "float32" else dtype
        if op == "layer_norm":
            return {"x": x, "gamma": gamma, "beta": beta, "epsilon": eps}
        if op == "layer_norm_grad":
            return {"dy": dy, "x": x, "variance": var.to(stat), "mean": mean.to(stat), "gamma": gamma, "epsilon": eps}
        if op == "layer_norm_backward":
            return {"dy": dy, "x": x, "mean": mean.float(), "rstd": torch.rsqrt(var + eps).float(), "gamma": gamma}
        res = ((x64 - mean[..., None]) * torch.rsqrt(var[..., None] + eps)).to(dtype)
        return {"res_for_gamma": res, "dy": dy}
    return inputs


def _layer_norm_peer(args):
    x, gamma, beta, eps = args
    return {0: (F.layer_norm(x, gamma.shape, gamma, beta, eps), "torch.nn.functional.layer_norm")}


def _backward_peer(op):
    def peer(args):
        if op == "layer_norm_backward":
            dy, x, mean, rstd, gamma = args
            src = "aten.native_layer_norm_backward"
        else:  # AscendC LayerNormGrad's pd_x: ATen's backward on rstd = rsqrt(variance + eps) in float32
            dy, x, var, mean, gamma, eps = args
            rstd = torch.rsqrt(var.float() + eps)
            src = "aten.native_layer_norm_backward (rstd = rsqrt(variance + epsilon) in float32)"
        stat, w = (*x.shape[:-1], 1), gamma.float()  # float32 weight: dgamma/dbeta in float32, CANN's dtype
        # the bias is only read for its presence (dbeta's shape); ATen refuses None beside an output mask
        full = op == "layer_norm_backward"
        outs = aten.native_layer_norm_backward(dy, x, [x.shape[-1]], mean.float().reshape(stat),
                                               rstd.float().reshape(stat), w, torch.zeros_like(w), [True, full, full])
        return {i: (outs[i], src) for i in range(3 if full else 1)}
    return peer


def _inputs(shape, dtype, device):
    m, n = shape["M"], shape["N"]
    x, dy = torch.randn(m, n, dtype=dtype, device=device), torch.randn(m, n, dtype=dtype, device=device)
    gamma, beta = torch.randn(n, dtype=dtype, device=device), torch.randn(n, dtype=dtype, device=device)
    mean = x.float().mean(-1)
    var = (x.float() - mean[:, None]).square().mean(-1)
    return x, dy, gamma, beta, mean, var, torch.rsqrt(var + EPS)


def _peers(x, dy, gamma, beta, mean, rstd, device):
    """ATen's fused backward (on the statistics torch itself keeps), the compiled reference and Liger's."""
    n = x.shape[-1]
    _, mean2, rstd2 = aten.native_layer_norm(x, [n], gamma, beta, EPS)
    eager = lambda: aten.native_layer_norm_backward(dy, x, [n], mean2, rstd2, gamma, beta, [True, True, True])  # noqa: E731
    liger = optional("liger_kernel.ops.layer_norm", "LigerLayerNormFunction") if device.type == "cuda" else None
    liger_run = None
    if liger is not None:
        xr, gr, br = (t.detach().requires_grad_() for t in (x, gamma, beta))
        with torch.enable_grad():
            ly = liger.apply(xr, gr, br, EPS)
        liger_run = lambda: torch.autograd.grad(ly, (xr, gr, br), dy, retain_graph=True)  # noqa: E731
    return eager, (reference.layer_norm_backward, (dy, x, mean, rstd, gamma)), liger_run


def _prepare_backward(shape, dtype, device):
    x, dy, gamma, beta, mean, _, rstd = _inputs(shape, dtype, device)
    return Timed((dy, x, mean, rstd, gamma), *_peers(x, dy, gamma, beta, mean, rstd, device))


def _prepare_pair(shape, dtype, device):
    x, dy, gamma, beta, mean, var, rstd = _inputs(shape, dtype, device)
    return Timed((dy, x, var, mean, gamma, EPS), *_peers(x, dy, gamma, beta, mean, rstd, device))


def _pair(gradops, dy, x, variance, mean, gamma, epsilon, *, out=None):
    """CANN's pair as a training step runs it: LayerNormGrad, then LayerNormGradBeta on its resForGamma."""
    if out is None:
        pd_x, res = gradops.layer_norm_grad(dy, x, variance, mean, gamma, epsilon)
        return (pd_x, res, *gradops.layer_norm_grad_beta(res, dy))
    gradops.layer_norm_grad(dy, x, variance, mean, gamma, epsilon, out=out[:2])
    gradops.layer_norm_grad_beta(out[1], dy, out=out[2:])
    return out


_SHAPES = {
    "cpu": [{"M": 8192, "N": 4096}],
    "cuda": [{"M": m, "N": n} for m, n in ((4096, 2048), (16384, 4096), (16384, 8192), (65536, 4096), (16384, 16384),
                                            (4096, 65536))],
    "quick": [{"M": 256, "N": 512}], "gpu-check": [{"M": 16384, "N": 4096}], "dry": [{"M": 8, "N": 64}],
}


def _sizes(rows, cols, vocab, top_k):
    return {"M": rows, "N": cols}


def _rows(s):
    return s["M"] * s["N"]


BACKWARD = Bench("layer_norm_backward", _SHAPES, _sizes, _prepare_backward,
                 lambda s, e: s["M"] * s["N"] * 3 * e + 8 * s["M"] + s["N"] * (e + 8), _rows,
                 "aten.native_layer_norm_backward")
PAIR = Bench("layer_norm_grad+beta", {**_SHAPES, "cuda": [{"M": 16384, "N": 4096}, {"M": 65536, "N": 8192}]}, _sizes,
             _prepare_pair,
             lambda s, e: ((s["M"] * s["N"] * 4 * e + 8 * s["M"] + s["N"] * e)  # LayerNormGrad
                           + (s["M"] * s["N"] * 2 * e + 2 * s["N"] * e)),  # LayerNormGradBeta
             _rows, "aten.native_layer_norm_backward", run=_pair)


def _layer_norm_rule(R, P, Shard):
    def rule(x, gamma, beta, epsilon):
        return [([R, R, R], [R, R, R, None])] + [([Shard(d)] * 3, [Shard(d), R, R, None])
                                                for d in range(x.ndim - gamma.ndim)]
    return rule


def _backward_rule(R, P, Shard):
    def rule(dy, x, mean, rstd, gamma):
        return [([R, R, R], [R] * 5)] + [([Shard(d), P, P], [Shard(d)] * 4 + [R])
                                        for d in rows_shardable(x, mean, gamma.ndim)]
    return rule


def _grad_rule(R, P, Shard):
    def rule(dy, x, variance, mean, gamma, epsilon):
        return [([R, R], [R] * 5 + [None])] + [([Shard(d), Shard(d)], [Shard(d)] * 4 + [R, None])
                                              for d in rows_shardable(x, variance, gamma.ndim)]
    return rule


def _grad_beta_rule(R, P, Shard):
    def rule(res_for_gamma, dy):
        return [([R, R], [R, R])] + [([P, P], [Shard(d), Shard(d)]) for d in range(dy.ndim - 1)]
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
    OpSpec("layer_norm", "AscendC LayerNorm", False, example=_example("layer_norm"),
           golden=Golden(("y", "mean", "variance"), ("epsilon", "gamma_dtype"), _golden_inputs("layer_norm"),
                         peer=_layer_norm_peer),
           sharding=_layer_norm_rule, node=True,
           check=contract.check_layer_norm, results=contract.layer_norm_results,
           providers=provided(_BACKENDS, lambda m: m.LAYER_NORM)),
    OpSpec("layer_norm_grad", "AscendC LayerNormGrad", True, example=_example("layer_norm_grad"),
           golden=Golden(("pd_x", "res_for_gamma"), ("epsilon", "stat_dtype", "gamma_dtype"),
                         _golden_inputs("layer_norm_grad"), peer=_backward_peer("layer_norm_grad")),
           timing=PAIR, sharding=_grad_rule,
           check=contract.check_layer_norm_grad, results=contract.layer_norm_grad_results,
           providers=provided(_BACKENDS, lambda m: m.LAYER_NORM_GRAD)),
    OpSpec("layer_norm_grad_beta", "AscendC LayerNormGradBeta", True, example=_example("layer_norm_grad_beta"),
           golden=Golden(("pd_gamma", "pd_beta"), ("epsilon",), _golden_inputs("layer_norm_grad_beta")),
           timing=PAIR, sharding=_grad_beta_rule,
           check=contract.check_layer_norm_grad_beta, results=contract.layer_norm_grad_beta_results,
           providers=provided(_BACKENDS, lambda m: m.LAYER_NORM_GRAD_BETA)),
    OpSpec("layer_norm_backward", "aclnnLayerNormBackward", True, example=_example("layer_norm_backward"),
           golden=Golden(("dx", "dgamma", "dbeta"), ("epsilon", "gamma_dtype"), _golden_inputs("layer_norm_backward"),
                         peer=_backward_peer("layer_norm_backward")),
           timing=BACKWARD, sharding=_backward_rule,
           check=contract.check_layer_norm_backward, results=contract.layer_norm_backward_results,
           providers=provided(_BACKENDS, lambda m: m.LAYER_NORM_BACKWARD)),
)
LAYER_NORM, LAYER_NORM_GRAD, LAYER_NORM_GRAD_BETA, LAYER_NORM_BACKWARD = SPECS
