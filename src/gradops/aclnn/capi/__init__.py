"""The C surface of gradops' aclnn operators: ``gradops cann-home DIR`` writes an Ascend-toolkit-shaped tree that
CANN's host programs build against unchanged and run on the CPU.

::

    DIR/include/acl/acl.h, acl_base.h, acl_rt.h     AscendCL: init, devices, streams, events, memory, error messages
    DIR/include/aclnn/acl_meta.h, aclnn_base.h      aclTensor and its kin, executors, the aclnn status codes
    DIR/include/aclnnop/aclnn_<op>.h                one per operator, generated from gradops.aclnn.C_API
    DIR/lib64/libascendcl.so                        the runtime subset (ascendcl.cpp)
    DIR/lib64/libnnopbase.so                        the objects, the bridge to gradops.aclnn (objects.cpp, bridge.cpp)
    DIR/lib64/libopapi.so                           the operators' entry points (generated: share/gradops/opapi.cpp)
    DIR/set_env.sh                                  ASCEND_HOME_PATH, LD_LIBRARY_PATH, as CANN's set_env.sh

so that ``g++ main.cpp -I DIR/include -I DIR/include/aclnnop -L DIR/lib64 -lascendcl -lnnopbase -lopapi`` builds
(and a CMake project with ``ASCEND_HOME_PATH=DIR``). The operators run in :mod:`gradops.aclnn` - the same
validation tables, statuses, workspace sizes, phase-2 re-checks and kernels - through an embedded Python (the
interpreter that wrote the tree): there is no second copy of any contract in C. docs/cann-c.md shows an example
built and run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ... import native
from ...cli_support import CommandError
from .. import C_API
from .._declare import CFunction

_HERE = Path(__file__).parent
#: The headers written by hand (CANN's values, gradops' words), copied under DIR/include as they are.
STATIC_HEADERS = ("acl/acl.h", "acl/acl_base.h", "acl/acl_rt.h", "aclnn/acl_meta.h", "aclnn/aclnn_base.h")
#: The three libraries, in link order, each with its sources and the libraries it links.
LIBRARIES = (("ascendcl", ("ascendcl.cpp",), ()),
             ("nnopbase", ("objects.cpp", "bridge.cpp"), ("ascendcl",)),
             ("opapi", ("opapi.cpp",), ("nnopbase", "ascendcl")))
CXXFLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wno-unused-function")


@dataclass(frozen=True)
class Home:
    """A written tree: its root, the operator headers and the libraries."""

    root: Path
    headers: tuple[Path, ...]
    libraries: tuple[Path, ...]

    @property
    def include(self) -> Path:
        return self.root / "include"

    @property
    def lib64(self) -> Path:
        return self.root / "lib64"

    def compile_line(self, source: str, output: str) -> list[str]:
        """The build line of a CANN host program against this tree (what CANN's examples document)."""
        return [compiler(), source, "-o", output, f"-I{self.include}", f"-I{self.include / 'aclnnop'}",
                f"-L{self.lib64}", "-lascendcl", "-lnnopbase", "-lopapi"]

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with what set_env.sh exports."""
        env = dict(os.environ if base is None else base)
        env["ASCEND_HOME_PATH"] = env["ASCEND_TOOLKIT_HOME"] = str(self.root)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.lib64), env.get("LD_LIBRARY_PATH", "")]))
        return env


class HomeError(RuntimeError):
    """The tree cannot be written here (no compiler, a Python without a shared libpython, a compile failure)."""


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "").strip() or "c++"


def _c_string(text: str) -> str:
    """``text`` as a C string literal (octal escapes for what is not printable ASCII)."""
    out = []
    for byte in os.fsencode(text):
        ch = chr(byte)
        out.append(ch if 32 <= byte < 127 and ch not in '"\\?' else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def operator_header(fn: CFunction) -> str:
    """``include/aclnnop/<fn.header>``: the two phases' declarations."""
    guard = "GRADOPS_CANN_" + fn.header.upper().replace(".", "_") + "_"
    params = ", ".join(f"{p.ctype}{'' if p.ctype.endswith('*') else ' '}{p.name}" for p in fn.params)
    summary = " ".join((fn.phase1.__doc__ or "").strip().split("\n\n")[0].split())
    return f"""/* gradops' CANN C surface: {fn.name}, written by `gradops cann-home` from its declaration in
 * {fn.phase1.__module__}. The phases run {fn.phase1.__module__}.{fn.phase1.__name__} and {fn.name}: the same
 * statuses, workspace size and results.
 *
 * {summary.replace("*/", "* /")}
 */
#ifndef {guard}
#define {guard}

#include "aclnn/aclnn_base.h"

#ifdef __cplusplus
extern "C" {{
#endif

ACL_FUNC_VISIBILITY aclnnStatus {fn.name}GetWorkspaceSize({params}, uint64_t *workspaceSize,
    aclOpExecutor **executor);
ACL_FUNC_VISIBILITY aclnnStatus {fn.name}(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
    aclrtStream stream);

#ifdef __cplusplus
}}
#endif

#endif /* {guard} */
"""


def opapi_source(functions: tuple[CFunction, ...]) -> str:
    """libopapi's source: each operator's two entry points, handing their arguments to nnopbase's bridge."""
    out = ["// libopapi.so: every operator's entry points, written by `gradops cann-home` from gradops.aclnn.C_API.",
           "// Each hands its arguments, tagged by type, to libnnopbase's bridge (gradops_capi.h).", "",
           '#include "gradops_capi.h"', ""]
    out += [f'#include "aclnnop/{fn.header}"' for fn in functions]
    out += ["", "using gradops_capi::arg;", "", "namespace {"]
    for fn in functions:
        names = ", ".join(_c_string(p.name) for p in fn.params)
        out.append(f"const char* const {fn.name}_params[] = {{{names}}};")
        out.append(f"gradops_capi::Op {fn.name}_op = {{{_c_string(fn.name)}, {_c_string(fn.signature)}, "
                   f"{fn.name}_params, {len(fn.params)}, nullptr}};")
    out += ["}  // namespace", "", 'extern "C" {', ""]
    for fn in functions:
        params = ", ".join(f"{p.ctype}{'' if p.ctype.endswith('*') else ' '}{p.name}" for p in fn.params)
        args = ", ".join(f"arg({p.name})" for p in fn.params)
        out += [f"aclnnStatus {fn.name}GetWorkspaceSize({params}, uint64_t* workspaceSize, "
                "aclOpExecutor** executor) {",
                f"  const gradops_capi::Arg args[] = {{{args}}};",
                f"  return gradops_phase1(&{fn.name}_op, args, workspaceSize, executor);",
                "}", "",
                f"aclnnStatus {fn.name}(void* workspace, uint64_t workspaceSize, aclOpExecutor* executor, "
                "aclrtStream stream) {",
                f"  return gradops_phase2(&{fn.name}_op, workspace, workspaceSize, executor, stream);",
                "}", ""]
    out.append('}  // extern "C"')
    return "\n".join(out) + "\n"


def home_header() -> str:
    """gradops_home.h: the interpreter, module path and kernel cache the embedded Python starts with (this
    process's: the folder gradops is imported from comes first, so the list is never empty)."""
    package_root = str(Path(__file__).resolve().parents[3])
    paths = [package_root, *(p for p in sys.path if p and os.path.isdir(p) and p != package_root)]
    cache = native.build_dir().parents[1]  # <cache>/native/<tag>: the extension this tree's bridge loads
    return "\n".join([
        "// Written by `gradops cann-home`: the Python that runs gradops for the C surface (the one that wrote it).",
        "#pragma once",
        f"static const char* const GRADOPS_PYTHON = {_c_string(sys.executable)};",
        f"static const char* const GRADOPS_CACHE = {_c_string(str(cache))};",
        "static const char* const GRADOPS_PATHS[] = {" + ", ".join(_c_string(p) for p in paths) + "};", ""])


def _python_link() -> list[str]:
    """How libnnopbase links libpython (shared builds only: a static interpreter cannot be embedded twice)."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise HomeError(f"the C surface embeds Python and needs a shared libpython; {sys.executable} is a static build "
                        "(use a Python built with --enable-shared, as distributions' and pyenv's with "
                        "PYTHON_CONFIGURE_OPTS=--enable-shared are)")
    libdir = sysconfig.get_config_var("LIBDIR")
    version = sysconfig.get_config_var("LDVERSION") or sysconfig.get_python_version()
    return [f"-I{sysconfig.get_paths()['include']}", f"-L{libdir}", f"-Wl,-rpath,{libdir}", f"-lpython{version}"]


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-6:])
        raise HomeError(f"building {what} failed ({' '.join(cmd[:2])} ...): {tail}")


def write_home(root: str | os.PathLike, functions: tuple[CFunction, ...] = C_API) -> Home:
    """Write the tree (headers, generated sources, the three libraries, set_env.sh) under ``root``.

    Raises:
        HomeError: no C++ compiler, a static Python, or a compile that failed (its last lines).
    """
    if shutil.which(compiler()) is None:
        raise HomeError(f"no C++ compiler: {compiler()} is not on PATH (install g++ or point CXX at one)")
    for fn in functions:
        wrong = fn.mismatch()
        if wrong:
            raise HomeError(f"declaration does not match its Python phase: {wrong}")
    root = Path(root).resolve()
    include, lib64, share = root / "include", root / "lib64", root / "share" / "gradops"
    for folder in (include / "acl", include / "aclnn", include / "aclnnop", lib64, share):
        folder.mkdir(parents=True, exist_ok=True)
    for name in STATIC_HEADERS:
        shutil.copyfile(_HERE / "include" / name, include / name)
    headers = []
    for fn in functions:
        path = include / "aclnnop" / fn.header
        path.write_text(operator_header(fn))
        headers.append(path)
    (share / "opapi.cpp").write_text(opapi_source(functions))
    (share / "gradops_home.h").write_text(home_header())
    python = _python_link()
    _ensure_extension()
    made = []
    for name, files, links in LIBRARIES:
        out = lib64 / f"lib{name}.so"
        sources = [share / f if f == "opapi.cpp" else _HERE / f for f in files]  # opapi.cpp is generated
        cmd = [compiler(), *CXXFLAGS, *map(str, sources), "-o", str(out), f"-I{include}",
               f"-I{_HERE}", f"-I{share}", f"-L{lib64}", "-Wl,-rpath,$ORIGIN", *[f"-l{lib}" for lib in links]]
        if name == "nnopbase":
            cmd += python
        _run(cmd, f"lib{name}.so")
        made.append(out)
    (root / "set_env.sh").write_text(
        "# gradops' CANN tree: source it as CANN's set_env.sh (ASCEND_HOME_PATH, the libraries' path).\n"
        f"export ASCEND_HOME_PATH={_shell(root)}\n"
        "export ASCEND_TOOLKIT_HOME=\"$ASCEND_HOME_PATH\"\n"
        "export LD_LIBRARY_PATH=\"$ASCEND_HOME_PATH/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}\"\n")
    return Home(root, tuple(headers), tuple(made))


def _shell(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def _ensure_extension() -> None:
    """Build the native extension now if it is missing (the bridge's tensors over C memory use it; a host program's
    first call should not wait two minutes for a build)."""
    try:
        native.kernels()
    except ImportError as err:  # the bridge falls back to its Python form; say so once
        print(f"gradops cann-home: the native extension is unavailable ({err}); tensors over C memory take the "
              "slower Python path", file=sys.stderr)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="where to write the tree (created if missing)")


def run(args: argparse.Namespace) -> int:
    try:
        home = write_home(args.dir)
    except (HomeError, OSError) as err:
        raise CommandError(str(err)) from err
    print(f"gradops cann-home: wrote {home.root} ({len(home.headers)} operator headers, "
          f"{', '.join(p.name for p in home.libraries)})")
    print(f"  build: g++ main.cpp -I {home.include} -I {home.include / 'aclnnop'} -L {home.lib64} "
          "-lascendcl -lnnopbase -lopapi")
    print(f"  run:   source {home.root / 'set_env.sh'}  (or LD_LIBRARY_PATH={home.lib64})")
    return 0
