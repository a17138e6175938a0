"""Train a tiny Hugging Face Qwen3-MoE on gradops (nothing downloaded: the model is built from its config, the
text is the Python standard library's own docstrings, bytes as tokens).

Run (after ``bash scripts/test.sh`` or ``bash scripts/main.sh`` set up ``.venv``, or ``pip install -e
'.[transformers]'``)::

    python examples/transformers_qwen3_moe.py                  # gradops.patch on the built model
    python examples/transformers_qwen3_moe.py --way register   # register, then from_config(experts="gradops")

It prints what gradops swapped, the loss every few steps, and exits 1 unless the loss fell and gradops' MoE ops
ran.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import transformers

import gradops
import gradops.transformers as gradops_hf
from gradops.demo.data import Batches, stdlib_corpus


def build(way: str, dtype: torch.dtype) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512)
    torch.manual_seed(0)
    if way == "patch":
        model = transformers.Qwen3MoeForCausalLM(config).to(dtype)
        print(gradops.patch(model))
        return model
    # The second way in: the "gradops" experts implementation by name, and transformers' patch mapping
    # building the RMSNorm classes as gradops' subclasses.
    gradops_hf.register(norms=["qwen3_moe"])
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="gradops").to(dtype)
    norms = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                    if type(m).__name__.endswith("RMSNorm")})
    print(f"from_config: experts_implementation={model.config._experts_implementation!r}, norms {norms}")
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", choices=("patch", "register"), default="patch")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build(args.way, dtype)
    text, what = stdlib_corpus()
    data = Batches(text, seq_len=128, batch_size=8, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    print(f"training {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters ({args.dtype}) on {what}")
    losses = []
    start = time.perf_counter()
    with torch.profiler.profile() as prof:  # one step, to show which gradops ops run
        x, _ = data.next_train()
        model(input_ids=x, labels=x).loss.backward()
        opt.zero_grad()
    ran = sorted({e.name for e in prof.events() if e.name.startswith("gradops::")})
    print("gradops ops in a step:", ", ".join(ran))
    for step in range(args.steps):
        x, _ = data.next_train()
        loss = model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.3f}", flush=True)
    took = time.perf_counter() - start
    first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
    print(f"{args.steps} steps in {took:.1f} s; loss {first:.3f} -> {last:.3f} (mean of the first and last 5)")
    ok = last < first and "gradops::moe_token_unpermute_grad" in ran and "gradops::rms_norm_grad" in ran
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
