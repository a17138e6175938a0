"""The Ascend kernel developer's loop with gradops: golden -> your kernel -> verify.

Run: ``python examples/golden_loop.py [--out DIR]``. It writes an aclnnRmsNormGrad case (bfloat16, 64x256), then
plays "the NPU" twice, reading the case's input files as a kernel would:

1. a kernel that accumulates dgamma in float32, as CANN specifies: both outputs pass both standards (Threshold,
   and Ratio against the case's third party, PyTorch's rms_norm backward);
2. the same kernel with a classic bug, dgamma accumulated in bfloat16 row by row: dgamma fails both (MARE 0.32, far
   above 10·2^-13, the float32 output's bar, and 10^4 times PyTorch's) and gradops verify names the worst elements.

The same two steps from a shell::

    gradops golden rms_norm_grad --shape 64x256 --dtype bfloat16 --out case/
    gradops verify case/ my_dx.bin my_dgamma.bin
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from gradops.golden import files, make, write_case
from gradops.golden.verify import report, verify


def my_kernel(directory: Path, manifest: dict, accumulate: torch.dtype) -> list[Path]:
    """A stand-in for an NPU kernel: reads the input .bin files, writes its outputs as .bin files."""
    x = {e["name"]: files.read(directory / e["bin"], e["dtype"], e["shape"]) for e in manifest["inputs"] if "bin" in e}
    dy, xs, rstd, gamma = (x[f"in_{n}"].float() for n in ("dy", "x", "rstd", "gamma"))
    normalised = xs * rstd
    dxn = dy * gamma
    dx = rstd * (dxn - normalised * (dxn * normalised).mean(-1, keepdim=True))
    if accumulate == torch.float32:
        dgamma = (dy * normalised).sum(0)  # torch's float32 sum: blocked, as an NPU's vector reduction
    else:
        dgamma = torch.zeros(gamma.shape, dtype=accumulate)
        for row in (dy * normalised).to(accumulate):  # the bug: one row at a time into a bfloat16 sum
            dgamma += row
    paths = []
    for name, value in (("dx", dx.to(torch.bfloat16)), ("dgamma", dgamma.float())):
        path = directory / f"npu_{accumulate}_{name}.bin".replace("torch.", "")
        files.storage(value).tofile(path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="case directory (default: a temporary one)")
    args = parser.parse_args(argv)
    directory = args.out or Path(tempfile.mkdtemp(prefix="gradops-golden-"))
    case = make("rms_norm_grad", "64x256", "bfloat16", seed=0)
    manifest = write_case(case, directory, shape="64x256", dtype="bfloat16", seed=0)
    print(f"case written to {directory}/ ({', '.join(o['name'] for o in manifest['outputs'])})\n")
    results = []
    for accumulate in (torch.float32, torch.bfloat16):
        print(f"--- the NPU kernel, dgamma accumulated in {str(accumulate).removeprefix('torch.')}")
        verdicts = verify(directory, my_kernel(directory, manifest, accumulate))
        print(report("rms_norm_grad", verdicts) + "\n")
        results.append(all(v.passed for v in verdicts))
    return 0 if results == [True, False] else 1  # the correct kernel passes, the buggy one fails


if __name__ == "__main__":
    sys.exit(main())
