"""torch.func on gradops (issue 14.3): ``grad`` through every module and differentiable forward gives the bits of
the eager backward, ``vmap(grad(...))`` gives per-sample gradients equal to one eager backward per sample, and the
backward ops themselves map over a batch. Each case failed before the ops got a setup_context-style Function and a
vmap rule ("... must override the setup_context staticmethod")."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vmap

import gradops
import gradops.nn as gnn

D = 8


def _modules():
    gen = torch.Generator().manual_seed(5)
    ln, rms = gnn.LayerNorm(D), gnn.RMSNorm(D)
    with torch.no_grad():  # weights away from 1 and 0 so that a lost weight gradient shows
        for p in (*ln.parameters(), *rms.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen))
    return {"LayerNorm": ln, "RMSNorm": rms, "Hardswish": gnn.Hardswish()}


MODULES = ["LayerNorm", "RMSNorm", "Hardswish"]


def _inputs(rows=5):
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(6)) * 2


def _loss(out):
    # Fixed, non-uniform cotangent: a sum alone would make LayerNorm's input gradient vanish.
    return (out * torch.linspace(-1, 2, out.numel()).view(out.shape)).sum()


def _eager_grads(module, x):
    params = dict(module.named_parameters())
    xg = x.clone().requires_grad_()
    for p in params.values():
        p.grad = None
    _loss(module(xg)).backward()
    return xg.grad, {k: p.grad.clone() for k, p in params.items()}


@pytest.mark.parametrize("name", MODULES)
def test_grad_through_modules_equals_eager_backward(name, backend):
    module, x = _modules()[name], _inputs()
    params = {k: p.detach() for k, p in module.named_parameters()}
    dx = grad(lambda z: _loss(module(z)))(x)
    dparams = grad(lambda p: _loss(functional_call(module, p, (x,))))(params)
    eager_dx, eager_dparams = _eager_grads(module, x)
    assert torch.equal(dx, eager_dx)
    assert dparams.keys() == eager_dparams.keys()
    for k in dparams:
        assert torch.equal(dparams[k], eager_dparams[k]), k


@pytest.mark.parametrize("name", MODULES)
def test_per_sample_gradients_equal_one_backward_per_sample(name, backend):
    module, x = _modules()[name], _inputs()
    params = {k: p.detach() for k, p in module.named_parameters()}

    def loss(p, sample):
        return _loss(functional_call(module, p, (sample[None],)))

    per_sample = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, 0))(params, x)
    for i in range(x.shape[0]):
        eager_dx, eager_dparams = _eager_grads(module, x[i:i + 1])
        assert torch.equal(per_sample[1][i], eager_dx[0])
        for k in params:
            assert torch.equal(per_sample[0][k][i], eager_dparams[k]), (k, i)


def test_embedding_per_sample_gradients(backend):
    emb, idx = gnn.Embedding(10, 4, padding_idx=3), torch.tensor([[1, 3, 1], [0, 9, 9], [3, 3, 2]])
    params = {k: p.detach() for k, p in emb.named_parameters()}
    per_sample = vmap(grad(lambda p, i: _loss(functional_call(emb, p, (i,)))), in_dims=(None, 0))(params, idx)
    assert per_sample["weight"].shape == (3, 10, 4)
    for i in range(3):
        emb.weight.grad = None
        _loss(emb(idx[i])).backward()
        assert torch.equal(per_sample["weight"][i], emb.weight.grad)
        assert not per_sample["weight"][i, 3].any()  # the padding row gets no gradient


def test_grad_through_the_moe_pair(backend):
    tokens, routing = _inputs(6), torch.tensor([[0, 2], [1, 1], [2, 0], [0, 1], [2, 2], [1, 0]])
    probs = torch.rand(6, 2, generator=torch.Generator().manual_seed(7))

    def loss(t, p):
        permuted, sorted_indices = gradops.moe_token_permute(t, routing)
        return _loss(gradops.moe_token_unpermute(permuted * 3, sorted_indices, p))

    d_tokens, d_probs = grad(loss, argnums=(0, 1))(tokens, probs)
    t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    loss(t, p).backward()
    assert torch.equal(d_tokens, t.grad) and torch.equal(d_probs, p.grad)


def test_grad_through_the_functional_forwards(backend):
    x, gamma, beta = _inputs(), torch.randn(D), torch.randn(D)
    cases = {
        "rms_norm": lambda z: gradops.rms_norm(z, gamma)[0],
        "layer_norm": lambda z: gradops.layer_norm(z, gamma, beta, 1e-5)[0],
        "hardswish": gradops.hardswish,
    }
    for name, fn in cases.items():
        z = x.clone().requires_grad_()
        _loss(fn(z)).backward()
        assert torch.equal(grad(lambda v, fn=fn: _loss(fn(v)))(x), z.grad), name


def test_vmap_of_backward_ops_maps_each_sample(backend):
    """The ops' own vmap rule: dgamma of each sample, not summed over the batch."""
    gen = torch.Generator().manual_seed(8)
    dy, x, gamma = torch.randn(3, 4, D, generator=gen), torch.randn(3, 4, D, generator=gen), torch.randn(D)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    dx, dgamma = vmap(gradops.rms_norm_grad, in_dims=(0, 0, 0, None))(dy, x, rstd, gamma)
    assert dgamma.shape == (3, D)
    for i in range(3):
        one = gradops.rms_norm_grad(dy[i], x[i], rstd[i], gamma)
        assert torch.equal(dx[i], one[0]) and torch.equal(dgamma[i], one[1])
    in_dim_1 = vmap(gradops.hardswish_backward, in_dims=(1, 1))(dy, x)  # a batch dim that is not the first
    assert torch.equal(in_dim_1, torch.stack([gradops.hardswish_backward(dy[:, j], x[:, j]) for j in range(4)]))


def test_vmap_keeps_refusals():
    with pytest.raises(gradops.OpError) as info:
        vmap(gradops.hardswish)(torch.zeros(2, 3, dtype=torch.int32))
    assert info.value.arg == "self.dtype"
