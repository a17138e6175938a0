"""Python port of the aclnnHardswishBackward example of the CANN seed (002), step by step as in C.

Run: ``python examples/cann/hardswish_backward.py [--device cpu|cuda]``. Prints the 8 results as the C program
does (``result[i] is: %f``); note ``result[3] = 4.5``: CANN's derivative at self = 3 is 3/3 + 0.5 (closed
interval), where PyTorch >= 2.8 gives 3.0.
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradops.aclnn import (
    ACLNN_SUCCESS,
    aclGetRecentErrMsg,
    aclnnHardswishBackward,
    aclnnHardswishBackwardGetWorkspaceSize,
)


def init(device: torch.device):
    """1. Device and stream: a CUDA stream, or None on the CPU."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def create_tensor(host_data, shape, dtype, device):
    """aclrtMalloc + aclrtMemcpy(HOST_TO_DEVICE) + aclCreateTensor (contiguous strides)."""
    return torch.tensor(host_data, dtype=dtype).reshape(shape).to(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args(argv).device)
    if device.type == "cuda" and not torch.cuda.is_available():  # one line, not torch's traceback on first use
        parser.exit(2, f"{parser.prog}: error: --device cuda, but torch sees no CUDA device (use --device cpu)\n")
    stream = init(device)

    # 2. Inputs and outputs.
    self_tensor = create_tensor([0, 1, 2, 3, 4, 5, 6, 7], [4, 2], torch.float32, device)
    grad_out = create_tensor([0, 1, 2, 3, 4, 5, 6, 7], [4, 2], torch.float32, device)
    out = create_tensor([0] * 8, [4, 2], torch.float32, device)

    # 3. First phase, workspace, second phase.
    ret, workspace_size, executor = aclnnHardswishBackwardGetWorkspaceSize(grad_out, self_tensor, out)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnHardswishBackwardGetWorkspaceSize failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret
    workspace = torch.empty(workspace_size, dtype=torch.uint8, device=device) if workspace_size > 0 else None
    ret = aclnnHardswishBackward(workspace, workspace_size, executor, stream)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnHardswishBackward failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret

    # 4. Synchronise the stream.
    if stream is not None:
        stream.synchronize()

    # 5. Read back and print.
    for i, value in enumerate(out.reshape(-1).cpu().tolist()):
        print(f"result[{i}] is: {value:f}")

    # 6./7. Release.
    del self_tensor, grad_out, out, workspace
    return 0


if __name__ == "__main__":
    sys.exit(main())
