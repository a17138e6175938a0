"""gradops golden / verify (issue 11): case files read back bit for bit, every op's golden against the independent
float64 oracle, the verdicts at each standard's edges, and bad arguments answered in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gradops.cli import main
from gradops.golden import CaseError, cases, files, make, verdict, write_case
from gradops.golden.verify import verify
from gradops.registry import NAMES
from oracles import oracle

DTYPES = ("float32", "float16", "bfloat16")


def _shape(op):
    return "12x16" if op.startswith("moe") else "3x5x16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                                   torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_files_round_trip_bit_for_bit(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        t = (torch.randn(6, 7, generator=gen) * 300).to(dtype)
    else:
        low, high = {torch.uint8: (0, 256), torch.bool: (0, 2), torch.int8: (-128, 128)}.get(dtype, (-3000, 3000))
        t = torch.randint(low, high, (6, 7), generator=gen).to(dtype)
    if dtype.is_floating_point:
        t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0]).to(dtype)
    entry = files.write(tmp_path, "x", t)
    raw = (tmp_path / "x.bin").read_bytes()
    assert len(raw) == t.numel() * t.element_size()
    assert raw == t.contiguous().view(torch.uint8).numpy().tobytes()  # little-endian, bfloat16 as its bits
    for key in ("bin", "npy"):
        back = files.read(tmp_path / entry[key], entry["dtype"], entry["shape"])
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8)), key
    if dtype == torch.bfloat16:
        assert entry["storage"] == "uint16 bits of bfloat16" and np.load(tmp_path / "x.npy").dtype == np.uint16


@pytest.mark.parametrize("op", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_is_the_float64_oracle_rounded_once(op, dtype):
    case = make(op, _shape(op), dtype, seed=3)
    expected = oracle(op, *case.inputs.values())
    assert len(expected) == len(case.outputs)
    for (name, golden), ref in zip(case.outputs.items(), expected):
        ref = ref.reshape(golden.shape)
        if not golden.is_floating_point():
            assert torch.equal(golden.long(), ref.long()), name
            continue
        # one rounding of the same float64 value: equal, except where the two float64 computations straddle a
        # rounding boundary (then one unit in the last place)
        ulp = torch.finfo(golden.dtype).eps * ref.abs().clamp_min(torch.finfo(golden.dtype).tiny)
        assert bool(((golden.double() - ref).abs() <= ulp).all()), (op, name)
        assert (golden.double() == ref.to(golden.dtype).double()).float().mean() > 0.99, (op, name)


@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_grad", "layer_norm", "layer_norm_grad", "layer_norm_backward"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_gamma_beside_half_activations(op, dtype):
    """The tables' mixed rows: gamma (and beta) float32 beside float16 / bfloat16 activations."""
    case = make(op, "4x8x16", dtype, seed=2, gamma_dtype="float32")
    assert case.inputs["gamma"].dtype == torch.float32 and case.inputs["x"].dtype == cases.FLOATS[dtype]
    for (name, golden), ref in zip(case.outputs.items(), oracle(op, *case.inputs.values())):
        ulp = torch.finfo(golden.dtype).eps * ref.reshape(golden.shape).abs().clamp_min(1e-30)
        assert bool(((golden.double() - ref.reshape(golden.shape)).abs() <= ulp).all()), (op, name)


@pytest.mark.parametrize("op", NAMES)
def test_every_op_writes_a_case_that_verifies(tmp_path, op):
    """gradops golden -> the third party's files as "the kernel" -> gradops verify passes; the manifest has what
    the issue names."""
    assert main(["golden", op, "--shape", _shape(op), "--dtype", "bfloat16", "--out", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["op"] == op and manifest["inputs"] and manifest["seed"] == 0
    for out in manifest["outputs"]:
        assert {"name", "dtype", "shape", "golden"} <= set(out) and (tmp_path / out["golden"]).is_file()
    actual = [str(tmp_path / o["third_party"]) for o in manifest["outputs"]]
    assert main(["verify", str(tmp_path), *actual]) == 0


def test_same_seed_same_files(tmp_path):
    for d in ("a", "b"):
        main(["golden", "embedding_dense_backward", "--shape", "40x8", "--seed", "7", "--out", str(tmp_path / d)])
    for f in (tmp_path / "a").glob("*.bin"):
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


@pytest.mark.parametrize("index_dtype", cases.INDEX_DTYPES["embedding_dense_backward"])
def test_every_embedding_index_dtype(tmp_path, index_dtype):
    """The nine index dtypes of aclnnEmbeddingDenseBackward: the golden is the oracle's on the indices as stored
    (floats truncated toward zero, fractions and (-1, 0) values included); narrow types stay in their range; the
    case round-trips through the CLI and verifies."""
    case = make("embedding_dense_backward", "60x8", "bfloat16", seed=6, index_dtype=index_dtype, num_weights=300)
    idx = case.inputs["indices"]
    assert idx.dtype == files.DTYPES[index_dtype][0]
    if idx.is_floating_point():
        assert bool((idx != idx.trunc()).any()) and bool(((idx < 0) & (idx > -1)).any())
    ref = oracle("embedding_dense_backward", *case.inputs.values())[0]
    assert torch.equal(case.outputs["out"], ref.to(torch.bfloat16))
    out = tmp_path / "case"
    assert main(["golden", "embedding_dense_backward", "--shape", "60x8", "--index-dtype", index_dtype,
                 "--out", str(out)]) == 0
    assert main(["verify", str(out), str(out / "third_out.bin")]) == 0
    with pytest.raises(CaseError, match="--index-dtype 'int8': one of int64, int32"):
        make("moe_token_permute", "8x4", "float32", index_dtype="int8")


def test_edge_values_are_in_the_inputs():
    x = make("hardswish_backward", "64x64", "float32").inputs["self"]
    assert bool((x == 3).any()) and bool((x == -3).any()) and bool((x == 0).any())
    emb = make("embedding_dense_backward", "40x8", "float32", padding_idx=1)
    idx = emb.inputs["indices"]
    assert bool((idx == 1).any()) and idx.unique().numel() < idx.numel()  # padding rows and repeats
    ids = make("moe_token_permute", "20x8", "float32", topk=3).inputs["indices"]
    assert any(row.unique().numel() < 3 for row in ids)  # duplicate experts in a token
    flat = make("rms_norm_grad", "4x8", "float32", rstd_form="flat").inputs["rstd"]
    assert flat.shape == (4,) and make("rms_norm_grad", "4x8", "float32").inputs["rstd"].shape == (4, 1)


TORCH_PEERS = {"rms_norm": ("y",), "layer_norm": ("y",), "hardswish": ("out",), "rms_norm_grad": ("dx", "dgamma"),
               "layer_norm_backward": ("dx", "dgamma", "dbeta"), "layer_norm_grad": ("pd_x",),
               "hardswish_backward": ("out",), "embedding_dense_backward": ("out",), "swiglu": ("out",),
               "swiglu_grad": ("out",)}


@pytest.mark.parametrize("op", NAMES)
def test_pytorch_is_the_third_party_where_it_has_the_op(op):
    """PyTorch computes every output it has an operator for, in CANN's output dtype and close to the golden (a
    float32 case: a swapped statistic or a wrong padding row would be far off); gradops' kernel computes the
    rest, and all of them with --third-party gradops."""
    case = make(op, _shape(op), "float32", seed=4, padding_idx=1) if op == "embedding_dense_backward" else \
        make(op, _shape(op), "float32", seed=4)
    for name, golden in case.outputs.items():
        third, source = case.third[name], case.third_source[name]
        assert source.startswith(("torch", "aten")) == (name in TORCH_PEERS.get(op, ())), (name, source)
        assert third.dtype == golden.dtype and third.shape == golden.shape, name
        if golden.is_floating_point():
            torch.testing.assert_close(third, golden, rtol=1e-4, atol=1e-4 * float(golden.abs().max()))
        else:
            assert torch.equal(third, golden)
    ours = make(op, _shape(op), "float32", seed=4, third_party="gradops")
    assert all(s.startswith("gradops.") for s in ours.third_source.values())
    with pytest.raises(CaseError, match="--third-party 'npu': one of torch, gradops"):
        make(op, _shape(op), "float32", third_party="npu")


def test_hardswish_third_party_takes_cann_values_at_the_edges():
    """torch >= 2.8 uses the open interval at x = +-3; the third party gets CANN's -0.5·g and 1.5·g there and
    ATen's hardswish_backward everywhere else."""
    case = make("hardswish_backward", "64x64", "bfloat16", seed=5)
    g, x = case.inputs["grad_output"], case.inputs["self"]
    third, aten = case.third["out"], torch.ops.aten.hardswish_backward(g, x)
    edge = (x == 3) | (x == -3)
    assert edge.any() and torch.equal(third[~edge], aten[~edge])
    assert torch.equal(third[x == -3], (g[x == -3].float() * -0.5).bfloat16())
    assert torch.equal(third[x == 3], (g[x == 3].float() * 1.5).bfloat16())


def test_embedding_third_party_reads_an_out_of_table_padding_as_none():
    case = make("embedding_dense_backward", "40x8", "float32", padding_idx=-3, num_weights=12)
    grad, idx = case.inputs["grad"], case.inputs["indices"]
    expected = torch.ops.aten.embedding_dense_backward(grad, idx, 12, -1, False)
    assert torch.equal(case.third["out"], expected) and bool(expected[idx[-1]].any())


# ---------------------------------------------------------------- the verdicts at their edges
T32 = 2.0 ** -13


def _planted(count, delta, n=1000):
    golden = torch.ones(n)
    actual = golden.clone()
    actual[:count] += delta  # 1 + delta is exact in float32 for these deltas
    return actual, golden


def test_threshold_mere_edge():
    """MERE < T: 124 elements off by 8T in 1000 give 0.992 T (pass), 126 give 1.008 T (fail)."""
    assert verdict.judge("y", *_planted(124, 8 * T32)).threshold_pass
    v = verdict.judge("y", *_planted(126, 8 * T32))
    assert not v.threshold_pass and v.errors.mere > T32 and v.errors.mare < 10 * T32


def test_threshold_mare_edge():
    """MARE < 10 T, strictly: 10 T = 1.25 * 2^-10 is exact; /(1 + 1e-7) puts it just inside, one float32 step
    more is outside."""
    assert verdict.judge("y", *_planted(1, 10 * T32)).threshold_pass
    v = verdict.judge("y", *_planted(1, 10 * T32 + 2.0 ** -23))
    assert not v.threshold_pass and v.errors.mare >= 10 * T32


def test_threshold_per_dtype():
    assert verdict.THRESHOLD == {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -13}
    golden = torch.ones(100, dtype=torch.bfloat16)
    off = golden.clone()
    off[0] = 1.0078125  # one bf16 ulp: MARE 2^-7 < 10 T, MERE 2^-7 / 100 < T
    assert verdict.judge("y", off, golden).threshold_pass


@pytest.mark.parametrize("ratios,level", [
    ((2.0, 1.2, 1.2), "L2"), ((2.01, 1.2, 1.2), "L1"), ((5.0, 1.5, 1.5), "L1"), ((5.0, 1.5, 1.51), "L0"),
    ((10.0, 2.0, 2.0), "L0"), ((10.0, 2.01, 2.0), None), ((0.0, 0.0, 0.0), "L2")])
def test_ratio_levels_at_their_edges(ratios, level):
    assert verdict.level(ratios) == level


def test_ratio_against_a_third_party():
    actual, golden = _planted(10, 4 * T32)
    third, _ = _planted(10, 2 * T32)
    v = verdict.judge("y", actual, golden, third)
    assert v.ratios == pytest.approx((2.0, 2.0, 2.0), rel=1e-6) and v.level == "L0" and v.passed
    # a third party with no error enters at the rounding floor (issue 36): for a float32 1.0, half an ulp (2^-24)
    # for MARE, a quarter for MERE, ulp / sqrt(12) for RMSE; 4 T off in 10 elements of 1000 stays far below L0
    v = verdict.judge("y", actual, golden, golden)
    ulp = 2.0 ** -23
    assert v.ratios == pytest.approx((4 * T32 / (ulp / 2), 0.01 * 4 * T32 / (ulp / 4), 0.1 * 4 * T32 * 12 ** 0.5 / ulp))
    assert v.level is None and not v.passed


def test_small_values_count_against_the_third_party():
    golden = torch.full((100,), 2.0 ** -16)  # below fp32's small-value threshold 2^-14
    actual = golden.clone()
    actual[:3] += 2.0 ** -28  # off by more than 2^-30: three small-value errors
    third = golden.clone()
    third[:1] += 2.0 ** -28
    v = verdict.judge("y", actual, golden, third)
    assert v.errors.small_errors == 3 and v.small_ratio == 3.0 and not v.passed
    third[:2] += 2.0 ** -28
    assert verdict.judge("y", actual, golden, third).small_ratio <= verdict.SMALL_RATIO


def test_non_finite_values_match_only_themselves():
    golden = torch.tensor([float("nan"), float("inf"), 1.0])
    assert verdict.judge("y", golden.clone(), golden).errors.mare == 0
    assert verdict.judge("y", torch.tensor([float("nan"), float("-inf"), 1.0]), golden).errors.mare == float("inf")
    assert not verdict.judge("y", torch.tensor([0.0, float("inf"), 1.0]), golden).passed


def test_integer_outputs_are_exact_and_name_the_worst():
    golden = torch.arange(10, dtype=torch.int32)
    bad = golden.clone()
    bad[4] = 7
    v = verdict.judge("sorted_indices", bad, golden)
    assert not v.passed and v.worst[0]["index"] == [4] and v.worst[0]["actual"] == 7


def test_worst_elements_and_chunks(monkeypatch):
    monkeypatch.setattr(verdict, "CHUNK", 7)  # statistics merged over chunks equal the one-pass ones
    actual, golden = _planted(5, 8 * T32, n=50)
    actual[33] += 0.5
    v = verdict.judge("y", actual, golden)
    assert v.worst[0]["index"] == [33] and v.errors.mere == pytest.approx((5 * 8 * T32 + 0.5) / 50 / (1 + 1e-7))


def test_the_standard_decides_pass_or_fail():
    """Ratio (CANN's standard for its built-in operators) is the default with a third party: a kernel as far from
    the golden as the third party passes it although both miss Threshold; "both" and "threshold" fail it."""
    actual, golden = _planted(50, 12 * T32)  # MARE 12 T: Threshold fails
    v = verdict.judge("y", actual, golden, actual.clone())
    assert v.standard == "ratio" and v.level == "L2" and v.passed and not v.threshold_pass
    assert v.third_threshold_pass is False and v.as_dict()["ratio_pass"] is True
    assert not verdict.judge("y", actual, golden, actual.clone(), standard="both").passed
    assert not verdict.judge("y", actual, golden, actual.clone(), standard="threshold").passed
    good, _ = _planted(1, T32)
    assert verdict.judge("y", good, golden, standard="threshold").passed
    assert verdict.judge("y", good, golden).standard == "threshold"  # no third party: Threshold
    with pytest.raises(ValueError, match="needs a third-party output"):
        verdict.judge("y", good, golden, standard="ratio")
    with pytest.raises(ValueError, match="standard 'loose'"):
        verdict.judge("y", good, golden, good, standard="loose")


def test_verify_standard_option_and_the_low_bar_note(tmp_path, capsys):
    """A third party that misses Threshold (its file replaced by the golden off by 20 T in one element in ten):
    verify says its bar is low; the same file judged as "the kernel" passes by Ratio and fails with --standard
    both."""
    main(["golden", "hardswish_backward", "--shape", "64x64", "--out", str(tmp_path)])
    off = np.fromfile(tmp_path / "golden_out.bin", dtype="<f4")
    off[::10] *= 1 + 20 * T32
    off.tofile(tmp_path / "third_out.bin")
    files_ = [str(tmp_path / "third_out.bin")]
    capsys.readouterr()
    assert main(["verify", str(tmp_path), *files_]) == 0
    out = capsys.readouterr().out
    assert "the third party fails Threshold itself" in out and "PASS by the ratio standard" in out
    assert main(["verify", str(tmp_path), *files_, "--standard", "both"]) == 1
    assert "FAIL by the both standard" in capsys.readouterr().out
    assert main(["verify", str(tmp_path), *files_, "--no-ratio", "--standard", "ratio"]) == 2
    assert "needs the third party" in capsys.readouterr().err


# ---------------------------------------------------------------- the CLI: verdicts, exit codes, errors
def test_verify_fails_a_perturbed_output_and_prints_the_worst(tmp_path, capsys):
    main(["golden", "hardswish_backward", "--shape", "32x32", "--dtype", "float16", "--out", str(tmp_path)])
    bits = np.fromfile(tmp_path / "golden_out.bin", dtype="<f2")
    bits[17] = bits[17] * 1.5 + 1.0
    bits.tofile(tmp_path / "npu.bin")
    capsys.readouterr()
    assert main(["verify", str(tmp_path), str(tmp_path / "npu.bin")]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "at (0, 17)" in out
    assert main(["verify", str(tmp_path), str(tmp_path / "golden_out.npy"), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["passed"] and record["outputs"][0]["level"] == "L2"


@pytest.mark.parametrize("argv,message", [
    (["golden", "nope", "--shape", "4x4"], "unknown op 'nope'"),
    (["golden", "hardswish", "--shape", "4by4"], "expected sizes joined by 'x'"),
    (["golden", "hardswish", "--shape", "4x4", "--dtype", "float64"], "--dtype 'float64'"),
    (["golden", "hardswish", "--shape", "4x4", "--topk", "2"], "hardswish does not read --topk"),
    (["golden", "moe_token_permute", "--shape", "4x4x4"], "--shape must be TxH"),
    (["golden", "moe_token_permute", "--shape", "4x4", "--experts", "0"], "--experts >= 1"),
    (["golden", "embedding_dense_backward", "--shape", "4x4", "--num-weights", "-2"], "--num-weights must be >= 1"),
])
def test_bad_golden_arguments_get_one_line(tmp_path, capsys, argv, message):
    assert main([*argv, "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_bad_verify_arguments_get_one_line(tmp_path, capsys):
    case = tmp_path / "case"
    main(["golden", "rms_norm", "--shape", "8x16", "--dtype", "bfloat16", "--out", str(case)])
    np.zeros(128, dtype="<f4").tofile(tmp_path / "wrong_dtype.bin")  # float32 bytes for a bfloat16 output
    np.save(tmp_path / "wrong.npy", np.zeros((8, 16), dtype=np.float32))
    checks = [
        ([str(tmp_path / "nowhere"), str(case / "third_y.bin")], "no manifest.json"),
        ([str(case), str(tmp_path / "missing.bin"), str(case / "third_rstd.bin")], "no such file"),
        ([str(case), str(tmp_path / "wrong_dtype.bin"), str(case / "third_rstd.bin")], "expected 256"),
        ([str(case), str(tmp_path / "wrong.npy"), str(case / "third_rstd.bin")], "expected bfloat16 [8, 16]"),
        ([str(case), str(case / "third_y.bin")], "has 2 output(s) (y, rstd); got 1"),
    ]
    for args, message in checks:
        capsys.readouterr()
        assert main(["verify", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_python_api(tmp_path):
    case = make("moe_token_unpermute_grad", "16x8", "float16", seed=1, topk=4, experts=3)
    manifest = write_case(case, tmp_path, shape="16x8", dtype="float16", seed=1)
    assert [o["name"] for o in manifest["outputs"]] == ["grad_permuted_tokens", "grad_probs"]
    verdicts = verify(tmp_path, [tmp_path / o["golden"] for o in manifest["outputs"]])
    assert all(v.passed and v.errors.mare == 0 for v in verdicts)
    with pytest.raises(CaseError, match="--topk must be in"):
        cases.make("moe_token_permute", "4x4", topk=0)


def test_the_readme_example_passes_the_good_kernel_and_fails_the_bug(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "golden_loop.py"
    spec = importlib.util.spec_from_file_location("golden_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS: 2/2") == 1 and out.count("FAIL: 1/2") == 1
