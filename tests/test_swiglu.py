"""SwiGlu / SwiGluGrad beyond the generic tables (tests/samples.py and tests/oracles.py feed those): the gradient is
the derivative of silu(A) * B and not the formula CANN's document prints, non-finite values, the aclnn surface's
statuses and results, torch_npu's names, autograd to the second order, and the CPU kernel's exp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradops
from gradops import aclnn, npu_compat
from gradops.status import ACLNN_ERR_PARAM_INVALID as INVALID
from gradops.status import ACLNN_ERR_PARAM_NULLPTR as NULL
from gradops.status import ACLNN_SUCCESS

F64 = torch.float64


def _silu_mul(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def test_the_gradient_is_the_derivative_not_the_printed_formula(backend):
    """CANN's document prints outA = yGrad * [s + s * (1 - s * A)] * B. At A = 2 that factor is 0.2100 where the
    derivative of A * s(A) is 1.0908; gradops follows the derivative (autograd of silu(A) * B agrees)."""
    a = torch.tensor([[2.0, -1.0, 0.5, 1.0]], dtype=F64)
    x = torch.cat((a, torch.ones_like(a)), dim=1).float()
    g = torch.ones(1, 4)
    dx = gradops.swiglu_grad(g, x)
    s = torch.sigmoid(a)
    derivative, printed = s + a * s * (1 - s), s + s * (1 - s * a)
    torch.testing.assert_close(dx[:, :4].double(), derivative, rtol=1e-6, atol=1e-7)
    assert abs(float(dx[0, 0]) - float(printed[0, 0])) > 0.8  # the printed factor at A = 2: 0.2100
    assert float(printed[0, 3]) == pytest.approx(float(derivative[0, 3]))  # they agree at A = 1 only
    xr = x.clone().requires_grad_()
    (auto,) = torch.autograd.grad(_silu_mul(xr), xr, g)
    torch.testing.assert_close(dx, auto, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_values_as_the_formula_gives_them(backend, dtype):
    """silu(+inf) = inf, silu(-inf) = -inf * 0 = NaN, a NaN stays NaN, in A and in B; exp overflows to inf and
    underflows to 0 without a NaN of its own (A = +-104, +-89). Below A = -88.7, e^-A is beyond float32, so float32
    math (torch's F.silu alike) gives silu(A) = -0 where the exact value is under 1e-36: the absolute tolerance."""
    a = torch.tensor([float("inf"), float("-inf"), float("nan"), 104.0, -104.0, 89.0, -89.0, 1.0])
    b = torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, float("inf")])
    x = torch.cat((a, b)).view(1, 16).to(dtype)
    g = torch.ones(1, 8, dtype=dtype)
    wide = x.double()
    want_y = _silu_mul(wide).to(dtype)
    s = torch.sigmoid(wide[:, :8])
    A, B = wide[:, :8], wide[:, 8:]
    want_dx = torch.cat((B * (s + A * s * (1 - s)), A * s), dim=1).to(dtype)
    y, dx = gradops.swiglu(x), gradops.swiglu_grad(g, x)
    torch.testing.assert_close(y, want_y, equal_nan=True, rtol=1e-2, atol=1e-35)
    torch.testing.assert_close(dx, want_dx, equal_nan=True, rtol=1e-2, atol=1e-35)


def test_a_middle_split_dim_takes_strided_halves(backend):
    """dim 1 of (2, 6, 5): A is x[:, :3], B x[:, 3:], each row's halves 15 items apart."""
    x = torch.randn(2, 6, 5, dtype=F64).float()
    torch.testing.assert_close(gradops.swiglu(x, 1), _silu_mul(x, 1), rtol=2e-6, atol=1e-6)
    g = torch.randn(2, 3, 5)
    xr = x.clone().requires_grad_()
    (auto,) = torch.autograd.grad(_silu_mul(xr, 1), xr, g)
    torch.testing.assert_close(gradops.swiglu_grad(g, x, 1), auto, rtol=2e-6, atol=1e-6)


def test_autograd_to_the_second_order():
    """swiglu's backward is swiglu_grad, whose own derivative (y_grad and x) is the reference formula's."""
    x = torch.randn(3, 8, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda v: gradops.swiglu(v, -1), (x,))
    torch.autograd.gradgradcheck(lambda v: gradops.swiglu(v, -1), (x,))
    g = torch.randn(3, 4, dtype=F64, requires_grad=True)
    torch.autograd.gradcheck(lambda gg, v: gradops.swiglu_grad(gg, v, -1), (g, x))


def test_the_cpu_kernels_exp_over_float32s_range(monkeypatch):
    """The vector exp of the CPU kernel (native/vec.h), seen through silu(A) * 1: within a few float32 ulps of
    float64 wherever the result is a normal float32, across sigmoid's whole range."""
    from gradops import backend

    if not backend.usable("cpu", torch.device("cpu"))[0]:
        pytest.skip("the CPU kernels are not built here")
    monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
    a = torch.linspace(-87.0, 87.0, 200_001)
    x = torch.cat((a, torch.ones_like(a))).view(1, -1)
    y = gradops.swiglu(x)
    want = _silu_mul(x.double())
    normal = want.abs() >= torch.finfo(torch.float32).tiny
    err = ((y.double() - want).abs() / want.abs())[normal]
    assert float(err.max()) < 8 * torch.finfo(torch.float32).eps, float(err.max())


# ---------------------------------------------------------------- aclnn
def _run(first, second, *args) -> int:
    status, size, executor = first(*args)
    if status:
        assert size == 0 and executor is None
        return status
    return second(torch.empty(size, dtype=torch.uint8) if size else None, size, executor, None)


def forward(*args) -> int:
    return _run(aclnn.aclnnSwiGluGetWorkspaceSize, aclnn.aclnnSwiGlu, *args)


def backward(*args) -> int:
    return _run(aclnn.aclnnSwiGluGradGetWorkspaceSize, aclnn.aclnnSwiGluGrad, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_aclnn_writes_what_the_pytorch_api_computes(backend, dtype):
    x = torch.randn(4, 6, 10).to(dtype)
    out = torch.full((4, 3, 10), float("nan"), dtype=dtype)
    assert forward(x, 1, out) == ACLNN_SUCCESS
    assert torch.equal(out, gradops.swiglu(x, 1))
    g = torch.randn(4, 3, 10).to(dtype)
    dx = torch.full_like(x, float("nan"))
    assert backward(g, x, 1, dx) == ACLNN_SUCCESS
    assert torch.equal(dx, gradops.swiglu_grad(g, x, 1))
    strided = torch.full((10, 3, 4), float("nan"), dtype=dtype).permute(2, 1, 0)  # an out that is a view
    assert forward(x, 1, strided) == ACLNN_SUCCESS and torch.equal(strided, gradops.swiglu(x, 1))


@pytest.mark.parametrize(("args", "status", "what"), [
    ((None, -1, torch.empty(2, 4)), NULL, "x missing"),
    ((torch.zeros(2, 8), -1, None), NULL, "out missing"),
    ((torch.zeros(2, 8, dtype=F64), -1, torch.empty(2, 4, dtype=F64)), INVALID, "float64 (CANN's table has none)"),
    ((torch.zeros(2, 8), -1, torch.empty(2, 4, dtype=torch.float16)), INVALID, "out dtype"),
    ((torch.zeros(2, 8), -1, torch.empty(2, 8)), INVALID, "out shape"),
    ((torch.zeros(2, 7), -1, torch.empty(2, 3)), INVALID, "odd size along dim"),
    ((torch.zeros(2, 8), 2, torch.empty(2, 4)), INVALID, "dim out of range"),
    ((torch.zeros(0, 8), -1, torch.empty(0, 4)), INVALID, "empty x"),
    ((torch.zeros(8, 2).t(), -1, torch.empty(2, 4)), INVALID, "non-contiguous x"),
])
def test_aclnn_refusals(args, status, what):
    assert forward(*args) == status, what


@pytest.mark.parametrize(("args", "status", "what"), [
    ((torch.zeros(2, 4), None, -1, torch.empty(2, 8)), NULL, "x missing"),
    ((torch.zeros(2, 4, dtype=torch.float16), torch.zeros(2, 8), -1, torch.empty(2, 8)), INVALID, "yGrad dtype"),
    ((torch.zeros(2, 8), torch.zeros(2, 8), -1, torch.empty(2, 8)), INVALID, "yGrad shape"),
    ((torch.zeros(2, 4), torch.zeros(2, 8), -1, torch.empty(2, 4)), INVALID, "out shape"),
    ((torch.zeros(0, 4), torch.zeros(0, 8), -1, torch.empty(0, 8)), INVALID, "empty"),
    ((torch.zeros(4, 2).t(), torch.zeros(2, 8), -1, torch.empty(2, 8)), INVALID, "non-contiguous yGrad"),
])
def test_aclnn_grad_refusals(args, status, what):
    assert backward(*args) == status, what


def test_a_refusal_names_the_argument_in_cann_spelling():
    from gradops.aclnn import aclGetRecentErrMsg

    assert backward(torch.zeros(2, 8), torch.zeros(2, 8), -1, torch.empty(2, 8)) == INVALID
    assert "yGrad.shape" in aclGetRecentErrMsg()


# ---------------------------------------------------------------- torch_npu names
def test_npu_swiglu_is_the_op_and_refuses_float64():
    x = torch.randn(3, 8, requires_grad=True)
    y = npu_compat.npu_swiglu(x)
    assert torch.equal(y, gradops.swiglu(x))
    g = torch.randn(3, 4)
    (dx,) = torch.autograd.grad(y, x, g)
    assert torch.equal(dx, npu_compat.npu_swiglu_backward(g, x))
    with pytest.raises(gradops.OpError) as err:
        npu_compat.npu_swiglu(torch.zeros(2, 4, dtype=F64))
    assert err.value.status == INVALID
