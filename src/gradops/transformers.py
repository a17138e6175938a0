"""Hugging Face ``transformers`` models on gradops: the RMSNorm families, the SwiGLU MLPs and the MoE experts.

Two ways in (both need ``pip install 'transformers>=5.23,<5.25'``, the ``transformers`` extra; tested against
transformers 5.23.0 and 5.24.0):

- ``gradops.patch(model)`` on a model already built: swaps its norms and Llama-style MLPs in place (below) and
  switches its MoE experts to the ``"gradops"`` experts implementation (:func:`register` runs first, once), whose
  SiLU gate is :func:`gradops.swiglu`;
- ``gradops.transformers.register(norms=True, mlps=True)`` before ``from_pretrained`` / ``from_config``: the
  experts implementation is then loadable by name (``experts_implementation="gradops"``) and transformers' own
  patch mapping builds the norm and MLP classes as gradops' subclasses.

The norms: every transformers RMSNorm whose code is one of three formulas transformers uses is swapped,
recognised by its code (an AST without comments, docstring or annotations, including the ``_norm`` helper some
call) rather than by class name: a model's norm class is a copy of one of them ("# Copied from"), or it is
something else and is left alone, named in the report, never guessed.

- Llama-style (138 classes in 5.23.0: Llama, Mistral, Qwen2/3 and their per-head q/k norms, Mixtral, Qwen3-MoE,
  OLMoE, DeepSeek-V3, ...): ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``;
- Gemma-style: ``(x_f32 * rsqrt(mean(x_f32^2) + eps) * (1 + weight_f32)).to(x.dtype)``;
- GPT-OSS-style (T5's order: GPT-OSS, AFMoE, ...): ``(weight * x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``.

All run on :func:`gradops.rms_norm` (aclnnRmsNorm forward, aclnnRmsNormGrad backward), normalising in float32
and rounding once to x's dtype: the Gemma formula (the weight becomes ``1 + weight`` in float32) and the GPT-OSS
formula exactly. For the Llama formula in float32 the two orders give the same result to float32 rounding; in
half precision transformers rounds the normalised x to x's dtype and then multiplies by the weight (a second
rounding), where gradops, as CANN's RmsNorm, multiplies in float32 and rounds once: closer to the float64 result,
not bitwise transformers'. A call whose dtypes CANN's table does not cover (float64, or for the Llama formula a
float32 weight beside half x, where transformers' result is float32) runs transformers' own forward unchanged.

The dense MLPs: every transformers MLP class whose forward is Llama's ``down_proj(act_fn(gate_proj(x)) *
up_proj(x))`` (recognised by its code, as the norms) computes, where act_fn is SiLU and both projections are plain
bias-free Linear layers, ``down_proj(swiglu(gate_up(x)))``: :func:`gate_up` writes the two projections into the
two halves of one tensor, and :func:`gradops.swiglu` (aclnnSwiGlu, backward aclnnSwiGluGrad) gives ``silu(gate) *
up`` from it in one pass, in float32, rounding once. Anything else (another activation, biases, LoRA or quantized
layers, DTensor shards, dtypes outside CANN's, calls below :data:`FUSED_MIN_ITEMS`) runs the class's own forward.

The experts (:func:`experts_forward`): transformers' ``"grouped_mm"`` implementation with gradops' token
movement: :func:`gradops.moe_token_permute` groups the token copies by expert (its backward is
aclnnMoeTokenPermuteGrad: a fixed-order sum per token, no scatter-add), transformers' own grouped matmul
dispatcher runs the experts (so a comparison with ``"grouped_mm"`` measures exactly the token movement), and
:func:`gradops.moe_token_unpermute` weights and merges each token's K results in one pass in float32, rounding
once (``"grouped_mm"`` materialises the weighted copies, gathers them back into token order, then sums).

Expert parallelism (transformers' ``DistributedConfig(ep_size=N)``): the experts implementation runs inside
transformers' exchanges, and :func:`register` adds ``ep_implementation="gradops"`` (:func:`expert_parallel_class`),
an exchange on :mod:`gradops.distributed` that hands the experts rows already grouped by expert.

Nothing here imports ``transformers`` unless the model being patched already did or :func:`register` is called.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Iterable

import torch
from torch import Tensor

from . import _compat, ops
from .families.rms_norm.contract import DTYPE_TABLE as RMS_NORM_DTYPES

#: The experts implementation name gradops registers in transformers' ``ALL_EXPERTS_FUNCTIONS``.
EXPERTS = "gradops"
#: The expert-parallel implementation name gradops registers in transformers' ``EPImplementationInterface``.
EP = "gradops"
#: The model families whose RMSNorm classes ``register(norms=True)`` maps (their modeling modules are imported).
NORM_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                 "gemma3", "olmoe", "deepseek_v3", "gpt_oss")

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _source(fn: object) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return None


def _shape_of(fn: object) -> str | None:
    """A method's code without its comments, docstring and annotations (an AST dump): two copies of one formula
    match whatever their comments say, and nothing else does."""
    src = _source(fn)
    if src is None:
        return None
    try:
        node = ast.parse(src).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(node, ast.FunctionDef):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    args = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
    return repr(args) + ast.dump(ast.Module(body=body, type_ignores=[]))


def _fingerprint(cls: type) -> str | None:
    """The formula of an RMSNorm class: its forward and the ``_norm`` helper some of them call."""
    parts = [_shape_of(cls.forward), _shape_of(cls._norm) if hasattr(cls, "_norm") else "-"]
    return None if None in parts else "\n".join(parts)  # type: ignore[arg-type]


@functools.cache
def _templates() -> dict[str, str]:
    """The formula of transformers' own Llama, Gemma and GPT-OSS RMSNorm -> style."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = {}
    for cls, style in ((LlamaRMSNorm, "llama"), (GemmaRMSNorm, "gemma"), (GptOssRMSNorm, "gpt_oss")):
        # Inside transformers' apply_patches() the module attribute may be a replacement class (gradops' own or
        # another library's): the formula is that of the transformers class it derives from.
        origin = next((c for c in cls.__mro__ if c.__module__.startswith("transformers.")), None)
        key = None if origin is None else _fingerprint(origin)
        if key is not None:
            out[key] = style
    return out


def rms_norm_style(cls: type) -> str | None:
    """``"llama"``, ``"gemma"`` or ``"gpt_oss"`` for a transformers RMSNorm class whose forward is that formula
    (comments and annotations aside), else None."""
    if not cls.__module__.startswith("transformers."):
        return None
    return _templates().get(_fingerprint(cls) or "")


def _llama_forward(self, hidden_states: Tensor) -> Tensor:
    if hidden_states.dtype not in _FLOATS or self.weight.dtype != hidden_states.dtype:
        return super(type(self), self).forward(hidden_states)
    return ops.rms_norm(hidden_states, self.weight, float(self.variance_epsilon))[0]


def _gemma_forward(self, x: Tensor) -> Tensor:
    if x.dtype not in _FLOATS:
        return super(type(self), self).forward(x)
    return ops.rms_norm(x, 1.0 + self.weight.float(), float(self.eps))[0]


def _gpt_oss_forward(self, hidden_states: Tensor) -> Tensor:
    if (hidden_states.dtype, self.weight.dtype) not in RMS_NORM_DTYPES:
        return super(type(self), self).forward(hidden_states)
    return ops.rms_norm(hidden_states, self.weight, float(self.variance_epsilon))[0]


_FORWARDS = {"llama": _llama_forward, "gemma": _gemma_forward, "gpt_oss": _gpt_oss_forward}
_EPS_ATTR = {"llama": "variance_epsilon", "gemma": "eps", "gpt_oss": "variance_epsilon"}


@functools.cache
def gradops_class(cls: type) -> type | None:
    """The in-place replacement of transformers RMSNorm class ``cls`` (a subclass whose forward runs
    :func:`gradops.rms_norm`), or None when its code is none of the known formulas."""
    style = rms_norm_style(cls)
    if style is None:
        return None
    return type(cls.__name__, (cls,), {"forward": _FORWARDS[style], "__module__": __name__,
                                       "gradops_style": style,
                                       "__doc__": f"{cls.__name__} ({style}-style) on gradops.rms_norm."})


def describe(module: torch.nn.Module) -> str:
    """The report detail of a swapped norm: its style, width and epsilon."""
    style = type(module).gradops_style  # type: ignore[attr-defined]
    return f"{style}-style, {tuple(module.weight.shape)}, eps={getattr(module, _EPS_ATTR[style])}"


# ---------------------------------------------------------------- the dense SwiGLU MLP (Llama, Qwen2/3, Mistral, ...)
#
# transformers' Llama-style MLP computes ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: two matmuls, then SiLU
# of the gate and the product, two elementwise passes whose backward autograd records as three more (two products
# and SiLU's derivative), keeping silu(gate) beside gate and up. gradops runs
# the gate on aclnnSwiGlu, whose input is ONE tensor holding both halves: the two projections are written into the
# two halves of one (..., 2I) tensor by two matmuls with the output's row stride (:func:`gate_up`: the same GEMMs,
# no copy of x, of the weights or of the activations), then :func:`gradops.swiglu` (one pass forward, one fused
# aclnnSwiGluGrad backward) gives ``silu(gate) * up``. Joining the weights instead (``cat([W_gate, W_up])`` per
# forward) copies 2·I·H weights per call, more than the GEMM itself costs at small token counts; a fused gate_up
# parameter would change the model's parameters and checkpoints.


@torch.library.custom_op("gradops::gate_up", mutates_args=())
def gate_up(x: Tensor, gate_weight: Tensor, up_weight: Tensor) -> Tensor:
    """``[x @ gate_weight.T, x @ up_weight.T]`` along the last dim: x (..., H), the weights (I, H) -> (..., 2I), each
    half written in place by its own matmul (torch.mm into a view with the result's row stride: BLAS's leading
    dimension, no temporary)."""
    rows = x.reshape(-1, x.shape[-1])
    i = gate_weight.shape[0]
    out = rows.new_empty((rows.shape[0], i + up_weight.shape[0]))
    torch.mm(rows, gate_weight.t(), out=out[:, :i])
    torch.mm(rows, up_weight.t(), out=out[:, i:])
    return out.view(*x.shape[:-1], out.shape[1])


@gate_up.register_fake
def _gate_up_fake(x: Tensor, gate_weight: Tensor, up_weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], gate_weight.shape[0] + up_weight.shape[0]))


def _gate_up_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _gate_up_backward(ctx, grad: Tensor):
    """dx = dG @ W_gate + dU @ W_up, dW_gate = dG^T @ x, dW_up = dU^T @ x, with [dG, dU] the halves of ``grad``
    (views: the matmuls read them with their row stride)."""
    x, gate_weight, up_weight = ctx.saved_tensors
    rows = x.reshape(-1, x.shape[-1])
    d = grad.reshape(-1, grad.shape[-1])
    i = gate_weight.shape[0]
    d_gate, d_up = d[:, :i], d[:, i:]
    dx = d_gate_weight = d_up_weight = None
    if ctx.needs_input_grad[0]:
        dx = torch.addmm(torch.mm(d_gate, gate_weight), d_up, up_weight).view(x.shape)
    if ctx.needs_input_grad[1]:
        d_gate_weight = torch.mm(d_gate.t(), rows)
    if ctx.needs_input_grad[2]:
        d_up_weight = torch.mm(d_up.t(), rows)
    return dx, d_gate_weight, d_up_weight


gate_up.register_autograd(_gate_up_backward, setup_context=_gate_up_setup)
_compat.record_every_call(gate_up)  # the profiler names gradops::gate_up on torch 2.14 too


#: Rows x intermediate size from which an MLP call takes the fused gate. Below it the class's own forward runs: there
#: the GEMMs into strided halves (10-25% slower in MKL at 64 x 128 x 344) and two custom ops' dispatch outweigh what
#: the fused gate saves. Measured on the CPU (scripts/bench_mlp_gate.py, one thread, fwd + bwd of LlamaMLP,
#: benchmarks/results/mlp-gate-cpu-*.jsonl; transformers / gradops, fp32 and bf16): T x H x I = 16 x 64 x 128:
#: 0.58x / 0.67x, 64 x 128 x 344: 0.86x / 0.84x, 256 x 256 x 688: 0.94x / 0.92x, 512 x 256 x 512: 0.96x / 0.90x,
#: 1024 x 256 x 1024 (2^20 items): 0.98x / 1.06x, 1024 x 512 x 1408: 1.02x / 1.04x; 2^21 stays clear of every case
#: that was slower (an LLM's MLP, 4096 tokens x 11008, is 45 M). Above it the call also keeps 2·T·I activations for
#: its backward where transformers' keeps 3·T·I (gate, up and silu(gate)).
FUSED_MIN_ITEMS = 1 << 21


def _silu(act: object) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (torch.nn.SiLU, SiLUActivation))


def _plain_linear(layer: object) -> bool:
    """A torch Linear without bias over a plain weight (not a LoRA wrapper, a quantized layer or a DTensor shard,
    whose forward is their own)."""
    return type(layer) is torch.nn.Linear and layer.bias is None and type(layer.weight) is torch.nn.Parameter


def _mlp_forward(self, x: Tensor) -> Tensor:
    gate, up = self.gate_proj, self.up_proj
    if not (_silu(self.act_fn) and _plain_linear(gate) and _plain_linear(up) and isinstance(x, Tensor)
            and x.dim() >= 1 and gate.weight.shape == up.weight.shape
            and x.numel() // max(x.shape[-1], 1) * gate.out_features >= FUSED_MIN_ITEMS):
        return super(type(self), self).forward(x)
    gate_weight, up_weight = gate.weight, up.weight
    device = x.device.type
    if torch.is_autocast_enabled(device):  # what F.linear would compute in: the autocast dtype
        dtype = torch.get_autocast_dtype(device)
        x, gate_weight, up_weight = x.to(dtype), gate_weight.to(dtype), up_weight.to(dtype)
    if x.dtype not in _FLOATS or gate_weight.dtype != x.dtype or up_weight.dtype != x.dtype:
        return super(type(self), self).forward(x)
    return self.down_proj(ops.swiglu(gate_up(x, gate_weight, up_weight), -1))

@functools.cache
def _mlp_template() -> str | None:
    """The code of transformers' own Llama MLP forward (copied as is by Mistral, Qwen2/3, the MoE models' shared
    and dense MLPs, ...)."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    origin = next((c for c in LlamaMLP.__mro__ if c.__module__.startswith("transformers.")), None)
    return None if origin is None else _shape_of(origin.forward)


@functools.cache
def gradops_mlp_class(cls: type) -> type | None:
    """The in-place replacement of transformers MLP class ``cls`` (a subclass whose forward runs the gate on
    :func:`gradops.swiglu`), or None when its forward is not Llama's ``down_proj(act_fn(gate_proj(x)) *
    up_proj(x))``."""
    if not cls.__module__.startswith("transformers."):
        return None
    template = _mlp_template()
    if template is None or _shape_of(cls.forward) != template:
        return None
    return type(cls.__name__, (cls,), {"forward": _mlp_forward, "__module__": __name__, "gradops_style": "swiglu",
                                       "__doc__": f"{cls.__name__} with its SiLU gate on gradops.swiglu."})


def describe_mlp(module: torch.nn.Module) -> str:
    """The report detail of a swapped MLP."""
    gate = module.gate_proj
    return f"swiglu gate, {gate.in_features} -> 2 x {gate.out_features}"



def experts_forward(self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
                    ) -> Tensor:
    """The ``"gradops"`` experts implementation (the signature of transformers' ``ALL_EXPERTS_FUNCTIONS``).

    local dispatch (gradops' permute, :func:`gradops.distributed.dispatch_local`) -> grouped up projection, gate /
    activation, grouped down projection (transformers' grouped matmul dispatcher, its optional biases and
    post-expert norm) -> combine (gradops' weighted unpermute, :func:`gradops.distributed.combine`).
    Differentiable w.r.t. ``hidden_states``, the expert weights and ``top_k_weights``; deterministic (no
    scatter-add anywhere in the token movement).

    Args:
        self: a transformers experts module (one decorated with ``use_experts_implementation``).
        hidden_states: (T, H) tokens.
        top_k_index: (T, K) expert ids; under expert parallelism ids >= ``self.num_experts`` are sentinels for
            experts on other ranks (their routing weights are zero): they sort to the tail, no matmul runs on
            them, and they add nothing to the output or to any gradient, as in ``"grouped_mm"``.
        top_k_weights: (T, K) routing weights.

    Returns:
        (T, H) in ``hidden_states``' dtype. Dtypes outside CANN's MoE tables (float64 tokens, weights or
        routing weights) run ``"batched_mm"`` (torch's grouped matmul has no float64 kernel).
    """
    from transformers.integrations.moe import batched_mm_experts_forward

    up = self.gate_up_proj if self.has_gate else self.up_proj
    if any(t.dtype not in _FLOATS for t in (hidden_states, top_k_weights, up, self.down_proj)):
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    from . import distributed  # its import registers DTensor's sharding rules: not at gradops.transformers' import

    num_experts = self.num_experts
    permuted, offsets, handle = distributed.dispatch_local(hidden_states, top_k_index, num_experts)
    row_experts = None
    if self.has_bias:
        # The expert id of each permuted row (the bias to add): ids scattered to their permuted positions.
        ids = top_k_index.reshape(-1)
        row_experts = torch.empty_like(ids)
        row_experts[handle.sorted_indices.long()] = ids
        row_experts.clamp_(max=num_experts - 1)
    out = grouped_experts(self, permuted, offsets, row_experts, sentinels=self._is_expert_parallel)
    if out.dtype != hidden_states.dtype and hidden_states.dtype == torch.float32:
        out = out.float()  # half-precision experts beside float32 tokens: merge in float32, as "grouped_mm" does
    return distributed.combine(out, handle, top_k_weights).to(hidden_states.dtype)


def _gate(self: torch.nn.Module, gate_up: Tensor) -> Tensor:
    """The experts' gate on the gate-up projection's rows: :func:`gradops.swiglu` (aclnnSwiGlu: its halves A and B
    are transformers' gate and up, in that order) where the module gates with transformers' default formula,
    ``act_fn(gate) * up``, and SiLU; else the module's own ``_apply_gate``. One pass that reads the rows once and
    rounds once, where the formula runs the activation and the product as two passes with a rounding each."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    if (type(self)._apply_gate is _default_apply_gate and isinstance(self.act_fn, (torch.nn.SiLU, SiLUActivation))
            and gate_up.dtype in _FLOATS):
        return ops.swiglu(gate_up, -1)
    return self._apply_gate(gate_up)


def grouped_experts(self: torch.nn.Module, rows: Tensor, offsets: Tensor, row_experts: Tensor | None = None,
                    sentinels: bool = False) -> Tensor:
    """The experts of a transformers experts module on rows already grouped by local expert.

    Args:
        self: the experts module.
        rows: (N, H) rows, expert 0's first; rows past ``offsets[-1]`` are sentinels (routes to other ranks'
            experts): no expert runs on them, their outputs and gradients are zero.
        offsets: (num_experts,) int32 inclusive cumulative row counts (the grouped matmul's ``offs``).
        row_experts: (N,) the local expert of each row, needed only by experts with biases.
        sentinels: whether rows past ``offsets[-1]`` may exist (they are then masked; 3 extra passes).

    Returns:
        (N, H') the post-expert rows (up projection, gate / activation, down projection, optional post-expert norm).
    """
    from transformers.integrations.moe import _grouped_linear

    up, up_bias = (self.gate_up_proj, "gate_up_proj_bias") if self.has_gate else (self.up_proj, "up_proj_bias")
    tail = None
    if sentinels:
        # The grouped matmul leaves the sentinel rows (>= offsets[-1]) of its outputs and of its input
        # gradient uninitialised: zero them after each projection, and zero the permuted input out of place
        # so that its backward zeroes their gradient before moe_token_permute_grad sums it into the tokens.
        tail = (torch.arange(rows.shape[0], device=rows.device) >= offsets[-1]).unsqueeze(-1)
        rows = rows.masked_fill(tail, 0.0)
    out = _grouped_linear(rows, up, offsets, getattr(self, up_bias)[row_experts] if self.has_bias else None,
                          is_transposed=self.is_transposed)
    if tail is not None:
        out = out.masked_fill(tail, 0.0)
    out = _gate(self, out) if self.has_gate else self.act_fn(out)
    out = _grouped_linear(out, self.down_proj, offsets, self.down_proj_bias[row_experts] if self.has_bias else None,
                          is_transposed=self.is_transposed)
    if tail is not None:
        out = out.masked_fill(tail, 0.0)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return out


@functools.cache
def expert_parallel_class() -> type:
    """The ``"gradops"`` expert-parallel implementation (an ``EPImplementation`` of transformers' distributed
    module, registered by :func:`register`; built on first use because its base class lives in transformers).

    transformers' own expert parallelism (``from_pretrained(..., distributed_config=DistributedConfig(ep_size=W,
    ep_implementation="gradops"))``) shards the experts of each ``ep_dispatch_experts`` module over the expert
    group and asks this object to bring them their tokens. It does so with :func:`gradops.distributed.dispatch`
    / :func:`gradops.distributed.combine`: gradops' permute groups the (token, k) copies by owner rank, an
    all-to-all moves them, a second permute groups what arrived by local expert, and the way back weights and
    merges each token's K results in float32 in k order. No scatter-add anywhere (transformers' ``"all_to_all"``
    gathers rows with advanced indexing, whose backward is an index-add, atomic on CUDA), so every gradient is
    bitwise repeatable. With the ``"gradops"`` experts implementation the received rows go straight to the
    grouped matmuls (they already are grouped by expert: no second permute inside the experts); any other
    experts implementation is called on them with local expert ids and unit weights, as ``"all_to_all"`` does.

    When the EP group shares one batch with a tensor-parallel group (``tp_size > 1``), each TP rank sends an
    equal slice of it (``torch.chunk``'s split), so no token runs twice, and the slices are gathered back.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers.distributed.expert_parallel import EPImplementation

    from . import distributed

    class GradopsEP(EPImplementation):
        def __init__(self, experts: torch.nn.Module, ep_mesh: object, tp_mesh: object) -> None:
            super().__init__(experts, ep_mesh, tp_mesh)
            self.experts = experts

        def __call__(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
            tokens, sliced = hidden_states.shape[0], self.tp_mesh.size() > 1
            if sliced:
                # Replicate -> Shard(0): this rank's chunk, no communication; its backward gathers the gradients.
                hidden_states, top_k_index, top_k_weights = (
                    DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                    .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                    for t in (hidden_states, top_k_index, top_k_weights))
            world = self.ep_mesh.size()
            rows, counts, handle = distributed.dispatch(hidden_states, top_k_index, self.num_local_experts * world,
                                                        self.ep_mesh.get_group())
            out = distributed.combine(self._experts(rows, counts), handle, top_k_weights)
            if not sliced:
                return out
            width = out.shape[-1]
            return DTensor.from_local(out.contiguous(), self.tp_mesh, [Shard(0)], shape=(tokens, width),
                                      stride=(width, 1)).full_tensor()

        def _experts(self, rows: Tensor, counts: Tensor) -> Tensor:
            experts, n = self.experts, rows.shape[0]
            if n == 0:
                # This rank's experts got no rows. An experts implementation may skip empty input without
                # touching a weight ("eager" does): nothing here would then need a gradient, this rank's backward
                # would never join the reverse exchange the other ranks run, and all of them would hang. One zero
                # row through expert 0 keeps the graph; its upstream gradient is empty, so it adds only zeros.
                first = torch.zeros_like(counts)
                first[0] = 1
                return self._experts(rows.sum(0, keepdim=True), first)[:0]
            local = torch.arange(self.num_local_experts, device=rows.device)
            if (experts.config._experts_implementation == EXPERTS and rows.dtype in _FLOATS
                    and experts.down_proj.dtype in _FLOATS):
                row_experts = torch.repeat_interleave(local, counts, output_size=n) if experts.has_bias else None
                return grouped_experts(experts, rows, torch.cumsum(counts, 0, dtype=torch.int32), row_experts)
            ids = torch.repeat_interleave(local, counts, output_size=n).unsqueeze(-1)
            return self.experts_forward(rows, ids, rows.new_ones(ids.shape))

    GradopsEP.__doc__ = expert_parallel_class.__doc__
    GradopsEP.__module__, GradopsEP.__qualname__ = __name__, "GradopsEP"
    return GradopsEP


def norm_classes(families: Iterable[str] = NORM_FAMILIES) -> dict[str, type]:
    """transformers RMSNorm class name -> its gradops subclass, for every known-formula RMSNorm class defined
    in the modeling modules of ``families`` (imported here)."""
    return _classes(families, "RMSNorm", gradops_class)


def _classes(families: Iterable[str], suffix: str, target_of) -> dict[str, type]:
    """Class name -> ``target_of(cls)`` for the classes named ``*suffix`` defined in the modeling modules of
    ``families`` (imported here) that have one."""
    import importlib

    out = {}
    for family in families:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name, cls in vars(module).items():
            if (isinstance(cls, type) and name.endswith(suffix) and cls.__module__ == module.__name__
                    and (target := target_of(cls)) is not None):
                out[name] = target
    return out


def mlp_classes(families: Iterable[str] = NORM_FAMILIES) -> dict[str, type]:
    """transformers MLP class name -> its gradops subclass, for every Llama-style MLP class defined in the modeling
    modules of ``families`` (imported here)."""
    return _classes(families, "MLP", gradops_mlp_class)


def register(norms: bool | Iterable[str] = False, mlps: bool | Iterable[str] = False) -> None:
    """Register gradops with transformers; idempotent.

    Always: the ``"gradops"`` experts implementation in ``ALL_EXPERTS_FUNCTIONS``, so that
    ``model.set_experts_implementation("gradops")`` and ``from_pretrained(..., experts_implementation="gradops")``
    run :func:`experts_forward`; with ``torch.distributed``, the ``"gradops"`` expert-parallel implementation in
    ``EPImplementationInterface`` (``DistributedConfig(ep_implementation="gradops")``).

    Args:
        norms: also register transformers patch mappings (``transformers.monkey_patching``) from the RMSNorm
            classes of these model families (True: :data:`NORM_FAMILIES`) to their gradops subclasses, applied
            by ``from_pretrained`` / ``from_config`` / ``apply_patches()``. A name another library already
            mapped to a different class raises transformers' ValueError rather than being overwritten.
        mlps: the same for the Llama-style MLP classes of these families (the gate on :func:`gradops.swiglu`).
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts_forward)
    if torch.distributed.is_available():
        from transformers.distributed.expert_parallel import EPImplementationInterface

        EPImplementationInterface.register(EP, expert_parallel_class())
    if not norms and not mlps:
        return
    from transformers.monkey_patching import get_patch_mapping, register_patch_mapping

    mapped = get_patch_mapping()
    wanted = {}
    if norms:
        wanted.update(norm_classes(NORM_FAMILIES if norms is True else norms))
    if mlps:
        wanted.update(mlp_classes(NORM_FAMILIES if mlps is True else mlps))
    register_patch_mapping({k: v for k, v in wanted.items() if mapped.get(k) is not v})


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module whose forward dispatches on ``config._experts_implementation``."""
    return (type(module).__module__.startswith("transformers.") and hasattr(module, "_is_expert_parallel")
            and hasattr(getattr(module, "config", None), "_experts_implementation"))
