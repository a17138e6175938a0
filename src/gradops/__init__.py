"""gradops: CANN's training backward operators for PyTorch, on CPU and NVIDIA GPUs.

Every function takes torch tensors, returns new tensors and never writes into its inputs. Invalid input raises
:class:`OpError` carrying CANN's status code.
"""

import os as _os

from .native import ensure_built as _ensure_built
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
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
    rms_norm,
    rms_norm_grad,
    swiglu,
    swiglu_grad,
)
from .patching import patch
from .status import OpError

# The CPU kernels are C++ compiled against this torch: the install builds them, or else this first import does (one
# line before and after, ~1-2 min), so that no training step ever waits for a compiler. Built, it is a file check
# (~1 ms). Not where GRADOPS_BACKEND names a backend without them (torch, triton): a later switch builds on first use.
if _os.environ.get("GRADOPS_BACKEND", "auto").strip().lower() in ("", "auto", "cpu"):
    _ensure_built()

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


def empty_cache() -> int:
    """Hand the memory of gradops' recycled CPU output buffers back to the OS; return how many bytes that was.

    The compiled CPU kernels keep the memory of outputs that died (>= 1 MiB each, up to ``GRADOPS_CPU_POOL_MB``
    MiB, default 2048) to skip the page faults of fresh memory on the next step (see ``gradops.cpu._pool``),
    and still hold it after every tensor is freed (measured: 640 MiB after the outputs of a few 8192 x 4096
    fp32 norm backwards died). This drops it, as ``torch.cuda.empty_cache()`` does for CUDA's caching
    allocator (CUDA tensors never use this pool). Outputs still alive are untouched; later calls refill the
    pool as needed. Returns 0 when no CPU kernel has run in this process.
    """
    import sys

    pool = sys.modules.get("gradops.cpu._pool")  # not loaded: nothing pooled
    return pool.clear() if pool is not None else 0


__all__ = [
    "OpError", "embedding", "embedding_dense_backward", "empty_cache", "hardswish", "hardswish_backward",
    "layer_norm", "layer_norm_backward", "layer_norm_grad", "layer_norm_grad_beta", "moe_token_permute",
    "moe_token_permute_grad", "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad",
    "moe_token_unpermute", "moe_token_unpermute_grad", "moe_token_unpermute_with_routing_map",
    "moe_token_unpermute_with_routing_map_grad", "patch", "rms_norm", "rms_norm_grad", "swiglu", "swiglu_grad",
    "synchronize",
]
