"""The CPU kernels across processes and threads: forked children (GNU OpenMP does not survive fork), threads
calling kernels at once, and the kernels' build in gradops' cache (per source version, a library that does not
load, a cache folder that cannot be written). Most cases run in a child process, as these hazards end or hang the
process they occur in."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gradops
from gradops import backend, native

cpu = importlib.import_module("gradops.cpu")


def _bits(*tensors: torch.Tensor) -> list[bytes]:
    return [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_computes_instead_of_hanging():
    """GNU OpenMP does not survive fork: a parallel region in a child forked after the parent ran one hangs. The
    child's calls run the kernels on its calling thread: the parent's bits, and a normal exit."""
    x, g = torch.randn(256, 256), torch.randn(256)
    expected = _bits(*gradops.rms_norm(x, g))  # the kernel's parallel loop in this process
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = 0 if _bits(*gradops.rms_norm(x, g)) == expected else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"


_FORK_CHILD = """
import os, torch, gradops
x = torch.randn(2048, 1024) * 4
g = torch.randn(2048, 1024)
rstd, gamma = torch.rand(2048) + 0.5, torch.randn(1024)
torch.nn.functional.layer_norm(x, (1024,))  # torch's own parallel region in the parent
want_h = gradops.hardswish_backward(g, x)  # and the kernels'
want_r = gradops.rms_norm_grad(g, x, rstd, gamma)[0]
table, ids = torch.randn(4096, 256), torch.randint(0, 4096, (8192,))
leaf, up = table.clone().requires_grad_(), torch.randn(8192, 256)
want_e = gradops.embedding(table, ids)
gradops.embedding(leaf, ids).backward(up)
want_d, leaf.grad = leaf.grad, None
bits = lambda t: t.view(torch.uint8).numpy().tobytes()

# 1. a plain fork: no torch call in the child but gradops' (any parallel region there hangs, torch's included;
#    the embedding's lookup is torch's index_select, which hung here before it ran on one thread)
pid = os.fork()
if pid == 0:
    got = [bits(gradops.hardswish_backward(g, x)), bits(gradops.rms_norm_grad(g, x, rstd, gamma)[0]),
           bits(gradops.embedding(table, ids))]
    gradops.embedding(leaf, ids).backward(up)
    got.append(bits(leaf.grad))
    os._exit(0 if got == [bits(want_h), bits(want_r), bits(want_e), bits(want_d)] else 3)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "plain fork"

# 2. fork-started DataLoader workers computing at parallel sizes
class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return gradops.hardswish_backward(g, x)[i], gradops.rms_norm_grad(g, x, rstd, gamma)[0][i]

loader = torch.utils.data.DataLoader(Rows(), batch_size=None, num_workers=2, multiprocessing_context="fork")
for i, (h, r) in enumerate(loader):
    assert torch.equal(h, want_h[i]) and torch.equal(r, want_r[i]), i
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.parametrize("name", ["auto", "cpu"])
def test_forked_children_and_dataloader_workers_compute_serially(name):
    """After the parent ran parallel regions, gradops' calls in a forked child run on one thread (the kernels'
    loops and torch's alike): the parent's bits, in a plain fork and in fork-started DataLoader workers, whether
    the backend is chosen (auto) or named (cpu)."""
    env = {**os.environ, "GRADOPS_BACKEND": name}
    proc = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


_THREADS_CHILD = """
import threading, torch, gradops
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
print(len(bad))
"""


@pytest.mark.parametrize("native_path", ["0", "1"])
def test_threads_calling_kernels_at_once_give_the_same_bits(native_path):
    """Six threads x 40 steps of four ops in a child process, on the Python path (``GRADOPS_NATIVE=0``) and the
    direct path: a normal exit with every result bit-identical (the kernels release the GIL and share torch's
    thread pool)."""
    env = {**os.environ, "GRADOPS_BACKEND": "cpu", "GRADOPS_NATIVE": native_path}
    result = subprocess.run([sys.executable, "-c", _THREADS_CHILD], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, f"child ended with {result.returncode}: {result.stderr[-1500:]}"
    assert result.stdout.split() == ["0"]


def test_the_build_goes_to_gradops_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("GRADOPS_CACHE_DIR", str(tmp_path))
    assert native.build_dir().parent == tmp_path / "native"
    monkeypatch.delenv("GRADOPS_CACHE_DIR")
    assert native.build_dir().parent == native.Path.home() / ".cache" / "gradops" / "native"


def test_the_build_follows_the_sources(monkeypatch, tmp_path):
    """One library per version of the kernels' sources: an edit to a header the kernels include is a new build."""
    before = native._tag()
    copies = []
    for path in native.HEADERS:
        copies.append(tmp_path / path.name)
        shutil.copy(path, copies[-1])
    monkeypatch.setattr(native, "HEADERS", tuple(copies))
    assert native._tag() == before
    with open(copies[0], "a") as f:
        f.write("\n// an edit to what every kernel includes\n")
    assert native._tag() != before


_CHILD = """
import sys, torch, gradops
from gradops import reference
g = torch.Generator().manual_seed(0)
grad, x = torch.randn(64, 33, generator=g), torch.randn(64, 33, generator=g) * 4
print(gradops.backend.decide("hardswish_backward", x.device).name)
assert torch.equal(gradops.hardswish_backward(grad, x), reference.hardswish_backward(grad, x))
print("ok")
"""

# The damaged library's child: a rebuild here is a copy of the library this process built (the rebuild's logic
# without the 1-2 minutes of the compiler).
_REBUILD = """
import shutil, sys
from pathlib import Path
from gradops import native
built = Path(sys.argv[1])
def build(verbose=False):
    native.build_dir().mkdir(parents=True, exist_ok=True)
    shutil.copy(built, native._library())
    return native._library()
native.build = build
"""


# A build at import that copies the library this process built (the next import after a compiler was installed).
_REBUILD_AT_IMPORT = """
import shutil, sys
from pathlib import Path
import torch.utils.cpp_extension as cpp
def load(name, sources, build_directory, **kwargs):
    shutil.copy(sys.argv[1], Path(build_directory) / (name + ".so"))
cpp.load = load
"""


def _child(cache: str, prelude: str = "", *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GRADOPS_BACKEND"}
    env["GRADOPS_CACHE_DIR"] = cache
    return subprocess.run([sys.executable, "-c", prelude + _CHILD, *args], capture_output=True, text=True,
                          timeout=600, env=env, check=False)


def test_a_library_that_does_not_load_is_rebuilt_with_one_warning(tmp_path):
    """A damaged library in the cache (a full disk, a killed build) costs one rebuild and one warning; the next
    process finds a healthy one. Before the rebuild existed: the reference, ~10-50x slower, in every process."""
    built = native._library()
    if not built.exists():
        pytest.skip("the CPU kernels are not built here")
    directory = tmp_path / "native" / native._tag()
    directory.mkdir(parents=True)
    (directory / built.name).write_bytes(b"not a shared library")
    first = _child(str(tmp_path), _REBUILD, str(built))
    assert first.returncode == 0 and first.stdout.split() == ["cpu", "ok"], first.stderr
    assert first.stderr.count("does not load") == 1 and "rebuilding it" in first.stderr, first.stderr
    second = _child(str(tmp_path), _REBUILD, str(built))
    assert second.returncode == 0 and second.stdout.split() == ["cpu", "ok"], second.stderr
    assert "does not load" not in second.stderr and "building" not in second.stderr, second.stderr


def test_a_cache_folder_that_cannot_be_written_says_so_once_and_computes(tmp_path):
    """Where the kernels cannot be built (here: a cache folder whose parent is a file, unwritable even for root)
    the first import says so in one line naming the folder and the fix (GRADOPS_CACHE_DIR, not a compiler: the
    line used to end "To fix: install a C++ compiler"), and CPU tensors take the reference: the same results,
    never an exception, and no second line from the slow path's warning."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = _child(str(blocker / "cache"))
    assert proc.returncode == 0 and proc.stdout.split() == ["torch", "ok"], proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "gradops" in line]
    assert len(lines) == 1 and "could not be built" in lines[0], proc.stderr
    assert "cannot be written" in lines[0] and "GRADOPS_CACHE_DIR" in lines[0] and "compiler" not in lines[0]
    assert backend.FIX == native.FIX


def test_a_missing_compiler_is_one_line_and_the_next_import_after_installing_one_builds(tmp_path):
    """Without a compiler the line names it (the cause used to be cut at 200 characters before ``c++: not
    found``) and no failure is noted: after installing one, the next import builds, where a noted failure kept
    the reference until ``python -m gradops.native`` ran."""
    env = {k: v for k, v in os.environ.items() if k != "GRADOPS_BACKEND"}
    env.update(GRADOPS_CACHE_DIR=str(tmp_path), CXX="gradops-test-no-such-compiler")
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, env=env,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.split() == ["torch", "ok"], proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "gradops" in line]
    assert len(lines) == 1, proc.stderr
    assert "no C++ compiler: CXX=gradops-test-no-such-compiler is not on PATH" in lines[0] and "CXX" in lines[0]
    assert not (tmp_path / "native" / native._tag() / native.FAILED).exists()
    built = native._library()
    if not built.exists():
        pytest.skip("the CPU kernels are not built here")
    env.pop("CXX")  # "installed": the next import builds (here a copy, the build's logic without the compiler)
    proc = subprocess.run([sys.executable, "-c", _REBUILD_AT_IMPORT + _CHILD, str(built)], capture_output=True,
                          text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0 and proc.stdout.split() == ["cpu", "ok"], proc.stderr
    assert "native CPU kernels built" in proc.stderr, proc.stderr


def test_a_failed_build_is_tried_again_when_the_compiler_changes(tmp_path, monkeypatch):
    """A compile error is noted with the toolchain that made it: the same toolchain is not tried again at every
    import (a minute each time), another one is."""
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_library", lambda: tmp_path / "missing.so")
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setattr(native, "_said", False)
    (tmp_path / native.FAILED).write_text("RuntimeError: simulated compile error\n")
    (tmp_path / native.TOOLCHAIN).write_text(native.toolchain() + "\n")
    tried = []
    monkeypatch.setattr(native, "build", lambda verbose=False: tried.append(True) or tmp_path / "missing.so")
    assert "simulated compile error" in native.ensure_built() and tried == []
    monkeypatch.setattr(native, "_failure", None)
    (tmp_path / native.TOOLCHAIN).write_text("c++=/an/older/compiler:1:1; ninja=-\n")
    assert native.ensure_built() is None and tried == [True]


def test_a_failed_build_is_said_not_repeated_at_every_import(tmp_path):
    """A build that failed (a compile error costs a minute) leaves its reason beside the library it did not make;
    later imports say it in one line and take the reference instead of failing the same build again."""
    directory = tmp_path / "native" / native._tag()
    directory.mkdir(parents=True)
    (directory / native.FAILED).write_text("CalledProcessError: simulated compile error\n")
    proc = _child(str(tmp_path))
    assert proc.returncode == 0 and proc.stdout.split() == ["torch", "ok"], proc.stderr
    assert "building" not in proc.stderr and proc.stderr.count("simulated compile error") >= 1, proc.stderr
    assert proc.stderr.count("gradops: the native CPU kernels could not be built") == 1, proc.stderr


def test_a_killed_builds_lock_is_removed_and_a_failure_noted(tmp_path, monkeypatch):
    """A build killed without cleanup (SIGKILL, OOM, a CI timeout) leaves torch's lock file, on which torch's
    builder waits forever, however young it is. gradops holds its own flock for a build, which the kernel drops
    when the builder dies: holding it, any lock file is a dead build's and is removed, with a warning. A build
    that fails writes FAILED; one that is tried again removes it first."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_library", lambda: tmp_path / "missing.so")
    lock = tmp_path / "lock"
    calls = []

    def failing_load(*args, **kwargs):
        calls.append(lock.exists())
        raise RuntimeError("simulated: compile error")

    monkeypatch.setattr(cpp, "load", failing_load)
    for _ in range(2):  # a fresh lock, as a killed build leaves it (the age rule waited 15 minutes on it)
        lock.write_text("")
        with pytest.warns(RuntimeWarning, match="build lock"), pytest.raises(RuntimeError, match="compile error"):
            native.build()
    assert calls == [False, False] and "simulated: compile error" in (tmp_path / native.FAILED).read_text()


def test_an_import_waits_for_a_live_build_and_uses_its_library(tmp_path, monkeypatch):
    """A build running in another process holds the flock: the next one says it waits, waits for it (not for a
    clock), and then finds the library that build made instead of building it again."""
    fcntl = pytest.importorskip("fcntl")
    import threading

    import torch.utils.cpp_extension as cpp

    library = tmp_path / "lib.so"
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_library", lambda: library)
    monkeypatch.setattr(native, "_damaged", lambda path: None)
    monkeypatch.setattr(cpp, "load", lambda *a, **k: pytest.fail("built again"))
    other = open(tmp_path / native.BUILD_LOCK, "a+b")  # another open file: flock conflicts as across processes
    fcntl.flock(other, fcntl.LOCK_EX)

    def finish():
        library.write_bytes(b"built")
        fcntl.flock(other, fcntl.LOCK_UN)
        other.close()

    timer = threading.Timer(0.5, finish)
    timer.start()
    start = native.time.perf_counter()
    assert native.build() == library
    timer.join()
    assert native.time.perf_counter() - start >= 0.4


def test_a_truncated_library_is_rebuilt_not_mapped(tmp_path):
    """A truncated library in the cache (a full disk, an interrupted copy of ~/.cache/gradops) was mapped as it
    was, and the first page past its end killed ``import gradops`` with SIGBUS; its ELF headers say how long it
    must be, so it is rebuilt instead, with one warning."""
    built = native._library()
    if not built.exists():
        pytest.skip("the CPU kernels are not built here")
    assert native._damaged(built) is None
    directory = tmp_path / "native" / native._tag()
    directory.mkdir(parents=True)
    data = built.read_bytes()
    (directory / built.name).write_bytes(data[:len(data) // 2])
    assert "truncated" in native._damaged(directory / built.name)
    first = _child(str(tmp_path), _REBUILD, str(built))
    assert first.returncode == 0 and first.stdout.split() == ["cpu", "ok"], (first.returncode, first.stderr)
    assert first.stderr.count("does not load") == 1 and "truncated" in first.stderr, first.stderr


def test_a_failed_build_notes_the_compilers_errors(tmp_path, monkeypatch):
    """torch's builder puts the whole compiler command on its message's first line and the compiler's diagnostics
    after it: FAILED keeps the compiler's ``error:`` lines (what a user must fix), not only the command's start
    (``[1/9] /opt/gcc/bin/g++ -MMD ...``, which says nothing of what failed)."""
    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_library", lambda: tmp_path / "missing.so")
    command = "Error building extension 'x': [1/9] /opt/gcc/bin/g++ " + "-isystem /a/very/long/include " * 40
    diagnostics = ["direct.cpp: In function 'f':", "direct.cpp:178:32: error: 'at::GradMode' has not been declared",
                   "  178 |   at::GradMode::is_enabled()", "ninja: build stopped: subcommand failed."]

    def failing_load(*args, **kwargs):
        raise RuntimeError("\n".join([command, *diagnostics]))

    monkeypatch.setattr(cpp, "load", failing_load)
    with pytest.raises(RuntimeError):
        native.build()
    note = (tmp_path / native.FAILED).read_text().splitlines()
    assert note[0].startswith("RuntimeError: Error building extension 'x'") and len(note[0]) <= 214
    assert note[1:] == ["direct.cpp:178:32: error: 'at::GradMode' has not been declared"]

def test_a_terminated_build_exits_through_cleanup(tmp_path, monkeypatch):
    """A TERM during the build (timeout(1) ending a part of scripts/gpu_check.sh) becomes SystemExit, so torch's
    builder releases its lock on the way out instead of leaving it for the next build to wait on; the process's
    own TERM handler is back after."""
    import signal
    import threading

    import torch.utils.cpp_extension as cpp

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are set in the main thread only")
    monkeypatch.setattr(native, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_library", lambda: tmp_path / "missing.so")
    released = []

    def terminated_load(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            native.time.sleep(1)  # the handler runs here, in this thread
        finally:
            released.append(True)  # what torch's builder does in its finally: release the lock

    monkeypatch.setattr(cpp, "load", terminated_load)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        native.build()
    assert info.value.code == 128 + signal.SIGTERM and released == [True]
    assert signal.getsignal(signal.SIGTERM) == before and not (tmp_path / native.FAILED).exists()
