"""GRADOPS_BACKEND: the one selection point."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops import backend, reference


def test_torch_backend_is_the_reference(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    assert backend.select("rms_norm_grad", torch.device("cpu")) == ("torch", reference.rms_norm_grad)


def test_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "tpu")
    with pytest.raises(ValueError, match="GRADOPS_BACKEND='tpu'"):
        gradops.hardswish(torch.zeros(3))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gradops.hardswish(torch.zeros(3))


def test_auto_falls_back_to_torch_without_numba(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: None)
    assert backend.select("hardswish_backward", torch.device("cpu"))[0] == "torch"


def test_explicit_cpu_without_numba_raises(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
    monkeypatch.setattr(backend.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="numba is not installed"):
        backend.select("hardswish_backward", torch.device("cpu"))


def test_auto_on_cpu_prefers_the_compiled_path_when_installed(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    expected = "cpu" if backend.usable("cpu", torch.device("cpu"))[0] and backend._module("cpu") else "torch"
    assert backend.select("hardswish_backward", torch.device("cpu"))[0] == expected


def test_a_named_backend_that_cannot_run_is_an_op_error_with_561003(monkeypatch):
    import pickle

    from gradops.status import ACLNN_ERR_INNER_FIND_KERNEL_ERROR, OpError

    monkeypatch.setenv("GRADOPS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(backend.BackendUnavailable) as info:
        backend.decide("hardswish", torch.device("cpu"))
    err = info.value
    assert isinstance(err, OpError) and isinstance(err, RuntimeError)
    assert err.status == ACLNN_ERR_INNER_FIND_KERNEL_ERROR and "TRITON_INTERPRET=1" in str(err)
    again = pickle.loads(pickle.dumps(err))  # crosses process boundaries (DataLoader workers) intact
    assert type(again) is type(err) and str(again) == str(err) and again.status == err.status


def test_choose_remembers_per_environment_and_device(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    first = backend.choose("rms_norm_grad", cpu)
    assert first == ("torch", reference.rms_norm_grad, None) and backend.choose("rms_norm_grad", cpu) is first
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")  # another key: decided again, as decide() would
    assert backend.choose("rms_norm_grad", cpu) == backend.decide("rms_norm_grad", cpu)
    monkeypatch.setenv("GRADOPS_BACKEND", "tpu")  # never remembered past a refusal
    with pytest.raises(ValueError, match="tpu"):
        backend.choose("rms_norm_grad", cpu)


def test_choose_decides_again_when_the_backend_module_changes(monkeypatch):
    """A test that removes numba (tests/test_cpu_backend.py) must not leave auto on the reference afterwards."""
    import sys

    cpu = torch.device("cpu")
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    before = backend.choose("hardswish", cpu)
    if before.name != "cpu":
        pytest.skip("the compiled CPU backend is not installed")
    module = sys.modules["gradops.cpu"]
    monkeypatch.delitem(sys.modules, "gradops.cpu")
    real_module = backend._module
    monkeypatch.setattr(backend, "_module", lambda name: None if name == "cpu" else real_module(name))
    assert backend.choose("hardswish", cpu).name == "torch"
    monkeypatch.undo()
    assert sys.modules["gradops.cpu"] is module and backend.choose("hardswish", cpu) == before
