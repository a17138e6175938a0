"""The fuzz tier: hypothesis drives every public function on every CPU backend.

Bounded by default so the test command stays within CI's budget, and derandomized there, so a CI run is
reproducible (the same examples every run; a failure prints the one that broke). The long run draws fresh
random examples, many more of them::

    GRADOPS_FUZZ=long python -m pytest tests/fuzz -q -p no:cacheprovider        # ~2000 examples per test
    GRADOPS_FUZZ_EXAMPLES=500 python -m pytest tests/fuzz ...                     # any number
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = {"deadline": None, "database": None, "print_blob": True,
               "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.function_scoped_fixture]}
settings.register_profile("ci", max_examples=int(os.environ.get("GRADOPS_FUZZ_EXAMPLES", 60)), derandomize=True,
                          **_COMMON)
settings.register_profile("long", max_examples=int(os.environ.get("GRADOPS_FUZZ_EXAMPLES", 2000)), **_COMMON)
settings.load_profile("long" if os.environ.get("GRADOPS_FUZZ") == "long" else "ci")
