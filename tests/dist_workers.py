"""The code each process of tests/test_distributed.py runs (spawned: a module the children can import).

Every scenario builds its data from a fixed seed, identical on every rank, takes this rank's share, runs, and
saves what the parent compares with a single-process run of the same data: ``<out>/<scenario>-<rank>.pt``.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import torch
import torch.distributed as dist

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
        finally:
            dist.destroy_process_group()
    except Exception:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


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
