"""A request the commands cannot carry out ends in one line on stderr and a non-zero exit, before any work: no
traceback, no pass after checking nothing, no training or timing lost to a write that was bound to fail.

Everything runs in-process on tiny inputs; CUDA is hidden (``torch.cuda.is_available`` -> False) where a test is
about a machine without a GPU, so the same assertions hold on the GPU machines.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from gradops import cli, cli_support

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "cann"


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine without CUDA (and no Triton interpreter): what a laptop or the CI VM is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("GRADOPS_BACKEND", raising=False)


def _refused(capsys, argv: list[str]) -> str:
    """Run ``gradops argv``; assert it exits 2 with exactly one line on stderr and nothing on stdout; return it."""
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse refuses while parsing
        code = stop.code
    out, err = capsys.readouterr()
    assert code == 2, (code, out, err)
    assert out == "", out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gradops {argv[0]}: error: "), err
    return lines[0]


# ---------------------------------------------------------------- gradops check: zero runs is no pass
def test_check_without_a_gpu_refuses_device_cuda(no_gpu, capsys):
    line = _refused(capsys, ["check", "--device", "cuda", "--op", "hardswish"])
    assert line == "gradops check: error: nothing to check: --device cuda: torch sees no CUDA device"


def test_check_refuses_triton_without_a_gpu_or_the_interpreter(no_gpu, capsys):
    line = _refused(capsys, ["check", "--backend", "triton", "--op", "hardswish"])
    assert "nothing to check: --backend triton on cpu: " in line
    if importlib.util.find_spec("triton") is not None:
        assert "TRITON_INTERPRET=1" in line and "CUDA device" in line


def test_check_names_what_it_skipped_beside_what_ran(no_gpu, capsys):
    code = cli.main(["check", "--backend", "triton", "--backend", "torch", "--op", "hardswish", "--dtype", "fp32",
                     "--rows", "2", "--cols", "4", "--seed", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and "1 passed, 0 failed" in out
    assert "gradops check: skipped --backend triton on cpu: " in err


# ---------------------------------------------------------------- one line per nonsensical argument
@pytest.mark.parametrize(("argv", "expected"), [
    (["check", "--rows", "0"], "argument --rows: must be an integer >= 1, got '0'"),
    (["check", "--cols", "-5"], "argument --cols: must be an integer >= 1, got '-5'"),
    (["check", "--seed", "-1"], "argument --seed: must be an integer from 0 to 2^63 - 1, got '-1'"),
    (["check", "--seed", str(2**64)], "argument --seed: must be an integer from 0 to 2^63 - 1"),
    (["check", "--dtype", "fp64"], "argument --dtype: 'fp64' is not a dtype; choose from fp32 (float32), "
                                   "fp16 (float16), bf16 (bfloat16)"),
    (["check", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["demo", "--device", "tpu"], "argument --device: 'tpu' is not a device here; use cpu, cuda, cuda:N or auto"),
    (["demo", "--device", "cuda"], "argument --device: cuda, but torch sees no CUDA device (use --device cpu)"),
    (["demo", "--lr", "-1"], "argument --lr: must be a finite number > 0, got '-1'"),
    (["demo", "--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["demo", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["demo", "--batch-size", "-2"], "argument --batch-size: must be an integer >= 1, got '-2'"),
    (["demo", "--seq-len", "1"], "argument --seq-len: must be an integer >= 2, got '1'"),
    (["demo", "--log-every", "-1"], "argument --log-every: must be an integer >= 0, got '-1'"),
    (["demo", "--ep", "-2"], "argument --ep: must be an integer >= 0, got '-2'"),
    (["demo", "--seed", "x"], "argument --seed: must be an integer from 0 to 2^63 - 1, got 'x'"),
    (["bench", "--reps", "0"], "argument --reps: must be an integer >= 1, got '0'"),
    (["bench", "--budget", "0"], "argument --budget: must be a finite number > 0, got '0'"),
    (["bench", "--dtype", "float64"], "argument --dtype: 'float64' is not a dtype"),
])
def test_a_nonsensical_argument_is_one_line(argv, expected, no_gpu, capsys):
    assert expected in _refused(capsys, argv)


def test_a_backend_variable_naming_no_backend_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("GRADOPS_BACKEND", "bogus")
    line = _refused(capsys, ["env"])
    assert line == ("gradops env: error: GRADOPS_BACKEND='bogus' is not a backend; choose one of auto, torch, "
                    "triton, cpu")


def test_demo_refuses_a_backend_that_cannot_run_before_any_work(no_gpu, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("GRADOPS_BACKEND", "triton")
    line = _refused(capsys, ["demo", "--steps", "1", "--out", str(tmp_path / "out")])
    assert line.startswith("gradops demo: error: GRADOPS_BACKEND=triton: ")
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_demo_refuses_too_little_text_naming_data_and_seq_len(no_gpu, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    line = _refused(capsys, ["demo", "--data", str(empty), "--seq-len", "16", "--out", str(tmp_path / "out")])
    assert line == ("gradops demo: error: the text has 0 bytes (NUL bytes dropped); --seq-len 16 needs at least 68: "
                    "pass a longer --data file or a smaller --seq-len")


def test_too_little_text_outside_the_cli_exits_with_the_message():
    """Batches is used by examples without the CLI: still a clean exit with the message, not frombuffer's
    ValueError on an empty buffer."""
    from gradops.demo.data import Batches

    with pytest.raises(SystemExit, match="the text has 0 bytes"):
        Batches(b"", 16, 2, 0)


# ---------------------------------------------------------------- where results go, checked first
def test_demo_refuses_an_out_it_cannot_write_before_training(no_gpu, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _refused(capsys, ["demo", "--steps", "1", "--out", str(blocker / "sub")])
    assert line.startswith(f"gradops demo: error: --out {blocker / 'sub'}: cannot write there (")
    line = _refused(capsys, ["demo", "--steps", "1", "--out", str(blocker)])
    assert line == f"gradops demo: error: --out {blocker}: exists and is not a directory; give a directory to write to"


def test_bench_refuses_results_it_cannot_write_before_timing(no_gpu, capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = _refused(capsys, ["bench", "--quick", "--op", "hardswish_backward", "--dtype", "fp32", "--results",
                             str(blocker / "sub")])
    assert line.startswith(f"gradops bench: error: --results {blocker / 'sub'}: cannot write there (")


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "--device", "cuda", "--no-save"],
     "gradops bench: error: --device cuda, but torch sees no CUDA device (use --device cpu)"),
    (["bench", "--sweep", "--dtype", "fp16", "--no-save"], "gradops bench: error: --dtype fp16: --sweep times fp32 and "
                                                           "bf16 only"),
    (["bench", "--models", "--dtype", "float16", "--no-save"], "gradops bench: error: --dtype fp16: --models times "
                                                               "fp32 and bf16 only"),
])
def test_bench_refuses_what_it_would_not_time(argv, expected, no_gpu, capsys):
    assert _refused(capsys, argv) == expected


def test_output_dir_creates_the_folder(tmp_path):
    target = tmp_path / "a" / "b"
    assert cli_support.output_dir(target, "--out") == target and target.is_dir()


# ---------------------------------------------------------------- one spelling of dtypes, both accepted
@pytest.mark.parametrize(("given", "short"), [("fp32", "fp32"), ("float32", "fp32"), ("FP16", "fp16"),
                                              ("float16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16"),
                                              ("torch.bfloat16", "bf16")])
def test_every_dtype_spelling_is_accepted(given, short):
    assert cli_support.dtype_name(given) == short


def test_check_accepts_the_long_spelling_and_prints_the_short(no_gpu, capsys):
    assert cli.main(["check", "--backend", "torch", "--op", "hardswish", "--dtype", "float32", "--dtype", "fp32",
                     "--rows", "2", "--cols", "4", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("hardswish ")]  # the two spellings: one run
    assert row.split()[1] == "fp32" and "float32" not in out


def test_bench_accepts_the_long_spelling_and_warns_under_load(no_gpu, monkeypatch, capsys):
    monkeypatch.setattr(cli_support.os, "getloadavg", lambda: (7.5, 5.0, 3.0))
    monkeypatch.setattr(cli_support.os, "cpu_count", lambda: 2)
    assert cli.main(["bench", "--quick", "--op", "hardswish_backward", "--dtype", "float32", "--reps", "1",
                     "--no-save"]) == 0
    out, err = capsys.readouterr()
    assert "load 7.50 (1 min) on 2 cpus" in out.splitlines()[0]
    assert " fp32 " in out and "float32" not in out
    warnings = [line for line in err.splitlines() if "load average" in line]
    assert len(warnings) == 1 and warnings[0].startswith("gradops bench: warning: the 1-minute load average is 7.50")


def test_bench_does_not_warn_on_an_idle_machine(monkeypatch):
    from gradops.bench import load_note

    monkeypatch.setattr(cli_support.os, "getloadavg", lambda: (0.3, 0.2, 0.1))
    monkeypatch.setattr(cli_support.os, "cpu_count", lambda: 2)
    assert load_note() == ("load 0.30 (1 min) on 2 cpus", None)


# ---------------------------------------------------------------- the CANN example ports
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_without_a_gpu_refuses_device_cuda_in_one_line(script, no_gpu, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script)])  # argparse names the program after argv[0]
    spec = importlib.util.spec_from_file_location(f"_example_{Path(script).stem}", EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as stop:
        module.main(["--device", "cuda"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err == f"{script}: error: --device cuda, but torch sees no CUDA device (use --device cpu)\n"


# ---------------------------------------------------------------- first contact: help, version, stray arguments
def test_help_describes_gradops_in_whole_sentences(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    text = " ".join(out.split())
    assert cli.DESCRIPTION in text and text.count("``") == 0  # was the docstring's first line, cut mid-sentence


def test_version_names_gradops_and_torch(capsys):
    import gradops

    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == \
        f"gradops {gradops.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


@pytest.mark.parametrize("command", ["bench", "check", "env", "demo"])
def test_an_unknown_argument_names_the_subcommand(capsys, command):
    line = _refused(capsys, [command, "--bogus"])
    assert line == f"gradops {command}: error: unrecognized arguments: --bogus"


def test_env_aligns_every_op_name(capsys):
    assert cli.main(["env"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    columns = {len(line) - len(line.rstrip().rsplit(" ", 1)[-1]) for line in rows}
    assert rows and len(columns) == 1, rows  # the routing-map names were longer than the column


# ---------------------------------------------------------------- golden: the routing-map and unpermute edge cases
@pytest.mark.parametrize("op", ["moe_token_permute_with_routing_map", "moe_token_permute_with_routing_map_grad",
                                "moe_token_unpermute_with_routing_map", "moe_token_unpermute_with_routing_map_grad"])
def test_golden_refuses_a_negative_num_out_tokens_in_one_line(capsys, tmp_path, op):
    code = cli.main(["golden", op, "--shape", "8x4", "--num-out-tokens", "-3", "--out", str(tmp_path / "case")])
    _, err = capsys.readouterr()
    assert code == 2 and err.splitlines() == [
        "gradops golden: --num-out-tokens must be >= 0 (the permuted rows the forward keeps), got -3"], err


@pytest.mark.parametrize("op", ["moe_token_unpermute", "moe_token_unpermute_grad"])
def test_golden_writes_unpermute_cases_of_no_columns(capsys, tmp_path, op):
    assert cli.main(["golden", op, "--shape", "8x0", "--out", str(tmp_path / "case")]) == 0, capsys.readouterr().err
    assert (tmp_path / "case" / "manifest.json").exists()
