"""CANN's aclnn two-phase API in Python: same function names, argument order and status codes as the C API.

Porting a C call::

    ret = aclnnRmsNormGradGetWorkspaceSize(dy, x, rstd, gamma, dxOut, dgammaOut, &workspaceSize, &executor);
    ret = aclnnRmsNormGrad(workspaceAddr, workspaceSize, executor, stream);

becomes::

    ret, workspaceSize, executor = aclnnRmsNormGradGetWorkspaceSize(dy, x, rstd, gamma, dxOut, dgammaOut)
    ret = aclnnRmsNormGrad(workspace, workspaceSize, executor, stream)   # stream: None or a torch.cuda.Stream

Tensors are torch tensors (an ``aclTensor*`` that is NULL is ``None``); the workspace is a tensor of at least
``workspaceSize`` bytes (any dtype, read as bytes) or ``None`` when the size is 0; results are written into
the out tensors. Nothing here raises for bad arguments: every call returns a status (``ACLNN_*`` below) and
:func:`aclGetRecentErrMsg` says why. Phase 1 runs the op's call plan, the one the PyTorch API runs
(:mod:`gradops.ops._plan`): the same validation table (:mod:`gradops.contract`) in its CANN-strict form, and the
same backend decision; the work runs in the implementation it chose.
"""

from ..families.embedding.aclnn import C_API as _EMBEDDING_C
from ..families.embedding.aclnn import (
    aclnnEmbedding,
    aclnnEmbeddingDenseBackward,
    aclnnEmbeddingDenseBackwardGetWorkspaceSize,
    aclnnEmbeddingGetWorkspaceSize,
)
from ..families.hardswish.aclnn import C_API as _HARDSWISH_C
from ..families.hardswish.aclnn import (
    aclnnHardswish,
    aclnnHardswishBackward,
    aclnnHardswishBackwardGetWorkspaceSize,
    aclnnHardswishGetWorkspaceSize,
)
from ..families.layer_norm.aclnn import C_API as _LAYER_NORM_C
from ..families.layer_norm.aclnn import aclnnLayerNormBackward, aclnnLayerNormBackwardGetWorkspaceSize
from ..families.moe.aclnn import C_API as _MOE_C
from ..families.moe.aclnn import (
    aclnnMoeTokenPermute,
    aclnnMoeTokenPermuteGetWorkspaceSize,
    aclnnMoeTokenPermuteGrad,
    aclnnMoeTokenPermuteGradGetWorkspaceSize,
    aclnnMoeTokenUnpermute,
    aclnnMoeTokenUnpermuteGetWorkspaceSize,
    aclnnMoeTokenUnpermuteGrad,
    aclnnMoeTokenUnpermuteGradGetWorkspaceSize,
)
from ..families.moe.routing_aclnn import C_API as _ROUTING_C
from ..families.moe.routing_aclnn import (
    aclnnMoeTokenPermuteWithRoutingMap,
    aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize,
    aclnnMoeTokenPermuteWithRoutingMapGrad,
    aclnnMoeTokenPermuteWithRoutingMapGradGetWorkspaceSize,
    aclnnMoeTokenUnpermuteWithRoutingMap,
    aclnnMoeTokenUnpermuteWithRoutingMapGetWorkspaceSize,
    aclnnMoeTokenUnpermuteWithRoutingMapGrad,
    aclnnMoeTokenUnpermuteWithRoutingMapGradGetWorkspaceSize,
)
from ..families.rms_norm.aclnn import C_API as _RMS_NORM_C
from ..families.rms_norm.aclnn import (
    aclnnRmsNorm,
    aclnnRmsNormGetWorkspaceSize,
    aclnnRmsNormGrad,
    aclnnRmsNormGradGetWorkspaceSize,
)
from ..families.swiglu.aclnn import C_API as _SWIGLU_C
from ..families.swiglu.aclnn import (
    aclnnSwiGlu,
    aclnnSwiGluGetWorkspaceSize,
    aclnnSwiGluGrad,
    aclnnSwiGluGradGetWorkspaceSize,
)
from ..status import (
    ACLNN_ERR_INNER,
    ACLNN_ERR_INNER_CREATE_EXECUTOR,
    ACLNN_ERR_INNER_FIND_KERNEL_ERROR,
    ACLNN_ERR_INNER_INFERSHAPE_ERROR,
    ACLNN_ERR_INNER_INVALID_IMPL_MODE,
    ACLNN_ERR_INNER_JSON_FORMAT_INVALID,
    ACLNN_ERR_INNER_JSON_VALUE_NOT_FOUND,
    ACLNN_ERR_INNER_KEY_CONFLICT,
    ACLNN_ERR_INNER_LOAD_JSON_FAILED,
    ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR,
    ACLNN_ERR_INNER_NULLPTR,
    ACLNN_ERR_INNER_OP_NOT_REGISTERED,
    ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND,
    ACLNN_ERR_INNER_PRE_ALLOC_FAILED,
    ACLNN_ERR_INNER_STATIC_BLOCK_DIM_INVALID,
    ACLNN_ERR_INNER_STATIC_WORKSPACE_INVALID,
    ACLNN_ERR_INNER_TILING_ERROR,
    ACLNN_ERR_INNER_WRONG_ATTR_INFO_SIZE,
    ACLNN_ERR_PARAM_INVALID,
    ACLNN_ERR_PARAM_NULLPTR,
    ACLNN_ERR_RUNTIME_ERROR,
    ACLNN_SUCCESS,
    STATUS_NAMES,
)
from ._executor import aclDestroyAclOpExecutor, aclGetRecentErrMsg, aclOpExecutor, aclSetAclOpExecutorRepeatable

#: ``aclnnStatus`` is a plain int; kept as a name so ported signatures read the same.
aclnnStatus = int

#: Every operator's C declaration (:class:`gradops.aclnn._declare.CFunction`), in the families' order: what
#: ``gradops cann-home`` writes into ``include/aclnnop`` and compiles into ``libopapi.so``.
C_API = (*_RMS_NORM_C, *_LAYER_NORM_C, *_HARDSWISH_C, *_EMBEDDING_C, *_MOE_C, *_ROUTING_C, *_SWIGLU_C)

__all__ = [
    "ACLNN_ERR_INNER",
    "ACLNN_ERR_INNER_CREATE_EXECUTOR",
    "ACLNN_ERR_INNER_FIND_KERNEL_ERROR",
    "ACLNN_ERR_INNER_INFERSHAPE_ERROR",
    "ACLNN_ERR_INNER_INVALID_IMPL_MODE",
    "ACLNN_ERR_INNER_JSON_FORMAT_INVALID",
    "ACLNN_ERR_INNER_JSON_VALUE_NOT_FOUND",
    "ACLNN_ERR_INNER_KEY_CONFLICT",
    "ACLNN_ERR_INNER_LOAD_JSON_FAILED",
    "ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR",
    "ACLNN_ERR_INNER_NULLPTR",
    "ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND",
    "ACLNN_ERR_INNER_OP_NOT_REGISTERED",
    "ACLNN_ERR_INNER_PRE_ALLOC_FAILED",
    "ACLNN_ERR_INNER_STATIC_BLOCK_DIM_INVALID",
    "ACLNN_ERR_INNER_STATIC_WORKSPACE_INVALID",
    "ACLNN_ERR_INNER_TILING_ERROR",
    "ACLNN_ERR_INNER_WRONG_ATTR_INFO_SIZE",
    "ACLNN_ERR_PARAM_INVALID",
    "ACLNN_ERR_PARAM_NULLPTR",
    "ACLNN_ERR_RUNTIME_ERROR",
    "ACLNN_SUCCESS",
    "C_API",
    "STATUS_NAMES",
    "aclDestroyAclOpExecutor",
    "aclGetRecentErrMsg",
    "aclOpExecutor",
    "aclSetAclOpExecutorRepeatable",
    "aclnnEmbedding",
    "aclnnEmbeddingDenseBackward",
    "aclnnEmbeddingDenseBackwardGetWorkspaceSize",
    "aclnnEmbeddingGetWorkspaceSize",
    "aclnnHardswish",
    "aclnnHardswishBackward",
    "aclnnHardswishBackwardGetWorkspaceSize",
    "aclnnHardswishGetWorkspaceSize",
    "aclnnLayerNormBackward",
    "aclnnLayerNormBackwardGetWorkspaceSize",
    "aclnnMoeTokenPermute",
    "aclnnMoeTokenPermuteGetWorkspaceSize",
    "aclnnMoeTokenPermuteGrad",
    "aclnnMoeTokenPermuteGradGetWorkspaceSize",
    "aclnnMoeTokenPermuteWithRoutingMap",
    "aclnnMoeTokenPermuteWithRoutingMapGetWorkspaceSize",
    "aclnnMoeTokenPermuteWithRoutingMapGrad",
    "aclnnMoeTokenPermuteWithRoutingMapGradGetWorkspaceSize",
    "aclnnMoeTokenUnpermute",
    "aclnnMoeTokenUnpermuteGetWorkspaceSize",
    "aclnnMoeTokenUnpermuteGrad",
    "aclnnMoeTokenUnpermuteGradGetWorkspaceSize",
    "aclnnMoeTokenUnpermuteWithRoutingMap",
    "aclnnMoeTokenUnpermuteWithRoutingMapGetWorkspaceSize",
    "aclnnMoeTokenUnpermuteWithRoutingMapGrad",
    "aclnnMoeTokenUnpermuteWithRoutingMapGradGetWorkspaceSize",
    "aclnnRmsNorm",
    "aclnnRmsNormGetWorkspaceSize",
    "aclnnRmsNormGrad",
    "aclnnRmsNormGradGetWorkspaceSize",
    "aclnnStatus",
    "aclnnSwiGlu",
    "aclnnSwiGluGetWorkspaceSize",
    "aclnnSwiGluGrad",
    "aclnnSwiGluGradGetWorkspaceSize",
]
