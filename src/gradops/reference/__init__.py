"""Pure-torch implementations: the formulas of record, the portable path (any device), and - run with
``compute=torch.float64`` - the oracle of ``gradops check``.

Each family's ``reference.py`` holds its functions, which take the 2-D views and checked indices the op's call plan
prepares (they never validate), and one ``Impl`` per op for the ``torch`` backend; this package re-exports them.
"""

from ..families.embedding.reference import embedding_dense_backward
from ..families.hardswish.reference import hardswish, hardswish_backward
from ..families.layer_norm.reference import layer_norm, layer_norm_backward, layer_norm_grad, layer_norm_grad_beta
from ..families.moe.reference import (
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_unpermute,
    moe_token_unpermute_grad,
)
from ..families.moe.routing_reference import (
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
)
from ..families.rms_norm.reference import rms_norm, rms_norm_grad
from ..families.swiglu.reference import swiglu, swiglu_grad

__all__ = [
    "embedding_dense_backward", "hardswish", "hardswish_backward", "layer_norm", "layer_norm_backward",
    "layer_norm_grad", "layer_norm_grad_beta", "moe_token_permute", "moe_token_permute_grad",
    "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad", "moe_token_unpermute",
    "moe_token_unpermute_grad", "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad",
    "rms_norm", "rms_norm_grad", "swiglu", "swiglu_grad",
]
