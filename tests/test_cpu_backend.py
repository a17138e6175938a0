"""The CPU kernels (C++, gradops.native): selection and fallback, bit-exact results whatever the thread count,
bfloat16/float16 rounding, ``out=`` on every op and sample, the workspace hook and the output pool.

Correctness against the float64 oracles on every sample runs in test_ops.py (its ``backend`` fixture covers
``cpu``); here the same samples go through ``out=`` on both CPU backends.
"""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import gradops
from gradops import backend, native, reference
from gradops.status import ACLNN_ERR_PARAM_INVALID, OpError
from oracles import assert_matches
from samples import OPS, samples

cpu = importlib.import_module("gradops.cpu")
pool = importlib.import_module("gradops.cpu._pool")

OUT_CASES = [pytest.param(op, s, id=f"{op}-{s.name}") for op in OPS for s in samples(op)]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equal means bit-identical (NaN payloads and signed zeros included)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


# ---------------------------------------------------------------- selection
def test_auto_selects_the_compiled_backend_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("GRADOPS_BACKEND", "auto")
    for op in cpu.__all__:
        if hasattr(gradops.reference, op):  # the kernels, not the hooks (``*_workspace``)
            assert backend.select(op, torch.device("cpu")) == ("cpu", getattr(cpu, op)), op


def test_falls_back_to_torch_without_the_kernels(monkeypatch):
    """CPU kernels that cannot be had (the build failed: no compiler) leave auto mode on the pure-torch path; naming
    cpu raises."""
    why = "the native CPU kernels could not be built (simulated: no compiler)"

    def not_built():
        raise ImportError(why)

    monkeypatch.setattr(native, "kernels", not_built)
    monkeypatch.setattr(native, "_failure", why)
    for name in [m for m in sys.modules if m == "gradops.cpu" or m.startswith("gradops.cpu.")]:
        monkeypatch.delitem(sys.modules, name)
    backend._module.cache_clear()
    try:
        with pytest.raises(ImportError):
            importlib.import_module("gradops.cpu")
        monkeypatch.setenv("GRADOPS_BACKEND", "auto")
        monkeypatch.setattr(backend, "_slow_path_warned", False)
        with pytest.warns(backend.SlowPathWarning, match="could not be built"):
            name, fn = backend.select("rms_norm_grad", torch.device("cpu"))
        assert name == "torch" and fn is reference.rms_norm_grad
        x, dy, g = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
        rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
        dx, dg = gradops.rms_norm_grad(dy, x, rstd, g)
        ref = reference.rms_norm_grad(dy, x, rstd, g)
        assert torch.equal(dx, ref[0]) and torch.equal(dg, ref[1])
        monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
        with pytest.raises(RuntimeError, match="could not be built"):
            backend.select("rms_norm_grad", torch.device("cpu"))
    finally:
        monkeypatch.undo()
        backend._module.cache_clear()


# ---------------------------------------------------------------- determinism across thread counts
def _thread_cases():
    """Above the parallel threshold with an uneven split (301 x 200: row blocks of 76, 76, 76 and 73 rows),
    duplicated embedding rows, K = 3."""
    g = torch.Generator().manual_seed(6)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x, dy = torch.randn(301, 200, generator=g).to(dt), torch.randn(301, 200, generator=g).to(dt)
        gamma = torch.randn(200, generator=g).to(dt)
        rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
        mean = x.float().mean(-1)
        idx = torch.randint(0, 17, (301,), generator=g)
        perm = torch.randperm(300, generator=g)
        name = str(dt).removeprefix("torch.")
        yield pytest.param(cpu.rms_norm_grad, (dy, x, rstd, gamma), id=f"rms_norm_grad-{name}")
        yield pytest.param(cpu.layer_norm_backward, (dy, x, mean, rstd, gamma), id=f"layer_norm_backward-{name}")
        yield pytest.param(cpu.layer_norm_grad_beta, (x, dy), id=f"layer_norm_grad_beta-{name}")
        yield pytest.param(cpu.embedding_dense_backward, (dy, idx, 20, 3, True), id=f"embedding-{name}")
        yield pytest.param(cpu.moe_token_permute_grad, (dy[:250], perm, 3), id=f"moe-{name}")


@pytest.mark.parametrize("fn,args", list(_thread_cases()))
def test_bitwise_identical_whatever_the_thread_count(fn, args):
    """The kernels run on torch's intra-op threads (native/kernels.h): one thread and two give the same bits."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _as_tuple(fn(*args))
        torch.set_num_threads(2)
        two = _as_tuple(fn(*args))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(_bits(a), _bits(b))


def test_serial_and_parallel_loops_give_the_same_bits():
    """Below PARALLEL_MIN items a kernel runs its rows on the calling thread, above it splits them over threads: the
    bits of a row do not depend on which loop ran it (LayerNorm's and RmsNorm's forwards: the same rows alone, and
    inside an input large enough for the parallel loop)."""
    from gradops.cpu._host import PARALLEL_MIN

    g = torch.Generator().manual_seed(9)
    m, n = 37, 50  # 1850 items: the serial loop
    assert m * n < PARALLEL_MIN
    x, gamma, beta = torch.randn(m, n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g)
    big = torch.cat([x, torch.randn(PARALLEL_MIN // n + 1, n, generator=g)])  # the parallel loop
    y, mean, var = cpu.layer_norm(x, gamma, beta, 1e-5)
    y2, mean2, var2 = cpu.layer_norm(big, gamma, beta, 1e-5)
    assert all(torch.equal(a, b[:m]) for a, b in ((y, y2), (mean, mean2), (var, var2)))
    y, rstd = cpu.rms_norm(x, gamma, 1e-6)
    y2, rstd2 = cpu.rms_norm(big, gamma, 1e-6)
    assert torch.equal(y, y2[:m]) and torch.equal(rstd, rstd2[:m])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_sorting_and_counting_paths_give_the_same_bits(dtype):
    """Fewer indices than table rows take the sorting path (no pass over V offsets); the rows they touch equal the
    counting sort's bit for bit (each row sums its gradient rows in increasing position either way)."""
    g = torch.Generator().manual_seed(10)
    idx = torch.randint(0, 12, (40,), generator=g)  # heavy duplicates: sums of up to ~8 rows
    grad = torch.randn(40, 33, generator=g).to(dtype)
    for scale in (False, True):
        counting = cpu.embedding_dense_backward(grad, idx, 40, 3, scale)  # T = V: counting sort
        sorting = cpu.embedding_dense_backward(grad, idx, 41, 3, scale)  # T < V: sorting path
        assert torch.equal(counting, sorting[:40]) and not sorting[40].any()
        assert not counting[3].any() and counting[idx[0]].any()  # the padding row stays zero; a used row does not


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_hardswish_backward_same_bits_as_the_reference(dtype):
    """One formula, one result: x·float32(1/3) is rounded before the + 0.5 on every backend (CANN's Muls then
    Adds). Every bf16 / fp16 bit pattern of x (NaN and infinities included), and for float32 a dense sweep of
    [-4, 4] with the points where an FMA would keep the product unrounded (x = -1.5 gave -1.49e-8·g, not 0)."""
    g = torch.Generator().manual_seed(11)
    if dtype == torch.float32:
        x = torch.cat([torch.tensor([-1.5, -0.75, 1.5, -3.0, 3.0]), torch.linspace(-4, 4, 400_001)])
    else:
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    grad = torch.randn(x.shape, generator=g).to(dtype)
    got = cpu.hardswish_backward(grad, x)
    assert torch.equal(_bits(got), _bits(reference.hardswish_backward(grad, x)))
    at = x == -1.5
    assert at.any() and not got[at].any(), "d(-1.5) = -1.5·(1/3) + 0.5 must be exactly 0"


# ---------------------------------------------------------------- half-precision rounding
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_results_round_to_nearest_even(dtype):
    """pd_beta of two rows is one float32 add rounded once: it must equal torch's float32 -> half cast bit for
    bit, over random values, exact ties (both directions), infinities, overflow and NaN."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(20000, generator=g) * 4).to(dtype)
    b = (torch.randn(20000, generator=g) * 4).to(dtype)
    eps = torch.finfo(dtype).eps
    ties = torch.tensor([[1.0, eps / 2], [1.0 + eps, eps / 2], [-1.0, -eps / 2], [-(1.0 + eps), -eps / 2]])
    big = torch.finfo(dtype).max
    special = torch.tensor([[float("inf"), 1.0], [big, big], [float("nan"), 1.0], [-float("inf"), -1.0]])
    rows = torch.cat([torch.stack([a, b], 1).float(), ties, special]).to(dtype)
    dy = rows.t().contiguous()  # (2, n): pd_beta[j] = dy[0, j] + dy[1, j]
    _, pd_beta = cpu.layer_norm_grad_beta(dy, dy)
    expected = (dy[0].float() + dy[1].float()).to(dtype)
    finite = ~expected.isnan()
    assert torch.equal(pd_beta[finite].view(torch.int16), expected[finite].view(torch.int16))
    assert torch.equal(pd_beta.isnan(), expected.isnan())  # NaN stays NaN (payload may differ)
    assert pd_beta[-4].isinf() and pd_beta[-3].isinf()


# ---------------------------------------------------------------- out=
@pytest.mark.parametrize("op,sample", OUT_CASES)
def test_out_writes_the_same_bits_into_the_given_tensors(op, sample, backend):
    fn = getattr(gradops, op)
    fresh = _as_tuple(fn(*sample.args, **sample.kwargs))
    outs = tuple(torch.full_like(t, 7) for t in fresh)
    got = _as_tuple(fn(*sample.args, **sample.kwargs, out=outs if len(outs) > 1 else outs[0]))
    assert all(g is o for g, o in zip(got, outs)), f"{op}: out= must return the given tensors"
    assert_matches(op, got, sample)
    for a, b in zip(got, fresh):
        assert torch.equal(a, b) or ((a.isnan() == b.isnan()).all() and torch.equal(a[~a.isnan()], b[~b.isnan()]))


def test_out_may_be_non_contiguous(backend):
    x, dy, g = torch.randn(6, 32), torch.randn(6, 32), torch.randn(32)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    dx = torch.empty(32, 6).t()
    got = gradops.rms_norm_grad(dy, x, rstd, g, out=(dx, torch.empty(32)))
    assert got[0] is dx and torch.equal(dx, gradops.rms_norm_grad(dy, x, rstd, g)[0])
    h = torch.empty(32, 6).t()
    assert torch.equal(gradops.hardswish_backward(dy, x, out=h), gradops.hardswish_backward(dy, x))


def test_out_is_validated():
    x, dy, g = torch.randn(6, 32), torch.randn(6, 32), torch.randn(32)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    bad = {
        "wrong shape": (torch.empty(6, 31), torch.empty(32)),
        "wrong dtype": (torch.empty(6, 32, dtype=torch.float16), torch.empty(32)),
        "overlaps an input": (dy, torch.empty(32)),
        "outs overlap": ((buf := torch.empty(6 * 32 + 32))[:192].view(6, 32), buf[160:]),
        "not a tuple": torch.empty(6, 32),
    }
    for why, out in bad.items():
        with pytest.raises(OpError) as err:
            gradops.rms_norm_grad(dy, x, rstd, g, out=out)
        assert err.value.status == ACLNN_ERR_PARAM_INVALID, why
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        gradops.hardswish(x.requires_grad_(), out=torch.empty(6, 32))


# ---------------------------------------------------------------- an output that is an input
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_hardswish_kernels_give_the_same_bits_into_an_input(dtype):
    """The native node writes dx into the upstream gradient it owns (nodes.h's owned_like): the kernels read a
    step's items before they write them, so an output that is an input gets a separate output's bits - over whole
    8-item steps, a tail, and the parallel chunks (from PARALLEL_MIN items)."""
    from gradops.cpu._host import PARALLEL_MIN, kernel

    g = torch.Generator().manual_seed(5)
    for n in (1, 7, 8, 13, 210, PARALLEL_MIN + 5):
        x = (torch.rand(n, generator=g) * 12 - 6).to(dtype)
        grad = torch.randn(n, generator=g).to(dtype)
        into = grad.clone()
        kernel("hardswish_backward", (into, x), (into,))
        assert torch.equal(_bits(into), _bits(cpu.hardswish_backward(grad, x))), n
        into = x.clone()
        kernel("hardswish", (into,), (into,))
        assert torch.equal(_bits(into), _bits(cpu.hardswish(x))), n


# ---------------------------------------------------------------- workspace hook and output pool
def test_workspace_hook_carves_scratch_and_checks_its_size():
    x, dy, g = torch.randn(100, 48), torch.randn(100, 48), torch.randn(48)
    rstd, mean = torch.rand(100) + 0.5, torch.randn(100)
    idx = torch.randint(0, 9, (100,))
    calls = [("rms_norm_grad", (dy, x, rstd, g)), ("layer_norm_backward", (dy, x, mean, rstd, g)),
             ("layer_norm_grad_beta", (x, dy)), ("embedding_dense_backward", (dy, idx, 10, 2, True))]
    for op, args in calls:
        nbytes = getattr(cpu, f"{op}_workspace")(*args)
        assert nbytes > 0
        plain = _as_tuple(getattr(cpu, op)(*args))
        carved = _as_tuple(getattr(cpu, op)(*args, workspace=torch.empty(nbytes, dtype=torch.uint8)))
        assert all(torch.equal(a, b) for a, b in zip(plain, carved)), op
        with pytest.raises(ValueError, match="workspace"):
            getattr(cpu, op)(*args, workspace=torch.empty(nbytes - 1, dtype=torch.uint8))


def test_empty_cache_hands_back_what_the_pool_holds(monkeypatch):
    """After every output died the pool still holds their memory; gradops.empty_cache() releases it, says how
    much, and the ops work as before afterwards."""
    monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
    monkeypatch.setenv(pool.ENV, "64")
    pool.clear()
    x, dy, g = torch.randn(512, 1024), torch.randn(512, 1024), torch.randn(1024)  # 2 MiB outputs: pooled
    rstd = gradops.rms_norm(x, g)[1]
    dx, dgamma = gradops.rms_norm_grad(dy, x, rstd, g)
    expected = dx.clone()
    del dx, dgamma
    held = pool.free_bytes()
    assert held >= 2 << 20
    assert gradops.empty_cache() == held and pool.free_bytes() == 0
    assert gradops.empty_cache() == 0
    assert torch.equal(gradops.rms_norm_grad(dy, x, rstd, g)[0], expected)
    assert pool.free_bytes() >= 2 << 20  # the dead output went back to the pool: it still recycles


def test_pool_recycles_only_dead_outputs(monkeypatch):
    monkeypatch.setenv(pool.ENV, "64")
    pool.clear()
    shape = (512, 1024)  # 2 MiB fp32, above the pool's 1 MiB floor
    a = pool.empty(shape, torch.float32)
    b = pool.empty(shape, torch.float32)
    assert a.data_ptr() != b.data_ptr()
    address = a.data_ptr()
    a.fill_(1.0)
    del a
    assert pool.free_bytes() == 2 << 20
    c = pool.empty(shape, torch.float32)
    assert c.data_ptr() == address and pool.free_bytes() == 0
    view = c[1:]  # a view keeps the block alive
    del c
    assert pool.free_bytes() == 0
    del view
    assert pool.free_bytes() == 2 << 20
    monkeypatch.setenv(pool.ENV, "0")
    pool.clear()
    d = pool.empty(shape, torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == shape
    del d
    assert pool.free_bytes() == 0  # pool off: nothing kept


def test_pool_floor_and_block_alignment(monkeypatch):
    """Below 1 MiB outputs are plain tensors; from it on they recycle. The extension's blocks are page-aligned
    mappings of their own, 2 MiB-aligned (for transparent huge pages) from 4 MiB on."""
    monkeypatch.setenv(pool.ENV, "64")
    pool.clear()
    floor = pool.MIN_BYTES
    below = pool.empty((floor // 4 - 1,), torch.float32)
    del below
    assert pool.free_bytes() == 0
    at = pool.empty((floor // 4,), torch.float32)
    address = at.data_ptr()
    del at
    assert pool.free_bytes() == floor
    again = pool.empty((floor // 4,), torch.float32)
    assert again.data_ptr() == address
    if pool._native is not None:
        assert address % 4096 == 0
        huge = pool.empty((1 << 20,), torch.float32)  # 4 MiB
        assert huge.data_ptr() % (2 << 20) == 0
        huge.fill_(2.0)  # the whole mapping is writable
        assert huge.sum().item() == 2 << 20
    del again
    assert gradops.empty_cache() >= floor
