"""torch.library operators (namespace ``gradops``) and the public functions that call them.

Each op has one call plan (:mod:`gradops.ops._plan`): the contract's check and the backend decision, remembered
together per argument metadata. The op body and the ``out=`` path both run through it: the body calls the plan's
``run`` (the backend's shaped entry, or the op's adapter that views the arguments in the backend's 2-D shapes),
``out=`` the plan's backend function into the caller's tensors. The CANN surfaces (:mod:`gradops.aclnn`,
:mod:`gradops.ascendc`) validate with the CANN-strict form of the same tables and pick the backend through
:mod:`gradops.backend`.
"""

from ..families.embedding.ops import embedding, embedding_dense_backward
from ..families.hardswish.ops import hardswish, hardswish_backward, hardswish_output
from ..families.layer_norm.ops import (
    layer_norm,
    layer_norm_backward,
    layer_norm_grad,
    layer_norm_grad_beta,
    layer_norm_output,
)
from ..families.moe.ops import moe_token_permute, moe_token_permute_grad, moe_token_unpermute, moe_token_unpermute_grad
from ..families.moe.routing_ops import (
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
)
from ..families.rms_norm.ops import rms_norm, rms_norm_grad
from ..families.swiglu.ops import swiglu, swiglu_grad

__all__ = [
    "embedding", "embedding_dense_backward", "hardswish", "hardswish_backward", "hardswish_output", "layer_norm",
    "layer_norm_backward", "layer_norm_grad", "layer_norm_grad_beta", "layer_norm_output", "moe_token_permute",
    "moe_token_permute_grad", "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad",
    "moe_token_unpermute", "moe_token_unpermute_grad", "moe_token_unpermute_with_routing_map",
    "moe_token_unpermute_with_routing_map_grad", "rms_norm", "rms_norm_grad", "swiglu", "swiglu_grad",
]
