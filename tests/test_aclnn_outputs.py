"""gradops.aclnn writes results straight into the caller's out tensors; an out with no view in the backend's result
shape gets a buffer carved from the workspace, counted in workspaceSize (issue 12.1)."""

from __future__ import annotations

import functools
import importlib
import types

import pytest
import torch

import gradops
import gradops.reference
from gradops import aclnn, backend
from gradops.aclnn import ACLNN_SUCCESS
from test_aclnn import hsw_args


@pytest.mark.parametrize("name", ["cpu", "torch"])
def test_results_go_straight_into_contiguous_outs_and_through_the_workspace_otherwise(name, monkeypatch, decided):
    """Issue 12.1: a backend that takes out= writes into the caller's tensors; an out without a view in the
    backend's result shape gets a buffer carved from the workspace, whose bytes phase 1 reports. The reference
    (no out=) computes with torch ops and is copied in, with nothing added to the workspace."""
    if name == "cpu" and not backend.usable("cpu", torch.device("cpu"))[0]:
        pytest.skip("the CPU kernels are not built here (python -m gradops.native)")
    monkeypatch.setenv("GRADOPS_BACKEND", name)
    x, dy, g = torch.randn(6, 4, 16), torch.randn(6, 4, 16), torch.randn(16)
    rstd = torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    want = gradops.reference.rms_norm_grad(dy.reshape(24, 16), x.reshape(24, 16), rstd.reshape(24), g)
    sizes, seen = {}, {}
    for layout in ("contiguous", "strided"):
        dx = torch.empty(6, 4, 16) if layout == "contiguous" else torch.full((16, 4, 6), float("nan")).permute(2, 1, 0)
        dgamma = torch.full((16,), float("nan"))
        module = importlib.import_module(backend.MODULES[name])
        fn = module.rms_norm_grad

        @functools.wraps(fn)  # keeps fn's signature: whether it takes out= is read from it
        def spy(*args, fn=fn, layout=layout, **kw):
            seen[layout] = kw.get("out")
            return fn(*args, **kw)

        decided(name, types.SimpleNamespace(rms_norm_grad=spy,
                                            rms_norm_grad_workspace=getattr(module, "rms_norm_grad_workspace", None)))
        status, size, executor = aclnn.aclnnRmsNormGradGetWorkspaceSize(dy, x, rstd, g, dx, dgamma)
        assert status == ACLNN_SUCCESS
        sizes[layout] = size
        workspace = torch.empty(size, dtype=torch.uint8) if size else None
        assert aclnn.aclnnRmsNormGrad(workspace, size, executor, None) == ACLNN_SUCCESS
        torch.testing.assert_close(dx.reshape(24, 16), want[0], rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(dgamma, want[1], rtol=2e-5, atol=2e-6)
        if name == "cpu":
            out_dx, out_dgamma = seen[layout]
            assert out_dgamma.data_ptr() == dgamma.data_ptr()  # contiguous: written in place
            if layout == "contiguous":
                assert out_dx.data_ptr() == dx.data_ptr()
            else:  # a buffer inside the caller's workspace
                assert workspace.data_ptr() <= out_dx.data_ptr() < workspace.data_ptr() + size
        else:
            assert seen[layout] is None
    carved = 24 * 16 * 4
    if name == "cpu":
        assert sizes["contiguous"] + carved <= sizes["strided"] <= sizes["contiguous"] + carved + 2 * 64
    else:
        assert sizes["strided"] == sizes["contiguous"]


def test_a_workspace_buffer_starting_anywhere_holds_the_carved_results(monkeypatch):
    if not backend.usable("cpu", torch.device("cpu"))[0]:
        pytest.skip("the CPU kernels are not built here (python -m gradops.native)")
    monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
    grad, x, _ = hsw_args()
    want = gradops.hardswish_backward(grad, x)  # the same backend through the PyTorch API
    for shift in range(0, 9, 4):  # void*: the caller's buffer need not be aligned
        out = torch.full((6, 4), float("nan")).t()
        status, size, executor = aclnn.aclnnHardswishBackwardGetWorkspaceSize(grad, x, out)
        assert status == ACLNN_SUCCESS and size >= out.numel() * 4
        buffer = torch.empty(size + shift, dtype=torch.uint8)[shift:]
        assert aclnn.aclnnHardswishBackward(buffer, size, executor, None) == ACLNN_SUCCESS
        assert torch.equal(out, want)
