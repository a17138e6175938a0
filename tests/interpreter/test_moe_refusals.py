"""The Triton launchers refuse what the CPU paths refuse (issue 36, items 4 and 5; tests/test_moe_refusals.py):
a moe_token_permute_grad sorted_indices that is not a permutation, and a negative expert id of moe_token_permute.
Both through :func:`gradops.launch._common.guard`'s flag (read at once here; on CUDA behind an event, raised by
the next launch, never a host synchronisation in the call)."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops import launch


@pytest.mark.parametrize("bad", [[0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 4], [5, 1, 2, 3, 4, 5]],
                         ids=["all-zero", "repeated-last", "repeated-first"])
def test_permute_grad_launcher_refuses_a_non_permutation(bad):
    si = torch.tensor(bad, dtype=torch.int32)
    with pytest.raises(gradops.OpError) as info:
        launch.moe_token_permute_grad(torch.randn(6, 3), si, 2)
    assert info.value.status == 161002 and info.value.arg == "sorted_indices"
    assert f"row {bad[-1]} named" in str(info.value)
    with pytest.raises(gradops.OpError, match="named"):  # the public function, with and without out=
        gradops.moe_token_permute_grad(torch.randn(6, 3), si, 2)
    with pytest.raises(gradops.OpError, match="named"):
        gradops.moe_token_permute_grad(torch.randn(6, 3), si, 2, out=torch.empty(3, 3))


def test_permute_grad_launcher_trusts_its_forward(launches, monkeypatch):
    """The backward of gradops' own permute skips the test (its sorted_indices is a permutation by construction,
    guarded by autograd's version counter): one device sort fewer per step, and the same gradient."""
    from gradops.families.moe import launch as module
    tested = []
    real = module._guard_permutation
    monkeypatch.setattr(module, "_guard_permutation", lambda si, op: tested.append(op) or real(si, op))
    tokens = torch.randn(5, 4, requires_grad=True)
    ids = torch.tensor([[1, 0], [2, 1], [0, 0], [3, 2], [1, 3]])
    permuted, sorted_indices = gradops.moe_token_permute(tokens, ids)
    upstream = torch.randn_like(permuted)
    permuted.backward(upstream)
    assert launches()["moe_token_permute_grad_kernel"] == 1 and tested == []
    assert torch.equal(tokens.grad, gradops.moe_token_permute_grad(upstream, sorted_indices, 2))
    assert tested == ["moe_token_permute_grad"]  # a direct call tests


@pytest.mark.parametrize("ids", [[[0, 1], [2, -1], [1, 0]], [[-(2**31), 1], [2, 3], [1, 0]]],
                         ids=["minus-one", "int32-min"])
def test_permute_launcher_refuses_a_negative_expert_id(ids):
    indices = torch.tensor(ids, dtype=torch.int32)
    position = [v for row in ids for v in row].index(min(v for row in ids for v in row))
    with pytest.raises(gradops.OpError) as info:
        launch.moe_token_permute(torch.randn(3, 4), indices, 6)
    assert info.value.status == 161002 and info.value.arg == "indices"
    assert f"at position {position}" in str(info.value)
    with pytest.raises(gradops.OpError, match="expert ids >= 0"):
        gradops.moe_token_permute(torch.randn(3, 4), indices)


def test_permute_launcher_takes_ids_past_every_expert():
    tokens = torch.randn(3, 4)
    ids = torch.tensor([[0, 2**31 - 1], [1, 0], [2**31 - 1, 1]], dtype=torch.int32)
    permuted, sorted_indices = launch.moe_token_permute(tokens, ids, 4)
    assert torch.equal(sorted_indices, torch.tensor([0, 4, 2, 1, 5, 3], dtype=torch.int32))
    assert torch.equal(permuted, tokens[[0, 1, 1, 2]])
