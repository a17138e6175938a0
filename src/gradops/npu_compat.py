"""torch_npu's names, argument orders and return conventions, on gradops' operators.

Code written for Ascend (``torch_npu.npu_rms_norm(...)``, MindSpeed's ``npu_moe_token_permute(...)``) runs on
CPU / NVIDIA GPUs by importing these instead; ``torch_npu`` is never imported. Each alias lists the aclnn
operator it stands for and the torch_npu schema it copies (op-plugin / MindSpeed signatures, e.g.
``func: npu_moe_token_permute_grad(Tensor tokens, Tensor grad_permuted_tokens, Tensor indices,
Tensor sorted_indices, bool padded_mode=False) -> Tensor`` from torch_npu's ``register_sharding`` rules).

Conventions kept: rstd is float32 in the forward's keepdim shape; ``sorted_indices`` is int32 in CANN's
convention (the permuted row of each (token, k) copy, the inverse of Megatron's); ``padded_mode=True`` is
refused (OpError 161002), as CANN supports only False. The forwards are differentiable like torch_npu's.
float64, which the PyTorch API (:mod:`gradops.ops`, :mod:`gradops.nn`) takes beyond CANN's tables, is refused
here with 161002 as torch_npu's operators refuse it (:func:`_cann_floats`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import ops
from .contract._common import FLOATS, dtypes_text
from .status import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, OpError

__all__ = ["npu_moe_token_permute", "npu_moe_token_permute_grad", "npu_moe_token_permute_grad_v2",
           "npu_moe_token_permute_with_routing_map", "npu_moe_token_unpermute", "npu_moe_token_unpermute_grad",
           "npu_moe_token_unpermute_grad_v2", "npu_moe_token_unpermute_with_routing_map", "npu_rms_norm",
           "npu_rms_norm_backward", "npu_swiglu", "npu_swiglu_backward"]


def _no_padded_mode(op: str, padded_mode: bool) -> None:
    if padded_mode:
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "padded_mode", "False (CANN supports only paddedMode=false)",
                      "True")


def _cann_floats(op: str, others: tuple, **tensors: Tensor | None) -> None:
    """Refuse float64 (161002), the one float dtype the PyTorch API adds to CANN's tables, among the op's float
    ``tensors`` (in the op's argument order). Everything else is left to the op's own table, so that its messages
    and CANN's order stand: a missing or non-tensor argument among ``tensors`` and the op's ``others`` (161001
    first), or an earlier argument of another wrong dtype, is not looked past. An optional tensor left at None
    (probs) is passed as None among ``tensors``, not ``others``."""
    if not all(isinstance(t, Tensor) for t in others) or \
            not all(isinstance(t, Tensor) for t in tensors.values() if t is not None):
        return
    for name, t in tensors.items():
        if t is None or t.dtype in FLOATS:
            continue
        if t.dtype == torch.float64:
            raise OpError(ACLNN_ERR_PARAM_INVALID, op, f"{name}.dtype", dtypes_text(FLOATS), "float64")
        return


def npu_rms_norm(self: Tensor, gamma: Tensor, epsilon: float = 1e-06) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_rms_norm(self, gamma, epsilon=1e-06) -> (y, rstd)``; aclnnRmsNorm.

    Returns:
        y in self's dtype; rstd float32 of shape ``self.shape[:-gamma.dim()] + (1,) * gamma.dim()``.
        Differentiable (backward: :func:`npu_rms_norm_backward`, i.e. aclnnRmsNormGrad).
    """
    _cann_floats("rms_norm", (gamma,), x=self)  # gamma: float64 only beside float64 x in the op's own table
    return ops.rms_norm(self, gamma, epsilon)


def npu_rms_norm_backward(dy: Tensor, self: Tensor, gamma: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.ops.npu.npu_rms_norm_backward(dy, self, gamma, rstd) -> (dx, dgamma)``; aclnnRmsNormGrad.

    Note the order: torch_npu passes gamma BEFORE rstd, aclnnRmsNormGrad (and :func:`gradops.rms_norm_grad`)
    take ``(dy, x, rstd, gamma)``. Returns dx in dy's dtype and dgamma in float32.
    """
    # x, rstd, gamma: float64 only beside float64 dy in the op's own table
    _cann_floats("rms_norm_grad", (self, rstd, gamma), dy=dy)
    return ops.rms_norm_grad(dy, self, rstd, gamma)


def npu_swiglu(input: Tensor, dim: int = -1) -> Tensor:
    """``torch_npu.npu_swiglu(input, dim=-1) -> Tensor``; aclnnSwiGlu: input split into halves A, B along dim,
    ``silu(A) * B``. Differentiable (backward: :func:`npu_swiglu_backward`, i.e. aclnnSwiGluGrad)."""
    _cann_floats("swiglu", (), x=input)
    return ops.swiglu(input, dim)


def npu_swiglu_backward(grad_output: Tensor, input: Tensor, dim: int = -1) -> Tensor:
    """``torch.ops.npu.npu_swiglu_backward(grad_output, input, dim=-1) -> Tensor``; aclnnSwiGluGrad: the gradient
    with respect to input, in input's shape and dtype."""
    _cann_floats("swiglu_grad", (input,), y_grad=grad_output)
    return ops.swiglu_grad(grad_output, input, dim)


def npu_moe_token_permute(tokens: Tensor, indices: Tensor, num_out_tokens: int | None = None,
                          padded_mode: bool = False) -> tuple[Tensor, Tensor]:
    """``torch_npu.npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
    -> (permuted_tokens, sorted_indices)``; aclnnMoeTokenPermute. Differentiable w.r.t. tokens
    (aclnnMoeTokenPermuteGrad)."""
    _no_padded_mode("npu_moe_token_permute", padded_mode)
    _cann_floats("moe_token_permute", (indices,), tokens=tokens)
    return ops.moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def npu_moe_token_permute_grad(tokens: Tensor, grad_permuted_tokens: Tensor, indices: Tensor,
                               sorted_indices: Tensor, padded_mode: bool = False) -> Tensor:
    """``npu_moe_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode=False)
    -> Tensor``; aclnnMoeTokenPermuteGrad(permutedOutputGrad, sortedIndices, numTopk, paddedMode).

    torch_npu passes the forward's tokens and indices; aclnn needs only ``numTopk = indices.shape[1]`` (1 for
    1-D indices), which is all this reads from them. Returns (T, H) in the gradient's dtype.
    """
    _no_padded_mode("npu_moe_token_permute_grad", padded_mode)
    _cann_floats("moe_token_permute_grad", (sorted_indices,), permuted_output_grad=grad_permuted_tokens)
    topk = indices.shape[1] if indices.dim() == 2 else 1
    out = ops.moe_token_permute_grad(grad_permuted_tokens, sorted_indices, topk, padded_mode)
    if out.shape[0] != tokens.shape[0]:
        raise OpError(ACLNN_ERR_PARAM_INVALID, "npu_moe_token_permute_grad", "tokens.shape[0]",
                      f"sorted_indices.numel() / K = {out.shape[0]}", str(tokens.shape[0]))
    return out


def npu_moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None,
                            padded_mode: bool = False, restore_shape: Sequence[int] | None = None) -> Tensor:
    """``torch_npu.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
    restore_shape=None) -> Tensor``; aclnnMoeTokenUnpermute.

    ``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]`` (K = probs.shape[1], or 1 without
    probs). ``restore_shape`` only matters in padded mode, which CANN does not support; it is ignored.
    Differentiable w.r.t. permuted_tokens and probs (aclnnMoeTokenUnpermuteGrad).
    """
    _no_padded_mode("npu_moe_token_unpermute", padded_mode)
    _cann_floats("moe_token_unpermute", (sorted_indices,), permuted_tokens=permuted_tokens, probs=probs)
    return ops.moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)


def npu_moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted_tokens: Tensor, sorted_indices: Tensor,
                                 probs: Tensor | None = None, padded_mode: bool = False,
                                 restore_shape: Sequence[int] | None = None) -> tuple[Tensor, Tensor]:
    """``npu_moe_token_unpermute_grad(permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs=None,
    padded_mode=False, restore_shape=None) -> (grad_permuted_tokens, grad_probs)``; aclnnMoeTokenUnpermuteGrad.

    The schema always returns two tensors: without probs the second is an empty tensor of probs' would-be
    dtype (the permuted tokens' dtype) [what torch_npu returns there is not documented].
    """
    _no_padded_mode("npu_moe_token_unpermute_grad", padded_mode)
    _cann_floats("moe_token_unpermute_grad", (sorted_indices,), permuted_tokens=permuted_tokens, probs=probs,
                 grad_unpermuted=grad_unpermuted_tokens)
    return ops.moe_token_unpermute_grad(permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs, padded_mode,
                                        restore_shape)


def npu_moe_token_permute_grad_v2(grad_permuted_tokens: Tensor, sorted_indices: Tensor, tokens_size_0: int,
                                  tokens_dtype: torch.dtype, num_topK: int, padded_mode: bool = False) -> Tensor:
    """``npu_moe_token_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK,
    padded_mode=False) -> Tensor``: the gradient function torch_npu's autograd of :func:`npu_moe_token_permute`
    calls (aclnnMoeTokenPermuteGrad), given the forward's token count and dtype instead of its tensors.

    Returns (tokens_size_0, H) in tokens_dtype: ``out[t] = sum_k grad[sorted_indices[t*K + k]]`` summed in fp32
    (rows past grad's dropped ones add nothing), rounded once to the gradient's dtype and then, where tokens_dtype
    differs, converted.
    """
    op = "npu_moe_token_permute_grad_v2"
    _no_padded_mode(op, padded_mode)
    _cann_floats("moe_token_permute_grad", (sorted_indices,), permuted_output_grad=grad_permuted_tokens)
    if not isinstance(tokens_dtype, torch.dtype):
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "tokens_dtype", "a torch.dtype", type(tokens_dtype).__name__)
    out = ops.moe_token_permute_grad(grad_permuted_tokens, sorted_indices, num_topK, padded_mode)
    if out.shape[0] != tokens_size_0:
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "tokens_size_0",
                      f"sorted_indices.numel() / num_topK = {out.shape[0]}", str(tokens_size_0))
    return out if out.dtype == tokens_dtype else out.to(tokens_dtype)


def npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens: Tensor, sorted_indices: Tensor,
                                    permuted_tokens_size_0: int, permuted_tokens_dtype: torch.dtype,
                                    probs: Tensor | None = None, padded_mode: bool = False,
                                    restore_shape: Sequence[int] | None = None,
                                    permuted_tokens: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
    permuted_tokens_dtype, probs=None, padded_mode=False, restore_shape=None, permuted_tokens=None)
    -> (grad_permuted_tokens, grad_probs)``: aclnnMoeTokenUnpermuteGrad as torch_npu's autograd of
    :func:`npu_moe_token_unpermute` calls it, given the permuted tokens' row count and dtype (their values are
    needed only with probs, for the probs' gradient).

    Returns ``(grad_permuted (permuted_tokens_size_0, H) in permuted_tokens_dtype, grad_probs)``; without probs
    the second is an empty tensor (torch_npu returns an unspecified placeholder there).
    """
    op = "npu_moe_token_unpermute_grad_v2"
    _no_padded_mode(op, padded_mode)
    if not isinstance(permuted_tokens_dtype, torch.dtype):
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "permuted_tokens_dtype", "a torch.dtype",
                      type(permuted_tokens_dtype).__name__)
    if isinstance(permuted_tokens_size_0, bool) or not isinstance(permuted_tokens_size_0, int) \
            or permuted_tokens_size_0 < 0:
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "permuted_tokens_size_0", "an int >= 0",
                      repr(permuted_tokens_size_0))
    if permuted_tokens is None:
        if probs is not None:
            raise OpError(ACLNN_ERR_PARAM_NULLPTR, op, "permuted_tokens",
                          "a tensor (the probs' gradient reads it)", "None")
        if isinstance(sorted_indices, Tensor) and permuted_tokens_size_0 > sorted_indices.numel():
            # before the stand-in below is allocated (2**40 rows failed in the allocator, 2**63 overflowed)
            raise OpError(ACLNN_ERR_PARAM_INVALID, op, "permuted_tokens_size_0",
                          f"at most T*K = sorted_indices.numel() = {sorted_indices.numel()} rows (fewer when tokens "
                          "were dropped)", repr(permuted_tokens_size_0))
        if not isinstance(grad_unpermuted_tokens, Tensor) or grad_unpermuted_tokens.dim() != 2:
            permuted_tokens = grad_unpermuted_tokens  # let the op name the missing or misshapen gradient
        else:  # read for its shape and dtype only: an uninitialised stand-in, never touched
            permuted_tokens = torch.empty((permuted_tokens_size_0, grad_unpermuted_tokens.shape[-1]),
                                          dtype=permuted_tokens_dtype, device=grad_unpermuted_tokens.device)
    elif isinstance(permuted_tokens, Tensor) and (permuted_tokens.dim() != 2 or
                                                  permuted_tokens.shape[0] != permuted_tokens_size_0 or
                                                  permuted_tokens.dtype != permuted_tokens_dtype):
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "permuted_tokens",
                      f"({permuted_tokens_size_0}, H) of {permuted_tokens_dtype} (permuted_tokens_size_0, "
                      "permuted_tokens_dtype)", f"{tuple(permuted_tokens.shape)} of {permuted_tokens.dtype}")
    _cann_floats("moe_token_unpermute_grad", (sorted_indices,), permuted_tokens=permuted_tokens, probs=probs,
                 grad_unpermuted=grad_unpermuted_tokens)
    return ops.moe_token_unpermute_grad(permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs, padded_mode,
                                        restore_shape)


def npu_moe_token_permute_with_routing_map(tokens: Tensor, routing_map: Tensor, *, probs: Tensor | None = None,
                                           num_out_tokens: int | None = None, drop_and_pad: bool = False
                                           ) -> tuple[Tensor, Tensor | None, Tensor]:
    """``torch_npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None, num_out_tokens=None,
    drop_and_pad=False) -> (permuted_tokens, permuted_probs, sorted_indices)``; aclnnMoeTokenPermuteWithRoutingMap.

    permuted_probs is None without probs (torch_npu's undefined tensor). Differentiable w.r.t. tokens and probs
    (aclnnMoeTokenPermuteWithRoutingMapGrad). See :func:`gradops.moe_token_permute_with_routing_map`.
    """
    _cann_floats("moe_token_permute_with_routing_map", (routing_map,), tokens=tokens, probs=probs)
    permuted, permuted_probs, sorted_indices = ops.moe_token_permute_with_routing_map(tokens, routing_map, probs,
                                                                                      num_out_tokens, drop_and_pad)
    return permuted, None if probs is None else permuted_probs, sorted_indices


def npu_moe_token_unpermute_with_routing_map(permuted_tokens: Tensor, sorted_indices: Tensor,
                                             restore_shape: Sequence[int], *, probs: Tensor | None = None,
                                             routing_map: Tensor | None = None, drop_and_pad: bool = False
                                             ) -> Tensor:
    """``torch_npu.npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
    probs=None, routing_map=None, drop_and_pad=False) -> Tensor``; aclnnMoeTokenUnpermuteWithRoutingMap.

    Differentiable w.r.t. permuted_tokens and probs (aclnnMoeTokenUnpermuteWithRoutingMapGrad). See
    :func:`gradops.moe_token_unpermute_with_routing_map`.
    """
    _cann_floats("moe_token_unpermute_with_routing_map", (sorted_indices,), permuted_tokens=permuted_tokens,
                 probs=probs)
    return ops.moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs,
                                                    routing_map, drop_and_pad)
