"""The compiled CPU backend (numba): selection and fallback, bit-exact results whatever the thread count,
bfloat16/float16 rounding, ``out=`` on every op and sample, the workspace hook and the output pool.

Correctness against the float64 oracles on every sample runs in test_ops.py (its ``backend`` fixture covers
``cpu``); here the same samples go through ``out=`` on both CPU backends.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

import gradops
from gradops import backend, reference
from gradops.status import ACLNN_ERR_PARAM_INVALID, OpError
from oracles import assert_matches
from samples import OPS, samples

numba = pytest.importorskip("numba")
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
        if hasattr(gradops.reference, op):  # the kernels, not the hooks (``*_workspace``) or cache_dir
            assert backend.select(op, torch.device("cpu")) == ("cpu", getattr(cpu, op)), op


def test_falls_back_to_torch_without_numba(monkeypatch):
    """``import numba`` failing (not installed) leaves auto mode on the pure-torch path; naming cpu raises."""
    monkeypatch.setitem(sys.modules, "numba", None)  # makes find_spec None and the import an ImportError
    for name in [m for m in sys.modules if m == "gradops.cpu" or m.startswith("gradops.cpu.")]:
        monkeypatch.delitem(sys.modules, name)
    backend._module.cache_clear()
    try:
        with pytest.raises(ImportError):
            importlib.import_module("gradops.cpu")
        monkeypatch.setenv("GRADOPS_BACKEND", "auto")
        name, fn = backend.select("rms_norm_grad", torch.device("cpu"))
        assert name == "torch" and fn is reference.rms_norm_grad
        x, dy, g = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
        rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
        dx, dg = gradops.rms_norm_grad(dy, x, rstd, g)
        ref = reference.rms_norm_grad(dy, x, rstd, g)
        assert torch.equal(dx, ref[0]) and torch.equal(dg, ref[1])
        monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
        with pytest.raises(RuntimeError, match="numba"):
            backend.select("rms_norm_grad", torch.device("cpu"))
    finally:
        monkeypatch.undo()
        backend._module.cache_clear()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_falls_back_to_torch_instead_of_terminating():
    """GNU OpenMP does not survive fork: numba would kill a child that launches a parallel kernel after the
    parent did. The child must compute (with the reference) and exit normally."""
    x, g = torch.randn(64, 64), torch.randn(64)
    expected = gradops.rms_norm(x, g)[0]  # runs the parallel kernel in this process
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            got = gradops.rms_norm(x, g)[0]
            code = 0 if torch.allclose(got, expected, rtol=1e-5, atol=1e-6) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


_FORK_CHILD = """
import os, torch, gradops
from gradops import reference
x = torch.randn(2048, 1024) * 4
g = torch.randn(2048, 1024)
rstd, gamma = torch.rand(2048) + 0.5, torch.randn(1024)
gradops.hardswish_backward(g, x)            # the compiled kernels' parallel region in the parent
torch.nn.functional.layer_norm(x, (1024,))  # and torch's own
want = [reference.hardswish_backward(g, x).numpy().tobytes(),
        reference.rms_norm_grad(g, x, rstd, gamma)[0].numpy().tobytes()]

# 1. a plain fork: no torch call in the child but gradops' (any parallel region there hangs, torch's included)
pid = os.fork()
if pid == 0:
    got = [gradops.hardswish_backward(g, x).numpy().tobytes(),
           gradops.rms_norm_grad(g, x, rstd, gamma)[0].numpy().tobytes()]
    os._exit(0 if got == want else 3)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "plain fork"

# 2. fork-started DataLoader workers computing at parallel sizes
class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return gradops.hardswish_backward(g, x)[i], gradops.rms_norm_grad(g, x, rstd, gamma)[0][i]

loader = torch.utils.data.DataLoader(Rows(), batch_size=None, num_workers=2, multiprocessing_context="fork")
ref_h, ref_r = reference.hardswish_backward(g, x), reference.rms_norm_grad(g, x, rstd, gamma)[0]
for i, (h, r) in enumerate(loader):
    assert torch.equal(h, ref_h[i]) and torch.equal(r, ref_r[i]), i
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_children_and_dataloader_workers_compute_serially():
    """After the parent ran parallel regions, a forked child's parallel region hangs (GNU OpenMP does not survive
    fork; torch's pool neither). gradops' ops in such a child compute with the reference on one thread: the same
    bits as the reference, in a plain fork and in fork-started DataLoader workers. Before: the child hung."""
    env = {k: v for k, v in os.environ.items() if k != "GRADOPS_BACKEND"}
    proc = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_refuses_a_named_cpu_backend_with_561003(monkeypatch):
    """Naming ``cpu`` in such a child is a request the process cannot honour: an OpError saying why (issue 12.2),
    from the public API and from a direct call of the backend alike, never a silent reference result."""
    x, g = torch.randn(64, 64), torch.randn(64)
    gradops.rms_norm(x, g)  # runs the parallel kernel in this process
    monkeypatch.setenv("GRADOPS_BACKEND", "cpu")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            for call in (lambda: gradops.rms_norm(x, g), lambda: cpu.rms_norm(x, g, 1e-6)):
                try:
                    call()
                    code = 2
                    break
                except backend.BackendUnavailable as e:
                    code = 0 if e.status == 561003 and "forked" in str(e) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


_THREADS_CHILD = """
import threading, torch, gradops, numba
torch.manual_seed(0)
x, g, dy = torch.randn(128, 256), torch.randn(256), torch.randn(128, 256)
idx = torch.randint(0, 50, (128,))
def step():
    y, r = gradops.rms_norm(x, g)
    return (gradops.rms_norm_grad(dy, x, r, g)[0], gradops.hardswish_backward(dy, x),
            gradops.layer_norm_backward(dy, x, *gradops.layer_norm(x, g, g, 1e-5)[1:2],
                                        torch.rsqrt(gradops.layer_norm(x, g, g, 1e-5)[2] + 1e-5), g)[0],
            gradops.embedding_dense_backward(dy, idx, 50))
want = step()
bad = []
def work():
    for _ in range(40):
        if any(not torch.equal(a, b) for a, b in zip(step(), want)):
            bad.append(1)
threads = [threading.Thread(target=work) for _ in range(6)]
[t.start() for t in threads]; [t.join() for t in threads]
print(numba.threading_layer(), len(bad))
"""


@pytest.mark.parametrize("layer", ["workqueue", "default"])
def test_threads_calling_kernels_at_once_never_abort(layer):
    """numba's workqueue layer (macOS, slim containers without libgomp, or chosen by the user) terminates the
    process when two threads launch parallel kernels at once; gradops serialises launches under it. Six threads
    x 40 steps of four ops in a child process: it must exit normally with every result bit-identical."""
    env = {**os.environ, "GRADOPS_BACKEND": "cpu", "NUMBA_THREADING_LAYER": layer}
    result = subprocess.run([sys.executable, "-c", _THREADS_CHILD], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, f"child ended with {result.returncode}: {result.stderr[-1500:]}"
    used, mismatches = result.stdout.split()
    assert mismatches == "0"
    if layer == "workqueue":
        assert used == "workqueue"


def test_cache_dir_prefers_gradops_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADOPS_CACHE_DIR", str(tmp_path))
    versioned = cpu.cache_dir()
    assert os.path.dirname(versioned) == str(tmp_path)  # one folder per version of the kernel sources
    monkeypatch.setenv("GRADOPS_CACHE_DIR", versioned)
    assert cpu.cache_dir() == versioned  # a child process inheriting the folder shares it
    monkeypatch.delenv("GRADOPS_CACHE_DIR")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert os.path.dirname(cpu.cache_dir()).endswith(os.path.join("gradops", "numba"))


def test_cache_folder_follows_the_sources(monkeypatch, tmp_path):
    import shutil

    copy = tmp_path / "cpu"
    shutil.copytree(os.path.dirname(cpu.__file__), copy)
    monkeypatch.setattr(cpu, "__file__", str(copy / "__init__.py"))
    before = cpu._sources_fingerprint()
    with open(copy / "_reduce.py", "a") as f:
        f.write("\n# an edit to a helper that the kernels inline\n")
    assert cpu._sources_fingerprint() != before


_CHILD = """
import torch, gradops
from gradops import reference
g = torch.Generator().manual_seed(0)
grad, x = torch.randn(64, 33, generator=g), torch.randn(64, 33, generator=g) * 4
assert gradops.backend.choose("hardswish_backward", x.device).name == "cpu"
assert torch.equal(gradops.hardswish_backward(grad, x), reference.hardswish_backward(grad, x))
print("ok")
"""


def _child(env_cache: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "GRADOPS_BACKEND")}
    env["GRADOPS_CACHE_DIR"] = env_cache
    return subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, env=env,
                          check=False)


def test_a_damaged_cache_entry_is_recompiled_not_fatal(tmp_path):
    """Truncated or garbage cache files (a full disk, a killed process) cost one recompilation and one warning;
    the next process finds a healthy cache again. Before: EOFError from every op, in every process."""
    first = _child(str(tmp_path))
    assert first.returncode == 0 and first.stdout.strip() == "ok", first.stderr
    damaged = sorted(tmp_path.rglob("*.nb[ic]"))
    assert damaged, "the first run must have cached its kernels"
    for i, path in enumerate(damaged):
        path.write_bytes(b"" if i % 2 else b"not a pickle")
    second = _child(str(tmp_path))
    assert second.returncode == 0 and second.stdout.strip() == "ok", second.stderr
    assert second.stderr.count("damaged kernel cache entries") == 1, second.stderr
    third = _child(str(tmp_path))
    assert third.returncode == 0 and "damaged" not in third.stderr, third.stderr


def test_an_unwritable_cache_folder_compiles_into_a_private_one(tmp_path):
    """A cache folder that cannot be created (its parent is a file: unwritable even for root) gets one warning and
    a private temporary folder, removed at exit; nothing is written beside the sources (numba's own fallback,
    shared by every version of them)."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    pycache = os.path.join(os.path.dirname(cpu.__file__), "__pycache__")
    before = {f for f in os.listdir(pycache) if ".nb" in f} if os.path.isdir(pycache) else set()
    proc = _child(str(blocker / "cache"))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert proc.stderr.count("is not writable") == 1, proc.stderr
    private = proc.stderr.split("kernels compile into ")[1].split()[0]
    assert "gradops-numba-" in private and not os.path.exists(private)
    after = {f for f in os.listdir(pycache) if ".nb" in f} if os.path.isdir(pycache) else set()
    assert after == before


# ---------------------------------------------------------------- determinism across thread counts
def _thread_cases():
    """Shapes with more rows than row blocks (64) and an uneven split, duplicated embedding rows, K = 3."""
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
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = _as_tuple(fn(*args))
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = _as_tuple(fn(*args))
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, two):
        assert torch.equal(_bits(a), _bits(b))


def test_serial_and_parallel_loops_give_the_same_bits():
    """Below PARALLEL_MIN items the entries loop serially over the same per-row / per-block functions that the
    parallel loops run: the bits do not depend on which loop ran them."""
    import numpy as np

    rn, ln = importlib.import_module("gradops.cpu.rms_norm"), importlib.import_module("gradops.cpu.layer_norm")
    from gradops.cpu._host import PARALLEL_MIN, row_blocks
    from gradops.cpu._reduce import fold_partials

    g = torch.Generator().manual_seed(9)
    m, n = 37, 50  # 1850 items: the serial loops
    assert m * n < PARALLEL_MIN
    x, dy, gamma, beta = (torch.randn(m, n, generator=g), torch.randn(m, n, generator=g), torch.randn(n, generator=g),
                          torch.randn(n, generator=g))
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    dx, dgamma = cpu.rms_norm_grad(dy, x, rstd, gamma)
    dx2, dgamma2 = np.empty((m, n), np.float32), np.empty(n, np.float32)
    partial = np.empty((row_blocks(m), n), np.float32)
    rn._rms_norm_grad_parallel(dy.numpy(), x.numpy(), rstd.numpy(), gamma.numpy(), dx2, partial)
    fold_partials(partial, dgamma2)
    assert torch.equal(dx, torch.from_numpy(dx2)) and torch.equal(dgamma, torch.from_numpy(dgamma2))
    y, mean, var = cpu.layer_norm(x, gamma, beta, 1e-5)
    y2, mean2, var2 = np.empty((m, n), np.float32), np.empty(m, np.float32), np.empty(m, np.float32)
    ln._layer_norm_parallel(x.numpy(), gamma.numpy(), beta.numpy(), np.float32(1e-5), y2, mean2, var2)
    assert all(torch.equal(a, torch.from_numpy(b)) for a, b in ((y, y2), (mean, mean2), (var, var2)))


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
