"""Drop-in ``torch.nn`` modules whose forward and backward run on gradops' operators.

Each class subclasses the PyTorch module it replaces, so construction arguments, ``reset_parameters``,
``state_dict`` keys, ``extra_repr`` and hooks are inherited unchanged; only ``forward`` differs. Gradients equal
PyTorch's own modules up to float32 rounding, except :class:`Hardswish` at exactly x = +-3, where gradops follows
CANN's closed interval (d(-3) = -0.5, d(3) = 1.5; PyTorch >= 2.8 gives 0 and 1). Double backward
(``create_graph=True``: gradient penalties, ``gradgradcheck``) works through :class:`RMSNorm`, :class:`LayerNorm`,
:class:`Hardswish` (second derivative 1/3 on the closed interval [-3, 3]) and :class:`Embedding` (with
``scale_grad_by_freq`` the true derivative, which keeps the 1/count that ATen's double backward drops); the MoE
modules refuse it.

Inputs are float16 / bfloat16 / float32 (CANN's dtypes), with parameters of the input's dtype or float32 beside
half inputs, or float64 with float64 parameters, as torch's modules take it (``model.double()``,
``torch.autograd.gradcheck``): float64 runs on the pure-torch reference in float64, never downcast (CANN's own
surfaces, :mod:`gradops.aclnn` and :mod:`gradops.npu_compat`, refuse it). An input whose trailing dims are not the
module's ``normalized_shape`` raises :class:`gradops.OpError` 161002 naming ``x``, not the weight.

The MoE pair :class:`MoeTokenPermute` / :class:`MoeTokenUnpermute` uses CANN's index convention:
``sorted_indices[t*K + k]`` is the permuted row of token t's k-th copy (the inverse of Megatron's
``sorted_indices``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import ops
from .contract._common import require_present, shape_text
from .families.embedding.contract import check_embedding, checked_indices
from .status import ACLNN_ERR_PARAM_INVALID, OpError

__all__ = ["Embedding", "Hardswish", "LayerNorm", "MoeTokenPermute", "MoeTokenUnpermute", "RMSNorm",
           "moe_token_unpermute", "moe_token_unpermute_backward"]


def _input_shape_error(op: str, x: Tensor, normalized_shape: tuple[int, ...]) -> OpError | None:
    """The error of a norm module's input that does not end with the module's ``normalized_shape``, or None."""
    nd = len(normalized_shape)
    if x.dim() >= nd and x.shape[x.dim() - nd:] == normalized_shape:
        return None
    dims = ", ".join(str(s) for s in normalized_shape)
    return OpError(ACLNN_ERR_PARAM_INVALID, op, "x.shape",
                   f"(..., {dims}), ending with the module's normalized_shape {shape_text(normalized_shape)}",
                   shape_text(x.shape))


def _not_a_tensor(op: str, name: str, x: object) -> None:
    """Raise the op's OpError (161001 for None, 161002 for another type) for a module input that is not a tensor,
    before the module reads its dtype or shape (torch's modules raise TypeError there; an AttributeError from here
    would name neither the op nor the argument). Called only when ``x`` is not one (no cost on the call path)."""
    require_present(op, **{name: x})


def _blame_input(err: OpError, op: str, x: Tensor, normalized_shape: tuple[int, ...]) -> OpError:
    """What a norm module raises for ``err``, a shape refusal of its op: the op checks gamma against x's trailing
    dims and so names gamma, the module's weight, whose shape is the module's own; the input is what does not fit.
    Found after the op refused (no cost on the call path); any other refusal is ``err`` itself."""
    if err.arg.endswith((".shape", ".dim()")):
        return _input_shape_error(op, x, normalized_shape) or err
    return err


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` on :func:`gradops.rms_norm` (backward: aclnnRmsNormGrad).

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in PyTorch. ``elementwise_affine=False`` passes a ones
    scale (a constant, not a parameter). The scale must have x's dtype, or be float32 beside float16 / bfloat16
    x (the seed's dtype table, plus float64 with float64); other pairs raise :class:`gradops.OpError` 161002.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            _not_a_tensor("rms_norm", "x", x)
        # finfo of an integer x would raise torch's TypeError before the op could refuse x's dtype (OpError 161002)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps if x.is_floating_point() else 0.0
        gamma = self.weight if self.weight is not None else x.new_ones(self.normalized_shape)
        try:
            return ops.rms_norm(x, gamma, eps)[0]
        except OpError as err:
            raise _blame_input(err, "rms_norm", x, self.normalized_shape) from None


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` on :func:`gradops.layer_norm` (backward: LayerNormGrad + LayerNormGradBeta fused).

    A multi-dim ``normalized_shape`` is flattened to one normalised dim of ``prod(normalized_shape)`` (the same
    statistics). ``elementwise_affine=False`` / ``bias=False`` pass ones / zeros constants instead of creating
    parameters, exactly as PyTorch leaves ``weight`` / ``bias`` at None.
    """

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            _not_a_tensor("layer_norm", "x", x)
        gamma = self.weight if self.weight is not None else x.new_ones(self.normalized_shape)
        beta = self.bias if self.bias is not None else x.new_zeros(self.normalized_shape)
        nd = len(self.normalized_shape)
        if nd == 1:  # the common case: no views (each would add an autograd node, ~15 µs of a small step)
            try:
                return ops.layer_norm_output(x, gamma, beta, self.eps)
            except OpError as err:
                raise _blame_input(err, "layer_norm", x, self.normalized_shape) from None
        error = _input_shape_error("layer_norm", x, self.normalized_shape)  # before the reshape, which could fit
        if error is not None:
            raise error
        n = math.prod(self.normalized_shape)
        flat = x.reshape(*x.shape[: x.dim() - nd], n)
        return ops.layer_norm(flat, gamma.reshape(n), beta.reshape(n), self.eps)[0].reshape(x.shape)


class Embedding(torch.nn.Embedding):
    """``torch.nn.Embedding`` on :func:`gradops.embedding` (backward: aclnnEmbeddingDenseBackward).

    ``padding_idx``: a negative value counts from the end, normalised as ``torch.nn.Embedding`` /
    ``F.embedding`` do (-1 is the last row) before reaching CANN's operator, where negative means "none".
    ``max_norm`` renormalises the looked-up rows in place first, exactly as ``F.embedding`` does (under
    no_grad, ``torch.embedding_renorm_``). ``sparse=True`` falls back to PyTorch's own lookup: a sparse gradient
    is not what aclnnEmbeddingDenseBackward produces, so :func:`gradops.patch` leaves such modules alone.
    """

    def forward(self, indices: Tensor) -> Tensor:
        if self.sparse:
            return super().forward(indices)
        if not isinstance(indices, Tensor):
            _not_a_tensor("embedding", "indices", indices)
        num_weights = self.weight.shape[0]
        padding_idx = -1
        if self.padding_idx is not None:
            padding_idx = self.padding_idx + num_weights if self.padding_idx < 0 else self.padding_idx
        if self.max_norm is not None:
            # The lookup's checks first: a refused index (past the table, a float outside it, a wrong dtype) must
            # raise OpError before any row is renormalised, and torch's renorm takes only int32 / int64 indices:
            # it gets the converted ones (floats truncated toward zero, as CANN reads them).
            check_embedding(self.weight, indices, padding_idx, self.scale_grad_by_freq)
            rows = checked_indices(indices, num_weights, op="embedding")
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, rows, self.max_norm, self.norm_type)
        return ops.embedding(self.weight, indices, padding_idx, self.scale_grad_by_freq)


class Hardswish(torch.nn.Hardswish):
    """``torch.nn.Hardswish`` on :func:`gradops.hardswish` (backward: aclnnHardswishBackward, CANN's closed
    interval at +-3). ``inplace=True`` is accepted but the result is a new tensor: gradops never writes into an
    input."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.hardswish_output(x)


class MoeTokenPermute(torch.nn.Module):
    """Groups token copies by expert with :func:`gradops.moe_token_permute` (backward: aclnnMoeTokenPermuteGrad).

    Args:
        num_out_tokens: keep only the first permuted rows (token dropping); None or 0 keeps all T*K.

    ``forward(tokens (T, H), indices (T, K) or (T,)) -> (permuted (rows, H), sorted_indices (T*K,) int32)``,
    rows ordered by expert id (stable in token order); differentiable w.r.t. tokens.
    """

    def __init__(self, num_out_tokens: int | None = None) -> None:
        super().__init__()
        self.num_out_tokens = num_out_tokens

    def forward(self, tokens: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        return ops.moe_token_permute(tokens, indices, self.num_out_tokens)

    def extra_repr(self) -> str:
        return f"num_out_tokens={self.num_out_tokens}"


class MoeTokenUnpermute(torch.nn.Module):
    """The inverse of :class:`MoeTokenPermute`, merging each token's K expert outputs (see
    :func:`gradops.moe_token_unpermute`).

    ``forward(permuted (rows, H), sorted_indices (T*K,), probs (T, K) or None)``."""

    def forward(self, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None) -> Tensor:
        return ops.moe_token_unpermute(permuted_tokens, sorted_indices, probs)


def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None) -> Tensor:
    """:func:`gradops.moe_token_unpermute` (aclnnMoeTokenUnpermute), kept here for code written against this
    module: ``out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]``, differentiable w.r.t.
    permuted_tokens and probs."""
    return ops.moe_token_unpermute(permuted_tokens, sorted_indices, probs)


def moe_token_unpermute_backward(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                                 probs: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`gradops.moe_token_unpermute_grad` (aclnnMoeTokenUnpermuteGrad), answering None for the probs
    gradient when there are no probs (the op itself returns an empty tensor there).

    Returns:
        ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, K) in probs' dtype or None)``.
    """
    d_permuted, d_probs = ops.moe_token_unpermute_grad(permuted_tokens, grad_unpermuted, sorted_indices, probs)
    return d_permuted, d_probs if probs is not None else None
