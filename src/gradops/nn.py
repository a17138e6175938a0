"""Drop-in ``torch.nn`` modules whose forward and backward run on gradops' operators.

Each class subclasses the PyTorch module it replaces, so construction arguments, ``reset_parameters``,
``state_dict`` keys, ``extra_repr`` and hooks are inherited unchanged; only ``forward`` differs. Gradients equal
PyTorch's own modules up to float32 rounding, except :class:`Hardswish` at exactly x = +-3, where gradops follows
CANN's closed interval (d(-3) = -0.5, d(3) = 1.5; PyTorch >= 2.8 gives 0 and 1).

Inputs are float16 / bfloat16 / float32 (CANN's dtypes; float64 raises :class:`gradops.OpError` 161002), with
parameters of the input's dtype or float32 beside half inputs.

The MoE pair :class:`MoeTokenPermute` / :class:`MoeTokenUnpermute` uses CANN's index convention:
``sorted_indices[t*K + k]`` is the permuted row of token t's k-th copy (the inverse of Megatron's
``sorted_indices``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from .contract.moe_permute import checked_sorted_indices
from .status import ACLNN_ERR_PARAM_INVALID, OpError

__all__ = ["Embedding", "Hardswish", "LayerNorm", "MoeTokenPermute", "MoeTokenUnpermute", "RMSNorm",
           "moe_token_unpermute", "moe_token_unpermute_backward"]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` on :func:`gradops.rms_norm` (backward: aclnnRmsNormGrad).

    ``eps=None`` means ``torch.finfo(x.dtype).eps``, as in PyTorch. ``elementwise_affine=False`` passes a ones
    scale (a constant, not a parameter). The scale must have x's dtype, or be float32 beside float16 / bfloat16
    x (the seed's dtype table); other pairs raise :class:`gradops.OpError` 161002.
    """

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        gamma = self.weight if self.weight is not None else x.new_ones(self.normalized_shape)
        return ops.rms_norm(x, gamma, eps)[0]


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` on :func:`gradops.layer_norm` (backward: LayerNormGrad + LayerNormGradBeta fused).

    A multi-dim ``normalized_shape`` is flattened to one normalised dim of ``prod(normalized_shape)`` (the same
    statistics). ``elementwise_affine=False`` / ``bias=False`` pass ones / zeros constants instead of creating
    parameters, exactly as PyTorch leaves ``weight`` / ``bias`` at None.
    """

    def forward(self, x: Tensor) -> Tensor:
        nd = len(self.normalized_shape)
        n = 1
        for s in self.normalized_shape:
            n *= s
        if x.dim() < nd or tuple(x.shape[x.dim() - nd:]) != tuple(self.normalized_shape):
            raise OpError(ACLNN_ERR_PARAM_INVALID, "layer_norm", "x.shape",
                          f"a shape ending with normalized_shape {tuple(self.normalized_shape)}",
                          str(tuple(x.shape)))
        flat = x.reshape(*x.shape[: x.dim() - nd], n)
        gamma = self.weight.reshape(n) if self.weight is not None else x.new_ones(n)
        beta = self.bias.reshape(n) if self.bias is not None else x.new_zeros(n)
        return ops.layer_norm(flat, gamma, beta, self.eps)[0].reshape(x.shape)


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
        num_weights = self.weight.shape[0]
        padding_idx = -1
        if self.padding_idx is not None:
            padding_idx = self.padding_idx + num_weights if self.padding_idx < 0 else self.padding_idx
        if self.max_norm is not None:
            with torch.no_grad():
                torch.embedding_renorm_(self.weight, indices.contiguous(), self.max_norm, self.norm_type)
        return ops.embedding(self.weight, indices, padding_idx, self.scale_grad_by_freq)


class Hardswish(torch.nn.Hardswish):
    """``torch.nn.Hardswish`` on :func:`gradops.hardswish` (backward: aclnnHardswishBackward, CANN's closed
    interval at +-3). ``inplace=True`` is accepted but the result is a new tensor: gradops never writes into an
    input."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.hardswish(x)


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
    :func:`moe_token_unpermute`). ``forward(permuted (rows, H), sorted_indices (T*K,), probs (T, K) or None)``."""

    def forward(self, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None) -> Tensor:
        return moe_token_unpermute(permuted_tokens, sorted_indices, probs)


def _sources(sorted_indices: Tensor, op: str) -> Tensor:
    """``inv[sorted_indices[i]] = i``: the flat (token, k) position that landed on each permuted row (int64).

    Eagerly, sorted_indices must be a permutation of [0, T*K) (CANN: "no duplicate indices"; a duplicate would leave
    a row with no source and its probability weight undefined), else OpError 161002. The range check comes first
    (one host sync, as in the ops) so that the index_put below never meets a bad index; then T*K values in range
    fill all T*K slots exactly when none repeats, so an unfilled slot is the duplicate test (a second sync; no
    bincount). While tracing both checks are skipped (a data-dependent test would break the graph); the -1 fill
    keeps the result defined, and torch's own index bounds checks stop a bad index.
    """
    tracing = torch.compiler.is_compiling()
    if not tracing:
        checked_sorted_indices(sorted_indices, op=op)
    s = sorted_indices.long()
    inv = torch.full_like(s, -1)
    inv[s] = torch.arange(s.numel(), device=s.device)
    if not tracing and s.numel() and bool((inv < 0).any()):
        counts = torch.bincount(s, minlength=s.numel())
        row = int((counts > 1).nonzero()[0, 0])
        raise OpError(ACLNN_ERR_PARAM_INVALID, op, "sorted_indices", "a permutation of [0, T*K) naming every row once",
                      f"row {row} named {int(counts[row])} times")
    return inv


def _topk(sorted_indices: Tensor, probs: Tensor | None) -> int:
    if probs is None:
        return 1
    if probs.dim() != 2 or probs.numel() != sorted_indices.numel():
        raise OpError(ACLNN_ERR_PARAM_INVALID, "moe_token_unpermute", "probs",
                      f"of shape (T, K) with T*K = sorted_indices.numel() = {sorted_indices.numel()}",
                      f"shape {tuple(probs.shape)}")
    return probs.shape[1]


class _Unpermute(torch.autograd.Function):
    """The forward also returns the checked inverse permutation (non-differentiable) so that the backward reuses
    it: one check and one inversion per step. setup_context style, which torch.func transforms require."""

    @staticmethod
    def forward(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None) -> tuple[Tensor, Tensor]:
        rows = permuted_tokens.shape[0]
        source = _sources(sorted_indices, "moe_token_unpermute")[:rows]  # every kept row has one (token, k) source
        k = _topk(sorted_indices, probs)
        if probs is None:  # out[t] = permuted[s[t]]: MoeTokenPermuteGrad with K = 1 is exactly this gather
            return ops.moe_token_permute_grad(permuted_tokens, sorted_indices, 1), source
        # Weight each permuted row by its token's prob in float32, then sum the K rows of each token in float32.
        weighted = permuted_tokens.float() * probs.reshape(-1).float().index_select(0, source)[:, None]
        return ops.moe_token_permute_grad(weighted, sorted_indices, k).to(permuted_tokens.dtype), source

    @staticmethod
    def setup_context(ctx, inputs, output):
        permuted_tokens, sorted_indices, probs = inputs
        source = output[1]
        ctx.mark_non_differentiable(source)
        ctx.save_for_backward(permuted_tokens, sorted_indices, probs, source)

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_source: Tensor | None):
        permuted_tokens, sorted_indices, probs, source = ctx.saved_tensors
        d_permuted, d_probs = _unpermute_grads(permuted_tokens, grad, sorted_indices, probs, source)
        return d_permuted, None, d_probs


def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenUnpermute (paddedMode false): ``out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]``.

    Runs on :func:`gradops.moe_token_permute_grad` (float32 sums in k order); rows the permute dropped
    (``sorted_indices >= permuted_tokens.shape[0]``) contribute zero. Differentiable w.r.t. permuted_tokens and
    probs through :func:`moe_token_unpermute_backward`.

    Args:
        permuted_tokens: (A, H), A <= T*K, float16 / bfloat16 / float32.
        sorted_indices: (T*K,) int32 / int64, CANN's convention (as :func:`gradops.moe_token_permute` returns).
        probs: (T, K) routing weights, or None: then K = 1 and the result is the plain inverse gather.

    Returns:
        (T, H) in permuted_tokens' dtype.
    """
    return _Unpermute.apply(permuted_tokens, sorted_indices, probs)[0]


def moe_token_unpermute_backward(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                                 probs: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """aclnnMoeTokenUnpermuteGrad: the gradients of :func:`moe_token_unpermute`, in float32 then cast::

        grad_permuted[sorted_indices[i]] = grad_unpermuted[i // K] * probs.flat[i]      (probs = 1 when None)
        grad_probs[t, k] = sum_h grad_unpermuted[t, h] * permuted[sorted_indices[t*K + k], h]   (0 if dropped)

    Returns:
        ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, K) in probs' dtype or None)``.
    """
    source = _sources(sorted_indices, "moe_token_unpermute_backward")[:permuted_tokens.shape[0]]
    return _unpermute_grads(permuted_tokens, grad_unpermuted, sorted_indices, probs, source)


def _unpermute_grads(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                     source: Tensor) -> tuple[Tensor, Tensor | None]:
    """:func:`moe_token_unpermute_backward` given ``source``, the checked inverse of sorted_indices (kept rows)."""
    k = _topk(sorted_indices, probs)
    rows, hidden = permuted_tokens.shape
    g = grad_unpermuted.float()
    # index_select, not g[index]: 27 vs 126 µs at 2048 x 96 on CPU (see gradops.reference.moe_permute)
    d_permuted = g.index_select(0, source // k)
    if probs is None:
        return d_permuted.to(permuted_tokens.dtype), None
    d_permuted = d_permuted * probs.reshape(-1).float().index_select(0, source)[:, None]
    s = sorted_indices.long()
    padded = torch.cat([permuted_tokens.float(), permuted_tokens.new_zeros(1, hidden, dtype=torch.float32)])
    picked = padded.index_select(0, torch.where(s < rows, s, rows)).view(-1, k, hidden)  # dropped: the zero row
    d_probs = (picked * g[:, None, :]).sum(dim=-1)
    return d_permuted.to(permuted_tokens.dtype), d_probs.to(probs.dtype)
