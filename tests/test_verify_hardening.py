"""gradops verify / golden against what a user or a stranger's case directory may hand them (issue 36): the Ratio
standard's floor for an exact third party, manifests that point outside their directory, files whose apparent size
is not on disk, and every malformed manifest, file or argument answered in one line with exit 2 (exit 1 is FAIL).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from golden_runs import gradops_outputs
from gradops.cli import main
from gradops.golden import make, verdict, write_case

BF16_ULP_1 = 2.0 ** -7  # one bfloat16 step at 1.0


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """``gradops ARGV`` in this process: (exit status, stdout, stderr). argparse's refusals leave main() as
    SystemExit, as they leave the command; any other exception escaping main() is what a user would see as a
    traceback, so the test fails on it."""
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _one_line_refusal(rc: int, out: str, err: str, fragment: str) -> None:
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err and not out, (out, err)


# ------------------------------------------------------------ 8: the Ratio against an exact third party
def test_one_ulp_against_an_exact_third_party_is_judged_against_the_rounding_floor():
    """bfloat16 golden 1.0 everywhere, the third party exact, the kernel one step off in one element of 1000: the
    ratio was err / 0 = inf ("below L0"); against the rounding floor (half an ulp, a quarter on average, ulp/sqrt(12)
    root mean square) it is 2 / 0.004 / 0.11: L2."""
    golden = torch.ones(1000, dtype=torch.bfloat16)
    actual = golden.clone()
    actual[7] = 1 + BF16_ULP_1
    v = verdict.judge("dx", actual, golden, golden.clone())
    assert v.third.as_tuple() == (0.0, 0.0, 0.0)
    assert v.floor.as_tuple() == pytest.approx((BF16_ULP_1 / 2 / (1 + 1e-7), BF16_ULP_1 / 4 / (1 + 1e-7),
                                                BF16_ULP_1 / 12 ** 0.5))
    assert v.ratios == pytest.approx((2.0, 4 / 1000, 12 ** 0.5 / 1000 ** 0.5))
    assert v.level == "L2" and v.passed


def test_the_floor_still_fails_a_kernel_off_everywhere():
    """One step off in every element against an exact third party: MERE ratio 4 (an ulp against a quarter), RMSE
    ratio sqrt(12): no level."""
    golden = torch.ones(1000, dtype=torch.bfloat16)
    v = verdict.judge("dx", golden + BF16_ULP_1, golden, golden.clone())
    assert v.ratios[1] == pytest.approx(4.0) and v.level is None and not v.passed


def test_the_floor_never_lowers_a_real_third_party_error():
    golden = torch.ones(1000, dtype=torch.bfloat16)
    third = golden.clone()
    third[:100] += 8 * BF16_ULP_1  # well above the floor on every statistic
    v = verdict.judge("dx", third.clone(), golden, third)
    assert v.ratios == (1.0, 1.0, 1.0) and v.third.mare > v.floor.mare


@pytest.mark.parametrize("seed", [0, 3])
def test_gradops_bf16_rms_norm_grad_passes_the_issue_case(tmp_path, capsys, seed):
    """The issue's case: ``gradops golden rms_norm_grad --shape 64x256 --dtype bfloat16`` with gradops' own
    outputs (seed 3 had dx one bf16 step off in one element, PyTorch exact: Ratio inf, FAIL)."""
    case = tmp_path / "case"
    assert main(["golden", "rms_norm_grad", "--shape", "64x256", "--dtype", "bfloat16", "--seed", str(seed),
                 "--out", str(case)]) == 0
    paths = gradops_outputs(case, json.loads((case / "manifest.json").read_text()))
    rc, out, _ = _run(["verify", str(case), *map(str, paths)], capsys)
    assert rc == 0, out


# ------------------------------------------------------------ 9: manifest paths stay in the case directory
@pytest.fixture(scope="module")
def base_case(tmp_path_factory) -> Path:
    """A small valid case (hardswish_backward 4x4 float32: 64 bytes per output file)."""
    directory = tmp_path_factory.mktemp("base") / "case"
    write_case(make("hardswish_backward", "4x4", "float32", seed=1), directory, shape="4x4", dtype="float32")
    return directory


def _copy_case(base: Path, tmp_path: Path) -> tuple[Path, dict]:
    case = tmp_path / "case"
    shutil.copytree(base, case)
    return case, json.loads((case / "manifest.json").read_text())


def _save(case: Path, manifest: object) -> None:
    (case / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("key,target", [
    ("golden", "../private.bin"), ("third_party", "../private.bin"), ("golden", "ABSOLUTE"),
    ("golden", "sub/../../private.bin"), ("golden", "link.bin"), ("third_party", "dirlink/private.bin")])
def test_verify_refuses_a_manifest_file_outside_the_case_directory(base_case, tmp_path, capsys, key, target):
    case, manifest = _copy_case(base_case, tmp_path)
    private = tmp_path / "private.bin"
    np.full(16, 1234.5, dtype="<f4").tofile(private)  # the right size: before the fix it was read and printed
    (case / "link.bin").symlink_to(private)
    (case / "dirlink").symlink_to(tmp_path)
    manifest["outputs"][0][key] = str(private) if target == "ABSOLUTE" else target
    _save(case, manifest)
    rc, out, err = _run(["verify", str(case), str(case / "golden_out.bin")], capsys)
    _one_line_refusal(rc, out, err, "case directory")
    assert "1234.5" not in out + err


def test_a_symlink_inside_the_case_directory_is_fine(base_case, tmp_path, capsys):
    case, manifest = _copy_case(base_case, tmp_path)
    (case / "alias.bin").symlink_to(case / "golden_out.bin")
    manifest["outputs"][0]["golden"] = "alias.bin"
    _save(case, manifest)
    assert _run(["verify", str(case), str(case / "golden_out.bin")], capsys)[0] == 0


# ------------------------------------------------------------ 10: memory bounded by chunks, not by the manifest
_PEAK = """
import resource, sys
from gradops.cli import main
rc = main(sys.argv[1:])
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc, file=sys.stderr)
"""


def _peak_kib(argv: list[str]) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, timeout=600)
    line = [x for x in done.stderr.splitlines() if x.startswith("PEAK")]
    assert line, done.stderr[-2000:]
    _, peak, rc = line[0].split()
    return int(peak), int(rc)


def _sparse_case(directory: Path, elements: int) -> Path:
    directory.mkdir()
    _save(directory, {"op": "hardswish", "inputs": [], "outputs": [
        {"name": "out", "dtype": "float32", "shape": [elements], "golden": "g.bin", "third_party": "t.bin"}]})
    for name in ("g.bin", "t.bin", "a.bin"):
        with open(directory / name, "wb") as f:
            f.truncate(4 * elements)  # holes: nothing on disk
    return directory / "a.bin"


def test_sparse_files_cost_chunks_not_their_apparent_size(tmp_path):
    """Three sparse files of 64 MiB apparent size each (a few KiB on disk): before, verify loaded all three
    (peak RSS 480 MiB above the same run on a 64-element case); now it reads chunks of verdict.CHUNK elements,
    ~40 MiB above it, less than one file's apparent size."""
    big = _sparse_case(tmp_path / "big", 1 << 24)
    small = _sparse_case(tmp_path / "small", 64)
    assert sum(f.stat().st_blocks for f in (tmp_path / "big").iterdir()) * 512 < 1 << 20
    base, rc_small = _peak_kib(["verify", str(small.parent), str(small)])
    peak, rc_big = _peak_kib(["verify", str(big.parent), str(big)])
    assert rc_small == rc_big == 0
    assert peak - base < 64 * 1024, (peak, base)


# ------------------------------------------------------------ 11: malformed manifests and files -> exit 2
def _mutate_manifest(change):
    def apply(case: Path, manifest: dict) -> list[str]:
        _save(case, change(manifest))
        return [str(case / "golden_out.bin")]
    return apply


def _set(path, value):
    def change(m):
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return m
    return change


def _drop(path):
    def change(m):
        target = m
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
        return m
    return change


def _raw_manifest(data: bytes):
    def apply(case: Path, manifest: dict) -> list[str]:
        (case / "manifest.json").write_bytes(data)
        return [str(case / "golden_out.bin")]
    return apply


def _actual_npy(make_file):
    def apply(case: Path, manifest: dict) -> list[str]:
        path = case / "actual.npy"
        make_file(path, case)
        return [str(path)]
    return apply


def _truncated_npy(path: Path, case: Path) -> None:
    np.save(path, np.zeros((4, 4), dtype="<f4"))
    path.write_bytes(path.read_bytes()[:-5])


def _pickled_npy(path: Path, case: Path) -> None:
    marker = case / "unpickled"
    np.save(path, np.array([_Marker(str(marker))] * 16, dtype=object).reshape(4, 4), allow_pickle=True)


class _Marker:
    """Unpickling one would create a file: the test proves verify never does."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


VERIFY_CASES = {
    "manifest a list": (_raw_manifest(b"[1, 2]"), "must hold a JSON object"),
    "manifest not utf-8": (_raw_manifest(b"\xff\xfe{"), "not JSON"),
    "manifest nested too deep": (_raw_manifest(b"[" * 100000 + b"]" * 100000), "not JSON"),
    "op a number": (_mutate_manifest(_set(["op"], 5)), "op must be a string"),
    "outputs an object": (_mutate_manifest(_set(["outputs"], {"a": 1})), "outputs must be a list"),
    "outputs empty": (_mutate_manifest(_set(["outputs"], [])), "outputs is empty"),
    "output a string": (_mutate_manifest(_set(["outputs", 0], "out")), "must be an object"),
    "output without golden": (_mutate_manifest(_drop(["outputs", 0, "golden"])), "missing golden"),
    "output without shape": (_mutate_manifest(_drop(["outputs", 0, "shape"])), "missing shape"),
    "name a list": (_mutate_manifest(_set(["outputs", 0, "name"], ["out"])), "name must be a string"),
    "shape negative": (_mutate_manifest(_set(["outputs", 0, "shape"], [-4, -4])), "shape must be a list"),
    "shape a string": (_mutate_manifest(_set(["outputs", 0, "shape"], "4x4")), "shape must be a list"),
    "shape floats": (_mutate_manifest(_set(["outputs", 0, "shape"], [4.0, 4.0])), "shape must be a list"),
    "shape None": (_mutate_manifest(_set(["outputs", 0, "shape"], None)), "shape must be a list"),
    "shape bools": (_mutate_manifest(_set(["outputs", 0, "shape"], [True, 16])), "shape must be a list"),
    "shape huge": (_mutate_manifest(_set(["outputs", 0, "shape"], [2 ** 62, 2 ** 62])), "bytes, expected"),
    "dtype a list": (_mutate_manifest(_set(["outputs", 0, "dtype"], ["float32"])), "dtype must be one of"),
    "dtype unknown": (_mutate_manifest(_set(["outputs", 0, "dtype"], "complex64")), "dtype must be one of"),
    "dtype None": (_mutate_manifest(_set(["outputs", 0, "dtype"], None)), "dtype must be one of"),
    "golden None": (_mutate_manifest(_set(["outputs", 0, "golden"], None)), "must be a file name"),
    "golden a number": (_mutate_manifest(_set(["outputs", 0, "golden"], 7)), "must be a file name"),
    "golden empty": (_mutate_manifest(_set(["outputs", 0, "golden"], "")), "must be a file name"),
    "golden with NUL": (_mutate_manifest(_set(["outputs", 0, "golden"], "a\x00b")), "must be a file name"),
    "golden a directory": (_mutate_manifest(_set(["outputs", 0, "golden"], ".")), "not a regular file"),
    "golden missing": (_mutate_manifest(_set(["outputs", 0, "golden"], "gone.bin")), "no such file"),
    "third party a list": (_mutate_manifest(_set(["outputs", 0, "third_party"], [])), "must be a file name"),
    "truncated .npy": (_actual_npy(_truncated_npy), "truncated"),
    "pickled .npy": (_actual_npy(_pickled_npy), "never unpickled"),
    "garbage .npy": (_actual_npy(lambda p, c: p.write_bytes(b"\x93NUMPY\x01\x00" + b"\xff" * 40)), ".npy"),
    "empty .npy": (_actual_npy(lambda p, c: p.write_bytes(b"")), ".npy"),
    "record .npy": (_actual_npy(lambda p, c: np.save(p, np.zeros((4, 4), dtype=[("a", "<f4")]))), "records"),
    "fortran .npy": (_actual_npy(lambda p, c: np.save(p, np.asfortranarray(np.zeros((4, 4), "<f4")))),
                     "Fortran-ordered"),
    "actual a directory": (lambda case, m: [str(case)], "not a regular file"),
}


@pytest.mark.parametrize("name", list(VERIFY_CASES))
def test_verify_answers_a_malformed_case_in_one_line(base_case, tmp_path, capsys, name):
    mutate, fragment = VERIFY_CASES[name]
    case, manifest = _copy_case(base_case, tmp_path)
    actual = mutate(case, manifest)
    rc, out, err = _run(["verify", str(case), *actual], capsys)
    _one_line_refusal(rc, out, err, fragment)
    assert not (case / "unpickled").exists()


GOLDEN_CASES = [
    (["hardswish", "--shape", "100000x100000"], "at most 2^31"),
    (["hardswish", "--shape", "4x4", "--seed", str(2 ** 70)], "--seed"),
    (["hardswish", "--shape", "4x4", "--seed", "-1"], "--seed"),
    (["hardswish", "--shape", "4x4", "--device", "meta"], "--device 'meta'"),
    (["hardswish", "--shape", "4x4", "--device", "no-such-device"], "--device"),
    (["hardswish", "--shape", "4x4", "--device", "cuda:99"], "--device cuda:99"),
    (["embedding_dense_backward", "--shape", "4x4", "--num-weights", "0"], "--num-weights must be >= 1"),
    (["embedding_dense_backward", "--shape", "4x4", "--num-weights", str(2 ** 70)], "--num-weights"),
    (["moe_token_permute", "--shape", "8x4", "--experts", str(2 ** 70)], "--experts"),
    (["layer_norm_grad_beta", "--shape", "3"], "at least two sizes"),
    (["layer_norm", "--shape", "3"], "at least two sizes"),
    (["rms_norm", "--shape", "3"], "at least two sizes"),
    (["hardswish", "--shape", ""], "expected sizes joined by 'x'"),
]


@pytest.mark.parametrize("argv,fragment", GOLDEN_CASES, ids=[" ".join(a)[:50] for a, _ in GOLDEN_CASES])
def test_golden_answers_a_bad_argument_in_one_line(tmp_path, capsys, argv, fragment):
    rc, out, err = _run(["golden", *argv, "--out", str(tmp_path / "c")], capsys)
    _one_line_refusal(rc, out, err, fragment)


def test_golden_memory_beyond_the_machine_is_refused_before_allocating(tmp_path, capsys, monkeypatch):
    """A shape under the 2^31 cap whose case cannot fit in the memory available is refused in one line (with
    overcommit the allocation succeeds and the OOM killer ends the process instead)."""
    from gradops.golden import cases

    monkeypatch.setattr(cases, "BYTES_PER_ELEMENT", 1 << 40)
    rc, out, err = _run(["golden", "hardswish", "--shape", "4x4", "--out", str(tmp_path / "c")], capsys)
    _one_line_refusal(rc, out, err, "GiB available")


def test_verify_json_is_strict_json(base_case, tmp_path, capsys):
    """A NaN where the golden is finite makes MARE and the ratios infinite: --json prints null, not Infinity."""
    case, _ = _copy_case(base_case, tmp_path)
    bad = np.fromfile(case / "golden_out.bin", dtype="<f4")
    bad[3] = np.nan
    bad.tofile(case / "bad.bin")
    rc, out, _ = _run(["verify", str(case), str(case / "bad.bin"), "--json"], capsys)
    assert rc == 1  # FAIL stays exit 1

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    record = json.loads(out, parse_constant=refuse)
    assert record["passed"] is False and record["outputs"][0]["errors"]["mare"] is None


def test_the_real_command_line_prints_no_traceback(base_case, tmp_path):
    """The real command (python -m gradops), not main(): a pickled .npy given to verify and --device meta given to
    golden each end with one line on stderr and exit 2."""
    case, _ = _copy_case(base_case, tmp_path)
    np.save(tmp_path / "p.npy", np.array([{"a": 1}] * 16, dtype=object).reshape(4, 4), allow_pickle=True)
    for argv in (["verify", str(case), str(tmp_path / "p.npy")],
                 ["golden", "hardswish", "--shape", "4x4", "--device", "meta", "--out", str(tmp_path / "x")]):
        done = subprocess.run([sys.executable, "-m", "gradops", *argv], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout, done.stderr


def test_make_takes_numpy_integers_and_refuses_other_numbers():
    """The Python API: numpy / torch integers are sizes and seeds; floats, bools and out-of-range seeds are
    CaseErrors (torch raised a RuntimeError for a seed of 2^70)."""
    from gradops.golden import CaseError

    case = make("hardswish", (np.int64(4), torch.tensor(3)), "float32", seed=np.int64(2))
    assert case.outputs["out"].shape == (4, 3)
    for shape, seed in (((4.0, 3), 0), ((True, 3), 0), (5, 0), ((4, 3), 1.5), ((4, 3), 2 ** 70), ((4, 3), -1)):
        with pytest.raises(CaseError, match=r"--shape|--seed"):
            make("hardswish", shape, "float32", seed=seed)
