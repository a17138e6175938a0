"""gradops.registry: the one list of operators, and everything that must agree with it."""

from __future__ import annotations

import importlib

import pytest
import torch

import gradops
from gradops import check, env, reference
from gradops.registry import BENCH, NAMES, OPS
from samples import OPS as SAMPLED


def test_every_registered_op_is_public_sampled_checked_and_listed():
    assert len(set(NAMES)) == len(NAMES) == len(OPS)
    assert set(NAMES) <= set(gradops.__all__)
    assert set(SAMPLED) == set(NAMES)  # tests/samples.py has cases for every op and no other
    assert check.OPS == NAMES and env.OPS == NAMES


@pytest.mark.parametrize("backend_module", ["gradops.reference", "gradops.cpu", "gradops.launch"])
def test_every_backend_implements_the_registered_ops_or_leaves_them_to_the_reference(backend_module):
    try:
        module = importlib.import_module(backend_module)
    except ImportError as e:
        pytest.skip(f"{backend_module}: {e}")
    implemented = {name for name in NAMES if callable(getattr(module, name, None))}
    if module is reference:
        assert implemented == set(NAMES)
    # every op a backend has carries the registry's name (a misspelt one would silently fall back to torch)
    extra = {n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))
             and n.removesuffix("_workspace") not in NAMES and n.endswith(("_grad", "_backward", "_beta"))}
    assert not extra, f"{backend_module} has ops the registry does not know: {sorted(extra)}"


def test_every_backward_op_is_benchmarked_and_every_bench_case_is_registered():
    """Issue 12.6: ``gradops bench`` kept its own list of ops (moe_token_unpermute_grad was in no case); its cases,
    shapes and ``--op`` choices now come from the registry."""
    from gradops.bench import cases

    assert all(op.bench for op in OPS if op.backward) and not any(op.bench for op in OPS if not op.backward)
    assert cases.OPS == BENCH and set(cases.BUILDERS) == set(BENCH)
    for device, shapes in cases.SHAPES.items():
        assert set(shapes) == set(BENCH), device


@pytest.mark.parametrize("backend_module", ["gradops.reference", "gradops.cpu"])
def test_the_first_call_cost_covers_every_registered_op(backend_module):
    """``gradops bench --compile-cost`` timed a hand-written list that missed three ops; it times the registry's."""
    from gradops.bench.compile_cost import first_calls

    try:
        module = importlib.import_module(backend_module)
    except ImportError as e:
        pytest.skip(f"{backend_module}: {e}")
    calls = first_calls(module, torch.float32)
    assert tuple(calls) == NAMES
    for name, call in calls.items():
        assert call() is not None, name
