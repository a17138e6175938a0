"""Errors against the float64 reference are within one output ulp plus float32 accumulation, or no larger than
PyTorch's own on the same inputs (``gradops check``'s criterion, run for every op, dtype and CPU backend)."""

from __future__ import annotations

import pytest
import torch

from gradops import check


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", check.OPS)
def test_no_worse_than_pytorch(op, dtype, backend):
    row = check.check_one(op, check.DTYPES[dtype], torch.device("cpu"), backend, 64, 520, seed=7)
    assert row.ok, row
    if row.torch_error is not None and row.error > row.bound:
        assert row.error <= row.torch_error, row
