"""A MoE layer written against torch_npu's names, as MindSpeed writes it, trained off the NPU with gradops.

The layer routes each token to its top-k experts, groups the token copies by expert with
``npu_moe_token_permute_with_routing_map``, runs each expert's MLP on its rows and merges them back, weighted by
the routing probabilities, with ``npu_moe_token_unpermute_with_routing_map`` - with ``drop_and_pad`` off (every
routed copy) and on (a fixed capacity per expert: the lowest token ids kept, short experts padded). On an Ascend
machine the same code runs on ``torch_npu``; elsewhere the one import below points it at
:mod:`gradops.npu_compat`.

It trains the layer beside a plain-PyTorch twin (Megatron's unfused permute / unpermute: masked_select,
index_select, index_add) from the same weights on the same data, and checks that both train alike: the losses and
the weights after every step agree to float32 rounding. Exit status 1 if they do not.

    python examples/mindspeed_moe_layer.py                 # CPU, both modes, 20 steps each
    python examples/mindspeed_moe_layer.py --device cuda   # the Triton kernels
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

try:  # on Ascend: torch_npu's own operators
    import torch_npu as npu  # type: ignore[import-not-found]
except ImportError:  # anywhere else: the same names on gradops
    from gradops import npu_compat as npu


class MoELayer(nn.Module):
    """Router, routing-map permute, one MLP per expert, weighted unpermute."""

    def __init__(self, hidden: int, ffn: int, experts: int, topk: int, capacity: int | None) -> None:
        super().__init__()
        self.topk, self.experts, self.capacity = topk, experts, capacity
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn) / hidden ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn ** 0.5)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, E) routing map of each token's top-k experts and their softmax probabilities (zeros elsewhere)."""
        scores = self.router(x).softmax(-1)
        top = scores.topk(self.topk, dim=-1).indices
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
        return routing_map, scores * routing_map

    def experts_on(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's MLP on its consecutive block of rows."""
        blocks = rows.split(counts)
        return torch.cat([torch.relu(b @ self.w1[e]) @ self.w2[e] for e, b in enumerate(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing_map, probs = self.route(x)
        drop = self.capacity is not None
        num_out_tokens = self.capacity * self.experts if drop else self.topk * x.shape[0]
        permuted, _, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
            x, routing_map, num_out_tokens=num_out_tokens, drop_and_pad=drop)
        counts = [self.capacity] * self.experts if drop else routing_map.sum(0).tolist()
        routed = sum(counts)  # without drop_and_pad, rows past the routed ones are padding
        out_rows = self.experts_on(permuted[:routed], counts)
        out_rows = torch.cat([out_rows, out_rows.new_zeros(permuted.shape[0] - routed, out_rows.shape[1])])
        return npu.npu_moe_token_unpermute_with_routing_map(out_rows, sorted_indices, x.shape, probs=probs,
                                                            routing_map=routing_map, drop_and_pad=drop)


class MegatronMoELayer(MoELayer):
    """The same layer with Megatron's unfused token movement (moe_utils.permute / unpermute)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing_map, probs = self.route(x)
        tokens, experts = routing_map.shape
        if self.capacity is None:
            mask = routing_map.T
            token_of_row = torch.arange(tokens).expand(experts, -1).masked_select(mask)
            weights = probs.T.masked_select(mask)
            counts = routing_map.sum(0).tolist()
        else:
            order = torch.argsort(routing_map.T.int(), dim=-1, descending=True, stable=True)
            token_of_row = order[:, :self.capacity].reshape(-1)
            expert_of_row = torch.arange(experts).repeat_interleave(self.capacity)
            weights = probs[token_of_row, expert_of_row]
            counts = [self.capacity] * experts
        out_rows = self.experts_on(x.index_select(0, token_of_row), counts)
        return torch.zeros_like(x).index_add(0, token_of_row, out_rows * weights[:, None])


def train(drop_and_pad: bool, steps: int, device: torch.device, seed: int = 0) -> float:
    """Train both layers side by side; returns the largest difference seen (losses and weights, relative)."""
    torch.manual_seed(seed)
    tokens, hidden, ffn, experts, topk = 64, 32, 48, 8, 2
    capacity = (tokens * topk // experts) // 2 if drop_and_pad else None  # half the mean load: drops and pads
    ours = MoELayer(hidden, ffn, experts, topk, capacity).to(device)
    twin = MegatronMoELayer(hidden, ffn, experts, topk, capacity).to(device)
    twin.load_state_dict(copy.deepcopy(ours.state_dict()))
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, twin)]
    target = torch.randn(tokens, hidden, device=device)
    worst = 0.0
    for step in range(steps):
        x = torch.randn(tokens, hidden, device=device)
        losses = []
        for model, opt in zip((ours, twin), optimisers):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        drift = max((a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
                    for a, b in zip(ours.parameters(), twin.parameters()))
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[1]), drift)
        if step % 5 == 0 or step == steps - 1:
            print(f"drop_and_pad={drop_and_pad!s:5} step {step:2d}: loss {losses[0]:.6f} (twin {losses[1]:.6f}), "
                  f"weights differ by {drift:.2e} (relative)")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    # float32 rounding, compounded over the steps: the two paths sum the same terms in different orders.
    bound = 1e-4
    ok = True
    for drop in (False, True):
        worst = train(drop, args.steps, torch.device(args.device))
        print(f"drop_and_pad={drop}: largest relative difference {worst:.2e} (bound {bound:.0e})")
        ok &= worst <= bound
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
