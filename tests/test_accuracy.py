"""Errors against the float64 reference are no larger than PyTorch's own on the same inputs (``gradops check``
runs the same comparison), up to two ulps of the output dtype: the two compute in different orders, so either
can land one rounding on the other side (measured worst: 1.6x PyTorch's at float32, i.e. 1.5e-7 against 1.0e-7;
before the CPU kernels folded their row blocks pairwise, 3.8x). Where PyTorch lacks the op, the derived bound
of ``gradops check`` applies."""

from __future__ import annotations

import pytest
import torch

from gradops import check


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("op", check.OPS)
def test_no_worse_than_pytorch(op, dtype, backend):
    for seed in (7, 8):
        row = check.check_one(op, check.DTYPES[dtype], torch.device("cpu"), backend, 64, 520, seed=seed)
        assert row.ok, row
        if row.torch_error is not None:
            two_ulps = 2 * torch.finfo(check.DTYPES[dtype]).eps
            assert row.error <= max(row.torch_error, two_ulps), row
