"""Validation table of Hardswish and aclnnHardswishBackward.

Source: hicann/ops-nn ``activation/hard_swish_grad/op_host/op_api/aclnn_hardswish_backward.cpp``: dtypes
{float32, float16, bfloat16} (the PyTorch API also float64), gradOutput, self and out share dtype and shape (no
broadcasting), at most 8 dims, 0-d and empty tensors allowed, non-contiguous supported. Errors name the PyTorch
API's arguments (``grad_output``); the aclnn surface renames them to CANN's (``gradOutput``,
:func:`gradops.spec.cann_arg`).
"""

from __future__ import annotations

from ...contract._common import (
    MAX_RANK,
    Result,
    floats,
    require_dtype,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    require_shape,
)


def hardswish_results(shape: None, x) -> list[Result]:
    """Hardswish's result: x's shape, dtype and (dense) layout, as an elementwise kernel writes it."""
    return [Result(None, x.dtype, x)]


def hardswish_backward_results(shape: None, grad_output, x) -> list[Result]:
    """HardswishBackward's result: x's shape, dtype and (dense) layout."""
    return [Result(None, x.dtype, x)]


def check_hardswish(x, *, out=None, cann: bool = False) -> None:
    op = "hardswish"
    outs = {"out": out} if cann else {}
    require_present(op, self=x, **outs)
    require_same_device(op, self=x, **outs)
    require_dtype(op, "self", x, floats(cann))
    if cann:
        require_same_dtype(op, "out", out, "self", x)
    require_rank(op, "self", x, 0, MAX_RANK)
    if cann:
        require_shape(op, "out", out, x.shape, "the shape of self")


def check_hardswish_backward(grad_output, x, *, out=None, cann: bool = False) -> None:
    op = "hardswish_backward"
    outs = {"out": out} if cann else {}
    require_present(op, grad_output=grad_output, self=x, **outs)
    require_same_device(op, grad_output=grad_output, self=x, **outs)
    require_dtype(op, "self", x, floats(cann))
    require_dtype(op, "grad_output", grad_output, floats(cann))
    require_same_dtype(op, "grad_output", grad_output, "self", x)
    if cann:
        require_same_dtype(op, "out", out, "self", x)
    require_rank(op, "grad_output", grad_output, 0, MAX_RANK)
    require_rank(op, "self", x, 0, MAX_RANK)
    require_shape(op, "grad_output", grad_output, x.shape, "the shape of self")
    if cann:
        require_shape(op, "out", out, x.shape, "the shape of self")
