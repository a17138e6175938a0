"""Decisions taken when CANN's and PyTorch's own test suites were run against gradops (issue 17): each test pins
one, with the authority it follows (the seeds first, then CANN's own tests, then PyTorch's)."""

from __future__ import annotations

import pytest
import torch

import gradops
from oracles import oracle, tolerance

F64 = torch.float64


def _aten_layer_norm_backward(dy, x, mean, rstd, gamma):
    """ATen's native_layer_norm_backward in float64: the golden of ops-nn's aclnnLayerNormBackward cases."""
    n = x.shape[-1]
    d = lambda t: t.to(F64)  # noqa: E731
    return torch.ops.aten.native_layer_norm_backward(d(dy), d(x), [n], d(mean)[:, None], d(rstd)[:, None],
                                                     d(gamma), d(gamma), [True, True, True])


@pytest.mark.parametrize("n", [1, 2, 7, 300])
def test_layer_norm_backward_follows_aclnn_layer_norm_backward_with_unrelated_statistics(backend, n):
    """Item 1: ops-nn draws mean / rstd independently of x in its aclnnLayerNormBackward (atk) and
    LayerNormGradV3 (ttk) cases, and its golden is ATen's formula; 283 of them failed while the fused rstd API
    applied AscendC LayerNormGrad's extra sum(x - mean) term. A 1-element row shows it most: that term is all of
    dx there."""
    g = torch.Generator().manual_seed(n)
    dy, x, gamma = torch.randn(6, n, generator=g), 3 * torch.randn(6, n, generator=g), torch.randn(n, generator=g)
    mean, rstd = torch.randn(6, generator=g), torch.rand(6, generator=g) * 4 + 0.1
    got = gradops.layer_norm_backward(dy, x, mean, rstd, gamma)
    want = _aten_layer_norm_backward(dy, x, mean, rstd, gamma)
    # Derived bounds (oracles.tolerance): dx sums n terms up to rstd·|dy·gamma|·(1 + xhat²) per row (xhat is large
    # here: the mean is unrelated to x); dgamma and dbeta sum 6 rows of |dy·xhat| and |dy|.
    xhat = (x - mean[:, None]) * rstd[:, None]
    dx_terms = (rstd[:, None] * (dy * gamma).abs().amax(-1, keepdim=True) * (1 + xhat.square())).max()
    scales = {"dx": (n, dx_terms), "dgamma": (6, (dy * xhat).abs().max()), "dbeta": (6, dy.abs().max())}
    for name, a, b in zip(scales, got, want):
        length, scale = scales[name]
        assert float((a.to(F64) - b).abs().max()) <= tolerance(torch.float32, length, float(scale)), name


def test_layer_norm_grad_keeps_ascendc_layer_norm_grad_formula(backend):
    """Item 1, the other half: LayerNormGrad (variance + epsilon in) is AscendC's operator, whose documented formula
    keeps the sum(x - mean) term; with unrelated statistics it is not ATen's, and stays so."""
    g = torch.Generator().manual_seed(1)
    dy, x, gamma = torch.randn(4, 1, generator=g), torch.randn(4, 1, generator=g), torch.randn(1, generator=g)
    mean, variance = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    pd_x, _ = gradops.layer_norm_grad(dy, x, variance, mean, gamma, 1e-5)
    ascendc = oracle("layer_norm_grad", dy, x, variance, mean, gamma, 1e-5)[0]
    torch.testing.assert_close(pd_x.to(F64), ascendc, rtol=1e-5, atol=1e-6)
    aten = _aten_layer_norm_backward(dy, x, mean, torch.rsqrt(variance + 1e-5), gamma)[0]
    assert (aten - ascendc).abs().max() > 1e-2  # the two formulas really differ here


def test_the_two_layer_norm_formulas_agree_with_statistics_from_the_forward(backend):
    """With mean and variance from :func:`gradops.layer_norm` the extra term is 0 up to rounding: a training step
    gets the same gradient from either API."""
    x, dy, gamma, beta = torch.randn(8, 64), torch.randn(8, 64), torch.randn(64), torch.randn(64)
    _, mean, variance = gradops.layer_norm(x, gamma, beta, 1e-5)
    fused = gradops.layer_norm_backward(dy, x, mean, torch.rsqrt(variance + 1e-5), gamma)[0]
    ascendc = gradops.layer_norm_grad(dy, x, variance, mean, gamma, 1e-5)[0]
    torch.testing.assert_close(fused, ascendc, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 8, 64), (4, 16, 128), (1, 1, 1023), (3, 7, 256)])
def test_bf16_layer_norm_module_is_within_one_rounding_of_float64(backend, shape):
    """Item 5: Liger-Kernel's bf16 LayerNorm cases compare with torch.nn.LayerNorm in bf16 at atol = rtol = 0.02,
    and 6 failed. Against float64 the failures are torch's: its CPU bf16 weight / bias gradients are up to 8.5e-2 /
    1.2e-1 off (relative to 1 + |value|, 4x16x128; measured with torch 2.13), gradops' within 3.3e-3, one bf16
    rounding of a float32 sum. So gradops is held to float64 here, not to torch's bf16 result."""
    from gradops import nn as gnn

    b, s, h = shape
    g = torch.Generator().manual_seed(0)
    x, up = torch.randn(b, s, h, generator=g), torch.randn(b, s, h, generator=g)
    weight, bias = torch.randn(h, generator=g), torch.randn(h, generator=g)
    module = gnn.LayerNorm(h, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        module.weight.copy_(weight)
        module.bias.copy_(bias)
    xb = x.to(torch.bfloat16).requires_grad_()
    module(xb).backward(up.to(torch.bfloat16))
    # float64 truth from the same bf16-rounded inputs
    x64 = xb.detach().to(F64).requires_grad_()
    w64 = module.weight.detach().to(F64).requires_grad_()
    b64 = module.bias.detach().to(F64).requires_grad_()
    torch.nn.functional.layer_norm(x64, (h,), w64, b64, 1e-6).backward(up.to(torch.bfloat16).to(F64))
    half_ulp = 2.0 ** -8  # bf16 rounds to 8 significant bits
    for name, got, want, length in (("dx", xb.grad, x64.grad, h), ("dweight", module.weight.grad, w64.grad, b * s),
                                    ("dbias", module.bias.grad, b64.grad, b * s)):
        # one bf16 rounding of a float32 result whose own error is a few float32 ulps of the summed terms
        bound = half_ulp * want.abs() + tolerance(torch.float32, length, float(want.abs().max()) + 1.0)
        assert bool(((got.to(F64) - want).abs() <= bound).all()), name


def test_a_raw_negative_padding_index_means_no_padding_row_but_the_module_follows_torch():
    """Item 5, OpInfo ``nn.functional.embedding`` with padding_idx=-1 (5 of 25 elements differed): a documented
    difference. CANN's aclnnEmbeddingDenseBackward takes the index raw (signed; outside [0, V) means none), while
    torch's F.embedding / nn.Embedding turn -1 into the last row before aten sees it. gradops.nn.Embedding
    normalises as torch.nn.Embedding does, so a swapped-in module gives torch's gradient."""
    from gradops import nn as gnn

    idx = torch.tensor([[0, 4, 2], [4, 1, 4]])
    grad = torch.randn(2, 3, 5)
    raw = gradops.embedding_dense_backward(grad, idx, 5, -1, False)
    assert torch.equal(raw[4], grad[idx == 4].sum(0))  # row 4 is an ordinary row under CANN's rule
    want = torch.ops.aten.embedding_dense_backward(grad, idx, 5, 4, False)  # torch after normalising -1
    module = gnn.Embedding(5, 5, padding_idx=-1)
    module(idx).backward(grad)
    torch.testing.assert_close(module.weight.grad, want)
    assert not module.weight.grad[4].any()


def test_hardswish_backward_at_minus_and_plus_three_is_the_closed_interval(backend):
    """Item 6, torch_npu's boundary tests expect 0 at x = -3 (PyTorch >= 2.8's open interval); the seed's closed
    interval gives the slope x/3 + 0.5 there: -0.5 at -3 and 1.5 at +3 (the seed's own example: 4.5 = 3 * 1.5)."""
    x = torch.tensor([-3.0, 3.0, -3.0001, 3.0001])
    got = gradops.hardswish_backward(torch.full_like(x, 3.0), x)
    assert got.tolist() == [-1.5, 4.5, 0.0, 3.0]


@pytest.mark.parametrize("with_probs", [False, True])
def test_moe_unpermute_saves_permuted_tokens_only_when_probs_need_them(backend, with_probs):
    """Item 4: torch_npu's test asserts that npu_moe_token_unpermute without probs does not save permuted_tokens
    (its backward never reads them: grad_permuted is grad gathered to the rows). Saved tensors are watched
    through autograd's pack hook; the gradient is still the plain inverse gather."""
    tokens = torch.randn(6, 8)
    ids = torch.tensor([[1], [0], [3], [1], [2], [0]])
    permuted, sorted_indices = gradops.moe_token_permute(tokens, ids)
    permuted = permuted.detach().requires_grad_()
    probs = torch.rand(6, 1, requires_grad=True) if with_probs else None
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gradops.moe_token_unpermute(permuted, sorted_indices, probs)
    kept = any(t.untyped_storage().data_ptr() == permuted.untyped_storage().data_ptr() for t in saved)
    assert kept == with_probs
    up = torch.randn(6, 8)
    out.backward(up)
    scale = probs.detach() if with_probs else torch.ones(6, 1)
    want = torch.empty(6, 8)
    want[sorted_indices.long()] = up * scale
    torch.testing.assert_close(permuted.grad, want)


def _aclnn_embedding(grad, idx, num_weights, out) -> int:
    from gradops import aclnn

    status, size, executor = aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize(grad, idx, num_weights, 2, True, out)
    if status:
        return status
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    return aclnn.aclnnEmbeddingDenseBackward(workspace, size, executor, None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_embedding_backward_writes_a_float32_out_for_half_grad_on_both_surfaces(backend, dtype):
    """Item 2: CANN's own opapi unit tests for aclnnEmbeddingDenseBackward (cases 5 and 6) expect a float32 out
    beside float16 / bfloat16 grad to succeed; the seed's table (out in grad's dtype) refused it with 161002. The
    result is the float32 sums unrounded: bit for bit what a float32 grad of the same values gives."""
    grad = torch.randn(40, 6).to(dtype)
    idx = torch.randint(0, 5, (40,))
    want = gradops.embedding_dense_backward(grad.float(), idx, 5, 2, True)
    out = torch.full((5, 6), float("nan"))
    assert _aclnn_embedding(grad, idx, 5, out) == 0
    assert torch.equal(out, want)
    out2 = torch.full((5, 6), float("nan"))
    assert gradops.embedding_dense_backward(grad, idx, 5, 2, True, out=out2) is out2
    assert torch.equal(out2, want)


@pytest.mark.parametrize("grad_dtype, out_dtype", [(torch.float32, torch.float16), (torch.float16, torch.bfloat16),
                                                   (torch.bfloat16, torch.float64), (torch.float32, torch.float64)])
def test_embedding_backward_refuses_an_out_that_loses_or_changes_precision(grad_dtype, out_dtype):
    """Only the widening to float32 is accepted; any other out dtype stays 161002 on both surfaces."""
    grad, idx = torch.randn(4, 3).to(grad_dtype), torch.tensor([0, 1, 1, 2])
    out = torch.empty(3, 3, dtype=out_dtype)
    assert _aclnn_embedding(grad, idx, 3, out) == gradops.status.ACLNN_ERR_PARAM_INVALID
    with pytest.raises(gradops.OpError, match=r"out\.dtype"):
        gradops.embedding_dense_backward(grad, idx, 3, -1, False, out=out)
