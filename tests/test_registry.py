"""gradops.registry: the one list of operators, and everything that must agree with it."""

from __future__ import annotations

import importlib

import pytest

import gradops
from gradops import check, env, reference
from gradops.registry import NAMES, OPS
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
