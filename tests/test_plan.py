"""The call plan (gradops.ops._plan): one check and one backend decision per argument metadata, shared by the
functional call and out= (issue 12), never remembering a refusal, lapsing with the environment."""

from __future__ import annotations

import importlib

import pytest
import torch

import gradops
from gradops import backend
from gradops.ops._plan import CallPlan, Planner, forget_all

rms = importlib.import_module("gradops.ops.rms_norm")


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


def test_the_functional_call_and_out_share_the_plan(monkeypatch):
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
