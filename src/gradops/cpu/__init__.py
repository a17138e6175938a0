"""The CPU kernels: the ``cpu`` backend of :mod:`gradops.backend`.

The kernels are C++ (``gradops/families/<family>/*.cpp``, compiled with the native extension when gradops is
installed, or on its first import), and each family's ``cpu.py`` is their host side: it allocates the results,
makes inputs contiguous, carves workspaces, runs a kernel and describes each call as a program the extension
replays. This package holds what those share - the recycling pool (:mod:`gradops.cpu._pool`), the kernel call
(:func:`gradops.cpu._host.kernel`), the programs' form (:mod:`gradops.cpu.programs`) - and re-exports the
families' host entries. Importing it fails with ImportError where the extension cannot be built or loaded; the
dispatcher then uses the pure-torch reference and says why once.
"""

from __future__ import annotations

from .. import native as _native

_native.kernels()  # ImportError where the kernels cannot be had: how gradops.backend learns it

from ..families.embedding.cpu import (  # noqa: E402 - after the kernels' check, on purpose
    embedding_dense_backward,
    embedding_dense_backward_shaped,
    embedding_dense_backward_workspace,
)
from ..families.hardswish.cpu import hardswish, hardswish_backward  # noqa: E402
from ..families.layer_norm.cpu import (  # noqa: E402
    layer_norm,
    layer_norm_backward,
    layer_norm_backward_shaped,
    layer_norm_backward_workspace,
    layer_norm_grad,
    layer_norm_grad_beta,
    layer_norm_grad_beta_shaped,
    layer_norm_grad_beta_workspace,
    layer_norm_grad_shaped,
    layer_norm_shaped,
)
from ..families.moe.cpu import (  # noqa: E402
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_permute_grad_shaped,
    moe_token_permute_shaped,
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    moe_token_unpermute_grad_shaped,
    moe_token_unpermute_shaped,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
)
from ..families.rms_norm.cpu import (  # noqa: E402
    rms_norm,
    rms_norm_grad,
    rms_norm_grad_shaped,
    rms_norm_grad_workspace,
    rms_norm_shaped,
)
from ..families.swiglu.cpu import swiglu, swiglu_grad, swiglu_grad_shaped, swiglu_shaped  # noqa: E402

__all__ = [
    "embedding_dense_backward", "embedding_dense_backward_shaped", "embedding_dense_backward_workspace",
    "hardswish", "hardswish_backward", "layer_norm", "layer_norm_backward", "layer_norm_backward_shaped",
    "layer_norm_backward_workspace", "layer_norm_grad", "layer_norm_grad_beta", "layer_norm_grad_beta_shaped",
    "layer_norm_grad_beta_workspace", "layer_norm_grad_shaped", "layer_norm_shaped", "moe_token_permute",
    "moe_token_permute_grad", "moe_token_permute_grad_shaped", "moe_token_permute_shaped",
    "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad", "moe_token_unpermute",
    "moe_token_unpermute_grad", "moe_token_unpermute_grad_shaped", "moe_token_unpermute_shaped",
    "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad", "rms_norm",
    "rms_norm_grad", "rms_norm_grad_shaped", "rms_norm_grad_workspace", "rms_norm_shaped", "swiglu", "swiglu_grad",
    "swiglu_grad_shaped", "swiglu_shaped",
]
