"""torch.library operators (namespace ``gradops``) and the public functions that call them.

Each op body dispatches the functional call: validate (the contract, remembered per argument metadata), pick a
backend (:func:`gradops.backend.choose`), view in the backend's 2-D shape, run. The ``out=`` path and the CANN
surfaces (:mod:`gradops.aclnn`, :mod:`gradops.ascendc`) use the same contract and backend decision but do their
own validation call and reshaping.
"""

from .embedding import embedding, embedding_dense_backward
from .hardswish import hardswish, hardswish_backward
from .layer_norm import layer_norm, layer_norm_backward, layer_norm_grad, layer_norm_grad_beta
from .moe_permute import moe_token_permute, moe_token_permute_grad, moe_token_unpermute, moe_token_unpermute_grad
from .rms_norm import rms_norm, rms_norm_grad

__all__ = [
    "embedding", "embedding_dense_backward", "hardswish", "hardswish_backward", "layer_norm", "layer_norm_backward",
    "layer_norm_grad", "layer_norm_grad_beta", "moe_token_permute", "moe_token_permute_grad",
    "moe_token_unpermute", "moe_token_unpermute_grad", "rms_norm",
    "rms_norm_grad",
]
