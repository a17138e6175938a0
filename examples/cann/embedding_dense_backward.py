"""Python port of the aclnnEmbeddingDenseBackward example of the CANN seed (001), step by step as in C.

Run: ``python examples/cann/embedding_dense_backward.py [--device cpu|cuda]``. Prints the (4, 3) result as the
C program does (``resultData[i] is: %f``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradops.aclnn import (
    ACLNN_SUCCESS,
    aclGetRecentErrMsg,
    aclnnEmbeddingDenseBackward,
    aclnnEmbeddingDenseBackwardGetWorkspaceSize,
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
    num_weights = 4
    padding_idx = 0           # uint64_t in C; values >= 2**63 would mean "no padding row"
    scale_grad_by_freq = False
    grad_output = create_tensor([1, 2, 3, 4, 5, 6], [2, 3], torch.float32, device)
    indices = create_tensor([1, 2], [2], torch.int64, device)
    out = create_tensor([0.0] * 12, [4, 3], torch.float32, device)

    # 3. First phase, then allocate the workspace and run the second phase.
    ret, workspace_size, executor = aclnnEmbeddingDenseBackwardGetWorkspaceSize(
        grad_output, indices, num_weights, padding_idx, scale_grad_by_freq, out)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnEmbeddingDenseBackwardGetWorkspaceSize failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret
    workspace = torch.empty(workspace_size, dtype=torch.uint8, device=device) if workspace_size > 0 else None
    ret = aclnnEmbeddingDenseBackward(workspace, workspace_size, executor, stream)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnEmbeddingDenseBackward failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret

    # 4. Synchronise the stream.
    if stream is not None:
        stream.synchronize()

    # 5. Read back and print.
    for i, value in enumerate(out.reshape(-1).cpu().tolist()):
        print(f"resultData[{i}] is: {value:f}")

    # 6./7. Release.
    del grad_output, indices, out, workspace
    return 0


if __name__ == "__main__":
    sys.exit(main())
