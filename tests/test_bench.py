"""``gradops bench``: the --quick smoke run of every op, its JSON-lines schema, and the report's arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from gradops.bench import report
from gradops.bench.cases import OPS, Case
from gradops.bench.timing import Timing, summarize
from gradops.cli import main

KEYS = {"op", "shape", "dtype", "provider", "median_ms", "p20_ms", "p80_ms", "reps", "bytes", "gbps", "pct_copy",
        "device", "device_name", "torch", "triton", "gradops", "gradops_backend", "date", "threads"}


def test_quick_run_writes_table_jsonl_and_plot(tmp_path, capsys):
    assert main(["bench", "--device", "cpu", "--quick", "--dtype", "fp32", "--results", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    files = sorted(p.name for p in tmp_path.iterdir())
    jsonl = [f for f in files if f.endswith(".jsonl")]
    assert len(jsonl) == 1 and jsonl[0].startswith("cpu-")
    rows = [json.loads(line) for line in (tmp_path / jsonl[0]).read_text().splitlines()]
    for r in rows:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["device"] == "cpu" and r["dtype"] == "fp32" and r["median_ms"] > 0
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["gbps"] == pytest.approx(r["bytes"] / (r["median_ms"] * 1e-3) / 1e9, rel=1e-2)
    assert {r["op"] for r in rows} == set(OPS)
    for op in OPS:
        providers = {r["provider"] for r in rows if r["op"] == op}
        assert {"gradops", "gradops fresh", "gradops out=", "eager", "copy_"} <= providers, op
        assert "compile" not in providers  # --quick leaves torch.compile out
    speedups = [r["speedup"] for r in rows if r["provider"].startswith("gradops")]
    assert all("eager" in s and s["eager"] > 0 for s in speedups)
    assert all(r["pct_copy"] == 100.0 for r in rows if r["provider"] == "copy_")
    assert "rms_norm_grad" in table and "speedup vs peers" in table
    pytest.importorskip("matplotlib")
    assert any(f.endswith(".png") for f in files)


def test_records_divide_the_byte_floor_by_the_median():
    case = Case("hardswish_backward", {"n": 1000}, torch.float32, nbytes=12_000, copy_numel=1000)
    timings = {"gradops": Timing(0.001, 0.0009, 0.0011, 5), "eager": Timing(0.004, 0.004, 0.004, 5),
               "copy_": Timing(0.002, 0.002, 0.002, 5)}
    rows = {r["provider"]: r for r in report.records(case, timings, {"device": "cpu"})}
    assert rows["gradops"]["gbps"] == pytest.approx(12.0)           # 12 kB in 1 us
    assert rows["copy_"]["gbps"] == pytest.approx(4.0)              # 2 x 1000 x 4 B in 2 us
    assert rows["gradops"]["pct_copy"] == pytest.approx(300.0)
    assert rows["gradops"]["speedup"] == {"eager": pytest.approx(4.0)}
    assert "speedup" not in rows["eager"]


def test_summary_quantiles():
    t = summarize([0.001 * i for i in range(1, 11)])  # 1..10 ms
    assert t.median_ms == pytest.approx(5.5) and t.p20_ms == pytest.approx(2.8) and t.p80_ms == pytest.approx(8.2)


def test_interpreter_timings_are_refused(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["bench", "--quick", "--device", "cpu", "--no-save"]) == 2
    assert "interpreter" in capsys.readouterr().err


def test_per_call_times_every_public_function_beside_its_op_path_and_aten(tmp_path, capsys, monkeypatch):
    import importlib

    import gradops

    per_call = importlib.import_module("gradops.bench.per_call")
    monkeypatch.setattr(per_call, "ROUNDS", 2)
    monkeypatch.setattr(per_call, "CALLS", 2)
    assert main(["bench", "--per-call", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    from gradops.registry import NAMES

    backwards = [name for name in gradops.__all__ if name.endswith(("_grad", "_backward", "_grad_beta"))]
    for name in [*NAMES, *backwards, "rms_norm fwd+bwd", "embedding fwd+bwd"]:  # every registered op
        assert f"\n{name} " in out, name
    (path,) = tmp_path.glob("per-call-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["function"] for r in rows} >= set(backwards)
    assert all(r["gradops_us"] > 0 and r["op_path_us"] > 0 and r["torch"] == torch.__version__ for r in rows)


def test_sweep_times_each_module_against_torch_and_writes_jsonl(tmp_path, capsys, monkeypatch):
    """A small sweep through the real workers: the cases the parent lists (monkeypatched here, handed to each
    worker in its spec), one record per case with each process's paired ratio, and the reported ratio their
    median."""
    import importlib
    import statistics

    sweep = importlib.import_module("gradops.bench.sweep")
    monkeypatch.setattr(sweep, "SIZES", ((8, 8), (16, 32)))
    monkeypatch.setattr(sweep, "VOCAB", 50)
    # one function through the workers (every one runs in-process below: a worker costs ~2 s of imports)
    monkeypatch.setattr(sweep, "OPS", ("moe_token_unpermute_grad",))
    assert main(["bench", "--sweep", "--dtype", "fp32", "--budget", "0.01", "--processes", "2", "--malloc", "glibc",
                 "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in (*sweep.MODULES, *sweep.OPS):
        assert f"\n{name} " in out, name
    (path,) = tmp_path.glob("sweep-cpu-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    cases = {(r.get("module") or r["op"], r["rows"], r["cols"]) for r in rows}
    assert cases == {(m, r, c) for m in (*sweep.MODULES, *sweep.OPS) for r, c in ((8, 8), (16, 32))}
    assert {r["twin"] for r in rows if "op" in r} == {"autograd of index_select, weight, sum"}
    assert {r["shape"]["K"] for r in rows if r.get("op") == "moe_token_unpermute_grad"} == {sweep.TOP_K}
    for r in rows:
        assert r["processes"] == 2 and len(r["ratios"]) == 2 and all(n >= 5 for n in r["rounds"])
        assert r["ratio"] == pytest.approx(statistics.median(r["ratios"]), rel=1e-3)
        assert r["gradops_us"] > 0 and r["torch_us"] > 0 and all(q > 0 for q in r["ratios"])
    assert {r["malloc"] for r in rows} == {"glibc defaults"}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_sweep_times_every_backward_function_against_its_eager_twin(dtype):
    """Each registered backward function maps to a shape at a sweep size, and a worker's measurement of it pairs
    gradops' call with the eager twin's (in this process, as a worker runs it)."""
    sweep = __import__("gradops.bench.sweep", fromlist=["measure"])
    from gradops.bench.cases import EAGER

    assert set(sweep.OPS) == set(EAGER)
    for op in sweep.OPS:
        got = sweep.measure({"op": op, "rows": 16, "cols": 32, "dtype": dtype, "device": "cpu", "compile": False,
                             "budget": 0.0, "vocab": 50, "malloc": "glibc"})
        assert got["rounds"] == 5 and got["gradops_us"] > 0 and got["torch_us"] > 0, op
        assert got["ratio"] > 0 and "compile_ratio" not in got, op
    assert sweep.op_shape("moe_token_permute_grad", 16, 32, 50) == {"T": 16, "K": sweep.TOP_K, "H": 32}
    assert sweep.op_shape("hardswish_backward", 16, 32, 50) == {"n": 512}
    with pytest.raises(ValueError, match="no sweep shape"):
        sweep.op_shape("not_an_op", 16, 32, 50)


def test_paired_ratio_compares_rounds_not_best_times():
    """A slow stretch that lands on some rounds moves both sides of those rounds: the paired median sees 0.9
    throughout, where each side's best round would compare a fast moment of one with a slow one of the other."""
    sweep = __import__("gradops.bench.sweep", fromlist=["_paired"])
    ours = [90.0, 180.0, 91.8, 270.0, 90.0]
    theirs = [100.0, 200.0, 102.0, 300.0, 100.0]
    assert sweep._paired(ours, theirs) == pytest.approx(0.9)
    assert sweep._paired([100.0, 50.0, 100.0], [50.0, 100.0, 50.0]) == pytest.approx(2.0)  # the median, not a mean


def test_rounds_alternate_the_order_of_the_cases():
    sweep = __import__("gradops.bench.sweep", fromlist=["_rounds"])
    calls: list[str] = []
    cases = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    means = sweep._rounds(cases, 0.0, lambda: None)
    assert {len(v) for v in means.values()} == {5}
    timed = calls[12:]  # after three warm-up calls and one probe call of each
    per_round = timed.count("a") // 5
    order = [timed[i] for i in range(0, len(timed), per_round)]
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a", "a", "b", "c"]


def test_steady_malloc_keeps_freed_memory_mapped():
    """The sweep's default allocator settings, in a child (they last for the process): on glibc, a step that
    allocates and frees three 24 MiB tensors (and two sums) takes no page faults once warm. With glibc's defaults the
    same steps took 306880 faults in every window of 10 steps (CI VM, 2026-11-24): freeing a 24 MiB mmapped chunk
    raises the mmap threshold to 24 MiB and the trim threshold to 48, so the next steps' tensors come from the heap
    and each step's frees trim ~72 MiB off its top, which the next step faults back in. (With 8 MiB tensors, as
    this test had, the defaults could take none either, and one window of the kept heap once took 2048 beside
    another pytest worker: the test could neither fail nor pass reliably.)"""
    import subprocess
    import sys

    code = """
import resource, torch
from gradops.bench import sweep
said = sweep.steady_malloc()
print(said)
def step():
    a, b, c = torch.ones(6 << 20), torch.ones(6 << 20), torch.ones(6 << 20)
    return (a + b + c).sum()
for _ in range(5):
    step()
windows = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    windows.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(windows))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if not sys.platform.startswith("linux"):
        assert out[0] == "platform"
        return
    if out[0] != "glibc":
        pytest.skip(f"not glibc: {' '.join(out)}")
    assert "no trimming" in " ".join(out)
    # The quietest window: a trimming heap faults in every one (>= 10 x 6144 pages), a kept one in none, apart from
    # what the kernel does to a page now and then on a loaded machine, which rarely reaches all three.
    assert int(out[-1]) < 6144  # fewer than one 24 MiB tensor's pages over 10 steps


def test_sweep_only_flags_are_refused_elsewhere(capsys):
    assert main(["bench", "--per-call", "--malloc", "glibc", "--no-save"]) == 2
    assert "--malloc applies to --sweep only" in capsys.readouterr().err
    assert main(["bench", "--per-call", "--sweep-compile", "--no-save"]) == 2
    assert "--sweep-compile applies to --sweep only" in capsys.readouterr().err
    assert main(["bench", "--per-call", "--processes", "2", "--no-save"]) == 2
    assert "--processes applies to --sweep only" in capsys.readouterr().err


def test_sweep_with_compile_adds_the_compiled_twin(tmp_path, capsys, monkeypatch):
    import importlib

    sweep = importlib.import_module("gradops.bench.sweep")
    monkeypatch.setattr(sweep, "SIZES", ((8, 8),))
    monkeypatch.setattr(sweep, "MODULES", ("Hardswish",))
    monkeypatch.setattr(sweep, "OPS", ("hardswish_backward",))
    assert main(["bench", "--sweep", "--sweep-compile", "--dtype", "fp32", "--budget", "0.01", "--processes", "1",
                 "--no-save"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("Hardswish", "hardswish_backward"):
        line = next(ln for ln in lines if ln.startswith(name + " "))
        assert len(line.split()) == 9, line  # name, size, dtype, gradops, torch, ratio, range, compile, ratio


def test_models_times_patched_against_transformers_and_its_experts_backends(tmp_path, capsys, monkeypatch):
    """--models on tiny configs: a row per model, every transformers experts backend for the MoE, a backend over
    SLOW x the fastest kept out of the rounds with its probe step, and ratios that divide the medians."""
    pytest.importorskip("transformers")
    import importlib

    models = importlib.import_module("gradops.bench.models")
    tiny = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    monkeypatch.setattr(models, "MODELS", {
        "llama": ("LlamaConfig", "LlamaForCausalLM", tiny),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      {**tiny, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2})})
    monkeypatch.setattr(models, "TOKENS", {"cpu": (2, 8)})
    monkeypatch.setattr(models, "SLOW", 1.0)  # every backend slower than the fastest is probed only
    assert main(["bench", "--models", "--reps", "3", "--budget", "0.01", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\nllama " in out and "\nqwen3_moe " in out
    (path,) = tmp_path.glob("models-cpu-*.jsonl")
    rows = {r["model"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(rows) == {"llama", "qwen3_moe"}
    assert {"transformers_batched_mm_ms", "transformers_eager_ms"} <= set(rows["qwen3_moe"])
    assert "transformers_eager_ms" not in rows["llama"]  # a dense model has no experts backends
    for r in rows.values():
        assert r["ratio"] == pytest.approx(r["gradops_ms"] / r["transformers_ms"], rel=1e-3)
        best = r[f"{r['best_transformers'].replace(' ', '_')}_ms"]
        assert best == min(v for k, v in r.items() if k.startswith("transformers") and k.endswith("_ms"))


def test_gpu_check_flags_are_refused_where_they_do_not_apply(capsys):
    assert main(["bench", "--per-call", "--dry-run", "--no-save"]) == 2
    assert "--dry-run applies to the table, --sweep and --models" in capsys.readouterr().err
    assert main(["bench", "--cuda-graphs", "--device", "cpu", "--no-save"]) == 2
    assert "--cuda-graphs needs a CUDA device" in capsys.readouterr().err
    assert main(["bench", "--sizes", "8x8", "--no-save"]) == 2
    assert "--sizes applies to --sweep only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--sweep", "--sizes", "8x", "--no-save"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "must be ROWSxCOLS" in err and len(err.strip().splitlines()) == 1


def test_records_are_written_case_by_case(tmp_path, monkeypatch):
    """A run stopped part-way (scripts/gpu_check.sh's time limit) keeps the cases it finished."""
    from gradops.bench import cases

    def broken(*args):
        raise RuntimeError("stopped here")

    monkeypatch.setitem(cases.BUILDERS, "hardswish_backward", broken)
    with pytest.raises(RuntimeError, match="stopped here"):
        main(["bench", "--device", "cpu", "--quick", "--dtype", "fp32", "--op", "rms_norm_grad", "--op",
              "hardswish_backward", "--results", str(tmp_path)])
    (path,) = tmp_path.glob("cpu-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["op"] for r in rows} == {"rms_norm_grad"} and all(r["median_ms"] > 0 for r in rows)
    assert all("commit" in r and "driver" in r for r in rows)
