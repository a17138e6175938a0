"""gradops.aclnn's executor protocol: workspace sizing and refusals (with a fake backend that has a workspace
hook), single use unless repeatable, phase 2's re-check of tensors changed after phase 1, and streams."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import gradops
import gradops.reference
from gradops import aclnn, backend
from gradops.aclnn import (
    ACLNN_ERR_INNER,
    ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
)
from test_aclnn import INVALID, NULL, PHASES, emb_args, hsw_args, moe_grad_args, rms_grad_args, with_


# ---------------------------------------------------------------------- executor, workspace and stream protocol
@pytest.fixture
def fake(monkeypatch, decided):
    """A backend whose hardswish_backward needs 96 bytes of workspace and records what it receives."""
    mod = types.ModuleType("gradops_test_fake_backend")
    record = types.SimpleNamespace(need=96, workspaces=[], streams=[], fail=None)

    def hardswish_backward_workspace(grad_output, x):
        if record.fail == "hook":
            raise RuntimeError("hook failed")
        return record.need

    def hardswish_backward(grad_output, x, *, workspace=None):
        if record.fail == "run":
            raise RuntimeError("kernel failed")
        record.workspaces.append(workspace)
        record.streams.append(torch.cuda.current_stream() if x.is_cuda else None)
        if workspace is not None:
            workspace.fill_(7)  # scratch the implementation may use freely
        return gradops.reference.hardswish_backward(grad_output, x)

    mod.hardswish_backward, mod.hardswish_backward_workspace = hardswish_backward, hardswish_backward_workspace
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(backend.MODULES, "fake", mod.__name__)
    decided("fake", mod)
    return record


def test_workspace_hook_sizes_the_workspace_and_gets_a_slice_of_it(fake):
    grad, x, out = hsw_args()
    status, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    assert (status, size, executor.backend) == (ACLNN_SUCCESS, 96, "fake")
    buffer = torch.zeros(128, dtype=torch.uint8)
    assert aclnn.aclnnHardswishBackward(buffer, 128, executor, None) == ACLNN_SUCCESS
    (ws,) = fake.workspaces
    assert ws.dtype == torch.uint8 and ws.numel() == 96 and ws.data_ptr() == buffer.data_ptr()
    assert bool((buffer[:96] == 7).all()) and bool((buffer[96:] == 0).all())
    assert torch.equal(out, gradops.reference.hardswish_backward(grad, x))


def test_workspace_refusals_leave_the_executor_usable(fake):
    grad, x, out = hsw_args()
    _, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    run = aclnn.aclnnHardswishBackward
    assert run(None, size, executor, None) == NULL
    assert run(torch.empty(size, dtype=torch.uint8), size - 1, executor, None) == INVALID  # below phase 1's size
    assert run(torch.empty(size - 32, dtype=torch.uint8), size, executor, None) == INVALID  # buffer < workspaceSize
    assert run(torch.empty(size, 2, dtype=torch.uint8)[:, 0], size, executor, None) == INVALID  # non-contiguous
    assert fake.workspaces == []  # nothing ran
    assert run(torch.empty(size // 4, dtype=torch.float32), size, executor, None) == ACLNN_SUCCESS  # void*: any dtype


def test_backend_without_hook_needs_no_workspace_and_gets_no_workspace_argument(fake):
    mod = sys.modules["gradops_test_fake_backend"]
    del mod.hardswish_backward_workspace
    mod.hardswish_backward = lambda grad_output, x: gradops.reference.hardswish_backward(grad_output, x)
    grad, x, out = hsw_args()
    status, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    assert (status, size) == (ACLNN_SUCCESS, 0)
    assert aclnn.aclnnHardswishBackward(None, 0, executor, None) == ACLNN_SUCCESS  # a workspace= would TypeError
    assert torch.equal(out, gradops.reference.hardswish_backward(grad, x))


def test_failures_inside_the_implementation_become_status_codes(fake):
    grad, x, out = hsw_args()
    fake.fail = "hook"
    assert aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out) == (ACLNN_ERR_INNER, 0, None)
    fake.fail = None
    _, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    fake.fail = "run"
    assert aclnn.aclnnHardswishBackward(torch.empty(size, dtype=torch.uint8), size, executor, None) == \
        ACLNN_ERR_RUNTIME_ERROR
    assert "kernel failed" in aclnn.aclGetRecentErrMsg() and executor.spent


def test_no_usable_backend_is_find_kernel_error(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "no-such-backend")
    assert aclnn.aclnnHardswishBackwardGetWorkspaceSize(*hsw_args()) == (ACLNN_ERR_INNER_FIND_KERNEL_ERROR, 0, None)


def test_executor_is_single_use_unless_repeatable():
    grad, x, out = hsw_args()
    run = aclnn.aclnnHardswishBackward
    _, size, once = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    ws = torch.empty(size, dtype=torch.uint8)
    assert run(ws, size, once, None) == ACLNN_SUCCESS
    assert run(ws, size, once, None) == INVALID and "single-use" in aclnn.aclGetRecentErrMsg()
    assert aclnn.aclSetAclOpExecutorRepeatable(once) == INVALID  # too late: already spent

    _, size, again = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    assert aclnn.aclSetAclOpExecutorRepeatable(again) == ACLNN_SUCCESS
    assert run(ws, size, again, None) == ACLNN_SUCCESS
    grad.mul_(2)  # the executor binds tensors, not values: a rerun sees the new data
    assert run(ws, size, again, None) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.hardswish_backward(grad, x))
    assert aclnn.aclDestroyAclOpExecutor(again) == ACLNN_SUCCESS
    assert run(ws, size, again, None) == INVALID
    assert aclnn.aclDestroyAclOpExecutor(again) == INVALID
    assert aclnn.aclDestroyAclOpExecutor(None) == NULL
    assert aclnn.aclSetAclOpExecutorRepeatable(None) == NULL


def _moe_permute_args():
    return [torch.randn(4, 6), torch.randint(0, 3, (4, 2)), 0, False, torch.empty(8, 6),
            torch.empty(8, dtype=torch.int32)]


CHANGES = [
    # (op, argument maker, position, change, name in the message): each would make phase 2 read or write outside
    # what phase 1 checked (x.resize_ made the CPU kernel read past gradOutput's end)
    ("hardswish_backward", hsw_args, 1, lambda t: t.resize_(1 << 16), "self"),
    ("hardswish_backward", hsw_args, 2, lambda t: t.resize_(1 << 16), "out"),
    ("hardswish_backward", hsw_args, 0, lambda t: t.set_(torch.randn(4, 6)), "gradOutput"),  # same shape, moved
    ("hardswish_backward", hsw_args, 2, lambda t: t.as_strided_((4, 6), (1, 4)), "out"),
    ("rms_norm_grad", rms_grad_args, 1, lambda t: t.resize_(2, 1, 4), "x"),
    ("rms_norm_grad", rms_grad_args, 5, lambda t: t.untyped_storage().resize_(8), "dgammaOut"),
    ("embedding_dense_backward", emb_args, 1, lambda t: t.resize_(1 << 12), "indices"),
    ("embedding_dense_backward", emb_args, 5, lambda t: t.resize_(2, 5), "out"),
    ("moe_token_permute_grad", moe_grad_args, 1, lambda t: t.resize_(1 << 12), "sortedIndices"),
    ("moe_token_permute", _moe_permute_args, 0, lambda t: t.resize_(64, 6), "tokens"),
]


@pytest.mark.parametrize("op,make,pos,change,name", CHANGES,
                         ids=[f"{c[0]}-{c[4]}-{i}" for i, c in enumerate(CHANGES)])
def test_phase_2_refuses_tensors_changed_after_phase_1(op, make, pos, change, name):
    """A tensor resized, re-pointed, restrided or whose storage shrank between the phases: 161002 naming it,
    nothing run (the outs keep their sentinel); a new phase 1 on the changed tensors decides afresh."""
    args = make()
    outs = [a for a in args if isinstance(a, torch.Tensor)][-2 if op in ("rms_norm_grad", "moe_token_permute")
                                                              else -1:]
    for o in outs:
        o.fill_(7)
    first, second = PHASES[op]
    status, size, executor = first(*args)
    assert status == ACLNN_SUCCESS
    change(args[pos])
    ws = torch.empty(size, dtype=torch.uint8) if size else None
    assert second(ws, size, executor, None) == INVALID
    message = aclnn.aclGetRecentErrMsg()
    assert f"{name} changed after phase 1" in message, message
    unchanged = [o for o in outs if o is not args[pos]]
    assert all(torch.equal(o, torch.full_like(o, 7)) for o in unchanged), "nothing may run"


def test_phase_2_runs_on_changed_values():
    """Values are data, not layout: an executor run after the inputs' values changed in place computes on them."""
    grad, x, out = hsw_args()
    _, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    x.mul_(0.5)
    assert aclnn.aclnnHardswishBackward(None, size, executor, None) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.hardswish_backward(grad, x))


def test_executor_argument_checks():
    _, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(*hsw_args())
    assert aclnn.aclnnHardswishBackward(None, 0, None, None) == NULL
    assert aclnn.aclnnRmsNormGrad(None, 0, executor, None) == INVALID  # made for another op
    assert aclnn.aclnnHardswishBackward(None, size, executor, object()) == INVALID  # not a stream
    assert aclnn.aclnnHardswishBackward(None, size, executor, None) == ACLNN_SUCCESS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_work_is_enqueued_on_the_given_stream(fake):
    grad, x, out = (t.cuda() for t in hsw_args())
    stream = torch.cuda.Stream()
    _, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
    ws = torch.empty(size, dtype=torch.uint8, device="cuda")
    assert aclnn.aclnnHardswishBackward(ws, size, executor, stream) == ACLNN_SUCCESS
    stream.synchronize()
    assert fake.streams == [stream] and torch.equal(out, gradops.reference.hardswish_backward(grad, x))
    cpu_args = hsw_args()
    _, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(*cpu_args)
    assert aclnn.aclnnHardswishBackward(torch.empty(size, dtype=torch.uint8), size, executor, stream) == INVALID


# ------------------------------------------------------------------ a workspace over the call's own tensors
def _inside(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor with ``like``'s values laid at the start of ``buffer``'s bytes."""
    t = buffer[:like.numel() * like.element_size()].view(like.dtype).view(like.shape)
    t.copy_(like)
    return t


@pytest.mark.parametrize("op, make, pos", [
    ("rms_norm_grad", rms_grad_args, 0), ("rms_norm_grad", rms_grad_args, 1), ("rms_norm_grad", rms_grad_args, 4),
    ("rms_norm_grad", rms_grad_args, 5), ("embedding_dense_backward", emb_args, 0),
    ("embedding_dense_backward", emb_args, 1), ("embedding_dense_backward", emb_args, 5),
], ids=["rms-dy", "rms-x", "rms-dx", "rms-dgamma", "emb-grad", "emb-indices", "emb-out"])
def test_a_workspace_over_an_input_or_output_is_refused(backend, op, make, pos):
    # The CPU kernels need scratch for these two (dgamma partials, the embedding's row lists). A workspace sharing
    # bytes with an argument made the embedding kernel segfault (out as workspace) and overwrote the caller's input
    # (grad, dy, x) with a 0 status and a wrong result; 161002 before anything runs, as for any bad workspace.
    args = make()
    first, second = PHASES[op]
    status, size, executor = first(*args)
    if size == 0:
        pytest.skip(f"{executor.backend} needs no workspace for {op}")
    buffer = torch.zeros(size + args[pos].numel() * args[pos].element_size(), dtype=torch.uint8)
    args = with_(args, pos, _inside(buffer, args[pos]))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    before = [t.clone() for t in tensors]
    status, size, executor = first(*args)
    assert status == ACLNN_SUCCESS
    assert second(buffer, buffer.numel(), executor, None) == ACLNN_ERR_PARAM_INVALID
    assert "workspace overlaps" in aclnn.aclGetRecentErrMsg()
    for t, b in zip(tensors, before):  # compared as bytes: an unwritten out may hold NaN bits
        assert torch.equal(t.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), "written before refusal"
    # The executor stays usable: a workspace of its own runs it.
    assert second(torch.empty(size, dtype=torch.uint8), size, executor, None) == ACLNN_SUCCESS
