"""RmsNorm and RmsNormGrad (aclnnRmsNorm / aclnnRmsNormGrad): the family's room (see :mod:`gradops.families`)."""
