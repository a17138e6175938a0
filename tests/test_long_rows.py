"""Row statistics on the C++ kernels as accurate as ATen's at every length, and a constant row normalised to
exactly beta (issue: the mean as ``sum * (1/N)`` and 16 in-order float32 lanes).

The float64 references are written here; the bounds are what one float32 rounding of the statistic leaves (2^-24
relative, ~6e-8) with a margin of 4: the in-order lanes missed them by 20-100x at N = 2^20."""

from __future__ import annotations

import pytest
import torch

import gradops

LENGTHS = [7, 100, 256, 257, 1000, 4096, 65536, 1 << 20]
#: One float32 rounding of a statistic (2^-24) and the partial sums' error around it: 4 · 2^-24.
BOUND = 4 * 2.0**-24


@pytest.mark.parametrize("n", LENGTHS)
def test_rms_norm_rstd_is_as_accurate_as_one_rounding(backend, n):
    x = torch.randn(3, n) + 3.0  # an offset: every square adds the same sign, the hard case for a running sum
    _, rstd = gradops.rms_norm(x, torch.ones(n), epsilon=1e-6)
    ref = (x.double().square().mean(1) + 1e-6).rsqrt()
    assert (rstd.double().view(-1) / ref - 1).abs().max().item() < BOUND


@pytest.mark.parametrize("n", LENGTHS)
def test_layer_norm_mean_and_variance_are_as_accurate_as_one_rounding(backend, n):
    x = torch.randn(3, n) + 3.0
    _, mean, var = gradops.layer_norm(x, torch.ones(n), torch.zeros(n), 1e-5)
    mref, vref = x.double().mean(1), x.double().var(1, unbiased=False)
    assert ((mean.double() - mref) / mref).abs().max().item() < BOUND
    assert ((var.double() - vref) / vref).abs().max().item() < BOUND


@pytest.mark.parametrize("n", LENGTHS)
def test_rms_norm_grad_row_sums_stay_accurate(backend, n):
    # dx = (dy·g - x·rstd·c)·rstd with c a row sum: the in-order lanes' sum error at N = 2^20 (~2e-6) reaches dx as
    # ~7e-7 of its largest value, where dx's own float32 arithmetic leaves ~1e-7: BOUND tells them apart.
    x, dy = torch.randn(2, n) + 3.0, torch.randn(2, n) + 1.0
    gamma = torch.rand(n) + 0.5
    rstd = (x.double().square().mean(1, keepdim=True) + 1e-6).rsqrt().float()
    dx, _ = gradops.rms_norm_grad(dy, x, rstd, gamma)
    xd, dyd, gd, sd = x.double(), dy.double(), gamma.double(), rstd.double()
    c = (dyd * gd * xd).mean(1, keepdim=True) * sd
    ref = (dyd * gd - xd * sd * c) * sd
    assert ((dx.double() - ref).abs().max() / ref.abs().max()).item() < BOUND


@pytest.mark.parametrize("n", [3, 7, 100, 1000, 12345])
@pytest.mark.parametrize("value", [0.1, 1.7, -3.3, 1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_constant_row_normalises_to_beta(backend, n, value, dtype):
    x = torch.full((2, n), value).to(dtype)
    gamma, beta = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    y, mean, var = gradops.layer_norm(x, gamma, beta, 1e-12)
    assert torch.equal(y, beta.expand(2, n)), (y.float() - beta.float()).abs().max()
    assert torch.equal(mean, x[:, 0].float()) and not var.any()


@pytest.mark.parametrize("hidden", [100, 512, 513, 65536])
def test_unpermute_grad_probs_dot_products_stay_accurate(backend, hidden):
    t, k = 2, 2
    permuted = torch.randn(t * k, hidden) + 2.0
    grad = torch.randn(t, hidden) + 2.0
    order = torch.randperm(t * k).to(torch.int32)
    probs = torch.rand(t, k)
    _, dprobs = gradops.moe_token_unpermute_grad(permuted, grad, order, probs)
    rows = permuted.double()[order.long()].view(t, k, hidden)
    ref = (rows * grad.double()[:, None, :]).sum(-1)
    assert ((dprobs.double() - ref) / ref).abs().max().item() < BOUND
