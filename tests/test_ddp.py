"""DistributedDataParallel over two CPU processes (gloo): a model built from gradops modules gets the same
gradients as one process running the whole batch.

Each rank runs half of the batch; DDP averages the two gradients, which equals the full-batch gradient of the
mean loss because the halves are equal in size. The float32 sums differ only in order (two halves then an
all-reduce, versus one pass), a few ulps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradops import nn as gnn
from rank_exit import end_rank

BATCH, SEQ, VOCAB, DIM = 8, 6, 32, 16
STEPS = 2


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = gnn.Embedding(VOCAB, DIM, padding_idx=0)
        self.rms = gnn.RMSNorm(DIM)
        self.ln = gnn.LayerNorm(DIM)
        self.router = torch.nn.Linear(DIM, 4, bias=False)
        self.permute = gnn.MoeTokenPermute()
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.act = gnn.Hardswish()
        self.down = torch.nn.Linear(2 * DIM, DIM)
        self.unpermute = gnn.MoeTokenUnpermute()
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.rms(self.emb(tokens))).reshape(-1, DIM)
        probs, experts = torch.topk(torch.softmax(self.router(x), dim=-1), 2)
        permuted, sorted_indices = self.permute(x, experts)
        y = self.unpermute(self.down(self.act(self.up(permuted))), sorted_indices, probs)
        return self.head(y).reshape(*tokens.shape, VOCAB)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model: torch.nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    """STEPS SGD steps; returns the gradients of the last step (so step 1 runs on DDP-synchronised weights)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        opt.zero_grad()
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
    return grads


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(_Model())
        tokens, targets = _data()
        half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        grads = _train(model, tokens[half], targets[half])
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()
    end_rank()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
def test_ddp_two_processes_match_single_process(tmp_path):
    out = str(tmp_path / "grads.pt")
    # A file store, not a TCP port: a port found free and then closed can be taken by another test worker's process
    # before rank 0 binds it. Rank 1's rare abort at exit in CI was torch's gloo teardown, not the port (rank_exit).
    mp.spawn(_worker, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    ddp_grads = torch.load(out)

    torch.manual_seed(0)
    single = _train(_Model(), *_data())
    assert len(ddp_grads) == len(single)
    for i, (a, b) in enumerate(zip(ddp_grads, single)):
        # float32, sums split in two halves plus an all-reduce: a few ulps of the largest gradient entry.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()) + 1e-8,
                                   msg=lambda m, i=i: f"parameter {i}: {m}")
