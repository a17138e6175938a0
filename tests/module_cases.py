"""float64 cases of the gradops.nn modules, shared by tests/test_float64.py (gradcheck) and
tests/test_double_backward.py (gradgradcheck): one table, so the two files test the same modules."""

from __future__ import annotations

import torch

import gradops.nn as gnn

F64 = torch.float64


def x64(*shape):
    return torch.randn(*shape, dtype=F64, requires_grad=True)


def hardswish_input(*shape):
    """Values in [-5, 5] kept 1e-3 away from the kinks at -3 and 3 (finite differences step 1e-6)."""
    n = 1
    for s in shape:
        n *= s
    x = torch.linspace(-5, 5, n, dtype=F64).reshape(shape) + 0.0123
    assert float((x.abs() - 3).abs().min()) > 1e-3
    return x.requires_grad_()


IDX = torch.tensor([[1, 5, 1], [0, 2, 1]])

#: name -> () -> (module, its inputs): the norms, hardswish and embedding (whose torch twins support double
#: backward).
MODULES = {
    "RMSNorm": lambda: (gnn.RMSNorm(8).double(), (x64(3, 8),)),
    "RMSNorm-eps-none-no-affine": lambda: (gnn.RMSNorm(8, eps=None, elementwise_affine=False).double(), (x64(3, 8),)),
    "RMSNorm-2d": lambda: (gnn.RMSNorm((2, 4)).double(), (x64(3, 2, 4),)),
    "LayerNorm": lambda: (gnn.LayerNorm(8).double(), (x64(3, 8),)),
    "LayerNorm-no-bias": lambda: (gnn.LayerNorm(8, bias=False).double(), (x64(2, 3, 8),)),
    "LayerNorm-2d": lambda: (gnn.LayerNorm((2, 4)).double(), (x64(3, 2, 4),)),
    "Hardswish": lambda: (gnn.Hardswish(), (hardswish_input(5, 8),)),
    "Embedding": lambda: (gnn.Embedding(6, 4).double(), (IDX,)),
}


def as_function(table: dict, name: str):
    """Module ``name`` of ``table`` as a function of its float inputs and parameters (random values: a fresh
    norm's ones and zeros would hide gamma's and beta's part), and those tensors; a tuple result gives its first
    item."""
    module, inputs = table[name]()
    names = [n for n, _ in module.named_parameters()]
    params = [torch.randn_like(p).requires_grad_() for p in module.parameters()]
    spots = [i for i, t in enumerate(inputs) if t.is_floating_point()]  # the differentiable inputs, in place

    def f(*tensors):
        args = list(inputs)
        for i, t in zip(spots, tensors):
            args[i] = t
        out = torch.func.functional_call(module, dict(zip(names, tensors[len(spots):])), tuple(args))
        return out[0] if isinstance(out, tuple) else out

    return f, (*(inputs[i] for i in spots), *params)
