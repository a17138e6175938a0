"""``gradops.patch(model)``: put gradops' operators under an existing model, in place.

One generic walker, not one function per model architecture: every submodule whose class is exactly a key of
the swap table becomes the table's drop-in subclass (:mod:`gradops.nn`). The swap reassigns the instance's
class, so the module object itself stays: its parameters and buffers (hence optimizer references, device,
dtype), hyper-parameters (eps, padding_idx, ...), training flag and hooks are all kept, and a module shared by
two parents is swapped once. Subclasses of the torch classes (a model's own ``MyNorm(nn.LayerNorm)``) are left
alone and reported, since their forward may differ. Hugging Face transformers' RMSNorm classes (their own
classes, not ``torch.nn.RMSNorm``) are swapped when their code is the Llama, Gemma or GPT-OSS formula
(:mod:`gradops.transformers`), and reported otherwise; so are their MLP classes whose forward is Llama's SwiGLU MLP
(the gate on :func:`gradops.swiglu`); their MoE experts modules are switched to the "gradops" experts
implementation (a config setting, not a class swap: transformers dispatches on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import nn

#: torch class -> gradops drop-in subclass.
SWAPS: dict[type[torch.nn.Module], type[torch.nn.Module]] = {
    torch.nn.RMSNorm: nn.RMSNorm,
    torch.nn.LayerNorm: nn.LayerNorm,
    torch.nn.Embedding: nn.Embedding,
    torch.nn.Hardswish: nn.Hardswish,
}


def _unsupported(module: torch.nn.Module) -> str | None:
    """Why a module of a swappable class must keep PyTorch's implementation, or None."""
    if isinstance(module, torch.nn.Embedding) and module.sparse:
        return "sparse=True (aclnnEmbeddingDenseBackward produces a dense gradient)"
    return None


def _transformers_norm(cls: type) -> bool:
    """A Hugging Face transformers RMSNorm class (gradops.transformers decides whether its formula is known)."""
    return cls.__name__.endswith("RMSNorm") and cls.__module__.startswith("transformers.")


def _transformers_mlp(cls: type) -> bool:
    """A Hugging Face transformers MLP class (gradops.transformers decides whether its forward is Llama's)."""
    return cls.__name__.endswith("MLP") and cls.__module__.startswith("transformers.")


def _transformers_experts(module: torch.nn.Module) -> bool:
    """A Hugging Face transformers MoE experts module (without importing transformers for other models)."""
    if not type(module).__module__.startswith("transformers."):
        return False
    from . import transformers as hf

    return hf.is_experts(module)


def _swap_transformers(module: torch.nn.Module, where: str, report: PatchReport, target_of, describe,
                       unknown: str) -> None:
    """Swap a transformers module for its gradops subclass (``target_of(cls)``), or report it kept (``unknown``)."""
    cls = type(module)
    target = target_of(cls)
    if target is None:
        report.skipped.append((where, cls.__name__, unknown))
        return
    module.__class__ = target
    report.swapped.append((where, cls.__name__, describe(module)))


def _swap_transformers_norm(module: torch.nn.Module, where: str, report: PatchReport) -> None:
    from . import transformers as hf

    _swap_transformers(module, where, report, hf.gradops_class, hf.describe,
                       "a transformers RMSNorm whose code is not the Llama, Gemma or GPT-OSS formula: left alone, not "
                       "guessed")


def _swap_transformers_mlp(module: torch.nn.Module, where: str, report: PatchReport) -> None:
    from . import transformers as hf

    _swap_transformers(module, where, report, hf.gradops_mlp_class, hf.describe_mlp,
                       "a transformers MLP whose forward is not Llama's down_proj(act_fn(gate_proj(x)) * up_proj(x)): "
                       "left alone")


def _switch_experts(model: torch.nn.Module, found: list[tuple[str, torch.nn.Module]], report: PatchReport) -> None:
    """Switch the transformers experts modules ``found`` to the "gradops" experts implementation: through the
    model's own ``set_experts_implementation`` when ``model`` is a transformers model, else on each module's
    config (shared by every experts module of that model)."""
    from . import transformers as hf

    hf.register()
    before = [m.config._experts_implementation for _, m in found]
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(hf.EXPERTS)
    for (where, module), was in zip(found, before):
        if module.config._experts_implementation != hf.EXPERTS:
            module.config._experts_implementation = hf.EXPERTS
        if was != hf.EXPERTS:
            detail = f"{module.num_experts} experts, experts_implementation {was!r} -> {hf.EXPERTS!r}"
            report.switched.append((where, type(module).__name__, detail))


@dataclass
class PatchReport:
    """What :func:`patch` did. ``swapped`` and ``skipped`` hold ``(path, class name, detail)`` rows; the root
    module's path is ``"(root)"``. ``str(report)`` is a printable table."""

    swapped: list[tuple[str, str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    #: transformers MoE experts modules switched to the "gradops" experts implementation.
    switched: list[tuple[str, str, str]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        """Swapped and switched modules per class name."""
        out: dict[str, int] = {}
        for _, name, _ in self.swapped + self.switched:
            out[name] = out.get(name, 0) + 1
        return out

    def __len__(self) -> int:
        return len(self.swapped) + len(self.switched)

    def __str__(self) -> str:
        summary = ", ".join(f"{n} {c}" for c, n in sorted(self.counts().items())) or "nothing"
        lines = [f"gradops.patch: swapped {len(self)} module(s) ({summary}); skipped {len(self.skipped)}"]
        width = max((len(p) for p, _, _ in self.swapped + self.switched + self.skipped), default=0)
        lines += [f"  {p:<{width}}  -> {'gradops.nn' if c in nn.__all__ else 'gradops.transformers'}.{c}({d})"
                  for p, c, d in self.swapped]
        lines += [f"  {p:<{width}}  {c}: {d}" for p, c, d in self.switched]
        lines += [f"  {p:<{width}}  kept {c}: {d}" for p, c, d in self.skipped]
        return "\n".join(lines)


def patch(model: torch.nn.Module, swaps: dict[type[torch.nn.Module], type[torch.nn.Module]] | None = None
          ) -> PatchReport:
    """Swap the torch modules of ``model`` (itself included) for gradops' drop-in subclasses, in place.

    Args:
        model: any ``torch.nn.Module``; call before wrapping it in DDP / FSDP or ``torch.compile``.
        swaps: class table to use instead of :data:`SWAPS`; every target must subclass its source, so the
            instance already carries all the state the target's forward reads.

    Returns:
        A :class:`PatchReport` listing the swapped modules, the transformers experts modules switched to the
        "gradops" experts implementation, and the matching ones that were kept (subclasses of the torch
        classes, unsupported options such as ``Embedding(sparse=True)``, unknown norm formulas).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module`` (a model's name or path is not loaded here: load the model,
            then patch it), or ``swaps`` is not a dict of module classes to subclasses of them.
    """
    if not isinstance(model, torch.nn.Module):
        given = f"the class {model.__name__}" if isinstance(model, type) else f"a {type(model).__name__}"
        raise TypeError(f"gradops.patch: model must be a torch.nn.Module instance (the model to patch in place), "
                        f"got {given}")
    if swaps is not None and not isinstance(swaps, dict):
        raise TypeError(f"gradops.patch: swaps must be None or a dict {{torch module class: gradops subclass}}, "
                        f"got {type(swaps).__name__}")
    table = SWAPS if swaps is None else swaps
    for source, target in table.items():
        if not (isinstance(source, type) and isinstance(target, type)):
            raise TypeError(f"gradops.patch: swaps must map module classes to module classes, got "
                            f"{source!r}: {target!r}")
        if not issubclass(target, source):
            raise TypeError(f"gradops.patch: {target.__name__} must subclass {source.__name__} to replace it in place")
    targets = set(table.values())
    report = PatchReport()
    experts: list[tuple[str, torch.nn.Module]] = []
    for path, module in model.named_modules():  # shared modules are visited once
        where = path or "(root)"
        cls = type(module)
        target = table.get(cls)
        if target is None and swaps is None and _transformers_norm(cls):
            _swap_transformers_norm(module, where, report)
            continue
        if target is None and swaps is None and _transformers_mlp(cls):
            _swap_transformers_mlp(module, where, report)
            continue
        if target is None and swaps is None and _transformers_experts(module):
            experts.append((where, module))
            continue
        if target is None:
            base = next((s for s in table if isinstance(module, s) and cls not in targets), None)
            if base is not None:
                why = f"subclass of {base.__module__}.{base.__name__}, its forward may differ"
                report.skipped.append((where, cls.__name__, why))
            continue
        why = _unsupported(module)
        if why is not None:
            report.skipped.append((where, cls.__name__, why))
            continue
        module.__class__ = target
        report.swapped.append((where, target.__name__, module.extra_repr()))
    if experts:
        _switch_experts(model, experts, report)
    return report
