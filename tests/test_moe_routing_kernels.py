"""The routing-map ops' CPU kernels (families/moe/moe_permute.cpp: one kernel per op, the slot tables built in C++) give
the bits of the permute family's kernels on the Python slot tables of gradops.families.moe.routing_reference, which they
replace on the CPU path: every sample, caller-made indices the samples lack (a token named twice in one expert's
column, rows no slot names), above the parallel threshold on one and two threads; every value the tables refuse
is refused, with the tables' OpError, before anything is written."""

from __future__ import annotations

import pytest
import torch

import gradops
from gradops.status import OpError
from native_paths import on_threads, same, skip_unless_native
from samples import samples

pytestmark = skip_unless_native

ROUTING = ("moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad",
           "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad")


def _cpu():
    from gradops.families.moe import cpu  # the extension is built: skip_unless_native

    return cpu


def _pair(op: str):
    """(the op's kernel entry, the same op on the slot tables and the family kernels)."""
    cpu = _cpu()
    return getattr(cpu, op), cpu._TABLES[ROUTING.index(op)]


def _tuple(r) -> tuple[torch.Tensor, ...]:
    return r if isinstance(r, tuple) else (r,)


def _args(op: str, sample) -> tuple:
    """The sample's positional arguments as the backend entries take them (defaults filled)."""
    args = list(sample.args)
    defaults = {"moe_token_permute_with_routing_map": [None, None, False],
                "moe_token_permute_with_routing_map_grad": [False],
                "moe_token_unpermute_with_routing_map": [None, None, False],
                "moe_token_unpermute_with_routing_map_grad": [None, None, False]}[op]
    arity = {"moe_token_permute_with_routing_map": 5, "moe_token_permute_with_routing_map_grad": 7,
             "moe_token_unpermute_with_routing_map": 6, "moe_token_unpermute_with_routing_map_grad": 6}[op]
    while len(args) < arity:
        args.append(defaults[len(args) - arity + len(defaults)])
    return tuple(args)


CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in ROUTING for s in samples(op)
         if not any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in s.args)]


@pytest.mark.parametrize("op,sample", CASES)
def test_kernel_same_bits_as_the_slot_tables(op, sample):
    kernel, tables = _pair(op)
    args = _args(op, sample)
    same(_tuple(kernel(*args)), _tuple(tables(*args)))


def _drop_indices_with_repeats() -> torch.Tensor:
    """drop_and_pad indices made by a caller, not a permute: token 2 twice in expert 0's column, token 4 on no row,
    token 0 on four rows (C = 3, E = 3, T = 5)."""
    return torch.tensor([2, 0, 2, 1, 0, 3, 0, 3, 0], dtype=torch.int32)


def _hand_cases():
    torch.manual_seed(3)
    si = _drop_indices_with_repeats()
    probs = torch.rand(5, 3)
    x = torch.randn(9, 6)
    yield "unpermute-drop-repeats", ("moe_token_unpermute_with_routing_map", (x, si, [5, 6], probs, None, True))
    yield "unpermute-grad-drop-repeats", ("moe_token_unpermute_with_routing_map_grad",
                                          (x, torch.randn(5, 6), si, probs, None, True))
    yield "permute-grad-drop-repeats", ("moe_token_permute_with_routing_map_grad",
                                        (x, torch.randn(9), si, None, 3, 5, True))
    # Without dropping: rows 0..3 named of A = 6 (rows 4, 5 unnamed), a slot naming a row whose token has no such
    # expert (token 2's map row routes one expert, its second slot names row 3): weight 0, no probs gradient.
    si = torch.tensor([0, -1, 2, -1, 1, 3], dtype=torch.int64)
    rm = torch.tensor([[1, 0, 0, 0], [0, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.bool)
    probs = torch.rand(3, 4)
    x = torch.randn(6, 5)
    yield "unpermute-unnamed-rows", ("moe_token_unpermute_with_routing_map", (x, si, [3, 5], probs, rm, False))
    yield "unpermute-grad-unnamed-rows", ("moe_token_unpermute_with_routing_map_grad",
                                          (x, torch.randn(3, 5), si, probs, rm, False))
    yield "unpermute-grad-no-probs", ("moe_token_unpermute_with_routing_map_grad",
                                      (x, torch.randn(3, 5), si, None, None, False))
    yield "unpermute-grad-mixed-dtypes", ("moe_token_unpermute_with_routing_map_grad",
                                          (x.bfloat16(), torch.randn(3, 5).half(), si, probs, rm, False))
    yield "unpermute-grad-mixed-no-probs", ("moe_token_unpermute_with_routing_map_grad",
                                            (x.bfloat16(), torch.randn(3, 5).half(), si, None, None, False))
    yield "permute-grad-unnamed-rows", ("moe_token_permute_with_routing_map_grad",
                                        (x, torch.randn(6), si, rm, 4, 3, False))


@pytest.mark.parametrize("name,case", list(_hand_cases()), ids=[n for n, _ in _hand_cases()])
def test_kernel_same_bits_on_caller_made_indices(name, case):
    op, args = case
    kernel, tables = _pair(op)
    same(_tuple(kernel(*args)), _tuple(tables(*args)))


def _large(op: str, dtype: torch.dtype, drop: bool) -> tuple:
    """A call above the kernels' parallel threshold (T·K·H >= 2**15 items): T = 512, E = 16, K = 4, H = 96."""
    torch.manual_seed(7)
    t, e, k, h = 512, 16, 4, 96
    scores = torch.rand(t, e)
    rm = torch.zeros(t, e, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    rm[::7, 0] = False  # fewer than K experts here and there
    probs = torch.where(rm, scores, 0.0).to(dtype)
    tokens = torch.randn(t, h).to(dtype)
    n = (t // 2) * e if drop else t * k
    if op == "moe_token_permute_with_routing_map":
        return tokens, rm, probs, n, drop
    permuted, permuted_probs, si = gradops.reference.moe_token_permute_with_routing_map(tokens, rm, probs, n, drop)
    grad = torch.randn(permuted.shape).to(dtype)
    if op == "moe_token_permute_with_routing_map_grad":
        return grad, torch.randn(permuted_probs.shape).to(dtype), si, rm, e, t, drop
    if op == "moe_token_unpermute_with_routing_map":
        return grad, si, [t, h], probs, rm, drop
    return grad, tokens, si, probs, rm, drop


@pytest.mark.parametrize("op", ROUTING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("drop", [False, True], ids=["slots", "drop"])
def test_parallel_split_same_bits(op, dtype, drop):
    kernel, tables = _pair(op)
    args = _large(op, dtype, drop)
    expected = _tuple(tables(*args))
    one, two = on_threads([1, 2], lambda: _tuple(kernel(*args)))
    same(one, expected)
    same(two, expected)


def _refusals():
    """(name, op, args) of values the tables refuse, each with the metadata of a call they accept."""
    rm = torch.tensor([[1, 1, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    yield "row-over-k", "moe_token_permute_with_routing_map", (torch.randn(3, 4), rm, None, 6, False)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    g = torch.randn(6, 4)
    yield "row-named-twice", "moe_token_permute_with_routing_map_grad", (g, None, i32(0, 1, 1, 2, 3, 4), None, 3, 3,
                                                                          False)
    yield "row-past-live", "moe_token_permute_with_routing_map_grad", (g, None, i32(0, 1, -1, 2, 3, 9), None, 3, 3,
                                                                        False)
    yield "below-minus-one", "moe_token_unpermute_with_routing_map", (g, i32(0, 1, -2, 2, 3, 4), [3, 4], None, None,
                                                                       False)
    yield "more-live-than-rows", "moe_token_unpermute_with_routing_map", (torch.randn(4, 4), i32(0, 1, 2, 3, 4, -1),
                                                                           [3, 4], None, None, False)
    yield "token-outside", "moe_token_unpermute_with_routing_map_grad", (g, torch.randn(3, 4), i32(0, 1, 2, 3, 1, 2),
                                                                          torch.rand(3, 3), None, True)
    yield "negative-token", "moe_token_permute_with_routing_map_grad", (g, torch.randn(6), i32(0, 1, 2, -1, 1, 2),
                                                                         None, 3, 3, True)


@pytest.mark.parametrize("name,op,args", list(_refusals()), ids=[n for n, _, _ in _refusals()])
def test_kernel_refuses_what_the_tables_refuse(name, op, args):
    kernel, tables = _pair(op)
    with pytest.raises(OpError) as expected:
        tables(*args)
    with pytest.raises(OpError) as got:
        kernel(*args)
    assert (got.value.status, str(got.value)) == (expected.value.status, str(expected.value))
    # The public function, twice: the second call meets the remembered program, whose kernel refuses the value.
    for _ in range(2):
        with pytest.raises(OpError) as public:
            getattr(gradops, op)(*args)
        assert str(public.value) == str(expected.value)


def test_a_token_on_too_many_rows_is_refused():
    """drop_and_pad: a token on more than 512 rows (the gather-sums' limit) is refused as the tables refuse it."""
    e, c = 2, 300
    si = torch.zeros(e * c, dtype=torch.int32)  # token 0 on all 600 rows
    kernel, tables = _pair("moe_token_unpermute_with_routing_map")
    args = (torch.randn(e * c, 3), si, [4, 3], torch.rand(4, e), None, True)
    with pytest.raises(OpError) as expected:
        tables(*args)
    with pytest.raises(OpError) as got:
        kernel(*args)
    assert str(got.value) == str(expected.value)
