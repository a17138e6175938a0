"""Triton kernels (``@triton.jit`` code and block-size heuristics only; launchers live in :mod:`gradops.launch`).
One module per op family; each kernel's docstring gives its formula and byte model."""
