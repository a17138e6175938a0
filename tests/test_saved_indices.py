"""Indices that change between a forward and its backward (issue 15, finding 1).

The eager embedding and MoE-permute backwards reuse the indices their forward checked or produced, without a
second host-side range test. Autograd's saved-tensor version check does not see every change: a data pipeline
refilling its batch buffer through numpy, or code writing through ``.data``, changes the values behind its back.
Every backend therefore tests the range where it reads the indices, and refuses with the same OpError the public
functions raise; nothing is read or written out of bounds. These ran into a segmentation fault (CPU kernel) or
silently wrong gradients before, so each case runs in a child process and the test asserts a clean exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import gradops
from gradops import reference

_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    import gradops, gradops.nn

    def outcome(fn):
        try:
            fn()
            return "no error"
        except gradops.OpError as e:
            return f"OpError {e.status}: {e}"

    def embedding(value):
        arr = np.array([1, 2, 3]); idx = torch.from_numpy(arr); emb = gradops.nn.Embedding(10, 4)
        y = emb(idx); arr[1] = value
        y.sum().backward()

    def moe(value):
        tokens = torch.randn(4, 3, requires_grad=True)
        permuted, sorted_indices = gradops.moe_token_permute(tokens, torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]]))
        sorted_indices.data[0] = value
        permuted.sum().backward()

    print(json.dumps({
        "embedding_huge": outcome(lambda: embedding(1_000_000)),
        "embedding_negative": outcome(lambda: embedding(-5)),
        "moe_huge": outcome(lambda: moe(100_000)),
        "moe_negative": outcome(lambda: moe(-1)),
    }))
""")


def test_changed_saved_indices_are_refused_not_a_crash(backend, monkeypatch):
    result = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"child ended with {result.returncode}: {result.stderr[-2000:]}"
    got = json.loads(result.stdout.strip().splitlines()[-1])
    value = {"huge": {"embedding": 1000000, "moe": 100000}, "negative": {"embedding": -5, "moe": -1}}
    for case, text in got.items():
        op, kind = case.split("_")
        assert text.startswith("OpError 161002"), (case, text)
        assert f"got {value[kind][op]} at " in text, (case, text)
        assert ("embedding_dense_backward: indices" if op == "embedding"
                else "moe_token_permute_grad: sorted_indices") in text


def _backend_impl(name: str, op: str):
    from gradops import backend

    monkey = backend._module(name)
    return getattr(monkey, op)


@pytest.mark.parametrize("bad", [10, -1, 2**40], ids=["at-V", "negative", "huge"])
def test_every_backend_refuses_bad_embedding_indices(backend, bad):
    """The backend functions themselves (reached by the saved-index backward, aclnn and AscendC): the same OpError
    as the public check, the first bad position named, and a preallocated ``out`` left untouched."""
    impl = _backend_impl(backend, "embedding_dense_backward")
    grad = torch.randn(5, 3)
    idx = torch.tensor([1, 2, bad, 4, bad])
    out = torch.full((10, 3), 7.0)
    kwargs = {"out": out} if backend == "cpu" else {}
    with pytest.raises(gradops.OpError) as info:
        impl(grad, idx, 10, -1, False, **kwargs)
    assert info.value.status == 161002
    assert f"got {bad} at flat position 2" in str(info.value)
    with pytest.raises(gradops.OpError) as public:
        gradops.embedding_dense_backward(grad, idx, 10)
    assert str(public.value) == str(info.value)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("bad", [8, -1, 2**31 - 1], ids=["at-TK", "negative", "huge"])
def test_every_backend_refuses_bad_sorted_indices(backend, bad):
    impl = _backend_impl(backend, "moe_token_permute_grad")
    grad = torch.randn(8, 3)
    si = torch.tensor([0, 1, 2, bad, 4, 5, 6, 7], dtype=torch.int32)
    with pytest.raises(gradops.OpError) as info:
        impl(grad, si, 2)
    assert info.value.status == 161002
    assert f"got {bad} at position 3" in str(info.value)
    with pytest.raises(gradops.OpError) as public:
        gradops.moe_token_permute_grad(grad, si, 2)
    assert str(public.value) == str(info.value)


def test_dropped_rows_are_still_allowed(backend):
    """Entries in [A, T*K) name rows the forward dropped: they add nothing and are not an error."""
    grad = torch.randn(5, 3, dtype=torch.float64).float()
    si = torch.tensor([0, 7, 2, 5, 4, 6, 1, 3], dtype=torch.int32)
    got = _backend_impl(backend, "moe_token_permute_grad")(grad, si, 2)
    want = reference.moe_token_permute_grad(grad, si, 2)
    assert torch.equal(got, want)


def test_deferred_flags_raise_once_then_drop_the_rest(monkeypatch):
    """The CUDA path of gradops.launch._common, with stand-in events (CPU torch has no CUDA): the first completed bad
    flag raises and drops every flag still queued (one bad index is flagged by the forward and by the backward); a
    completed good flag leaves the queue, one still in flight stays."""
    from collections import deque

    pytest.importorskip("triton")
    from gradops.launch import _common

    class Done:  # a completed CUDA event
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class InFlight(Done):
        def query(self) -> bool:
            return False

    def entry(bad: bool, event: Done | None = None):
        return torch.tensor(int(bad)), event or Done(), lambda: RuntimeError("bad index")

    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(_common, "_PENDING", deque([entry(False), entry(True), entry(True), entry(False, InFlight())]))
    with pytest.raises(RuntimeError, match="bad index"):
        _common.raise_pending()
    assert not _common._PENDING
    _common.raise_pending(wait=True)  # reported once
    monkeypatch.setattr(_common, "_PENDING", deque([entry(False), entry(False, InFlight())]))
    _common.raise_pending()
    assert len(_common._PENDING) == 1
