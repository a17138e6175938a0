"""gradops: CANN's training backward operators for PyTorch, on CPU and NVIDIA GPUs.

Every function takes torch tensors, returns new tensors and never writes into its inputs. Invalid input raises
:class:`OpError` carrying CANN's status code.
"""

from .ops import (
    embedding,
    embedding_dense_backward,
    hardswish,
    hardswish_backward,
    layer_norm,
    layer_norm_backward,
    layer_norm_grad,
    layer_norm_grad_beta,
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    rms_norm,
    rms_norm_grad,
)
from .patching import patch
from .status import OpError

__version__ = "0.1.0"


def synchronize() -> None:
    """Wait for every gradops kernel in flight and raise the OpError of any index check it failed.

    On CUDA the Triton backwards test their indices on the device and report a bad one at the next gradops launch
    without synchronising the host (see ``gradops.launch._common.guard``); call this where a step must know now,
    e.g. before reading gradients. A no-op when Triton is not in use.
    """
    import sys

    common = sys.modules.get("gradops.launch._common")
    if common is not None:
        common.raise_pending(wait=True)

__all__ = [
    "OpError", "embedding", "embedding_dense_backward", "hardswish", "hardswish_backward", "layer_norm",
    "layer_norm_backward", "layer_norm_grad", "layer_norm_grad_beta", "moe_token_permute", "moe_token_permute_grad",
    "moe_token_unpermute", "moe_token_unpermute_grad", "patch", "rms_norm", "rms_norm_grad", "synchronize",
]
