"""The five seed documents' examples, with the values their contracts (or semantics.md) give."""

from __future__ import annotations

import torch

import gradops


def test_rms_norm_grad_seed_example(backend):
    # x = dy = 1..32 as (2, 1, 16), gamma = 1..16, rstd = [1, 2] (deliberately not derived from x).
    x = torch.arange(1, 33, dtype=torch.float32).view(2, 1, 16)
    gamma = torch.arange(1, 17, dtype=torch.float32)
    dx, dgamma = gradops.rms_norm_grad(x, x, torch.tensor([1.0, 2.0]), gamma)
    assert dx[0, 0, :4].tolist() == [-1155, -2308, -3459, -4608]
    assert dx[1, 0, :4].tolist() == [-860030, -910584, -961134, -1011680]
    assert dgamma[:4].tolist() == [579, 652, 731, 816]
    assert dgamma.dtype == torch.float32 and dx.shape == (2, 1, 16)


def test_hardswish_backward_seed_example(backend):
    s = torch.arange(8, dtype=torch.float32).view(4, 2)
    out = gradops.hardswish_backward(s, s).flatten()
    # 4.5 at x = 3: CANN's closed interval (PyTorch >= 2.8 gives 3.0 there).
    expected = torch.tensor([0, 0.8333333, 2.3333335, 4.5, 4, 5, 6, 7])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)
    assert out[3].item() == 4.5


def test_hardswish_backward_boundaries_are_closed(backend):
    x = torch.tensor([-3.0, 3.0, -3.0000002, 3.0000002])
    out = gradops.hardswish_backward(torch.ones(4), x)
    assert out.tolist() == [-0.5, 1.5, 0.0, 1.0]


def test_hardswish_backward_nan_passes_the_gradient(backend):
    # semantics.md leaves NaN open; gradops follows CANN's 950 kernel: both range tests fail, so out = grad.
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    out = gradops.hardswish_backward(torch.full((4,), 2.0), x)
    assert out[:3].tolist() == [2.0, 2.0, 0.0]  # NaN and +inf pass the gradient, -inf gives 0
    assert abs(out[3].item() - 2.0 * (1.0 / 3.0 + 0.5)) < 1e-6


def test_embedding_dense_backward_seed_example(backend):
    grad = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    out = gradops.embedding_dense_backward(grad, torch.tensor([1, 2]), 4, 0, False)
    assert out.tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 6], [0, 0, 0]]


def test_moe_token_permute_grad_seed_example(backend):
    out = gradops.moe_token_permute_grad(torch.tensor([[1.0, 2], [3, 4]]), torch.tensor([0, 1], dtype=torch.int32), 2)
    assert out.tolist() == [[4, 6]] and out.shape == (1, 2)


def test_moe_convention_is_cann_inverse_permutation(backend):
    g = torch.tensor([[1.0], [10.0], [100.0], [1000.0]])
    out = gradops.moe_token_permute_grad(g, torch.tensor([2, 0, 3, 1], dtype=torch.int32), 2)
    assert out.flatten().tolist() == [101.0, 1010.0]  # CANN: [g2+g0, g3+g1]; Megatron's reading: [g1+g3, g0+g2]


def test_layer_norm_grad_beta_seed_kernel_half(backend):
    # The seed's kernel example instantiates KernelLayernormGradBeta<half, false> (it ships no data): half in,
    # half out, accumulated in float32. 4096 ones: a float16 accumulator stalls at 2048 (2048 + 1 rounds back
    # to 2048), float32 accumulation reaches 4096 exactly.
    dy = torch.ones(2, 2048, 16, dtype=torch.float16)
    res = torch.full((2, 2048, 16), 0.5, dtype=torch.float16)
    pd_gamma, pd_beta = gradops.layer_norm_grad_beta(res, dy)
    assert pd_gamma.dtype == pd_beta.dtype == torch.float16
    assert pd_gamma.tolist() == [2048.0] * 16 and pd_beta.tolist() == [4096.0] * 16
