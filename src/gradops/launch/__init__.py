"""Triton host launchers: the ``triton`` backend of :mod:`gradops.backend`.

Each family's ``launch.py`` holds its launchers (the backend signature: the 2-D views its ``ops.py`` prepares; each
allocates its outputs, picks tiles and launches the family's ``kernels.py``) and one ``Impl`` per op, which the op's
declaration provides to the backend; ops with scratch memory declare a workspace hook (bytes for the same args) and
accept ``workspace=`` (a uint8 device tensor). This package holds what they share (:mod:`gradops.launch._common`:
launches, index checks, workspace carving; the interpreter's fixes) and re-exports the launchers. CUDA tensors run
compiled kernels; CPU tensors only under ``TRITON_INTERPRET=1`` (tests). Importing this package needs triton.
"""

from .._runtime import interpreting

if interpreting():  # before any kernel runs: make the interpreter work with NumPy >= 2.4
    from ._interpret import apply as _apply_interpreter_fix

    _apply_interpreter_fix()

from ..families.embedding.launch import embedding_dense_backward, embedding_dense_backward_workspace
from ..families.hardswish.launch import hardswish, hardswish_backward
from ..families.layer_norm.launch import (
    layer_norm,
    layer_norm_backward,
    layer_norm_backward_workspace,
    layer_norm_grad,
    layer_norm_grad_beta,
    layer_norm_grad_beta_workspace,
)
from ..families.moe.launch import (
    moe_token_permute,
    moe_token_permute_grad,
    moe_token_permute_with_routing_map,
    moe_token_permute_with_routing_map_grad,
    moe_token_permute_workspace,
    moe_token_unpermute,
    moe_token_unpermute_grad,
    moe_token_unpermute_with_routing_map,
    moe_token_unpermute_with_routing_map_grad,
)
from ..families.rms_norm.launch import rms_norm, rms_norm_grad, rms_norm_grad_workspace
from ..families.swiglu.launch import swiglu, swiglu_grad
from ._common import LAUNCHES

__all__ = [
    "LAUNCHES", "embedding_dense_backward", "embedding_dense_backward_workspace", "hardswish", "hardswish_backward",
    "layer_norm", "layer_norm_backward", "layer_norm_backward_workspace", "layer_norm_grad", "layer_norm_grad_beta",
    "layer_norm_grad_beta_workspace", "moe_token_permute", "moe_token_permute_grad",
    "moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad", "moe_token_permute_workspace",
    "moe_token_unpermute", "moe_token_unpermute_grad", "moe_token_unpermute_with_routing_map",
    "moe_token_unpermute_with_routing_map_grad", "rms_norm", "rms_norm_grad", "rms_norm_grad_workspace", "swiglu",
    "swiglu_grad",
]
