"""Issue 36: no crash, no hang, no silent wrong answer - on every path a call can take (the Python path, the native
extension's remembered direct programs and autograd nodes, the saved tensors a backward reads).

Each test runs on the native path (skipped where the extension is not built, failed under GRADOPS_REQUIRE_NATIVE=1)
and on the Python path (the extension switched off), and warms each call first where a remembered plan or program
is what a later call would take: a check made only when a plan is made would pass a later call unchecked.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch

import gradops
import gradops.native as native
from gradops import OpError
from gradops.contract import _common
from gradops.status import ACLNN_ERR_INNER_NULLPTR, ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR
from native_paths import skip_unless_native

NON_TENSORS = [None, 3, 1.5, [1.0, 2.0], "x", (1,)]


@pytest.fixture(params=["native", "python"])
def path(request):
    """The path under test: the native extension loaded, or switched off (every call on the Python path)."""
    if request.param == "native":
        if native.status() != "loaded":
            if os.environ.get("GRADOPS_REQUIRE_NATIVE") == "1":
                pytest.fail(f"gradops.native: {native.status()}")
            pytest.skip(f"gradops.native: {native.status()}")
        yield "native"
        return
    native.set_enabled(False)
    try:
        yield "python"
    finally:
        native.set_enabled(True)


def free(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage freed, as FSDP frees a parameter's between uses."""
    t.untyped_storage().resize_(0)
    return t


def refused(err: pytest.ExceptionInfo, arg: str, status: int) -> None:
    assert isinstance(err.value, OpError), repr(err.value)
    assert err.value.arg == arg and err.value.status == status, str(err.value)


# ---------------------------------------------------------------- item 1: a module input that is not a tensor


def _modules():
    return {"LayerNorm": gradops.nn.LayerNorm(8),
            "LayerNorm-no-affine": gradops.nn.LayerNorm(8, elementwise_affine=False),
            "LayerNorm-2d": gradops.nn.LayerNorm((2, 4)), "RMSNorm": gradops.nn.RMSNorm(8),
            "Hardswish": gradops.nn.Hardswish(), "Embedding": gradops.nn.Embedding(4, 8),
            "Embedding-max-norm": gradops.nn.Embedding(4, 8, max_norm=1.0)}


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("value", NON_TENSORS, ids=repr)
def test_module_refuses_a_non_tensor_input(path, value, grad, backend, monkeypatch):
    """The native LayerNorm node unpacked x unchecked (a segfault for all six values, GRADOPS_BACKEND=torch too);
    modules without a weight read x.new_ones / x.dtype first (AttributeError)."""
    if backend is not None:
        monkeypatch.setenv("GRADOPS_BACKEND", backend)
    x = torch.randn(3, 8, requires_grad=True)
    for name, module in _modules().items():
        warm = torch.tensor([0, 1]) if "Embedding" in name else x.view(3, 2, 4) if name == "LayerNorm-2d" else x
        module(warm)  # a remembered plan for the node, if any
        with torch.set_grad_enabled(grad), pytest.raises(OpError) as err:
            module(value)
        want = ACLNN_ERR_PARAM_NULLPTR if value is None else ACLNN_ERR_PARAM_INVALID
        assert err.value.arg == ("indices" if "Embedding" in name else
                                 "self" if name == "Hardswish" else "x"), (name, str(err.value))
        assert err.value.status == want, (name, str(err.value))


@pytest.mark.parametrize("value", NON_TENSORS, ids=repr)
def test_node_entries_refuse_non_tensors(path, value):
    """Every argument of the native nodes' entries, each in turn, beside tensors that require grad (which is what
    sends a call to a node): the op's OpError naming it, never an unchecked unpack."""
    gamma, beta = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    x = torch.randn(3, 8, requires_grad=True)
    gradops.ops.layer_norm_output(x, gamma, beta, 1e-5)
    for pos, arg in enumerate(("x", "gamma", "beta")):
        args = [x, gamma, beta]
        args[pos] = value
        with pytest.raises(OpError) as err:
            gradops.ops.layer_norm_output(*args, 1e-5)
        assert err.value.arg == arg, str(err.value)
    weight = torch.randn(4, 8, requires_grad=True)
    gradops.embedding(weight, torch.tensor([0, 1]))
    with pytest.raises(OpError) as err:
        gradops.embedding(value, torch.zeros(2, requires_grad=True))  # float indices requiring grad
    assert err.value.arg == "weight", str(err.value)
    with pytest.raises(OpError) as err:
        gradops.embedding(weight, value)
    assert err.value.arg == "indices", str(err.value)
    with pytest.raises(OpError) as err:
        gradops.hardswish(value)
    assert err.value.arg == "self", str(err.value)


@skip_unless_native
def test_planned_entries_decline_non_tensors():
    """The extension's own entries, called as gradops calls them, answer None (the Python path then refuses)."""
    ext = native.module()
    gamma = torch.ones(8, requires_grad=True)
    for value in NON_TENSORS:
        assert ext.layer_norm_planned(value, gamma, gamma, 1e-5) is None
        assert ext.layer_norm_planned(torch.randn(2, 8), value, gamma, 1e-5) is None
        assert ext.embedding_planned(value, torch.zeros(2, requires_grad=True), -1, False) is None
        assert ext.hardswish_planned(value) is None


# ---------------------------------------------------------------- item 2: freed storage


def test_freed_inputs_of_the_functions(path):
    """layer_norm(x) and embedding(weight, indices) with a freed or shrunk storage, after a call of the same
    metadata (a remembered plan, a direct program, a node's plan), with and without autograd recording."""
    for grad in (False, True):
        x, g, b = torch.randn(4, 8, requires_grad=grad), torch.ones(8), torch.zeros(8)
        gradops.layer_norm(x, g, b)
        gradops.ops.layer_norm_output(x, g, b, 1e-5)
        with torch.no_grad():
            free(x)
        with pytest.raises(OpError) as err:
            gradops.layer_norm(x, g, b)
        refused(err, "x", ACLNN_ERR_PARAM_NULLPTR)
        with pytest.raises(OpError) as err:
            gradops.ops.layer_norm_output(x, g, b, 1e-5)
        refused(err, "x", ACLNN_ERR_PARAM_NULLPTR)

        w, idx = torch.randn(10, 8, requires_grad=grad), torch.tensor([1, 2, 3])
        gradops.embedding(w, idx)
        free(idx)
        with pytest.raises(OpError) as err:
            gradops.embedding(w, idx)
        refused(err, "indices", ACLNN_ERR_PARAM_NULLPTR)
        idx = torch.tensor([1, 2, 3])
        with torch.no_grad():
            free(w)
        with pytest.raises(OpError) as err:
            gradops.embedding(w, idx)
        refused(err, "weight", ACLNN_ERR_PARAM_NULLPTR)

    x = torch.randn(4, 8)
    gradops.hardswish(x)
    x.untyped_storage().resize_(16)  # shrunk below the 128 bytes the view addresses: 161002
    with pytest.raises(OpError) as err:
        gradops.hardswish(x)
    refused(err, "self", ACLNN_ERR_PARAM_INVALID)
    base = torch.randn(40)
    view = base[8:].view(4, 8)  # an offset view whose storage is shrunk to 36 elements: its last 4 are gone
    gradops.hardswish(view)
    base.untyped_storage().resize_(36 * 4)
    with pytest.raises(OpError) as err:
        gradops.hardswish(view)
    refused(err, "self", ACLNN_ERR_PARAM_INVALID)


def test_freed_saved_tensors_before_backward(path):
    """A module's weight (FSDP frees parameters after the forward) or the indices a lookup saved, freed before the
    backward: the backward raises the op's OpError naming it (was a segfault in each node)."""
    norm = gradops.nn.LayerNorm(8)
    x = torch.randn(4, 8, requires_grad=True)
    norm(x).sum().backward()  # a remembered plan, as in training
    y = norm(x)
    with torch.no_grad():
        free(norm.weight)
    with pytest.raises(OpError) as err:
        y.sum().backward()
    refused(err, "gamma", ACLNN_ERR_PARAM_NULLPTR)

    emb = gradops.nn.Embedding(10, 8)
    idx = torch.tensor([1, 2, 3])
    emb(idx).sum().backward()
    y = emb(idx)
    free(idx)
    with pytest.raises(OpError) as err:
        y.sum().backward()
    refused(err, "indices", ACLNN_ERR_PARAM_NULLPTR)

    act = gradops.nn.Hardswish()
    x = torch.randn(4, 8, requires_grad=True)
    act(x).sum().backward()
    y = act(x)
    with torch.no_grad():
        free(x)
    with pytest.raises(OpError) as err:
        y.sum().backward()
    assert err.value.status == ACLNN_ERR_PARAM_NULLPTR, str(err.value)


def test_freed_upstream_gradient(path):
    norm = gradops.nn.LayerNorm(8)
    x = torch.randn(4, 8, requires_grad=True)
    norm(x).backward(torch.ones(4, 8))
    y = norm(x)
    with pytest.raises(OpError) as err:
        y.backward(free(torch.ones(4, 8)))
    refused(err, "dy", ACLNN_ERR_PARAM_NULLPTR)


def test_freed_out(path):
    x = torch.randn(4, 8)
    gradops.hardswish_backward(x, x, out=torch.empty(4, 8))  # the direct path's program for out= calls
    with pytest.raises(OpError) as err:
        gradops.hardswish_backward(x, x, out=free(torch.empty(4, 8)))
    refused(err, "out", ACLNN_ERR_PARAM_NULLPTR)


def _layouts():
    """Tensors of every kind the storage test meets: whole, empty, views with offsets, broadcast, transposed,
    freed, shrunk, meta."""
    base = torch.randn(6, 8)
    shrunk = torch.randn(6, 8)
    views = {"shrunk-ok": shrunk[:2], "shrunk-offset": shrunk[2:], "shrunk-column": shrunk[:, 7]}  # before the shrink
    shrunk.untyped_storage().resize_(20 * 4)
    return {"whole": base, "empty": torch.empty(0, 8), "offset": base[2:], "column": base[:, 3],
            "broadcast": torch.zeros(1).expand(5, 4), "transposed": base.t(), "freed": free(torch.randn(3, 3)),
            "freed-empty": free(torch.randn(0)), "shrunk": shrunk, **views, "meta": torch.empty(4, 4, device="meta")}


WANT_HOLLOW = {"freed", "shrunk", "shrunk-offset", "shrunk-column"}


def test_hollow_rule():
    """The Python form of the storage test, on every layout."""
    for name, t in _layouts().items():
        assert _common._hollow(t) is (name in WANT_HOLLOW), name


@skip_unless_native
def test_hollow_in_c_is_the_python_rule():
    """The extension's form (what contract._memo.key_of asks once the extension is loaded) answers as Python's,
    and is the one installed."""
    ext = native.module()
    assert _common.hollow is ext.hollow
    for name, t in _layouts().items():
        assert ext.hollow(t) is _common._hollow(t), name
    assert ext.hollow(None) is False and ext.hollow(3) is False


def test_hollow_under_torch_func():
    """Inside grad / vmap the checks see functorch wrappers, which have no storage of their own: not hollow, and no
    error from asking."""
    from torch.func import grad, vmap

    seen = []

    def f(t):
        seen.append(_common._hollow(t))
        return t.sum()

    grad(f)(torch.randn(3))
    vmap(f)(torch.randn(2, 3))
    assert seen == [False, False]


# ---------------------------------------------------------------- item 3: out= in a child forked after parallel work


def _out_calls_in_child() -> None:
    x = torch.randn(512, 1024)
    g, b = torch.ones(1024), torch.zeros(1024)
    gradops.layer_norm(x, g, b, out=(torch.empty(512, 1024), torch.empty(512), torch.empty(512)))
    gradops.layer_norm(x, g, b, out=(torch.empty(1024, 512).t(), torch.empty(512), torch.empty(512)))
    gradops.hardswish(x, out=torch.empty(512, 1024))
    gradops.hardswish_backward(x, x, out=torch.empty(1024, 512).t())
    grad = torch.randn(4096, 256)
    gradops.embedding_dense_backward(grad, torch.randint(0, 4096, (4096,)), 4096, out=torch.empty(4096, 256))
    os._exit(0)


def test_out_calls_in_a_child_forked_after_a_parallel_region():
    """The copy into an out (and everything else of an out= call) runs on one thread there: GNU OpenMP does not
    survive fork, and a parallel region in the child never returns (this hung; also with GRADOPS_NATIVE=0). A
    timeout turns a regression into a failure."""
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no parallel region to fork after")
    x = torch.randn(512, 1024)
    gradops.layer_norm(x, torch.ones(1024), torch.zeros(1024))  # gradops' kernels on the thread pools
    torch.randn(2048, 2048).sum()  # and torch's
    child = multiprocessing.get_context("fork").Process(target=_out_calls_in_child)
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the out= calls in the forked child did not return in 120 s")
    assert child.exitcode == 0


# ---------------------------------------------------------------- items 6, 7, 15: what an out may be


def _negated(shape) -> torch.Tensor:
    """A float32 tensor with the lazy negation bit: its memory holds the negation of what it reads."""
    return torch.zeros(*shape, dtype=torch.complex64).conj().imag


def test_neg_bit_outs_read_back_the_results(path):
    x = torch.randn(4, 8)
    for _ in range(2):  # the second call on the remembered programs
        for out in (_negated((4, 8)), torch.zeros(4, 8)._neg_view()):
            assert out.is_neg()
            gradops.hardswish_backward(x, x, out=out)
            assert torch.equal(out, gradops.hardswish_backward(x, x))
            gradops.hardswish(x, out=out)
            assert torch.equal(out, gradops.hardswish(x))
        g, b = torch.randn(8), torch.randn(8)
        outs = (_negated((4, 8)), _negated((4,)), torch.empty(4))
        gradops.layer_norm(x, g, b, out=outs)
        for got, want in zip(outs, gradops.layer_norm(x, g, b)):
            assert torch.equal(got, want)
        grad, idx = torch.randn(6, 8), torch.tensor([0, 2, 2, 5, 1, 0])
        table = _negated((7, 8))
        gradops.embedding_dense_backward(grad, idx, 7, out=table)
        assert torch.equal(table, gradops.embedding_dense_backward(grad, idx, 7))


def test_conj_bit_out_is_refused(path):
    """A conjugated out is complex, a dtype no result has: refused by its dtype, nothing written."""
    x = torch.randn(4, 8)
    out = torch.zeros(4, 8, dtype=torch.complex64).conj()
    assert out.is_conj()
    with pytest.raises(OpError) as err:
        gradops.hardswish_backward(x, x, out=out)
    refused(err, "out.dtype", ACLNN_ERR_PARAM_INVALID)


def test_outs_that_require_grad(path):
    """Refused under grad mode, naming the out, with nothing written (torch's out= functions refuse them there);
    written under no_grad, as torch writes them."""
    x = torch.randn(4, 8)
    for _ in range(2):
        out = torch.zeros(4, 8, requires_grad=True)
        with pytest.raises(OpError) as err:
            gradops.hardswish_backward(x, x, out=out)
        refused(err, "out", ACLNN_ERR_PARAM_INVALID)
        assert not out.detach().any()
        outs = (torch.zeros(4, 8), torch.zeros(4), torch.zeros(4, requires_grad=True))
        with pytest.raises(OpError) as err:
            gradops.layer_norm(x, torch.ones(8), torch.zeros(8), out=outs)
        refused(err, "out[2]", ACLNN_ERR_PARAM_INVALID)
        assert not any(o.detach().any() for o in outs)
        table = torch.zeros(5, 8, requires_grad=True)
        with pytest.raises(OpError) as err:
            gradops.embedding_dense_backward(torch.randn(3, 8), torch.tensor([0, 1, 4]), 5, out=table)
        refused(err, "out", ACLNN_ERR_PARAM_INVALID)
        with torch.no_grad():
            gradops.hardswish_backward(x, x, out=out)
        assert torch.equal(out.detach(), gradops.hardswish_backward(x, x))


def test_out_overlapping_an_input_through_another_storage(path):
    """Two torch storages over one numpy array, shifted by one element: the out's bytes meet the input's."""
    memory = np.zeros(33, dtype=np.float32)
    a = torch.from_numpy(memory[:32]).view(4, 8)
    b = torch.from_numpy(memory[1:]).view(4, 8)
    a.copy_(torch.randn(4, 8))
    before = memory.copy()
    with pytest.raises(OpError) as err:
        gradops.hardswish_backward(a, a, out=b)
    refused(err, "out", ACLNN_ERR_PARAM_INVALID)
    assert np.array_equal(memory, before)
    apart = torch.from_numpy(np.zeros(32, dtype=np.float32)).view(4, 8)  # another array: accepted
    gradops.hardswish_backward(a, a, out=apart)
    assert torch.equal(apart, gradops.hardswish_backward(a, a))


# ---------------------------------------------------------------- item 12: a table memory cannot hold


@pytest.mark.parametrize("num_weights", [2**40, 2**62, 2**62 + 2**18])
def test_num_weights_beyond_memory(path, num_weights):
    """The table's size comes from num_weights alone: the OpError naming it on every path (the native direct
    program raised a bare RuntimeError; 2**62 + 2**18 rows of 4 floats wrap to 4 MiB in int64)."""
    grad, idx = torch.randn(3, 4), torch.tensor([0, 1, 2])
    gradops.embedding_dense_backward(grad, idx, 8)
    with pytest.raises(OpError) as err:
        gradops.embedding_dense_backward(grad, idx, num_weights)
    refused(err, "num_weights", ACLNN_ERR_INNER_NULLPTR)
