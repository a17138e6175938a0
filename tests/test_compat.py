"""A torch without one of the hooks gradops reads (docs/compat.md) still imports gradops and computes the same bits.

Each hook is hidden in a fresh child process before gradops is imported (tests/compat_probe.py: one interpreter
forks a child per hook): deleted from torch, as a torch release that lacks or renames it would lack it, and hidden
from gradops._compat, through which gradops reads every hook (only hidden there for the four hooks torch's own
internals read too). The results of every registry op, a gradops.nn training step and a torch.func gradient are
compared with those of a child where nothing is hidden.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("compat_probe.py")

#: The direct path's test (gradops.ops._direct._HOOK_PATHS): without any one of them every call takes the op path.
DIRECT_HOOKS = (
    "torch.compiler.is_compiling", "torch._C._len_torch_dispatch_stack",
    "torch.utils._python_dispatch.is_in_torch_dispatch_mode", "torch.autograd._profiler_enabled",
    "torch._C._is_torch_function_mode_enabled", "torch._C._functorch.peek_interpreter_stack",
    "torch._C._get_tracing_state", "torch._C._functorch.is_legacy_batchedtensor",
)
#: The rest: the C++ apply and functorch-wrapper test of the FUNCTION path, the transform types, the vmap rule, the
#: DTensor rules, the OpenMP flag of the native build.
OTHER_HOOKS = (
    "torch._C._FunctionBase", "torch._C._functorch.is_functorch_wrapped_tensor", "torch._C._functorch.TransformType",
    "CustomOpDef.register_vmap", "torch.distributed.tensor.experimental.register_sharding", "torch._C.has_openmp",
)


@pytest.fixture(scope="module")
def probed() -> dict[str | None, dict]:
    """hook -> its child's report (None: the baseline)."""
    env = dict(os.environ)
    env.pop("GRADOPS_BACKEND", None)  # the default backend, as a user gets it
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(PROBE), *DIRECT_HOOKS, *OTHER_HOOKS], capture_output=True, text=True,
                          env=env, timeout=600)
    reports = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
            reports[report["hook"]] = report
    assert None in reports, f"the baseline failed: exit {done.returncode}\n{done.stderr[-3000:]}"
    return reports


def test_gradops_compat_module_is_a_leaf():
    """gradops._compat is imported by the op and native modules: it must import nothing of gradops (no cycle)."""
    source = Path(__file__).parents[1].joinpath("src", "gradops", "_compat.py").read_text()
    assert "from ." not in source and "import gradops" not in source


def test_hooks_are_read_through_gradops_compat():
    """The direct path's hooks are those the test hides, and no gradops module reads one of them but through
    gradops._compat (a read that bypasses it escapes the hiding, and fails on a torch without the hook)."""
    from gradops.ops import _direct

    assert tuple(_direct._HOOK_PATHS) == DIRECT_HOOKS
    src = Path(__file__).parents[1] / "src" / "gradops"
    for path in src.rglob("*.py"):
        if path.name == "_compat.py":
            continue
        with tokenize.open(path) as f:  # the code's names, without strings and comments
            code = " ".join(t.string for t in tokenize.generate_tokens(f.readline)
                            if t.type in (tokenize.NAME, tokenize.OP))
        for hook in DIRECT_HOOKS + OTHER_HOOKS:
            name = hook.rsplit(".", 1)[-1]
            assert not re.search(rf"\btorch (?:\. \w+ )*\. {name}\b", code), f"{path} reads {hook} directly"


@pytest.mark.parametrize("hook", DIRECT_HOOKS + OTHER_HOOKS)
def test_hidden_hook_keeps_import_and_results(hook, probed):
    baseline, got = probed[None], probed.get(hook)
    assert got is not None and "error" not in got, (got or {}).get("error", f"no report for {hook}")
    assert got["results"] == baseline["results"], f"results differ with {hook} hidden"
    if hook in DIRECT_HOOKS:  # the direct path says why it is off, naming the hook
        assert got["disabled"] is not None and hook in got["disabled"], got["disabled"]
    if hook.endswith("register_sharding"):
        assert "register_sharding" in (got["sharding"] or "")
    assert baseline["disabled"] is None or baseline["disabled"] == "GRADOPS_EAGER=0"
