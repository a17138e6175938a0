"""gradops.launch's fixes to Triton's interpreter: it must round like the GPU, or the tier tests other numerics."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import gradops.launch  # noqa: F401  (applies the interpreter fixes)

pytestmark = pytest.mark.interpreter


@triton.jit
def _cast_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask).to(Y.dtype.element_ty), mask=mask)


def test_float32_to_bfloat16_rounds_to_nearest_even():
    x = torch.randn(4096) * 10
    # specials, a carry into the exponent (-1.9975 -> -2), the largest float (-> inf), subnormals, ties
    x[:9] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0, 1e-40, -1.9975202, 1.00390625,
                          1.01171875])
    y = torch.empty(4096, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, y, 4096, BLOCK=4096)
    ref = x.to(torch.bfloat16)
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y[~ref.isnan()].view(torch.int16), ref[~ref.isnan()].view(torch.int16))


def test_runtime_loop_bounds_work():
    @triton.jit
    def _loop_kernel(Y, n):
        acc = 0
        for i in range(n):
            acc += i
        tl.store(Y, acc)

    y = torch.zeros(1, dtype=torch.int32)
    _loop_kernel[(1,)](y, 10)
    assert y.item() == 45
