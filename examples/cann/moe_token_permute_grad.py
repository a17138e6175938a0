"""Python port of the aclnnMoeTokenPermuteGrad example of the CANN seed (004), step by step as in C.

The C program copies float data into BF16 / INT32 tensors through ``std::vector<float>`` (the bytes are
reinterpreted), so its literal device output is meaningless; this port uses the intended values: grad
[[1, 2], [3, 4]] in bfloat16, sortedIndices [0, 1] in int32, numTopk 2 -> out [[4, 6]] (shape (1, 2)).

Run: ``python examples/cann/moe_token_permute_grad.py [--device cpu|cuda]``. Prints ``mean result[i] is: %f``
as the C program does.
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradops.aclnn import (
    ACLNN_SUCCESS,
    aclGetRecentErrMsg,
    aclnnMoeTokenPermuteGrad,
    aclnnMoeTokenPermuteGradGetWorkspaceSize,
)


def init(device: torch.device):
    """1. Device and stream: a CUDA stream, or None on the CPU."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def create_tensor(host_data, shape, dtype, device):
    """aclrtMalloc + aclrtMemcpy(HOST_TO_DEVICE) + aclCreateTensor, with the data converted to ``dtype``."""
    return torch.tensor(host_data, dtype=torch.float64).to(dtype).reshape(shape).to(device)


def print_out_result(tensor: torch.Tensor) -> None:
    """PrintOutResult: copy to the host (as float) and print every element."""
    for i, value in enumerate(tensor.float().reshape(-1).cpu().tolist()):
        print(f"mean result[{i}] is: {value:f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(parser.parse_args(argv).device)
    if device.type == "cuda" and not torch.cuda.is_available():  # one line, not torch's traceback on first use
        parser.exit(2, f"{parser.prog}: error: --device cuda, but torch sees no CUDA device (use --device cpu)\n")
    stream = init(device)

    # 2. Inputs and outputs.
    num_topk = 2
    permuted_output_grad = create_tensor([1, 2, 3, 4], [2, 2], torch.bfloat16, device)
    sorted_indices = create_tensor([0, 1], [2], torch.int32, device)
    out = create_tensor([0, 0], [1, 2], torch.bfloat16, device)

    # 3. First phase, workspace, second phase.
    ret, workspace_size, executor = aclnnMoeTokenPermuteGradGetWorkspaceSize(permuted_output_grad, sorted_indices,
                                                                             num_topk, False, out)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnMoeTokenPermuteGradGetWorkspaceSize failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret
    workspace = torch.empty(workspace_size, dtype=torch.uint8, device=device) if workspace_size > 0 else None
    ret = aclnnMoeTokenPermuteGrad(workspace, workspace_size, executor, stream)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnMoeTokenPermuteGrad failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret

    # 4. Synchronise the stream.
    if stream is not None:
        stream.synchronize()

    # 5. Read back and print.
    print_out_result(out)

    # 6./7. Release.
    del permuted_output_grad, sorted_indices, out, workspace
    return 0


if __name__ == "__main__":
    sys.exit(main())
