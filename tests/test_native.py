"""gradops.native: the C++ autograd nodes of gradops.nn's eager training path on CPU.

The nodes call the same compiled kernels as the Python path, so every result here is compared bit for bit with
the Python Function path (``gradops.native.set_enabled(False)``, tests/native_paths.py) on the same inputs; the
float64 references of the modules' formulas are tests/test_nn.py's business and hold for both paths through it.
The Embedding node has its own file, tests/test_native_embedding.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import gradops
import gradops.native as native
import gradops.nn as gnn
from native_paths import DTYPES, both, on_threads, same, skip_unless_native, step

pytestmark = skip_unless_native


def test_required_extension_is_loaded():
    """Where setup built the extension, the tests run on it (a skip would hide a broken build or load)."""
    assert native.status() == "loaded"


@pytest.fixture
def python_path():
    """Runs the body with the native nodes off, then turns them back on."""
    native.set_enabled(False)
    try:
        yield
    finally:
        native.set_enabled(True)


# 8 x 8: the per-call end; (3, 5, 64): a 3-D input; 512 x 256 = 131072 items, above the kernels' serial/parallel
# threshold (PARALLEL_MIN = 32768), so the nodes split the work over torch's threads; 7 x 33: odd sizes, no
# vector-width multiple.
SHAPES = [(8, 8), (3, 5, 64), (512, 256), (7, 33)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_hardswish_node_matches_python_path(shape, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 4).to(dtype).requires_grad_()
    x.data[..., 0] = 3.0  # CANN's closed interval at +-3 (d = 1.5, -0.5), on both paths
    x.data[..., -1] = -3.0
    w = torch.randn(shape).to(dtype)
    name, name_py, ours, python = both(gnn.Hardswish(), x, lambda y: (y * w).sum())
    assert name == "gradops_native::HardswishBackward"
    assert "gradops_native" not in name_py
    same(ours, python)
    assert ours[1][..., 0].eq((w[..., 0].float() * 1.5).to(dtype)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(8, 8), (512, 256), (3, 5, 64)], ids=str)
@pytest.mark.parametrize("name", ["Hardswish", "LayerNorm"])
def test_node_writes_only_a_gradient_nobody_holds(name, shape, dtype):
    """The Hardswish and LayerNorm nodes compute dx in the incoming gradient's memory only when nothing else
    references it (the matches tests run that path: (y * w).sum()'s gradient is MulBackward's fresh tensor). A
    gradient the caller passed, one a hook kept or retain_grad stored, comes back unchanged, and every gradient has
    the same bits either way (LayerNorm's in-place row blocks are a kernel of their own)."""
    torch.manual_seed(0)
    module = (gnn.Hardswish() if name == "Hardswish" else gnn.LayerNorm(shape[-1])).to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = (torch.randn(shape) * 4).to(dtype).requires_grad_()
    w = torch.randn(shape).to(dtype)
    leaves = [x, *module.parameters()]

    def grads():
        return [t.grad.clone() for t in leaves]

    def clear():
        for t in leaves:
            t.grad = None

    gy = w.clone()
    module(x).backward(gy)
    assert torch.equal(gy, w)
    expected = grads()
    if name == "Hardswish":
        assert torch.equal(expected[0], gradops.hardswish_backward(w, x.detach()))
    kept = []
    for hold in (lambda y: y.register_hook(kept.append), lambda y: y.retain_grad()):
        clear()
        y = module(x)
        hold(y)
        (y * w).sum().backward()
        assert all(map(torch.equal, grads(), expected))
        assert torch.equal(kept[-1] if y.grad is None else y.grad, w)
    clear()
    (module(x) * w).sum().backward()  # nothing holds it: written in place, the same bits
    assert all(map(torch.equal, grads(), expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("affine", ["affine", "no-bias", "none", "fp32-params"])
def test_layer_norm_node_matches_python_path(shape, dtype, affine):
    torch.manual_seed(0)
    cols = shape[-1]
    module = gnn.LayerNorm(cols, elementwise_affine=affine != "none", bias=affine != "no-bias")
    if affine != "fp32-params":  # fp32 weight beside a half input: the seed's mixed dtype row
        module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    x = torch.randn(shape).to(dtype).requires_grad_()
    w = torch.randn(shape).to(dtype)
    name, name_py, ours, python = both(module, x, lambda y: (y * w).sum())
    assert name == "gradops_native::LayerNormBackward"
    assert "gradops_native" not in name_py
    same(ours, python)


def test_thresholds_are_the_documented_ones():
    """The kernels' thresholds (kernels.h, their one definition: docs/backends.md names them), and the output pool
    serves from the floor gradops.cpu._pool tests before asking it."""
    from gradops.cpu import _pool

    ext = native.module()
    assert (ext.PARALLEL_MIN, ext.ROW_BLOCKS, ext.BLOCK_ITEMS) == (1 << 15, 64, 1 << 14)
    assert ext.POOL_MIN == _pool.MIN_BYTES


# (rows, cols, blocks): none; one item; exactly 16 Ki items -> 1, one more column -> 2; 2.4 blocks' worth -> 4 and
# 4.9 -> 8 (rounded up to a power of two); 512 x 256 = 8 x 16 Ki; capped by the rows (3 rows of 3 blocks' worth,
# 5 rows of 1 Mi); 2048 x 512 = 64 x 16 Ki; capped at 64; 130 x 1000 -> 8; 64 x 520 (the accuracy test's) -> 4.
BLOCKS = [(0, 7, 1), (7, 0, 1), (1, 1, 1), (128, 128, 1), (128, 129, 2), (40, 1000, 4), (80, 1000, 8),
          (512, 256, 8), (3, 16385, 3), (5, 1 << 20, 5), (2048, 512, 64), (8192, 4096, 64), (130, 1000, 8),
          (64, 520, 4)]


@pytest.mark.parametrize(("rows", "cols", "blocks"), BLOCKS)
def test_row_blocks_are_the_python_paths(rows, cols, blocks):
    """The fixed row blocks of the cross-row reductions (the bits of dgamma / dbeta follow the count): a function of
    the shape alone, the same for the kernels and for the workspace sizes the Python side reports."""
    from gradops.cpu import _host

    assert native.module().row_blocks(rows, cols) == _host.row_blocks(rows, cols) == blocks


@pytest.mark.parametrize("make", [gnn.Hardswish, lambda: gnn.LayerNorm(1000)], ids=["Hardswish", "LayerNorm"])
def test_same_bits_on_any_number_of_threads(make):
    """The nodes run on torch's intra-op threads (at::parallel_for): the pieces are elementwise, per row, or fixed
    row blocks folded in a fixed order, so one thread and two give the same bits (130 x 1000 fp32, above the
    parallel threshold: 17 rows in each of row blocks 0-6, 11 in block 7 - an uneven split)."""
    torch.manual_seed(0)
    module = make()
    x = torch.randn(130, 1000, requires_grad=True)

    def run():
        name, y, grads = step(module, x, lambda y: (y * 1.5).sum())
        assert name.startswith("gradops_native::")
        return [y, *grads]

    results = on_threads((1, 2), run)
    same(*results)


@pytest.mark.parametrize("make", [gnn.Hardswish, lambda: gnn.LayerNorm(64)], ids=["Hardswish", "LayerNorm"])
def test_strided_upstream_gradient(make):
    """``y.sum()`` hands the node an expanded gradient (stride 0); ``y[:, ::2]`` a zero-filled, sliced one."""
    x = torch.randn(16, 64)
    for upstream in (lambda y: y.sum(), lambda y: y[:, ::2].sum() * 2, lambda y: y.t().contiguous()[3].sum()):
        _, _, ours, python = both(make(), x.requires_grad_(), upstream)
        same(ours, python)


class _SwiGlu(torch.nn.Module):
    """gradops.swiglu as a module (what gradops.transformers' experts call), for native_paths.both."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gradops.swiglu(x, self.dim)


# (shape, dim): the per-call end; a middle split dim (rows before it, columns after it); 512 x 512, above the
# parallel threshold; an odd half width (17), no vector-width multiple.
SWIGLU_CASES = [((8, 16), -1), ((3, 6, 10), 1), ((512, 512), -1), ((7, 34), -1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "dim"), SWIGLU_CASES, ids=str)
def test_swiglu_node_matches_python_path(shape, dim, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3).to(dtype).requires_grad_()
    out_shape = list(shape)
    out_shape[dim] //= 2
    w = torch.randn(out_shape).to(dtype)
    name, name_py, ours, python = both(_SwiGlu(dim), x, lambda y: (y * w).sum())
    assert name == "gradops_native::SwiGluBackward"
    assert "gradops_native" not in name_py
    same(ours, python)


def test_swiglu_node_double_backward_and_batched_gradients():
    """create_graph=True and batched cotangents reach the SwiGLU node's backward, which hands them to the op (its
    Python formula): the same bits as the Python path, and the loop's answer."""
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(6, 8)
    results = []
    for flag in (True, False):
        native.set_enabled(flag)
        x.grad = None
        y = gradops.swiglu(x)
        assert ("gradops_native" in y.grad_fn.name()) == flag
        (gx,) = torch.autograd.grad((y * y * w).sum(), x, create_graph=True)
        (gx * gx).sum().backward()
        results.append([gx.detach(), x.grad])
    native.set_enabled(True)
    same(*results)
    y = gradops.swiglu(x)
    cotangents = torch.randn(3, 6, 8)
    (batched,) = torch.autograd.grad(y, x, cotangents, retain_graph=True, is_grads_batched=True)
    looped = torch.stack([torch.autograd.grad(y, x, c, retain_graph=True)[0] for c in cotangents])
    assert torch.equal(batched, looped)


def test_strided_input_takes_the_python_path():
    """A non-contiguous x keeps the Python Function (which lays y out like x); results as before."""
    x = torch.randn(64, 32).t().requires_grad_()
    module = gnn.Hardswish()
    assert "gradops_native" not in module(x).grad_fn.name()
    assert "gradops_native" not in gnn.LayerNorm(64)(x).grad_fn.name()


def test_double_backward_through_the_node():
    """create_graph=True: the node's backward runs the Python formula, recorded. The first derivative (and
    Hardswish's second) is the Python path's bit for bit. LayerNorm's second derivative with respect to x sums the
    same two contributions (through y, through the statistics) in another order - the Python path's statistics are
    outputs of the one node that also made y, the native node's are recomputed by a second one - so it agrees to
    that rounding: at most 2 float32 ulps of the largest entry."""
    torch.manual_seed(0)
    x = torch.randn(6, 16, requires_grad=True)
    w = torch.randn(6, 16)  # (y * y).sum() of a LayerNorm is constant in x: its gradient would be rounding noise
    for module in (gnn.Hardswish(), gnn.LayerNorm(16)):
        results = []
        for flag in (True, False):
            native.set_enabled(flag)
            for t in (x, *module.parameters()):
                t.grad = None
            y = module(x)
            assert ("gradops_native" in y.grad_fn.name()) == flag
            (gx,) = torch.autograd.grad((y * y * w).sum(), x, create_graph=True)
            (gx * gx).sum().backward()
            results.append([gx.detach(), x.grad, *(p.grad for p in module.parameters())])
        native.set_enabled(True)
        ours, python = results
        if isinstance(module, gnn.LayerNorm):
            bound = 2 * torch.finfo(torch.float32).eps * python[1].abs().max()
            assert (ours[1] - python[1]).abs().max() <= bound
            ours, python = ours[:1] + ours[2:], python[:1] + python[2:]
        same(ours, python)


def test_gradients_that_are_not_plain_take_the_op():
    """Batched cotangents (``is_grads_batched``: legacy vmap tensors without storage) and a lazily negated
    gradient reach the node's backward; the Python formula's op dispatches them (the kernels would read raw
    memory)."""
    x0 = torch.randn(4, 8)
    cotangents = torch.randn(3, 4, 8)
    negated = torch.randn(4, 8, dtype=torch.complex64).conj().imag
    assert negated.is_neg()
    for module in (gnn.Hardswish(), gnn.LayerNorm(8)):
        x = x0.clone().requires_grad_()
        y = module(x)
        assert "gradops_native" in y.grad_fn.name()
        (batched,) = torch.autograd.grad(y, x, cotangents, retain_graph=True, is_grads_batched=True)
        looped = torch.stack([torch.autograd.grad(y, x, c, retain_graph=True)[0] for c in cotangents])
        assert torch.equal(batched, looped)
        (lazy,) = torch.autograd.grad(y, x, negated, retain_graph=True)
        assert torch.equal(lazy, torch.autograd.grad(y, x, negated.resolve_neg())[0])


def test_no_node_without_recording():
    """Under no_grad, or for an x that needs no gradient, nothing is recorded: the body runs."""
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert gnn.Hardswish()(x.requires_grad_()).grad_fn is None
    assert gnn.LayerNorm(8, elementwise_affine=False)(x.detach()).grad_fn is None


def test_saved_tensor_hooks_and_version_check():
    """The node saves through torch's SavedVariable: saved-tensor hooks see x, and an in-place change of x after
    the forward is refused at backward, as for torch's own nodes."""
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t

    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = gnn.Hardswish()(x * 1)
    assert (4, 8) in packed
    y.sum().backward()
    z = x.detach().clone().requires_grad_()
    inner = z * 1
    y = gnn.Hardswish()(inner)
    inner.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_invalid_input_still_raises_op_error():
    """Validation runs before the node: an unsupported dtype is OpError 161002, as on the Python path."""
    x = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(gradops.OpError) as err:
        gradops.hardswish(x)
    assert err.value.status == 161002
    with pytest.raises(gradops.OpError):
        gnn.LayerNorm(8)(torch.randn(4, 7, requires_grad=True))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_backward_in_a_forked_child():
    """A graph recorded before fork() and run backward in the child: the child's backward takes the Python path on
    one thread (GNU OpenMP does not survive fork: a parallel region there hangs). 512 x 256 splits the nodes'
    kernels over torch's threads in the parent first."""
    torch.manual_seed(0)
    x = torch.randn(512, 256, requires_grad=True)
    modules = (gnn.Hardswish(), gnn.LayerNorm(256))
    ys = [m(x) for m in modules]
    assert all("gradops_native" in y.grad_fn.name() for y in ys)
    expected = torch.autograd.grad(sum((y * 1.5).sum() for y in ys), x, retain_graph=True)[0]
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            torch.set_num_threads(1)  # torch's own OpenMP pool does not survive fork either (DataLoader does this)
            got = torch.autograd.grad(sum((y * 1.5).sum() for y in ys), x)[0]
            code = 0 if torch.allclose(got, expected, rtol=1e-5, atol=1e-5) else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_one_call_eager_test_agrees_with_eager_path():
    """The C++ ``recordable`` test says True only where gradops.ops._direct.eager_path says FUNCTION (then the
    node is recorded), in every state that path knows: modes, transforms, the profiler, tracing, subclasses, meta
    and lazily negated tensors, no_grad."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from gradops.ops import _direct

    ext = native.module()
    x, p = torch.randn(4, 8, requires_grad=True), torch.nn.Parameter(torch.randn(8))
    seen = []

    def agree(*args):
        fast = _direct.python_allows_native() and ext.recordable(*args)
        path = _direct.eager_path(*args)
        assert not fast or path == _direct.FUNCTION, (fast, path)
        seen.append((fast, path))
        return fast

    assert agree(x, p) and agree(x.detach(), p) and not agree(x.detach(), p.detach())
    with torch.no_grad():
        assert not agree(x, p)

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    for mode in (Dispatch(), Function(), torch.profiler.profile(), torch._subclasses.FakeTensorMode()):
        with mode:
            assert not agree(x, p), mode
    assert not agree(x.as_subclass(Sub).requires_grad_(), p)
    assert not agree(torch.randn(4, 8, device="meta", requires_grad=True))
    neg = torch.randn(4, 8, dtype=torch.complex64, requires_grad=True).conj().imag
    assert not agree(neg)
    torch.func.grad(lambda t: (agree(t) and t.sum()) or t.sum())(torch.randn(3))
    torch.func.vmap(lambda t: (agree(t) and t) or t)(torch.randn(2, 3, requires_grad=True))
    torch.jit.trace(lambda t: (agree(t) and t * 2) or t * 2, (torch.randn(3, requires_grad=True),), check_trace=False)
    assert [fast for fast, _ in seen].count(True) == 2  # only the two plain recorded calls


def test_remembered_plans_follow_the_environment(monkeypatch):
    """The extension's copy of a plan (a repeated call is one C++ call) answers only for the metadata and
    environment it was made with: a second call reuses it, GRADOPS_BACKEND=torch sends the same call to the
    reference's Python Function, a new shape or eps makes a new plan, a refused eps is still refused."""
    x = torch.randn(4, 8, requires_grad=True)
    layer, act = gnn.LayerNorm(8), gnn.Hardswish()
    for _ in range(2):
        assert "gradops_native" in layer(x).grad_fn.name() and "gradops_native" in act(x).grad_fn.name()
    first = layer(x)
    monkeypatch.setenv("GRADOPS_BACKEND", "torch")
    assert "gradops_native" not in layer(x).grad_fn.name() and "gradops_native" not in act(x).grad_fn.name()
    assert torch.allclose(layer(x), first, atol=1e-6)
    monkeypatch.delenv("GRADOPS_BACKEND")
    assert torch.equal(layer(x), first)
    y = gnn.LayerNorm(8, eps=1e-3)(x)
    assert "gradops_native" in y.grad_fn.name() and not torch.equal(y, first)
    assert "gradops_native" in gnn.LayerNorm(8)(torch.randn(2, 3, 8, requires_grad=True)).grad_fn.name()
    bad = gnn.LayerNorm(8)
    bad.eps = "tiny"
    with pytest.raises(gradops.OpError):
        bad(x)


def test_one_remembered_call_serves_the_node_and_the_direct_call(monkeypatch):
    """The extension keeps one entry per (op, argument metadata), the plan Python made once: after an eval call
    (the direct path) of a shape, the recorded call of that shape takes the node without asking Python's planner,
    and the other way round; gradops._runtime.invalidate drops the entry with the plans."""
    from gradops import _runtime
    from gradops.ops import _plan

    planned = []
    real = _plan.Planner.__call__

    def counting(self, *args, **options):
        planned.append(self.op)
        return real(self, *args, **options)

    monkeypatch.setattr(_plan.Planner, "__call__", counting)
    _runtime.invalidate()
    act, layer = gnn.Hardswish(), gnn.LayerNorm(8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        act(x), layer(x)  # the direct path: planned once each
    assert planned == ["hardswish", "layer_norm"]
    assert "gradops_native" in act(x).grad_fn.name() and "gradops_native" in layer(x).grad_fn.name()
    assert planned == ["hardswish", "layer_norm"]  # the same entries let the nodes take the recorded calls
    y = torch.randn(2, 8, requires_grad=True)
    assert "gradops_native" in act(y).grad_fn.name()  # a new shape, recorded first: planned once
    with torch.no_grad():
        act(y)
    assert planned == ["hardswish", "layer_norm", "hardswish"]
    _runtime.invalidate()
    act(y)
    assert planned[-1] == "hardswish" and len(planned) == 4


def test_fullgraph_compile_never_sees_the_extension():
    """Under torch.compile(fullgraph=True) the modules trace the custom ops (dynamo answers is_compiling before any
    call into the extension), in training as in inference; the eager call after it still records the node."""
    x = torch.randn(4, 8, requires_grad=True)
    for module in (gnn.Hardswish(), gnn.LayerNorm(8)):
        compiled = torch.compile(module, fullgraph=True, backend="eager")
        y = compiled(x)
        y.sum().backward()
        assert "gradops_native" not in y.grad_fn.name()
        assert "gradops_native" in module(x).grad_fn.name()
        torch._dynamo.reset()


def test_switch_and_environment(python_path):
    assert native.status() == "set_enabled(False)"
    x = torch.randn(4, 8, requires_grad=True)
    assert "gradops_native" not in gnn.Hardswish()(x).grad_fn.name()
    code = "import gradops.native as n; print(n.status())"
    env = {**os.environ, "GRADOPS_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "GRADOPS_NATIVE=0"


def test_build_command_is_idempotent():
    """``python -m gradops.native`` with the extension built: exit 0, the library's path, nothing compiled."""
    out = subprocess.run([sys.executable, "-m", "gradops.native"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(".so")


def test_registering_a_backward_again_releases_the_one_before(monkeypatch):
    """gradops.native.reset() registers each node's Python backward again (set_differentiable): the extension
    replaces the function it held and releases it, instead of leaking it with its references."""
    ext = native.module()

    def first(inputs, extra):
        raise AssertionError("not called")

    def second(inputs, extra):
        raise AssertionError("not called")

    monkeypatch.setattr(native, "_registered", set())  # the real backwards are registered again on next use
    before = sys.getrefcount(first)
    ext.set_differentiable(ext.HARDSWISH, first)
    assert sys.getrefcount(first) == before + 1
    ext.set_differentiable(ext.HARDSWISH, second)
    assert sys.getrefcount(first) == before
    x = torch.randn(4, 5, requires_grad=True)  # the node's backward of record comes back on use
    y = gradops.nn.Hardswish()(x)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    assert g.requires_grad


@pytest.mark.parametrize("source", [p.name for p in native.SOURCES], ids=str)
def test_every_source_compiles_for_the_portable_baseline(source):
    """The extension is built with -march=native, and on a CPU without F16C or AVX2 (an older x86, a virtual machine
    that hides them) the vector layer's portable branches are the ones compiled: each source must compile for
    -march=x86-64 too (a template ``load`` once tied with c10's under argument-dependent lookup there). The flags are
    the ones this torch's extension builder used for the build here (its build.ninja), -march changed."""
    import platform
    import shlex
    import shutil

    ninja = native.build_dir() / "build.ninja"
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None or platform.machine() not in ("x86_64", "AMD64") or not ninja.is_file():
        pytest.skip("needs a C++ compiler targeting x86-64 and the extension built here")
    line = next(ln for ln in ninja.read_text().splitlines() if ln.startswith("cflags = "))
    flags = [f for f in shlex.split(line.removeprefix("cflags = ")) if not f.startswith("-march=")]
    path = next(p for p in native.SOURCES if p.name == source)
    done = subprocess.run([compiler, *flags, "-march=x86-64", "-fsyntax-only", str(path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
