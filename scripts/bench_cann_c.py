"""The cost of an aclnn call through the C surface, beside the same call from Python, in one run.

``python scripts/bench_cann_c.py [--threads N] [--out FILE | --no-save]``: writes a `gradops cann-home` tree into a
temporary folder, builds benchmarks/capi/two_phase.cpp against it with CANN's build line, and times phase 1 + phase 2
of five operators (RmsNormGrad, HardswishBackward, LayerNormBackward, EmbeddingDenseBackward, MoeTokenPermuteGrad) on
8 x 8 float32 tensors: from C (the embedded Python behind libopapi.so), from Python (gradops.aclnn, the same phases
without the C layer) and the PyTorch API's call of the same op with ``out=`` (what a Python user pays). Medians of
batches; one JSON line per op with the environment (CPU, versions, commit, date), into
benchmarks/results/cann-c-cpu-<date>.jsonl by default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
N = 8


def _median_us(call, batches: int = 15, per_batch: int = 2000) -> float:
    for _ in range(200):
        call()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(per_batch):
            call()
        times.append((time.perf_counter() - start) / per_batch * 1e6)
    return sorted(times)[len(times) // 2]


def _python_side() -> dict[str, tuple[float, float]]:
    """(gradops.aclnn two-phase µs, PyTorch-API µs) per op, on the inputs two_phase.cpp builds."""
    import gradops
    from gradops import aclnn

    i = torch.arange(N * N, dtype=torch.float32)
    dy, x = (0.01 * i - 0.3).reshape(N, N), (0.02 * (i % 11) - 0.1).reshape(N, N)
    r = torch.arange(N, dtype=torch.float32)
    rstd, gamma, mean = 1.0 + 0.1 * r, 0.5 + 0.05 * r, 0.01 * r
    ids, rows = (3 * r.long()) % N, ((5 * r.long() + 1) % N).int()
    dx, dgamma, dbeta, out, table = torch.empty(N, N), torch.empty(N), torch.empty(N), torch.empty(N, N), \
        torch.empty(N, N)
    workspace = torch.empty(1 << 16, dtype=torch.uint8)

    def two_phase(first, second, *args):
        def call():
            status, size, executor = first(*args)
            assert status == 0 and second(workspace[:size] if size else None, size, executor, None) == 0
        return call

    return {
        "aclnnRmsNormGrad": (
            _median_us(two_phase(aclnn.aclnnRmsNormGradGetWorkspaceSize, aclnn.aclnnRmsNormGrad, dy, x, rstd, gamma,
                                 dx, dgamma)),
            _median_us(lambda: gradops.rms_norm_grad(dy, x, rstd, gamma, out=(dx, dgamma)))),
        "aclnnHardswishBackward": (
            _median_us(two_phase(aclnn.aclnnHardswishBackwardGetWorkspaceSize, aclnn.aclnnHardswishBackward, dy, x,
                                 out)),
            _median_us(lambda: gradops.hardswish_backward(dy, x, out=out))),
        "aclnnLayerNormBackward": (
            _median_us(two_phase(aclnn.aclnnLayerNormBackwardGetWorkspaceSize, aclnn.aclnnLayerNormBackward, dy, x,
                                 (N,), mean, rstd, gamma, None, (True, True, True), dx, dgamma, dbeta)),
            _median_us(lambda: gradops.layer_norm_backward(dy, x, mean, rstd, gamma, out=(dx, dgamma, dbeta)))),
        "aclnnEmbeddingDenseBackward": (
            _median_us(two_phase(aclnn.aclnnEmbeddingDenseBackwardGetWorkspaceSize, aclnn.aclnnEmbeddingDenseBackward,
                                 dy, ids, N, (1 << 64) - 1, False, table)),
            _median_us(lambda: gradops.embedding_dense_backward(dy, ids, N, -1, False, out=table))),
        "aclnnMoeTokenPermuteGrad": (
            _median_us(two_phase(aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize, aclnn.aclnnMoeTokenPermuteGrad, dy,
                                 rows, 1, False, out)),
            _median_us(lambda: gradops.moe_token_permute_grad(dy, rows, 1, out=out))),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads (default 1)")
    parser.add_argument("--out", default=None, help="the JSON-lines file (default benchmarks/results/...)")
    parser.add_argument("--no-save", action="store_true", help="print the records only")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from gradops.aclnn import capi
    from gradops.bench.provenance import environment

    with tempfile.TemporaryDirectory() as tmp:
        home = capi.write_home(Path(tmp) / "ascend-toolkit")
        program = Path(tmp) / "two_phase"
        subprocess.run([*home.compile_line(str(ROOT / "benchmarks" / "capi" / "two_phase.cpp"), str(program)), "-O2"],
                       check=True)
        done = subprocess.run([str(program)], capture_output=True, text=True, env=home.environment(), check=True)
    c_side = {rec["op"]: rec for rec in map(json.loads, done.stdout.splitlines())}
    python_side = _python_side()
    env = environment(torch.device("cpu"))
    records = []
    for op, rec in c_side.items():
        python_us, api_us = python_side[op]
        records.append({"case": "aclnn-two-phase", "op": op, "shape": rec["shape"], "dtype": rec["dtype"],
                        "c_us": rec["us"], "python_aclnn_us": round(python_us, 2), "api_out_us": round(api_us, 2),
                        "compiler": capi.compiler(), **env})
    for rec in records:
        print(json.dumps(rec))
    if not args.no_save:
        day = datetime.date.today().isoformat()
        out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"cann-c-cpu-{day}.jsonl"
        with out.open("a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
