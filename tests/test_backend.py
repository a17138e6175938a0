"""GRADOPS_BACKEND: the one selection point."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops import backend, native, reference
from gradops.families.hardswish import ops as hardswish_ops
from gradops.families.rms_norm import ops as rms_ops
from gradops.spec import Impl, OpSpec

#: What a failed build of the CPU kernels leaves behind (gradops.native.ensure_built), simulated.
NOT_BUILT = "the native CPU kernels could not be built (CalledProcessError: simulated: no compiler)"


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


def test_auto_falls_back_to_torch_without_the_cpu_kernels(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    monkeypatch.setattr(native, "_failure", NOT_BUILT)
    monkeypatch.setattr(backend, "_slow_path_warned", False)
    with pytest.warns(backend.SlowPathWarning, match="could not be built"):
        assert backend.select("hardswish_backward", torch.device("cpu"))[0] == "torch"


def test_explicit_cpu_without_the_cpu_kernels_raises(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
    monkeypatch.setattr(native, "_failure", NOT_BUILT)
    with pytest.raises(RuntimeError, match="could not be built"):
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


def test_a_planner_remembers_its_choice_per_environment_and_device(monkeypatch):
    """The backend decision is remembered beside an op's plans (ops/_plan.py): a new shape reuses it."""
    cpu = torch.device("cpu")
    grad = rms_ops.plan_rms_norm_grad
    args = lambda rows: (torch.randn(rows, 8), torch.randn(rows, 8), torch.rand(rows), torch.randn(8))  # noqa: E731
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    first = grad(*args(4)).backend
    assert first == ("torch", reference.rms_norm_grad, None, None) and grad(*args(5)).backend is first
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")  # another key: decided again, as decide() would
    assert grad(*args(6)).backend == backend.decide("rms_norm_grad", cpu)
    monkeypatch.setenv("GRADOPS_BACKEND", "tpu")  # never remembered past a refusal
    for _ in range(2):
        with pytest.raises(backend.BackendUnavailable, match="tpu"):
            grad(*args(7))


def test_a_planner_decides_again_when_the_backend_module_changes(monkeypatch):
    """A test that takes the CPU kernels away (below) must not leave auto on the reference afterwards."""
    import sys

    plan = hardswish_ops.plan_hardswish_backward
    x = torch.randn(4, 8)
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    before = plan(x, x).backend
    if before.name != "cpu":
        pytest.skip("the compiled CPU backend is not installed")
    module = sys.modules["gradops.cpu"]
    monkeypatch.delitem(sys.modules, "gradops.cpu")
    real_module = backend._module
    monkeypatch.setattr(backend, "_module", lambda name: None if name == "cpu" else real_module(name))
    monkeypatch.setattr(backend, "_slow_path_warned", False)
    with pytest.warns(backend.SlowPathWarning, match="importing gradops.cpu failed"):
        assert plan(x, x).backend.name == "torch"
        assert plan(torch.randn(5, 8), torch.randn(5, 8)).backend.name == "torch"  # a new shape: the same choice
    monkeypatch.undo()
    assert sys.modules["gradops.cpu"] is module and plan(x, x).backend == before


@pytest.mark.parametrize("failure", ["missing", "broken"])
def test_auto_says_once_that_cpu_tensors_take_the_slow_path(failure, monkeypatch):
    """Without the CPU kernels auto mode still computes (the reference, ~10-50x slower), and says so once per
    process, naming the cause and the fix: not once per op, shape or call."""
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    monkeypatch.setattr(backend, "_slow_path_warned", False)
    if failure == "missing":  # the build failed (no compiler, no ninja)
        monkeypatch.setattr(native, "_failure", NOT_BUILT)
        cause = NOT_BUILT
    else:  # built, but the library does not load (e.g. built against another torch and not rebuildable)
        real_import = backend.importlib.import_module

        def import_module(name, *args):
            if name == "gradops.cpu":
                raise ImportError("the native library does not load (simulated)")
            return real_import(name, *args)

        monkeypatch.setattr(backend.importlib, "import_module", import_module)
        cause = "importing gradops.cpu failed: the native library does not load (simulated)"
    backend.forget()  # remembered choices and call plans were made with the kernels present
    try:
        x, g = torch.randn(4, 8), torch.ones(4, 8)
        with pytest.warns(backend.SlowPathWarning) as caught:
            first = gradops.hardswish_backward(g, x)
            gradops.hardswish_backward(g, x)
            gradops.rms_norm(torch.randn(16, 32), torch.ones(32))  # another op, another shape
        assert torch.equal(first, reference.hardswish_backward(g, x))
        slow = [str(w.message) for w in caught if issubclass(w.category, backend.SlowPathWarning)]
        assert len(slow) == 1, slow
        assert cause in slow[0] and native.FIX in slow[0] and "GRADOPS_BACKEND=torch" in slow[0]
    finally:
        monkeypatch.undo()
        backend.forget()


def test_no_slow_path_warning_when_the_reference_is_chosen_or_the_kernels_load(monkeypatch, recwarn):
    monkeypatch.setattr(backend, "_slow_path_warned", False)
    backend.forget()
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")  # chosen on purpose
    gradops.hardswish(torch.zeros(3))
    cpu = torch.device("cpu")
    if backend.usable("cpu", cpu)[0] and backend._module("cpu") is not None:
        # an op the compiled backend leaves to the reference (documented: no warning, the kernels did load)
        only = OpSpec("only_in_the_reference", "-", True, providers={"torch": lambda: Impl(lambda *args: None)})
        monkeypatch.setenv("GRADOPS_BACKEND", "auto")
        assert backend.decide(only, cpu).name == "torch"
    assert not [w for w in recwarn if issubclass(w.category, backend.SlowPathWarning)]
    assert not backend._slow_path_warned
