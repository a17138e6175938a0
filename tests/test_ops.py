"""Every op, every sample, every CPU backend: matches the float64 oracle, returns the documented dtypes, never
writes into its inputs, and repeats bit for bit."""

from __future__ import annotations

import inspect

import pytest
import torch

import gradops
from oracles import assert_matches
from samples import OPS, samples

CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op)]

F32 = torch.float32


#: Documented output dtypes, from the inputs.
OUTPUT_DTYPES = {
    "rms_norm": lambda x, *_: (x.dtype, F32),
    "rms_norm_grad": lambda dy, *_: (dy.dtype, F32),
    "layer_norm": lambda x, *_: (x.dtype, F32, F32),
    "layer_norm_grad": lambda dy, x, *_: (x.dtype, x.dtype),
    "layer_norm_grad_beta": lambda res, dy: (dy.dtype, dy.dtype),
    "layer_norm_backward": lambda dy, x, *_: (x.dtype, F32, F32),
    "hardswish": lambda x: (x.dtype,),
    "hardswish_backward": lambda g, x: (x.dtype,),
    "embedding_dense_backward": lambda grad, *_: (grad.dtype,),
    "moe_token_permute": lambda tokens, *_: (tokens.dtype, torch.int32),
    "moe_token_permute_grad": lambda grad, *_: (grad.dtype,),
    "moe_token_unpermute": lambda permuted, *_: (permuted.dtype,),
    # Without probs the second output is torch_npu's empty placeholder, in the tokens' dtype.
    "moe_token_unpermute_grad": lambda permuted, grad, idx, probs=None: (permuted.dtype, (probs if probs is not None
                                                                                          else permuted).dtype),
    # The routing-map ops: without probs, the same empty placeholder in the first input's dtype.
    "moe_token_permute_with_routing_map": lambda tokens, rm, probs, *_: (tokens.dtype, (probs if probs is not None
                                                                                        else tokens).dtype,
                                                                         torch.int32),
    "moe_token_permute_with_routing_map_grad": lambda grad, gp, *_: (grad.dtype, (gp if gp is not None
                                                                                  else grad).dtype),
    "moe_token_unpermute_with_routing_map": lambda permuted, *_: (permuted.dtype,),
    "moe_token_unpermute_with_routing_map_grad": lambda permuted, grad, idx, probs, *_: (
        permuted.dtype, (probs if probs is not None else permuted).dtype),
    "swiglu": lambda x, dim: (x.dtype,),
    "swiglu_grad": lambda g, x, dim: (x.dtype,),
}


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("op,sample", CASES)
def test_matches_oracle(op, sample, backend):
    before = sample.clone()
    fn = getattr(gradops, op)
    got = _as_tuple(fn(*sample.args, **sample.kwargs))
    assert_matches(op, got, sample)
    assert tuple(t.dtype for t in got) == OUTPUT_DTYPES[op](*sample.args)
    for a, b in zip(before.args, sample.args):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and a.stride() == b.stride(), f"{op} wrote into an input"
    again = _as_tuple(fn(*sample.args, **sample.kwargs))
    for x, y in zip(got, again):
        assert torch.equal(x, y), f"{op} is not bitwise repeatable"


def test_embedding_backward_repeatable_at_parallel_sizes(backend):
    """200k gradient rows into 4 table rows: the torch backend's index_put_(accumulate=True) summed them in
    parallel and differed between runs (20 of 20, by up to 2.06); every backend must give the same bits."""
    g = torch.Generator().manual_seed(13)
    grad, idx = torch.randn(200_000, 8, generator=g), torch.randint(0, 4, (200_000,), generator=g)
    first = gradops.embedding_dense_backward(grad, idx, 4, -1, False)
    assert all(torch.equal(first, gradops.embedding_dense_backward(grad, idx, 4, -1, False)) for _ in range(5))


def test_every_op_has_samples():
    assert set(OPS) == set(OUTPUT_DTYPES)
    for op in OPS:
        purposes = {s.purpose for s in samples(op)}
        assert len(purposes) >= 3, f"{op}: samples must cover several purposes"


def _op_args(op, sample) -> tuple:
    """The sample's arguments in the order of the registered op's schema: the public signature with defaults filled,
    less what only the public function takes (``out``; moe_token_unpermute's ignored ``restore_shape``)."""
    bound = inspect.signature(getattr(gradops, op)).bind(*sample.args, **sample.kwargs)
    bound.apply_defaults()
    schema = [a.name for a in getattr(torch.ops.gradops, op).default._schema.arguments]
    return tuple(bound.arguments[name] for name in schema)


@pytest.mark.parametrize("op,sample", CASES)
def test_fake_matches_real(op, sample, backend):
    """Outputs have the shapes, dtypes and strides the op's fake implementation promises: what torch.compile traces
    with. (A backend returning another layout than the fake breaks compiled graphs: found in hardswish_backward.)"""
    torch.library.opcheck(getattr(torch.ops.gradops, op).default, _op_args(op, sample), test_utils=("test_faketensor",))


def test_padding_idx_beyond_int64_means_none(backend):
    grad, idx = torch.randn(3, 2), torch.tensor([0, 1, 1])
    expected = gradops.embedding_dense_backward(grad, idx, 4, -1)
    for padding_idx in (2**64 - 1, 2**63, 10**30, -(2**70)):  # a uint64 pattern or any out-of-table value
        assert torch.equal(gradops.embedding_dense_backward(grad, idx, 4, padding_idx), expected)


# ---------------------------------------------------------------- LayerNorm statistics (issue 12.5)
def _ln_stats(backend_name, monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", backend_name)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 16, generator=g) + 0.5
    dy, gamma = torch.randn(6, 16, generator=g), torch.randn(16, generator=g)
    mean, var = x.mean(-1), x.var(-1, unbiased=False)
    mean[2] = -0.25  # a mean below -epsilon gives a swapped pair away
    return dy, x, mean, var, gamma


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_swapped_layer_norm_statistics_are_refused_on_every_path(backend_name, monkeypatch):
    from gradops.status import ACLNN_ERR_PARAM_INVALID, OpError

    if backend_name == "cpu" and not gradops.backend.usable("cpu", torch.device("cpu"))[0]:
        pytest.skip("the CPU kernels are not built here (python -m gradops.native)")
    dy, x, mean, var, gamma = _ln_stats(backend_name, monkeypatch)
    calls = {
        "public": lambda: gradops.layer_norm_grad(dy, x, mean, var, gamma),  # swapped: mean where variance goes
        "op": lambda: torch.ops.gradops.layer_norm_grad(dy, x, mean, var, gamma, 1e-5),
        "out=": lambda: gradops.layer_norm_grad(dy, x, mean, var, gamma, out=(torch.empty_like(x),
                                                                               torch.empty_like(x))),
    }
    for path, call in calls.items():
        with pytest.raises(OpError, match=r"variance.*swapped.*-0\.25 at row 2") as info:
            call()
        assert info.value.status == ACLNN_ERR_PARAM_INVALID and info.value.arg == "variance", path
    rstd = torch.rsqrt(var + 1e-5)
    for call in (lambda: gradops.layer_norm_backward(dy, x, rstd, mean, gamma),
                 lambda: torch.ops.gradops.layer_norm_backward(dy, x, rstd, mean, gamma)):
        with pytest.raises(OpError, match=r"rstd.*-0\.25 at row 2") as info:
            call()
        assert info.value.arg == "rstd"


def test_layer_norm_statistics_by_keyword_equal_the_positional_cann_order(monkeypatch):
    dy, x, mean, var, gamma = _ln_stats("torch", monkeypatch)
    mean = x.mean(-1)
    positional = gradops.layer_norm_grad(dy, x, var, mean, gamma)
    keyword = gradops.layer_norm_grad(dy, x, mean=mean, variance=var, gamma=gamma)
    assert all(torch.equal(a, b) for a, b in zip(positional, keyword))


def test_a_variance_within_epsilon_below_zero_is_computed_as_cann_does(monkeypatch):
    """E[x^2] - E[x]^2 can come out a rounding below zero for a constant row: still a usable variance."""
    dy, x, _, var, gamma = _ln_stats("torch", monkeypatch)
    var[0] = -1e-9
    pdx, res = gradops.layer_norm_grad(dy, x, var, x.mean(-1), gamma)
    assert torch.isfinite(pdx).all() and torch.isfinite(res).all()


def test_the_autograd_backward_skips_the_statistics_check_its_forward_makes_unnecessary(monkeypatch):

    from gradops.families.layer_norm import ops as ln
    calls = []
    real = ln.plan_layer_norm_backward

    def spy(*args):  # records whether each run of the backward checks rstd (the default: it does)
        plan = real(*args)

        def run(*a, check_statistics=True):
            calls.append(check_statistics)
            return plan.run(*a, check_statistics=check_statistics)
        return plan._replace(run=run)

    monkeypatch.setattr(ln, "plan_layer_norm_backward", spy)
    x = torch.randn(4, 8, requires_grad=True)
    gradops.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5)[0].square().sum().backward()
    assert calls == [False] and x.grad is not None
    with torch.profiler.profile():  # through the op: checked, as any direct call of the backward op
        gradops.layer_norm(x, torch.ones(8), torch.zeros(8), 1e-5)[0].square().sum().backward()
    assert calls == [False, True]
