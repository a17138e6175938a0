"""An op is one room: what is only one op family's lives in its folder (``gradops/families/<family>/``), and the
rest of gradops reaches it through the declarations (:mod:`gradops.registry`), not by name. Outside the folder, a
family's ops may be named in code by its consumers only - the nn modules, the torch_npu names, the transformers
patch, expert parallelism: at most four source files, package ``__init__`` re-exports not counted. And no module
finds an op's piece by a name it builds from a string (``getattr(module, f"{op}_shaped")``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gradops import families

PACKAGE = Path(families.__file__).resolve().parents[1]
FOLDERS = {p.name for p in Path(families.__file__).parent.iterdir() if (p / "__init__.py").is_file()}
#: Module attributes that are torch's, not gradops' (``F.layer_norm``, ``torch.rms_norm``, ``aten.hardswish``,
#: ``torch.ops.aten.x``): an attribute whose chain starts at one of these names.
TORCH_ROOTS = {"torch", "F", "aten"}


def _torch_attribute(node: ast.Attribute) -> bool:
    owner = node.value
    while isinstance(owner, ast.Attribute):
        owner = owner.value
    return isinstance(owner, ast.Name) and owner.id in TORCH_ROOTS


def _names(family: str) -> set[str]:
    """The family's op names, from its declaration modules."""
    return {spec.name for module in families.DECLARATIONS if module.__name__.split(".")[2] == family
            for spec in module.SPECS}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def named_in_code(tree: ast.AST) -> set[str]:
    """Every name the module's code uses: identifiers, attributes (not torch's), definitions, imported names and
    module paths, and string constants that are not docstrings."""
    docs, found = _docstrings(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            if not _torch_attribute(node):
                found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.alias):
            found.update(part for part in [*node.name.split("."), node.asname or ""] if part)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.lstrip("."))  # families.moe.ops: the folder, by its path
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            found.add(node.value)
    return {name.lstrip("_") for name in found}


def outside_users(family: str) -> list[str]:
    """The source files outside the family's folder (package __init__s aside) whose code names one of its ops or
    imports from its folder."""
    wanted = _names(family)
    folder_path = f"families.{family}"
    folder = PACKAGE / "families" / family
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if folder in path.parents or path.name == "__init__.py":
            continue
        named = named_in_code(ast.parse(path.read_text(), str(path)))
        if named & wanted or any(folder_path in name for name in named):
            users.append(str(path.relative_to(PACKAGE)))
    return users


@pytest.mark.parametrize("family", sorted(FOLDERS))
def test_outside_its_folder_only_consumers_name_a_family(family):
    users = outside_users(family)
    assert len(users) <= 4, f"{family} is named outside its folder by {users}"


def test_the_room_check_sees_names():
    """The check finds an op named in code, whatever the form, and ignores docstrings and torch's own functions."""
    code = '''"""rms_norm_grad in a docstring does not count."""
import torch.nn.functional as F
y = F.layer_norm(x, (4,)) + torch.ops.aten.hardswish(x)
'''
    assert not named_in_code(ast.parse(code)) & {"rms_norm_grad", "layer_norm", "hardswish"}
    assert "rms_norm" in named_in_code(ast.parse("ops.rms_norm(x, g)"))  # gradops.ops, not torch.ops
    for use in ("gradops.rms_norm_grad(x)", "plan = {'rms_norm_grad': 1}", "from .x import rms_norm_grad",
                "def _rms_norm_grad(): pass"):
        assert "rms_norm_grad" in named_in_code(ast.parse(use)), use
    assert "families.rms_norm.ops" in named_in_code(ast.parse("from ..families.rms_norm.ops import plan"))
    assert {"rms_norm", "layer_norm", "moe"} <= FOLDERS and _names("moe") >= {"moe_token_permute_grad"}


def test_no_piece_is_found_by_a_name_built_from_a_string():
    """``getattr(x, f"...{...}")`` and ``import_module(f"...{...}")`` in the runtime: a piece found by a built name
    is a piece no reader (or tool) can follow. The bench and transformers' model modules are not ops' pieces."""
    allowed = {"bench/__init__.py", "transformers.py", "demo/training.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
                    in ("getattr", "import_module") and len(node.args) > 0
                    and any(isinstance(a, ast.JoinedStr) for a in node.args[:2]) and rel not in allowed):
                found.append(f"{rel}:{node.lineno}")
    assert not found, found


def _cpp_code(text: str) -> str:
    """C++ source without its comments (line and block)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def test_the_shared_cpp_names_no_op():
    """The extension's shared C++ (gradops/native: the module, the node helpers, the pool, the direct calls, the
    kernel registry) names no op in code: each family's kernels and native node live in its own .cpp, which adds
    itself (GRADOPS_KERNEL, GRADOPS_MODULE_PART)."""
    ops = {name for family in FOLDERS for name in _names(family)}
    for source in sorted((PACKAGE / "native").glob("*.[ch]*")):
        if source.suffix not in (".cpp", ".h"):
            continue
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", _cpp_code(source.read_text())))
        words |= {w.lower() for w in words}
        assert not ops & words, f"{source.name} names {sorted(ops & words)}"


def test_every_declaration_carries_its_check_and_results():
    """The runtime reads an op's validation and results from its declaration (Planner, DirectOp, out=, aclnn)."""
    from gradops import registry

    for spec in registry.SPECS:
        assert callable(spec.check), spec.name
        assert callable(spec.results), spec.name


# A result's shape written in a backend's host code: a program output, a pool block or a launcher output given as a
# literal (shape, dtype) list. The declaration (``<op>_results`` in the contract) is the one place; Hardswish's
# layout helper allocates "like self" (its declared result has no shape of its own).
_RESTATED = re.compile(r"p\.output\(|outputs\([^)\n]*\[\(\(|output\([^,\n]*, \(")


@pytest.mark.parametrize("family", sorted(FOLDERS))
def test_backends_allocate_from_the_declared_results(family):
    for name in ("cpu.py", "launch.py"):
        path = PACKAGE / "families" / family / name
        if path.is_file():
            found = _RESTATED.findall(path.read_text())
            assert not found, f"{family}/{name} states result shapes itself: {found}"


def test_results_take_what_the_check_takes():
    """A call plan evaluates an op's results on the arguments its check took (defaults included): the same
    positional parameters, the same defaults."""
    import inspect

    from gradops import registry

    def positional(fn, skip):
        params = list(inspect.signature(fn).parameters.values())[skip:]
        return [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]

    for spec in registry.SPECS:
        checked = positional(spec.check, 0)
        declared = positional(spec.results, 1)
        assert [d for _, d in declared] == [d for _, d in checked], spec.name
        assert len(declared) == len(checked), spec.name
