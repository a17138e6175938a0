"""``gradops bench --models``: whole Hugging Face transformers models, forward + backward, patched vs not.

What an LLM / MoE user sees: one training step (forward, loss, backward) of a tiny-but-not-toy transformers model
built from its config (random weights, nothing downloaded), for

- ``gradops``: the model after ``gradops.patch`` (norms, embedding, and for MoE the "gradops" experts),
- ``transformers``: the same model unpatched, with transformers' default experts implementation
  (``grouped_mm``),
- for MoE models each other experts implementation transformers ships that runs here (``batched_mm``,
  ``eager``), so that "best transformers" is the fastest of them, measured in the same run.

All providers run interleaved, round after round (:func:`gradops.bench.timing.time_cpu`), from identical weights
and the same batch. Writes ``models-<device>-<date>.jsonl``. Needs ``pip install 'transformers>=5.23'``.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Callable
from pathlib import Path

import torch

#: name -> (config class, model class, config). hidden 512, 4 layers; the MoE has 8 experts, top-2.
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4,
               "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 384,
                   "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                   "num_experts": 8, "num_experts_per_tok": 2}),
}
#: (batch, sequence) of the CPU and GPU steps.
TOKENS = {"cpu": (2, 256), "cuda": (8, 1024)}
_DRY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
#: ``--dry-run``: the same model classes at toy sizes, one step each on (batch, sequence) DRY_TOKENS, nothing timed.
DRY_MODELS = {"llama": (MODELS["llama"][0], MODELS["llama"][1], _DRY),
              "qwen3_moe": (MODELS["qwen3_moe"][0], MODELS["qwen3_moe"][1],
                            {**_DRY, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2})}
DRY_TOKENS = (1, 16)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: dtypes timed unless --dtype says otherwise. Not bf16 on the CPU: torch's bf16 matmuls there run ~20x slower
#: than fp32 without AMX (a Qwen3-MoE experts block: 1.1 s vs 45 ms at 512 tokens), so the row would time them.
DEFAULT_DTYPES = {"cpu": ["fp32"], "cuda": ["bf16", "fp32"]}
#: transformers' experts implementations timed beside the default ("grouped_mm").
OTHER_EXPERTS = ("batched_mm", "eager")
#: A provider whose probe step takes more than this many times the fastest one's is not timed in rounds.
SLOW = 5


def build(name: str, dtype: torch.dtype, device: torch.device, table: dict | None = None
          ) -> dict[str, torch.nn.Module]:
    """provider -> model, all from one set of random weights (``table``: the model configs, default
    :data:`MODELS`)."""
    import transformers

    import gradops
    from gradops.transformers import is_experts

    config_cls, model_cls, kwargs = (table or MODELS)[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**kwargs, max_position_embeddings=4096)
    base = getattr(transformers, model_cls)(config).to(device, dtype)
    ours = copy.deepcopy(base)
    gradops.patch(ours)
    models = {"gradops": ours, "transformers": base}
    if any(is_experts(m) for m in base.modules()):
        for impl in OTHER_EXPERTS:
            other = copy.deepcopy(base)
            other.set_experts_implementation(impl)
            models[f"transformers {impl}"] = other
    return models


def _probe(steps: dict[str, Callable[[], None]], device: torch.device, failures: dict[str, str]) -> dict[str, float]:
    """One warm-up and one timed step of each provider, ms; a peer that fails goes to ``failures``."""
    import time

    out = {}
    for k, fn in steps.items():
        try:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            out[k] = (time.perf_counter() - start) * 1e3
        except Exception as err:
            if k == "gradops":
                raise
            failures[k] = f"{type(err).__name__}: {err}"[:300]
    return out


def step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    params = list(model.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        model(input_ids=ids, labels=ids).loss.backward()

    return run


def run(device: torch.device, dtypes: list[str], reps: int, budget_s: float, results: Path | None,
        env: dict, dry: bool = False) -> int:
    """Print the whole-model table; write JSONL under ``results`` unless None. ``dry``: :data:`DRY_MODELS`, each
    provider's step once, nothing timed (``--dry-run``)."""
    from .timing import time_cpu, time_cuda

    try:
        import transformers
    except ImportError:
        print("gradops bench --models: needs transformers (pip install 'transformers>=5.23')")
        return 2
    if dry:
        return _dry(device, dtypes, results, env, transformers.__version__)
    timer = time_cuda if device.type == "cuda" else time_cpu
    batch, seq = TOKENS[device.type]
    head = (f"{'model':<10} {'dtype':<5} {'tokens':>6} {'gradops ms':>10} {'transformers ms':>15} {'ratio':>6} "
            f"{'best transformers':>26} {'ratio':>6}")
    print(f"gradops bench --models on {env['device_name']}: torch {env['torch']}, transformers "
          f"{transformers.__version__}, backend {env['gradops_backend']}; one step (forward, loss, backward), "
          f"median ms; ratio gradops / transformers (below 1: gradops faster)", flush=True)
    print(head + "\n" + "-" * len(head), flush=True)
    rows = []
    for name in MODELS:
        for dname in dtypes:
            models = build(name, DTYPES[dname], device)
            ids = torch.randint(0, MODELS[name][2]["vocab_size"], (batch, seq),
                                generator=torch.Generator().manual_seed(1)).to(device)
            failures: dict[str, str] = {}
            steps = {k: step(m, ids) for k, m in models.items()}
            probe = _probe(steps, device, failures)
            # A backend many times slower than the fastest (batched_mm on the CPU: 36 s a step, it gathers every
            # copy's expert weight matrices) would eat the rounds of the others: its one probe step stands.
            slow = {k: v for k, v in probe.items() if v > SLOW * min(probe.values())}
            timings = timer({k: f for k, f in steps.items() if k in probe and k not in slow}, reps, budget_s,
                            failures=failures)
            for k, why in failures.items():
                print(f"  ({name} {k}: {why})", flush=True)
            ms = {**{k: t.median_ms for k, t in timings.items()}, **slow}
            for k in slow:
                print(f"  ({name} {k}: {slow[k]:.0f} ms in one step, over {SLOW}x the fastest: not in the rounds)",
                      flush=True)
            peers = {k: v for k, v in ms.items() if k.startswith("transformers")}
            best = min(peers, key=peers.__getitem__)
            base = ms["transformers"]
            print(f"{name:<10} {dname:<5} {batch * seq:>6} {ms['gradops']:>10.1f} {base:>15.1f} "
                  f"{ms['gradops'] / base:>6.3f} {f'{peers[best]:.1f} ({best})':>26} "
                  f"{ms['gradops'] / peers[best]:>6.3f}", flush=True)
            rows.append({**env, "bench": "models", "model": name, "dtype": dname, "batch": batch, "seq": seq,
                         "transformers": transformers.__version__,
                         **{f"{k.replace(' ', '_')}_ms": round(v, 3) for k, v in ms.items()},
                         "best_transformers": best, "ratio": float(f"{ms['gradops'] / base:.4g}"),
                         "ratio_best": float(f"{ms['gradops'] / peers[best]:.4g}")})
            del models
    if results is not None and rows:
        path = results / f"models-{device.type}-{datetime.date.today().isoformat()}.jsonl"
        results.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"\nwrote {path}")
    return 0


def _dry(device: torch.device, dtypes: list[str], results: Path | None, env: dict, version: str) -> int:
    """``--models --dry-run``: every provider's training step once on :data:`DRY_MODELS`; records say what ran."""
    batch, seq = DRY_TOKENS
    print(f"gradops bench --models --dry-run (no times) on {env['device_name']}: torch {env['torch']}, "
          f"transformers {version}; toy configs, one step each", flush=True)
    rows = []
    for name, (_, _, config) in DRY_MODELS.items():
        for dname in dtypes:
            models = build(name, DTYPES[dname], device, DRY_MODELS)
            ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1))
            failures: dict[str, str] = {}
            ran = []
            for k, m in models.items():
                try:
                    step(m, ids.to(device))()
                    ran.append(k)
                except Exception as err:
                    if k == "gradops":
                        raise
                    failures[k] = f"{type(err).__name__}: {err}"[:300]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            print(f"{name:<10} {dname:<5} ran {', '.join(ran)} once (dry run: no times)"
                  + "".join(f"\n  ({name} {k}: {why})" for k, why in failures.items()), flush=True)
            rows.append({**env, "bench": "models", "model": name, "dtype": dname, "batch": batch, "seq": seq,
                         "transformers": version, "ran": ran, **({"failed": failures} if failures else {})})
            del models
    if results is not None and rows:
        path = results / f"models-{device.type}-{datetime.date.today().isoformat()}.jsonl"
        results.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"\nwrote {path}")
    return 0
