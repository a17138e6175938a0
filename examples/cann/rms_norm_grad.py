"""Python port of the aclnnRmsNormGrad example of the CANN seed (000), step by step as in the C program.

Run: ``python examples/cann/rms_norm_grad.py [--device cpu|cuda]``. Prints dx (32 values) then dgamma (16 values)
as the C program does (``result[i] is: %f``).
"""

from __future__ import annotations

import argparse
import sys

import torch

from gradops.aclnn import ACLNN_SUCCESS, aclGetRecentErrMsg, aclnnRmsNormGrad, aclnnRmsNormGradGetWorkspaceSize


def init(device: torch.device):
    """1. Device and stream (aclInit / aclrtSetDevice / aclrtCreateStream): a CUDA stream, or None on the CPU."""
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

    # 2. Inputs and outputs (shapes and data of the C example).
    grad_data = [float(i) for i in range(1, 33)]
    x_data = [float(i) for i in range(1, 33)]
    rstd_data = [1.0, 2.0]
    gamma_data = [float(i) for i in range(1, 17)]
    grad_input = create_tensor(grad_data, [2, 1, 16], torch.float32, device)
    x_input = create_tensor(x_data, [2, 1, 16], torch.float32, device)
    rstd_input = create_tensor(rstd_data, [2], torch.float32, device)
    gamma_input = create_tensor(gamma_data, [16], torch.float32, device)
    dx_out = create_tensor(grad_data, [2, 1, 16], torch.float32, device)   # initial contents are overwritten
    dgamma_out = create_tensor(gamma_data, [16], torch.float32, device)

    # 3. First phase: validate and get the workspace size and the executor.
    ret, workspace_size, executor = aclnnRmsNormGradGetWorkspaceSize(grad_input, x_input, rstd_input, gamma_input,
                                                                     dx_out, dgamma_out)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnRmsNormGradGetWorkspaceSize failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret
    workspace = torch.empty(workspace_size, dtype=torch.uint8, device=device) if workspace_size > 0 else None
    # Second phase: run on the stream.
    ret = aclnnRmsNormGrad(workspace, workspace_size, executor, stream)
    if ret != ACLNN_SUCCESS:
        print(f"aclnnRmsNormGrad failed. ERROR: {ret} ({aclGetRecentErrMsg()})")
        return ret

    # 4. Wait for the stream (aclrtSynchronizeStream).
    if stream is not None:
        stream.synchronize()

    # 5. Copy the results back to the host and print them.
    for i, value in enumerate(dx_out.reshape(-1).cpu().tolist()):
        print(f"result[{i}] is: {value:f}")
    for i, value in enumerate(dgamma_out.reshape(-1).cpu().tolist()):
        print(f"result[{i}] is: {value:f}")

    # 6./7. Release: the executor was single-use and is spent; tensors and workspace are freed with their names.
    del grad_input, x_input, rstd_input, gamma_input, dx_out, dgamma_out, workspace
    return 0


if __name__ == "__main__":
    sys.exit(main())
