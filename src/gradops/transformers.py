"""Hugging Face ``transformers`` models on gradops: the RMSNorm families (issue 10, first part).

``gradops.patch(model)`` swaps every RMSNorm of a transformers model whose forward is one of the two formulas
transformers uses, recognised by their source code rather than by class name (a model's norm class is a copy
of one of them, "# Copied from", or it is something else and is left alone, named in the report):

- Llama-style (Llama, Mistral, Qwen2/3 and their q/k per-head norms, Mixtral, Qwen3-MoE, OLMoE, DeepSeek, ...):
  ``weight * (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(x.dtype)``;
- Gemma-style: ``(x_f32 * rsqrt(mean(x_f32^2) + eps) * (1 + weight_f32)).to(x.dtype)``.

Both run on :func:`gradops.rms_norm` (aclnnRmsNorm forward, aclnnRmsNormGrad backward), normalising in float32
and rounding once to x's dtype (the Gemma formula exactly; the weight becomes ``1 + weight`` in float32). For the
Llama formula in float32 the two orders give the same result to float32 rounding; in half precision transformers
rounds the normalised x to x's dtype and then multiplies by the weight (a second rounding), where gradops, as
CANN's RmsNorm, multiplies in float32 and rounds once: closer to the float64 result, not bitwise HF's. A call whose
dtypes CANN's table does not cover (float64, or a float32 weight beside half x, where transformers' result is
float32) runs transformers' own forward unchanged.

Nothing here imports ``transformers`` unless the model being patched already did.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

import torch
from torch import Tensor

from . import ops

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _source(fn: object) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


@functools.cache
def _templates() -> dict[str, str]:
    """The source of transformers' own Llama and Gemma RMSNorm forwards -> style."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    out = {}
    for cls, style in ((LlamaRMSNorm, "llama"), (GemmaRMSNorm, "gemma")):
        src = _source(cls.forward)
        if src is not None:
            out[src] = style
    return out


def rms_norm_style(cls: type) -> str | None:
    """``"llama"`` or ``"gemma"`` for a transformers RMSNorm class whose forward is that formula, else None."""
    if not cls.__module__.startswith("transformers."):
        return None
    return _templates().get(_source(cls.forward) or "")


def _llama_forward(self, hidden_states: Tensor) -> Tensor:
    if hidden_states.dtype not in _FLOATS or self.weight.dtype != hidden_states.dtype:
        return super(type(self), self).forward(hidden_states)
    return ops.rms_norm(hidden_states, self.weight, float(self.variance_epsilon))[0]


def _gemma_forward(self, x: Tensor) -> Tensor:
    if x.dtype not in _FLOATS:
        return super(type(self), self).forward(x)
    return ops.rms_norm(x, 1.0 + self.weight.float(), float(self.eps))[0]


_FORWARDS = {"llama": _llama_forward, "gemma": _gemma_forward}
_EPS_ATTR = {"llama": "variance_epsilon", "gemma": "eps"}


@functools.cache
def gradops_class(cls: type) -> type | None:
    """The in-place replacement of transformers RMSNorm class ``cls`` (a subclass whose forward runs
    :func:`gradops.rms_norm`), or None when its forward is neither known formula."""
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
