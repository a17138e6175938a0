"""Code paths the shared samples cannot reach at interpreter-friendly sizes, forced through the launchers' tile
overrides: looped columns (rows wider than a register tile), several persistent programs and the partial
reduction, split column sums, strided elementwise layouts, multi-step segment sums and gathers. Each case checks
the float64 oracle and the kernel that must have run."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 set before import", allow_module_level=True)
pytest.importorskip("triton")

import torch

import gradops
from gradops import launch
from gradops.families.embedding.kernels import embedding_config
from gradops.kernels.common import row_config
from oracles import assert_matches
from samples import Sample

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["fp32", "fp16", "bf16"]
#: Rows wider than 16 columns take the looped kernels: N = 45 is 3 column blocks with a 13-column tail.
LOOPED = row_config(45, max_block_n=16)


def _rand(*shape, dtype=torch.float32, offset=0.0):
    return (torch.randn(shape) + offset).to(dtype)


def _check(op, fn, args, launches, kernel, **kwargs):
    got = fn(*args, **kwargs)
    assert_matches(op, got, Sample(f"{op}-path", "code path", args))
    assert launches()[kernel] > 0, f"{kernel} did not run: {dict(launches())}"
    return got


# ------------------------------------------------------------------ RmsNorm
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_rms_norm_looped(dtype, launches):
    def keepdim_rstd(*args, **kwargs):  # the oracle gives the public op's keepdim rstd
        y, rstd = launch.rms_norm(*args, **kwargs)
        return y, rstd[:, None]

    x, g = _rand(7, 45, dtype=dtype), _rand(45, dtype=dtype)
    _check("rms_norm", keepdim_rstd, (x, g, 1e-6), launches, "rms_norm_fwd_kernel", config=LOOPED)


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_rms_norm_grad_looped(dtype, launches):
    """7 rows over 3 programs: each program reads-modifies-writes its own partial row, then the reduction."""
    dy, x = _rand(7, 45, dtype=dtype), _rand(7, 45, dtype=dtype)
    rstd = torch.rand(7) + 0.5
    _check("rms_norm_grad", launch.rms_norm_grad, (dy, x, rstd, _rand(45, dtype=dtype)), launches,
           "rms_norm_grad_looped_kernel", config=LOOPED)
    assert launches()["sum_partials_kernel"] == 1


@pytest.mark.parametrize("gamma_dtype", [torch.float16, torch.float32], ids=["gamma-fp16", "gamma-fp32"])
def test_rms_norm_grad_persistent_tiles(gamma_dtype, launches):
    """Narrow rows: 16-row tiles, more tiles than programs (each program loops), a masked tail tile."""
    dy, x = _rand(150, 24, dtype=torch.float16), _rand(150, 24, dtype=torch.float16)
    rstd = torch.rand(150) + 0.5
    _check("rms_norm_grad", launch.rms_norm_grad, (dy, x, rstd, _rand(24, dtype=gamma_dtype)), launches,
           "rms_norm_grad_kernel", config=row_config(24)._replace(block_m=16))
    assert launches()["sum_partials_kernel"] == 1


def test_rms_norm_grad_multi_dim_gamma_strided_rows(launches):
    """gamma of 2 dims through the public op, x a row-sliced view (row stride 2*N, no copy needed)."""
    base = _rand(4, 3, 2, 10)
    x, dy = base[:, :, :, :5], _rand(4, 3, 2, 5)
    gamma, rstd = _rand(2, 5), torch.rand(4, 3) + 0.5
    got = gradops.rms_norm_grad(dy, x, rstd, gamma)
    assert_matches("rms_norm_grad", got, Sample("multi-dim", "gamma (2, 5)", (dy, x, rstd, gamma)))
    assert launches()["rms_norm_grad_kernel"] == 1


def test_rms_norm_grad_workspace(launches):
    """Scratch carved from a caller's workspace gives the same bits; a short workspace is refused."""
    dy, x, g = _rand(40, 30), _rand(40, 30), _rand(30)
    rstd = torch.rand(40) + 0.5
    size = launch.rms_norm_grad_workspace(dy, x, rstd, g, config=row_config(30)._replace(block_m=4))
    assert size >= 3 * 30 * 4
    ws = torch.empty(size, dtype=torch.uint8)
    a = launch.rms_norm_grad(dy, x, rstd, g, workspace=ws, config=row_config(30)._replace(block_m=4))
    b = launch.rms_norm_grad(dy, x, rstd, g, config=row_config(30)._replace(block_m=4))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    with pytest.raises(ValueError, match="workspace"):
        launch.rms_norm_grad(dy, x, rstd, g, workspace=ws[: size // 2], config=row_config(30)._replace(block_m=4))


# ------------------------------------------------------------------ LayerNorm
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_layer_norm_looped(dtype, launches):
    """Chan's merge over column blocks, with a large mean (cancellation-prone)."""
    x = _rand(5, 45, dtype=dtype, offset=50.0)
    _check("layer_norm", launch.layer_norm, (x, _rand(45, dtype=dtype), _rand(45, dtype=dtype), 1e-5), launches,
           "layer_norm_fwd_kernel", config=LOOPED)


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_layer_norm_grad_looped(dtype, launches):
    x, dy = _rand(5, 45, dtype=dtype, offset=1.0), _rand(5, 45, dtype=dtype)
    mean, var = x.float().mean(-1) + 0.1, x.float().var(-1) + 0.2  # statistics used as given (CANN: literally)
    _check("layer_norm_grad", launch.layer_norm_grad, (dy, x, var, mean, _rand(45, dtype=dtype), 1e-5), launches,
           "layer_norm_bwd_looped_kernel", config=LOOPED)


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_layer_norm_backward_looped(dtype, launches):
    """Statistics unrelated to x, as ops-nn's case files draw them: the fused op is aclnnLayerNormBackward's
    (ATen's) formula, without AscendC's sum(x - mean) term (issue 17)."""
    x, dy = _rand(5, 45, dtype=dtype), _rand(5, 45, dtype=dtype)
    mean, rstd = x.float().mean(-1) + 0.3, torch.rsqrt(x.float().var(-1, unbiased=False) + 1e-5) * 1.5
    _check("layer_norm_backward", launch.layer_norm_backward, (dy, x, mean, rstd, _rand(45, dtype=dtype)),
           launches, "layer_norm_bwd_looped_kernel", config=LOOPED)
    assert launches()["sum_partials_kernel"] == 1


def test_layer_norm_backward_tiles_and_workspace(launches):
    x, dy = _rand(70, 20, dtype=torch.bfloat16), _rand(70, 20, dtype=torch.bfloat16)
    mean, rstd = torch.randn(70), torch.rand(70) + 0.5  # unrelated to x: aclnnLayerNormBackward's formula
    cfg = row_config(20)._replace(block_m=8)
    args = (dy, x, mean, rstd, _rand(20))
    ws = torch.empty(launch.layer_norm_backward_workspace(*args, config=cfg), dtype=torch.uint8)
    got = _check("layer_norm_backward", launch.layer_norm_backward, args, launches, "layer_norm_bwd_kernel",
                 config=cfg, workspace=ws)
    plain = launch.layer_norm_backward(*args, config=cfg)
    assert all(torch.equal(p, q) for p, q in zip(got, plain))


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_layer_norm_grad_beta_splits(dtype, launches):
    """70 rows in 8-row steps over several splits and 16-column strips with a tail: split partials + reduction."""
    res, dy = _rand(70, 37, dtype=dtype), _rand(70, 37, dtype=dtype)
    size = launch.layer_norm_grad_beta_workspace(res, dy, block=(16, 8))
    assert size > 0
    _check("layer_norm_grad_beta", launch.layer_norm_grad_beta, (res, dy), launches, "layer_norm_grad_beta_kernel",
           block=(16, 8), workspace=torch.empty(size, dtype=torch.uint8))
    assert launches()["sum_partials_kernel"] == 1


# ------------------------------------------------------------------ Hardswish
def _layouts():
    base = _rand(6, 10, offset=0.0) * 4
    yield "transposed-dense", base.t(), _rand(6, 10).t(), "hardswish_flat_kernel"
    yield "row-sliced", base[:, :7], _rand(6, 7), "hardswish_strided_kernel"
    yield "1d-step", (torch.randn(40) * 4)[::2], torch.randn(20), "hardswish_strided_kernel"
    yield "expanded-grad", base, torch.randn(10).expand(6, 10), "hardswish_strided_kernel"
    yield "4d-strided", (torch.randn(3, 4, 5, 6) * 4)[:, ::2, :, 1:], torch.randn(3, 2, 5, 5), \
        "hardswish_strided_kernel"
    every_other = (slice(None, None, 2),) * 6  # 6 dims, none mergeable: one copy per input, then the flat kernel
    yield "6d-fallback", (torch.randn((3,) * 6) * 4)[every_other], torch.randn((2,) * 6), "hardswish_flat_kernel"


@pytest.mark.parametrize("name,x,g,kernel", list(_layouts()), ids=[c[0] for c in _layouts()])
def test_hardswish_layouts(name, x, g, kernel, launches):
    assert not (x.is_contiguous() and g.is_contiguous())
    _check("hardswish_backward", launch.hardswish_backward, (g, x), launches, kernel)
    _check("hardswish", launch.hardswish, (x,), launches, kernel)


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_hardswish_boundaries(dtype, launches):
    """Closed interval: d(-3) = -0.5, d(3) = 1.5; NaN x passes the gradient through; 5000 elements = 2 blocks."""
    x = torch.cat([torch.tensor([-3.0, 3.0, -3.5, 3.5, float("nan"), 0.0]), torch.randn(4994) * 4]).to(dtype)
    g = torch.ones_like(x)
    out = _check("hardswish_backward", launch.hardswish_backward, (g, x), launches, "hardswish_flat_kernel")
    assert out[:5].float().tolist() == [-0.5, 1.5, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_hardswish_backward_every_half_value_same_bits_as_the_reference(dtype, launches):
    """Every bit pattern of x: the kernel's x·float32(1/3) + 0.5 rounds as the reference's (and CANN's) does."""
    from gradops import reference

    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(dtype)
    got = launch.hardswish_backward(g, x)
    assert torch.equal(got.view(torch.int16), reference.hardswish_backward(g, x).view(torch.int16))
    assert launches()["hardswish_flat_kernel"] == 1


# ------------------------------------------------------------------ Embedding
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_embedding_segments(dtype, launches):
    """Segments longer than BLOCK_T (3 steps of 4), rows no index names (zero), E split in 8-column blocks with a
    tail, padding and scale."""
    idx = torch.cat([torch.full((11,), 2), torch.randint(0, 13, (20,))])
    grad = _rand(31, 19, dtype=dtype)
    cfg = embedding_config(19, block_t=4, block_e=8)
    args = (grad, idx, 13, 5, True)
    size = launch.embedding_dense_backward_workspace(*args)
    _check("embedding_dense_backward", launch.embedding_dense_backward, args, launches,
           "embedding_dense_backward_kernel", config=cfg, workspace=torch.empty(size, dtype=torch.uint8))
    again = launch.embedding_dense_backward(*args, config=cfg)
    assert torch.equal(again, launch.embedding_dense_backward(*args, config=cfg))


def test_embedding_strided_grad(launches):
    grad = _rand(12, 16)[:, ::2]
    _check("embedding_dense_backward", launch.embedding_dense_backward, (grad, torch.randint(0, 4, (12,)), 4, 0, False),
           launches, "embedding_dense_backward_kernel")


# ------------------------------------------------------------------ MoE permute
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_moe_grad_blocks_and_drops(dtype, launches):
    """K = 5, tokens not a multiple of BLOCK_T, 8-column blocks with a tail, 20 of 35 rows present."""
    perm = torch.randperm(35, dtype=torch.int32)
    _check("moe_token_permute_grad", launch.moe_token_permute_grad, (_rand(20, 21, dtype=dtype), perm, 5), launches,
           "moe_token_permute_grad_kernel", block_h=8)


def test_moe_grad_k512_int64(launches):
    _check("moe_token_permute_grad", launch.moe_token_permute_grad,
           (_rand(1000, 3), torch.randperm(1024), 512), launches, "moe_token_permute_grad_kernel")


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_moe_permute_blocks(dtype, launches):
    tokens, idx = _rand(9, 21, dtype=dtype)[:, :19], torch.randint(0, 4, (9, 3), dtype=torch.int32)
    size = launch.moe_token_permute_workspace(tokens, idx, 20)
    _check("moe_token_permute", launch.moe_token_permute, (tokens, idx, 20), launches, "moe_token_permute_kernel",
           block_h=8, workspace=torch.empty(size, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_moe_unpermute_blocks_and_drops(dtype, launches):
    """K = 5, tokens not a multiple of BLOCK_T, 8-column blocks with a tail, 20 of 35 rows present, probs in
    another dtype than the tokens."""
    perm, probs = torch.randperm(35, dtype=torch.int32), torch.rand(7, 5)
    _check("moe_token_unpermute", launch.moe_token_unpermute, (_rand(20, 21, dtype=dtype), perm, probs), launches,
           "moe_token_unpermute_kernel", block_h=8)


@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_moe_unpermute_grad_blocks_and_drops(dtype, launches):
    """The same layout backwards: each program loops K and the column blocks for the probs' dot products."""
    perm, probs = torch.randperm(35), torch.rand(7, 5, dtype=dtype)
    args = (_rand(20, 21, dtype=dtype), _rand(7, 21, dtype=dtype), perm, probs)
    _check("moe_token_unpermute_grad", launch.moe_token_unpermute_grad, args, launches,
           "moe_token_unpermute_grad_kernel", block_h=8)


@pytest.mark.parametrize("bad", [[0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 4, 6], [-1, 1, 2, 3, 4, 5]],
                         ids=["repeated", "at-TK", "negative"])
def test_moe_unpermute_kernels_refuse_a_non_permutation(bad):
    si = torch.tensor(bad, dtype=torch.int32)
    for fn, args in ((launch.moe_token_unpermute, (torch.randn(6, 3), si, torch.rand(3, 2))),
                     (launch.moe_token_unpermute_grad, (torch.randn(6, 3), torch.randn(3, 3), si, torch.rand(3, 2)))):
        with pytest.raises(gradops.OpError) as info:
            fn(*args)
        assert info.value.status == 161002 and "sorted_indices" in str(info.value)


# ------------------------------------------------------------------ out=
def test_out_written_in_place(launches):
    """The public ``out=`` reaches the launchers: results land in the caller's tensors (no copy)."""
    dy, x, g = _rand(9, 12, dtype=torch.bfloat16), _rand(9, 12, dtype=torch.bfloat16), _rand(12)
    rstd = torch.rand(9) + 0.5
    outs = (torch.empty(9, 12, dtype=torch.bfloat16), torch.empty(12))
    got = gradops.rms_norm_grad(dy, x, rstd, g, out=outs)
    assert got[0].data_ptr() == outs[0].data_ptr() and got[1].data_ptr() == outs[1].data_ptr()
    assert_matches("rms_norm_grad", tuple(outs), Sample("out", "out=", (dy, x, rstd, g)))
    hs_out = torch.empty(6, 10)
    xt = _rand(10, 6).t()  # dense but transposed: out has other strides, so the strided kernel writes it
    gradops.hardswish_backward(torch.ones(6, 10), xt, out=hs_out)
    assert_matches("hardswish_backward", hs_out, Sample("out", "out=", (torch.ones(6, 10), xt)))
    assert launches()["rms_norm_grad_kernel"] == 1 and launches()["hardswish_strided_kernel"] == 1


# ------------------------------------------------------------------ indices never trusted (issue 15)
@pytest.mark.parametrize("bad", [10, -1, 2**40], ids=["at-V", "negative", "huge"])
def test_embedding_kernel_refuses_bad_indices(bad):
    """The launcher's range flag (read at once under the interpreter, deferred on CUDA): the public OpError text;
    the kernel itself reads only sorted positions of in-table indices."""
    with pytest.raises(gradops.OpError) as info:
        launch.embedding_dense_backward(torch.randn(5, 3), torch.tensor([1, 2, bad, 4, bad]), 10, -1, False)
    assert info.value.status == 161002 and f"got {bad} at flat position 2" in str(info.value)
    with pytest.raises(gradops.OpError, match="at flat position 0"):  # an empty table: every index is outside
        launch.embedding_dense_backward(torch.randn(2, 3), torch.tensor([0, 0]), 0, -1, False)



def test_public_embedding_backward_tests_integer_indices_once(monkeypatch):
    """On the Triton backend the public function leaves the range test of integer indices to the launcher (on CUDA
    the ops layer's own test is six more device calls per call): the refusal is the same OpError; float indices
    (truncated, NaN refused) still take the ops layer's test."""

    from gradops.families.embedding import ops as module
    calls = []
    real = module.checked_indices
    monkeypatch.setattr(module, "checked_indices", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    with pytest.raises(gradops.OpError, match="got 12 at flat position 1"):
        gradops.embedding_dense_backward(torch.randn(3, 4), torch.tensor([1, 12, 2]), 10)
    ok = gradops.embedding_dense_backward(torch.randn(3, 4), torch.tensor([1, 5, 2]), 10)
    assert ok.shape == (10, 4) and calls == []
    with pytest.raises(gradops.OpError, match="got nan at flat position 2"):
        gradops.embedding_dense_backward(torch.randn(3, 4), torch.tensor([1.0, 5.5, float("nan")]), 10)
    assert calls == [torch.float32]

@pytest.mark.parametrize("bad", [8, -1], ids=["at-TK", "negative"])
def test_moe_grad_kernel_refuses_bad_sorted_indices(bad, launches):
    si = torch.tensor([0, 1, 2, bad, 4, 5, 6, 7], dtype=torch.int32)
    with pytest.raises(gradops.OpError, match=f"got {bad} at position 3"):
        launch.moe_token_permute_grad(torch.randn(8, 3), si, 2)


def test_changed_saved_indices_refused_by_the_triton_backward():
    """The eager backward reuses the forward's indices without a host check; the kernel's flag catches a change
    made behind autograd's back."""
    import numpy as np

    arr = np.array([1, 2, 3])
    emb = gradops.nn.Embedding(10, 4)
    y = emb(torch.from_numpy(arr))
    arr[1] = -5
    with pytest.raises(gradops.OpError, match="got -5 at flat position 1"):
        y.sum().backward()


@pytest.mark.interpreter
@pytest.mark.parametrize("config", [None, LOOPED], ids=["tile", "looped"])
@pytest.mark.parametrize("dtype", FLOATS, ids=IDS)
def test_layer_norm_constant_rows_give_beta_exactly(config, dtype):
    # The mean of x - x[0]: a constant row's mean is x[0] exactly, so y = beta even where eps = 1e-12 makes rstd
    # ~1e6 (sum(x) / N missed 45 copies of 0.1 by an ulp).
    n = 45
    x = torch.tensor([0.1, 1.7, -3.3, 1e4]).to(dtype)[:, None].expand(4, n).contiguous()
    gamma, beta = _rand(n, dtype=dtype), _rand(n, dtype=dtype)
    y, mean, var = launch.layer_norm(x, gamma, beta, 1e-12, config=config)
    assert torch.equal(y, beta.expand(4, n)) and torch.equal(mean, x[:, 0].float()) and not var.any()
