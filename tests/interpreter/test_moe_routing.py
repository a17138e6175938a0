"""The routing-map MoE ops on the Triton backend (issue 41): their slot tables run the permute family's Triton
kernels, which must give what a float64 evaluation of the same ops gives, forward and backward, with and without
drop_and_pad and probs (the semantics themselves are tested against independent references in
tests/test_moe_routing.py)."""

from __future__ import annotations

import pytest
import torch

import gradops

#: fp32 sums of at most E = 6 terms, then the result in its dtype: a few ulps of fp32 (2^-23 ~ 1.2e-7) each.
FP32 = {"rtol": 1e-5, "atol": 1e-6}
#: bf16 results: one rounding of the fp32 value, half a bf16 ulp (2^-8 relative), and the inputs' own rounding
#: is shared by both sides (the float64 evaluation takes the same bf16 values).
BF16 = {"rtol": 2 ** -7, "atol": 2 ** -7}


def _case(seed: int, dtype: torch.dtype, tokens: int = 7, experts: int = 5, hidden: int = 6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    routing_map = torch.rand(tokens, experts, generator=gen) < 0.45
    routing_map[0] = False  # a token routed nowhere
    routing_map[:, 1] = False  # an empty expert
    probs = torch.rand(tokens, experts, generator=gen)
    return x, routing_map, probs


def _run(x, routing_map, probs, drop, num_out_tokens, grads):
    """Permute -> scale -> unpermute, its value and the gradients of tokens and probs."""
    x = x.detach().requires_grad_()
    probs = None if probs is None else probs.detach().requires_grad_()
    permuted, permuted_probs, sorted_indices = gradops.moe_token_permute_with_routing_map(
        x, routing_map, probs, num_out_tokens, drop)
    out = gradops.moe_token_unpermute_with_routing_map(permuted * 3, sorted_indices, tuple(x.shape), probs,
                                                       routing_map, drop)
    loss = (out.float() * grads[0]).sum()
    if permuted_probs is not None:
        loss = loss + (permuted_probs.float() * grads[1][:permuted_probs.numel()]).sum()
    loss.backward()
    return [permuted, out, sorted_indices, x.grad] + ([] if probs is None else [permuted_probs, probs.grad])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("drop", [False, True], ids=["nodrop", "drop"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_routing_map_ops_on_triton_match_float64(dtype, drop, with_probs, launches):
    x, routing_map, probs = _case(3, dtype)
    probs = probs if with_probs else None
    topk = int(routing_map.sum(1).max())
    num_out_tokens = 2 * routing_map.shape[1] if drop else topk * x.shape[0]
    grads = (torch.randn(x.shape, generator=torch.Generator().manual_seed(9)),
             torch.randn(x.shape[0] * routing_map.shape[1], generator=torch.Generator().manual_seed(10)))
    ours = _run(x, routing_map, probs, drop, num_out_tokens, grads)
    wide = _run(x.double(), routing_map, None if probs is None else probs.double(), drop, num_out_tokens, grads)
    tol = FP32 if dtype == torch.float32 else BF16
    for a, b in zip(ours, wide):
        if a.dtype in (torch.int32, torch.int64):
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a.double(), b.to(a.dtype).double(), **tol)
    ran = launches()
    assert any(name.startswith("moe_token") for name in ran), ran  # the permute family's Triton kernels ran
