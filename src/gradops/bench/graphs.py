"""``gradops bench --cuda-graphs``: does a patched model's training step capture in a CUDA graph and replay to the
eager step's results?

For each model of :data:`gradops.bench.models.MODELS` (Llama, Qwen3-MoE) and dtype, on CUDA:

- ``torch.cuda.graph``: the forward and backward of one step (loss and every parameter's gradient) captured after
  warm-up steps on a side stream (PyTorch's whole-network recipe), replayed, and compared with the same step run
  eagerly on a copy of the model;
- ``reduce-overhead``: the same step's forward under ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA
  graphs, forward and backward), three calls, the last one compared.

The ``torch.cuda.graph`` rows run for the gradops-patched model and, as the control that says the harness itself
captures, for the unpatched transformers model; ``reduce-overhead`` (a whole-step compile, the slow row) for the
patched Llama in the first dtype. A capture fails where something in the step synchronises with the host (a ``.item()``,
a device-to-host copy, a data-dependent shape) or allocates outside the graph's pool; the record keeps the error's
first line. "Replays to the eager results" means every gradient within :data:`TOLERANCE` of the eager step's
(bits are not required: cuBLAS may pick another algorithm inside a capture); ``bitwise`` says whether they were
equal. Records go to ``cuda-graphs-<date>.jsonl``; ``--dry-run`` is refused (CUDA graphs need a device).
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Callable
from pathlib import Path

import torch

from .models import DEFAULT_DTYPES, DTYPES, MODELS

#: (rtol, atol) of a replayed gradient against the eager step's, per dtype: a few units in the last place of the
#: largest gradients, where a reordered matmul reduction moves them.
TOLERANCE = {torch.float32: (1e-4, 1e-6), torch.bfloat16: (2e-2, 1e-4)}
#: (batch, sequence) of a captured step: a short step, so the check costs seconds.
TOKENS = (2, 128)
WARMUP = 3


def _model(name: str, dtype: torch.dtype, device: torch.device, patched: bool) -> torch.nn.Module:
    import transformers

    import gradops

    config_cls, model_cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs, max_position_embeddings=4096)
    model = getattr(transformers, model_cls)(config).to(device, dtype)
    if patched:
        gradops.patch(model)
    return model


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _eager(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = _loss(model, ids)
    loss.backward()
    return loss.detach().clone(), _grads(model)


def _graphed(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One step captured with ``torch.cuda.graph`` and replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            model.zero_grad(set_to_none=True)
            _loss(model, ids).backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = _loss(model, ids)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    return loss.detach().clone(), _grads(model)


def _compiled(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step under ``torch.compile(mode="reduce-overhead")``, third call."""
    step = torch.compile(lambda: _loss(model, ids), mode="reduce-overhead")
    loss = None
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        loss = step()
        loss.backward()
    torch.cuda.synchronize()
    return loss.detach().clone(), _grads(model)


def _compare(ref: tuple[torch.Tensor, list[torch.Tensor]], got: tuple[torch.Tensor, list[torch.Tensor]],
             dtype: torch.dtype) -> dict:
    rtol, atol = TOLERANCE[dtype]
    pairs = [(ref[0], got[0]), *zip(ref[1], got[1])]
    worst = max(float((a.float() - b.float()).abs().max()) if a.numel() else 0.0 for a, b in pairs)
    return {"replays": all(torch.allclose(b.float(), a.float(), rtol=rtol, atol=atol) for a, b in pairs),
            "bitwise": all(torch.equal(a, b) for a, b in pairs), "max_abs_diff": worst}


MODES: dict[str, Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]] = {
    "cuda.graph": _graphed, "reduce-overhead": _compiled}


def check_one(name: str, dtype: torch.dtype, mode: str, patched: bool, device: torch.device) -> dict:
    """One row: capture ``name`` in ``dtype`` by ``mode``; the comparison, or the failure's first line."""
    model = _model(name, dtype, device, patched)
    ids = torch.randint(0, MODELS[name][2]["vocab_size"], TOKENS, device=device,
                        generator=torch.Generator(device=device).manual_seed(0))
    reference = _eager(copy.deepcopy(model), ids)
    try:
        got = MODES[mode](model, ids)
    except Exception as err:  # a capture that fails is this check's finding, not the run's end
        first = (str(err).strip().splitlines() or [""])[0]
        return {"replays": False, "error": f"{type(err).__name__}: {first}"[:400]}
    return _compare(reference, got, dtype)


def cases(dtypes: list[str]) -> list[tuple[str, str, str, bool]]:
    """(model, dtype, mode, patched) in the order they run: every ``torch.cuda.graph`` row first (seconds each), then
    the one ``reduce-overhead`` row (a compile of the whole step, tens of seconds: the patched Llama in the first
    dtype), so that a run stopped by its time limit keeps the captures it made."""
    rows = [(name, dname, "cuda.graph", patched) for name in MODELS for dname in dtypes for patched in (True, False)]
    return [*rows, ("llama", dtypes[0], "reduce-overhead", True)]


def run(device: torch.device, dtypes: list[str] | None, results: Path | None, env: dict) -> int:
    """Print the table; append the records under ``results`` unless None. Returns 1 where a gradops row fails."""
    if device.type != "cuda":
        raise ValueError("CUDA graphs need a CUDA device")
    dtypes = dtypes or DEFAULT_DTYPES["cuda"]
    print(f"CUDA-graph capture of a training step on {env['device_name']}: torch {env['torch']}, tokens {TOKENS}")
    print(f"{'model':10s} {'dtype':5s} {'mode':15s} {'side':12s} result")
    failed = False
    for name, dname, mode, patched in cases(dtypes):
        got = check_one(name, DTYPES[dname], mode, patched, device)
        side = "gradops" if patched else "transformers"
        failed |= patched and not got["replays"]
        text = ("replays (bitwise)" if got.get("bitwise") else
                f"replays (max |diff| {got['max_abs_diff']:.3g})" if got["replays"] else
                got.get("error") or f"differs (max |diff| {got['max_abs_diff']:.3g})")
        print(f"{name:10s} {dname:5s} {mode:15s} {side:12s} {text}", flush=True)
        if results is not None:  # row by row: a run stopped by a time limit keeps what it found
            rec = {**env, "bench": "cuda-graphs", "model": name, "dtype": dname, "mode": mode, "side": side,
                   "tokens": list(TOKENS), **got}
            results.mkdir(parents=True, exist_ok=True)
            with (results / f"cuda-graphs-{datetime.date.today().isoformat()}.jsonl").open("a") as f:
                f.write(json.dumps(rec) + "\n")
    return 1 if failed else 0
