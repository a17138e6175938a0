"""What each process of tests/test_transformers_ep.py runs: a tiny Mixtral under transformers' own expert
parallelism (``from_pretrained(..., distributed_config=DistributedConfig(ep_size=...))``) with gradops' experts and,
for ``ep_implementation="gradops"``, gradops' token exchange. Spawned children import this module by name.

Each scenario saves ``<out>/<scenario>-<rank>.pt``; the parent compares with one process running the same model.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from rank_exit import end_rank

#: 4 experts, top-2, 2 layers: with 2 ranks each owns 2 experts.
CONFIG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
          "max_position_embeddings": 64}
#: The gradients compared: a dense one (all-reduced / reduce-scattered over the batch) and both expert weights.
GRADS = ("model.embed_tokens.weight", "model.layers.0.mlp.experts.gate_up_proj",
         "model.layers.1.mlp.experts.down_proj")


def save_model(path: Path) -> None:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**CONFIG)).save_pretrained(path)


def load(path: Path, distributed_config=None, experts: str = "gradops"):
    from transformers import AutoModelForCausalLM

    extra = {} if distributed_config is None else {"distributed_config": distributed_config}
    return AutoModelForCausalLM.from_pretrained(path, experts_implementation=experts, dtype=torch.float32, **extra)


def batch() -> torch.Tensor:
    """Four sequences of 8 tokens (every position has a label, so a rank's mean loss weighs as much as another's)."""
    return torch.randint(0, CONFIG["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(5))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def step(model, ids: torch.Tensor) -> dict:
    """Loss, then the gradients of :data:`GRADS` (whole tensors, gathered from their shards)."""
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"loss": loss.detach(), **{name: _full(params[name].grad) for name in GRADS}}


def direct_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs for layer 0's experts called directly: 10 tokens, every route to experts 0 and 1 (rank 0's), so the
    other rank's experts receive no rows."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, CONFIG["hidden_size"], generator=g)
    ids = torch.tensor([[0, 1], [1, 0]]).repeat(5, 1)
    weights = torch.rand(10, 2, generator=g)
    return hidden, ids, weights, torch.randn(10, CONFIG["hidden_size"], generator=g)


def direct(model) -> dict:
    """Layer 0's experts on :func:`direct_inputs`: output and every gradient."""
    hidden, ids, weights, upstream = direct_inputs()
    hidden, weights = hidden.requires_grad_(), weights.requires_grad_()
    experts = model.model.layers[0].mlp.experts
    out = experts(hidden, ids, weights)
    (out * upstream).sum().backward()
    return {"out": out.detach(), "hidden": hidden.grad, "weights": weights.grad,
            "gate_up_proj": _full(experts.gate_up_proj.grad), "down_proj": _full(experts.down_proj.grad)}


def run(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            _scenarios(rank, world, Path(model_dir), Path(out))
        finally:
            dist.destroy_process_group()
    except Exception:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    end_rank()


def _scenarios(rank: int, world: int, path: Path, out: Path) -> None:
    from transformers.distributed import DistributedConfig

    import gradops.transformers

    gradops.transformers.register()
    ids = batch()
    mine = ids.chunk(world)[rank]
    # FSDP + EP (efsdp = 1): each rank its own share of the batch, tokens exchanged by all-to-all.
    for implementation in ("gradops", "all_to_all"):
        model = load(path, DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=implementation))
        first, again = step(model, mine), step(model, mine)
        first["repeatable"] = torch.tensor(all(torch.equal(first[k], again[k]) for k in first))
        torch.save(first, out / f"fsdp-{implementation}-{rank}.pt")
    # TP + EP: the ranks share the batch; gradops' exchange sends each TP rank's slice of it.
    config = DistributedConfig(tp_size=world, ep_size=world, ep_implementation="gradops")
    torch.save(step(load(path, config), ids), out / f"tp-gradops-{rank}.pt")
    # Inference over a shared batch: "auto" runs transformers' all-reduce EP, i.e. gradops' experts with the
    # off-rank routes as sentinels.
    model = load(path, DistributedConfig(tp_size=world, ep_size=world))
    with torch.no_grad():
        torch.save({"logits": model(input_ids=ids).logits}, out / f"infer-auto-{rank}.pt")
    # A rank whose experts receive no rows, with gradops' grouped experts and with another implementation.
    for experts in ("gradops", "eager"):
        model = load(path, config, experts=experts)
        torch.save(direct(model), out / f"direct-{experts}-{rank}.pt")
