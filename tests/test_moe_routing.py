"""The routing-map MoE token movement (docs/semantics.md §5b), specified by float64 references written here.

Ops under test: ``gradops.moe_token_permute_with_routing_map`` and its ``_grad``,
``gradops.moe_token_unpermute_with_routing_map`` and its ``_grad``, the torch_npu spellings in
``gradops.npu_compat`` and the v2 backward helpers ``npu_moe_token_{permute,unpermute}_grad_v2``.

The references below never call gradops: the index plan (which token goes to which permuted row) is computed with
plain Python loops straight from the semantics, and the values are float64 torch index ops on that plan, so that
float64 autograd of them is the gradient every op and every explicit ``_grad`` function must match.

Conventions pinned here (the implementer's decisions, see the module's docs):

- non-drop: K = num_out_tokens // T (None means T, so K = 1), A = K*T output rows; the M routed pairs fill rows
  [0, M) expert-major, tokens ascending within an expert; rows [M, A) are zero; ``sorted_indices[t*K + k]`` is the
  row of token t's k-th routed expert (ascending), -1 for the unused slots of a token routed to fewer than K.
- drop_and_pad: C = num_out_tokens // E (None means T), A = C*E; expert e's C slots hold its routed tokens in
  ascending order, then (padding) the tokens not routed to it in ascending order, the first C of those;
  ``sorted_indices`` are token ids; ``permuted_probs[r] = probs[sorted_indices[r], r // C]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

import gradops
from gradops import npu_compat
from gradops.status import OpError

NULLPTR = 161001
INVALID = 161002

# ---------------------------------------------------------------------------------------------- tolerances
#: unit roundoff u of each dtype (round to nearest: |fl(x) - x| <= u |x|); 8, 11, 24, 53 significand bits.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24, torch.float64: 2.0**-53}
U32 = 2.0**-24


def assert_within(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, n_terms: int, dtype: torch.dtype,
                  what: str) -> None:
    """``got`` (in ``dtype``) against the float64 ``ref``, elementwise.

    Derivation. Every value here is a sum of at most ``n_terms`` products of two inputs (or plain copies). The
    inputs are exact in float64 (the reference reads the very bf16/fp16/fp32 tensors the op gets), so the only
    error is the op's arithmetic: products and sums in float32 (the spec: float32 accumulation for fp16/bf16),
    then ONE rounding to the output dtype. A float32 product of two inputs errs by <= u32 |term|, and a float32
    sum of n terms (any order) by <= (n - 1) u32 sum|terms| (first order, Higham's gamma_{n-1}), so the float32
    value v satisfies |v - ref| <= acc := (n + 1) u32 sum|terms| (we double it: second-order terms and an
    implementation that rounds each product before adding). Rounding v once to the output dtype adds
    <= u_out |v| <= u_out (|ref| + acc). Hence |got - ref| <= u_out (|ref| + acc) + acc. For bf16 this is about
    2^-8 |ref|: one bf16 rounding of the exact result plus the float32 accumulation of the K terms. ``mag`` is
    sum|terms|, computed by the same float64 reference on the absolute values of every input (all these ops are
    multilinear with nonnegative coefficients). An entry with no terms (mag = 0) must be exactly zero.
    """
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    acc = 2.0 * (n_terms + 1) * U32 * mag
    tol = UNIT_ROUNDOFF[dtype] * (ref.abs() + acc) + acc
    err = (got.detach().double() - ref).abs()
    bad = err > tol
    assert not bool(bad.any()), (
        f"{what}: {int(bad.sum())} entries outside the bound, worst excess {float((err - tol).max()):.3e} "
        f"at {[int(i) for i in torch.unravel_index((err - tol).argmax(), err.shape)]}\n"
        f"got={got.detach().double()}\nref={ref}")


def assert_exact(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Copies (permute forward, scatter of probs gradients): bitwise the reference's values in ``dtype``."""
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert tuple(got.shape) == tuple(ref.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    assert torch.equal(got.detach(), ref.to(dtype)), f"{what}:\ngot={got}\nref={ref}"


# ---------------------------------------------------------------------------------------------- the reference
@dataclass(frozen=True)
class Plan:
    """Where every token goes. ``rows[i]``, ``experts[i]``: the token and expert of permuted row i, for the rows
    that hold a pair (non-drop: the M pairs; drop: every one of the A rows, padding included). ``si``: the
    expected ``sorted_indices``. ``k``: K (non-drop) or C (drop)."""

    drop: bool
    num_tokens: int
    num_experts: int
    k: int
    out_rows: int
    rows: tuple[int, ...]
    experts: tuple[int, ...]
    si: tuple[int, ...]


def routed(mask: list[list[bool]], t: int) -> list[int]:
    """Token t's routed experts, ascending."""
    return [e for e, on in enumerate(mask[t]) if on]


def plan_of(routing_map: torch.Tensor, num_out_tokens: int | None, drop: bool) -> Plan:
    mask = (routing_map != 0).tolist()
    num_tokens, num_experts = routing_map.shape
    n = num_tokens if num_out_tokens is None else num_out_tokens
    if not drop:
        k = n // num_tokens
        pairs = [(t, e) for e in range(num_experts) for t in range(num_tokens) if mask[t][e]]  # expert-major
        row_of = {pair: i for i, pair in enumerate(pairs)}
        si: list[int] = []
        for t in range(num_tokens):
            experts = routed(mask, t)
            assert len(experts) <= k, "a reference case routes a token to more than K experts"
            si += [row_of[(t, e)] for e in experts] + [-1] * (k - len(experts))
        return Plan(False, num_tokens, num_experts, k, k * num_tokens, tuple(t for t, _ in pairs),
                    tuple(e for _, e in pairs), tuple(si))
    c = n // num_experts
    assert 0 < c <= num_tokens
    si = []
    for e in range(num_experts):
        chosen = [t for t in range(num_tokens) if mask[t][e]]
        padding = [t for t in range(num_tokens) if not mask[t][e]]
        si += (chosen + padding)[:c]
    return Plan(True, num_tokens, num_experts, c, c * num_experts, tuple(si),
                tuple(r // c for r in range(c * num_experts)), tuple(si))


def ref_permute(tokens: torch.Tensor, probs: torch.Tensor | None, plan: Plan):
    """float64 (permuted_tokens, permuted_probs or None) of the plan; differentiable w.r.t. tokens and probs."""
    rows = torch.tensor(plan.rows, dtype=torch.long)
    unused = plan.out_rows - len(plan.rows)
    permuted = torch.cat([tokens[rows], tokens.new_zeros(unused, tokens.shape[1])])
    if probs is None:
        return permuted, None
    pp = torch.cat([probs[rows, torch.tensor(plan.experts, dtype=torch.long)], probs.new_zeros(unused)])
    return permuted, pp


def ref_unpermute(permuted: torch.Tensor, si: list[int], num_tokens: int, probs: torch.Tensor | None,
                  mask: list[list[bool]] | None, drop: bool) -> torch.Tensor:
    """float64 (T, H) of §2, from sorted_indices (and the routing map's booleans for the weights)."""
    tok, src, wts = [], [], []
    if drop:
        c = len(si) // probs.shape[1] if probs is not None else None  # only the weights need C
        for r, t in enumerate(si):
            tok.append(t)
            src.append(r)
            wts.append((t, r // c) if c is not None else None)
    else:
        k = len(si) // num_tokens
        for t in range(num_tokens):
            experts = routed(mask, t) if mask is not None else None
            for j in range(k):
                row = si[t * k + j]
                if row == -1:
                    continue
                tok.append(t)
                src.append(row)
                wts.append((t, experts[j]) if experts is not None else None)
    contrib = permuted[torch.tensor(src, dtype=torch.long)]
    if probs is not None:
        w = probs[torch.tensor([p[0] for p in wts], dtype=torch.long), torch.tensor([p[1] for p in wts],
                                                                                    dtype=torch.long)]
        contrib = contrib * w[:, None]
    out = permuted.new_zeros(num_tokens, permuted.shape[1])
    return out.index_add(0, torch.tensor(tok, dtype=torch.long), contrib)


def ref_permute_grad_v2(grad: torch.Tensor, si: list[int], num_tokens: int, topk: int) -> torch.Tensor:
    """§3 MoeTokenPermuteGrad: out[t] = sum_k grad[si[t*K + k]], rows >= grad.shape[0] adding nothing."""
    out = grad.new_zeros(num_tokens, grad.shape[1])
    for i, row in enumerate(si):
        if row < grad.shape[0]:
            out[i // topk] += grad[row]
    return out


def ref_unpermute_grad_v2(grad: torch.Tensor, si: list[int], out_rows: int, probs: torch.Tensor | None,
                          permuted: torch.Tensor | None):
    """§3 MoeTokenUnpermuteGrad: (grad_permuted (A, H), grad_probs (T, K) or None)."""
    topk = probs.shape[1] if probs is not None else 1
    flat = probs.reshape(-1) if probs is not None else None
    gp = grad.new_zeros(out_rows, grad.shape[1])
    gprobs = grad.new_zeros(grad.shape[0], topk) if probs is not None else None
    for i, row in enumerate(si):
        if row >= out_rows:
            continue
        t = i // topk
        gp[row] = grad[t] * (flat[i] if flat is not None else 1.0)
        if gprobs is not None:
            gprobs[t, i % topk] = (grad[t] * permuted[row]).sum()
    return gp, gprobs


def vjp(fn, primals, cotangents):
    """float64 (value, grads, mags) of ``fn`` (a tuple-valued function of float64 tensors): the autograd of the
    reference at ``primals`` with ``cotangents``, and the same on |primals|, |cotangents| (sum of |terms|, for
    :func:`assert_within`). None primals/cotangents stay None; grads of None primals are None."""

    def run(absolute):
        leaves = [None if x is None else (x.detach().double().abs() if absolute else x.detach().double())
                  .requires_grad_() for x in primals]
        outs = fn(*leaves)
        pairs = [(o, (g.double().abs() if absolute else g.double())) for o, g in zip(outs, cotangents)
                 if o is not None and g is not None]
        want = [x for x in leaves if x is not None]
        if not pairs:
            return [None if o is None else o.detach() for o in outs], [None] * len(leaves)
        got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], allow_unused=True))
        grads = [None if x is None else next(got) for x in leaves]
        grads = [g if g is not None or x is None else torch.zeros_like(x) for g, x in zip(grads, leaves)]
        return [None if o is None else o.detach() for o in outs], grads

    value, grads = run(False)
    _, mags = run(True)
    return value, grads, mags


# ---------------------------------------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Case:
    name: str
    routing_map: torch.Tensor  # (T, E) bool or int8
    num_out_tokens: int | None
    drop: bool
    with_probs: bool
    hidden: int = 5

    @property
    def plan(self) -> Plan:
        return plan_of(self.routing_map, self.num_out_tokens, self.drop)

    @property
    def mask(self) -> list[list[bool]]:
        return (self.routing_map != 0).tolist()


def _topk_map(gen: torch.Generator, t: int, e: int, counts: list[int]) -> torch.Tensor:
    """(t, e) bool map, row i routed to ``counts[i]`` distinct random experts."""
    out = torch.zeros(t, e, dtype=torch.bool)
    for i, c in enumerate(counts):
        out[i, torch.randperm(e, generator=gen)[:c]] = True
    return out


def samples() -> list[Case]:
    """The seeded cases, each named for what it exercises."""
    gen = torch.Generator().manual_seed(20260721)
    cases = [
        # ---- non-drop (K = num_out_tokens // T)
        Case("k2-exact-topk", _topk_map(gen, 8, 4, [2] * 8), 16, False, True),
        Case("k2-exact-topk-no-probs", _topk_map(gen, 8, 4, [2] * 8), 16, False, False),
        Case("k1-num-out-none", _topk_map(gen, 6, 3, [1] * 6), None, False, True),
        Case("k3-fewer-than-k-rows", _topk_map(gen, 10, 6, [3, 0, 1, 2, 3, 1, 0, 2, 3, 1]), 30, False, True, 7),
        Case("k2-routed-nowhere-no-probs", _topk_map(gen, 8, 4, [2, 0, 2, 1, 2, 0, 2, 2]), 16, False, False),
        Case("k2-num-out-not-multiple", _topk_map(gen, 5, 4, [2, 2, 1, 2, 2]), 14, False, True),
        Case("k2-int8-map", _topk_map(gen, 7, 5, [2, 1, 2, 2, 0, 2, 2]).to(torch.int8), 14, False, True),
        Case("k1-single-token", _topk_map(gen, 1, 3, [1]), None, False, True, 8),
        Case("k4-every-expert", torch.ones(3, 4, dtype=torch.bool), 12, False, True),
        Case("k2-nothing-routed", torch.zeros(4, 3, dtype=torch.bool), 8, False, True),
        # ---- drop_and_pad (C = num_out_tokens // E)
        Case("drop-default-capacity-int8", (torch.rand(12, 4, generator=gen) < 0.4).to(torch.int8), None, True,
             True),
        Case("drop-capacity-equals-tokens", torch.rand(4, 3, generator=gen) < 0.5, 12, True, True),
        # C = T with E = 6: each token fills a slot of all six experts, so its gradient sums six rows (an
        # accumulation in bf16 instead of float32 shows here)
        Case("drop-six-slots-per-token", torch.rand(4, 6, generator=gen) < 0.3, 24, True, True, 8),
        Case("drop-num-out-not-multiple-no-probs", torch.rand(9, 4, generator=gen) < 0.5, 11, True, False),
        Case("drop-no-probs", torch.rand(8, 3, generator=gen) < 0.5, 9, True, False, 8),
    ]
    # non-drop: experts 1 and 4 empty (every row routed among {0, 2, 3})
    empty = torch.zeros(8, 5, dtype=torch.bool)
    empty[:, [0, 2, 3]] = _topk_map(gen, 8, 3, [2, 1, 2, 2, 2, 0, 2, 1])
    cases.append(Case("k2-empty-experts", empty, 16, False, True))
    # non-drop int8 map whose routed entries are nonzero values other than 1 (nonzero = routed)
    odd = _topk_map(gen, 6, 4, [2, 2, 1, 2, 0, 2]).to(torch.int8)
    odd = odd * torch.tensor([[1, 2, -1, 5]] * 6, dtype=torch.int8)
    cases.append(Case("k2-int8-nonzero-values", odd, 12, False, True))
    # drop: dense map, capacity 2 well below each expert's routed count (drops)
    dense = _topk_map(gen, 12, 4, [3] * 12)
    cases.append(Case("drop-capacity-below-routed", dense, 8, True, True))
    # drop: sparse map, capacity above the routed counts (padding with unrouted tokens' real data)
    sparse = _topk_map(gen, 10, 3, [1, 0, 0, 1, 0, 1, 0, 0, 1, 0])
    cases.append(Case("drop-padding-sparse", sparse, 15, True, True))
    # drop: expert 2 empty (gets tokens 0..C-1), token 3 routed nowhere (may appear as padding), some drops
    mixed = _topk_map(gen, 8, 4, [2, 2, 1, 0, 2, 1, 2, 2])
    mixed[:, 2] = False
    mixed[0, [0, 1]] = True
    cases.append(Case("drop-empty-expert-unrouted-token", mixed, 12, True, True, 6))
    return cases


SAMPLES = samples()
#: (tokens dtype, probs dtype): probs may be float32 beside bf16 tokens.
DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-probs-fp32": (torch.bfloat16, torch.float32),
    "fp16-probs-fp32": (torch.float16, torch.float32),
}
CASES = [pytest.param(s, d, id=f"{s.name}-{d}") for s in SAMPLES for d in DTYPES
         if s.with_probs or d != "bf16-probs-fp32"]
GRAD_CASES = [pytest.param(s, d, id=f"{s.name}-{d}") for s in SAMPLES for d in ("fp32", "bf16", "bf16-probs-fp32")
              if s.with_probs or d != "bf16-probs-fp32"]


def _inputs(case: Case, dname: str, seed: int = 0):
    """(tokens, probs or None) of the case in the dtypes named, seeded by the case's name."""
    tdt, pdt = DTYPES[dname]
    gen = torch.Generator().manual_seed(seed + sum(map(ord, case.name)))
    t, e = case.routing_map.shape
    tokens = torch.randn(t, case.hidden, generator=gen).to(tdt)
    probs = torch.rand(t, e, generator=gen).to(pdt) if case.with_probs else None
    return tokens, probs


def _autograd(outs, leaves, cots):
    """Gradients of gradops' outputs; a leaf the outputs do not use (e.g. nothing routed) gets zeros."""
    got = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)]


def _si_tensor(plan: Plan) -> torch.Tensor:
    return torch.tensor(plan.si, dtype=torch.int32)


def _terms(plan: Plan) -> int:
    """Most terms any output sums: a token's slots (K, or up to E in drop mode), or H for the probs' dots."""
    return max(plan.k, plan.num_experts, 1)


# ---------------------------------------------------------------------------------------------- permute forward
@pytest.mark.parametrize("case, dname", CASES)
def test_permute_values(case, dname, backend):
    tokens, probs = _inputs(case, dname)
    plan = case.plan
    pt, pp, si = gradops.moe_token_permute_with_routing_map(tokens, case.routing_map, probs=probs,
                                                            num_out_tokens=case.num_out_tokens,
                                                            drop_and_pad=case.drop)
    assert si.dtype == torch.int32 and si.tolist() == list(plan.si), (si.tolist(), plan.si)
    rt, rp = ref_permute(tokens.double(), None if probs is None else probs.double(), plan)
    assert_exact(pt, rt, tokens.dtype, "permuted_tokens")  # rows [M, A) included: zero
    if probs is None:  # gradops' empty placeholder (npu_compat gives None)
        assert pp.shape == (0,) and pp.dtype == tokens.dtype
    else:
        assert_exact(pp, rp, probs.dtype, "permuted_probs")


@pytest.mark.parametrize("case", [s for s in SAMPLES if not s.drop], ids=lambda s: s.name)
def test_permute_non_drop_layout(case):
    """The non-drop layout restated without the plan: rows [0, M) are the pairs expert-major, tokens ascending;
    every valid slot names a row holding its own token; -1 exactly for the missing slots; rows past M zero."""
    tokens = torch.randn(case.routing_map.shape[0], 4)
    pt, _, si = gradops.moe_token_permute_with_routing_map(tokens, case.routing_map,
                                                           num_out_tokens=case.num_out_tokens)
    mask = case.routing_map != 0
    t_count = tokens.shape[0]
    k = (t_count if case.num_out_tokens is None else case.num_out_tokens) // t_count
    m = int(mask.sum())
    assert pt.shape == (k * t_count, 4) and si.shape == (k * t_count,)
    owner = torch.arange(t_count).expand(mask.shape[1], -1).masked_select(mask.T)  # token of each pair row
    assert torch.equal(pt[:m], tokens[owner])
    assert not bool(pt[m:].any())
    for t in range(t_count):
        slots = si[t * k:(t + 1) * k].tolist()
        n = int(mask[t].sum())
        assert slots[n:] == [-1] * (k - n) and all(0 <= r < m and int(owner[r]) == t for r in slots[:n])
        assert slots[:n] == sorted(slots[:n])  # ascending experts -> ascending rows (expert-major)


def test_reference_drop_order_is_the_stable_descending_argsort():
    """The drop plan above equals the brief's formula (a check of the reference itself; no gradops)."""
    for case in SAMPLES:
        if case.drop:
            c = case.plan.k
            want = torch.argsort((case.routing_map != 0).T.int(), dim=-1, descending=True, stable=True)[:, :c]
            assert list(case.plan.si) == want.reshape(-1).tolist(), case.name


# ---------------------------------------------------------------------------------------------- permute gradients
@pytest.mark.parametrize("case, dname", GRAD_CASES)
def test_permute_autograd(case, dname, backend):
    tokens, probs = _inputs(case, dname)
    plan = case.plan
    gen = torch.Generator().manual_seed(7)
    g_pt = torch.randn(plan.out_rows, tokens.shape[1], generator=gen).to(tokens.dtype)  # rows >= M too
    g_pp = torch.randn(plan.out_rows, generator=gen).to(probs.dtype) if probs is not None else None
    leaves = [tokens.clone().requires_grad_()] + ([probs.clone().requires_grad_()] if probs is not None else [])
    pt, pp, _ = gradops.moe_token_permute_with_routing_map(leaves[0], case.routing_map,
                                                           probs=leaves[1] if probs is not None else None,
                                                           num_out_tokens=case.num_out_tokens,
                                                           drop_and_pad=case.drop)
    outs, cots = ([pt, pp], [g_pt, g_pp]) if probs is not None else ([pt], [g_pt])
    got = _autograd(outs, leaves, cots)
    _, (rg_t, rg_p), (mg_t, _) = vjp(lambda x, p: ref_permute(x, p, plan), [tokens, probs], [g_pt, g_pp])
    assert_within(got[0], rg_t, mg_t, _terms(plan), tokens.dtype, "tokens.grad")
    if probs is not None:
        assert_exact(got[1], rg_p, probs.dtype, "probs.grad")  # one source per pair: a scatter


@pytest.mark.parametrize("case, dname", GRAD_CASES)
def test_permute_grad_function(case, dname, backend):
    tokens, probs = _inputs(case, dname)
    plan = case.plan
    gen = torch.Generator().manual_seed(8)
    g_pt = torch.randn(plan.out_rows, tokens.shape[1], generator=gen).to(tokens.dtype)
    g_pp = torch.randn(plan.out_rows, generator=gen).to(probs.dtype) if probs is not None else None
    tg, pg = gradops.moe_token_permute_with_routing_map_grad(g_pt, g_pp, _si_tensor(plan), case.routing_map,
                                                             plan.num_experts, plan.num_tokens, case.drop)
    _, (rg_t, rg_p), (mg_t, _) = vjp(lambda x, p: ref_permute(x, p, plan), [tokens, probs], [g_pt, g_pp])
    assert_within(tg, rg_t, mg_t, _terms(plan), g_pt.dtype, "tokens_grad")
    if probs is None:
        assert pg.shape == (0,) and pg.dtype == g_pt.dtype
    else:
        assert_exact(pg, rg_p, g_pp.dtype, "probs_grad")


@pytest.mark.parametrize("case", [s for s in SAMPLES if not s.drop], ids=lambda s: s.name)
def test_permute_grad_function_without_routing_map(case):
    """No probs gradient: sorted_indices alone give tokens_grad (routing_map=None)."""
    plan = case.plan
    g_pt = torch.randn(plan.out_rows, 3)
    tg, pg = gradops.moe_token_permute_with_routing_map_grad(g_pt, None, _si_tensor(plan), None, plan.num_experts,
                                                             plan.num_tokens)
    _, (rg_t, _), (mg_t, _) = vjp(lambda x, p: ref_permute(x, p, plan), [torch.zeros(plan.num_tokens, 3), None],
                                  [g_pt, None])
    assert pg.shape == (0,)
    assert_within(tg, rg_t, mg_t, _terms(plan), torch.float32, "tokens_grad")


# ---------------------------------------------------------------------------------------------- unpermute
def _unpermute_inputs(case: Case, dname: str):
    """(permuted_tokens (A, H) random, probs or None, routing_map or None) for the unpermute of the case."""
    tokens, probs = _inputs(case, dname, seed=1)
    gen = torch.Generator().manual_seed(11)
    permuted = torch.randn(case.plan.out_rows, case.hidden, generator=gen).to(tokens.dtype)
    return permuted, probs, (case.routing_map if probs is not None else None)


def _ref_unpermute_fn(case: Case):
    plan, mask = case.plan, case.mask
    return lambda x, p: (ref_unpermute(x, list(plan.si), plan.num_tokens, p, mask, case.drop),)


@pytest.mark.parametrize("case, dname", CASES)
def test_unpermute_values(case, dname, backend):
    permuted, probs, rmap = _unpermute_inputs(case, dname)
    plan = case.plan
    out = gradops.moe_token_unpermute_with_routing_map(permuted, _si_tensor(plan), (plan.num_tokens, case.hidden),
                                                       probs=probs, routing_map=rmap, drop_and_pad=case.drop)
    (ref,), _, _ = vjp(_ref_unpermute_fn(case), [permuted, probs], [None])
    (mag,), _, _ = vjp(_ref_unpermute_fn(case), [permuted.abs(), None if probs is None else probs.abs()], [None])
    assert_within(out, ref, mag, _terms(plan), permuted.dtype, "unpermuted")


@pytest.mark.parametrize("case, dname", GRAD_CASES)
def test_unpermute_autograd(case, dname, backend):
    permuted, probs, rmap = _unpermute_inputs(case, dname)
    plan = case.plan
    g = torch.randn(plan.num_tokens, case.hidden, generator=torch.Generator().manual_seed(12)).to(permuted.dtype)
    leaves = [permuted.clone().requires_grad_()] + ([probs.clone().requires_grad_()] if probs is not None else [])
    out = gradops.moe_token_unpermute_with_routing_map(leaves[0], _si_tensor(plan), (plan.num_tokens, case.hidden),
                                                       probs=leaves[1] if probs is not None else None,
                                                       routing_map=rmap, drop_and_pad=case.drop)
    got = _autograd([out], leaves, [g])
    _, (rg_x, rg_p), (mg_x, mg_p) = vjp(_ref_unpermute_fn(case), [permuted, probs], [g])
    assert_within(got[0], rg_x, mg_x, 1, permuted.dtype, "permuted_tokens.grad")  # one product per row
    if probs is not None:
        assert_within(got[1], rg_p, mg_p, case.hidden, probs.dtype, "probs.grad")  # a dot over H


@pytest.mark.parametrize("case, dname", GRAD_CASES)
def test_unpermute_grad_function(case, dname, backend):
    permuted, probs, rmap = _unpermute_inputs(case, dname)
    plan = case.plan
    g = torch.randn(plan.num_tokens, case.hidden, generator=torch.Generator().manual_seed(13)).to(permuted.dtype)
    gx, gp = gradops.moe_token_unpermute_with_routing_map_grad(permuted, g, _si_tensor(plan), probs=probs,
                                                               routing_map=rmap, drop_and_pad=case.drop)
    _, (rg_x, rg_p), (mg_x, mg_p) = vjp(_ref_unpermute_fn(case), [permuted, probs], [g])
    assert_within(gx, rg_x, mg_x, 1, permuted.dtype, "grad_permuted")
    if probs is None:
        assert gp.shape == (0,) and gp.dtype == permuted.dtype
    else:
        assert_within(gp, rg_p, mg_p, case.hidden, probs.dtype, "grad_probs")


@pytest.mark.parametrize("case, dname", CASES)
def test_round_trip_is_the_weighted_sum(case, dname):
    """unpermute(permute(tokens)) = sum over the token's kept experts of probs[t, e] * tokens[t] (kept: routed in
    non-drop mode; in drop mode every expert slot holding t, padding included, dropped pairs excluded)."""
    tokens, probs = _inputs(case, dname)
    plan = case.plan
    pt, _, si = gradops.moe_token_permute_with_routing_map(tokens, case.routing_map, probs=probs,
                                                           num_out_tokens=case.num_out_tokens,
                                                           drop_and_pad=case.drop)
    out = gradops.moe_token_unpermute_with_routing_map(pt, si, (plan.num_tokens, case.hidden), probs=probs,
                                                       routing_map=case.routing_map if probs is not None else None,
                                                       drop_and_pad=case.drop)
    kept = torch.zeros(plan.num_tokens, plan.num_experts, dtype=torch.float64)
    if case.drop:
        for r, t in enumerate(plan.si):
            kept[t, r // plan.k] = 1.0
    else:
        kept = (case.routing_map != 0).double()
    w = kept * (probs.double() if probs is not None else 1.0)
    ref = w.sum(1, keepdim=True) * tokens.double()
    mag = w.abs().sum(1, keepdim=True) * tokens.double().abs()
    assert_within(out, ref, mag, _terms(plan), tokens.dtype, "round trip")


# ---------------------------------------------------------------------------------------------- worked examples
OPDOC_PROBS = [[0.5, 0.3], [0.4, 0.6], [0.2, 0.8]]


def test_opdoc_example():
    """docs/semantics.md §5b (the torch_npu page's example): all-ones (3, 2) map, num_out_tokens = 6 (K = 2)."""
    tokens = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    rmap = torch.ones(3, 2, dtype=torch.bool)
    probs = torch.tensor(OPDOC_PROBS)
    for fn in (gradops.moe_token_permute_with_routing_map, npu_compat.npu_moe_token_permute_with_routing_map):
        pt, pp, si = fn(tokens, rmap, probs=probs, num_out_tokens=6)
        assert si.dtype == torch.int32 and si.tolist() == [0, 3, 1, 4, 2, 5]
        assert torch.equal(pp, torch.tensor([0.5, 0.4, 0.2, 0.3, 0.6, 0.8]))
        assert torch.equal(pt, tokens[[0, 1, 2, 0, 1, 2]])
    out = gradops.moe_token_unpermute_with_routing_map(pt, si, (3, 2), probs=probs, routing_map=rmap)
    want = torch.tensor([[0.8], [1.0], [1.0]], dtype=torch.float64) * tokens.double()
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=0)
    assert torch.equal(gradops.moe_token_unpermute_with_routing_map(pt, si, (3, 2)), 2 * tokens)


def test_drop_example_by_hand():
    """Map [[1,0],[1,1],[0,0],[1,0]], num_out_tokens 4 -> C = 2: expert 0 (tokens 0, 1, 3 routed) keeps 0, 1 and
    drops 3; expert 1 (token 1 routed) is padded with token 0, the lowest one not routed to it."""
    tokens = torch.arange(8.0).reshape(4, 2)
    rmap = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0]], dtype=torch.bool)
    probs = torch.tensor([[0.25, 0.5], [0.125, 0.75], [1.0, 2.0], [4.0, 8.0]])
    pt, pp, si = gradops.moe_token_permute_with_routing_map(tokens, rmap, probs=probs, num_out_tokens=4,
                                                            drop_and_pad=True)
    assert si.dtype == torch.int32 and si.tolist() == [0, 1, 1, 0]
    assert torch.equal(pt, tokens[[0, 1, 1, 0]])
    assert pp.tolist() == [0.25, 0.125, 0.75, 0.5]
    out = gradops.moe_token_unpermute_with_routing_map(pt, si, (4, 2), probs=probs, routing_map=rmap,
                                                       drop_and_pad=True)
    assert torch.equal(out, torch.stack([0.75 * tokens[0], 0.875 * tokens[1], 0 * tokens[2], 0 * tokens[3]]))


def test_fewer_than_k_example_by_hand():
    """Map [[1,0,1],[0,0,0],[0,1,0]], K = 2: pairs (0,e0) (2,e1) (0,e2) fill rows 0..2; token 1 routed nowhere."""
    tokens = torch.tensor([[1.0, -1.0], [2.0, -2.0], [3.0, -3.0]])
    rmap = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0]], dtype=torch.int8)
    probs = torch.tensor([[0.5, 9.0, 0.25], [9.0, 9.0, 9.0], [9.0, 0.75, 9.0]])
    pt, pp, si = gradops.moe_token_permute_with_routing_map(tokens, rmap, probs=probs, num_out_tokens=6)
    assert si.tolist() == [0, 2, -1, -1, 1, -1]
    assert torch.equal(pt, torch.tensor([[1.0, -1.0], [3.0, -3.0], [1.0, -1.0], [0, 0], [0, 0], [0, 0]]))
    assert pp.tolist() == [0.5, 0.75, 0.25, 0.0, 0.0, 0.0]
    out = gradops.moe_token_unpermute_with_routing_map(pt, si, (3, 2), probs=probs, routing_map=rmap)
    assert torch.equal(out, torch.tensor([[0.75, -0.75], [0.0, 0.0], [2.25, -2.25]]))
    tg, pg = gradops.moe_token_permute_with_routing_map_grad(torch.ones(6, 2), torch.arange(1.0, 7.0), si, rmap, 3, 3)
    assert torch.equal(tg, torch.tensor([[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(pg, torch.tensor([[1.0, 0.0, 3.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))


# ---------------------------------------------------------------------------------------------- npu_compat
COMPAT = [pytest.param(s, d, id=f"{s.name}-{d}") for s in SAMPLES
          if s.name in ("k3-fewer-than-k-rows", "k2-exact-topk-no-probs", "drop-capacity-below-routed",
                        "drop-empty-expert-unrouted-token")
          for d in ("fp32", "bf16-probs-fp32")]


@pytest.mark.parametrize("case, dname", COMPAT)
def test_npu_compat_permute_and_unpermute(case, dname):
    tokens, probs = _inputs(case, dname)
    plan = case.plan
    pt, pp, si = npu_compat.npu_moe_token_permute_with_routing_map(tokens, case.routing_map, probs=probs,
                                                                   num_out_tokens=case.num_out_tokens,
                                                                   drop_and_pad=case.drop)
    rt, rp = ref_permute(tokens.double(), None if probs is None else probs.double(), plan)
    assert si.dtype == torch.int32 and si.tolist() == list(plan.si)
    assert_exact(pt, rt, tokens.dtype, "permuted_tokens")
    if probs is not None:
        assert_exact(pp, rp, probs.dtype, "permuted_probs")
    else:  # torch_npu's undefined tensor
        assert pp is None
    rmap = case.routing_map if probs is not None else None
    out = npu_compat.npu_moe_token_unpermute_with_routing_map(pt, si, (plan.num_tokens, case.hidden), probs=probs,
                                                              routing_map=rmap, drop_and_pad=case.drop)
    (ref,), _, _ = vjp(_ref_unpermute_fn(case), [pt, probs], [None])
    (mag,), _, _ = vjp(_ref_unpermute_fn(case), [pt.abs(), None if probs is None else probs.abs()], [None])
    assert_within(out, ref, mag, _terms(plan), tokens.dtype, "unpermuted")


def test_npu_compat_options_are_keyword_only():
    tokens, rmap, probs = torch.randn(3, 2), torch.ones(3, 2, dtype=torch.bool), torch.rand(3, 2)
    with pytest.raises(TypeError):
        npu_compat.npu_moe_token_permute_with_routing_map(tokens, rmap, probs)
    pt, _, si = npu_compat.npu_moe_token_permute_with_routing_map(tokens, rmap, num_out_tokens=6)
    with pytest.raises(TypeError):
        npu_compat.npu_moe_token_unpermute_with_routing_map(pt, si, (3, 2), probs)


# ---------------------------------------------------------------------------------------------- v2 helpers
@pytest.mark.parametrize("num_tokens, topk, rows, gdt, tdt", [
    (6, 2, 12, torch.float32, torch.float32),
    (6, 2, 9, torch.float32, torch.float32),  # rows >= 9 dropped by num_out_tokens: add nothing
    (5, 3, 15, torch.bfloat16, torch.bfloat16),
    (5, 3, 11, torch.float32, torch.bfloat16),  # output in tokens_dtype, not the gradient's
    (4, 1, 4, torch.bfloat16, torch.float32),
], ids=["fp32", "fp32-dropped", "bf16", "fp32-grad-bf16-tokens", "k1-bf16-grad-fp32-tokens"])
def test_permute_grad_v2(num_tokens, topk, rows, gdt, tdt):
    gen = torch.Generator().manual_seed(num_tokens * 100 + rows)
    si = torch.randperm(num_tokens * topk, generator=gen).to(torch.int32)
    grad = torch.randn(rows, 6, generator=gen).to(gdt)
    out = npu_compat.npu_moe_token_permute_grad_v2(grad, si, num_tokens, tdt, topk)
    ref = ref_permute_grad_v2(grad.double(), si.tolist(), num_tokens, topk)
    mag = ref_permute_grad_v2(grad.double().abs(), si.tolist(), num_tokens, topk)
    assert_within(out, ref, mag, topk, tdt, "permute_grad_v2")


@pytest.mark.parametrize("num_tokens, topk, rows, dt, pdt", [
    (6, 2, 12, torch.float32, torch.float32),
    (6, 2, 8, torch.float32, torch.float32),  # slots naming rows >= 8: no gradient row, grad_probs 0
    (5, 3, 15, torch.bfloat16, torch.float32),
    (5, 3, 13, torch.bfloat16, torch.bfloat16),
    (7, None, 7, torch.float32, None),  # no probs: K = 1, weight 1
    (7, None, 5, torch.bfloat16, None),
], ids=["fp32", "fp32-dropped", "bf16-probs-fp32", "bf16-dropped", "no-probs", "no-probs-bf16-dropped"])
def test_unpermute_grad_v2(num_tokens, topk, rows, dt, pdt):
    gen = torch.Generator().manual_seed(num_tokens * 100 + rows)
    k = topk or 1
    si = torch.randperm(num_tokens * k, generator=gen).to(torch.int32)
    grad = torch.randn(num_tokens, 4, generator=gen).to(dt)
    permuted = torch.randn(rows, 4, generator=gen).to(dt)
    probs = torch.rand(num_tokens, k, generator=gen).to(pdt) if topk else None
    gx, gp = npu_compat.npu_moe_token_unpermute_grad_v2(grad, si, rows, dt, probs=probs,
                                                        permuted_tokens=permuted if topk else None)
    rx, rp = ref_unpermute_grad_v2(grad.double(), si.tolist(), rows, None if probs is None else probs.double(),
                                   permuted.double())
    mx, mp = ref_unpermute_grad_v2(grad.double().abs(), si.tolist(), rows,
                                   None if probs is None else probs.double().abs(), permuted.double().abs())
    assert_within(gx, rx, mx, 1, dt, "grad_permuted")
    if probs is not None:  # without probs the second output is not pinned
        assert_within(gp, rp, mp, 4, pdt, "grad_probs")


# ---------------------------------------------------------------------------------------------- refusals
def _refused(fn, *args, **kwargs) -> OpError:
    with pytest.raises(OpError) as info:
        fn(*args, **kwargs)
    return info.value


def _leading(err: OpError) -> str:
    """The argument an error names: ``err.arg``'s leading name (gradops spells the part at fault, e.g.
    ``routing_map.dtype`` or ``probs.shape``)."""
    return re.match(r"\w+", err.arg).group()


def permute(*args, **kwargs):
    """gradops.moe_token_permute_with_routing_map, looked up at call time."""
    return gradops.moe_token_permute_with_routing_map(*args, **kwargs)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("n", [-1, -8])
def test_refuses_negative_num_out_tokens(drop, n):
    err = _refused(permute, torch.randn(4, 3), torch.ones(4, 2, dtype=torch.bool), num_out_tokens=n,
                   drop_and_pad=drop)
    assert err.status == INVALID and _leading(err) == "num_out_tokens", str(err)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("rows", [3, 5])
def test_refuses_routing_map_rows_other_than_tokens(drop, rows):
    rmap = torch.zeros(rows, 2, dtype=torch.bool)
    rmap[:, 0] = True
    err = _refused(permute, torch.randn(4, 3), rmap, num_out_tokens=4, drop_and_pad=drop)
    assert err.status == INVALID and _leading(err) in ("routing_map", "tokens"), str(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64, torch.float16])
def test_refuses_routing_map_dtype(dtype):
    rmap = torch.zeros(4, 2, dtype=dtype)
    rmap[:, 0] = 1
    err = _refused(permute, torch.randn(4, 3), rmap)
    assert err.status == INVALID and _leading(err) == "routing_map", str(err)


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("shape", [(4, 3), (3, 2), (4,), (8,)])
def test_refuses_probs_shape_other_than_routing_map(drop, shape):
    rmap = torch.zeros(4, 2, dtype=torch.bool)
    rmap[:, 1] = True
    err = _refused(permute, torch.randn(4, 3), rmap, probs=torch.rand(shape), num_out_tokens=4, drop_and_pad=drop)
    assert err.status == INVALID and _leading(err) in ("probs", "routing_map"), str(err)


def test_refuses_missing_tokens():
    err = _refused(permute, None, torch.ones(4, 2, dtype=torch.bool))
    assert err.status == NULLPTR and _leading(err) == "tokens", str(err)


@pytest.mark.parametrize("num_out, counts", [
    (None, [1, 2, 1, 0]),  # K = 1, row 1 routed to 2
    (8, [2, 2, 3, 1]),  # K = 2, row 2 routed to 3
    (9, [3, 2, 2, 2]),  # K = 9 // 4 = 2, row 0 routed to 3
])
def test_refuses_a_row_over_k(num_out, counts, backend):
    rmap = torch.zeros(4, 3, dtype=torch.bool)
    for t, c in enumerate(counts):
        rmap[t, :c] = True
    err = _refused(permute, torch.randn(4, 2), rmap, num_out_tokens=num_out)
    assert err.status == INVALID and _leading(err) == "routing_map", str(err)
    err = _refused(permute, torch.randn(4, 2), rmap.to(torch.int8), probs=torch.rand(4, 3), num_out_tokens=num_out)
    assert err.status == INVALID and _leading(err) == "routing_map", str(err)


@pytest.mark.parametrize("num_tokens, num_experts, num_out", [
    (4, 3, 2),  # C = 2 // 3 = 0
    (4, 3, 0),
    (2, 4, None),  # None means T: C = 2 // 4 = 0
    (4, 2, 10),  # C = 5 > T
    (3, 3, 12),  # C = 4 > T
])
def test_drop_refuses_capacity_outside_one_to_tokens(num_tokens, num_experts, num_out):
    rmap = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    rmap[:, 0] = True
    err = _refused(permute, torch.randn(num_tokens, 2), rmap, num_out_tokens=num_out, drop_and_pad=True)
    assert err.status == INVALID, str(err)
