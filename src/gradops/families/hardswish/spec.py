"""Hardswish and its backward (aclnnHardswish / aclnnHardswishBackward): their declarations (see
:mod:`gradops.spec`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...spec import Bench, Example, Golden, OpSpec, Timed, provided
from . import contract, reference

aten = torch.ops.aten


def _example(op):
    def example(m, n, dtype, device, gen):
        x = (torch.rand(m, n, generator=gen) * 12 - 6).to(dtype).to(device)
        if op == "hardswish":
            return Example((x,), (1,), lambda x: (F.hardswish(x),), kernel=aten.hardswish)
        g = (torch.randn(m, n, generator=gen)).to(dtype).to(device)
        # PyTorch >= 2.8 uses the open interval at +-3 (CANN: closed): compare it off those two points only.
        return Example((g, x), (1,), lambda g, x: (aten.hardswish_backward(g, x),), twin_mask=x.abs() != 3,
                       kernel=aten.hardswish_backward)
    return example


def _golden_inputs(op):
    def inputs(shape, dtype, draw, opts):
        x = torch.rand(shape, generator=draw.gen, dtype=torch.float64) * 12 - 6
        flat = x.view(-1)
        if flat.numel():  # a sixteenth of the elements on CANN's edges: -3, +3, 0
            picks = torch.randint(0, flat.numel(), (max(1, flat.numel() // 16),), generator=draw.gen)
            flat[picks] = torch.tensor([-3.0, 3.0, 0.0], dtype=torch.float64)[torch.arange(picks.numel()) % 3]
        x = x.to(dtype)
        return {"self": x} if op == "hardswish" else {"grad_output": draw.normal(*shape), "self": x}
    return inputs


def _hardswish_peer(args):
    return {0: (F.hardswish(args[0]), "torch.nn.functional.hardswish")}


def _backward_peer(args):
    # torch >= 2.8 takes the open interval at x = +-3 (d(-3) = 0, d(3) = 1); CANN's V1 the closed one. At those two
    # points the third party gets CANN's values, as torch_npu patches them for its users.
    g, x = args
    out = aten.hardswish_backward(g, x)
    closed = torch.where(x == -3, g.float() * -0.5, g.float() * 1.5).to(g.dtype)
    return {0: (torch.where((x == 3) | (x == -3), closed, out),
                "aten.hardswish_backward (CANN's closed-interval values at x = -3, 3)")}


def _prepare(shape, dtype, device):
    n = shape["n"]
    x = (torch.randn(n, device=device) * 4).to(dtype)
    g = torch.randn(n, dtype=dtype, device=device)
    return Timed((g, x), lambda: aten.hardswish_backward(g, x), (reference.hardswish_backward, (g, x)))


BENCH = Bench(
    "hardswish_backward",
    shapes={"cpu": [{"n": 32 * 1024 * 1024}], "cuda": [{"n": 16384 * 4096}, {"n": 16384 * 14336}],
            "quick": [{"n": 1 << 17}], "gpu-check": [{"n": 16384 * 4096}], "dry": [{"n": 512}]},
    sizes=lambda rows, cols, vocab, top_k: {"n": rows * cols},
    prepare=_prepare,
    nbytes=lambda s, e: 3 * s["n"] * e,
    copy_numel=lambda s: s["n"],
    eager_name="aten.hardswish_backward",
)


def _rule(R, P, Shard):
    def rule(x):
        return [([R], [R])] + [([Shard(d)], [Shard(d)]) for d in range(x.ndim)]
    return rule


def _backward_rule(R, P, Shard):
    def rule(grad_output, x):
        return [([R], [R, R])] + [([Shard(d)], [Shard(d), Shard(d)]) for d in range(x.ndim)]
    return rule


def _cpu():
    """The family's compiled CPU kernels (importing them loads or builds the native extension)."""
    from . import cpu

    return cpu


def _triton():
    """The family's Triton launchers (importing them needs triton)."""
    from . import launch

    return launch


#: The family's module for each backend: where each op's implementation (gradops.spec.Impl) is.
_BACKENDS = {"torch": lambda: reference, "cpu": _cpu, "triton": _triton}


#: The family's declarations, in the tables' order; each is also the module's constant of its name.
SPECS = (
    OpSpec("hardswish", "aclnnHardswish", False, example=_example("hardswish"),
           golden=Golden(("out",), (), _golden_inputs("hardswish"), peer=_hardswish_peer), sharding=_rule,
           node=True, check=contract.check_hardswish, results=contract.hardswish_results,
           providers=provided(_BACKENDS, lambda m: m.HARDSWISH)),
    OpSpec("hardswish_backward", "aclnnHardswishBackward", True, example=_example("hardswish_backward"),
           golden=Golden(("out",), (), _golden_inputs("hardswish_backward"), peer=_backward_peer),
           timing=BENCH, sharding=_backward_rule, check=contract.check_hardswish_backward,
           results=contract.hardswish_backward_results, providers=provided(_BACKENDS, lambda m: m.HARDSWISH_BACKWARD)),
)
HARDSWISH, HARDSWISH_BACKWARD = SPECS
