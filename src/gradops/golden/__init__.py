"""Golden data and CANN's precision verdict: ``gradops golden OP`` writes a case directory, ``gradops verify DIR
ACTUAL...`` judges a kernel's outputs against it (:mod:`gradops.golden.verify`).

The loop of an Ascend kernel developer: generate inputs, compute a golden in high precision on the CPU, run the
kernel, judge it by CANN's precision standard. A case directory holds every input and output as raw little-endian
``.bin`` (as AscendC samples read them) and ``.npy``, the goldens (:mod:`gradops.reference` in float64, rounded
once to each output's dtype), a third party's outputs (for the Ratio standard) and ``manifest.json``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

from ..cli_support import seed_value
from .cases import INDEX_DTYPES, OPTIONS, THIRD_PARTIES, Case, CaseError, make
from .files import CaseFileError, write, write_manifest

__all__ = ["Case", "CaseError", "CaseFileError", "make", "write_case"]


def write_case(case: Case, directory: str | Path, *, shape: str = "", dtype: str = "", seed: int | None = None
               ) -> dict:
    """Write ``case`` under ``directory`` (created): ``in_<name>``, ``golden_<name>`` and ``third_<name>`` as
    ``.bin`` and ``.npy``, and ``manifest.json``; returns the manifest."""
    import gradops

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    inputs = [write(out, f"in_{name}", value) if isinstance(value, torch.Tensor) else {"name": name, "value": value}
              for name, value in case.inputs.items()]
    outputs = []
    for name, golden in case.outputs.items():
        entry = write(out, f"golden_{name}", golden)
        third = write(out, f"third_{name}", case.third[name].to(golden.dtype))
        outputs.append({"name": name, "dtype": entry["dtype"], "shape": entry["shape"], "golden": entry["bin"],
                        "golden_npy": entry["npy"], "third_party": third["bin"], "third_party_npy": third["npy"],
                        "third_party_source": case.third_source[name],
                        **({"storage": entry["storage"]} if "storage" in entry else {})})
    manifest = {
        "op": case.op, "cann": gradops.registry.OPS[gradops.registry.NAMES.index(case.op)].cann,
        "shape": shape, "dtype": dtype, "seed": seed, "attributes": case.attributes, "inputs": inputs,
        "outputs": outputs, "golden": "gradops.reference in float64, rounded once to each output's dtype",
        "format": "raw little-endian .bin and .npy; bfloat16 stored as its uint16 bits",
        "versions": {"gradops": gradops.__version__, "torch": torch.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_manifest(out, manifest)
    return manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("op", help="operator (gradops.registry.NAMES), e.g. rms_norm_grad")
    parser.add_argument("--shape", required=True, help="activation shape, sizes joined by x: 64x128 (MoE: TxH)")
    parser.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16")
    parser.add_argument("--seed", type=seed_value, default=0, help="an integer from 0 to 2^63 - 1")
    parser.add_argument("--out", required=True, type=Path, help="case directory to write")
    parser.add_argument("--device", default="cpu", help="where the third-party kernel runs (cpu, cuda)")
    parser.add_argument("--third-party", choices=THIRD_PARTIES, default="torch",
                        help="the Ratio standard's bar: torch (PyTorch where it has the operator, else gradops' "
                             "kernel) or gradops (gradops' kernel for every output)")
    parser.add_argument("--epsilon", type=float, default=None)
    parser.add_argument("--rstd-form", choices=("keepdim", "flat"), default=None)
    parser.add_argument("--stat-dtype", choices=("float32", "input"), default=None,
                        help="layer_norm_grad: mean/variance in float32 or in x's dtype")
    parser.add_argument("--gamma-dtype", choices=("input", "float32"), default=None,
                        help="norms: gamma/beta in the activations' dtype (default) or float32")
    parser.add_argument("--num-weights", type=int, default=None)
    parser.add_argument("--padding-idx", type=int, default=None)
    parser.add_argument("--scale-grad-by-freq", action="store_true", default=None)
    parser.add_argument("--index-dtype", choices=tuple(dict.fromkeys(d for ds in INDEX_DTYPES.values() for d in ds)),
                        default=None,
                        help="embedding: any of the nine (floats truncated toward zero); MoE permute: int64, int32")
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--num-out-tokens", type=int, default=None)
    parser.add_argument("--drop-and-pad", action="store_true", default=None,
                        help="routing-map MoE ops: Megatron's capacity mode")


def run(args: argparse.Namespace) -> int:
    opts = {k: getattr(args, k) for k in ("epsilon", "rstd_form", "stat_dtype", "gamma_dtype", "num_weights",
                                          "padding_idx", "scale_grad_by_freq", "index_dtype", "topk", "experts",
                                          "num_out_tokens", "drop_and_pad")}
    unused = [k for k, v in opts.items() if v is not None and k not in OPTIONS.get(args.op, ())]
    try:
        if unused:
            raise CaseError(f"{args.op} does not read --{unused[0].replace('_', '-')}")
        case = make(args.op, args.shape, args.dtype, args.seed, args.device, third_party=args.third_party, **opts)
        manifest = write_case(case, args.out, shape=args.shape, dtype=args.dtype, seed=args.seed)
    except (CaseError, CaseFileError, OSError) as err:
        message = f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.strerror else str(err)
        print(f"gradops golden: {message}".replace("\n", "\\n"), file=sys.stderr)  # one line, whatever it holds
        return 2
    print(f"gradops golden: {manifest['op']} ({manifest['cann']}) {args.shape} {args.dtype} seed {args.seed} -> "
          f"{args.out}/")
    for entry in manifest["inputs"]:
        print(f"  input  {entry['name']:<22} " + (f"{entry['dtype']:<9} {entry['shape']}  {entry['bin']}"
                                                  if "bin" in entry else f"= {entry['value']!r}"))
    for entry in manifest["outputs"]:
        print(f"  output {entry['name']:<22} {entry['dtype']:<9} {entry['shape']}  {entry['golden']} "
              f"(third party: {entry['third_party_source']})")
    return 0
