"""gradops on the dense SwiGLU MLPs of Hugging Face transformers models (Llama, Mistral, Qwen2/3, the dense and
shared MLPs of MoE models): ``gradops.patch`` swaps every MLP class whose forward is Llama's
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; with SiLU and plain bias-free projections its gate runs on
``gradops.swiglu`` over one (..., 2I) tensor the two projections are written into (``gate_up``), anything else keeps
the class's forward. Tiny random-init configs, nothing downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import gradops  # noqa: E402
from gradops import transformers as hf  # noqa: E402

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 32}
#: model -> (config class, model class, extra config, the MLP class and how many of them the patch swaps)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ("LlamaMLP", 2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, ("MistralMLP", 2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ("Qwen2MLP", 2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, ("Qwen3MLP", 2)),
    # a dense first layer and one shared expert beside the routed ones: two MLPs of the same class
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {"num_experts_per_tok": 2, "n_routed_experts": 8, "n_shared_experts": 1,
                     "moe_intermediate_size": 16, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                     "kv_lora_rank": 16, "q_lora_rank": 16, "head_dim": 4, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
                     "v_head_dim": 8},
                    ("DeepseekV3MLP", 2)),
}
GATE_OPS = {"gradops::gate_up", "gradops::swiglu"}


@pytest.fixture(autouse=True)
def fused_at_every_size(monkeypatch):
    """The tiny models here are far below the size from which the fused gate runs (FUSED_MIN_ITEMS): take it at
    every size, except where a test says otherwise."""
    monkeypatch.setattr(hf, "FUSED_MIN_ITEMS", 0)


def _pair(name, **config):
    config_cls, model_cls, extra, _ = MODELS[name]
    torch.manual_seed(0)
    ref = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**TINY, **extra, **config}))
    return ref, copy.deepcopy(ref)


def _ids(seed=1, shape=(2, 8)):
    return torch.randint(0, TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def _ops(model, ids):
    """The loss and gradients of one step, and the gradops ops it ran."""
    with torch.profiler.profile() as prof:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss, {e.name for e in prof.events() if e.name.startswith("gradops::")}


@pytest.mark.parametrize("name", list(MODELS))
def test_dense_mlps_run_their_gate_on_swiglu(name):
    """Every Llama-style MLP is swapped (the report names it), its gate runs on gate_up + swiglu (swiglu_grad in
    the backward), and the loss and every gradient equal the unpatched model's to float32 rounding."""
    ref, ours = _pair(name)
    cls, count = MODELS[name][3]
    report = gradops.patch(ours)
    assert report.counts().get(cls) == count, str(report)
    assert f"gradops.transformers.{cls}(swiglu gate, 32 -> 2 x" in str(report)
    ids = _ids()
    loss, ran = _ops(ours, ids)
    assert GATE_OPS | {"gradops::swiglu_grad"} <= ran
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (pname, a), b in zip(ours.named_parameters(), ref.parameters()):
        scale = float(b.grad.abs().max())
        assert float((a.grad - b.grad).abs().max()) <= 1e-5 * max(scale, 1e-6), pname
    assert len(gradops.patch(ours)) == 0  # idempotent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gate_up_is_the_two_projections_side_by_side(dtype):
    """gate_up(x, W_gate, W_up) = [x W_gate^T, x W_up^T] (the matmuls F.linear runs, writing into the halves of one
    tensor), for 2-D and 3-D x; its fake, schema and autograd pass torch.library.opcheck."""
    g = torch.Generator().manual_seed(3)
    for shape in [(5, 32), (2, 3, 32)]:
        x = torch.randn(shape, generator=g).to(dtype)
        wg, wu = (torch.randn(24, 32, generator=g).to(dtype) for _ in range(2))
        got = hf.gate_up(x, wg, wu)
        assert got.shape == (*shape[:-1], 48) and got.is_contiguous()
        torch.testing.assert_close(got, torch.cat([F.linear(x, wg), F.linear(x, wu)], -1), rtol=0, atol=0)
        args = (x.requires_grad_(), wg.requires_grad_(), wu.requires_grad_())
        torch.library.opcheck(hf.gate_up, args)
        upstream = torch.randn(got.shape, generator=g).to(dtype)
        ours = torch.autograd.grad(hf.gate_up(*args), args, upstream)
        theirs = torch.autograd.grad(torch.cat([F.linear(x, wg), F.linear(x, wu)], -1), args, upstream)
        wide = [t.detach().double().requires_grad_() for t in args]
        exact = torch.autograd.grad(torch.cat([F.linear(wide[0], wide[1]), F.linear(wide[0], wide[2])], -1), wide,
                                    upstream.double())
        # The same products, summed in another order (dx = dG W_gate + dU W_up in one addmm, where autograd adds the
        # two linears' dx): no further from the float64 gradient than F.linear's, to a factor 2 and the dtype's eps.
        for a, b, e in zip(ours, theirs, exact):
            eps = torch.finfo(dtype).eps * float(e.abs().max())
            assert float((a.double() - e).abs().max()) <= 2 * float((b.double() - e).abs().max()) + eps


def test_mlps_outside_the_fused_form_keep_their_forward():
    """Biased projections (mlp_bias=True), another activation, a projection that is not a plain Linear (a LoRA-like
    wrapper): the class is swapped but its forward is transformers' own, bit for bit; the gate ops do not run."""
    ids = _ids()
    for change in ("bias", "gelu", "wrapped"):
        ref, ours = _pair("llama", **({"mlp_bias": True} if change == "bias" else {}))
        for model in (ref, ours):
            for layer in model.model.layers:
                if change == "gelu":
                    layer.mlp.act_fn = torch.nn.GELU()
                if change == "wrapped":
                    layer.mlp.up_proj = torch.nn.Sequential(layer.mlp.up_proj)
        gradops.patch(ours)
        assert all(type(layer.mlp).__module__ == "gradops.transformers" for layer in ours.model.layers)
        loss, ran = _ops(ours, ids)
        assert not GATE_OPS & ran, change
        assert torch.equal(loss, ref(input_ids=ids, labels=ids).loss), change


def test_small_calls_keep_the_original_forward(monkeypatch):
    """Below FUSED_MIN_ITEMS (rows x intermediate size) a swapped MLP runs its class's own forward."""
    monkeypatch.setattr(hf, "FUSED_MIN_ITEMS", 2 * 8 * 64 + 1)  # one more than the call's rows x I
    ref, ours = _pair("llama")
    gradops.patch(ours)
    ids = _ids()
    loss, ran = _ops(ours, ids)
    assert not GATE_OPS & ran
    assert torch.equal(loss, ref(input_ids=ids, labels=ids).loss)
    monkeypatch.setattr(hf, "FUSED_MIN_ITEMS", 2 * 8 * 64)
    assert GATE_OPS <= _ops(ours, ids)[1]


def test_an_mlp_with_another_forward_is_left_alone_and_named():
    from transformers.models.llama import modeling_llama

    class OddMLP(modeling_llama.LlamaMLP):
        def forward(self, x):  # not Llama's formula
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))

    OddMLP.__module__ = "transformers.models.odd.modeling_odd"
    model = torch.nn.Sequential(OddMLP(transformers.LlamaConfig(**TINY)))
    report = gradops.patch(model)
    assert len(report) == 0 and type(model[0]) is OddMLP
    assert report.skipped[0][1] == "OddMLP" and "left alone" in report.skipped[0][2]


def test_autocast_runs_the_gate_in_the_autocast_dtype():
    """Under torch.autocast (bfloat16 on the CPU) the projections run in bfloat16, as F.linear would, and the gate on
    gradops.swiglu in bfloat16: the loss is transformers' autocast loss to bfloat16 rounding."""
    ref, ours = _pair("llama")
    gradops.patch(ours)
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ran = _ops(ours, ids)
        ref_loss = ref(input_ids=ids, labels=ids).loss
    assert GATE_OPS <= ran
    torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=2e-2, atol=2e-2)
    for a in ours.parameters():
        assert a.grad is not None and a.grad.dtype == a.dtype


def test_register_then_load_by_name_swaps_the_mlps():
    from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping

    before = set(get_patch_mapping())
    hf.register(mlps=["qwen3"])
    added = sorted(set(get_patch_mapping()) - before)
    try:
        assert added == ["Qwen3MLP"]
        config_cls, _, extra, _ = MODELS["qwen3"]
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**{**TINY, **extra}))
    finally:
        unregister_patch_mapping(added)
    mlps = [m for m in model.modules() if type(m).__name__ == "Qwen3MLP"]
    assert len(mlps) == 2 and all(type(m).__module__ == "gradops.transformers" for m in mlps)
    assert GATE_OPS <= _ops(model, _ids())[1]


@pytest.mark.compile
def test_torch_compile_takes_the_patched_mlp_whole():
    """torch.compile(fullgraph=True) of a patched MLP: gate_up and swiglu are custom ops in the graph, and the
    forward and backward equal eager's."""
    ref, _ = _pair("llama")
    mlp = ref.model.layers[0].mlp
    gradops.patch(mlp)
    x = torch.randn(2, 8, 32, requires_grad=True)
    eager = mlp(x)
    (eager_grad,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(mlp, fullgraph=True)
    got = compiled(x)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, eager_grad, rtol=1e-6, atol=1e-6)
