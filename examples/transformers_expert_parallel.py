"""Train a tiny Hugging Face Qwen3-MoE with transformers' own expert parallelism on gradops, beside one process.

transformers loads the model with ``DistributedConfig(fsdp_size=N, ep_size=N, ep_implementation="gradops")``: the
dense layers FSDP2-sharded over N ranks, the experts split over them (8 experts: 8 / N each), every rank training
on its N-th of each batch. ``ep_implementation="gradops"`` (registered by ``gradops.transformers.register()``)
moves the token copies with :func:`gradops.distributed.dispatch` / ``combine``; ``"all_to_all"`` is transformers'
own exchange, with gradops' experts inside. Nothing is downloaded: the model is built from its config and saved
to a temporary directory (``from_pretrained`` is transformers' distributed entry point); the text is the Python
standard library's docstrings, bytes as tokens. The N processes are spawned here (gloo, a file store: no port).

Run (after ``bash scripts/test.sh`` or ``bash scripts/main.sh`` set up ``.venv``, or ``pip install -e
'.[transformers]'``, which brings ``accelerate``: transformers' distributed loading imports it)::

    python examples/transformers_expert_parallel.py                     # 2 ranks, gradops' exchange
    python examples/transformers_expert_parallel.py --ep-implementation all_to_all --ranks 4

It prints the mean loss of each step beside a one-process run of the same model on the same batches, and exits 1
unless the two agree to float32 rounding and the loss fell. Measured (2-core VM, torch 2.13, transformers 5.23):
20 steps, 2 ranks, 15 s, at most 4.8e-7 apart (2 float32 ulps at ~4); 4 ranks the same. The bound, 5e-4, leaves
room for AdamW's normalised step to grow last-bit differences of the gradient reduction order over longer runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: Agreement bound on the per-step loss (see the module docstring).
TOLERANCE = 5e-4


def save_model(path: Path) -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)


def train(path: Path, steps: int, rank: int = 0, world: int = 1, distributed_config=None) -> list[float]:
    """AdamW steps on this rank's share of each batch; the mean loss over the ranks before each step."""
    import transformers

    import gradops.transformers
    from gradops.demo.data import Batches, stdlib_corpus

    gradops.transformers.register(norms=["qwen3_moe"])
    extra = {} if distributed_config is None else {"distributed_config": distributed_config}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="gradops",
                                                              dtype=torch.float32, **extra)
    data = Batches(stdlib_corpus()[0], seq_len=64, batch_size=8, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        x = data.next_train()[0].chunk(world)[rank]
        loss = model(input_ids=x, labels=x).loss  # transformers shifts the labels itself
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
    return losses


def _rank(rank: int, world: int, store: str, path: str, steps: int, implementation: str, out: str) -> None:
    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            from transformers.distributed import DistributedConfig

            config = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=implementation)
            losses = train(Path(path), steps, rank, world, config)
            if rank == 0:
                torch.save(losses, Path(out, "losses.pt"))
        finally:
            dist.destroy_process_group()
    except Exception:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    # End the rank without the interpreter's teardown: torch 2.13 keeps the gloo group's threads running after
    # destroy_process_group() once FSDP has used it, and a normal exit beside them aborts now and then ("terminate
    # called without an active exception": 8 of 150 plain torch DDP runs on a 2-core VM; 0 of 150 with os._exit).
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, choices=(2, 4, 8), default=2, help="processes (divides 8 experts)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ep-implementation", choices=("gradops", "all_to_all"), default="gradops")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "qwen3_moe")
        save_model(path)
        print(f"{args.ranks} ranks: FSDP2 + expert parallel, {8 // args.ranks} of 8 experts per rank, "
              f"ep_implementation={args.ep_implementation!r}", flush=True)
        start = time.perf_counter()
        try:
            mp.start_processes(_rank, args=(args.ranks, str(Path(tmp, "store")), str(path), args.steps,
                                            args.ep_implementation, tmp), nprocs=args.ranks, start_method="spawn")
        except mp.ProcessRaisedException:
            for error in sorted(Path(tmp).glob("error-*.txt")):
                print(error.read_text(), file=sys.stderr)
            return 1
        parallel = torch.load(Path(tmp, "losses.pt"))
        took = time.perf_counter() - start
        single = train(path, args.steps)
    print(f"{'step':>4}  {'expert parallel':>15}  {'one process':>11}  {'|diff|':>8}")
    for step, (a, b) in enumerate(zip(parallel, single)):
        print(f"{step:4d}  {a:15.6f}  {b:11.6f}  {abs(a - b):8.1e}")
    worst = max(abs(a - b) for a, b in zip(parallel, single))
    agree = worst <= TOLERANCE
    print(f"{args.steps} steps on {args.ranks} ranks in {took:.1f} s; largest difference {worst:.1e}: "
          f"{'agree' if agree else 'DISAGREE'} (bound {TOLERANCE:g})")
    return 0 if agree and parallel[-1] < parallel[0] else 1


if __name__ == "__main__":
    sys.exit(main())
