"""The CANN C surface (gradops cann-home): the tree builds, CANN's own host programs build against it unchanged and
print what gradops computes, every operator answers from C exactly as gradops.aclnn does from Python (statuses,
workspace sizes, messages, results, over every sample of every op and their refusals), host threads call at once,
and the C layer's own checks refuse what C can get wrong.

Building needs a C++ compiler and a Python with a shared libpython; where either is missing the tests skip with
the reason. The four CANN examples are read from ``$GRADOPS_CANN_EXAMPLES`` or ``shared/cann-examples`` beside or
inside the checkout (the documents' own programs, not copied here); where they are not, those four skip.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import gradops
from gradops import aclnn, registry
from gradops.aclnn import capi
from samples import samples

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
#: CANN's example programs: ``$GRADOPS_CANN_EXAMPLES``, else ``shared/cann-examples`` inside or beside the checkout.
EXAMPLES = next((p for p in (Path(os.environ.get("GRADOPS_CANN_EXAMPLES", "/nonexistent")),
                             ROOT / "shared" / "cann-examples", ROOT.parent / "shared" / "cann-examples")
                 if p.is_dir()), None)


def _why_not() -> str | None:
    if shutil.which(capi.compiler()) is None:
        return f"no C++ compiler ({capi.compiler()} is not on PATH)"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return "this Python has no shared libpython to embed"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> capi.Home:
    return capi.write_home(tmp_path_factory.mktemp("cann") / "ascend-toolkit")


def build(home: capi.Home, source: Path, out: Path, *extra: str) -> Path:
    done = subprocess.run([*home.compile_line(str(source), str(out)), *extra], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return out


def run(home: capi.Home, program: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(program), *args], capture_output=True, text=True, env=home.environment(), timeout=300)


# ------------------------------------------------------------------------------------------------ the tree
def test_the_tree_has_every_operator_and_the_three_libraries(home):
    names = {p.name for p in (home.include / "aclnnop").iterdir()}
    assert names == {f.header for f in aclnn.C_API}
    assert {p.name for p in home.lib64.iterdir()} == {"libascendcl.so", "libnnopbase.so", "libopapi.so"}
    for rel in capi.STATIC_HEADERS:
        assert (home.include / rel).is_file()


def test_every_aclnn_operator_is_declared_for_c():
    phase1 = {n.removesuffix("GetWorkspaceSize") for n in aclnn.__all__ if n.endswith("GetWorkspaceSize")}
    declared = {spec.cann for spec in registry.SPECS if spec.cann.startswith("aclnn")}
    assert phase1 == {f.name for f in aclnn.C_API} == declared
    for f in aclnn.C_API:
        assert f.mismatch() is None
        assert any(spec.cann == f.name for spec in registry.SPECS), f.name


def test_the_headers_compile_as_c_and_as_cpp(home, tmp_path):
    includes = "".join(f'#include "aclnnop/{f.header}"\n' for f in aclnn.C_API)
    for suffix, tool in ((".c", "cc"), (".cpp", capi.compiler())):
        if shutil.which(tool) is None:
            continue
        src = tmp_path / f"all{suffix}"
        src.write_text('#include "acl/acl.h"\n' + includes + "int main(void) { return ACL_SUCCESS; }\n")
        done = subprocess.run([tool, "-Wall", "-Werror", "-fsyntax-only", f"-I{home.include}", str(src)],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_a_cmake_project_with_ascend_home_path_builds(home, tmp_path):
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    (tmp_path / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.10)\nproject(opapi_test CXX)\n"
        "set(ASCEND_PATH $ENV{ASCEND_HOME_PATH})\n"
        "include_directories(${ASCEND_PATH}/include ${ASCEND_PATH}/include/aclnnop)\n"
        "link_directories(${ASCEND_PATH}/lib64)\n"
        "add_executable(opapi_test main.cpp)\ntarget_link_libraries(opapi_test ascendcl nnopbase opapi)\n")
    shutil.copyfile(HERE / "capi" / "threads.cpp", tmp_path / "main.cpp")
    env = home.environment()
    build_dir = str(tmp_path / "build")
    for cmd in (["cmake", "-S", str(tmp_path), "-B", build_dir], ["cmake", "--build", build_dir]):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run([str(tmp_path / "build" / "opapi_test")], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_command_line_writes_the_tree_and_refuses_in_one_line(tmp_path):
    from gradops.cli import main

    assert main(["cann-home", str(tmp_path / "t")]) == 0
    assert (tmp_path / "t" / "lib64" / "libopapi.so").is_file()
    assert (tmp_path / "t" / "set_env.sh").read_text().count("ASCEND_HOME_PATH") >= 2
    blocker = tmp_path / "file"
    blocker.write_text("")
    done = subprocess.run([sys.executable, "-m", "gradops", "cann-home", str(blocker / "x")],
                          capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("gradops cann-home: error:")


# ------------------------------------------------------------------------------------ CANN's own examples
def _printed(stdout: str) -> list[float]:
    return [float(m) for m in re.findall(r"is: (-?[0-9.]+)", stdout)]


def _example(home, tmp_path, name) -> subprocess.CompletedProcess:
    if EXAMPLES is None:
        pytest.skip("CANN's examples are not here: set GRADOPS_CANN_EXAMPLES or keep shared/cann-examples beside "
                    "the checkout")
    return run(home, build(home, EXAMPLES / f"{name}.cpp", tmp_path / name))


def _hosted(values, shape, dtype=torch.float32):
    return torch.tensor(values, dtype=torch.float32).to(dtype).reshape(shape)


def test_cann_example_rms_norm_grad(home, tmp_path):
    done = _example(home, tmp_path, "rms_norm_grad")
    assert done.returncode == 0, done.stdout + done.stderr
    x = _hosted(range(1, 33), (2, 1, 16))
    dx, dgamma = gradops.rms_norm_grad(x.clone(), x, torch.tensor([1.0, 2.0]), _hosted(range(1, 17), (16,)))
    want = torch.cat([dx.reshape(-1), dgamma])
    assert torch.tensor(_printed(done.stdout)).allclose(want, rtol=1e-6, atol=1e-3), done.stdout


def test_cann_example_embedding_dense_backward(home, tmp_path):
    done = _example(home, tmp_path, "embedding_dense_backward")
    assert done.returncode == 0, done.stdout + done.stderr
    want = gradops.embedding_dense_backward(_hosted(range(1, 7), (2, 3)), torch.tensor([1, 2]), 4, 0, False)
    assert _printed(done.stdout) == want.reshape(-1).tolist()


def test_cann_example_hardswish_backward(home, tmp_path):
    done = _example(home, tmp_path, "hardswish_backward")
    assert done.returncode == 0, done.stdout + done.stderr
    x = _hosted(range(8), (4, 2))
    want = gradops.hardswish_backward(x, x)
    assert torch.tensor(_printed(done.stdout)).allclose(want.reshape(-1), atol=5e-7), done.stdout


def test_cann_example_moe_token_permute_grad_is_refused_in_phase_2(home, tmp_path):
    # The example fills INT32 indices from float data: index 1 reads 0x3F800000, far outside [0, 2).
    done = _example(home, tmp_path, "moe_token_permute_grad")
    assert done.returncode == 161002 % 256, done.stdout + done.stderr
    assert done.stdout.strip() == "aclnnMoeTokenPermuteGrad failed. ERROR: 161002"
    indices = torch.tensor([0.0, 1.0]).view(torch.int32)
    grad = torch.tensor([1.0, 2.0]).view(torch.bfloat16).reshape(2, 2)
    status, size, executor = aclnn.aclnnMoeTokenPermuteGradGetWorkspaceSize(grad, indices, 2, False,
                                                                              torch.zeros(1, 2, dtype=torch.bfloat16))
    assert status == 0
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    assert aclnn.aclnnMoeTokenPermuteGrad(workspace, size, executor, None) == 161002


# ------------------------------------------------------------------------------ host threads, the C budget
def test_four_host_threads_get_right_answers_and_their_own_messages(home, tmp_path):
    done = run(home, build(home, HERE / "capi" / "threads.cpp", tmp_path / "threads", "-pthread"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split("\n")[:4] == [f"ok {t} 450" for t in range(4)]


def test_the_two_phase_benchmark_runs(home, tmp_path):
    # Its figures are recorded by scripts/bench_cann_c.py (benchmarks/results), never asserted here.
    done = run(home, build(home, ROOT / "benchmarks" / "capi" / "two_phase.cpp", tmp_path / "bench", "-O2"), "1", "5")
    assert done.returncode == 0, done.stdout + done.stderr
    ops = [json.loads(line)["op"] for line in done.stdout.splitlines()]
    assert ops == ["aclnnRmsNormGrad", "aclnnHardswishBackward", "aclnnLayerNormBackward",
                   "aclnnEmbeddingDenseBackward", "aclnnMoeTokenPermuteGrad"]


# ------------------------------------------------------------------- the same answers from C and from Python
ACL_CODES = {torch.float32: 0, torch.float16: 1, torch.int8: 2, torch.int32: 3, torch.uint8: 4, torch.int16: 6,
             torch.int64: 9, torch.float64: 11, torch.bool: 12, torch.complex64: 16, torch.bfloat16: 27}
ACL_FORMAT_ND = 2
_C_TYPES = {"tensor": ctypes.c_void_p, "int_array": ctypes.c_void_p, "bool_array": ctypes.c_void_p,
            "float_array": ctypes.c_void_p, "int64": ctypes.c_int64, "uint64": ctypes.c_uint64,
            "double": ctypes.c_double, "bool": ctypes.c_bool}


class Lib:
    """The three libraries loaded into this process (the bridge then uses this interpreter)."""

    def __init__(self, home: capi.Home) -> None:
        mode = ctypes.RTLD_GLOBAL
        self.acl = ctypes.CDLL(str(home.lib64 / "libascendcl.so"), mode=mode)
        self.base = ctypes.CDLL(str(home.lib64 / "libnnopbase.so"), mode=mode)
        self.ops = ctypes.CDLL(str(home.lib64 / "libopapi.so"), mode=mode)
        self.acl.aclGetRecentErrMsg.restype = ctypes.c_char_p
        i64p, u64 = ctypes.POINTER(ctypes.c_int64), ctypes.c_uint64
        self.base.aclCreateTensor.restype = ctypes.c_void_p
        self.base.aclCreateTensor.argtypes = [i64p, u64, ctypes.c_int, i64p, ctypes.c_int64, ctypes.c_int, i64p, u64,
                                              ctypes.c_void_p]
        for name, element in (("aclCreateIntArray", ctypes.c_int64), ("aclCreateBoolArray", ctypes.c_bool)):
            fn = getattr(self.base, name)
            fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.POINTER(element), u64]
        for name in ("aclDestroyTensor", "aclDestroyIntArray", "aclDestroyBoolArray", "aclDestroyAclOpExecutor",
                     "aclSetAclOpExecutorRepeatable"):
            getattr(self.base, name).argtypes = [ctypes.c_void_p]
        self.phases = {}
        for f in aclnn.C_API:
            one, two = getattr(self.ops, f.name + "GetWorkspaceSize"), getattr(self.ops, f.name)
            one.argtypes = [_C_TYPES[p.kind] for p in f.params] + [ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_void_p)]
            two.argtypes = [ctypes.c_void_p, u64, ctypes.c_void_p, ctypes.c_void_p]
            self.phases[f.name] = one, two

    def message(self) -> str | None:
        raw = self.acl.aclGetRecentErrMsg()
        return None if raw is None else raw.decode()

    def tensor(self, t: torch.Tensor) -> int:
        """An aclTensor over ``t``'s memory: its view, strides and offset inside its whole storage. As in C, the
        memory must outlive the aclTensor and any executor made with it: the caller keeps ``t``."""
        dims = (ctypes.c_int64 * max(t.dim(), 1))(*t.shape)
        strides = (ctypes.c_int64 * max(t.dim(), 1))(*t.stride())
        storage = (ctypes.c_int64 * 1)(t.untyped_storage().nbytes() // t.element_size())
        made = self.base.aclCreateTensor(dims, t.dim(), ACL_CODES[t.dtype], strides, t.storage_offset(),
                                         ACL_FORMAT_ND, storage, 1, t.untyped_storage().data_ptr() or None)
        assert made, self.message()
        return made


@pytest.fixture(scope="session")
def lib(home) -> Lib:
    return Lib(home)


def _copy(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).copy_(a)
    return a


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def _masked(message: str | None) -> str | None:
    return None if message is None else re.sub(r"0x[0-9a-f]+", "0x?", message)


def _as_python(kind: str, value):
    """What the C layer hands the Python phase for ``value`` of a parameter of ``kind``."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    convert = {"uint64": lambda v: int(v) % (1 << 64), "int64": int, "double": float, "bool": bool,
               "int_array": lambda v: tuple(int(x) for x in v), "bool_array": lambda v: tuple(bool(x) for x in v)}
    return convert[kind](value)


def outcome_c(lib: Lib, fn, args) -> tuple:
    made, cargs = [], []
    for p, v in zip(fn.params, args):
        if v is None:
            cargs.append(None)
        elif p.kind == "tensor":
            made.append((lib.base.aclDestroyTensor, lib.tensor(v)))
            cargs.append(made[-1][1])
        elif p.kind in ("int_array", "bool_array"):
            element = ctypes.c_int64 if p.kind == "int_array" else ctypes.c_bool
            create = lib.base.aclCreateIntArray if p.kind == "int_array" else lib.base.aclCreateBoolArray
            destroy = lib.base.aclDestroyIntArray if p.kind == "int_array" else lib.base.aclDestroyBoolArray
            made.append((destroy, create((element * max(len(v), 1))(*v), len(v))))
            cargs.append(made[-1][1])
        else:
            cargs.append(_as_python(p.kind, v))
    one, two = lib.phases[fn.name]
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    try:
        status = one(*cargs, ctypes.byref(size), ctypes.byref(executor))
        first = (status, size.value, _masked(lib.message()))
        if status:
            assert size.value == 0 and executor.value is None
            return first, None
        workspace = torch.empty(size.value, dtype=torch.uint8) if size.value else None
        status = two(None if workspace is None else workspace.data_ptr(), size.value, executor, None)
        return first, (status, _masked(lib.message()))
    finally:
        for destroy, obj in made:
            destroy(obj)


def outcome_python(fn, args) -> tuple:
    status, size, executor = fn.phase1(*[_as_python(p.kind, v) for p, v in zip(fn.params, args)])
    first = (status, size, _masked(aclnn.aclGetRecentErrMsg()) if status else None)
    if status:
        return first, None
    workspace = torch.empty(size, dtype=torch.uint8) if size else None
    status = fn.phase2(workspace, size, executor, None)
    return first, (status, _masked(aclnn.aclGetRecentErrMsg()) if status else None)


def same_answers(lib: Lib, fn, args) -> tuple:
    """Run ``args`` through C and through Python on two copies; assert equal answers and bytes; the outcome."""
    through_c, through_python = [_copy(a) for a in args], [_copy(a) for a in args]
    got, want = outcome_c(lib, fn, through_c), outcome_python(fn, through_python)
    assert got == want, f"{fn.name}: C {got} != Python {want}"
    for p, a, b in zip(fn.params, through_c, through_python):
        if isinstance(a, torch.Tensor):
            assert torch.equal(_bytes(a), _bytes(b)), f"{fn.name}: {p.name} differs"
    return got


def _outs(results) -> list:
    results = results if isinstance(results, tuple) else (results,)
    return [None if r is None else torch.full_like(r, 3) for r in results]


def _routing_indices(si: torch.Tensor, drop: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if not drop:
        return si, si
    token_id, out_index = torch.sort(si, stable=True)
    return out_index.to(si.dtype), token_id


#: Each op's samples in its aclnn form: the public function's arguments, CANN's attributes and outs shaped like the
#: public results.
FORMS = {
    "rms_norm": lambda a, kw: [a[0], a[1], kw.get("epsilon", a[2] if len(a) > 2 else 1e-6),
                               *_outs(gradops.rms_norm(*a, **kw))],
    "rms_norm_grad": lambda a, kw: [*a, *_outs(gradops.rms_norm_grad(*a))],
    "layer_norm_backward": lambda a, kw: [a[0], a[1], tuple(a[4].shape), a[2], a[3], a[4], None, (True, True, True),
                                          *_outs(gradops.layer_norm_backward(*a))],
    "hardswish": lambda a, kw: [*a, *_outs(gradops.hardswish(*a))],
    "hardswish_backward": lambda a, kw: [*a, *_outs(gradops.hardswish_backward(*a))],
    "embedding": lambda a, kw: [_table(a), a[1], torch.full((*a[1].shape, a[0].shape[-1]), 3, dtype=a[0].dtype)],
    "embedding_dense_backward": lambda a, kw: [*a[:3], kw.get("padding_idx", -1), kw.get("scale_grad_by_freq", False),
                                               *_outs(gradops.embedding_dense_backward(*a, **kw))],
    "moe_token_permute": lambda a, kw: [a[0], a[1], kw.get("num_out_tokens") or 0, False,
                                        *_outs(gradops.moe_token_permute(*a, **kw))],
    "moe_token_permute_grad": lambda a, kw: [*a[:3], False, *_outs(gradops.moe_token_permute_grad(*a))],
    "moe_token_unpermute": lambda a, kw: [a[0], a[1], a[2] if len(a) > 2 else None, False, None,
                                          *_outs(gradops.moe_token_unpermute(*a))],
    "moe_token_unpermute_grad": lambda a, kw: [*a[:3], a[3] if len(a) > 3 else None, False, None,
                                               *_outs(gradops.moe_token_unpermute_grad(*a))],
    "moe_token_permute_with_routing_map": lambda a, kw: [a[0], a[1], a[2], a[3] or 0, a[4],
                                                         *_outs(gradops.moe_token_permute_with_routing_map(*a))],
    "moe_token_permute_with_routing_map_grad": lambda a, kw: [
        *a, *_outs(gradops.moe_token_permute_with_routing_map_grad(*a))],
    "moe_token_unpermute_with_routing_map": lambda a, kw: [
        a[0], a[1], a[4], a[3], a[5], tuple(a[2]), *_outs(gradops.moe_token_unpermute_with_routing_map(*a)),
        torch.zeros_like(a[1]), torch.zeros_like(a[1]),
        torch.zeros(a[1].numel(), dtype=a[3].dtype if a[3] is not None else torch.float32)],
    "moe_token_unpermute_with_routing_map_grad": lambda a, kw: [
        a[1], *_routing_indices(a[2], a[5]), a[4], a[0], a[3], a[5], None,
        *_outs(gradops.moe_token_unpermute_with_routing_map_grad(*a))],
    "swiglu": lambda a, kw: [a[0], a[1], *_outs(gradops.swiglu(*a))],
    "swiglu_grad": lambda a, kw: [*a, *_outs(gradops.swiglu_grad(*a))],
}

def _table(a: tuple) -> torch.Tensor:
    """The lookup's table for a backward sample ``(grad, indices, numWeights)``: numWeights rows of grad's width."""
    return torch.linspace(-2, 2, a[2] * a[0].shape[-1]).to(a[0].dtype).reshape(a[2], a[0].shape[-1])


OPS = {spec.cann: spec.name for spec in registry.SPECS}
#: The lookup has no samples of its own (no backend implements it: a gather); its backward's give its indices.
SAMPLES_OF = {"embedding": "embedding_dense_backward"}
SAMPLED = [(f, s) for f in aclnn.C_API for s in samples(SAMPLES_OF.get(OPS[f.name], OPS[f.name]))]


def test_every_operator_has_its_aclnn_form():
    assert {OPS[f.name] for f in aclnn.C_API} == set(FORMS)


@pytest.mark.parametrize("fn,sample", SAMPLED, ids=[f"{f.name}-{s.name}" for f, s in SAMPLED])
def test_samples_answer_alike_from_c_and_python(lib, fn, sample):
    same_answers(lib, fn, FORMS[OPS[fn.name]](sample.args, sample.kwargs))


def _mutations(fn, base: list):
    """Refusal cases built from a valid call: each argument made absent, of another dtype or shape, non-contiguous,
    out of range; integer tensors filled with indices nobody has (refused when the executor runs)."""
    for i, (p, v) in enumerate(zip(fn.params, base)):
        def at(value, i=i):
            return [*base[:i], value, *base[i + 1:]]

        if p.kind == "tensor" and v is not None:
            yield f"{p.name}-null", at(None)
            yield f"{p.name}-float64", at(v.double())
            yield f"{p.name}-int32", at(v.int())
            yield f"{p.name}-bigger", at(torch.zeros(*(s + 1 for s in v.shape), dtype=v.dtype))
            yield f"{p.name}-extra-dim", at(v.unsqueeze(0).expand(2, *v.shape).contiguous())
            if v.dim() >= 1 and v.numel() > 1:
                yield f"{p.name}-strided", at(torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype)[..., ::2])
            if not v.is_floating_point() and v.numel():
                yield f"{p.name}-far-indices", at(torch.full_like(v, 1 << 20 if v.dtype != torch.bool else 1))
        elif p.kind in ("int64", "uint64"):
            for value in (-1, 0, 1 << 40):
                yield f"{p.name}={value}", at(value)
        elif p.kind == "double":
            yield f"{p.name}=nan", at(float("nan"))
        elif p.kind == "bool":
            yield f"{p.name}={not v}", at(not v)
        elif p.kind in ("int_array", "bool_array"):
            yield f"{p.name}-null", at(None)
            yield f"{p.name}-short", at(tuple(v)[:-1] if v else (1,))


def _mutated():
    cases = []
    for f in aclnn.C_API:
        first = next(iter(samples(SAMPLES_OF.get(OPS[f.name], OPS[f.name]))))
        base = FORMS[OPS[f.name]](first.args, first.kwargs)
        cases += [(f, name, args) for name, args in _mutations(f, base)]
    return cases


MUTATED = _mutated()


@pytest.mark.parametrize("fn,why,args", MUTATED, ids=[f"{f.name}-{w}" for f, w, _ in MUTATED])
def test_refusals_answer_alike_from_c_and_python(lib, fn, why, args):
    same_answers(lib, fn, args)


def test_the_mutations_refuse_in_both_phases_and_every_status():
    refused = set()
    for f, _, args in MUTATED:
        for phase, answer in enumerate(outcome_python(f, [_copy(a) for a in args])):
            if answer is not None and answer[0]:
                refused.add((phase, answer[0]))
    assert {(0, 161001), (0, 161002), (0, 561002), (1, 161002)} <= refused


# ------------------------------------------------------------------------------- what the C layer checks itself
def _rms(lib: Lib, **replace):
    x = torch.randn(4, 8)
    args = {"dy": torch.randn(4, 8), "x": x, "rstd": torch.rand(4) + 0.5, "gamma": torch.randn(8),
            "dxOut": torch.empty(4, 8), "dgammaOut": torch.empty(8)}
    args.update(replace)
    return args


def test_refusals_name_the_argument_and_the_rule_in_aclgetrecenterrmsg(lib):
    fn = next(f for f in aclnn.C_API if f.name == "aclnnRmsNormGrad")
    (status, _, message), _ = outcome_c(lib, fn, list(_rms(lib, gamma=torch.randn(5)).values()))
    assert status == 561002
    assert "gamma" in message and "(5,)" in message and "561002" in message, message
    assert lib.message() is None  # read once: CANN's aclGetRecentErrMsg clears what it returns


def test_objects_not_made_or_already_destroyed_are_refused_not_dereferenced(lib):
    one, two = lib.phases["aclnnHardswishBackward"]
    x, y = torch.randn(4, 4), torch.empty(4, 4)  # the memory stays ours while the C objects point into it
    a, b, out = lib.tensor(x), lib.tensor(x), lib.tensor(y)
    lib.base.aclDestroyTensor(b)
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    assert one(a, b, out, ctypes.byref(size), ctypes.byref(executor)) == 161002
    assert "self is not an object this library made" in lib.message()
    assert one(a, a, out, None, ctypes.byref(executor)) == 161001
    assert "workspaceSize is nullptr" in lib.message()
    assert one(a, a, out, ctypes.byref(size), ctypes.byref(executor)) == 0
    assert two(None, size, executor, None) == 0
    assert two(None, size, executor, None) == 161002  # single-use: the id is gone, never reused
    assert "ran already" in lib.message()
    assert two(None, 0, ctypes.c_void_p(0xDEAD0), None) == 161002
    assert lib.base.aclDestroyAclOpExecutor(ctypes.c_void_p(0xDEAD0)) == 161002
    assert one(a, a, out, ctypes.byref(size), ctypes.byref(executor)) == 0
    assert two(None, size, executor, ctypes.c_void_p(0x1234)) == 161002  # a stream aclrtCreateStream did not make
    assert "stream" in lib.message()
    assert lib.base.aclSetAclOpExecutorRepeatable(executor) == 0
    for _ in range(3):
        assert two(None, size, executor, None) == 0
    assert lib.base.aclDestroyAclOpExecutor(executor) == 0
    assert two(None, size, executor, None) == 161002
    for t in (a, out):
        assert lib.base.aclDestroyTensor(t) == 0
    assert lib.base.aclDestroyTensor(a) == 161002


def test_a_view_outside_its_storage_or_its_block_is_refused(lib):
    i64 = ctypes.c_int64
    dims, strides, storage = (i64 * 2)(4, 4), (i64 * 2)(4, 1), (i64 * 1)(15)
    data = torch.zeros(16)
    assert not lib.base.aclCreateTensor(dims, 2, 0, strides, 0, ACL_FORMAT_ND, storage, 1, data.data_ptr())
    assert "runs past its storage of 15 elements" in lib.message()
    assert not lib.base.aclCreateTensor(dims, 2, 0, (i64 * 2)(-4, 1), 0, ACL_FORMAT_ND, storage, 1, data.data_ptr())
    lib.message()
    # An aclrtMalloc block of 32 bytes holding a (4, 4) float tensor's 64: refused when an operator would read it.
    lib.acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    block = ctypes.c_void_p()
    assert lib.acl.aclrtMalloc(ctypes.byref(block), 32, 0) == 0
    short = lib.base.aclCreateTensor(dims, 2, 0, strides, 0, ACL_FORMAT_ND, (i64 * 1)(16), 1, block)
    y = torch.empty(4, 4)
    good, out = lib.tensor(data.reshape(4, 4)), lib.tensor(y)
    one, _ = lib.phases["aclnnHardswishBackward"]
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    assert one(good, short, out, ctypes.byref(size), ctypes.byref(executor)) == 161002
    assert "runs past the end of the aclrtMalloc block" in lib.message()
    for t in (short, good, out):
        lib.base.aclDestroyTensor(t)
    lib.acl.aclrtFree.argtypes = [ctypes.c_void_p]
    assert lib.acl.aclrtFree(block) == 0
    assert lib.acl.aclrtFree(block) == 100000  # freed already: refused, not a double free


def test_private_formats_and_unreadable_dtypes_are_refused(lib):
    i64 = ctypes.c_int64
    data = torch.zeros(16)
    dims, strides = (i64 * 2)(4, 4), (i64 * 2)(4, 1)
    nz = lib.base.aclCreateTensor(dims, 2, 0, strides, 0, 29, dims, 2, data.data_ptr())  # ACL_FORMAT_FRACTAL_NZ
    y = torch.empty(4, 4)
    out = lib.tensor(y)
    one, _ = lib.phases["aclnnHardswishBackward"]
    size, executor = ctypes.c_uint64(), ctypes.c_void_p()
    assert one(nz, nz, out, ctypes.byref(size), ctypes.byref(executor)) == 161002
    assert "private Ascend layout" in lib.message()
    # ACL_UINT1 (bits, no byte size): no tensor can be made of it
    assert not lib.base.aclCreateTensor(dims, 2, 30, strides, 0, ACL_FORMAT_ND, dims, 2, data.data_ptr())
    assert "ACL_UINT1" in lib.message()
    for t in (nz, out):
        lib.base.aclDestroyTensor(t)


def test_the_runtime_subset_checks_handles_and_bounds(lib):
    acl = lib.acl
    stream = ctypes.c_void_p()
    acl.aclrtCreateStream.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    for name in ("aclrtDestroyStream", "aclrtSynchronizeStream"):
        getattr(acl, name).argtypes = [ctypes.c_void_p]
    assert acl.aclrtCreateStream(ctypes.byref(stream)) == 0
    assert acl.aclrtSynchronizeStream(stream) == 0
    assert acl.aclrtDestroyStream(stream) == 0
    assert acl.aclrtSynchronizeStream(stream) == 200005  # destroyed
    assert acl.aclrtSetDevice(1) == 200002
    acl.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
    acl.aclrtMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    block = ctypes.c_void_p()
    assert acl.aclrtMalloc(ctypes.byref(block), 0, 0) == 100000
    assert acl.aclrtMalloc(ctypes.byref(block), 16, 0) == 0
    assert block.value % 512 == 0
    src = (ctypes.c_char * 64)()
    assert acl.aclrtMemcpy(block, 16, src, 16, 1) == 0
    assert acl.aclrtMemcpy(block, 64, src, 64, 1) == 100000  # past the 16-byte block
    assert "run past the end" in lib.message()
    assert acl.aclrtMemcpy(block, 8, src, 16, 1) == 100000  # count > destMax
    acl.aclrtFree.argtypes = [ctypes.c_void_p]
    assert acl.aclrtFree(block) == 0
    acl.aclrtGetMemInfo.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    assert acl.aclrtGetMemInfo(0, None, None) == 200001
    assert "not supported" in lib.message()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_tensors_over_c_memory_are_the_same_with_or_without_the_extension(dtype):
    from gradops.aclnn.capi import bridge

    base = (torch.arange(60) % 7).to(dtype)
    for sizes, strides, offset in (((3, 4), (4, 1), 2), ((4, 3), (1, 5), 1), ((2, 0), (1, 1), 0), ((), (), 5)):
        made = [make(base.data_ptr(), dtype, sizes, strides, offset)
                for make in (bridge.from_address, bridge._from_address_python)]
        want = base.as_strided(sizes, strides, offset)
        for t in made:
            assert t.shape == want.shape and t.dtype == dtype and torch.equal(t, want)
            if want.numel():
                assert t.data_ptr() == want.data_ptr()  # a view of the caller's memory, not a copy


def test_float16_conversions_round_to_nearest_even(lib):
    lib.acl.aclFloatToFloat16.restype, lib.acl.aclFloatToFloat16.argtypes = ctypes.c_uint16, [ctypes.c_float]
    lib.acl.aclFloat16ToFloat.restype, lib.acl.aclFloat16ToFloat.argtypes = ctypes.c_float, [ctypes.c_uint16]
    values = torch.cat([torch.randn(2000) * 100, torch.tensor([0.0, -0.0, 65504.0, 70000.0, 1e-7, 5.96e-8, 2.98e-8,
                                                                float("inf"), float("-inf")])])
    for v in values.tolist():
        want = torch.tensor(v).half().view(torch.int16).item() & 0xFFFF
        assert lib.acl.aclFloatToFloat16(v) == want, v
        assert lib.acl.aclFloat16ToFloat(want) == torch.tensor(want, dtype=torch.int32).to(torch.int16) \
            .view(torch.float16).float().item()
