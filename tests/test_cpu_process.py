"""The compiled CPU backend across processes and threads: forked children (GNU OpenMP does not survive fork),
threads launching kernels at once, and the on-disk kernel cache (per source version, damaged entries, unwritable
folders). Most cases run in a child process, as these hazards end or hang the process they occur in."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

import gradops
from gradops import backend

numba = pytest.importorskip("numba")
cpu = importlib.import_module("gradops.cpu")


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
try:
    used = numba.threading_layer()
except ValueError:  # numba's pool never started: every call ran on the native extension's direct path
    used = "none"
print(used, len(bad))
"""


@pytest.mark.parametrize("layer,native", [("workqueue", "0"), ("default", "0"), ("default", "1")])
def test_threads_calling_kernels_at_once_never_abort(layer, native):
    """numba's workqueue layer (macOS, slim containers without libgomp, or chosen by the user) terminates the
    process when two threads launch parallel kernels at once; gradops serialises launches under it. Six threads
    x 40 steps of four ops in a child process: it must exit normally with every result bit-identical. With the
    native extension (``native`` 1, where built) the calls take its direct path on torch's threads instead of
    numba's pool; the numba layers are tested on the Python path (``GRADOPS_NATIVE=0``)."""
    env = {**os.environ, "GRADOPS_BACKEND": "cpu", "NUMBA_THREADING_LAYER": layer, "GRADOPS_NATIVE": native}
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
