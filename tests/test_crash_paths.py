"""Inputs that crashed, read uninitialised memory or answered differently on one path than another: each case runs
on the reference and the C++ kernels (the ``backend`` fixture) and in float64, and must give the same answer."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops import OpError

FLOAT64 = [torch.float32, torch.float64]


# ---------------------------------------------------------------- one refusal rule for the LayerNorm statistics
@pytest.mark.parametrize("dtype", FLOAT64)
@pytest.mark.parametrize("order", ["nan-first", "nan-last"])
def test_a_refused_statistic_beside_a_nan_is_refused_on_every_path(backend, dtype, order):
    # min() of a tensor holding a NaN is NaN, which compared as no refusal: the reference and float64 paths took a
    # variance of -1 that the C++ kernels refused.
    bad = [float("nan"), -1.0] if order == "nan-first" else [-1.0, float("nan")]
    x = torch.randn(2, 4, dtype=dtype)
    with pytest.raises(OpError, match="variance must be") as err:
        gradops.layer_norm_grad(x, x, torch.tensor(bad), torch.zeros(2), torch.ones(4, dtype=dtype))
    assert err.value.status == 161002
    with pytest.raises(OpError, match="rstd must be") as err:
        gradops.layer_norm_backward(x, x, torch.zeros(2), torch.tensor(bad), torch.ones(4, dtype=dtype))
    assert err.value.status == 161002


# ---------------------------------------------------------------- MoE rows of no columns
@pytest.mark.parametrize("dtype", FLOAT64)
def test_moe_unpermute_of_rows_without_columns_is_empty_on_every_path(backend, dtype):
    order = torch.randperm(4).to(torch.int32)
    permuted, probs = torch.empty(4, 0, dtype=dtype), torch.rand(2, 2, dtype=dtype)
    out = gradops.moe_token_unpermute(permuted, order, probs)
    assert out.shape == (2, 0) and out.dtype == dtype
    d_permuted, d_probs = gradops.moe_token_unpermute_grad(permuted, torch.empty(2, 0, dtype=dtype), order, probs)
    assert d_permuted.shape == (4, 0) and torch.equal(d_probs, torch.zeros(2, 2, dtype=dtype))
    assert gradops.moe_token_unpermute(permuted[:2], order[:2].argsort().int(), None).shape == (2, 0)


# ---------------------------------------------------------------- saved indices changed behind autograd's back
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
@pytest.mark.parametrize("dtype", FLOAT64)
def test_unpermute_backward_retests_its_saved_indices(backend, with_probs, dtype):
    # The node trusted the forward's permutation test; a numpy view (or .data) bypasses autograd's version counter,
    # and a repeated entry left gradient rows unwritten: uninitialised memory (2.5e33, pointer bits) in p.grad.
    t, k, h = 4, 2 if with_probs else 1, 3
    permuted = torch.randn(t * k, h, dtype=dtype, requires_grad=True)
    order = torch.randperm(t * k).to(torch.int32)
    probs = torch.rand(t, k, dtype=dtype, requires_grad=True) if with_probs else None
    out = gradops.moe_token_unpermute(permuted, order, probs)
    order.numpy()[:] = 0
    with pytest.raises(OpError, match="sorted_indices must be a permutation") as err:
        out.sum().backward()
    assert err.value.status == 161002
    assert permuted.grad is None


# ---------------------------------------------------------------- gradops.nn: OpError, and nothing changed first
def test_rmsnorm_module_refuses_an_integer_input_with_operror(backend):
    # eps=None took torch.finfo(int64) first: torch's TypeError instead of the op's refusal
    with pytest.raises(OpError, match=r"x\.dtype must be one of") as err:
        gradops.nn.RMSNorm(8)(torch.ones(2, 8, dtype=torch.int64))
    assert err.value.status == 161002


@pytest.mark.parametrize("max_norm", [None, 0.5], ids=["plain", "max_norm"])
@pytest.mark.parametrize("indices", [[1, 10], [-1, 2], [1.0, 10.5], [float("nan"), 1.0]],
                         ids=["past-table", "negative", "float-past-table", "nan"])
def test_embedding_module_refuses_an_index_before_renormalising(backend, max_norm, indices):
    # With max_norm, torch.embedding_renorm_ ran first: rows renormalised, then torch's IndexError (past the
    # table) or RuntimeError (float indices).
    module = gradops.nn.Embedding(10, 4, max_norm=max_norm)
    before = module.weight.detach().clone()
    with pytest.raises(OpError, match="indices must be values in") as err:
        module(torch.tensor(indices))
    assert err.value.status == 161002
    assert torch.equal(module.weight.detach(), before), "no row may change before the refusal"


def test_embedding_module_with_max_norm_takes_float_indices_as_cann_reads_them(backend):
    module = gradops.nn.Embedding(10, 4, max_norm=0.5)
    twin = torch.nn.Embedding(10, 4, max_norm=0.5)
    twin.weight.data.copy_(module.weight.detach())
    got = module(torch.tensor([1.7, 2.0, 9.9]))  # truncated toward zero: rows 1, 2, 9
    want = twin(torch.tensor([1, 2, 9]))
    assert torch.equal(got, want) and torch.equal(module.weight.detach(), twin.weight.detach())


# ---------------------------------------------------------------- one documented answer without probs
def test_results_without_probs_are_empty_tensors_and_none_under_torch_npus_name():
    # docs/api.md: gradops' functions (and torch.ops.gradops) give an empty (0,) tensor; npu_compat gives None for
    # npu_moe_token_permute_with_routing_map's permuted probs, as torch_npu and Megatron do.
    from gradops import npu_compat

    tokens = torch.randn(4, 3)
    routing = torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1]], dtype=torch.bool)
    permuted, permuted_probs, order = gradops.moe_token_permute_with_routing_map(tokens, routing, None, 8)
    assert permuted_probs.shape == (0,) and permuted_probs.dtype == tokens.dtype
    assert torch.ops.gradops.moe_token_permute_with_routing_map(tokens, routing, None, 8, False)[1].shape == (0,)
    _, probs_grad = gradops.moe_token_permute_with_routing_map_grad(torch.randn_like(permuted), None, order, routing,
                                                                    3, 4, False)
    assert probs_grad.shape == (0,)
    _, grad_probs = gradops.moe_token_unpermute_with_routing_map_grad(permuted, torch.randn(4, 3), order)
    assert grad_probs.shape == (0,)
    assert npu_compat.npu_moe_token_permute_with_routing_map(tokens, routing, num_out_tokens=8)[1] is None
