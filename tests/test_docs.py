"""The documents say what the code does: the README runs as written, and the sources cite only documents that
ship with the repository (issue 12.6).

README.md, so that it cannot drift from the code again:

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
- the golden / verify block runs as written in a scratch directory, writing the files its comments list;
- every repository path in inline code exists.
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

#: Python blocks that do not run everywhere, by the heading they sit under: what their ``# needs:`` line names.
MARKED = {"Hugging Face transformers": "transformers"}


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


# ---------------------------------------------------------------- reading the README
@dataclass(frozen=True)
class Block:
    """A fenced code block of README.md: its language tag, the line of its opening fence, the heading it sits
    under and its text."""

    lang: str
    line: int
    heading: str
    text: str

    @property
    def id(self) -> str:
        return f"L{self.line}-" + re.sub(r"\W+", "-", self.heading).strip("-")

    @property
    def needs(self) -> str | None:
        found = re.match(r"# needs: (\S+)", self.text)
        return found.group(1) if found else None


def _read() -> tuple[list[Block], list[str]]:
    """The README's fenced blocks, and its inline code spans outside them."""
    blocks, spans, heading, lang, start, body = [], [], "", None, 0, []
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if lang is not None:
            if line.startswith("```"):
                blocks.append(Block(lang, start, heading, "\n".join(body) + "\n"))
                lang = None
            else:
                body.append(line)
        elif fence := re.match(r"```(\w*)\s*$", line):
            lang, start, body = fence.group(1), n, []
        else:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            spans += re.findall(r"`([^`\n]+)`", line)
    assert lang is None, f"README.md: the block opened at line {start} is never closed"
    return blocks, spans


BLOCKS, SPANS = _read()
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _block(heading: str, lang: str) -> Block:
    found = [b for b in BLOCKS if b.heading == heading and b.lang == lang]
    assert len(found) == 1, f"README.md: expected one {lang} block under {heading!r}, found {len(found)}"
    return found[0]


def _run(block: Block) -> dict:
    """Execute a block in a fresh namespace; tracebacks name README.md and its line numbers."""
    namespace = {"__name__": "__readme__"}
    exec(compile("\n" * block.line + block.text, str(README), "exec"), namespace)
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
        pytest.skip(f"README.md {block.id} needs a multi-process launcher")
    if need == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"README.md {block.id} needs a CUDA device")
    if need not in (None, "cuda", "launcher") and importlib.util.find_spec(need) is None:
        pytest.skip(f"README.md {block.id} needs {need}, which is not installed")
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a scratch directory
    if not block.text.startswith(">>>"):
        with _transformers_patches_restored() if need == "transformers" else contextlib.nullcontext():
            namespace = _run(block)
        if block.heading in CHECKS:
            CHECKS[block.heading](namespace)
        return
    test = doctest.DocTestParser().get_doctest(block.text, {}, block.id, str(README), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    result = runner.run(test, out=report.write)
    assert result.attempted > 0 and result.failed == 0, report.getvalue()


def test_readme_blocks_that_may_skip_or_are_checked_are_the_ones_named_here():
    marked = {b.heading: b.needs for b in PYTHON if b.needs}
    assert marked == MARKED, "a README block gained or lost its '# needs:' line: name it in MARKED"
    assert len(PYTHON) - len(marked) >= 3, "most README blocks run everywhere"
    for heading in CHECKS:
        _block(heading, "python")


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


#: What a block computes, checked after it ran (by heading): running is not enough.
CHECKS = {"API": _api_gradients_are_pytorchs}


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
                    found.append((f"README.md {block.id}: {line.strip()}", argv, True))
    for span in SPANS:
        if re.match(r"(gradops|python|bash|pip install) ", span):
            unbracketed = re.sub(r"\[(--[^\]]*)\]", r"\1", span)  # "[--way register]": an optional flag
            found.append((f"README.md `{span}`", shlex.split(unbracketed), False))
    return found


def _project() -> dict:
    """pyproject.toml's [project] table."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: pytest's own dependency
        import tomli as tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


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


def test_a_plain_install_brings_the_compiled_cpu_kernels():
    """numba is a dependency: without it CPU tensors take the ~25-50x slower reference. The ``cpu`` extra that
    used to carry it stays, so that older instructions (``gradops[cpu]``) still install."""
    project = _project()
    assert any(re.match(r"numba\b", requirement) for requirement in project["dependencies"]), project["dependencies"]
    assert "cpu" in project["optional-dependencies"]


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


def test_readme_golden_loop_runs_as_written(tmp_path, monkeypatch, capsys):
    block = _block("Golden data and CANN's precision verdict: `gradops golden` / `gradops verify`", "bash")
    commands = [shlex.split(line, comments=True) for line in block.text.splitlines()]
    golden, verify = [c for c in commands if c[:1] == ["gradops"]]
    assert golden[1] == "golden" and verify[1] == "verify"
    monkeypatch.chdir(tmp_path)
    assert cli.main(golden[1:]) == 0, capsys.readouterr().out
    # "#    case/in_dy.bin in_x.bin ...     inputs, ...": the files the comments promise
    listed = [(m.group(1), m.group(2).split()) for line in block.text.splitlines()
              if (m := re.match(r"#\s+(\w+/)(\S+(?: \S+)*?)\s{2,}", line))]
    assert len(listed) >= 4, listed
    missing = [folder + name for folder, names in listed for name in names if not (tmp_path / folder / name).is_file()]
    assert not missing, f"the README lists files gradops golden did not write: {missing}"
    # step 2 is the user's kernel: here one that returns the goldens (my_dx.bin <- case/golden_dx.bin)
    case = Path(verify[2])
    for actual in verify[3:]:
        Path(actual).write_bytes((case / actual.replace("my_", "golden_", 1)).read_bytes())
    assert cli.main(verify[1:]) == 0, capsys.readouterr().out


def test_readme_paths_exist():
    """Inline code that names a repository path (``examples/...``, ``gradops/ops/_sharding.py`` under src/)."""
    tops = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
    paths = [s for s in SPANS if "/" in s and " " not in s and s.split("/")[0] in tops | {"gradops"}]
    assert len(paths) >= 5, paths
    missing = [p for p in paths if not (ROOT / p).exists() and not (ROOT / "src" / p).exists()]
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_readme_hardswish_rates_at_three():
    """The README's share of N(0, 2²) activations that are exactly ±3 in bfloat16 / float16 (where CANN's hardswish
    gradient differs from PyTorch's): the Gaussian mass within half an ulp of 3, which is each dtype's eps, and a
    sample; and the gradient there is the one the README states."""
    import math

    import gradops

    text = " ".join(README.read_text().split())
    found = re.search(r"(\d+\.\d+)% are exactly ±3 once rounded to bfloat16 and (\d+\.\d+)% in float16", text)
    assert found, "README.md: the hardswish rates at ±3 moved; update this test"
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
