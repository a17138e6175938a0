"""aclnnLayerNormBackward, two-phase: LayerNorm's backward over the last ``len(normalizedShape)`` dims.

The work is :func:`gradops.layer_norm_backward` (one pass for dx, dgamma and dbeta, fp32 accumulation) on the
2-D view ``(M, N)`` of the call, M the product of the leading dims and N of the normalized ones; results are cast
into each out's dtype, as CANN's executor casts and view-copies them (``GenOutWithMask``).

The parameter rules follow hicann/ops-nn's ``norm/layer_norm_grad_v3/docs/aclnnLayerNormBackward.md`` (its status
table) and ``op_host/op_api/aclnn_layer_norm_backward.cpp`` (``CheckNotNull``, ``CheckDtype``, ``CheckShape``):

- 161001: gradOut, input, normalizedShape, mean, rstd or outputMask None; an out whose mask entry is True None.
- 161002: outputMask not 3 bools; a dtype outside float32 / float16 / bfloat16 (inputs, the optional weight and
  bias, and the outs); gradOut's dtype or shape not input's; weight neither float32 nor input's dtype;
  normalizedShape empty, longer than 8 or than input's rank, or not input's trailing dims; weight or bias not of
  shape normalizedShape; mean and rstd of different shapes, or not M elements; gradInputOut not of input's shape;
  gradWeightOut or gradBiasOut not N elements; a rank outside 1-8; tensors on different devices; an out whose
  elements share memory.

Where the two sources differ, the documented rule is kept: the source's trailing-dims loop
(``CheckShapeEqual``) starts at ``axis`` instead of 0 and so compares nothing once ``input.dim() >= 2 *
len(normalizedShape)``; the doc's table refuses any trailing dim that differs, and so does this surface.

mean and rstd are read in float32 (CANN's LayerNormGradV3 path casts them so); the weight defaults to ones of
input's dtype. Every buffer the run needs (dx when gradInputOut is masked off, not contiguous or of another dtype,
the float32 dgamma / dbeta, float32 statistics, contiguous copies of non-contiguous inputs, the ones weight) is
carved from the workspace, whose size phase 1 reports: phase 2 allocates nothing. A negative rstd (a mean passed
in its place, typically) is refused at run time with 161002, as :func:`gradops.layer_norm_backward` refuses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ...aclnn._declare import CFunction
from ...aclnn._executor import aclOpExecutor, execute, refused
from ...contract._common import (
    MAX_RANK,
    dtype_name,
    dtypes_text,
    fail,
    overlaps_itself,
    require_dtype,
    require_present,
    require_rank,
    require_same_device,
    require_same_dtype,
    shape_text,
)
from ...contract._memo import key_of, remembered
from ...status import ACLNN_ERR_PARAM_INVALID, ACLNN_ERR_PARAM_NULLPTR, ACLNN_SUCCESS, OpError
from .ops import layer_norm_backward, plan_layer_norm_backward

OP = "layer_norm_backward"
NAME = "aclnnLayerNormBackward"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Alignment of the buffers carved from the workspace (a cache line, as the other executors carve theirs).
ALIGN = 64


def _invalid(arg: str, expected: str, given: str) -> OpError:
    return fail(ACLNN_ERR_PARAM_INVALID, NAME, arg, expected, given)


def _int_array(normalized_shape: object) -> tuple[int, ...]:
    """normalizedShape as a tuple of ints (an aclIntArray: a sequence of int, not bool)."""
    if not isinstance(normalized_shape, Sequence) or isinstance(normalized_shape, str) or any(
            isinstance(d, bool) or not isinstance(d, int) for d in normalized_shape):
        raise _invalid("normalizedShape", "a sequence of ints (aclIntArray)", repr(normalized_shape))
    return tuple(normalized_shape)


def _mask(output_mask: object) -> tuple[bool, bool, bool]:
    if not isinstance(output_mask, Sequence) or isinstance(output_mask, str) or len(output_mask) != 3 or any(
            not isinstance(m, bool) for m in output_mask):
        raise _invalid("outputMask", "3 bools (aclBoolArray of length 3)", repr(output_mask))
    return tuple(output_mask)  # type: ignore[return-value]


def check(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask, grad_input, grad_weight,
          grad_bias) -> tuple[int, int, tuple[bool, bool, bool]]:
    """Validate an aclnnLayerNormBackward call in CANN's order; returns ``(M, N, outputMask)``.

    Raises:
        OpError: 161001 / 161002 as the module docstring lists.
    """
    require_present(NAME, gradOut=grad_out, input=x, mean=mean, rstd=rstd)
    if normalized_shape is None:
        raise fail(ACLNN_ERR_PARAM_NULLPTR, NAME, "normalizedShape", "an aclIntArray", "None")
    if output_mask is None:
        raise fail(ACLNN_ERR_PARAM_NULLPTR, NAME, "outputMask", "an aclBoolArray", "None")
    mask = _mask(output_mask)
    outs = {"gradInputOut": grad_input, "gradWeightOut": grad_weight, "gradBiasOut": grad_bias}
    for (name, t), wanted in zip(outs.items(), mask):
        if wanted and t is None:
            raise fail(ACLNN_ERR_PARAM_NULLPTR, NAME, name, f"a tensor ({name} is asked for by outputMask)", "None")
    given = {name: t for name, t in {"weightOptional": weight, "biasOptional": bias, **outs}.items() if t is not None}
    require_present(NAME, **given)
    require_same_device(NAME, gradOut=grad_out, input=x, mean=mean, rstd=rstd, **given)
    norm = _int_array(normalized_shape)

    # CheckDtype
    for name, t in {"gradOut": grad_out, "input": x, "mean": mean, "rstd": rstd}.items():
        require_dtype(NAME, name, t, DTYPES)
    require_same_dtype(NAME, "gradOut", grad_out, "input", x)
    if weight is not None:
        require_dtype(NAME, "weightOptional", weight, DTYPES)
        if weight.dtype not in (torch.float32, x.dtype):
            raise _invalid("weightOptional.dtype", f"{dtypes_text((torch.float32, x.dtype))} for input of "
                           f"{dtype_name(x.dtype)}", dtype_name(weight.dtype))
    for name in ("biasOptional", *outs):
        if name in given:
            require_dtype(NAME, name, given[name], DTYPES)

    # CheckShape
    for name, t in {"gradOut": grad_out, "input": x, "mean": mean, "rstd": rstd, **given}.items():
        require_rank(NAME, name, t, 1, MAX_RANK)
    if not 1 <= len(norm) <= MAX_RANK:
        raise _invalid("normalizedShape", f"1 to {MAX_RANK} dims", shape_text(norm))
    if len(norm) > x.dim():
        raise _invalid("normalizedShape", f"at most input.dim() = {x.dim()} dims", shape_text(norm))
    begin = x.dim() - len(norm)
    if tuple(x.shape[begin:]) != norm:
        raise _invalid("normalizedShape", f"input's trailing dims {shape_text(x.shape[begin:])}", shape_text(norm))
    for name in ("weightOptional", "biasOptional"):
        if name in given and tuple(given[name].shape) != norm:
            raise _invalid(f"{name}.shape", f"normalizedShape {shape_text(norm)}", shape_text(given[name].shape))
    if grad_out.shape != x.shape:
        raise _invalid("gradOut.shape", f"input's shape {shape_text(x.shape)}", shape_text(grad_out.shape))
    if mean.shape != rstd.shape:
        raise _invalid("rstd.shape", f"mean's shape {shape_text(mean.shape)}", shape_text(rstd.shape))
    m, n = math.prod(x.shape[:begin]), math.prod(norm)
    if mean.numel() != m:
        raise _invalid("mean.shape", f"{m} elements (the product of input's dims before normalizedShape)",
                       f"{shape_text(mean.shape)} ({mean.numel()} elements)")
    if mask[0] and grad_input.shape != x.shape:
        raise _invalid("gradInputOut.shape", f"input's shape {shape_text(x.shape)}", shape_text(grad_input.shape))
    for name, t, wanted in (("gradWeightOut", grad_weight, mask[1]), ("gradBiasOut", grad_bias, mask[2])):
        if wanted and t.numel() != n:
            raise _invalid(f"{name}.shape", f"{n} elements (the product of normalizedShape)",
                           f"{shape_text(t.shape)} ({t.numel()} elements)")
    for name, t, wanted in zip(outs, outs.values(), mask):
        if wanted and overlaps_itself(t):
            raise _invalid(name, "one memory location per element",
                           f"strides {tuple(t.stride())} for shape {shape_text(t.shape)}")
    return m, n, mask


#: check's answers by the arguments' metadata with strides (it reads nothing else; a refusal raises afresh):
#: at 4 x 64 the check costs ~15 µs of a ~60 µs two-phase call, a remembered answer ~2.
_checked: dict[tuple, tuple[int, int, tuple[bool, bool, bool]]] = {}
#: The backend decision's stand-ins (metadata only, one element of storage each) by (dtype, shape, device).
_stand_ins: dict[tuple, Tensor] = {}


def _remembered_check(*args) -> tuple[int, int, tuple[bool, bool, bool]]:
    key = key_of(args, strides=True)
    return check(*args) if key is None else remembered(_checked, key, lambda: check(*args))


def _like(dtype: torch.dtype, device: torch.device, *shape: int) -> Tensor:
    return remembered(_stand_ins, (dtype, shape, device),
                      lambda: torch.empty(1, dtype=dtype, device=device).expand(*shape))


class _Carver:
    """Buffers carved from the workspace: ``add`` reserves one (aligned) at phase 1, ``take`` views it at run."""

    def __init__(self) -> None:
        self.size = 0
        self.spots: list[tuple[int, int, torch.dtype, tuple[int, ...]]] = []

    def add(self, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        offset = -(-self.size // ALIGN) * ALIGN
        self.spots.append((offset, nbytes, dtype, shape))
        self.size = offset + nbytes
        return len(self.spots) - 1

    def total(self) -> int:
        return self.size + ALIGN if self.spots else 0  # slack: the caller's workspace may start anywhere

    def take(self, workspace: Tensor, spot: int) -> Tensor:
        offset, nbytes, dtype, shape = self.spots[spot]
        start = (-workspace.data_ptr()) % ALIGN + offset
        return workspace[start:start + nbytes].view(dtype).view(shape)


def aclnnLayerNormBackwardGetWorkspaceSize(gradOut: Tensor, input: Tensor, normalizedShape: Sequence[int],
                                           mean: Tensor, rstd: Tensor, weightOptional: Tensor | None,
                                           biasOptional: Tensor | None, outputMask: Sequence[bool],
                                           gradInputOut: Tensor | None, gradWeightOut: Tensor | None,
                                           gradBiasOut: Tensor | None) -> tuple[int, int, aclOpExecutor | None]:
    """Phase 1 of aclnnLayerNormBackward (ops-nn's formula; N the product of normalizedShape):

    ``xhat = (input - mean)·rstd``, ``g = gradOut·weight``, ``gradInput = (g - mean_N(g) - xhat·mean_N(g·xhat))·rstd``,
    ``gradWeight = Σ_rows gradOut·xhat``, ``gradBias = Σ_rows gradOut``.

    Args:
        gradOut, input: the same shape (1-8 dims, rank >= len(normalizedShape)) and dtype (float32 / float16 /
            bfloat16); any strides.
        normalizedShape: input's trailing dims (a sequence of 1-8 ints).
        mean, rstd: the forward's statistics, one shape of M elements (``input.shape[:-len(normalizedShape)]``
            or its keepdim form), float32 / float16 / bfloat16 (read as float32).
        weightOptional: shape normalizedShape, float32 or input's dtype; None means ones.
        biasOptional: shape normalizedShape; checked, not used (the backward does not read beta).
        outputMask: three bools: which of gradInputOut, gradWeightOut, gradBiasOut are computed and written.
        gradInputOut: input's shape. gradWeightOut, gradBiasOut: N elements. Any supported float dtype each (the
            results are cast into it); masked-off outs may be None.

    Returns:
        ``(status, workspace_size, executor)``: 0 and an executor, or (161001 | 161002, 0, None);
        :func:`gradops.aclnn.aclGetRecentErrMsg` names the argument.
    """
    try:
        m, n, mask = _remembered_check(gradOut, input, normalizedShape, mean, rstd, weightOptional, biasOptional,
                                       outputMask, gradInputOut, gradWeightOut, gradBiasOut)
        # The backend decision of the functional API, on stand-ins of the 2-D call's metadata (one element of
        # storage each: the plan reads metadata only); 561003 when GRADOPS_BACKEND names one that cannot run.
        device = input.device
        weight_dtype = weightOptional.dtype if weightOptional is not None else input.dtype
        chosen = plan_layer_norm_backward(_like(input.dtype, device, m, n), _like(input.dtype, device, m, n),
                                          _like(torch.float32, device, m), _like(torch.float32, device, m),
                                          _like(weight_dtype, device, n))
    except OpError as e:
        return refused(e)
    outs = {"gradInputOut": gradInputOut, "gradWeightOut": gradWeightOut, "gradBiasOut": gradBiasOut}
    written = {name: t for (name, t), wanted in zip(outs.items(), mask) if wanted}
    inputs = {"gradOut": gradOut, "input": input, "mean": mean, "rstd": rstd, "weightOptional": weightOptional,
              "biasOptional": biasOptional}
    bound = {name: t for name, t in {**inputs, **written}.items() if t is not None}
    if not written or m == 0 or n == 0:
        # Nothing to compute: with no rows, the weight gradients are sums of nothing (CANN fills them with 0).
        def fill(_workspace: Tensor | None) -> None:
            for name in ("gradWeightOut", "gradBiasOut"):
                if name in written and m == 0:
                    written[name].zero_()

        return ACLNN_SUCCESS, 0, aclOpExecutor(OP, "none", device, 0, fill, bound)

    carver = _Carver()
    accumulate = torch.float32

    def staged(t: Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
        """A workspace spot for ``t`` unless it can be read as it is (the right dtype and contiguous)."""
        if t is not None and t.dtype == dtype and t.is_contiguous():
            return None
        return carver.add(dtype, shape)

    def direct_out(t: Tensor | None, dtype: torch.dtype) -> bool:
        return t is not None and t.dtype == dtype and t.is_contiguous()

    spots = {
        "gradOut": staged(gradOut, input.dtype, (m, n)),
        "input": staged(input, input.dtype, (m, n)),
        "mean": staged(mean, torch.float32, (m,)),
        "rstd": staged(rstd, torch.float32, (m,)),
        "weight": staged(weightOptional, weightOptional.dtype if weightOptional is not None else input.dtype, (n,)),
        "dx": None if mask[0] and direct_out(gradInputOut, input.dtype) else carver.add(input.dtype, (m, n)),
        "dgamma": None if mask[1] and direct_out(gradWeightOut, accumulate) else carver.add(accumulate, (n,)),
        "dbeta": None if mask[2] and direct_out(gradBiasOut, accumulate) else carver.add(accumulate, (n,)),
    }
    sources = {"gradOut": gradOut, "input": input, "mean": mean, "rstd": rstd, "weight": weightOptional,
               "dx": gradInputOut, "dgamma": gradWeightOut, "dbeta": gradBiasOut}
    shapes = {"gradOut": (m, n), "input": (m, n), "mean": (m,), "rstd": (m,), "weight": (n,), "dx": (m, n),
              "dgamma": (n,), "dbeta": (n,)}

    # The 2-D views of what is read or written in place, made once: phase 2 runs on the layouts phase 1 saw.
    fixed = {key: sources[key].view(shapes[key]) for key, spot in spots.items() if spot is None}

    def run(workspace: Tensor | None) -> None:
        views = dict(fixed)
        for key, spot in spots.items():
            if spot is None:
                continue
            buf = carver.take(workspace, spot)
            if key == "weight" and weightOptional is None:
                buf.fill_(1)
            elif key in ("gradOut", "input", "mean", "rstd", "weight"):
                buf.copy_(sources[key].reshape(shapes[key]))
            views[key] = buf
        layer_norm_backward(views["gradOut"], views["input"], views["mean"], views["rstd"], views["weight"],
                            out=(views["dx"], views["dgamma"], views["dbeta"]))
        for key, name, wanted in (("dx", "gradInputOut", mask[0]), ("dgamma", "gradWeightOut", mask[1]),
                                  ("dbeta", "gradBiasOut", mask[2])):
            if wanted and spots[key] is not None:
                written[name].copy_(views[key].reshape(written[name].shape))  # cast to the out's dtype

    size = carver.total()
    return ACLNN_SUCCESS, size, aclOpExecutor(OP, chosen.backend.name, device, size, run, bound)


def aclnnLayerNormBackward(workspace, workspaceSize: int, executor: aclOpExecutor | None, stream=None) -> int:
    """Phase 2 of aclnnLayerNormBackward: run ``executor`` on ``stream`` (None or a torch.cuda.Stream)."""
    return execute(OP, workspace, workspaceSize, executor, stream)


#: The C declarations in CANN's words: what ``gradops cann-home`` writes and compiles (gradops.aclnn.capi).
C_API = (
    CFunction(
        aclnnLayerNormBackwardGetWorkspaceSize, aclnnLayerNormBackward,
        "aclnn_layer_norm_backward.h",
        "const aclTensor *gradOut, const aclTensor *input, const aclIntArray *normalizedShape, "
        "const aclTensor *mean, const aclTensor *rstd, const aclTensor *weightOptional, "
        "const aclTensor *biasOptional, const aclBoolArray *outputMask, aclTensor *gradInputOut, "
        "aclTensor *gradWeightOut, aclTensor *gradBiasOut"),
)
