"""Forward/backward consistency: autograd through an independent float64 forward equals gradops' backward op,
and the differentiable gradops forwards route their gradients through those ops."""

from __future__ import annotations

import pytest
import torch

import gradops
from oracles import tolerance

F64 = torch.float64


def _close(got, ref, n):
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got.double() - ref).abs().max()) if ref.numel() else 0.0
    assert err <= tolerance(got.dtype, n, scale), f"error {err:.3e} (scale {scale:.3e})"


def test_rms_norm_grad_is_autograd_of_forward(backend):
    x = torch.randn(6, 3, 10)
    gamma = torch.randn(3, 10)
    dy = torch.randn(6, 3, 10)
    x64 = x.double().requires_grad_()
    g64 = gamma.double().requires_grad_()
    rstd = torch.rsqrt(x64.square().mean(dim=(1, 2), keepdim=True) + 1e-6)
    (x64 * rstd * g64).backward(dy.double())
    # gradops' backward takes rstd as a given input; autograd also differentiates through rstd(x): same thing.
    dx, dgamma = gradops.rms_norm_grad(dy, x, rstd.detach().float().view(6), gamma)
    _close(dx, x64.grad, 30)
    _close(dgamma, g64.grad, 6)


def test_layer_norm_backward_is_autograd_of_forward(backend):
    x, gamma, dy = torch.randn(7, 24) * 3 + 1, torch.randn(24), torch.randn(7, 24)
    x64, g64 = x.double().requires_grad_(), gamma.double().requires_grad_()
    b64 = torch.zeros(24, dtype=F64, requires_grad=True)
    torch.nn.functional.layer_norm(x64, (24,), g64, b64, 1e-5).backward(dy.double())
    mean = x.mean(-1)
    var = x.var(-1, unbiased=False)
    pdx, res = gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5)
    pd_gamma, pd_beta = gradops.layer_norm_grad_beta(res, dy)
    _close(pdx, x64.grad, 24)
    _close(pd_gamma, g64.grad, 7)
    _close(pd_beta, b64.grad, 7)
    dx, dg, db = gradops.layer_norm_backward(dy, x, mean, torch.rsqrt(var + 1e-5), gamma)
    _close(dx, x64.grad, 24)
    _close(dg, g64.grad, 7)
    _close(db, b64.grad, 7)


def test_hardswish_backward_is_autograd_of_forward_off_the_kinks(backend):
    x = torch.empty(1000).uniform_(-6, 6)
    x = x[(x.abs() - 3).abs() > 1e-3]
    x64 = x.double().requires_grad_()
    (x64 * torch.clamp(x64 + 3, 0, 6) / 6).sum().backward()
    _close(gradops.hardswish_backward(torch.ones_like(x), x), x64.grad, 1)


def test_embedding_backward_is_autograd_of_lookup(backend):
    weight = torch.randn(9, 5, dtype=F64, requires_grad=True)
    idx = torch.randint(0, 9, (4, 6))
    grad = torch.randn(4, 6, 5)
    torch.nn.functional.embedding(idx, weight).backward(grad.double())
    _close(gradops.embedding_dense_backward(grad, idx, 9), weight.grad, 24)


def test_moe_permute_grad_is_autograd_of_permute(backend):
    tokens = torch.randn(10, 6)
    experts = torch.randint(0, 4, (10, 3))
    t64 = tokens.double().requires_grad_()
    order = torch.argsort(experts.flatten(), stable=True)
    permuted = t64[order // 3]
    grad = torch.randn_like(permuted.detach()).float()
    permuted.backward(grad.double())
    _, sorted_indices = gradops.moe_token_permute(tokens, experts)
    _close(gradops.moe_token_permute_grad(grad, sorted_indices, 3), t64.grad, 3)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "hardswish", "moe_token_permute"])
def test_forwards_are_differentiable(op, backend):
    x = torch.randn(5, 8, requires_grad=True)
    gamma = torch.randn(8, requires_grad=True)
    beta = torch.randn(8, requires_grad=True)
    if op == "rms_norm":
        y, _ = gradops.rms_norm(x, gamma)
        ref = torch.nn.functional.rms_norm(x, (8,), gamma, 1e-6)
        params = (x, gamma)
    elif op == "layer_norm":
        y, _, _ = gradops.layer_norm(x, gamma, beta)
        ref = torch.nn.functional.layer_norm(x, (8,), gamma, beta, 1e-5)
        params = (x, gamma, beta)
    elif op == "hardswish":
        y = gradops.hardswish(x)
        ref = torch.nn.functional.hardswish(x)
        params = (x,)
    else:
        experts = torch.randint(0, 3, (5, 2))
        y, _ = gradops.moe_token_permute(x, experts)
        ref = x[torch.argsort(experts.flatten(), stable=True) // 2]
        params = (x,)
    w = torch.randn_like(ref)
    ours = torch.autograd.grad((y * w).sum(), params)
    theirs = torch.autograd.grad((ref * w).sum(), params)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_statistic_outputs_carry_gradient(backend):
    """rstd, mean and variance are outputs too: gradients through them reach x (float64 finite differences
    are not available to our float32-only ops, so compare with torch autograd of the same math)."""
    x = torch.randn(4, 6, requires_grad=True)
    gamma = torch.randn(6)
    _, rstd = gradops.rms_norm(x, gamma)
    (gx,) = torch.autograd.grad(rstd.sum(), x)
    (rx,) = torch.autograd.grad(torch.rsqrt(x.square().mean(-1) + 1e-6).sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    _, mean, var = gradops.layer_norm(x, gamma, torch.zeros(6))
    (gx,) = torch.autograd.grad((mean * 2 + var * 3).sum(), x)
    (rx,) = torch.autograd.grad((x.mean(-1) * 2 + x.var(-1, unbiased=False) * 3).sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
