"""One declaration per op (gradops.spec): the surfaces derived from it name no op, and every op declares what they
read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from gradops import registry
from gradops.spec import cann_arg

SRC = Path(__file__).resolve().parents[1] / "src" / "gradops"

#: The modules that read the declarations instead of keeping a table per op.
DERIVED = ("registry.py", "check.py", "golden/cases.py", "golden/__init__.py", "bench/cases.py", "bench/per_call.py",
           "bench/compile_cost.py", "bench/sweep.py", "bench/__init__.py", "bench/provenance.py", "bench/first_use.py",
           "ops/_sharding.py", "aclnn/_executor.py", "demo/__init__.py", "cpu/__init__.py", "native/__init__.py")


def code_names(path: Path) -> set[str]:
    """Identifiers, attribute names and string constants without spaces (prose is not code) in ``path``; an
    ``__init__.py``'s imports and ``__all__`` (re-exports) left out."""
    tree = ast.parse(path.read_text())
    if path.name == "__init__.py":
        tree.body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom)) and not (
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets))]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            found.add(node.value)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
    return found


@pytest.mark.parametrize("module", DERIVED)
def test_derived_surfaces_name_no_op(module):
    """What used to be a table per op in each of these modules (bench cases, per-call and first-call inputs, check
    cases, golden cases, sharding rules, CANN argument names, the demo's op list) is read from the declarations:
    adding an op touches its family's files, not these."""
    names = {spec.name for spec in registry.SPECS} | set(registry.BENCH)
    words = code_names(SRC / module)
    pattern = re.compile(r"[A-Za-z0-9_+]+")
    named = sorted(n for w in words for n in pattern.findall(w) if n in names)
    assert not named, f"{module} names {named}"


def test_every_op_declares_what_the_surfaces_read():
    for spec in registry.SPECS:
        assert spec.example is not None and spec.sharding is not None, spec.name
        if spec.kernels:
            assert spec.golden is not None and spec.golden.inputs is not None, spec.name
            assert spec.timing is not None or not spec.backward, spec.name
    assert [s.name for s in registry.OPS] == list(registry.NAMES)
    assert len(set(registry.NAMES)) == len(registry.NAMES)


@pytest.mark.parametrize("spec", registry.SPECS, ids=lambda s: s.name)
def test_examples_run_on_the_public_function_and_match_the_twin(spec):
    """Each example is a valid call (the public function takes it as it is) with one reduction length per output;
    its twin, where PyTorch has one, gives as many elements per output, and ATen's kernel the same first output."""
    import gradops

    example = spec.example(6, 16, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(1))
    out = getattr(gradops, spec.name)(*example.args)
    out = out if isinstance(out, tuple) else (out,)
    assert len(example.lengths) == len(out), spec.name  # one reduction length per output (check's bound)
    if example.twin is not None:
        twin = example.twin(*example.args)
        for ours, theirs in zip(out, twin):
            assert ours.numel() == theirs.numel(), spec.name
    if example.kernel is not None:  # ATen's kernel for the same work: the first output agrees
        theirs = example.kernel(*example.args)
        theirs = theirs[0] if isinstance(theirs, tuple) else theirs
        torch.testing.assert_close(out[0], theirs, rtol=1e-5, atol=1e-5, msg=spec.name)


def test_cann_argument_names():
    """CANN's spelling: the camel case of the PyTorch name unless the op declares its own."""
    grad = registry.spec("moe_token_permute_grad")
    assert cann_arg(grad, "padded_mode") == "paddedModeOptional"
    assert cann_arg(grad, "sorted_indices") == "sortedIndices"
    assert cann_arg(registry.spec("embedding_dense_backward"), "scale_grad_by_freq") == "scaleGradByFreq"
    assert cann_arg(registry.spec("hardswish_backward"), "self") == "self"


def test_the_declared_native_nodes_are_the_extensions():
    """``OpSpec.node`` says which ops have a native autograd node; the extension names each by a constant."""
    from gradops import native

    ext = native.module()
    if ext is None:
        pytest.skip(f"native extension not loaded: {native.status()}")
    declared = {spec.name for spec in registry.SPECS if spec.node}
    assert declared and all(isinstance(getattr(ext, name.upper(), None), int) for name in declared), declared


def test_every_family_module_is_registered():
    """A family's declaration module the package does not list would declare ops nothing reads: each folder of
    gradops.families and each ``spec.py`` / ``*_spec.py`` in it is in ``DECLARATIONS``."""
    from pathlib import Path

    from gradops import families

    root = Path(families.__file__).parent
    found = {f"{families.__name__}.{p.parent.name}.{p.stem}" for p in root.glob("*/*.py")
             if p.stem == "spec" or p.stem.endswith("_spec")}
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert found and {name.split(".")[2] for name in found} == folders
    assert sorted(found) == sorted(module.__name__ for module in families.DECLARATIONS)
