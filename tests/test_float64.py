"""float64 on the PyTorch API (issue "Drop-in means drop-in", item 4): torch's modules take float64, so gradops'
drop-ins, functional ops and ``gradops.patch`` do too, computing in float64 on the pure-torch reference (never a
float32 kernel); ``torch.autograd.gradcheck`` passes on every module and differentiable op. CANN's own surfaces
(:mod:`gradops.aclnn`, :mod:`gradops.ascendc`, :mod:`gradops.npu_compat`) keep CANN's tables: float64 is 161002.

Double backward (issue 17 item 3): ``gradgradcheck`` passes on every module whose torch counterpart supports it
(RMSNorm, LayerNorm, Hardswish, Embedding; tests/test_double_backward.py has the full set), and the MoE modules,
which have no torch counterpart and whose backward ops register no derivative, still refuse a second backward
(:func:`test_double_backward_of_the_moe_modules_is_not_supported`).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import gradops
import gradops.nn as gnn
import module_cases as cases
from gradops import npu_compat as npu
from gradops.aclnn import ACLNN_ERR_PARAM_INVALID as INVALID
from gradops.aclnn import ACLNN_ERR_PARAM_NULLPTR as NULL
from oracles import assert_matches
from samples import OPS, samples
from test_opcheck import FORWARDS, _op_args, _with_grad

F32, F64 = torch.float32, torch.float64
#: float64's unit roundoff: the computation's, for the oracle's tolerance (tests/oracles.py).
U64 = torch.finfo(F64).eps / 2


def _wide(op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A float32 sample in float64: every float tensor, but embedding's float indices (an index dtype)."""
    def conv(i, a):
        keep = op == "embedding_dense_backward" and i == 1
        return a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() and not keep else a
    return tuple(conv(i, a) for i, a in enumerate(args)), {k: conv(None, v) for k, v in kwargs.items()}


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op, dtypes={F32})]


@pytest.mark.parametrize("op,sample", CASES)
def test_matches_oracle_to_float64_rounding(op, sample, backend):
    """Every op on the float32 samples in float64, on every backend setting: the float64 oracle within the derived
    bound at float64's unit roundoff (a float32 computation misses it by ~1e8), float64 results (statistics and
    weight gradients included), inputs untouched, bitwise repeatable."""
    args, kwargs = _wide(op, sample.args, sample.kwargs)
    wide = type(sample)(sample.name, sample.purpose, args, kwargs)
    before = wide.clone()
    got = _as_tuple(getattr(gradops, op)(*args, **kwargs))
    assert_matches(op, got, wide, unit=U64)
    assert all(t.dtype == F64 for t in got if t.is_floating_point()), [t.dtype for t in got]
    for a, b in zip(before.args, wide.args):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.stride() == b.stride(), f"{op} wrote into an input"
    again = _as_tuple(getattr(gradops, op)(*args, **kwargs))
    assert all(torch.equal(x, y) for x, y in zip(got, again))


def _planner(op: str):
    return getattr(importlib.import_module(getattr(gradops, op).__module__), f"plan_{op}")


@pytest.mark.parametrize("op", OPS)
def test_float64_is_planned_onto_the_float64_reference(op, backend):
    """The backend decision routes float64 to the reference computing in float64, whatever GRADOPS_BACKEND names,
    and leaves the float32 plan of the same call to the backend named."""
    sample = next(iter(samples(op, dtypes={F32})))
    args, _ = _wide(op, sample.args, sample.kwargs)
    planner = _planner(op)
    fn = planner(*args).backend.fn
    if "compute" not in inspect.signature(getattr(gradops.reference, op)).parameters:  # moves rows: nothing to widen
        assert fn is getattr(gradops.reference, op)
    else:
        assert (fn.func, fn.keywords) == (getattr(gradops.reference, op), {"compute": F64})
    assert planner(*args).backend.name == "torch"
    assert planner(*sample.args).backend.name == backend


def test_float64_indices_are_only_indices(backend):
    """float64 is one of CANN's nine embedding index dtypes: float32 gradients with float64 indices stay on the
    backend named (and in float32), where a float64 gradient beside float32 indices widens."""
    from gradops.families.embedding.ops import plan_embedding_dense_backward as plan

    grad, idx = torch.randn(4, 3), torch.tensor([0.0, 2.7, 1.0, 2.0], dtype=F64)
    assert plan(grad, idx, 3, -1, False).backend.name == backend
    assert gradops.embedding_dense_backward(grad, idx, 3).dtype == F32
    assert plan(grad.double(), idx.float(), 3, -1, False).backend.fn.keywords == {"compute": F64}


def test_mixed_unpermute_computes_in_float64():
    """float32 tokens beside float64 probs (CANN types each tensor separately): computed in float64, the result in
    the tokens' dtype, rounded once."""
    permuted, probs, perm = torch.randn(6, 5), torch.rand(3, 2, dtype=F64), torch.randperm(6).int()
    got = gradops.moe_token_unpermute(permuted, perm, probs)
    picked = permuted.double()[perm.long()].view(3, 2, 5)
    exact = (picked * probs[:, :, None]).sum(1)
    assert got.dtype == F32 and torch.equal(got, exact.float())


def test_misspelt_backend_is_refused_for_float64_too(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "trion")
    x = torch.randn(2, 8, dtype=F64)
    with pytest.raises(gradops.backend.BackendUnavailable, match="trion"):
        gradops.rms_norm(x, torch.ones(8, dtype=F64))


def test_out_in_float64():
    x, g = torch.randn(3, 8, dtype=F64), torch.randn(8, dtype=F64)
    y, rstd = torch.empty(3, 8, dtype=F64), torch.empty(3, 1, dtype=F64)
    gradops.rms_norm(x, g, out=(y, rstd))
    ref = gradops.rms_norm(x, g)
    assert torch.equal(y, ref[0]) and torch.equal(rstd, ref[1])
    with pytest.raises(gradops.OpError) as info:
        gradops.rms_norm(x, g, out=(y, torch.empty(3, 1)))
    assert info.value.arg == "out[1].dtype" and "float64" in str(info.value)


@pytest.mark.parametrize("op", OPS)
def test_opcheck_float64(op):
    """Schema, fake kernels (float64 statistics and weight gradients), autograd registration and AOT dispatch on the
    op's first float32 sample in float64."""
    sample = next(iter(samples(op, dtypes={F32})))
    args, kwargs = _wide(op, sample.args, sample.kwargs)
    op_args = _op_args(op, type(sample)(sample.name, sample.purpose, args, kwargs))
    if op in FORWARDS:
        op_args = _with_grad(op_args)
    torch.library.opcheck(getattr(torch.ops.gradops, op).default, tuple(op_args))


def test_opcheck_embedding_forward_float64():
    weight = torch.randn(6, 3, dtype=F64, requires_grad=True)
    torch.library.opcheck(torch.ops.gradops.embedding.default, (weight, torch.tensor([0, 5, 5, 2]), 1, True))


# ------------------------------------------------------------------------------------------------- gradcheck
_x = cases.x64


MODULES = {
    **cases.MODULES,
    "MoeTokenPermute": lambda: (gnn.MoeTokenPermute(), (_x(4, 3), torch.tensor([[0, 2], [1, 0], [2, 2], [1, 1]]))),
    "MoeTokenPermute-drop": lambda: (gnn.MoeTokenPermute(num_out_tokens=5),
                                     (_x(4, 3), torch.tensor([[0, 2], [1, 0], [2, 2], [1, 1]]))),
    "MoeTokenUnpermute": lambda: (gnn.MoeTokenUnpermute(), (_x(8, 3), torch.randperm(8).int(), _x(4, 2))),
    "MoeTokenUnpermute-dropped-rows": lambda: (gnn.MoeTokenUnpermute(), (_x(5, 3), torch.randperm(8).int(), _x(4, 2))),
}


def _as_function(name: str):
    return cases.as_function(MODULES, name)


@pytest.mark.parametrize("name", MODULES)
def test_gradcheck_modules(name, backend):
    """Analytic gradients (gradops' backward ops) against finite differences of gradops' float64 forward, with
    respect to the inputs and to every parameter."""
    f, tensors = _as_function(name)
    assert gradcheck(f, tensors)


def _unpermute(fn, rows: int, perm: torch.Tensor):
    return lambda p, q=None: fn(p[:rows], perm, q)


FUNCTIONS = {
    # every output, statistics included: their gradients reach x through the autograd formulas' extra terms
    "rms_norm": lambda: (lambda x, g: gradops.rms_norm(x, g, 1e-6), (_x(3, 8), _x(8))),
    "rms_norm-multidim-gamma": lambda: (lambda x, g: gradops.rms_norm(x, g), (_x(2, 3, 4), _x(3, 4))),
    "layer_norm": lambda: (lambda x, g, b: gradops.layer_norm(x, g, b, 1e-5), (_x(3, 8), _x(8), _x(8))),
    "hardswish": lambda: (gradops.hardswish, (cases.hardswish_input(5, 8),)),
    "embedding": lambda: (lambda w: gradops.embedding(w, torch.tensor([4, 0, 4, 2])), (_x(5, 3),)),
    "embedding-float-indices": lambda: (lambda w: gradops.embedding(w, torch.tensor([4.7, 0.2, 4.0], dtype=F64)),
                                        (_x(5, 3),)),
    "moe_token_permute": lambda: (lambda t: gradops.moe_token_permute(t, torch.tensor([[1, 0], [0, 1], [1, 1]]))[0],
                                  (_x(3, 4),)),
    "moe_token_unpermute": lambda: (_unpermute(gradops.moe_token_unpermute, 6, torch.randperm(6).int()),
                                    (_x(6, 4), _x(3, 2))),
    "moe_token_unpermute-dropped-rows": lambda: (_unpermute(gradops.moe_token_unpermute, 4, torch.randperm(6).int()),
                                                 (_x(6, 4), _x(3, 2))),
    "moe_token_unpermute-no-probs": lambda: (_unpermute(gradops.moe_token_unpermute, 4, torch.randperm(4).int()),
                                             (_x(4, 3),)),
    "nn.moe_token_unpermute": lambda: (_unpermute(gnn.moe_token_unpermute, 6, torch.randperm(6).int()),
                                       (_x(6, 4), _x(3, 2))),
}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_gradcheck_functions(name, backend):
    fn, inputs = FUNCTIONS[name]()
    assert gradcheck(fn, inputs)


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("Moe")])
def test_double_backward_of_the_moe_modules(name):
    """The MoE backward ops are linear in their float inputs and differentiate through their references
    (gradops.ops._double.reference_derivative): a second backward matches finite differences. (They raised "no
    autograd formula was registered" before.)"""
    f, tensors = _as_function(name)
    assert gradgradcheck(f, tensors)


# ------------------------------------------------------------------------------------- patch of a .double() model
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(30, 16, padding_idx=0, scale_grad_by_freq=True)
        self.ln = torch.nn.LayerNorm(16)
        self.up = torch.nn.Linear(16, 32)
        self.act = torch.nn.Hardswish()
        self.down = torch.nn.Linear(32, 16)
        self.rms = torch.nn.RMSNorm(16)

    def forward(self, idx):
        return self.rms(self.down(self.act(self.up(self.ln(self.emb(idx))))))


def test_patched_double_model_equals_torch_in_float64(backend):
    """The issue's case: ``gradops.patch`` on a ``.double()`` model raised ``OpError ... got float64`` in the
    forward. Now its outputs and every gradient (padding row, scale_grad_by_freq included) equal torch's own
    float64 model. Bound: each of the 6 layers adds at most 8 sqrt(n) float64 unit roundoffs (n = 32, the widest
    reduction) relative to the largest value, as tests/oracles.py derives per op; a float32 computation anywhere
    would miss it by ~1e8."""
    torch.manual_seed(3)
    original = _Net().double()
    patched = copy.deepcopy(original)
    report = gradops.patch(patched)
    assert report.counts() == {"Embedding": 1, "LayerNorm": 1, "Hardswish": 1, "RMSNorm": 1}
    idx = torch.randint(0, 30, (4, 7))
    idx[0, :3] = 0  # the padding row, used
    idx[1, :] = 5   # one row looked up 7 times: scale_grad_by_freq divides by 7
    dy = torch.randn(4, 7, 16, dtype=F64)
    outs = []
    for model in (original, patched):
        y = model(idx)
        y.backward(dy)
        outs.append((y.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (y_ref, g_ref), (y_got, g_got) = outs
    assert y_got.dtype == F64
    bound = 6 * 8 * math.sqrt(32) * U64

    def close(got, ref):
        return float((got - ref).abs().max()) <= bound * max(float(ref.abs().max()), 1.0)

    assert close(y_got, y_ref)
    for name, ref in g_ref.items():
        assert g_got[name].dtype == F64 and close(g_got[name], ref), name
    assert torch.equal(g_got["emb.weight"][0], torch.zeros(16, dtype=F64))


# ------------------------------------------------------------------------------ the strict surfaces stay strict
def _aclnn_calls():
    from gradops import aclnn

    x, rstd, g = torch.randn(2, 16, dtype=F64), torch.rand(2, dtype=F64) + 0.5, torch.randn(16, dtype=F64)
    idx, perm = torch.tensor([1, 2, 2, 0]), torch.randperm(8).int()
    return {
        "RmsNormGrad": (aclnn.aclnnRmsNormGradGetWorkspaceSize,
                        (x, x, rstd, g, torch.empty_like(x), torch.empty_like(g)), "dy.dtype"),
        "RmsNorm": (aclnn.aclnnRmsNormGetWorkspaceSize, (x, g, 1e-6, torch.empty_like(x), torch.empty(2, 1, dtype=F64)),
                    "x.dtype"),
        "EmbeddingDenseBackward": (aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize,
                                   (torch.randn(4, 3, dtype=F64), idx, 5, -1, False, torch.empty(5, 3, dtype=F64)),
                                   "grad.dtype"),
        "HardswishBackward": (aclnn.aclnnHardswishBackwardGetWorkspaceSize, (x, x, torch.empty_like(x)), "self.dtype"),
        "MoeTokenPermuteGrad": (aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize,
                                (torch.randn(8, 3, dtype=F64), perm, 2, False, torch.empty(4, 3, dtype=F64)),
                                "permutedOutputGrad.dtype"),
        "MoeTokenPermute": (aclnn.aclnnMoeTokenPermuteGetWorkspaceSize,
                            (torch.randn(4, 3, dtype=F64), torch.tensor([[0, 1], [1, 0], [2, 2], [0, 0]]), 0, False,
                             torch.empty(8, 3, dtype=F64), torch.empty(8, dtype=torch.int32)), "tokens.dtype"),
    }


@pytest.mark.parametrize("name", list(_aclnn_calls()))
def test_aclnn_refuses_float64(name):
    """Every aclnn phase 1 answers float64 with 161002 naming the dtype, where the PyTorch API computes."""
    from gradops import aclnn

    fn, args, dtype_arg = _aclnn_calls()[name]
    status, size, executor = fn(*args)
    assert (status, size, executor) == (INVALID, 0, None)
    message = aclnn.aclGetRecentErrMsg()
    assert dtype_arg.split(".")[0] in message and "float64" in message, message


def test_ascendc_refuses_float64():
    from gradops.ascendc import GetLayerNormGradBetaNDTilingInfo, LayerNormGrad, LayerNormGradBeta

    x, stat, g = torch.randn(2, 4, 8, dtype=F64), torch.rand(2, 4, dtype=F64), torch.randn(8, dtype=F64)
    with pytest.raises(gradops.OpError) as info:
        LayerNormGrad(torch.empty_like(x), torch.empty_like(x), x, x, stat, stat, g, 1e-5)
    assert (info.value.status, info.value.arg) == (INVALID, "inputX.dtype")
    tiling = GetLayerNormGradBetaNDTilingInfo([2, 4, 8, 8], 4096, 4, False)
    with pytest.raises(gradops.OpError) as info:
        LayerNormGradBeta(torch.empty(8, dtype=F64), torch.empty(8, dtype=F64), x, x, tiling)
    assert info.value.status == INVALID and info.value.arg.endswith(".dtype"), str(info.value)
    assert "float64" in str(info.value)


def _npu_calls():
    x, g, rstd = torch.randn(2, 16, dtype=F64), torch.randn(16, dtype=F64), torch.rand(2, 1, dtype=F64) + 0.5
    tokens, experts, perm = torch.randn(4, 3, dtype=F64), torch.tensor([[0, 1], [1, 0], [2, 2], [0, 0]]), \
        torch.randperm(8).int()
    probs, p32 = torch.rand(4, 2, dtype=F64), torch.randn(8, 3)
    return {
        "npu_rms_norm": (lambda: npu.npu_rms_norm(x, g), "x.dtype"),
        "npu_rms_norm_backward": (lambda: npu.npu_rms_norm_backward(x, x, g, rstd), "dy.dtype"),
        "npu_moe_token_permute": (lambda: npu.npu_moe_token_permute(tokens, experts), "tokens.dtype"),
        "npu_moe_token_permute_grad": (lambda: npu.npu_moe_token_permute_grad(tokens, torch.randn(8, 3, dtype=F64),
                                                                              experts, perm),
                                       "permuted_output_grad.dtype"),
        "npu_moe_token_unpermute": (lambda: npu.npu_moe_token_unpermute(p32, perm, probs), "probs.dtype"),
        "npu_moe_token_unpermute_grad": (lambda: npu.npu_moe_token_unpermute_grad(p32, torch.randn(4, 3, dtype=F64),
                                                                                  perm, probs.float()),
                                         "grad_unpermuted.dtype"),
    }


@pytest.mark.parametrize("name", list(_npu_calls()))
def test_npu_compat_refuses_float64(name):
    """torch_npu's names keep CANN's tables (161002), while gradops' own functions take the same float64."""
    call, arg = _npu_calls()[name]
    with pytest.raises(gradops.OpError) as info:
        call()
    assert (info.value.status, info.value.arg) == (INVALID, arg), str(info.value)
    assert "float64" in str(info.value)


def test_npu_compat_keeps_cann_order_for_float64():
    """A missing argument is answered first (161001), as CANN checks nulls before dtypes."""
    with pytest.raises(gradops.OpError) as info:
        npu.npu_rms_norm(torch.randn(2, 16, dtype=F64), None)
    assert (info.value.status, info.value.arg) == (NULL, "gamma")
