"""LayerNorm, its fused backward and CANN's LayerNormGrad / LayerNormGradBeta (AscendC): the family's room (see
:mod:`gradops.families`)."""
