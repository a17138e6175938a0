"""Shared by the gradops.native tests: the skip rule, and running a module on its native node and on the Python
path so that the two can be compared bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

import gradops.native as native

#: Skipped where the extension is not built, except under ``GRADOPS_REQUIRE_NATIVE=1`` (scripts/test.sh sets it
#: when setup built the extension), where a missing extension fails.
skip_unless_native = pytest.mark.skipif(
    native.status() != "loaded" and os.environ.get("GRADOPS_REQUIRE_NATIVE") != "1",
    reason=f"gradops.native: {native.status()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def step(module: torch.nn.Module, x: torch.Tensor, upstream, create_graph: bool = False):
    """Forward, backward of ``upstream(y)``; returns the node's name, y and every gradient."""
    x = x.detach().requires_grad_(x.requires_grad)
    for p in module.parameters():
        p.grad = None
    y = module(x)
    upstream(y).backward(create_graph=create_graph)
    grads = [t.grad for t in (x, *module.parameters()) if t.requires_grad]
    return y.grad_fn.name(), y, grads


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as the integers of their width: equal then means the same bits, NaN payloads and signed zeros too."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def same(a, b) -> None:
    """Equal bits, dtypes, shapes and strides, tensor by tensor."""
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride()
        assert torch.equal(_bits(u), _bits(v))


def both(module, x, upstream=lambda y: (y * 1.5).sum(), create_graph=False):
    """The module's results on the native node and on the Python path: (native name, python name, native results,
    python results)."""
    name, y, grads = step(module, x, upstream, create_graph)
    native.set_enabled(False)
    try:
        name_py, y_py, grads_py = step(module, x, upstream, create_graph)
    finally:
        native.set_enabled(True)
    return name, name_py, [y, *grads], [y_py, *grads_py]


def on_threads(counts, run):
    """``[run() for each thread count]`` with torch's intra-op threads set to each, restored after."""
    before = torch.get_num_threads()
    try:
        results = []
        for threads in counts:
            torch.set_num_threads(threads)
            results.append(run())
        return results
    finally:
        torch.set_num_threads(before)
