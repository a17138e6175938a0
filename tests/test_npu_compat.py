"""gradops.npu_compat: torch_npu's names, argument orders and return conventions on gradops' ops."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import gradops
from gradops import npu_compat as npu
from gradops.status import ACLNN_ERR_PARAM_INVALID, OpError

TOL = {"rtol": 1.3e-6, "atol": 1e-5}


def test_npu_rms_norm_returns_y_and_keepdim_float32_rstd():
    x, gamma = torch.randn(4, 3, 16), torch.randn(16)
    y, rstd = npu.npu_rms_norm(x, gamma)  # torch_npu's default epsilon 1e-6
    assert rstd.shape == (4, 3, 1) and rstd.dtype == torch.float32
    torch.testing.assert_close(rstd, torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6), **TOL)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (16,), gamma, 1e-6), **TOL)


def test_npu_rms_norm_backward_takes_gamma_before_rstd():
    x, gamma, dy = torch.randn(5, 8), torch.randn(8), torch.randn(5, 8)
    _, rstd = npu.npu_rms_norm(x, gamma)
    dx, dgamma = npu.npu_rms_norm_backward(dy, x, gamma, rstd)
    ref_dx, ref_dgamma = gradops.rms_norm_grad(dy, x, rstd, gamma)
    assert torch.equal(dx, ref_dx) and torch.equal(dgamma, ref_dgamma)
    # and it is the true gradient of the forward
    xr, gr = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    torch.nn.functional.rms_norm(xr, (8,), gr, 1e-6).backward(dy)
    torch.testing.assert_close(dx, xr.grad, **TOL)
    torch.testing.assert_close(dgamma, gr.grad, **TOL)


def test_npu_rms_norm_is_differentiable():
    x = torch.randn(3, 8, requires_grad=True)
    gamma = torch.randn(8, requires_grad=True)
    npu.npu_rms_norm(x, gamma)[0].sum().backward()
    assert x.grad is not None and gamma.grad is not None


def _setup(t=6, h=5, k=2, e=3):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randn(t, h, generator=g)
    indices = torch.randint(0, e, (t, k), generator=g)
    return tokens, indices


def test_npu_moe_token_permute_and_grad():
    tokens, indices = _setup()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    assert sorted_indices.dtype == torch.int32
    order = torch.argsort(indices.reshape(-1), stable=True)  # Megatron's sorted_indices
    assert torch.equal(sorted_indices.long(), torch.argsort(order))  # CANN returns its inverse
    torch.testing.assert_close(permuted, tokens[order // 2], rtol=0, atol=0)

    grad = torch.randn_like(permuted)
    out = npu.npu_moe_token_permute_grad(tokens, grad, indices, sorted_indices)
    expected = grad[sorted_indices.long()].view(6, 2, 5).sum(1)
    torch.testing.assert_close(out, expected, **TOL)
    # equals autograd through the differentiable forward
    t = tokens.clone().requires_grad_()
    npu.npu_moe_token_permute(t, indices)[0].backward(grad)
    torch.testing.assert_close(out, t.grad, rtol=0, atol=0)


def test_npu_moe_token_permute_grad_checks_tokens_rows():
    tokens, indices = _setup()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    with pytest.raises(OpError, match=r"tokens\.shape"):
        npu.npu_moe_token_permute_grad(tokens[:4], permuted, indices, sorted_indices)


@pytest.mark.parametrize("with_probs", [True, False])
def test_npu_moe_token_unpermute_and_grad(with_probs):
    tokens, indices = _setup()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    probs = torch.rand(6, 2) if with_probs else None
    p = permuted.clone().requires_grad_()
    pr = probs.clone().requires_grad_() if with_probs else None
    out = npu.npu_moe_token_unpermute(p, sorted_indices, pr)
    rows = permuted[sorted_indices.long()]
    if with_probs:
        expected = (rows.view(6, 2, 5) * probs[..., None]).sum(1)
        torch.testing.assert_close(out, expected, **TOL)
    else:
        torch.testing.assert_close(out, rows, rtol=0, atol=0)  # K = 1: the plain inverse gather

    grad = torch.randn_like(out)
    d_permuted, d_probs = npu.npu_moe_token_unpermute_grad(permuted, grad, sorted_indices, probs)
    out.backward(grad)
    torch.testing.assert_close(d_permuted, p.grad, rtol=0, atol=0)
    if with_probs:
        torch.testing.assert_close(d_probs, pr.grad, rtol=0, atol=0)
        torch.testing.assert_close(d_probs, (grad[:, None, :] * rows.view(6, 2, 5)).sum(-1), **TOL)
    else:
        assert d_probs.numel() == 0


@pytest.mark.parametrize("call", [
    lambda t, i, s, p: npu.npu_moe_token_permute(t, i, padded_mode=True),
    lambda t, i, s, p: npu.npu_moe_token_permute_grad(t, p, i, s, padded_mode=True),
    lambda t, i, s, p: npu.npu_moe_token_unpermute(p, s, padded_mode=True, restore_shape=(6, 5)),
    lambda t, i, s, p: npu.npu_moe_token_unpermute_grad(p, t, s, padded_mode=True),
])
def test_padded_mode_is_refused_with_161002(call):
    tokens, indices = _setup()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    with pytest.raises(OpError) as err:
        call(tokens, indices, sorted_indices, permuted)
    assert err.value.status == ACLNN_ERR_PARAM_INVALID and err.value.arg == "padded_mode"


@pytest.mark.parametrize("call,arg", [
    (lambda p, s, g: npu.npu_moe_token_unpermute(p[:, 0], s), "permuted_tokens.dim()"),
    (lambda p, s, g: npu.npu_moe_token_unpermute(p.double(), s), "permuted_tokens.dtype"),
    (lambda p, s, g: npu.npu_moe_token_unpermute(None, s), "permuted_tokens"),
    (lambda p, s, g: npu.npu_moe_token_unpermute(p, s, torch.rand(5, 2)), "probs"),
    (lambda p, s, g: npu.npu_moe_token_unpermute_grad(p, g[:, :1], s, torch.rand(6, 2)), "grad_unpermuted.shape"),
    (lambda p, s, g: npu.npu_moe_token_unpermute_grad(p, g, s, torch.rand(2, 6)), "probs"),
    (lambda p, s, g: npu.npu_moe_token_unpermute_grad(p, g, None, torch.rand(6, 2)), "sorted_indices"),
], ids=["tokens-1d", "tokens-f64", "tokens-none", "probs-count", "grad-t1", "probs-kt", "indices-none"])
def test_unpermute_pair_is_validated(call, arg):
    """Issue 16.4: each was accepted (a wrong-shaped result) or answered with AttributeError."""
    tokens, indices = _setup()
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    with pytest.raises(OpError) as err:
        call(permuted, sorted_indices, torch.randn(6, 5))
    assert err.value.arg == arg, str(err.value)


def test_never_imports_torch_npu():
    code = "import sys, gradops.npu_compat; sys.exit('torch_npu' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@pytest.mark.parametrize("rows", [5, 2**40, 2**63 - 1])
def test_unpermute_grad_v2_refuses_a_row_count_before_allocating(rows):
    # Without probs the permuted tokens are a stand-in of permuted_tokens_size_0 rows: allocated before the size
    # was checked, 2**40 rows failed in the allocator and 2**63 - 1 overflowed (RuntimeError / TypeError).
    grad, order = torch.randn(4, 3), torch.randperm(4).to(torch.int32)
    with pytest.raises(OpError, match="permuted_tokens_size_0 must be at most T\\*K") as err:
        npu.npu_moe_token_unpermute_grad_v2(grad, order, rows, torch.float32)
    assert err.value.status == 161002
