"""The operators: one list that the command line (``check``, ``env``, ``bench``), the tests and the backends'
coverage read.

Each entry is an operator every backend implements under the same name (``gradops.reference``, ``gradops.cpu``,
``gradops.launch``; a backend that lacks one leaves it to the reference, see :mod:`gradops.backend`) and that the
package exports as a public function of that name. ``gradops.embedding`` (the lookup, a gather with its
backward attached) is not here: no backend implements it.
"""

from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    name: str  # the public function and every backend's function
    cann: str  # what CANN calls it
    backward: bool  # a backward operator (the forwards produce their inputs)
    bench: str | None = None  # the ``gradops bench`` case that times it (backward operators; see gradops.bench)


OPS: tuple[Op, ...] = (
    Op("rms_norm", "aclnnRmsNorm", False),
    Op("rms_norm_grad", "aclnnRmsNormGrad", True, "rms_norm_grad"),
    Op("layer_norm", "AscendC LayerNorm", False),
    # CANN's pair runs as one case: LayerNormGradBeta consumes LayerNormGrad's resForGamma
    Op("layer_norm_grad", "AscendC LayerNormGrad", True, "layer_norm_grad+beta"),
    Op("layer_norm_grad_beta", "AscendC LayerNormGradBeta", True, "layer_norm_grad+beta"),
    Op("layer_norm_backward", "aclnnLayerNormBackward", True, "layer_norm_backward"),
    Op("hardswish", "aclnnHardswish", False),
    Op("hardswish_backward", "aclnnHardswishBackward", True, "hardswish_backward"),
    Op("embedding_dense_backward", "aclnnEmbeddingDenseBackward", True, "embedding_dense_backward"),
    Op("moe_token_permute", "aclnnMoeTokenPermute", False),
    Op("moe_token_permute_grad", "aclnnMoeTokenPermuteGrad", True, "moe_token_permute_grad"),
    Op("moe_token_unpermute", "aclnnMoeTokenUnpermute", False),
    Op("moe_token_unpermute_grad", "aclnnMoeTokenUnpermuteGrad", True, "moe_token_unpermute_grad"),
)

#: The names, in the order above.
NAMES: tuple[str, ...] = tuple(op.name for op in OPS)

#: The ``gradops bench`` cases, in the order above: every backward operator is timed by one of them.
BENCH: tuple[str, ...] = tuple(dict.fromkeys(op.bench for op in OPS if op.bench))
