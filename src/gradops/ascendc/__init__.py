"""AscendC's kernel-level LayerNormGrad / LayerNormGradBeta API on torch tensors (seed 003).

Same names and argument order as the AscendC C++ API; template parameters become keywords
(``LayerNormGradBeta<float, true>(...)`` -> ``LayerNormGradBeta(..., isReuseSource=True)``); ``LocalTensor``s are
torch tensors written in place; host tiling functions return what C writes through reference parameters.
Misuse raises :class:`~gradops.status.OpError` where AscendC would assert.
"""

from ..families.layer_norm.ascendc import LayerNormGrad, LayerNormGradBeta
from .tiling import GetLayerNormGradBetaMaxMinTmpSize, GetLayerNormGradBetaNDTilingInfo, LayerNormGradBetaTiling

__all__ = ["GetLayerNormGradBetaMaxMinTmpSize", "GetLayerNormGradBetaNDTilingInfo", "LayerNormGrad",
           "LayerNormGradBeta", "LayerNormGradBetaTiling"]
