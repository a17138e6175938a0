"""gradops.patch on Hugging Face transformers models (issue 10, the RMSNorm families): tiny random-init configs,
nothing downloaded. The patched model's loss and every parameter's gradient equal the unpatched model's to float32
rounding, and gradops' ops really run."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gradops  # noqa: E402

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32}
#: model -> (config class, model class, the norm class patch must swap, how many, its style)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaRMSNorm", 5, "llama"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "MistralRMSNorm", 5, "llama"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3RMSNorm", 9, "llama"),  # + per-head q/k norms
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "GemmaRMSNorm", 5, "gemma"),
}


def _pair(name):
    config_cls, model_cls, *_ = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**TINY)
    ref = getattr(transformers, model_cls)(config)
    ours = getattr(transformers, model_cls)(config)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_model_matches_the_original(name):
    ref, ours = _pair(name)
    _, _, norm, count, style = MODELS[name]
    report = gradops.patch(ours)
    assert report.counts()[norm] == count, str(report)
    assert f"gradops.transformers.{norm}({style}-style" in str(report)
    assert all(type(m).__module__ == "gradops.transformers" for m in ours.modules() if type(m).__name__ == norm)
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.profiler.profile() as prof:
        loss = ours(input_ids=ids, labels=ids).loss
        loss.backward()
    names = {e.name for e in prof.events()}
    assert {"gradops::rms_norm", "gradops::rms_norm_grad"} <= names
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (pname, a), b in zip(ours.named_parameters(), ref.parameters()):
        scale = float(b.grad.abs().max())
        assert float((a.grad - b.grad).abs().max()) <= 1e-5 * max(scale, 1e-6), pname
    assert len(gradops.patch(ours)) == 0  # idempotent


def test_an_unknown_norm_formula_is_left_alone_and_named():
    from transformers.models.llama import modeling_llama

    class OddRMSNorm(modeling_llama.LlamaRMSNorm):
        def forward(self, hidden_states):  # not one of the two formulas
            return super().forward(hidden_states) * 2

    OddRMSNorm.__module__ = "transformers.models.odd.modeling_odd"
    model = torch.nn.Sequential(OddRMSNorm(8))
    report = gradops.patch(model)
    assert len(report) == 0 and type(model[0]) is OddRMSNorm
    assert report.skipped[0][1] == "OddRMSNorm" and "not guessed" in report.skipped[0][2]


def test_dtypes_outside_cann_table_run_transformers_forward():
    """A float32 weight beside bfloat16 input: transformers returns float32, so gradops keeps its forward."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(2)
    norm = LlamaRMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    x = torch.randn(32, 64, generator=g).bfloat16()
    expected = norm(x)
    gradops.patch(torch.nn.Sequential(norm))
    got = norm(x)
    assert got.dtype == expected.dtype == torch.float32 and torch.equal(got, expected)
    norm.bfloat16()
    y = norm(x)  # now in CANN's table: gradops.rms_norm, normalised and scaled in float32, rounded once
    x64, w64 = x.double(), norm.weight.double()
    exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w64
    hf = w64.bfloat16() * (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert y.dtype == torch.bfloat16
    assert (y.double() - exact).abs().sum() <= (hf.double() - exact).abs().sum()  # one rounding, not two
