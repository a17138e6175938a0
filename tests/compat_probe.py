"""Run by tests/test_compat.py in a fresh interpreter: ``python tests/compat_probe.py [HOOK ...]``.

For the baseline (nothing hidden) and then each ``HOOK``, in a child forked from this process before gradops is
imported: delete the torch attribute ``HOOK`` names (as a torch release without it would lack it), import gradops,
call every registry op, train a step of gradops.nn modules, take a torch.func gradient, and print one JSON line: a
digest of every result's bits, and what the direct path says about itself. The parent imports torch
once, ~2 s that each child would otherwise pay again; gradops itself is imported in each child only.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

SHARDING = "torch.distributed.tensor.experimental.register_sharding"
#: Hooks that torch's own internals read as well (dynamo's import, functorch's dispatch, custom ops' registration):
#: deleting them would break torch itself, which a torch without them would not be, so they are only hidden from
#: gradops (gradops._compat.HIDDEN). Every other hook is both hidden and deleted from torch, so that a read of it
#: that bypasses gradops._compat fails here too.
TORCH_NEEDS = frozenset({"torch.compiler.is_compiling", "torch._C._functorch.peek_interpreter_stack",
                         "torch._C._get_tracing_state", "CustomOpDef.register_vmap"})


def hide(hook: str) -> None:
    """Hide ``hook`` from gradops (gradops._compat, loaded here before the rest of gradops) and, unless torch needs
    it itself, delete it from torch; a hook this torch does not have is an error (the test would test nothing)."""
    import importlib.util
    from pathlib import Path

    if hook == "CustomOpDef.register_vmap":
        from torch._library.custom_ops import CustomOpDef

        assert callable(getattr(CustomOpDef, "register_vmap", None)), hook
    else:
        parts = hook.split(".")
        owner = importlib.import_module(".".join(parts[:-1])) if hook == SHARDING else torch
        for name in parts[1:-1] if owner is torch else ():
            owner = getattr(owner, name)
        getattr(owner, parts[-1])  # raises AttributeError when missing
        if hook not in TORCH_NEEDS:
            delattr(owner, parts[-1])
    package = importlib.util.find_spec("gradops")
    assert package is not None and package.submodule_search_locations
    spec = importlib.util.spec_from_file_location("gradops._compat",
                                                  Path(package.submodule_search_locations[0]) / "_compat.py")
    assert spec is not None and spec.loader is not None
    compat = importlib.util.module_from_spec(spec)
    compat.HIDDEN = frozenset({hook})  # read by the module body (gradops._compat.HIDDEN)
    sys.modules["gradops._compat"] = compat
    spec.loader.exec_module(compat)


def digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1)
    if raw.is_floating_point():
        raw = raw.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[raw.element_size()])
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:16] + f"/{tuple(t.shape)}/{t.dtype}"


def results() -> dict[str, list[str]]:
    import gradops
    import gradops.nn as gnn
    from gradops.registry import OPS

    out: dict[str, list[str]] = {}
    for i, spec in enumerate(OPS):  # each op's declared example (gradops check's call)
        op = spec.name
        for dtype in (torch.float32, torch.bfloat16):
            case = spec.example(8, 64, dtype, torch.device("cpu"), torch.Generator().manual_seed(100 + i))
            got = getattr(gradops, op)(*case.args)
            out[f"{op} {dtype}"] = [digest(t) for t in (got if isinstance(got, tuple) else (got,))]
    # a recorded training step through every gradops.nn module (the autograd paths: Function, native node, op)
    torch.manual_seed(0)
    emb, norm, ln, act = gnn.Embedding(50, 32), gnn.RMSNorm(32), gnn.LayerNorm(32), gnn.Hardswish()
    ids = torch.randint(0, 50, (4, 6))
    x = emb(ids)
    y = act(ln(norm(x)))
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    params = [*emb.parameters(), *norm.parameters(), *ln.parameters()]
    out["nn step"] = [digest(y), *(digest(p.grad) for p in params)]
    # torch.func: the functorch path of the direct op
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    w = torch.randn(32, generator=torch.Generator().manual_seed(8))
    out["func.grad rms_norm"] = [digest(torch.func.grad(lambda x: gradops.rms_norm(x, w)[0].square().sum())(x))]
    return out


def probe(hook: str | None) -> None:
    """In a forked child: hide ``hook``, import gradops, print the report line."""
    if hook:
        hide(hook)
    got = results()
    from gradops import _compat
    from gradops.ops import _direct

    assert _compat.HIDDEN == ({hook} if hook else set()), "gradops imported another gradops._compat"

    report = {"hook": hook, "results": got, "disabled": _direct.DISABLED}
    if hook == SHARDING:  # DTensor users import gradops.distributed; it registers the rules
        import gradops.distributed  # noqa: F401
        from gradops.ops import _sharding

        report["sharding"] = _sharding.UNAVAILABLE
    print(json.dumps(report), flush=True)


def main(argv: list[str]) -> int:
    import os
    import traceback

    assert "gradops" not in sys.modules
    failed = 0
    for hook in [None, *argv[1:]]:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: its own torch to change, gradops imported afresh
            code = 0
            try:
                probe(hook)
            except BaseException:  # reported as the hook's failure, with its traceback
                traceback.print_exc()
                print(json.dumps({"hook": hook, "error": traceback.format_exc()[-3000:]}), flush=True)
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        failed += status != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
