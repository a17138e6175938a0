"""The call plan (gradops.ops._plan): one check and one backend decision per argument metadata, shared by the
functional call and out= (issue 12), never remembering a refusal, lapsing with the environment."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import gradops
from gradops import aclnn, ascendc, backend, registry
from gradops.families.rms_norm import ops as rms
from gradops.ops._plan import CallPlan, Planner, forget_all
from gradops.status import ACLNN_ERR_INNER_FIND_KERNEL_ERROR


@pytest.fixture
def python_path():
    """The Python path of every call: the native extension's direct path (which plans through the same Planner
    objects, held by each op rather than looked up by module attribute) off for the test."""
    import gradops.native as native

    native.set_enabled(False)
    yield
    native.set_enabled(True)


def test_a_plan_is_remembered_per_metadata_and_environment(monkeypatch):
    x, g = torch.randn(4, 8), torch.randn(8)
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    first = rms.plan_rms_norm(x, g, 1e-6)
    assert isinstance(first, CallPlan) and first.backend.name == "torch"
    assert rms.plan_rms_norm(torch.randn(4, 8), torch.randn(8), 1e-6) is first  # same metadata, other values
    assert rms.plan_rms_norm(x, g, 1e-5) is not first  # a scalar is part of the key
    assert rms.plan_rms_norm(torch.randn(5, 8), g, 1e-6) is not first
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    assert rms.plan_rms_norm(x, g, 1e-6).backend == backend.decide("rms_norm", x.device)


def test_a_refusal_is_never_remembered():
    calls = []

    def check(x):
        calls.append(x.shape)
        if x.shape[0] == 0:
            raise gradops.OpError(161002, "op", "x", "rows", "none")
        return x.shape

    planner = Planner("hardswish", check)
    for _ in range(2):
        with pytest.raises(gradops.OpError):
            planner(torch.empty(0, 3))
    planner(torch.empty(2, 3))
    planner(torch.empty(2, 3))
    assert calls == [(0, 3), (0, 3), (2, 3)]


def test_forget_drops_every_plan():
    x, g = torch.randn(4, 8), torch.randn(8)
    first = rms.plan_rms_norm(x, g, 1e-6)
    backend.forget()
    assert rms.plan_rms_norm(x, g, 1e-6) is not first
    second = rms.plan_rms_norm(x, g, 1e-6)
    forget_all()
    assert rms.plan_rms_norm(x, g, 1e-6) is not second


def test_the_functional_call_and_out_share_the_plan(monkeypatch, python_path):
    """Issue 12.1: the out= path validated and picked the backend on its own."""
    seen = []
    real = rms.plan_rms_norm_grad

    def spy(*args):
        plan = real(*args)
        seen.append(plan)
        return plan

    monkeypatch.setattr(rms, "plan_rms_norm_grad", spy)
    dy, x, g = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    plain = gradops.rms_norm_grad(dy, x, rstd, g)
    into = gradops.rms_norm_grad(dy, x, rstd, g, out=(torch.empty(3, 8), torch.empty(8)))
    assert len(seen) == 2 and seen[0] is seen[1]
    assert all(torch.equal(a, b) for a, b in zip(plain, into))


def test_plans_key_on_the_device_of_every_tensor():
    """A plan is never reused for tensors on another device: the contract's same-device check runs again."""
    x, g = torch.randn(4, 8), torch.randn(8)
    rms.plan_rms_norm(x, g, 1e-6)
    with pytest.raises(gradops.OpError) as info:
        rms.plan_rms_norm(x, torch.randn(8, device="meta"), 1e-6)
    assert "device" in info.value.arg


@pytest.fixture
def recorder(monkeypatch, decided):
    """A backend, registered as ``recorder``, that runs the reference and records each op it is asked for; the one
    backend decision answers it for every op (the ``decided`` fixture)."""
    mod = types.ModuleType("gradops_test_recorder")
    mod.calls = []
    for op in registry.NAMES:
        def run(*args, op=op, **kwargs):
            mod.calls.append(op)
            return getattr(gradops.reference, op)(*args)
        setattr(mod, op, run)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(backend.MODULES, "recorder", mod.__name__)
    decided("recorder", mod)
    return mod


def test_every_surface_runs_the_backend_its_call_plan_chose(recorder, monkeypatch, python_path):
    """Issue 12.1: aclnn phase 1 and AscendC LayerNormGrad validated with the contract and picked a backend through
    ``backend.select`` beside the call plan; now each surface of an op plans through the op's planner and runs the
    plan's backend, and the aclnn executor names it."""
    planned = []
    plan = Planner.__call__

    def spy(self, *args, **options):
        planned.append(self.op)
        return plan(self, *args, **options)

    monkeypatch.setattr(Planner, "__call__", spy)
    x, dy, g = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    gradops.rms_norm_grad(dy, x, rstd, g)
    gradops.rms_norm_grad(dy, x, rstd, g, out=(torch.empty(4, 8), torch.empty(8)))
    status, _, executor = aclnn.aclnnRmsNormGradGetWorkspaceSize(dy, x, rstd, g, torch.empty(4, 8), torch.empty(8))
    assert status == 0 and executor.backend == "recorder"
    assert aclnn.aclnnRmsNormGrad(None, 0, executor) == 0
    assert recorder.calls == planned == ["rms_norm_grad"] * 3

    recorder.calls.clear()
    variance, mean = x.var(-1, unbiased=False), x.mean(-1)
    gradops.layer_norm_grad(dy, x, variance, mean, g, 1e-5)
    ascendc.LayerNormGrad(torch.empty(4, 8), torch.empty(4, 8), dy, x, variance, mean, g, 1e-5)
    assert recorder.calls == ["layer_norm_grad"] * 2 and planned[3:] == ["layer_norm_grad"] * 2

    recorder.calls.clear()
    planned.clear()
    grad, out = torch.randn(4, 8), torch.empty(5, 8)
    idx = torch.tensor([0, 4, 4, 1])
    for status, _, executor in (
            aclnn.aclnnHardswishBackwardGetWorkspaceSize(dy, x, torch.empty(4, 8)),
            aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize(grad, idx, 5, -1, False, out),
            aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize(torch.randn(4, 8), torch.randperm(4).int(), 2, False,
                                                           torch.empty(2, 8)),
            aclnn.aclnnMoeTokenPermuteGetWorkspaceSize(torch.randn(2, 8), torch.tensor([[1, 0], [0, 1]]), 0, False,
                                                       torch.empty(4, 8), torch.empty(4, dtype=torch.int32)),
            aclnn.aclnnRmsNormGetWorkspaceSize(x, g, 1e-6, torch.empty(4, 8), torch.empty(4))):
        assert status == 0 and executor.backend == "recorder", aclnn.aclGetRecentErrMsg()
    assert recorder.calls == []  # phase 1 plans; nothing has run
    assert planned == ["hardswish_backward", "embedding_dense_backward", "moe_token_permute_grad",
                       "moe_token_permute", "rms_norm"]


def test_an_unknown_backend_is_561003_on_every_surface(monkeypatch):
    """Issue 12.2: ``GRADOPS_BACKEND`` naming nothing was a plain ValueError from the functional API and a status
    only on the aclnn surface, each worded its own way; now it is the one decision's OpError (561003) everywhere."""
    monkeypatch.setenv("GRADOPS_BACKEND", "bogus")
    x = torch.randn(4, 6)
    with pytest.raises(gradops.OpError) as info:
        gradops.hardswish_backward(x, x)
    assert info.value.status == ACLNN_ERR_INNER_FIND_KERNEL_ERROR and "GRADOPS_BACKEND='bogus'" in str(info.value)
    assert isinstance(info.value, RuntimeError)  # the environment is wrong, not an argument
    status, _, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(x, x, torch.empty(4, 6))
    assert (status, executor) == (ACLNN_ERR_INNER_FIND_KERNEL_ERROR, None)
    assert "GRADOPS_BACKEND='bogus'" in aclnn.aclGetRecentErrMsg()
    with pytest.raises(gradops.OpError) as info:
        ascendc.LayerNormGrad(torch.empty(4, 6), torch.empty(4, 6), x, x, x.var(-1), x.mean(-1), torch.ones(6), 1e-5)
    assert info.value.status == ACLNN_ERR_INNER_FIND_KERNEL_ERROR
