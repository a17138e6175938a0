"""The code each process of tests/test_distributed.py runs (spawned: a module the children can import).

Every scenario builds its data from a fixed seed, identical on every rank, takes this rank's share, runs, and
saves what the parent compares with a single-process run of the same data: ``<out>/<scenario>-<rank>.pt``.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from rank_exit import end_rank

H, E, K = 16, 8, 2


def routing(kind: str, t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids (T, K) int64, probs (T, K) float32)`` for the whole batch: ``random``; ``skewed`` (expert 3 gets
    no token, expert 0 most); ``one_rank`` (every copy to experts 0 and 1, i.e. rank 0's)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    elif kind == "skewed":
        ids = torch.randint(0, E, (t, K), generator=g)
        ids[ids == 3] = 0
        ids[: t // 2, 0] = 0
    else:
        ids = torch.stack([torch.tensor([0, 1]) if i % 2 else torch.tensor([1, 0]) for i in range(t)])
    probs = torch.rand(t, K, generator=g)
    return ids, probs / probs.sum(-1, keepdim=True)


def experts(seed: int = 1) -> list[torch.nn.Linear]:
    torch.manual_seed(seed)
    return [torch.nn.Linear(H, H) for _ in range(E)]


def shares(t: int, world: int, empty_rank: bool) -> list[int]:
    """Uneven token counts per rank summing to t: rank 0 two more than the rest, or none when ``empty_rank``."""
    sizes = [0] + [t // (world - 1)] * (world - 1) if empty_rank else [t // world + 2] + [t // world] * (world - 1)
    sizes[-1] += t - sum(sizes)
    return sizes


def ep_step(tokens, ids, probs, upstream, layers, dispatcher_experts, group=None):
    """One expert-parallel forward + backward through gradops.distributed; returns what is compared."""
    from gradops import distributed

    tokens = tokens.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    rows, counts, handle = distributed.dispatch(tokens, ids, E, group)
    chunks = rows.split(counts.tolist())
    y = torch.cat([layers[e](c) for e, c in zip(dispatcher_experts, chunks)])
    out = distributed.combine(y, handle, probs)
    (out * upstream).sum().backward()
    grads = {f"w{e}": layers[e].weight.grad.clone() for e in dispatcher_experts}
    grads |= {f"b{e}": layers[e].bias.grad.clone() for e in dispatcher_experts}
    return {"out": out.detach(), "tokens": tokens.grad, "probs": probs.grad, "rows": rows.detach(),
            "counts": counts, **grads}


def run(rank: int, world: int, store: str, out: str) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            _scenarios(rank, world, Path(out))
            _dtensor(rank, world, Path(out))
            _fsdp(rank, world, Path(out))
        finally:
            dist.destroy_process_group()
    except Exception:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    end_rank()


def _scenarios(rank: int, world: int, out: Path) -> None:
    from gradops import distributed

    t = 24
    local = range(rank * E // world, (rank + 1) * E // world)
    for kind, empty_rank in (("random", False), ("skewed", False), ("one_rank", False), ("random", True)):
        g = torch.Generator().manual_seed(2)
        tokens, upstream = torch.randn(t, H, generator=g), torch.randn(t, H, generator=g)
        ids, probs = routing(kind, t)
        sizes = shares(t, world, empty_rank)
        lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
        result = ep_step(tokens[lo:hi], ids[lo:hi], probs[lo:hi], upstream[lo:hi], experts(), local)
        result["span"] = torch.tensor([lo, hi])
        torch.save(result, out / f"ep-{kind}-{int(empty_rank)}-{rank}.pt")
    dispatcher = distributed.TokenDispatcher(E)
    torch.save({"local": torch.tensor([dispatcher.local_experts.start, dispatcher.local_experts.stop])},
               out / f"dispatcher-{rank}.pt")


def sharded_case(wrap, full) -> dict:
    """Norms, hardswish, embedding and the MoE permute pair, forward + backward, with each input placed by
    ``wrap(tensor, placement name)`` (a DTensor, or the tensor itself for the unsharded run); ``full`` turns a
    result back into a plain tensor. Placements: rows of the norms by sequence (dim 1), hardswish by hidden,
    embedding by tokens, MoE by hidden."""
    import gradops

    g = torch.Generator().manual_seed(5)
    x, up = torch.randn(4, 6, H, generator=g), torch.randn(4, 6, H, generator=g)
    gamma, beta = torch.randn(H, generator=g), torch.randn(H, generator=g)
    table, idx = torch.randn(10, H, generator=g), torch.randint(0, 10, (12,), generator=g)
    tokens, probs = torch.randn(6, H, generator=g), torch.rand(6, 2, generator=g)
    experts = torch.randint(0, 4, (6, 2), generator=g)
    found = {}

    def leaf(t, placement):
        return wrap(t.clone(), placement).requires_grad_()

    xs, gs, bs, ups = leaf(x, "seq"), leaf(gamma, "rep"), leaf(beta, "rep"), wrap(up, "seq")
    y, rstd = gradops.rms_norm(xs, gs)
    (y * ups).sum().backward()
    found |= {"rms.y": full(y), "rms.rstd": full(rstd), "rms.dx": full(xs.grad), "rms.dgamma": full(gs.grad)}

    xs, gs = leaf(x, "seq"), leaf(gamma, "rep")
    y, mean, var = gradops.layer_norm(xs, gs, bs, 1e-5)
    (y * ups).sum().backward()
    found |= {"ln.y": full(y), "ln.mean": full(mean), "ln.var": full(var), "ln.dx": full(xs.grad),
              "ln.dgamma": full(gs.grad), "ln.dbeta": full(bs.grad)}

    xs = leaf(x, "hidden")
    y = gradops.hardswish(xs)
    (y * wrap(up, "hidden")).sum().backward()
    found |= {"hsw.y": full(y), "hsw.dx": full(xs.grad)}

    ts = leaf(table, "rep")
    y = gradops.embedding(ts, wrap(idx, "tokens"))
    (y * wrap(up.reshape(-1, H)[:12], "tokens")).sum().backward()
    found |= {"emb.y": full(y), "emb.dtable": full(ts.grad)}

    tk, pr = leaf(tokens, "cols"), leaf(probs, "rep")
    permuted, sorted_indices = gradops.moe_token_permute(tk, wrap(experts, "rep"))
    merged = gradops.moe_token_unpermute(permuted * 2, sorted_indices, pr)
    (merged * wrap(up.reshape(-1, H)[:6], "cols")).sum().backward()
    found |= {"moe.permuted": full(permuted), "moe.merged": full(merged), "moe.dtokens": full(tk.grad),
              "moe.dprobs": full(pr.grad)}
    return found


def _dtensor(rank: int, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dims = {"seq": 1, "hidden": 2, "tokens": 0, "cols": 1}

    def wrap(t, placement):
        return distribute_tensor(t, mesh, [Replicate() if placement == "rep" else Shard(dims[placement])])

    seen = []

    def full(t):
        seen.append(str(t.placements[0]) if isinstance(t, DTensor) else "plain")
        return t.full_tensor() if isinstance(t, DTensor) else t

    found = sharded_case(wrap, full)
    torch.save({**found, "placements": dict(zip(found, seen))}, out / f"dtensor-{rank}.pt")


def demo_model():
    """The demo's MoE language model with gradops patched in, fixed initial weights, no load-balancing term (a
    product of per-rank means is not the global product; the rest of the loss is a mean the ranks split exactly)."""
    import gradops
    from gradops import nn as gnn
    from gradops.demo.model import Config, MoeLM

    torch.manual_seed(0)
    model = MoeLM(Config(aux_loss=0.0), gnn.MoeTokenPermute, gnn.MoeTokenUnpermute)
    gradops.patch(model)
    return model


def demo_batch() -> torch.Tensor:
    """Eight sequences of 65 bytes, none of them the padding byte 0 (so every rank's mean has the same count)."""
    return torch.randint(1, 256, (8, 65), generator=torch.Generator().manual_seed(1))


def train(model, batch: torch.Tensor, steps: int = 3) -> list[float]:
    """AdamW steps on ``batch``; the next-byte losses before each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        total, lm = model.loss(batch[:, :-1], batch[:, 1:])
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(lm.detach())
    return losses


def _fsdp(rank: int, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = demo_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    batch = demo_batch()
    per = batch.shape[0] // world
    losses = torch.stack(train(model, batch[rank * per:(rank + 1) * per]))
    dist.all_reduce(losses)
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    torch.save({"losses": losses / world, "params": params}, out / f"fsdp-{rank}.pt")
