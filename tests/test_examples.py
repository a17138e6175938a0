"""The Python ports of the seeds' C examples (examples/cann/): each runs as its own process, and the values it
prints match the float64 oracle of the seed's inputs.

Each process costs ~3 s (interpreter and torch start-up). They run the pure-torch backend
(GRADOPS_BACKEND=torch): what is under test is the ported call sequence (the CPU kernels run the same aclnn
calls in test_aclnn.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradops.ascendc import GetLayerNormGradBetaMaxMinTmpSize, GetLayerNormGradBetaNDTilingInfo
from oracles import oracle, tolerance

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "cann"
LINE = re.compile(r"^(?P<label>[A-Za-z ]+)\[(?P<index>\d+)\] is: (?P<value>-?\d+\.\d{6})$")
PRINTED = 0.5e-6  # "%f" keeps 6 decimals


def run_example(name: str) -> tuple[dict[str, list[float]], str]:
    """Run ``examples/cann/<name>.py`` on the CPU; returns the printed values per label (in order) and stdout."""
    env = {**os.environ, "GRADOPS_BACKEND": "torch"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    values: dict[str, list[float]] = {}
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if m:
            values.setdefault(m["label"], []).append(float(m["value"]))
    return values, proc.stdout


def assert_printed(got: list[float], ref: torch.Tensor, dtype: torch.dtype, n: int) -> None:
    ref = ref.reshape(-1)
    assert len(got) == ref.numel()
    tol = tolerance(dtype, n, float(ref.abs().max())) + PRINTED
    err = (torch.tensor(got, dtype=torch.float64) - ref).abs().max().item()
    assert err <= tol, f"max error {err} > {tol}"


def test_rms_norm_grad_example():
    values, _ = run_example("rms_norm_grad")
    x = torch.arange(1, 33, dtype=torch.float32).reshape(2, 1, 16)
    dx, dgamma = oracle("rms_norm_grad", x, x, torch.tensor([1.0, 2.0]), torch.arange(1, 17, dtype=torch.float32))
    printed = values["result"]  # dx (32 values), then dgamma (16), both labelled "result" as in C
    assert_printed(printed[:32], dx, torch.float32, 16)
    assert_printed(printed[32:], dgamma, torch.float32, 2)


def test_embedding_dense_backward_example():
    values, _ = run_example("embedding_dense_backward")
    grad = torch.tensor([[1.0, 2, 3], [4, 5, 6]])
    (ref,) = oracle("embedding_dense_backward", grad, torch.tensor([1, 2]), 4, 0, False)
    assert_printed(values["resultData"], ref, torch.float32, 2)


def test_hardswish_backward_example():
    values, _ = run_example("hardswish_backward")
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    (ref,) = oracle("hardswish_backward", x, x)
    assert_printed(values["result"], ref, torch.float32, 1)
    assert values["result"][3] == pytest.approx(4.5, abs=PRINTED)  # CANN's closed interval at x = 3


def test_moe_token_permute_grad_example():
    values, _ = run_example("moe_token_permute_grad")
    grad = torch.tensor([[1.0, 2], [3, 4]], dtype=torch.bfloat16)
    (ref,) = oracle("moe_token_permute_grad", grad, torch.tensor([0, 1], dtype=torch.int32), 2)
    assert_printed(values["mean result"], ref, torch.bfloat16, 2)


def test_layer_norm_grad_beta_example():
    values, stdout = run_example("layer_norm_grad_beta")
    spec = importlib.util.spec_from_file_location("cann_lngb_example", EXAMPLES / "layer_norm_grad_beta.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    b, s, h = example.B, example.S, example.H
    _, low = GetLayerNormGradBetaMaxMinTmpSize([b, s, h, h], 2, False)
    tiling = GetLayerNormGradBetaNDTilingInfo([b, s, h, h], 2 * low, 2, False)
    assert f"loopRound={tiling.loopRound} " in stdout and tiling.loopRound > 1 and tiling.inputTailSize > 0
    dy, x, variance, mean, _ = (t.double() for t in example.make_inputs(torch.device("cpu")))
    xhat = (x - mean) / torch.sqrt(variance + example.EPSILON)
    terms = {"outputPdGamma": (dy * xhat).reshape(-1, h), "outputPdBeta": dy.reshape(-1, h)}
    eps16 = torch.finfo(torch.float16).eps
    for label, t in terms.items():
        ref = t.sum(0)
        # resForGamma is rounded to half (eps/2 per term) before a float32 sum of B*S rows ((n+1) u32), and
        # the result is rounded to half once more (eps/2 of the value).
        n = t.shape[0]
        tol = (eps16 / 2 + (n + 1) * 2.0 ** -24) * t.abs().sum(0) + eps16 / 2 * ref.abs() + PRINTED
        got = torch.tensor(values[label], dtype=torch.float64)
        assert got.shape == ref.shape and bool(((got - ref).abs() <= tol).all()), label


def test_the_mindspeed_moe_example_trains_like_its_twin():
    """examples/mindspeed_moe_layer.py: torch_npu's routing-map names on gradops, drop_and_pad off and on, against
    Megatron's unfused index ops; it exits 1 when losses or weights drift past float32 rounding."""
    script = EXAMPLES.parent / "mindspeed_moe_layer.py"
    proc = subprocess.run([sys.executable, str(script), "--steps", "4"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for mode in ("False", "True"):
        assert f"drop_and_pad={mode}: largest relative difference" in proc.stdout
