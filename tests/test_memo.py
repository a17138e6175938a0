"""contract/_memo.py's key, as an op's call plan uses it (ops/_plan.py): a remembered answer is the check's, and
refusals are never remembered."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops.contract._memo import LIMIT
from gradops.families.hardswish.contract import check_hardswish
from gradops.families.rms_norm import contract
from gradops.families.rms_norm import ops as rms_ops
from gradops.ops._plan import Planner, forget_all
from gradops.status import OpError


def counted(check, op="rms_norm", device_arg=0):
    """``check`` behind a planner of its own: ``(remembered, calls)``, where ``remembered(*args)`` is the plan's
    answer of the check and ``calls`` the arguments the check actually ran on."""
    calls = []

    def counting(*args):
        calls.append(args)
        return check(*args)

    planner = Planner(op, counting, device_arg=device_arg)
    return (lambda *args: planner(*args).shape), calls


def test_a_plan_is_computed_once_per_metadata_and_equals_the_checks():
    check, calls = counted(contract.check_rms_norm_grad)
    x, g = torch.randn(6, 4, 8), torch.randn(8)
    rstd = torch.rand(6, 4, 1)
    first = check(x, x, rstd, g)
    assert first == contract.check_rms_norm_grad(x, x, rstd, g) == (24, 8, (6, 4, 1))
    # other tensors of the same metadata (values, strides and storage do not enter a check): remembered
    assert check(torch.randn(6, 4, 8), x.transpose(0, 1).contiguous().transpose(0, 1).contiguous(), rstd.clone(),
                 g * 2) is first
    assert len(calls) == 1
    with pytest.raises(OpError):  # another dtype (a refusal): computed
        check(x.int(), x.int(), rstd, g)
    assert len(calls) == 2


@pytest.mark.parametrize("change", ["shape", "dtype", "scalar type", "scalar value", "device"])
def test_metadata_the_check_reads_is_in_the_key(change):
    check, calls = counted(contract.check_rms_norm)
    x, g = torch.randn(4, 8), torch.randn(8)
    check(x, g, 1e-6)
    other = {
        "shape": (torch.randn(5, 8), g, 1e-6),
        "dtype": (x.half(), g, 1e-6),
        "scalar type": (x, g, 1),  # int 1 == 1.0 == True as dict keys; the type keeps them apart
        "scalar value": (x, g, 1e-5),
        "device": (x.to("meta"), g.to("meta"), 1e-6),
    }[change]
    try:
        check(*other)
    except OpError:
        pass
    assert len(calls) == 2


def test_refusals_are_raised_afresh_each_time():
    check, calls = counted(contract.check_rms_norm)
    x = torch.randn(4, 8)
    for _ in range(2):
        with pytest.raises(OpError, match="gamma"):
            check(x, torch.randn(7), 1e-6)
    assert len(calls) == 2


@pytest.mark.parametrize("arg", [torch.randn(4, 8).to_sparse(), [4.5, 8], [[4], 8], object()],
                         ids=["sparse", "list-of-floats", "nested-list", "object"])
def test_arguments_the_key_cannot_describe_are_checked_every_time(arg):
    check, calls = counted(lambda a, b: None, device_arg=1)
    for _ in range(2):
        check(arg, torch.randn(8))
    assert len(calls) == 2


@pytest.mark.parametrize("shape", [[4, 8], (4, 8)], ids=["list", "tuple"])
def test_a_shape_argument_is_part_of_the_key(shape):
    """A list or tuple of ints (the routing-map unpermute's restore_shape) is metadata like a scalar: remembered,
    and another shape is another key."""
    check, calls = counted(lambda a, b: None, device_arg=1)
    for _ in range(2):
        check(shape, torch.randn(8))
    check([4, 9], torch.randn(8))
    assert len(calls) == 2


def test_a_subclass_is_checked_every_time():
    class Sub(torch.Tensor):
        pass

    check, calls = counted(contract.check_rms_norm)
    x = torch.randn(4, 8).as_subclass(Sub)
    for _ in range(2):
        check(x, torch.randn(8), 1e-6)
    assert len(calls) == 2


def test_the_table_is_bounded():
    check, calls = counted(check_hardswish, "hardswish")
    for n in range(LIMIT + 10):
        check(torch.empty(n))
    check(torch.empty(LIMIT + 9))  # still there after the table started over
    assert len(calls) == LIMIT + 10


def test_the_public_functions_use_the_remembered_check_and_still_refuse():
    forget_all()
    x, g = torch.randn(4, 8), torch.randn(8)
    y, rstd = gradops.rms_norm(x, g)
    gradops.rms_norm_grad(y, x, rstd, g)
    assert len(rms_ops.plan_rms_norm_grad._plans) == 1
    with pytest.raises(OpError, match="rstd"):
        gradops.rms_norm_grad(y, x, rstd.double(), g)
    with pytest.raises(OpError, match="rstd"):  # the same refusal again: checked again
        gradops.rms_norm_grad(y, x, rstd.double(), g)
    assert len(rms_ops.plan_rms_norm_grad._plans) == 1
