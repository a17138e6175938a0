"""SwiGlu and SwiGluGrad (aclnnSwiGlu / aclnnSwiGluGrad; torch_npu ``npu_swiglu``): the family's room (see
:mod:`gradops.families`)."""
