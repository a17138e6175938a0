"""The dense MLP patch against transformers' own MLP: one LlamaMLP, forward + backward, alternating runs.

``python scripts/bench_mlp_gate.py [--threads N] [--device cpu|cuda] [--dtype fp32|bf16] [--out FILE]``: for each
T x H x I case, the unpatched module and the patched one (the fused gate forced at every size, so that the table
shows where the threshold gradops.transformers.FUSED_MIN_ITEMS belongs), medians of 11 rounds, 3 alternating runs;
one JSON line per case with the environment (device, versions, commit, date).
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch

CASES = [(16, 64, 128), (64, 128, 344), (128, 256, 1024), (256, 256, 688), (512, 256, 512), (1024, 256, 1024),
         (1024, 512, 1408)]


def _median_us(step, n: int, sync) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(11):
        sync()
        start = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        times.append((time.perf_counter() - start) / n * 1e6)
    return sorted(times)[5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default=None, help="T x H x I cases, e.g. 1024x256x1024,64x128x344")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP

    import gradops
    from gradops import transformers as hf
    from gradops.bench.provenance import environment

    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    hf.FUSED_MIN_ITEMS = 0
    env = {**environment(device), "bench": "mlp-gate", "dtype": args.dtype, "threads": torch.get_num_threads(),
           "transformers": transformers.__version__}
    lines = []
    cases = CASES if args.cases is None else [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    for t, h, i in cases:
        torch.manual_seed(0)
        ref = LlamaMLP(transformers.LlamaConfig(hidden_size=h, intermediate_size=i)).to(device, dtype)
        ours = copy.deepcopy(ref)
        gradops.patch(ours)
        x = torch.randn(t, h, device=device, dtype=dtype, requires_grad=True)
        n = max(3, int(2e5 / (t * h * i / 1e3 + 100))) if device.type == "cpu" else 20
        def step(module, x=x):
            return lambda: module(x).sum().backward()

        pairs = [(_median_us(step(ref), n, sync), _median_us(step(ours), n, sync)) for _ in range(3)]
        theirs, mine = sum(a for a, _ in pairs), sum(b for _, b in pairs)
        record = {**env, "shape": [t, h, i], "transformers_us": round(theirs / 3, 1), "gradops_us": round(mine / 3, 1),
                  "ratio": round(theirs / mine, 3)}
        lines.append(json.dumps(record))
        print(f"T x H x I = {t} x {h} x {i}: transformers {theirs / 3:10.1f} µs, gradops {mine / 3:10.1f} µs "
              f"({theirs / mine:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
