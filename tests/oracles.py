"""Float64 oracles, written from CANN's documented formulas independently of gradops' code, and the comparison
every correctness test uses.

Tolerance (derived, per output): a backend computes in float32 and rounds once to the output dtype, and the
oracle sees exactly the same (already rounded) inputs. So the error is at most one ulp of the output dtype at
the value (rounding the float32 result) plus float32 accumulation error, which for a length-n reduction of
random-signed terms grows like sqrt(n) unit roundoffs; we allow 8 sqrt(n) u32. Measured norm-wise, against
the largest reference value of the tensor::

    max|got - ref| <= (eps(out dtype) + 8 * sqrt(n) * u32) * max|ref|

Non-finite reference values must be matched exactly; integer outputs must be equal.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

F64 = torch.float64
U32 = torch.finfo(torch.float32).eps / 2


def _rms_norm(x, gamma, epsilon=1e-6):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    X = x.to(F64)
    # a row of no elements has mean(x^2) = 0 (gradops' documented rule; torch's mean of nothing is NaN)
    rstd = 1.0 / torch.sqrt((X * X).sum(dim=dims, keepdim=True) / max(gamma.numel(), 1) + epsilon)
    return (X * rstd * gamma.to(F64), rstd), (gamma.numel(), gamma.numel())


def _rms_norm_grad(dy, x, rstd, gamma):
    d = gamma.numel()
    r = x.numel() // d if d else math.prod(x.shape[: x.dim() - gamma.dim()])
    X, DY = x.to(F64).reshape(r, d), dy.to(F64).reshape(r, d)
    R, G = rstd.to(F64).reshape(r, 1), gamma.to(F64).reshape(1, d)
    mean_term = (DY * G * X * R).sum(dim=1, keepdim=True) / d
    dx = (DY * G - X * R * mean_term) * R
    dgamma = (DY * X * R).sum(dim=0)
    return (dx.reshape(x.shape), dgamma.reshape(gamma.shape)), (d, r)


def _layer_norm(x, gamma, beta, epsilon=1e-5):
    X = x.to(F64)
    n = x.shape[-1]
    mean = X.sum(-1) / n
    var = ((X - mean[..., None]) ** 2).sum(-1) / n
    y = (X - mean[..., None]) / torch.sqrt(var[..., None] + epsilon) * gamma.to(F64) + beta.to(F64)
    return (y, mean, var), (n, n, n)


def _ascendc_pdx(dy, x, mean, rstd, gamma):
    """AscendC LayerNormGrad, term by term, in float64 (rstd = (variance + EPSILON)^-0.5, per row)."""
    n = x.shape[-1]
    X, DY = x.to(F64), dy.to(F64)
    mu = mean.to(F64).reshape(*x.shape[:-1], 1)
    rs = rstd.reshape(*x.shape[:-1], 1)
    pd_xl = DY * gamma.to(F64)
    pd_var = torch.sum(-0.5 * pd_xl * (X - mu) * rs ** 3, dim=-1, keepdim=True)
    pd_mean = (torch.sum(-pd_xl * rs, dim=-1, keepdim=True)
               + pd_var * (1.0 / n) * torch.sum(-2.0 * (X - mu), dim=-1, keepdim=True))
    pd_x = pd_xl * rs + pd_var * (2.0 / n) * (X - mu) + pd_mean * (1.0 / n)
    return pd_x, (X - mu) * rs


def _layer_norm_grad(dy, x, variance, mean, gamma, epsilon=1e-5):
    rstd = (variance.to(F64) + epsilon) ** -0.5
    pd_x, res = _ascendc_pdx(dy, x, mean, rstd, gamma)
    return (pd_x, res), (x.shape[-1], 1)


def _layer_norm_grad_beta(res_for_gamma, dy):
    n = dy.shape[-1]
    DY, RES = dy.to(F64).reshape(-1, n), res_for_gamma.to(F64).reshape(-1, n)
    return ((DY * RES).sum(0), DY.sum(0)), (DY.shape[0], DY.shape[0])


def _layer_norm_backward(dy, x, mean, rstd, gamma):
    """aclnnLayerNormBackward, whose golden is ATen's native_layer_norm_backward: with g = dy * gamma and
    xhat = (x - mean) * rstd, ``dx = rstd * (g - mean_H(g) - xhat * mean_H(g * xhat))`` (issue 17: no AscendC
    sum(x - mean) term, which matters only when mean is not the row's mean)."""
    n = x.shape[-1]
    rows = (*x.shape[:-1], 1)
    g = dy.to(F64) * gamma.to(F64)
    rs = rstd.to(F64).reshape(rows)
    xhat = (x.to(F64) - mean.to(F64).reshape(rows)) * rs
    dx = rs * (g - g.sum(-1, keepdim=True) / max(n, 1) - xhat * (g * xhat).sum(-1, keepdim=True) / max(n, 1))
    (dg, db), lengths = _layer_norm_grad_beta(xhat, dy)
    return (dx, dg, db), (n, *lengths)


def _hardswish(x):
    X = x.to(F64)
    return (X * torch.clamp(X + 3, 0, 6) / 6,), (1,)


def _hardswish_backward(grad_output, x):
    X, G = x.to(F64), grad_output.to(F64)
    slope = torch.where(X < -3, 0.0, torch.where(X <= 3, X / 3 + 0.5, 1.0))
    slope = torch.where(torch.isnan(X), 1.0, slope)  # gradops' documented NaN rule: grad passes through
    # Below -3 the gradient is selected, not multiplied: 0 even where the incoming gradient is NaN or inf (CANN's
    # select and PyTorch's ``x < -3 ? 0 : ...`` alike).
    return (torch.where(X < -3, 0.0, G * slope),), (1,)


def _embedding_dense_backward(grad, indices, num_weights, padding_idx=-1, scale_grad_by_freq=False):
    flat = indices.reshape(-1)
    idx = flat.to(F64).trunc().long() if flat.is_floating_point() else flat.long()
    e = grad.shape[-1]
    G = grad.to(F64).reshape(idx.numel(), e)
    onehot = (idx[:, None] == torch.arange(num_weights, device=idx.device)[None, :]).to(F64)  # (N, V)
    weight = torch.ones(idx.numel(), dtype=F64, device=idx.device)
    if scale_grad_by_freq:
        weight = 1.0 / onehot.sum(0)[idx]
    weight = torch.where(idx == padding_idx, 0.0, weight)
    out = onehot.t() @ (G * weight[:, None])
    return (out,), (max(idx.numel(), 1),)


def _stable_order(flat: list[int]) -> list[int]:
    return sorted(range(len(flat)), key=lambda i: (flat[i], i))


def _moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    k = indices.shape[1] if indices.dim() == 2 else 1
    order = _stable_order(indices.reshape(-1).tolist())
    inverse = [0] * len(order)
    for dest, src in enumerate(order):
        inverse[src] = dest
    kept = range(len(order))[:num_out_tokens] if num_out_tokens else range(len(order))
    rows = [order[j] // k for j in kept]
    permuted = tokens.to(F64)[torch.tensor(rows, dtype=torch.long, device=tokens.device)]
    return (permuted, torch.tensor(inverse, dtype=torch.int64, device=tokens.device)), (1, 0)


def _moe_token_permute_grad(grad, sorted_indices, num_topk, padded_mode=False):
    rows, h = grad.shape
    t = sorted_indices.numel() // num_topk
    G = grad.to(F64)
    out = torch.zeros(t, h, dtype=F64, device=grad.device)
    src = sorted_indices.long().reshape(t, num_topk)
    for k in range(num_topk):
        col = src[:, k]
        present = col < rows
        out[present] += G[col[present]]
    return (out,), (num_topk,)


def _unpermute_parts(permuted, sorted_indices, probs):
    rows = permuted.shape[0]
    k = 1 if probs is None else probs.shape[1]
    t = sorted_indices.numel() // k
    weights = torch.ones(t, k, dtype=F64) if probs is None else probs.to(F64).cpu()
    return rows, k, t, sorted_indices.long().cpu().tolist(), weights


def _moe_token_unpermute(permuted, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """``out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]``; a row >= A (dropped) adds nothing."""
    rows, k, t, src, weights = _unpermute_parts(permuted, sorted_indices, probs)
    X = permuted.to(F64).cpu()
    out = torch.zeros(t, permuted.shape[1], dtype=F64)
    for i, r in enumerate(src):
        if r < rows:
            out[i // k] += weights[i // k, i % k] * X[r]
    return (out.to(permuted.device),), (k,)


def _moe_token_unpermute_grad(permuted, grad, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """``d_permuted[s[i]] = grad[i // K] * probs.flat[i]``, ``d_probs[t, k] = grad[t] . permuted[s[t*K + k]]``."""
    rows, k, t, src, weights = _unpermute_parts(permuted, sorted_indices, probs)
    X, G = permuted.to(F64).cpu(), grad.to(F64).cpu()
    d_permuted = torch.zeros(rows, permuted.shape[1], dtype=F64)
    d_probs = torch.zeros(t, k, dtype=F64)
    for i, r in enumerate(src):
        if r < rows:
            d_permuted[r] = G[i // k] * weights[i // k, i % k]
            d_probs[i // k, i % k] = (G[i // k] * X[r]).sum()
    if probs is None:
        d_probs = torch.empty(0, dtype=F64)
    return (d_permuted.to(permuted.device), d_probs.to(permuted.device)), (1, permuted.shape[1])


# ---------------------------------------------------------------- routing-map MoE (docs/semantics.md §5b)
def _routing_rows(routing_map, num_out_tokens, drop_and_pad):
    """From the map alone, by loops: per permuted row its (token, expert), the per-token slot rows (non-drop: each
    token's routed experts ascending, -1 padded to K; drop: each expert's first C of its routed tokens, then of
    the others, ascending), K or C, and the number of output rows."""
    mask = (routing_map != 0).cpu().tolist()
    t = len(mask)
    e = routing_map.shape[1]
    n = t if num_out_tokens is None else num_out_tokens
    if drop_and_pad:
        c = n // e
        rows = []
        for ex in range(e):
            chosen = [tok for tok in range(t) if mask[tok][ex]] + [tok for tok in range(t) if not mask[tok][ex]]
            rows += [(tok, ex) for tok in chosen[:c]]
        return rows, None, c, c * e
    k = n // t if t else 0
    rows = [(tok, ex) for ex in range(e) for tok in range(t) if mask[tok][ex]]
    where = {pair: i for i, pair in enumerate(rows)}
    slots = [[where[(tok, ex)] for ex in range(e) if mask[tok][ex]] for tok in range(t)]
    slots = [row + [-1] * (k - len(row)) for row in slots]
    return rows, slots, k, k * t


def _moe_token_permute_with_routing_map(tokens, routing_map, probs=None, num_out_tokens=None, drop_and_pad=False):
    rows, slots, _, out_rows = _routing_rows(routing_map, num_out_tokens, drop_and_pad)
    dev = tokens.device
    permuted = torch.zeros(out_rows, tokens.shape[1], dtype=F64, device=dev)
    pp = torch.zeros(0 if probs is None else out_rows, dtype=F64, device=dev)  # without probs: the placeholder
    for r, (tok, ex) in enumerate(rows):
        permuted[r] = tokens[tok].to(F64)
        if probs is not None:
            pp[r] = float(probs[tok, ex])
    si = [tok for tok, _ in rows] if drop_and_pad else [r for row in slots for r in row]
    return (permuted, pp, torch.tensor(si, dtype=torch.int64, device=dev)), (1, 1, 0)


def _slot_pairs(sorted_indices, routing_map, num_experts, num_tokens, rows, drop_and_pad):
    """Each (token, expert or None, row) the sorted indices name: with drop_and_pad row r holds token s[r] of
    expert r // C; without, slot k of token t names row s[t*K + k] (-1: none) of the token's k-th routed expert."""
    s = sorted_indices.long().cpu().tolist()
    if drop_and_pad:
        c = rows // num_experts if num_experts else 0
        return [(tok, r // c if c else None, r) for r, tok in enumerate(s)], 1
    k = len(s) // num_tokens if num_tokens else 0
    mask = None if routing_map is None else (routing_map != 0).cpu().tolist()
    out = []
    for tok in range(num_tokens):
        experts = [ex for ex in range(num_experts) if mask[tok][ex]] if mask is not None else []
        for j in range(k):
            if s[tok * k + j] >= 0:
                out.append((tok, experts[j] if j < len(experts) else None, s[tok * k + j]))
    return out, k


def _moe_token_permute_with_routing_map_grad(grad, grad_probs, sorted_indices, routing_map, num_experts, num_tokens,
                                             drop_and_pad=False):
    rows, h = grad.shape
    pairs, _ = _slot_pairs(sorted_indices, routing_map, num_experts, num_tokens, rows, drop_and_pad)
    G = grad.to(F64).cpu()
    dtokens = torch.zeros(num_tokens, h, dtype=F64)
    dprobs = None if grad_probs is None else torch.zeros(num_tokens, num_experts, dtype=F64)
    most = 0
    for tok, ex, r in pairs:
        dtokens[tok] += G[r]
        if dprobs is not None and ex is not None:
            dprobs[tok, ex] = float(grad_probs[r])
    for tok in range(num_tokens):
        most = max(most, sum(1 for p in pairs if p[0] == tok))
    dev = grad.device
    return (dtokens.to(dev), torch.zeros(0, dtype=F64, device=dev) if dprobs is None else dprobs.to(dev)), \
        (max(most, 1), 1)


def _moe_token_unpermute_with_routing_map(permuted, sorted_indices, restore_shape, probs=None, routing_map=None,
                                          drop_and_pad=False):
    t, h = restore_shape
    known = probs if probs is not None else routing_map
    experts = known.shape[1] if known is not None else 0
    pairs, _ = _slot_pairs(sorted_indices, routing_map, experts, t, permuted.shape[0], drop_and_pad)
    X = permuted.to(F64).cpu()
    out = torch.zeros(t, h, dtype=F64)
    counts = [0] * t
    for tok, ex, r in pairs:
        w = 1.0 if probs is None else float(probs[tok, ex])
        out[tok] += w * X[r]
        counts[tok] += 1
    return (out.to(permuted.device),), (max([1, *counts]),)


def _moe_token_unpermute_with_routing_map_grad(permuted, grad, sorted_indices, probs=None, routing_map=None,
                                               drop_and_pad=False):
    rows, h = permuted.shape
    t = grad.shape[0]
    experts = probs.shape[1] if probs is not None else (routing_map.shape[1] if routing_map is not None else 0)
    pairs, _ = _slot_pairs(sorted_indices, routing_map, experts, t, rows, drop_and_pad)
    X, G = permuted.to(F64).cpu(), grad.to(F64).cpu()
    dpermuted = torch.zeros(rows, h, dtype=F64)
    dprobs = None if probs is None else torch.zeros(t, experts, dtype=F64)
    for tok, ex, r in pairs:
        w = 1.0 if probs is None else float(probs[tok, ex])
        dpermuted[r] = w * G[tok]
        if dprobs is not None:
            dprobs[tok, ex] = float((G[tok] * X[r]).sum())
    dev = permuted.device
    return (dpermuted.to(dev), torch.zeros(0, dtype=F64, device=dev) if dprobs is None else dprobs.to(dev)), (1, h)


def _swiglu(x, dim=-1):
    """CANN's SwiGlu: y = swish(A) * B with swish(a) = a / (1 + e^-a), A and B the halves of x along dim."""
    A, B = x.to(F64).chunk(2, dim=dim)
    return (A / (1 + torch.exp(-A)) * B,), (1,)


def _swiglu_grad(y_grad, x, dim=-1):
    """The derivative of A * sigmoid(A) * B: d/dA = B * (s + A * s * (1 - s)), d/dB = A * s, s = sigmoid(A)
    (written from the calculus: CANN's printed dA factor, s + s * (1 - s * A), is not the derivative)."""
    A, B = x.to(F64).chunk(2, dim=dim)
    G = y_grad.to(F64)
    s = 1 / (1 + torch.exp(-A))
    return (torch.cat((G * B * (s + A * s * (1 - s)), G * A * s), dim=dim),), (1,)


_ORACLES = {
    "rms_norm": _rms_norm, "rms_norm_grad": _rms_norm_grad, "layer_norm": _layer_norm,
    "layer_norm_grad": _layer_norm_grad, "layer_norm_grad_beta": _layer_norm_grad_beta,
    "layer_norm_backward": _layer_norm_backward, "hardswish": _hardswish, "hardswish_backward": _hardswish_backward,
    "embedding_dense_backward": _embedding_dense_backward, "moe_token_permute": _moe_token_permute,
    "moe_token_permute_grad": _moe_token_permute_grad, "moe_token_unpermute": _moe_token_unpermute,
    "moe_token_unpermute_grad": _moe_token_unpermute_grad,
    "moe_token_permute_with_routing_map": _moe_token_permute_with_routing_map,
    "moe_token_permute_with_routing_map_grad": _moe_token_permute_with_routing_map_grad,
    "moe_token_unpermute_with_routing_map": _moe_token_unpermute_with_routing_map,
    "moe_token_unpermute_with_routing_map_grad": _moe_token_unpermute_with_routing_map_grad,
    "swiglu": _swiglu, "swiglu_grad": _swiglu_grad,
}


def _hardswish_backward_terms(grad_output, x):
    """The float32 error of ``g * (x/3 + 0.5)`` is a few u32 of ``|g| * (|x|/3 + 0.5)``, not of the result: near
    x = -1.5 the sum cancels (found by the fuzz tier: g = 65504 there). The largest such term over the linear
    branch, so the norm-wise bound covers it."""
    X, G = x.to(F64), grad_output.to(F64)
    terms = torch.where((X >= -3) & (X <= 3), G.abs() * (X.abs() / 3 + 0.5), 0.0)
    terms = terms[torch.isfinite(terms)]
    return float(terms.max()) if terms.numel() else 0.0


def _layer_norm_dx_terms(dy, x, mean, rstd, gamma):
    """dx sums terms of size ``rstd * |dy * gamma|`` that cancel exactly at N = 1 and N = 2 (x - mean = +-sigma):
    its float32 error is a few u32 of them (found by the fuzz tier at N = 2)."""
    terms = dy.to(F64).abs() * gamma.to(F64).abs() * rstd.to(F64).reshape(*x.shape[:-1], 1)
    terms = terms[torch.isfinite(terms)]
    return float(terms.max()) if terms.numel() else 0.0


def _layer_norm_grad_dx_terms(dy, x, variance, mean, gamma, epsilon=1e-5):
    """``_layer_norm_dx_terms`` for AscendC's argument order: rstd derived from the variance."""
    return _layer_norm_dx_terms(dy, x, mean, (variance.to(F64) + epsilon) ** -0.5, gamma)


def _swiglu_grad_terms(y_grad, x, dim=-1):
    """dA = g * B * s * (1 + A * (1 - s)) cancels where A * (1 - s) = -1 (A ~ -1.28): its float32 error is a few
    u32 of the terms ``|g * B| * s * (1 + |A| * (1 - s))``."""
    A, B = x.to(F64).chunk(2, dim=dim)
    G = y_grad.to(F64)
    s = 1 / (1 + torch.exp(-A))
    terms = torch.cat(((G * B).abs() * s * (1 + A.abs() * (1 - s)), (G * A).abs() * s), dim=dim)
    terms = terms[torch.isfinite(terms)]
    return float(terms.max()) if terms.numel() else 0.0


#: Ops whose first output's rounding error scales with the size of its terms rather than of its value.
_TERM_SCALES = {"hardswish_backward": _hardswish_backward_terms, "layer_norm_backward": _layer_norm_dx_terms,
                "layer_norm_grad": _layer_norm_grad_dx_terms, "swiglu_grad": _swiglu_grad_terms}


def oracle(op: str, *args, **kwargs) -> tuple[Tensor, ...]:
    """The float64 outputs of ``op`` (index outputs as int64)."""
    return _ORACLES[op](*args, **kwargs)[0]


def tolerance(out_dtype: torch.dtype, n: int, scale: float, unit: float = U32) -> float:
    """The derived bound of this module's docstring; ``unit``: the unit roundoff of the computation (float32's,
    or float64's for float64 inputs, which the PyTorch API computes in float64)."""
    return (torch.finfo(out_dtype).eps + 8 * math.sqrt(max(n, 1)) * unit) * scale


def max_error(got: Tensor, ref: Tensor) -> float:
    """Largest |got - ref| over finite reference values; inf if non-finite values differ."""
    g = got.to(F64)
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isnan(g), torch.isnan(ref)) or not torch.equal(g[torch.isinf(ref)], ref[torch.isinf(ref)]):
        return math.inf
    return float((g[finite] - ref[finite]).abs().max()) if finite.any() else 0.0


def assert_matches(op: str, got, sample, unit: float = U32) -> None:
    """Compare the outputs of ``gradops.<op>(*sample.args, **sample.kwargs)`` with the oracle (``unit``: see
    :func:`tolerance`)."""
    expected, lengths = _ORACLES[op](*sample.args, **sample.kwargs)
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected), f"{op}: {len(got)} outputs, expected {len(expected)}"
    for i, (g, e, n) in enumerate(zip(got, expected, lengths)):
        where = f"{op}[{sample.name}] output {i}"
        assert tuple(g.shape) == tuple(e.shape), f"{where}: shape {tuple(g.shape)}, expected {tuple(e.shape)}"
        if not e.is_floating_point():
            assert torch.equal(g.long().cpu(), e.cpu()), f"{where}: indices differ"
            continue
        if e.numel() == 0:
            continue
        # A value beyond the output dtype's range rounds to an infinity (float16: |v| >= 65520): that is the
        # exact answer in that dtype, so the infinity is what must come back.
        rounded = e.to(g.dtype).to(F64)
        e = torch.where(torch.isinf(rounded) & torch.isfinite(e), rounded, e)
        finite = e[torch.isfinite(e)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
        if op in _TERM_SCALES and i == 0:
            scale = max(scale, _TERM_SCALES[op](*sample.args, **sample.kwargs))
        err, tol = max_error(g, e), tolerance(g.dtype, n, scale, unit)
        assert err <= tol, f"{where} ({g.dtype}): max error {err:.3e} > tolerance {tol:.3e} (scale {scale:.3e}, n={n})"
