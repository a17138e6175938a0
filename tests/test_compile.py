"""torch.compile(fullgraph=True), forward + backward, over every gradops.nn module.

One model holds every module, so the whole check costs a single compilation (~20 s on a 2-core CPU; one
compile per module would cost ~8x that). fullgraph=True turns any graph break into an error.
"""

from __future__ import annotations

import pytest
import torch

from gradops import nn as gnn

pytestmark = pytest.mark.compile


class _EveryModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = gnn.Embedding(20, 16, padding_idx=-1, scale_grad_by_freq=True)
        self.rms = gnn.RMSNorm(16)  # eps=None: finfo eps, read from the input's dtype while tracing
        self.ln = gnn.LayerNorm(16, bias=False)
        self.router = torch.nn.Linear(16, 4)
        self.permute = gnn.MoeTokenPermute()
        self.expert = torch.nn.Linear(16, 16)
        self.act = gnn.Hardswish()
        self.unpermute = gnn.MoeTokenUnpermute()

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.rms(self.emb(indices))).reshape(-1, 16)
        probs, experts = torch.topk(torch.softmax(self.router(x), dim=-1), 2)
        permuted, sorted_indices = self.permute(x, experts)
        y = self.unpermute(self.act(self.expert(permuted)), sorted_indices, probs)
        return (y * y).sum()


def test_fullgraph_forward_backward_matches_eager():
    torch.manual_seed(0)
    model = _EveryModule()
    indices = torch.randint(0, 20, (3, 5))
    indices[0, 0] = 19  # the padding row

    eager_loss = model(indices)
    eager_loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)  # the default backend, inductor: what users run
    loss = compiled(indices)
    loss.backward()

    torch.testing.assert_close(loss, eager_loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[name], msg=lambda m, n=name: f"grad of {n}: {m}")
    assert torch.all(model.emb.weight.grad[19] == 0)

    # A second step with the same shapes reuses the compiled graph: nothing dynamo traced reads gradops state
    # that the first step changed (a remembered-check table did, and recompiled the model on its second step).
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled(indices).backward()
