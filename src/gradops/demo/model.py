"""A small mixture-of-experts transformer language model (bytes in, next-byte logits out).

Built from plain ``torch.nn`` modules so that the twin IS this model; the gradops copy is the same code with
gradops' MoE permute pair plugged in and :func:`gradops.patch` swapping the rest (Embedding, RMSNorm,
LayerNorm, Hardswish). Every gradops operator runs in a step:

- token and position ``Embedding`` (padding_idx 0: the NUL byte, absent from text) -> EmbeddingDenseBackward
- ``RMSNorm`` before attention and at the output -> RmsNormGrad
- ``LayerNorm`` before the MoE layer -> LayerNormGrad + LayerNormGradBeta
- top-k routing with ``moe_token_permute`` / its inverse -> MoeTokenPermuteGrad
- expert MLPs ``Linear -> Hardswish -> Linear`` -> HardswishBackward
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The byte that pads sequences (and never occurs in the corpus).
PAD = 0


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    seq_len: int = 64
    dim: int = 96
    heads: int = 4
    layers: int = 2
    experts: int = 4
    topk: int = 2
    expert_dim: int = 192
    aux_loss: float = 0.01  # Switch-style load balancing, keeps every expert (and its permute rows) in use


class TorchTokenPermute(nn.Module):
    """Plain-PyTorch twin of :class:`gradops.nn.MoeTokenPermute` in CANN's convention: two stable argsorts;
    ``sorted_indices`` is the permuted row of each (token, k) copy."""

    def forward(self, tokens: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        k = indices.shape[1] if indices.dim() == 2 else 1
        order = torch.argsort(indices.reshape(-1), stable=True)
        return tokens.index_select(0, order // k), torch.argsort(order).to(torch.int32)


class TorchTokenUnpermute(nn.Module):
    """Plain-PyTorch twin of :class:`gradops.nn.MoeTokenUnpermute`: gather each token's K rows, weight, sum."""

    def forward(self, permuted: Tensor, sorted_indices: Tensor, probs: Tensor) -> Tensor:
        t, k = probs.shape
        rows = permuted.index_select(0, sorted_indices.long()).view(t, k, -1)
        return (rows * probs.unsqueeze(-1)).sum(dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class MoE(nn.Module):
    """Top-k routed experts: permute the (token, k) copies into expert order, run each expert on its
    contiguous rows, unpermute with the renormalised routing probabilities."""

    def __init__(self, cfg: Config, permute: nn.Module, unpermute: nn.Module) -> None:
        super().__init__()
        self.topk, self.num_experts = cfg.topk, cfg.experts
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(cfg.dim, cfg.expert_dim), nn.Hardswish(), nn.Linear(cfg.expert_dim, cfg.dim))
            for _ in range(cfg.experts))
        self.permute, self.unpermute = permute, unpermute
        self.aux = torch.zeros(())
        #: A :class:`gradops.distributed.TokenDispatcher` for expert parallelism (``gradops demo --ep N``): rows go
        #: to the rank owning their expert and this rank runs its own experts only. None: every expert here.
        self.dispatcher = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.softmax(self.router(x), dim=-1)
        probs, chosen = torch.topk(scores, self.topk, dim=-1)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        counts = torch.bincount(chosen.reshape(-1), minlength=self.num_experts)
        if self.dispatcher is None:
            permuted, sorted_indices = self.permute(x, chosen)
            # Rows come grouped by expert id (stable sort), so expert e owns the next counts[e] rows.
            chunks = permuted.split(counts.tolist())
            y = self.unpermute(torch.cat([f(c) for f, c in zip(self.experts, chunks)]), sorted_indices, probs)
            load, mean_scores = counts.to(scores.dtype) / chosen.numel(), scores.mean(dim=0)
        else:
            rows, local_counts = self.dispatcher.dispatch(x, chosen)
            chunks = rows.split(local_counts.tolist())
            experts = [self.experts[e] for e in self.dispatcher.local_experts]
            y = self.dispatcher.combine(torch.cat([f(c) for f, c in zip(experts, chunks)]), probs)
            load, mean_scores = self._global_statistics(counts, scores)
        self.aux = self.num_experts * (load * mean_scores).sum()
        return y.view(shape)

    def _global_statistics(self, counts: Tensor, scores: Tensor) -> tuple[Tensor, Tensor]:
        """The load-balancing term's expert load and mean router score over every rank's tokens (so that the
        term, a product of two means, is the single-process one); the score sum is reduced differentiably."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_reduce

        group = self.dispatcher.group
        totals = torch.cat([counts, counts.new_tensor([scores.shape[0]])])
        dist.all_reduce(totals, group=group)
        load = totals[:-1].to(scores.dtype) / (totals[-1] * self.topk)  # counts / (T * K), all ranks' T
        return load, all_reduce(scores.sum(dim=0), group=group) / totals[-1]


class Block(nn.Module):
    def __init__(self, cfg: Config, permute: nn.Module, unpermute: nn.Module) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.attn = Attention(cfg)
        self.moe_norm = nn.LayerNorm(cfg.dim)
        self.moe = MoE(cfg, permute, unpermute)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoeLM(nn.Module):
    """Byte-level MoE transformer. ``forward(tokens (B, S)) -> logits (B, S, vocab)``; :meth:`loss` adds the
    routers' load-balancing term."""

    def __init__(self, cfg: Config, permute_cls: type[nn.Module] = TorchTokenPermute,
                 unpermute_cls: type[nn.Module] = TorchTokenUnpermute) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim, padding_idx=PAD)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, permute_cls(), unpermute_cls()) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """``(total, lm)``: the training objective and the next-byte cross-entropy alone (what is reported)."""
        logits = self(tokens)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD)
        aux = sum(block.moe.aux for block in self.blocks)
        return lm + self.cfg.aux_loss * aux, lm


def build_pair(cfg: Config, seed: int, device: torch.device) -> tuple[MoeLM, MoeLM, object]:
    """``(gradops model, plain-PyTorch twin, patch report)`` with identical initial weights."""
    import gradops
    from gradops import nn as gnn

    torch.manual_seed(seed)
    twin = MoeLM(cfg).to(device)
    model = MoeLM(cfg, gnn.MoeTokenPermute, gnn.MoeTokenUnpermute).to(device)
    model.load_state_dict(twin.state_dict())
    report = gradops.patch(model)
    return model, twin, report
