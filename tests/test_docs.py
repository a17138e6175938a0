"""The documents say what the code does: README.md and docs/*.md run as written, their links resolve, they name
every package, and the sources cite only documents that ship with the repository (issues 12.6, 40).

README.md and every page of docs/, so that they cannot drift from the code again:

- every ```python block runs, each on its own in a fresh namespace (a user copies one block, not the page; the
  README says so above its API block), from a scratch working directory. A block that opens with ``>>>`` is an
  interpreter session and runs under doctest, so its printed output and exceptions are checked too. A block
  whose first line is ``# needs: X`` runs only where X is there: ``cuda`` a CUDA device, ``launcher`` a
  multi-process launcher (never here), anything else an importable module; :data:`MARKED` names every such
  block, so no block is skipped unless this file says so;
- after it ran, the API block's gradients are compared with PyTorch autograd's (:data:`CHECKS`; running is not
  enough: the block once fed ``layer_norm_backward`` the rstd of ``rms_norm``);
- every command in a ```bash block (and ``$ `` line of an output block) and every ``gradops ...``,
  ``python ...``, ``bash ...`` and ``pip install ...`` in inline code names a file that exists, a subcommand and
  flags its argparse parser accepts (block commands are parsed in full, nothing runs), or an install source that
  exists (a path or a git URL, never the package index gradops is not on, with extras of pyproject.toml);
- every bash block of ``gradops golden`` / ``gradops verify`` lines runs as written in a scratch directory (the
  files a ``verify`` line judges that the block leaves to "your kernel" are the case's goldens), writing the files
  its comments list;
- every repository path in inline code exists, every relative link resolves (to a file, and to a heading of it
  where the link names one), and every package under src/gradops is named (``gradops.X`` or ``gradops/X``).
"""

from __future__ import annotations

import argparse
import contextlib
import doctest
import importlib
import importlib.util
import io
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from gradops import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The documents: the README, then the pages of docs/.
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]

#: Python blocks that do not run everywhere, by (document, the heading they sit under): what their ``# needs:`` line
#: names.
MARKED = {("README.md", "Snippets"): "transformers",
          ("docs/huggingface.md", "Hugging Face transformers"): "transformers"}


def test_every_cited_markdown_file_is_in_the_repository():
    cited = set()
    for path in (ROOT / "src").rglob("*.py"):
        for line in path.read_text().splitlines():
            if "hicann/" in line:  # a file of an upstream repository, cited with its repository's name
                continue
            cited |= {(m, path.name) for m in re.findall(r"[\w./-]+\.md\b", line)}
    assert cited, "expected the sources to cite docs/semantics.md and docs/performance.md"
    missing = sorted((doc, where) for doc, where in cited if not (ROOT / doc).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


# ---------------------------------------------------------------- reading the documents
@dataclass(frozen=True)
class Block:
    """A fenced code block of a document: the document (relative to the repository), its language tag, the line of
    its opening fence, the heading it sits under and its text."""

    doc: str
    lang: str
    line: int
    heading: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.doc}:L{self.line}-" + re.sub(r"\W+", "-", self.heading).strip("-")

    @property
    def needs(self) -> str | None:
        found = re.match(r"# needs: (\S+)", self.text)
        return found.group(1) if found else None


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _read(path: Path) -> tuple[list[Block], list[tuple[str, str]], list[tuple[str, str]]]:
    """A document's fenced blocks, its inline code spans outside them and its links ``[text](target)``, each span
    and link with the document's name."""
    blocks, spans, links, heading, lang, start, body = [], [], [], "", None, 0, []
    doc = _name(path)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if lang is not None:
            if line.startswith("```"):
                blocks.append(Block(doc, lang, start, heading, "\n".join(body) + "\n"))
                lang = None
            else:
                body.append(line)
        elif fence := re.match(r"```(\w*)\s*$", line):
            lang, start, body = fence.group(1), n, []
        else:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            spans += [(doc, s) for s in re.findall(r"`([^`\n]+)`", line)]
            links += [(doc, t) for t in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`\n]+`", "", line))]
    assert lang is None, f"{doc}: the block opened at line {start} is never closed"
    return blocks, spans, links


BLOCKS, SPANS, LINKS = [], [], []
for _document in DOCUMENTS:
    _found = _read(_document)
    BLOCKS += _found[0]
    SPANS += _found[1]
    LINKS += _found[2]
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _block(doc: str, heading: str, lang: str) -> Block:
    found = [b for b in BLOCKS if b.doc == doc and b.heading == heading and b.lang == lang]
    assert len(found) == 1, f"{doc}: expected one {lang} block under {heading!r}, found {len(found)}"
    return found[0]


def _run(block: Block) -> dict:
    """Execute a block in a fresh namespace; tracebacks name the document and its line numbers."""
    namespace = {"__name__": "__readme__"}
    exec(compile("\n" * block.line + block.text, str(ROOT / block.doc), "exec"), namespace)
    return namespace


@contextlib.contextmanager
def _transformers_patches_restored():
    """``gradops.transformers.register(norms=True)`` maps transformers' norm classes to gradops' for every later
    ``from_config`` in the process, the tests of tests/test_transformers.py's unpatched twins included: drop the
    mappings a block added."""
    from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping

    before = set(get_patch_mapping())
    try:
        yield
    finally:
        unregister_patch_mapping(sorted(set(get_patch_mapping()) - before))


# ---------------------------------------------------------------- python blocks
@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_readme_python_block_runs_as_written(block, tmp_path, monkeypatch):
    need = block.needs
    if need == "launcher":
        pytest.skip(f"{block.id} needs a multi-process launcher")
    if need == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"{block.id} needs a CUDA device")
    if need not in (None, "cuda", "launcher") and importlib.util.find_spec(need) is None:
        pytest.skip(f"{block.id} needs {need}, which is not installed")
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a scratch directory
    if not block.text.startswith(">>>"):
        with _transformers_patches_restored() if need == "transformers" else contextlib.nullcontext():
            namespace = _run(block)
        if (block.doc, block.heading) in CHECKS:
            CHECKS[block.doc, block.heading](namespace)
        return
    test = doctest.DocTestParser().get_doctest(block.text, {}, block.id, str(ROOT / block.doc), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    result = runner.run(test, out=report.write)
    assert result.attempted > 0 and result.failed == 0, report.getvalue()


def test_readme_blocks_that_may_skip_or_are_checked_are_the_ones_named_here():
    marked = {(b.doc, b.heading): b.needs for b in PYTHON if b.needs}
    assert marked == MARKED, "a block gained or lost its '# needs:' line: name it in MARKED"
    assert len(PYTHON) - len(marked) >= 3, "most blocks run everywhere"
    assert sum(b.doc == "README.md" for b in PYTHON) >= 3, "the README shows its snippets"
    for doc, heading in CHECKS:
        _block(doc, heading, "python")


def _api_gradients_are_pytorchs(ns: dict) -> None:
    """The API block's results against PyTorch's autograd, given the block's namespace."""
    x, dy, gamma, beta = ns["x"], ns["dy"], ns["gamma"], ns["beta"]
    n = x.shape[-1]

    def close(actual, expected, what):
        # float32 against float32 in another summation order: at most 16% of this tolerance over seeds 0-3,
        # where the rstd of rms_norm in layer_norm_backward (the bug this test is for) is 360-935x it.
        torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5, msg=lambda m: f"{what}: {m}")

    xr, g = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    F.rms_norm(xr, (n,), g, 1e-6).backward(dy)
    close(ns["dx"], xr.grad, "rms_norm_grad dx")
    close(ns["dgamma"], g.grad, "rms_norm_grad dgamma")

    xr, g, b = x.clone().requires_grad_(), gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    F.layer_norm(xr, (n,), g, b, 1e-5).backward(dy)
    for name in ("pdx", "ln_dx"):
        close(ns[name], xr.grad, name)
    for name in ("pd_gamma", "ln_dgamma"):
        close(ns[name], g.grad, name)
    for name in ("pd_beta", "ln_dbeta"):
        close(ns[name], b.grad, name)
    wrong_rstd = ns["gradops"].layer_norm_backward(dy, x, ns["mean"], ns["rstd"], gamma)[0]
    with pytest.raises(AssertionError):  # the comparison above tells LayerNorm's rstd from RMSNorm's
        close(wrong_rstd, xr.grad, "layer_norm_backward with rms_norm's rstd")

    assert not (x.abs() == 3).any()  # the one place CANN's hardswish gradient differs from PyTorch's
    xr = x.clone().requires_grad_()
    F.hardswish(xr).backward(dy)
    close(ns["grad_input"], xr.grad, "hardswish_backward")

    weight = ns["weight"].clone().requires_grad_()
    F.embedding(ns["indices"], weight).backward(dy)
    close(ns["grad_weight"], weight.grad, "embedding_dense_backward")

    # CANN's sorted_indices: token t's k-th copy went to row sorted_indices[t*K + k]
    k, rows = ns["experts"].shape[1], ns["sorted_indices"].long()
    assert torch.equal(ns["permuted"][rows], x.repeat_interleave(k, 0))
    close(ns["grad_tokens"], ns["grad_permuted"][rows].view(-1, k, n).sum(1), "moe_token_permute_grad")


#: What a block computes, checked after it ran (by document and heading): running is not enough.
CHECKS = {("docs/api.md", "API"): _api_gradients_are_pytorchs}


# ---------------------------------------------------------------- commands
class _Parsed(Exception):
    """Raised in place of returning from ``parse_args``: the command line parsed, and nothing runs after it."""


def _parse_only(main: Callable[[list[str]], int], argv: list[str]) -> argparse.Namespace:
    """``main(argv)`` up to its argparse call: the parsed arguments, or AssertionError with argparse's message."""
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    errors = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse), contextlib.redirect_stderr(errors):
        try:
            main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
        except SystemExit:
            raise AssertionError(errors.getvalue().strip()) from None
    raise AssertionError("returned without parsing its arguments")


def _help(main: Callable[[list[str]], int], argv: list[str]) -> str:
    """What ``main(argv + ['--help'])`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def _script_main(path: Path) -> Callable[[list[str]], int] | None:
    """The ``main(argv)`` of an example script, imported without running it; where the script needs a module
    that is not installed (an extra), a stand-in that knows the flags its source passes to ``add_argument``."""
    spec = importlib.util.spec_from_file_location(f"_readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ModuleNotFoundError:
        flags = re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text())

        def main(argv: list[str]) -> int:
            parser = argparse.ArgumentParser(prog=path.name)
            for flag in flags:
                parser.add_argument(flag, nargs="?")  # the values are not known here, only the flags
            parser.parse_args(argv)
            return 0

        return main
    return getattr(module, "main", None)


def _commands() -> list[tuple[str, list[str], bool]]:
    """``(where, argv, whole)``: each command of the bash blocks and output blocks' ``$`` lines (whole command
    lines, parsed in full) and of inline code (often with placeholders: ``gradops golden OP``, ``[--way
    register]``; only the file, subcommand and flags are checked)."""
    found = []
    for block in BLOCKS:
        for line in block.text.splitlines():
            if block.lang == "bash" or line.startswith("$ "):
                argv = shlex.split(line.removeprefix("$ "), comments=True)
                if argv:
                    found.append((f"{block.id}: {line.strip()}", argv, True))
    for doc, span in SPANS:
        if re.match(r"(gradops|python|bash|pip install) ", span):
            unbracketed = re.sub(r"\[(--[^\]]*)\]", r"\1", span)  # "[--way register]": an optional flag
            found.append((f"{doc} `{span}`", shlex.split(unbracketed), False))
    return found


def _pyproject() -> dict:
    """pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _project() -> dict:
    """pyproject.toml's [project] table."""
    return _pyproject()["project"]


def _extras() -> set[str]:
    return set(_project()["optional-dependencies"])


def _install_source(target: str, extras: set[str]) -> str | None:
    """What is wrong with a ``pip install`` target, or None: it must be a checkout path or a git URL (gradops is
    on no package index), and name only extras pyproject.toml defines."""
    named = re.search(r"\[([\w,]+)\]", target)
    unknown = set(named.group(1).split(",")) - extras if named else set()
    if unknown:
        return f"extras {sorted(unknown)} are not in pyproject.toml"
    if target.startswith(("/", ".")) or re.match(r"gradops(\[[\w,]+\])? @ git\+\S", target):
        return None
    return "not a path or a git URL: gradops is on no package index"


def _c_toolchain(where: str, tool: str, args: list[str]) -> str | None:
    """A C host program built against a ``gradops cann-home`` tree (docs/cann-c.md): the compiler links the tree's
    libraries and reads its include folders; ``source`` reads the tree's set_env.sh; ``./NAME`` runs a program a
    compiler line of the documents builds (``-o NAME``)."""
    from gradops.aclnn import capi

    if tool == "source":
        return None if args[:1] and args[0].endswith("/set_env.sh") else f"{where}: not a tree's set_env.sh"
    if tool.startswith("./"):
        built = {a[i + 1] for _, a, _ in _commands() if a[0] in ("g++", "c++") for i in range(len(a) - 1)
                 if a[i] == "-o"}
        return None if tool[2:] in built else f"{where}: no compiler line builds {tool[2:]}"
    libraries = {a[2:] for a in args if a.startswith("-l")}
    paths = [a[2:] or (args[i + 1] if i + 1 < len(args) else "") for i, a in enumerate(args)
             if a.startswith(("-I", "-L"))]  # -IDIR or -I DIR
    folders = {p.rstrip("/").rsplit("/", 1)[-1] for p in paths}
    if libraries != {name for name, _, _ in capi.LIBRARIES}:
        return f"{where}: links {sorted(libraries)}, not the tree's libraries"
    return None if folders == {"include", "aclnnop", "lib64"} else f"{where}: reads {sorted(folders)}"


def _check(where: str, argv: list[str], whole: bool, extras: set[str]) -> str | None:
    """What is wrong with one README command, or None."""
    tool, args = argv[0], argv[1:]
    if tool == "bash":
        return None if (ROOT / args[0]).is_file() else f"{where}: no file {args[0]}"
    if tool == "pip":
        targets = [a for a in args[1:] if not a.startswith("-")] if args[:1] == ["install"] else []
        problems = [f"{t!r}: {why}" for t in targets if (why := _install_source(t, extras))]
        if not targets:
            problems.append("expected pip install TARGET")
        return f"{where}: {'; '.join(problems)}" if problems else None
    if tool == "python" and args[:1] == ["-m"]:  # a module run as a script: its __main__'s main(argv)
        try:
            spec = importlib.util.find_spec(args[1])
        except (ImportError, IndexError):
            spec = None
        if spec is None:
            return f"{where}: no module {args[1:2]}"
        name = f"{args[1]}.__main__" if spec.submodule_search_locations else args[1]
        main, args = getattr(importlib.import_module(name), "main", None), args[2:]
    elif tool == "python":
        script = ROOT / args[0]
        if not script.is_file():
            return f"{where}: no file {args[0]}"
        main, args = _script_main(script), args[1:]
    elif tool == "gradops":
        if not args or args[0] not in cli.COMMANDS:
            return f"{where}: gradops has no subcommand {args[:1]}"
        main = cli.main
    elif tool in ("g++", "c++", "source") or tool.startswith("./"):
        return _c_toolchain(where, tool, args)
    else:
        return f"{where}: a command this test does not know how to check ({tool})"
    if main is None:
        return f"{where}: {tool} {argv[1]} has no main(argv)" if args else None
    try:
        if whole:
            _parse_only(main, args)
        elif flags := [a.split("=")[0] for a in args if a.startswith("--")]:
            shown = _help(main, args[:1] if tool == "gradops" else [])
            missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", shown)]
            if missing:
                return f"{where}: no option {missing}"
    except AssertionError as err:
        return f"{where}: {err}"
    return None


def test_readme_commands_name_real_files_subcommands_flags_and_install_sources():
    commands, extras = _commands(), _extras()
    kinds = {argv[0] for _, argv, _ in commands}
    assert {"bash", "gradops", "python", "pip"} <= kinds, f"expected every kind of command, found {kinds}"
    problems = [why for where, argv, whole in commands if (why := _check(where, argv, whole, extras))]
    assert not problems, "\n".join(problems)


def test_a_plain_install_builds_the_cpu_kernels():
    """The install builds the C++ CPU kernels (gradops' build backend), which needs ninja at build time and at the
    first import's build; without them CPU tensors take the ~10-50x slower reference. The ``cpu`` and ``native``
    extras that used to carry numba and ninja stay, so that older instructions (``gradops[cpu]``) still install."""
    project = _project()
    build = _pyproject()["build-system"]
    assert build["build-backend"] == "gradops_build" and (ROOT / build["backend-path"][0] / "gradops_build.py").exists()
    assert any(re.match(r"ninja\b", r) for r in build["requires"]) and "ninja" in project["dependencies"]
    assert not any(re.match(r"numba\b", r) for r in project["dependencies"]), project["dependencies"]
    assert {"cpu", "native"} <= set(project["optional-dependencies"])


def test_readme_install_section_names_every_extra():
    section = README.read_text().split("## Installing gradops in your own project", 1)[1].split("\n## ", 1)[0]
    missing = sorted(e for e in _extras() if f"`{e}`" not in section)
    assert not missing, f"extras of pyproject.toml the README's install section does not explain: {missing}"


def test_readme_command_check_catches_what_drifted():
    """The checks above fail on the mistakes they exist for (each was in the README or is one edit away)."""
    extras = _extras()
    assert "package index" in _check("t", ["pip", "install", "gradops[cpu]"], False, extras)
    assert "not in pyproject" in _check("t", ["pip", "install", "/path/to/gradops[gpu]"], False, extras)
    assert _check("t", ["pip", "install", "gradops[triton] @ git+https://host/gradops.git"], False, extras) is None
    assert "unrecognized" in _check("t", ["gradops", "demo", "--epochs", "2"], True, extras)
    assert "no option" in _check("t", ["gradops", "bench", "--per-op"], False, extras)
    assert "no file" in _check("t", ["python", "examples/nowhere.py"], False, extras)


#: The bash blocks that run ``gradops golden`` and ``gradops verify``: they run here, in a scratch directory.
GOLDEN = [b for b in BLOCKS if b.lang == "bash" and re.search(r"^gradops golden ", b.text, re.M)]


@pytest.mark.parametrize("block", GOLDEN, ids=[b.id for b in GOLDEN])
def test_golden_loops_run_as_written(block, tmp_path, monkeypatch, capsys):
    commands = [c for line in block.text.splitlines() if (c := shlex.split(line, comments=True))]
    assert all(c[:1] == ["gradops"] and c[1] in ("golden", "verify") for c in commands), commands
    assert [c[1] for c in commands].count("verify") >= 1
    monkeypatch.chdir(tmp_path)
    for command in commands:
        if command[1] == "verify":
            # the files "your kernel" writes (my_dx.bin): here a kernel that returns the goldens
            case = Path(command[2])
            for actual in (a for a in command[3:] if not a.startswith("-")):
                if not Path(actual).exists():
                    Path(actual).write_bytes((case / actual.replace("my_", "golden_", 1)).read_bytes())
        assert cli.main(command[1:]) == 0, f"{block.id}: {shlex.join(command)}\n{capsys.readouterr()}"
    # "#    case/in_dy.bin in_x.bin ...     inputs, ...": the files the comments promise
    listed = [(m.group(1), m.group(2).split()) for line in block.text.splitlines()
              if (m := re.match(r"#\s+(\w+/)(\S+(?: \S+)*?)\s{2,}", line))]
    missing = [folder + name for folder, names in listed for name in names if not (tmp_path / folder / name).is_file()]
    assert not missing, f"{block.id} lists files gradops golden did not write: {missing}"


def test_the_readme_runs_the_golden_loop_and_lists_its_files():
    readme = [b for b in GOLDEN if b.doc == "README.md"]
    assert len(readme) == 1, "the README shows one golden / verify loop"
    assert len(re.findall(r"^#\s+\w+/\S+", readme[0].text, re.M)) >= 4, "its comments list the case's files"


def test_golden_options_per_op_are_the_ones_gradops_golden_reads():
    """docs/cann.md's table of each op's ``gradops golden`` options is gradops.golden.cases.OPTIONS, and
    ``gradops golden --help`` lists every option (it lists them all, not an op's: the page says so)."""
    from gradops.golden.cases import OPTIONS

    text = (ROOT / "docs" / "cann.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|$", text, re.M))
    stated = {op: tuple(re.findall(r"`--([\w-]+)`", rows[op])) for op in rows if op in OPTIONS}
    expected = {op: tuple(o.replace("_", "-") for o in opts) for op, opts in OPTIONS.items()}
    assert stated == expected, "docs/cann.md's golden options table differs from gradops.golden.cases.OPTIONS"
    shown = _help(cli.main, ["golden"])
    missing = sorted({o for opts in expected.values() for o in opts if f"--{o}" not in shown})
    assert not missing, f"gradops golden --help does not list {missing}"
    assert "lists every option of every op" in " ".join(text.split())


def test_readme_paths_exist():
    """Inline code that names a repository path (``examples/...``, ``gradops/ops/_sharding.py`` under src/), a
    pattern (``benchmarks/results/*.jsonl``) matching at least one file."""
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    # semantics.md and performance.md cite files of other repositories by their own paths (tests/st/..., src/...)
    paths = [(doc, s) for doc, s in SPANS if doc not in UPSTREAM_CITING
             and "/" in s and " " not in s and "<" not in s and s.split("/")[0] in tops | {"gradops"}]
    assert len(paths) >= 5, paths

    def exists(path: str) -> bool:
        return any(any(base.glob(path)) if "*" in path else (base / path).exists() for base in (ROOT, ROOT / "src"))

    missing = [f"{doc}: {p}" for doc, p in paths if not exists(p)]
    assert not missing, f"the documents name paths that do not exist: {missing}"


#: Pages whose inline paths name files of the upstream repositories they cite, not of this one.
UPSTREAM_CITING = {"docs/semantics.md", "docs/performance.md"}


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a document's headings: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    as ``-``."""
    found = set()
    for line in path.read_text().splitlines():
        if heading := re.match(r"#+ (.*)", line):
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_relative_links_resolve():
    checked, broken = 0, []
    for doc, target in LINKS:
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not the repository's to check
            continue
        file, _, anchor = target.partition("#")
        path = (ROOT / doc).parent / file if file else ROOT / doc
        checked += 1
        if not path.exists():
            broken.append(f"{doc}: {target} (no file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{doc}: {target} (no heading)")
    assert checked >= 20, checked
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_the_link_check_catches_what_breaks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# The native extension (`gradops.native`)\n## CANN vs PyTorch\n")
    assert _anchors(page) == {"the-native-extension-gradopsnative", "cann-vs-pytorch"}


def test_every_package_is_named_in_the_documents():
    text = "\n".join(p.read_text() for p in DOCUMENTS)
    packages = sorted(".".join(p.parent.relative_to(ROOT / "src").parts)
                      for p in (ROOT / "src" / "gradops").rglob("__init__.py"))
    assert "gradops.native" in packages and len(packages) >= 10, packages
    unnamed = [p for p in packages if p != "gradops" and p not in text and p.replace(".", "/") not in text]
    assert not unnamed, f"packages that neither the README nor a page of docs/ names: {unnamed}"


def test_readme_hardswish_rates_at_three():
    """docs/cann.md's share of N(0, 2²) activations that are exactly ±3 in bfloat16 / float16 (where CANN's hardswish
    gradient differs from PyTorch's): the Gaussian mass within half an ulp of 3, which is each dtype's eps, and a
    sample; and the gradient there is the one the page states."""
    import math

    import gradops

    text = " ".join((ROOT / "docs" / "cann.md").read_text().split())
    found = re.search(r"(\d+\.\d+)% are exactly ±3 once rounded to bfloat16 and (\d+\.\d+)% in float16", text)
    assert found, "docs/cann.md: the hardswish rates at ±3 moved; update this test"
    stated = {torch.bfloat16: float(found.group(1)) / 100, torch.float16: float(found.group(2)) / 100}

    def phi(z: float) -> float:  # the standard normal CDF
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1 << 22, generator=g) * 2  # bfloat16: ~8,500 hits expected, a 1% standard error
    for dtype, rate in stated.items():
        eps = torch.finfo(dtype).eps  # ulp at 1; at 3 the ulp is 2·eps and half of it eps
        predicted = 2 * (phi((3 + eps) / 2) - phi((3 - eps) / 2))
        assert abs(predicted - rate) <= 0.05 * rate, (dtype, predicted, rate)
        sampled = (x.to(dtype).abs() == 3).double().mean().item()
        assert abs(sampled - predicted) <= 0.25 * predicted, (dtype, sampled, predicted)
    at = torch.tensor([-3.0, 3.0], dtype=torch.bfloat16)
    assert gradops.hardswish_backward(torch.ones_like(at), at).tolist() == [-0.5, 1.5]


def test_gradops_env_names_every_native_node_and_the_direct_calls(capsys):
    """`gradops env` says whether the CPU kernels are built and what the native path provides, from the extension's
    own list: autograd nodes for every op that has one (it once named LayerNorm and Hardswish only, after Embedding
    gained its node), and the direct calls of the public functions."""
    from gradops.registry import SPECS

    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("CPU kernels (C++") for line in out), out
    line = next(line for line in out if line.startswith("native path"))
    nodes = sorted(spec.name for spec in SPECS if spec.node)
    assert "embedding" in nodes, nodes
    assert all(op in line for op in nodes), line
    assert "direct calls" in line, line
