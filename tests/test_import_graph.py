"""gradops' modules import each other without a cycle, counting every way one module reaches another: imports at the
top, imports inside functions, and module names looked up as strings (``sys.modules.get("gradops.x")``,
``importlib.import_module("gradops.x")``). A cycle makes the import order matter and hides what depends on what;
the one-spec design (docs/architecture.md) keeps the graph layered: the leaf runtime module, then contracts and
kernels, then the ops, then the surfaces."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
_NAME = re.compile(r"gradops(\.\w+)+")


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, whether it is a package's __init__)."""
    found = {}
    for path in SRC.joinpath("gradops").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _owner(name: str, modules: dict) -> str | None:
    """The module a dotted name lives in (``gradops.cpu._host.kernel`` -> ``gradops.cpu._host``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def graph() -> dict[str, set[str]]:
    """module -> the gradops modules it reaches (see the module docstring)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, (path, package) in modules.items():
        here = module if package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join(anchor) + (f".{node.module}" if node.module else "")
                # ``from X import a``: the module X.a where there is one, else X (a is a name X defines)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
                targets = [node.value]
            else:
                continue
            for target in targets:
                owner = _owner(target, modules)
                if owner is not None and owner != module:
                    edges[module].add(owner)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_gradops():
    edges = graph()
    assert len(edges) > 50 and edges["gradops.cpu"], "the graph must see gradops' modules and their imports"
    found = cycles(edges)
    assert not found, "import cycles (imports anywhere and module-name lookups counted):\n" + "\n".join(
        f"{len(c)}: " + " <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_what_it_is_for():
    """A cycle through a function-level import, one through a name looked up as a string, and a chain without a
    cycle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert [sorted(c) for c in cycles({"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"p"}})] == [["p", "q"], ["x", "y"]]
    edges = graph()
    assert "gradops.cpu" in edges["gradops.backend"], "a module name as a string (backend.MODULES) counts"
    assert "gradops.launch._common" in edges["gradops"], "a lookup inside a function (gradops.synchronize) counts"
    assert "gradops.contract._memo" in edges["gradops.ops._plan"], "from ..contract._memo import LIMIT, key_of"


_UNDECLARED = r"""
import builtins, json, sys
allowed = set(sys.stdlib_module_names) | set(json.loads(sys.argv[1])) | {"gradops", "_typeshed"}
found = set()
real = builtins.__import__


def watched(name, globals=None, locals=None, fromlist=(), level=0):
    # what a gradops module imports by absolute name (relative imports stay inside gradops)
    if level == 0 and globals and str(globals.get("__name__", "")).startswith("gradops"):
        top = name.partition(".")[0]
        if top not in allowed:
            found.add(top)
    return real(name, globals, locals, fromlist, level)


builtins.__import__ = watched
import importlib
import torch
for module in ("gradops", "gradops.cpu", "gradops.nn", "gradops.aclnn", "gradops.ascendc", "gradops.golden",
               "gradops.golden.files", "gradops.cli", "gradops.npu_compat", "gradops.env", "gradops.check"):
    importlib.import_module(module)
import gradops
x = torch.randn(64, 32)
gradops.rms_norm_grad(x, x, torch.ones(64), torch.ones(32))
print(json.dumps(sorted(found)))
"""


def test_gradops_imports_nothing_it_does_not_declare():
    """Every package a gradops module imports is the standard library's, a dependency or an extra's in
    pyproject.toml. (numba's removal left numpy imported by the CPU output pool and the golden files but declared
    nowhere: a fresh environment had no numpy, and the CPU kernels fell back to the reference.)"""
    import json
    import subprocess
    import sys

    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values()
                                                 for r in extra)]
    declared = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in requirements}
    done = subprocess.run([sys.executable, "-c", _UNDECLARED, json.dumps(sorted(declared))], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], "imported by gradops, declared nowhere"
