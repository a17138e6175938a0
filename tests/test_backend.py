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
