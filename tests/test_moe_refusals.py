"""MoE permute values that no formula can use, refused on every CPU path (issue 36, items 4 and 5).

- moe_token_permute_grad's sorted_indices must be a permutation of [0, T*K) (CANN: no repeated index): a repeated
  row left another row of the gradient without its source and summed the repeated one into several tokens (all
  zeros: every token got row 0's sum, silently).
- moe_token_permute's expert ids must be >= 0 (CANN: "值大于等于0"): a negative id sorted before expert 0, so
  its copy took expert 0's first row and shifted every other row by one, silently.

Each path answers the same OpError (161002 naming the argument): the public function on the reference (torch)
and compiled CPU backends, with and without ``out=``, the backends' own functions, the aclnn surface, and the
native extension's remembered program, which declines the call so that the Python path raises.

The Triton launchers' refusals are in tests/interpreter/test_moe_refusals.py.
"""

from __future__ import annotations

import pytest
import torch

import gradops
import gradops.native as native
from gradops import aclnn
from gradops.status import ACLNN_ERR_PARAM_INVALID as INVALID
from gradops.status import ACLNN_SUCCESS
from native_paths import skip_unless_native

#: sorted_indices of T*K = 6 (K = 2) that are not permutations: (values, the error text's "got" part).
NOT_PERMUTATIONS = {
    "all-zero": ([0, 0, 0, 0, 0, 0], "row 0 named 6 times"),
    "repeated-last": ([0, 1, 2, 3, 4, 4], "row 4 named 2 times"),
    "repeated-first": ([5, 1, 2, 3, 4, 5], "row 5 named 2 times"),
}

#: expert ids of T = 4 tokens, K = 2 with a negative one: (ids, the error text's "got" part).
NEGATIVE_IDS = {
    "minus-one": ([[0, 1], [2, -1], [1, 0], [3, 2]], "-1 at position 3"),
    "int32-min": ([[0, 1], [2, 3], [-(2**31), 0], [3, 2]], f"{-(2**31)} at position 4"),
}


def _si(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def _refused(fn, *args, **kwargs) -> gradops.OpError:
    with pytest.raises(gradops.OpError) as info:
        fn(*args, **kwargs)
    return info.value


# ---------------------------------------------------------------- moe_token_permute_grad: a permutation
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", list(NOT_PERMUTATIONS))
def test_permute_grad_refuses_a_non_permutation(backend, case, dtype):
    values, got = NOT_PERMUTATIONS[case]
    grad, si = torch.randn(6, 3), _si(values, dtype)
    err = _refused(gradops.moe_token_permute_grad, grad, si, 2)
    assert err.status == INVALID and err.arg == "sorted_indices" and got in str(err), str(err)
    out = torch.full((3, 3), 7.0)
    err = _refused(gradops.moe_token_permute_grad, grad, si, 2, out=out)
    assert err.status == INVALID and got in str(err), str(err)
    assert bool((out == 7.0).all())  # nothing written


@pytest.mark.parametrize("case", list(NOT_PERMUTATIONS))
def test_permute_grad_backends_refuse_a_non_permutation(case):
    """The backends' own functions (what the aclnn surface and ``out=`` run): the reference and the compiled CPU
    kernel, whose one pass over the indices (a bitmap, T*K bytes) finds the repeat before any row is summed."""
    from gradops import cpu, reference

    values, got = NOT_PERMUTATIONS[case]
    for fn in (reference.moe_token_permute_grad, cpu.moe_token_permute_grad):
        err = _refused(fn, torch.randn(6, 3), _si(values), 2)
        assert err.arg == "sorted_indices" and got in str(err), (fn, str(err))


def test_permute_grad_keeps_refusing_a_value_outside():
    """The permutation test names an entry outside [0, T*K) as before (the range comes first)."""
    err = _refused(gradops.moe_token_permute_grad, torch.randn(6, 3), _si([0, 1, 2, 3, 4, 9]), 2)
    assert "9 at position 5" in str(err)


def test_permute_grad_dropped_rows_still_a_permutation(backend):
    """A < T*K rows: the entries in [A, T*K) name dropped rows, part of the permutation; a repeated one of them is
    refused too (it is still not a permutation)."""
    grad = torch.randn(4, 3)
    good = gradops.moe_token_permute_grad(grad, _si([5, 0, 4, 1, 2, 3]), 2)
    assert torch.equal(good[0], grad[0]) and torch.equal(good[1], grad[1])
    err = _refused(gradops.moe_token_permute_grad, grad, _si([5, 0, 5, 1, 2, 3]), 2)
    assert "row 5 named 2 times" in str(err)


@pytest.mark.parametrize("case", list(NOT_PERMUTATIONS))
def test_aclnn_permute_grad_refuses_a_non_permutation(backend, case):
    values, _ = NOT_PERMUTATIONS[case]
    grad, si, out = torch.randn(6, 3), _si(values), torch.full((3, 3), 7.0)
    status, size, executor = aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize(grad, si, 2, False, out)
    assert status == ACLNN_SUCCESS  # the values are read when the op runs, as CANN reads them
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    assert aclnn.aclnnMoeTokenPermuteGrad(workspace, size, executor, None) == INVALID
    assert bool((out == 7.0).all())


@skip_unless_native
@pytest.mark.parametrize("case", list(NOT_PERMUTATIONS))
def test_permute_grad_program_declines_a_non_permutation(case):
    """The extension's remembered program of a good call (the same metadata) declines the bad one: its check
    piece finds the repeat, and the call goes back to the Python path, which raises."""
    ext = native.module()
    op = ext.direct_op("moe_token_permute_grad")
    grad = torch.randn(6, 3)
    gradops.moe_token_permute_grad(grad, _si([4, 1, 0, 3, 2, 5]), 2)  # remembers the program
    assert ext.direct(op, grad, _si([4, 1, 0, 3, 2, 5]), 2, False) not in (None, ext.MISS)
    assert ext.direct(op, grad, _si(NOT_PERMUTATIONS[case][0]), 2, False) is None
    err = _refused(gradops.moe_token_permute_grad, grad, _si(NOT_PERMUTATIONS[case][0]), 2)
    assert NOT_PERMUTATIONS[case][1] in str(err)


# ---------------------------------------------------------------- moe_token_permute: expert ids >= 0
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", list(NEGATIVE_IDS))
def test_permute_refuses_a_negative_expert_id(backend, case, dtype):
    ids, got = NEGATIVE_IDS[case]
    tokens, indices = torch.randn(4, 3), torch.tensor(ids, dtype=dtype)
    err = _refused(gradops.moe_token_permute, tokens, indices)
    assert err.status == INVALID and err.arg == "indices" and got in str(err), str(err)
    outs = (torch.full((8, 3), 7.0), torch.full((8,), 7, dtype=torch.int32))
    err = _refused(gradops.moe_token_permute, tokens, indices, out=outs)
    assert got in str(err)
    assert all(bool((o == 7).all()) for o in outs)
    err = _refused(gradops.moe_token_permute, tokens.requires_grad_(), indices)  # the autograd path
    assert got in str(err)


@pytest.mark.parametrize("case", list(NEGATIVE_IDS))
def test_permute_backends_refuse_a_negative_expert_id(case):
    from gradops import cpu, reference

    ids, got = NEGATIVE_IDS[case]
    for fn in (reference.moe_token_permute, cpu.moe_token_permute):
        err = _refused(fn, torch.randn(4, 3), torch.tensor(ids), 8)
        assert err.arg == "indices" and got in str(err), (fn, str(err))


def test_permute_refuses_a_negative_id_on_the_merge_sort_path(backend):
    """Ids spanning more values than the CPU's counting sort takes (its merge-sort path): the same refusal."""
    ids = torch.tensor([[2**40, 3], [-5, 0]])
    err = _refused(gradops.moe_token_permute, torch.randn(2, 3), ids)
    assert "-5 at position 2" in str(err)


def test_ids_past_every_expert_sort_last_and_are_dropped(backend):
    """The accepted counterpart: an id >= the experts' count (a "no expert" marker such as int32's max) sorts after
    every real expert, so num_out_tokens drops exactly those copies."""
    tokens = torch.arange(12.0).reshape(4, 3)
    ids = torch.tensor([[0, 2**31 - 1], [1, 0], [2**31 - 1, 1], [2, 0]], dtype=torch.int32)
    permuted, sorted_indices = gradops.moe_token_permute(tokens, ids, 6)
    assert torch.equal(sorted_indices, torch.tensor([0, 6, 3, 1, 7, 4, 5, 2], dtype=torch.int32))
    assert torch.equal(permuted, tokens[[0, 1, 3, 1, 2, 3]])


@pytest.mark.parametrize("case", list(NEGATIVE_IDS))
def test_aclnn_permute_refuses_a_negative_expert_id(backend, case):
    ids, _ = NEGATIVE_IDS[case]
    tokens, indices = torch.randn(4, 3), torch.tensor(ids)
    permuted, sorted_out = torch.full((8, 3), 7.0), torch.full((8,), 7, dtype=torch.int32)
    status, size, executor = aclnn.aclnnMoeTokenPermuteGetWorkspaceSize(tokens, indices, 0, False, permuted,
                                                                        sorted_out)
    assert status == ACLNN_SUCCESS
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    assert aclnn.aclnnMoeTokenPermute(workspace, size, executor, None) == INVALID
    assert bool((permuted == 7.0).all()) and bool((sorted_out == 7).all())


@skip_unless_native
@pytest.mark.parametrize("case", list(NEGATIVE_IDS))
def test_permute_program_declines_a_negative_expert_id(case):
    ext = native.module()
    op = ext.direct_op("moe_token_permute")
    tokens, good = torch.randn(4, 3), torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    gradops.moe_token_permute(tokens, good)  # remembers the program
    assert ext.direct(op, tokens, good, None, False) not in (None, ext.MISS)
    assert ext.direct(op, tokens, torch.tensor(NEGATIVE_IDS[case][0]), None, False) is None
