"""Every invalid input: OpError with CANN's status and a message naming the argument (CANN's check order:
nulls 161001, dtypes 161002, shapes 161002 — RmsNormGrad's shape rules 561002, as its seed says)."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops.status import ACLNN_ERR_INNER_TILING_ERROR as TILING
from gradops.status import ACLNN_ERR_PARAM_INVALID as INVALID
from gradops.status import ACLNN_ERR_PARAM_NULLPTR as NULL

f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def t(*shape, dtype=f32, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


X, G, R = t(2, 4, 8), t(8), t(2, 4)
LX, LG = t(3, 8), t(8)
LSTAT = t(3)

# (id, function, args, kwargs, status, the argument the message must name)
CASES = [
    # ---- rms_norm_grad
    ("rmsg-null-dy", "rms_norm_grad", (None, X, R, G), {}, NULL, "dy"),
    ("rmsg-null-gamma", "rms_norm_grad", (X, X, R, None), {}, NULL, "gamma"),
    ("rmsg-null-before-dtype", "rms_norm_grad", (t(2, 4, 8, dtype=f64), X, None, G), {}, NULL, "rstd"),
    ("rmsg-not-tensor", "rms_norm_grad", ([1.0], X, R, G), {}, INVALID, "dy"),
    ("rmsg-dtype-int", "rms_norm_grad", (t(2, 4, 8, dtype=torch.int32), t(2, 4, 8, dtype=torch.int32), R, G), {}, INVALID, "dy.dtype"),
    ("rmsg-dtype-gamma-f32-x-f64", "rms_norm_grad", (t(2, 4, 8, dtype=f64), t(2, 4, 8, dtype=f64), R, G), {}, INVALID, "gamma.dtype"),
    ("rmsg-dtype-rstd-f64-x-f32", "rms_norm_grad", (X, X, t(2, 4, dtype=f64), G), {}, INVALID, "rstd.dtype"),
    ("rmsg-dtype-x-vs-dy", "rms_norm_grad", (X, t(2, 4, 8, dtype=f16), R, G), {}, INVALID, "x.dtype"),
    ("rmsg-dtype-rstd", "rms_norm_grad", (X, X, t(2, 4, dtype=f16), G), {}, INVALID, "rstd.dtype"),
    ("rmsg-dtype-gamma-f16-x-bf16", "rms_norm_grad", (t(2, 4, 8, dtype=bf16), t(2, 4, 8, dtype=bf16), R, t(8, dtype=f16)), {}, INVALID, "gamma.dtype"),
    ("rmsg-dtype-gamma-bf16-x-f32", "rms_norm_grad", (X, X, R, t(8, dtype=bf16)), {}, INVALID, "gamma.dtype"),
    ("rmsg-dtype-before-shape", "rms_norm_grad", (X, X, t(5, dtype=f16), t(3)), {}, INVALID, "rstd.dtype"),
    ("rmsg-rank-9", "rms_norm_grad", (t(*[1] * 9), t(*[1] * 9), t(1), t(1)), {}, TILING, "x.dim()"),
    ("rmsg-gamma-rank", "rms_norm_grad", (t(4, 8), t(4, 8), t(4), t(1, 4, 8)), {}, TILING, "gamma.dim()"),
    ("rmsg-dy-shape", "rms_norm_grad", (t(2, 4, 9), X, R, G), {}, TILING, "dy.shape"),
    ("rmsg-gamma-shape", "rms_norm_grad", (X, X, R, t(7)), {}, TILING, "gamma.shape"),
    # issue 36.14: dy against x first (CANN's tiling order); gamma, which matches dy, was named
    ("rmsg-dy-x-before-gamma", "rms_norm_grad", (t(4, 8), t(4, 7), t(4), t(8)), {}, TILING, "dy.shape"),
    ("rmsg-rstd-shape", "rms_norm_grad", (X, X, t(4, 2), G), {}, TILING, "rstd.shape"),
    ("rmsg-rstd-prefix-skips-non-1", "rms_norm_grad", (X, X, t(2), G), {}, TILING, "rstd.shape"),
    ("rmsg-rstd-keepdim-numel", "rms_norm_grad", (X, X, t(2, 4, 2), G), {}, TILING, "rstd.shape"),
    ("rmsg-device", "rms_norm_grad", (X, X, R, t(8, device="meta")), {}, INVALID, "gamma.device"),
    # ---- rms_norm
    ("rms-null", "rms_norm", (None, G), {}, NULL, "x"),
    ("rms-dtype", "rms_norm", (t(2, 8, dtype=torch.int32), G), {}, INVALID, "x.dtype"),
    ("rms-gamma-shape", "rms_norm", (X, t(4)), {}, INVALID, "gamma.shape"),
    ("rms-eps-type", "rms_norm", (X, G, "1e-6"), {}, INVALID, "epsilon"),
    # ---- layer_norm family
    ("ln-null", "layer_norm", (LX, None, LG), {}, NULL, "gamma"),
    ("ln-dtype", "layer_norm", (t(3, 8, dtype=torch.int32), LG, LG), {}, INVALID, "x.dtype"),
    ("ln-gamma-f32-x-f64", "layer_norm", (t(3, 8, dtype=f64), LG, t(8, dtype=f64)), {}, INVALID, "gamma.dtype"),
    ("ln-gamma-dtype", "layer_norm", (LX, t(8, dtype=f16), LG), {}, INVALID, "gamma.dtype"),
    ("ln-beta-shape", "layer_norm", (LX, LG, t(9)), {}, INVALID, "beta.shape"),
    ("lng-null", "layer_norm_grad", (LX, LX, None, LSTAT, LG), {}, NULL, "variance"),
    ("lng-dy-dtype", "layer_norm_grad", (t(3, 8, dtype=f16), LX, LSTAT, LSTAT, LG), {}, INVALID, "dy.dtype"),
    ("lng-stat-dtype", "layer_norm_grad", (LX, LX, t(3, dtype=f64), LSTAT, LG), {}, INVALID, "variance.dtype"),
    ("lng-dy-shape", "layer_norm_grad", (t(3, 9), LX, LSTAT, LSTAT, LG), {}, INVALID, "dy.shape"),
    ("lng-mean-shape", "layer_norm_grad", (LX, LX, LSTAT, t(4), LG), {}, INVALID, "mean.shape"),
    ("lng-rank-9", "layer_norm_grad", (t(*[1] * 9), t(*[1] * 9), t(*[1] * 8), t(*[1] * 8), t(1)), {}, INVALID, "x.dim()"),
    ("lngb-null", "layer_norm_grad_beta", (None, LX), {}, NULL, "res_for_gamma"),
    ("lngb-dtype", "layer_norm_grad_beta", (LX, t(3, 8, dtype=f16)), {}, INVALID, "res_for_gamma.dtype"),
    ("lngb-shape", "layer_norm_grad_beta", (t(3, 7), LX), {}, INVALID, "res_for_gamma.shape"),
    ("lnb-rstd-shape", "layer_norm_backward", (LX, LX, LSTAT, t(2), LG), {}, INVALID, "rstd.shape"),
    # ---- swiglu (every refusal 161002; the dim rules before y_grad's shape, as the split defines that shape)
    ("swi-null", "swiglu", (None,), {}, NULL, "x"),
    ("swi-dtype", "swiglu", (t(2, 8, dtype=torch.int32),), {}, INVALID, "x.dtype"),
    ("swi-rank-0", "swiglu", (t(),), {}, INVALID, "x.dim()"),
    ("swi-rank-9", "swiglu", (t(*[2] * 9),), {}, INVALID, "x.dim()"),
    ("swi-dim-high", "swiglu", (t(2, 8), 2), {}, INVALID, "dim"),
    ("swi-dim-low", "swiglu", (t(2, 8), -3), {}, INVALID, "dim"),
    ("swi-dim-type", "swiglu", (t(2, 8), 1.0), {}, INVALID, "dim"),
    ("swi-dim-bool", "swiglu", (t(2, 8), True), {}, INVALID, "dim"),
    ("swi-odd", "swiglu", (t(2, 7),), {}, INVALID, "x.shape[dim]"),
    ("swi-odd-dim0", "swiglu", (t(3, 8), 0), {}, INVALID, "x.shape[dim]"),
    ("swig-null-x", "swiglu_grad", (t(2, 4), None), {}, NULL, "x"),
    ("swig-dtype-mismatch", "swiglu_grad", (t(2, 4, dtype=f16), t(2, 8)), {}, INVALID, "y_grad.dtype"),
    ("swig-shape", "swiglu_grad", (t(2, 8), t(2, 8)), {}, INVALID, "y_grad.shape"),
    ("swig-shape-dim0", "swiglu_grad", (t(2, 4), t(2, 8), 0), {}, INVALID, "y_grad.shape"),
    ("swig-odd-before-shape", "swiglu_grad", (t(2, 4), t(2, 7)), {}, INVALID, "x.shape[dim]"),
    ("swig-device", "swiglu_grad", (t(2, 4, device="meta"), t(2, 8)), {}, INVALID, "x.device"),
    # ---- hardswish
    ("hs-null", "hardswish", (None,), {}, NULL, "self"),
    ("hs-dtype", "hardswish", (t(3, dtype=torch.int32),), {}, INVALID, "self.dtype"),
    ("hs-rank-9", "hardswish", (t(*[1] * 9),), {}, INVALID, "self.dim()"),
    ("hsb-null", "hardswish_backward", (None, t(3)), {}, NULL, "grad_output"),
    ("hsb-dtype-int", "hardswish_backward", (t(3, dtype=torch.int32), t(3, dtype=torch.int32)), {}, INVALID, "self.dtype"),
    ("hsb-dtype-mismatch", "hardswish_backward", (t(3, dtype=f16), t(3)), {}, INVALID, "grad_output.dtype"),
    ("hsb-shape-no-broadcast", "hardswish_backward", (t(1, 3), t(2, 3)), {}, INVALID, "grad_output.shape"),
    ("hsb-rank-9", "hardswish_backward", (t(*[1] * 9), t(*[1] * 9)), {}, INVALID, "grad_output.dim()"),
    # ---- embedding_dense_backward
    ("emb-null-grad", "embedding_dense_backward", (None, i32(1), 4), {}, NULL, "grad"),
    ("emb-null-indices", "embedding_dense_backward", (t(1, 3), None, 4), {}, NULL, "indices"),
    ("emb-grad-dtype", "embedding_dense_backward", (t(2, 3, dtype=torch.int32), i32(0, 1), 4), {}, INVALID, "grad.dtype"),
    ("emb-index-dtype", "embedding_dense_backward", (t(2, 3), torch.zeros(2, dtype=torch.complex64), 4), {}, INVALID, "indices.dtype"),
    ("emb-grad-1d", "embedding_dense_backward", (t(3), i32(0), 4), {}, INVALID, "grad.dim()"),
    ("emb-grad-rank-9", "embedding_dense_backward", (t(*[1] * 8, 3), i32(0), 4), {}, INVALID, "grad.dim()"),
    ("emb-indices-rank-9", "embedding_dense_backward", (t(1, 3), torch.zeros([1] * 9, dtype=torch.int64), 4), {}, INVALID, "indices.dim()"),
    ("emb-numel-mismatch", "embedding_dense_backward", (t(3, 2), i32(0, 1), 4), {}, INVALID, "grad.shape"),
    ("emb-index-too-big", "embedding_dense_backward", (t(2, 3), i32(1, 4), 4), {}, INVALID, "indices"),
    ("emb-index-negative", "embedding_dense_backward", (t(2, 3), i32(-1, 0), 4), {}, INVALID, "indices"),
    ("emb-index-float-beyond", "embedding_dense_backward", (t(2, 3), torch.tensor([0.5, 4.0]), 4), {}, INVALID, "indices"),
    ("emb-index-float-below", "embedding_dense_backward", (t(2, 3), torch.tensor([0.5, -1.0]), 4), {}, INVALID, "indices"),
    ("emb-index-nan", "embedding_dense_backward", (t(2, 3), torch.tensor([0.0, float("nan")]), 4), {}, INVALID, "indices"),
    ("emb-index-inf", "embedding_dense_backward", (t(2, 3), torch.tensor([float("inf"), 0.0]), 4), {}, INVALID, "indices"),
    ("emb-bool-empty-table", "embedding_dense_backward", (t(1, 3), torch.tensor([True]), 1), {}, INVALID, "indices"),
    ("emb-num-weights-negative", "embedding_dense_backward", (t(1, 3), i32(0), -1), {}, INVALID, "num_weights"),
    ("emb-num-weights-float", "embedding_dense_backward", (t(1, 3), i32(0), 4.0), {}, INVALID, "num_weights"),
    ("emb-num-weights-beyond-int64", "embedding_dense_backward", (t(1, 3), i32(0), 2**64), {}, INVALID, "num_weights"),
    ("emb-padding-type", "embedding_dense_backward", (t(1, 3), i32(0), 4, None), {}, INVALID, "padding_idx"),
    ("emb-scale-type", "embedding_dense_backward", (t(1, 3), i32(0), 4, -1, 1), {}, INVALID, "scale_grad_by_freq"),
    # ---- embedding (the lookup whose backward is embedding_dense_backward)
    ("embf-null", "embedding", (None, i32(0)), {}, NULL, "weight"),
    ("embf-weight-dtype", "embedding", (t(4, 3, dtype=torch.int32), i32(0)), {}, INVALID, "weight.dtype"),
    ("embf-weight-rank", "embedding", (t(4), i32(0)), {}, INVALID, "weight.dim()"),
    ("embf-indices-rank-8", "embedding", (t(4, 3), torch.zeros([1] * 8, dtype=torch.int64)), {}, INVALID, "indices.dim()"),
    ("embf-index-too-big", "embedding", (t(4, 3), i32(0, 4)), {}, INVALID, "indices"),
    ("embf-padding-type", "embedding", (t(4, 3), i32(0), 1.5), {}, INVALID, "padding_idx"),
    # ---- moe_token_permute
    ("moe-null", "moe_token_permute", (t(4, 3), None), {}, NULL, "indices"),
    ("moe-token-dtype", "moe_token_permute", (t(4, 3, dtype=torch.int32), i32(0, 1, 2, 3)), {}, INVALID, "tokens.dtype"),
    ("moe-index-dtype", "moe_token_permute", (t(4, 3), t(4)), {}, INVALID, "indices.dtype"),
    ("moe-token-rank", "moe_token_permute", (t(4, 3, 1), i32(0, 1, 2, 3)), {}, INVALID, "tokens.dim()"),
    ("moe-index-rank", "moe_token_permute", (t(4, 3), torch.zeros(4, 1, 1, dtype=torch.int32)), {}, INVALID, "indices.dim()"),
    ("moe-index-rows", "moe_token_permute", (t(4, 3), i32(0, 1, 2)), {}, INVALID, "indices.shape"),
    ("moe-topk-513", "moe_token_permute", (t(1, 3), torch.zeros(1, 513, dtype=torch.int32)), {}, INVALID, "indices.shape[1]"),
    ("moe-topk-0", "moe_token_permute", (t(1, 3), torch.zeros(1, 0, dtype=torch.int32)), {}, INVALID, "indices.shape[1]"),
    ("moe-padded", "moe_token_permute", (t(4, 3), i32(0, 1, 2, 3)), {"padded_mode": True}, INVALID, "padded_mode"),
    ("moe-num-out-beyond-int64", "moe_token_permute", (t(4, 3), i32(0, 1, 2, 3)), {"num_out_tokens": -(2**63) - 1}, INVALID, "num_out_tokens"),
    ("moe-num-out-type", "moe_token_permute", (t(4, 3), i32(0, 1, 2, 3)), {"num_out_tokens": 2.0}, INVALID, "num_out_tokens"),
    # issue 36.5: a negative expert id sorted before expert 0 (CANN: ids >= 0)
    ("moe-negative-id", "moe_token_permute", (t(4, 3), i32(0, 1, -1, 3)), {}, INVALID, "indices"),
    # ---- moe_token_permute_grad
    ("moeg-null", "moe_token_permute_grad", (None, i32(0, 1), 2), {}, NULL, "permuted_output_grad"),
    ("moeg-grad-dtype", "moe_token_permute_grad", (t(2, 3, dtype=torch.int32), i32(0, 1), 2), {}, INVALID, "permuted_output_grad.dtype"),
    ("moeg-index-dtype", "moe_token_permute_grad", (t(2, 3), t(2), 2), {}, INVALID, "sorted_indices.dtype"),
    ("moeg-topk-0", "moe_token_permute_grad", (t(2, 3), i32(0, 1), 0), {}, INVALID, "num_topk"),
    ("moeg-topk-513", "moe_token_permute_grad", (t(2, 3), i32(0, 1), 513), {}, INVALID, "num_topk"),
    ("moeg-topk-type", "moe_token_permute_grad", (t(2, 3), i32(0, 1), 2.0), {}, INVALID, "num_topk"),
    ("moeg-padded", "moe_token_permute_grad", (t(2, 3), i32(0, 1), 2, True), {}, INVALID, "padded_mode"),
    ("moeg-grad-rank", "moe_token_permute_grad", (t(2, 3, 1), i32(0, 1), 2), {}, INVALID, "permuted_output_grad.dim()"),
    ("moeg-index-rank", "moe_token_permute_grad", (t(2, 3), torch.zeros(1, 2, dtype=torch.int32), 2), {}, INVALID, "sorted_indices.dim()"),
    ("moeg-not-multiple-of-k", "moe_token_permute_grad", (t(3, 3), i32(0, 1, 2), 2), {}, INVALID, "sorted_indices.shape"),
    ("moeg-too-many-rows", "moe_token_permute_grad", (t(5, 3), i32(0, 1, 2, 3), 2), {}, INVALID, "permuted_output_grad.shape"),
    ("moeg-index-too-big", "moe_token_permute_grad", (t(4, 3), i32(0, 1, 2, 4), 2), {}, INVALID, "sorted_indices"),
    ("moeg-index-negative", "moe_token_permute_grad", (t(4, 3), i32(0, -1, 2, 3), 2), {}, INVALID, "sorted_indices"),
    # issue 36.4: not a permutation; every token got row 0's sum
    ("moeg-not-permutation", "moe_token_permute_grad", (t(4, 3), i32(0, 0, 0, 0), 2), {}, INVALID, "sorted_indices"),
    ("moeg-repeated", "moe_token_permute_grad", (t(4, 3), i32(3, 1, 2, 1), 2), {}, INVALID, "sorted_indices"),
    # ---- moe_token_unpermute (issue 16.4: each of these was accepted or answered with AttributeError)
    ("unp-null-tokens", "moe_token_unpermute", (None, i32(0, 1)), {}, NULL, "permuted_tokens"),
    ("unp-null-indices", "moe_token_unpermute", (t(2, 3), None), {}, NULL, "sorted_indices"),
    ("unp-probs-type", "moe_token_unpermute", (t(2, 3), i32(0, 1), 4), {}, INVALID, "probs"),
    ("unp-tokens-1d", "moe_token_unpermute", (t(4), i32(0, 1, 2, 3)), {}, INVALID, "permuted_tokens.dim()"),
    ("unp-tokens-int", "moe_token_unpermute", (t(4, 3, dtype=torch.int32), i32(0, 1, 2, 3)), {}, INVALID,
     "permuted_tokens.dtype"),
    ("unp-probs-int", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 3), t(2, 2, dtype=torch.int32)), {}, INVALID,
     "probs.dtype"),
    ("unp-index-float", "moe_token_unpermute", (t(4, 3), t(4)), {}, INVALID, "sorted_indices.dtype"),
    ("unp-probs-1d", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 3), t(4)), {}, INVALID, "probs.dim()"),
    ("unp-probs-count", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 3), t(4, 3)), {}, INVALID, "probs"),
    ("unp-topk-513", "moe_token_unpermute", (t(4, 3), torch.arange(513, dtype=torch.int32), t(1, 513)), {},
     INVALID, "probs"),
    ("unp-too-many-rows", "moe_token_unpermute", (t(5, 3), i32(0, 1, 2, 3)), {}, INVALID, "permuted_tokens.shape"),
    ("unp-padded", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 3), None, True), {}, INVALID, "padded_mode"),
    ("unp-restore-shape", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 3)), {"restore_shape": "ab"}, INVALID,
     "restore_shape"),
    ("unp-outside", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 4)), {}, INVALID, "sorted_indices"),
    ("unp-repeated", "moe_token_unpermute", (t(4, 3), i32(0, 1, 1, 3)), {}, INVALID, "sorted_indices"),
    ("unp-out-shape", "moe_token_unpermute", (t(4, 3), i32(0, 1, 2, 3), t(2, 2)), {"out": t(4, 3)}, INVALID,
     "out.shape"),
    # ---- moe_token_unpermute_grad
    ("unpg-null-grad", "moe_token_unpermute_grad", (t(4, 3), None, i32(0, 1, 2, 3)), {}, NULL, "grad_unpermuted"),
    ("unpg-grad-t1", "moe_token_unpermute_grad", (t(4, 3), t(2, 1), i32(0, 1, 2, 3), t(2, 2)), {}, INVALID,
     "grad_unpermuted.shape"),
    ("unpg-grad-1d", "moe_token_unpermute_grad", (t(4, 3), t(3), i32(0, 1, 2, 3), t(2, 2)), {}, INVALID,
     "grad_unpermuted.dim()"),
    ("unpg-grad-int", "moe_token_unpermute_grad", (t(4, 3), t(2, 3, dtype=torch.int32), i32(0, 1, 2, 3), t(2, 2)), {},
     INVALID, "grad_unpermuted.dtype"),
    ("unpg-probs-transposed", "moe_token_unpermute_grad", (t(8, 3), t(4, 3), torch.arange(8, dtype=torch.int32),
                                                           t(2, 4)), {}, INVALID, "probs"),
    ("unpg-repeated", "moe_token_unpermute_grad", (t(4, 3), t(2, 3), i32(0, 0, 2, 3), t(2, 2)), {}, INVALID,
     "sorted_indices"),
    ("unpg-out-probs", "moe_token_unpermute_grad", (t(4, 3), t(2, 3), i32(0, 1, 2, 3), t(2, 2)),
     {"out": (t(4, 3), t(2, 3))}, INVALID, "out[1].shape"),
    ("unpg-out-no-probs", "moe_token_unpermute_grad", (t(4, 3), t(4, 3), i32(0, 1, 2, 3)),
     {"out": (t(4, 3), t(2))}, INVALID, "out[1].shape"),
    # ---- the routing-map ops (docs/semantics.md §5b): shapes, dtypes, nulls, and values read before any kernel
    ("rmp-null-map", "moe_token_permute_with_routing_map", (t(4, 3), None), {}, NULL, "routing_map"),
    ("rmp-map-float", "moe_token_permute_with_routing_map", (t(4, 3), t(4, 2)), {}, INVALID, "routing_map.dtype"),
    ("rmp-map-rows", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(3, 2, dtype=torch.bool)), {},
     INVALID, "routing_map.shape"),
    ("rmp-probs-shape", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(4, 2, dtype=torch.bool), t(4, 3)),
     {}, INVALID, "probs.shape"),
    ("rmp-negative-out", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(4, 2, dtype=torch.bool)),
     {"num_out_tokens": -1}, INVALID, "num_out_tokens"),
    ("rmp-out-past-te", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(4, 2, dtype=torch.bool)),
     {"num_out_tokens": 9}, INVALID, "num_out_tokens"),
    ("rmp-capacity-0", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(4, 2, dtype=torch.bool)),
     {"num_out_tokens": 1, "drop_and_pad": True}, INVALID, "num_out_tokens"),
    ("rmp-row-over-k", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(4, 2, dtype=torch.bool)),
     {"num_out_tokens": 4}, INVALID, "routing_map"),
    ("rmp-drop-flag", "moe_token_permute_with_routing_map", (t(4, 3), torch.ones(4, 2, dtype=torch.bool)),
     {"drop_and_pad": 1}, INVALID, "drop_and_pad"),
    ("rmpg-probs-no-map", "moe_token_permute_with_routing_map_grad", (t(4, 3), t(4), i32(0, 1, 2, 3), None, 2, 2),
     {}, NULL, "routing_map"),
    ("rmpg-indices-range", "moe_token_permute_with_routing_map_grad", (t(4, 3), None, i32(0, 1, 2, 9), None, 2, 2),
     {}, INVALID, "sorted_indices"),
    ("rmpg-indices-repeated", "moe_token_permute_with_routing_map_grad", (t(4, 3), None, i32(0, 1, 1, 3), None, 2,
                                                                          2), {}, INVALID, "sorted_indices"),
    ("rmpg-drop-token-range", "moe_token_permute_with_routing_map_grad", (t(4, 3), None, i32(0, 1, 2, 5), None, 2,
                                                                          3, True), {}, INVALID, "sorted_indices"),
    ("rmpg-num-tokens", "moe_token_permute_with_routing_map_grad", (t(4, 3), None, i32(0, 1, 2, 3), None, 2, 3),
     {}, INVALID, "sorted_indices.shape"),
    ("rmu-restore-h", "moe_token_unpermute_with_routing_map", (t(4, 3), i32(0, 1, 2, 3), [2, 4]), {}, INVALID,
     "restore_shape"),
    ("rmu-probs-no-map", "moe_token_unpermute_with_routing_map", (t(4, 3), i32(0, 1, 2, 3), [2, 3], t(2, 2)), {},
     NULL, "routing_map"),
    ("rmu-indices-int16", "moe_token_unpermute_with_routing_map", (t(4, 3), i32(0, 1, 2, 3).short(), [2, 3]), {},
     INVALID, "sorted_indices.dtype"),
    ("rmug-grad-width", "moe_token_unpermute_with_routing_map_grad", (t(4, 3), t(2, 4), i32(0, 1, 2, 3)), {},
     INVALID, "grad_unpermuted.shape"),
    ("rmug-out-shape", "moe_token_unpermute_with_routing_map_grad", (t(4, 3), t(2, 3), i32(0, 1, 2, 3)),
     {"out": (t(4, 4), t(0))}, INVALID, "out[0].shape"),
    # ---- issue 15.3: inputs that used to reach torch or Python internals (RuntimeError, NotImplementedError,
    # OverflowError) before any check named them
    ("sparse-x", "rms_norm", (LX.to_sparse(), LG), {}, INVALID, "x.layout"),
    ("sparse-grad-output", "hardswish_backward", (LX.to_sparse(), LX), {}, INVALID, "grad_output.layout"),
    ("sparse-self", "hardswish", (LX.to_sparse(),), {}, INVALID, "self.layout"),
    ("sparse-indices", "embedding_dense_backward", (t(4, 3), torch.tensor([1, 2, 3, 0]).to_sparse(), 5), {},
     INVALID, "indices.layout"),
    ("csr-gamma", "layer_norm", (LX, t(2, 4).to_sparse_csr(), LG, 1e-5), {}, INVALID, "gamma.layout"),
    ("rms-eps-overflow", "rms_norm", (LX, LG, 10**400), {}, INVALID, "epsilon"),
    ("ln-eps-overflow", "layer_norm", (LX, LG, LG, -(10**400)), {}, INVALID, "epsilon"),
    ("lng-eps-overflow", "layer_norm_grad", (LX, LX, t(3, 1), t(3, 1), LG, 10**400), {}, INVALID, "epsilon"),
    ("out-expanded", "hardswish", (LX,), {"out": t(8).expand(3, 8)}, INVALID, "out"),
    ("out-interleaved", "hardswish_backward", (LX, LX), {"out": torch.empty(40).as_strided((3, 8), (1, 1))},
     INVALID, "out"),
    ("out-tuple-expanded", "rms_norm", (LX, LG), {"out": (t(8).expand(3, 8), t(3, 1))}, INVALID, "out[0]"),
]


@pytest.mark.parametrize("op,args,kwargs,status,arg", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_refused_with_cann_status(op, args, kwargs, status, arg, backend):
    with pytest.raises(gradops.OpError) as info:
        getattr(gradops, op)(*args, **kwargs)
    err = info.value
    assert err.status == status, str(err)
    assert err.arg == arg, str(err)
    assert arg in str(err) and "must be" in str(err) and "got" in str(err)
    assert isinstance(err, ValueError)


def test_error_survives_pickling():
    import pickle

    err = gradops.OpError(INVALID, "op", "x", "a tensor", "None")
    back = pickle.loads(pickle.dumps(err))
    assert (back.status, back.arg, str(back)) == (err.status, err.arg, str(err))


def test_every_op_has_error_cases():
    from gradops.registry import NAMES

    assert {c[1] for c in CASES} == {"embedding", *NAMES}


def test_nothing_written_when_a_later_out_is_refused(backend):
    """The out= tensors are all checked before any kernel runs: out[0] keeps its values when out[1] is refused."""
    y = torch.full((3, 8), 7.0)
    with pytest.raises(gradops.OpError):
        gradops.rms_norm(LX + 1, LG + 1, out=(y, t(1).expand(3, 1)))
    assert bool((y == 7.0).all())


def test_zero_epsilon_on_empty_rows_is_inf_not_an_exception(backend):
    """rms_norm of rows with no columns and epsilon 0: rstd = rsqrt(0 + 0) = inf on every backend (the CPU
    backend raised ZeroDivisionError)."""
    y, rstd = gradops.rms_norm(t(4, 0), t(0), 0)
    assert y.shape == (4, 0) and bool(torch.isinf(rstd).all())
    mean_var = gradops.layer_norm(t(4, 0), t(0), t(0), 0)
    assert mean_var[0].shape == (4, 0)


def test_rows_without_columns_give_empty_gradients(backend):
    """H = 0 is defined on every backend: empty pd_x / dx / res_for_gamma, empty dgamma / dbeta, and the
    statistics still checked (the reference divided by H; the CPU backend failed to compile a (M, 1) variance)."""
    z = t(4, 0)
    pd_x, res = gradops.layer_norm_grad(z, z, t(4, 1) + 1, t(4, 1), t(0), 1e-5)
    assert pd_x.shape == res.shape == (4, 0)
    dx, dgamma, dbeta = gradops.layer_norm_backward(z, z, t(4), t(4) + 1, t(0))
    assert dx.shape == (4, 0) and dgamma.shape == dbeta.shape == (0,)
    dx, dgamma = gradops.rms_norm_grad(z, z, t(4) + 1, t(0))
    assert dx.shape == (4, 0) and dgamma.shape == (0,)
    with pytest.raises(gradops.OpError, match="variance"):
        gradops.layer_norm_grad(z, z, t(4, 1) - 1, t(4, 1), t(0), 1e-5)
    y, rstd = gradops.rms_norm(z, t(0), -1.0)  # rsqrt(0 - 1) = NaN, as the formula says; no exception
    assert y.shape == (4, 0) and bool(rstd.isnan().all())


@pytest.mark.parametrize("x_shape,stat_shape", [((0,), ()), ((3, 0), (3, 1)), ((2, 3, 0), (2, 3, 1)),
                                                  ((3, 0), (3,))], ids=["0d", "keepdim", "3d-keepdim", "flat"])
def test_layer_norm_backward_without_columns_takes_every_statistic_shape(backend, x_shape, stat_shape):
    """H = 0 with the statistic shapes the contract takes (``x.shape[:-1]``, 0-d for a 1-D x, or its keepdim
    form): empty dx, empty dgamma / dbeta, and a negative rstd still refused (issue 36.13: the CPU backend raised
    a TypingError of its compiler for 0-d and (M, 1) statistics; the torch backend answered these)."""
    x, gamma = t(*x_shape), t(0)
    dx, dgamma, dbeta = gradops.layer_norm_backward(x, x, t(*stat_shape), t(*stat_shape) + 1, gamma)
    assert dx.shape == x_shape and dgamma.shape == dbeta.shape == (0,)
    with pytest.raises(gradops.OpError) as info:
        gradops.layer_norm_backward(x, x, t(*stat_shape), t(*stat_shape) - 1, gamma)
    assert info.value.status == INVALID and info.value.arg == "rstd"
    pd_x, res = gradops.layer_norm_grad(x, x, t(*stat_shape) + 1, t(*stat_shape), gamma, 1e-5)
    assert pd_x.shape == res.shape == x_shape


@pytest.mark.parametrize("model,given", [("model", "a str"), (None, "a NoneType"),
                                         (torch.nn.LayerNorm, "the class LayerNorm")], ids=["str", "none", "class"])
def test_patch_names_what_it_takes(model, given):
    """issue 36.14: ``gradops.patch("model")`` raised AttributeError from inside the walker."""
    with pytest.raises(TypeError, match=rf"gradops\.patch: model must be a torch\.nn\.Module instance .*got {given}$"):
        gradops.patch(model)


@pytest.mark.parametrize("swaps", [[torch.nn.LayerNorm], {"LayerNorm": gradops.nn.LayerNorm}], ids=["list", "str-key"])
def test_patch_names_a_bad_swap_table(swaps):
    with pytest.raises(TypeError, match=r"gradops\.patch: swaps must"):
        gradops.patch(torch.nn.Sequential(torch.nn.LayerNorm(4)), swaps)


def test_scratch_is_sized_by_the_work_not_the_table(backend):
    """E = 0 with V = 2^31 + 1: the result is the empty (V, 0) table; no 16·V bytes of scratch are asked for."""
    out = gradops.embedding_dense_backward(t(3, 0), torch.tensor([0, 5, 2 ** 31]), 2 ** 31 + 1, -1, True)
    assert out.shape == (2 ** 31 + 1, 0)


def test_a_table_no_memory_can_hold_is_an_op_error(backend):
    """num_weights alone sizes the result (V rows whatever the work): 2^40 rows x 4 float32 = 16 TiB cannot be
    allocated, and the failure is an OpError naming num_weights and the size (was a bare MemoryError)."""
    with pytest.raises(gradops.OpError, match=r"num_weights .*16\.0 TiB") as info:
        gradops.embedding_dense_backward(t(0, 4), torch.zeros(0, dtype=torch.long), 2 ** 40, -1, False)
    assert info.value.status == gradops.status.ACLNN_ERR_INNER_NULLPTR


def test_interleaved_but_disjoint_out_is_accepted():
    """The overlap test is exact: strides (3, 2) over (2, 3) reach offsets 0 2 4 3 5 7, all distinct."""
    from gradops.contract._common import overlaps_itself

    disjoint = torch.empty(8).as_strided((2, 3), (3, 2))
    assert not overlaps_itself(disjoint)
    assert overlaps_itself(torch.empty(8).as_strided((2, 3), (2, 1)))  # offsets 0 1 2 2 3 4
    assert not overlaps_itself(torch.empty(3, 4).t())
