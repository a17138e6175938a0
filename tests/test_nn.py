"""gradops.nn modules against PyTorch's own modules, state_dict compatibility, and gradops.patch."""

from __future__ import annotations

import copy

import pytest
import torch

import gradops
from gradops import nn as gnn

# float32, different reduction orders: results agree to a few ulps of the largest value involved. torch's default
# float32 tolerances (rtol 1.3e-6, atol 1e-5) cover rows of up to a few hundred elements.
TOL = {"rtol": 1.3e-6, "atol": 1e-5}


def _run(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor | None = None):
    """Output, input gradient (float inputs only) and parameter gradients of one forward + backward."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    y = module(x)
    g = grad if grad is not None else torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(g)
    params = {n: p.grad for n, p in module.named_parameters()}
    return y.detach(), x.grad, params


def _compare(torch_module: torch.nn.Module, ours: torch.nn.Module, x: torch.Tensor) -> None:
    y0, dx0, p0 = _run(torch_module, x)
    y1, dx1, p1 = _run(ours, x)
    torch.testing.assert_close(y1, y0, **TOL)
    if dx0 is not None:
        torch.testing.assert_close(dx1, dx0, **TOL)
    assert p1.keys() == p0.keys()
    for name in p0:
        torch.testing.assert_close(p1[name], p0[name], **TOL, msg=lambda m, n=name: f"grad of {n}: {m}")


def _twin(torch_module: torch.nn.Module) -> torch.nn.Module:
    ours = copy.deepcopy(torch_module)
    report = gradops.patch(ours)
    assert len(report) == 1, str(report)
    return ours


CASES = {
    "rms-1d": (lambda: torch.nn.RMSNorm(48, eps=1e-6), (4, 7, 48)),
    "rms-multidim": (lambda: torch.nn.RMSNorm((4, 12), eps=1e-5), (5, 4, 12)),
    "rms-no-affine": (lambda: torch.nn.RMSNorm(33, elementwise_affine=False), (6, 33)),
    "ln-1d": (lambda: torch.nn.LayerNorm(40), (3, 9, 40)),
    "ln-multidim": (lambda: torch.nn.LayerNorm((3, 10), eps=1e-6), (4, 3, 10)),
    "ln-no-bias": (lambda: torch.nn.LayerNorm(24, bias=False), (7, 24)),
    "ln-no-affine": (lambda: torch.nn.LayerNorm(24, elementwise_affine=False), (7, 24)),
    "ln-one-row-1d-input": (lambda: torch.nn.LayerNorm(17), (17,)),
}


@pytest.mark.parametrize("case", CASES)
def test_norm_modules_match_torch(case):
    make, shape = CASES[case]
    torch.manual_seed(0)
    reference = make()
    with torch.no_grad():  # non-trivial affine parameters, so dgamma/dbeta paths are exercised
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(shape) * 2 + 0.5
    _compare(reference, _twin(reference), x)


def test_rms_norm_eps_none_is_finfo_eps():
    """eps=None must mean torch.finfo(x.dtype).eps; on tiny inputs it differs visibly from 1e-6."""
    torch.manual_seed(0)
    x = torch.randn(4, 16) * 1e-4
    reference = torch.nn.RMSNorm(16)
    _compare(reference, _twin(reference), x)
    y_default = gnn.RMSNorm(16)(x)
    y_1e6 = gnn.RMSNorm(16, eps=1e-6)(x)
    assert (y_default - y_1e6).abs().max() > 1e-2


@pytest.mark.parametrize("padding_idx", [None, 3, -1, -4])
@pytest.mark.parametrize("scale", [False, True])
def test_embedding_matches_torch(padding_idx, scale):
    torch.manual_seed(0)
    reference = torch.nn.Embedding(12, 8, padding_idx=padding_idx, scale_grad_by_freq=scale)
    indices = torch.randint(0, 12, (5, 9))
    indices[0, :3] = 11  # the last row (padding_idx = -1) is hit, and hit repeatedly
    indices[1, :2] = 8   # padding_idx = -4 -> row 8
    ours = _twin(reference)
    _compare(reference, ours, indices)
    if padding_idx is not None:
        row = padding_idx % 12
        _, _, grads = _run(ours, indices)
        assert torch.all(grads["weight"][row] == 0)


def test_embedding_max_norm_renormalises_like_torch():
    torch.manual_seed(0)
    reference = torch.nn.Embedding(10, 6, max_norm=1.0)
    with torch.no_grad():
        reference.weight.mul_(3)
    ours = copy.deepcopy(reference)
    gradops.patch(ours)
    indices = torch.tensor([[1, 2, 2], [7, 1, 0]])
    _compare(reference, ours, indices)
    torch.testing.assert_close(ours.weight, reference.weight)  # the in-place renorm happened identically
    assert ours.weight[[0, 1, 2, 7]].norm(dim=-1).max() <= 1.0 + 1e-6


def test_embedding_sparse_falls_back_and_patch_keeps_it():
    module = torch.nn.Embedding(10, 4, sparse=True)
    report = gradops.patch(module)
    assert len(report) == 0 and "sparse=True" in str(report)
    direct = gnn.Embedding(10, 4, sparse=True)
    direct(torch.tensor([1, 2])).sum().backward()
    assert direct.weight.grad.is_sparse


def test_hardswish_matches_torch_away_from_three_and_follows_cann_at_three():
    torch.manual_seed(0)
    x = torch.linspace(-5, 5, 101)
    x = x[(x.abs() - 3).abs() > 1e-3]
    _compare(torch.nn.Hardswish(), gnn.Hardswish(), x)
    edge = torch.tensor([-3.0, 3.0], requires_grad=True)
    gnn.Hardswish()(edge).sum().backward()
    assert edge.grad.tolist() == [-0.5, 1.5]  # CANN's closed interval; torch >= 2.8 gives [0, 1]


def test_state_dict_round_trips_both_ways():
    for make in (lambda c: c(16), lambda c: c(16, eps=1e-3)):
        for torch_cls, our_cls in ((torch.nn.RMSNorm, gnn.RMSNorm), (torch.nn.LayerNorm, gnn.LayerNorm)):
            reference, ours = make(torch_cls), make(our_cls)
            with torch.no_grad():
                for p in reference.parameters():
                    p.uniform_()
            ours.load_state_dict(reference.state_dict())
            assert ours.state_dict().keys() == reference.state_dict().keys()
            reference.load_state_dict(ours.state_dict())
    reference, ours = torch.nn.Embedding(7, 3, padding_idx=2), gnn.Embedding(7, 3, padding_idx=2)
    ours.load_state_dict(reference.state_dict())
    torch.testing.assert_close(ours.weight, reference.weight)
    assert repr(ours).endswith(repr(reference).split("(", 1)[1])  # same extra_repr


def _reference_permute(tokens, indices):
    """CANN's convention in plain torch: rows grouped by expert; sorted_indices = destination of each copy."""
    k = indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    return tokens[order // k], torch.argsort(order)


def _reference_unpermute(permuted, sorted_indices, probs):
    rows = torch.cat([permuted, permuted.new_zeros(1, permuted.shape[1])])  # dropped copies read zeros
    s = torch.where(sorted_indices < permuted.shape[0], sorted_indices, permuted.shape[0])
    picked = rows[s].view(probs.shape[0], probs.shape[1], -1)
    return (picked * probs[..., None]).sum(1)


@pytest.mark.parametrize("num_out_tokens", [None, 11])
def test_moe_permute_unpermute_modules_match_torch(num_out_tokens):
    torch.manual_seed(0)
    t, h, k, e = 9, 6, 2, 4
    indices = torch.randint(0, e, (t, k))
    tokens0 = torch.randn(t, h, requires_grad=True)
    probs0 = torch.rand(t, k, requires_grad=True)
    tokens1 = tokens0.detach().clone().requires_grad_()
    probs1 = probs0.detach().clone().requires_grad_()
    weight = torch.randn(h, h)  # an "expert" between the two, so row order matters

    permuted, sorted_indices = gnn.MoeTokenPermute(num_out_tokens)(tokens0, indices)
    ours = gnn.MoeTokenUnpermute()(permuted @ weight, sorted_indices, probs0)
    rp, rs = _reference_permute(tokens1, indices)
    rp = rp[:num_out_tokens] if num_out_tokens else rp
    ref = _reference_unpermute(rp @ weight, rs, probs1)

    assert torch.equal(sorted_indices.long(), rs)
    torch.testing.assert_close(permuted, rp)
    torch.testing.assert_close(ours, ref, **TOL)
    g = torch.randn(t, h)
    ours.backward(g)
    ref.backward(g)
    torch.testing.assert_close(tokens0.grad, tokens1.grad, **TOL)
    torch.testing.assert_close(probs0.grad, probs1.grad, **TOL)


def test_moe_unpermute_without_probs_is_the_inverse_gather():
    torch.manual_seed(0)
    tokens = torch.randn(8, 5, requires_grad=True)
    permuted, sorted_indices = gradops.moe_token_permute(tokens, torch.randint(0, 3, (8,)))
    back = gnn.moe_token_unpermute(permuted, sorted_indices)
    torch.testing.assert_close(back, tokens, rtol=0, atol=0)
    back.backward(torch.ones_like(back))
    torch.testing.assert_close(tokens.grad, torch.ones_like(tokens), rtol=0, atol=0)


def test_moe_unpermute_refuses_bad_probs_shape():
    permuted, sorted_indices = gradops.moe_token_permute(torch.randn(4, 3), torch.randint(0, 2, (4, 2)))
    with pytest.raises(ValueError, match="probs must be"):
        gnn.moe_token_unpermute(permuted, sorted_indices, torch.rand(4, 3))


def test_moe_unpermute_under_torch_func_and_compile():
    """torch.func transforms need setup_context-style autograd Functions (a forward taking ctx broke func.grad:
    review finding)."""
    torch.manual_seed(0)
    tokens, probs = torch.randn(6, 4), torch.rand(6, 2)
    permuted, sorted_indices = gradops.moe_token_permute(tokens, torch.randint(0, 3, (6, 2)))
    p = permuted.clone().requires_grad_()
    gnn.moe_token_unpermute(p, sorted_indices, probs).square().sum().backward()
    grad = torch.func.grad(lambda q: gnn.moe_token_unpermute(q, sorted_indices, probs).square().sum())(permuted)
    assert torch.equal(grad, p.grad)
    torch._dynamo.reset()
    compiled = torch.compile(gnn.moe_token_unpermute, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(permuted, sorted_indices, probs),
                               gnn.moe_token_unpermute(permuted, sorted_indices, probs), rtol=0, atol=0)


class _MyNorm(torch.nn.LayerNorm):
    """A model's own subclass: its forward may differ, so patch must keep it."""


def test_patch_swaps_in_place_and_reports():
    shared = torch.nn.LayerNorm(8)
    model = torch.nn.Sequential(
        torch.nn.Embedding(20, 8, padding_idx=-1),
        torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-4), torch.nn.Linear(8, 8), torch.nn.Hardswish()),
        shared, shared, _MyNorm(8), torch.nn.Embedding(5, 8, sparse=True),
    ).to(torch.float64)
    model.eval()
    params_before = dict(model.named_parameters())
    report = gradops.patch(model)

    assert report.counts() == {"Embedding": 1, "RMSNorm": 1, "Hardswish": 1, "LayerNorm": 1}
    assert [p for p, _, _ in report.swapped] == ["0", "1.0", "1.2", "2"]  # shared module once, at its first path
    assert {p for p, _, _ in report.skipped} == {"4", "5"}
    text = str(report)
    assert "1.0" in text and "gradops.nn.RMSNorm((8,), eps=0.0001" in text and "subclass of torch.nn" in text
    assert type(model[0]) is gnn.Embedding and type(model[2]) is gnn.LayerNorm and model[3] is model[2]
    assert type(model[4]) is _MyNorm
    # State kept: the very same Parameter objects (optimizers stay valid), dtype, hyper-parameters, eval mode.
    assert all(p is params_before[n] for n, p in model.named_parameters())
    assert model[0].padding_idx == 19 and model[1][0].eps == 1e-4 and not model[1][0].training
    assert model[0].weight.dtype == torch.float64
    assert len(gradops.patch(model)) == 0  # idempotent


def test_patch_refuses_non_subclass_targets():
    with pytest.raises(TypeError, match="must subclass"):
        gradops.patch(torch.nn.LayerNorm(4), swaps={torch.nn.LayerNorm: gnn.RMSNorm})


def test_patched_model_trains_like_the_original():
    torch.manual_seed(0)
    original = torch.nn.Sequential(torch.nn.Embedding(30, 16, padding_idx=0), torch.nn.LayerNorm(16),
                                   torch.nn.Linear(16, 32), torch.nn.Hardswish(), torch.nn.Linear(32, 16),
                                   torch.nn.RMSNorm(16), torch.nn.Linear(16, 30))
    patched = copy.deepcopy(original)
    gradops.patch(patched)
    data = torch.randint(0, 30, (6, 8))
    losses = []
    for model in (original, patched):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        run = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten())
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0][-1] < losses[0][0]
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=0)


def test_moe_unpermute_refuses_out_of_range_indices_with_161002():
    bad = torch.tensor([0, 1, 2, 9], dtype=torch.int32)
    with pytest.raises(gradops.OpError) as err:
        gnn.moe_token_unpermute(torch.randn(4, 3), bad, torch.rand(2, 2))
    assert err.value.status == 161002


@pytest.mark.parametrize("with_probs", [True, False])
def test_moe_unpermute_refuses_duplicate_indices_with_161002(with_probs):
    """In range but not a permutation: some row would have no source (found reading uninitialised memory)."""
    permuted = torch.randn(4, 3, requires_grad=True)
    probs = torch.rand(2, 2) if with_probs else None
    duplicated = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    with pytest.raises(gradops.OpError) as info:
        gnn.moe_token_unpermute(permuted, duplicated, probs if with_probs else None)
    assert info.value.status == 161002 and info.value.arg == "sorted_indices"


def test_module_refusals_are_op_errors_naming_the_argument():
    """Issue 12.3: the nn layer refuses in the library's terms (OpError, a ValueError, with CANN's status)."""
    from gradops.status import ACLNN_ERR_PARAM_INVALID, OpError

    with pytest.raises(OpError) as info:
        gnn.LayerNorm(8)(torch.randn(2, 7))
    assert (info.value.status, info.value.op, info.value.arg) == (ACLNN_ERR_PARAM_INVALID, "layer_norm", "x.shape")
    permuted, sorted_indices = gradops.moe_token_permute(torch.randn(4, 3), torch.randint(0, 2, (4, 2)))
    with pytest.raises(OpError) as info:
        gnn.moe_token_unpermute(permuted, sorted_indices, torch.rand(4, 3))
    assert (info.value.status, info.value.arg) == (ACLNN_ERR_PARAM_INVALID, "probs")
    # Hardswish's module path goes to the native node first: a non-tensor or a refused dtype still gets the op's error
    with pytest.raises(OpError) as info:
        gnn.Hardswish()([1.0])
    assert (info.value.status, info.value.op, info.value.arg) == (ACLNN_ERR_PARAM_INVALID, "hardswish", "self")
    with pytest.raises(OpError) as info:
        gnn.Hardswish()(torch.randn(3, dtype=torch.complex64, requires_grad=True))
    assert (info.value.status, info.value.op, info.value.arg) == (ACLNN_ERR_PARAM_INVALID, "hardswish", "self.dtype")


@pytest.mark.parametrize("make,shape,expected", [
    (lambda: gnn.RMSNorm(8), (4, 7), "(..., 8)"),
    (lambda: gnn.RMSNorm(8, elementwise_affine=False), (4, 7), "(..., 8)"),
    (lambda: gnn.RMSNorm((2, 8)), (4, 8), "(..., 2, 8)"),
    (lambda: gnn.RMSNorm((2, 8)), (8,), "(..., 2, 8)"),
    (lambda: gnn.RMSNorm(8), (), "(..., 8)"),
    (lambda: gnn.LayerNorm(8), (4, 7), "(..., 8)"),
    (lambda: gnn.LayerNorm((3, 8), bias=False), (4, 2, 8), "(..., 3, 8)"),
], ids=["rms", "rms-no-affine", "rms-2d", "rms-2d-short-x", "rms-0d-x", "ln", "ln-2d"])
def test_module_shape_errors_blame_the_input(make, shape, expected):
    """Issue "drop-in means drop-in" 9: ``RMSNorm(8)(randn(4, 7))`` said "gamma.shape must be (7,)", blaming the
    weight for the input's last dim. The modules name x, the shape they need and the one given."""
    module = make()
    with pytest.raises(gradops.OpError) as info:
        module(torch.randn(shape))
    err = info.value
    assert (err.status, err.arg) == (161002, "x.shape"), str(err)
    text = str(err)
    assert f"must be {expected}, ending with the module's normalized_shape" in text, text
    assert text.split(", got ")[1].startswith("(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "")
                                              + ")"), text
    assert "gamma" not in text and "weight" not in text


def test_functional_shape_errors_still_name_gamma():
    """The functional API has no module: a gamma that does not match x's trailing dims is what it names."""
    with pytest.raises(gradops.OpError) as info:
        gradops.rms_norm(torch.randn(4, 7), torch.ones(8))
    assert info.value.arg == "gamma.shape"


@pytest.mark.parametrize("indices,arg", [
    (torch.tensor([1, 12]), "indices"),
    (torch.tensor([-1, 2]), "indices"),
    (torch.zeros([1] * 8, dtype=torch.long), "indices.dim()"),
    (torch.tensor([1.0 + 0j]), "indices.dtype"),
], ids=["beyond-table", "negative", "rank-8", "complex"])
def test_embedding_module_errors_name_the_indices(indices, arg):
    with pytest.raises(gradops.OpError) as info:
        gnn.Embedding(10, 4)(indices)
    assert (info.value.status, info.value.arg) == (161002, arg), str(info.value)
