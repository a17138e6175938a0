"""The Triton kernels on real hardware, and their sm_90 builds.

- ``test_sm90_build_*`` (no device needed, main tier): every kernel at the tiles the heuristics pick compiles
  for Hopper (sm_90a) through Triton's own ptxas, with no register spills. Catches what the interpreter cannot:
  GPU-only type errors in loops/masks and tiles that outgrow the register file.
- ``gpu``-marked tests (skipped without CUDA): large shapes against the reference in float64, the looped
  65536-column paths, tensors over 2^31 elements (int64 offsets), bit-for-bit determinism across runs, and
  launch counters proving the Triton path ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETING
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (and TRITON_INTERPRET unset)")


# ----------------------------------------------------------------------------------------- sm_90 builds
def _build(kernel, ptrs: dict, consts: dict, warps: int, floats=(), i64=()) -> str | None:
    """Compile ``kernel`` for sm_90 and return ptxas' resource report (``-v``); None when Triton's bundled ptxas
    is missing (the kernel was still compiled to PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in consts else "*" + ptrs[a] if a in ptrs else "fp32" if a in floats
           else "i64" if a in i64 else "i32" for a in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        return subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)


def _builds():
    if INTERPRETING:
        return []
    from gradops.families.embedding import kernels as embedding
    from gradops.families.hardswish import kernels as hardswish
    from gradops.families.layer_norm import kernels as layer_norm
    from gradops.families.moe import kernels as moe_permute
    from gradops.families.rms_norm import kernels as rms_norm
    from gradops.kernels import common

    bf = "bf16"
    rms = {"DY": bf, "X": bf, "RSTD": "fp32", "G": bf, "DX": bf, "PART": "fp32"}
    ln = {"DY": bf, "X": bf, "MEAN": "fp32", "STAT": "fp32", "G": bf, "DX": bf, "RES": bf, "PG": "fp32", "PB": "fp32"}
    out = []
    for n in (128, 1024, 4096, 8192, 65536):
        c = common.row_config(n)
        tile = {"BLOCK_N": c.block_n} if c.looped else {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}
        grad = rms_norm.rms_norm_grad_looped_kernel if c.looped else rms_norm.rms_norm_grad_kernel
        out.append((f"rms_norm_grad-N{n}", grad, rms, tile, c.num_warps, ()))
        lnb = layer_norm.layer_norm_bwd_looped_kernel if c.looped else layer_norm.layer_norm_bwd_kernel
        for fused in (False, True):
            flags = {"FROM_VAR": not fused, "WRITE_RES": not fused, "PARTIALS": fused, "MEAN_TERM": not fused}
            out.append((f"layer_norm_bwd-N{n}-fused{fused}", lnb, ln, {**tile, **flags}, c.num_warps, ("eps",)))
        fwd = {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "LOOPED": c.looped}
        out.append((f"rms_norm_fwd-N{n}", rms_norm.rms_norm_fwd_kernel, {"X": bf, "G": bf, "Y": bf, "RSTD": "fp32"},
                    fwd, c.num_warps, ("eps",)))
        out.append((f"layer_norm_fwd-N{n}", layer_norm.layer_norm_fwd_kernel,
                    {"X": bf, "G": bf, "B": bf, "Y": bf, "MEAN": "fp32", "VAR": "fp32"}, fwd, c.num_warps, ("eps",)))
    bm, bn, _ = layer_norm.grad_beta_config(16384, 4096, 132)
    out.append(("layer_norm_grad_beta", layer_norm.layer_norm_grad_beta_kernel,
                {"RES": bf, "DY": bf, "PG": "fp32", "PB": "fp32"}, {"BLOCK_M": bm, "BLOCK_N": bn}, 8, ()))
    out.append(("sum_partials", common.sum_partials_kernel, {"PA": "fp32", "OA": "fp32", "PB": "fp32", "OB": "fp32"},
                {"TWO": True, "BLOCK_P": 32, "BLOCK_N": 128}, 4, ()))
    for backward in (False, True):
        out.append((f"hardswish_flat-bwd{backward}", hardswish.hardswish_flat_kernel, {"G": bf, "X": bf, "OUT": bf},
                    {"BACKWARD": backward, "BLOCK": hardswish.FLAT_BLOCK}, hardswish.FLAT_WARPS, ()))
        br, bc, w = hardswish.strided_blocks(4096)
        out.append((f"hardswish_strided-bwd{backward}", hardswish.hardswish_strided_kernel,
                    {"G": bf, "X": bf, "OUT": bf}, {"BACKWARD": backward, "BLOCK_R": br, "BLOCK_C": bc}, w, ()))
    e = embedding.embedding_config(4096)
    out.append(("embedding", embedding.embedding_dense_backward_kernel,
                {"G": bf, "KEYS": "i64", "PERM": "i64", "OFFS": "i64", "OUT": bf},
                {"SCALE": True, "BLOCK_T": e.block_t, "BLOCK_E": e.block_e}, e.num_warps, ()))
    for h in (128, 7168):
        bt, bh, w = moe_permute.moe_blocks(h)
        out.append((f"moe_grad-H{h}", moe_permute.moe_token_permute_grad_kernel, {"G": bf, "IDX": "i32", "OUT": bf},
                    {"BLOCK_T": bt, "BLOCK_H": bh}, w, ()))
        out.append((f"moe_permute-H{h}", moe_permute.moe_token_permute_kernel,
                    {"TOK": bf, "FIRST": "i64", "PERM": bf, "INV": "i32"}, {"BLOCK_J": bt, "BLOCK_H": bh}, w, ()))
    return out


@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1 replaces kernels by interpreted functions")
@pytest.mark.parametrize("name,kernel,ptrs,consts,warps,floats", _builds(), ids=[b[0] for b in _builds()])
def test_sm90_build(name, kernel, ptrs, consts, warps, floats):
    report = _build(kernel, ptrs, consts, warps, floats)
    if report is None:  # visibly: a pass here would claim a spill check that did not run
        pytest.skip("compiled to PTX; Triton's bundled ptxas is missing, so register spills are not checked")
    assert "Used" in report, f"{name}: ptxas printed no resource report: {report!r}"
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
    assert not any(spills), f"{name}: register spills at the default tile ({report.strip()})"


@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1 replaces kernels by interpreted functions")
def test_a_missing_ptxas_skips_the_spill_check_visibly(monkeypatch):
    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: not str(p).endswith("ptxas") and real(p))
    name, kernel, ptrs, consts, warps, floats = _builds()[0]
    with pytest.raises(pytest.skip.Exception, match="ptxas is missing"):
        test_sm90_build(name, kernel, ptrs, consts, warps, floats)


# ----------------------------------------------------------------------------------------- on the device
@pytest.fixture
def launches():
    from gradops.launch import LAUNCHES

    before = LAUNCHES.copy()
    return lambda: LAUNCHES - before


def _close(got, ref, n):
    """The oracle module's derived bound: one output ulp plus 8 sqrt(n) fp32 roundoffs, scaled by max|ref|."""
    from oracles import tolerance

    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((got.double() - ref.double()).abs().max()) if ref.numel() else 0.0
    assert err <= tolerance(got.dtype, n, scale), f"max error {err:.3e} (scale {scale:.3e}, n={n})"


@gpu
@pytest.mark.parametrize("n", [4096, 16384, 65536])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_grad_large(n, dtype, launches):
    import gradops
    from gradops import reference

    m = 2048 if n < 65536 else 256
    x, dy = torch.randn(m, n, device="cuda", dtype=dtype), torch.randn(m, n, device="cuda", dtype=dtype)
    gamma = torch.randn(n, device="cuda", dtype=dtype)
    _, rstd = gradops.rms_norm(x, gamma, 1e-6)
    dx, dg = gradops.rms_norm_grad(dy, x, rstd, gamma)
    rdx, rdg = reference.rms_norm_grad(dy, x, rstd.reshape(m), gamma, compute=torch.float64)
    _close(dx, rdx, n)
    _close(dg, rdg, m)
    again = gradops.rms_norm_grad(dy, x, rstd, gamma)
    assert torch.equal(dx, again[0]) and torch.equal(dg, again[1]), "not bitwise deterministic"
    assert launches()["rms_norm_grad_looped_kernel" if n > 8192 else "rms_norm_grad_kernel"] == 2


@gpu
@pytest.mark.parametrize("n", [1024, 8192, 65536])
def test_layer_norm_backward_large(n, launches):
    import gradops
    from gradops import reference

    m = 4096 if n < 65536 else 256
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    gamma, beta = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    _y, mean, var = gradops.layer_norm(x, gamma, beta, 1e-5)
    rstd = torch.rsqrt(var + 1e-5)
    got = gradops.layer_norm_backward(dy, x, mean, rstd, gamma)
    ref = reference.layer_norm_backward(dy, x, mean, rstd, gamma, compute=torch.float64)
    for g, r, length in zip(got, ref, (n, m, m)):
        _close(g, r, length)
    again = gradops.layer_norm_backward(dy, x, mean, rstd, gamma)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not bitwise deterministic"
    _, res = gradops.layer_norm_grad(dy, x, var, mean, gamma, 1e-5)
    pg, pb = gradops.layer_norm_grad_beta(res, dy)
    rg, rb = reference.layer_norm_grad_beta(res, dy, compute=torch.float64)
    _close(pg, rg, m)
    _close(pb, rb, m)
    assert launches()["layer_norm_grad_beta_kernel"] == 1


@gpu
def test_embedding_large_vocab(launches):
    import gradops
    from gradops import reference

    v, t, e = 128256, 8192, 1024
    idx = torch.randint(0, v, (t,), device="cuda")
    idx[:2000] = 7  # a heavy segment
    grad = torch.randn(t, e, device="cuda", dtype=torch.bfloat16)
    out = gradops.embedding_dense_backward(grad, idx, v, padding_idx=3, scale_grad_by_freq=True)
    ref = reference.embedding_dense_backward(grad, idx, v, 3, True, compute=torch.float64)
    _close(out, ref, 2000)
    assert torch.equal(out, gradops.embedding_dense_backward(grad, idx, v, padding_idx=3, scale_grad_by_freq=True))
    assert launches()["embedding_dense_backward_kernel"] == 2


@gpu
def test_moe_permute_roundtrip_large(launches):
    import gradops
    from gradops import reference

    t, k, h = 4096, 8, 7168
    tokens = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    experts = torch.randint(0, 64, (t, k), device="cuda")
    permuted, sorted_idx = gradops.moe_token_permute(tokens, experts)
    rperm, ridx = reference.moe_token_permute(tokens, experts, t * k)
    assert torch.equal(permuted, rperm) and torch.equal(sorted_idx, ridx)
    grad = torch.randn_like(permuted)
    out = gradops.moe_token_permute_grad(grad, sorted_idx, k)
    _close(out, reference.moe_token_permute_grad(grad, sorted_idx, k, compute=torch.float64), k)
    assert torch.equal(out, gradops.moe_token_permute_grad(grad, sorted_idx, k))


@gpu
def test_autograd_backwards_do_not_synchronise():
    """The embedding and MoE permute backwards reuse the indices their forward checked: the forward may
    synchronise (the range test), the backward must not (set_sync_debug_mode turns a sync into an error)."""
    import gradops

    weight = torch.randn(32000, 512, device="cuda", requires_grad=True)
    tokens = torch.randint(0, 32000, (2048,), device="cuda")
    rows = gradops.embedding(weight, tokens)
    permuted, _ = gradops.moe_token_permute(rows, torch.randint(0, 8, (2048, 4), device="cuda"))
    loss = permuted.float().square().sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert weight.grad is not None and bool(torch.isfinite(weight.grad).all())


@gpu
def test_changed_saved_indices_reported_without_a_sync():
    """Indices changed behind autograd's back (``.data``) after the forward: the backward neither synchronises
    nor reads out of bounds; the kernel's flag raises the OpError at gradops.synchronize() (or the next launch)."""
    import gradops

    weight = torch.randn(1000, 64, device="cuda", requires_grad=True)
    idx = torch.randint(0, 1000, (512,), device="cuda")
    y = gradops.embedding(weight, idx)
    idx.data[7] = 5000
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(gradops.OpError, match="got 5000 at flat position 7"):
        gradops.synchronize()
    gradops.synchronize()  # reported once


@gpu
def test_embedding_forward_bad_index_reported_without_a_sync():
    """The forward's range test on CUDA: no host synchronisation (rows read clamped into the table), the OpError
    raised by gradops.synchronize() (or the next gradops launch)."""
    import gradops

    weight = torch.randn(100, 8, device="cuda")
    idx = torch.tensor([3, 250, 7], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = gradops.embedding(weight, idx)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert y.shape == (3, 8) and torch.equal(y[0], weight[3])
    with pytest.raises(gradops.OpError, match="got 250 at flat position 1"):
        gradops.synchronize()
    gradops.synchronize()  # reported once


@gpu
def test_embedding_bad_index_on_the_torch_backend_refused_at_once(monkeypatch):
    """Where nothing would raise a deferred refusal (the torch backend launches no Triton kernel), the range test
    synchronises and refuses at once, forward and backward, as on the CPU."""
    import gradops

    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    idx = torch.tensor([1, 12], device="cuda")
    with pytest.raises(gradops.OpError, match="got 12 at flat position 1"):
        gradops.embedding(torch.randn(10, 4, device="cuda"), idx)
    with pytest.raises(gradops.OpError, match="got 12 at flat position 1"):
        gradops.embedding_dense_backward(torch.randn(2, 4, device="cuda"), idx, 10)
    gradops.synchronize()  # nothing deferred

@gpu
def test_layer_norm_grad_bad_variance_reported_without_a_sync():
    """A variance below -epsilon (a swapped mean) on CUDA: flagged on the device after the kernels, raised by
    gradops.synchronize()."""
    import gradops

    dy, x = torch.randn(2, 4, 64, device="cuda").unbind(0)
    variance = torch.rand(4, device="cuda")
    variance[2] = -1.0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gradops.layer_norm_grad(dy, x, variance, torch.zeros(4, device="cuda"), torch.ones(64, device="cuda"), 1e-5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(gradops.OpError, match="variance"):
        gradops.synchronize()

def _free_bytes() -> int:
    return torch.cuda.mem_get_info()[0] if CUDA else 0


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_hardswish_backward_no_fma(dtype, launches):
    """Launched with enable_fp_fusion=False: an FMA would keep x·float32(1/3) unrounded (x = -1.5 gives -1.49e-8
    instead of 0). Same bits as the CPU reference on every half bit pattern (a dense sweep for float32)."""
    from gradops import launch, reference

    if dtype == torch.float32:
        x = torch.cat([torch.tensor([-1.5, -0.75, 1.5]), torch.linspace(-4, 4, 400_001)])
    else:
        x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(dtype)
    got = launch.hardswish_backward(g.cuda(), x.cuda()).cpu()
    bits = {2: torch.int16, 4: torch.int32}[x.element_size()]
    assert torch.equal(got.view(bits), reference.hardswish_backward(g, x).view(bits))
    assert launches()["hardswish_flat_kernel"] == 1


@gpu
@pytest.mark.skipif(_free_bytes() < 16 << 30, reason="needs 16 GiB free device memory")
def test_hardswish_backward_over_2_31_elements(launches):
    """2^31 + 4099 bf16 elements (4.3 GB each): offsets past 2^31 must not wrap. Checked at both ends."""
    from gradops import launch, reference

    n = (1 << 31) + 4099
    x = torch.empty(n, device="cuda", dtype=torch.bfloat16).uniform_(-5, 5)
    g = torch.empty_like(x).normal_()
    out = launch.hardswish_backward(g, x)
    for sl in (slice(0, 1 << 20), slice(n - (1 << 20), n), slice((1 << 31) - 10, (1 << 31) + 10)):
        _close(out[sl], reference.hardswish_backward(g[sl], x[sl], compute=torch.float64), 1)
    assert launches()["hardswish_flat_kernel"] == 1


@gpu
@pytest.mark.skipif(_free_bytes() < 16 << 30, reason="needs 16 GiB free device memory")
def test_moe_grad_over_2_31_elements(launches):
    """grad of 524,800 x 4096 bf16 = 2.15e9 elements: rows beyond 2^31 / 4096 are gathered with int64 offsets."""
    from gradops import launch

    rows, h, k = 524_800, 4096, 2
    grad = torch.empty(rows, h, device="cuda", dtype=torch.bfloat16).normal_()
    idx = torch.arange(rows - 1, -1, -1, device="cuda", dtype=torch.int32)  # token 0 reads the last rows
    out = launch.moe_token_permute_grad(grad, idx, k)
    pick = torch.cat([torch.arange(16, device="cuda"), torch.arange(rows // k - 16, rows // k, device="cuda")])
    src = idx.long().view(-1, k)[pick]
    ref = grad[src[:, 0]].double() + grad[src[:, 1]].double()
    _close(out[pick], ref, k)
    assert (src >= (1 << 31) // h).any(), "the check must reach rows past the 2^31-element mark"
    assert launches()["moe_token_permute_grad_kernel"] == 1
