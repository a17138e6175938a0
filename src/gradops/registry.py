"""The operators: one list, collected from the families' declarations (``families/<family>/spec.py``), that the
command line (``check``, ``golden``, ``env``, ``bench``), the measurements, the sharding rules, the CANN surfaces'
argument names, the tests and the backends' coverage read.

Each entry of :data:`OPS` is an operator the backends implement (its declaration's ``providers``: ``torch``,
``cpu``, ``triton``; a backend it does not list leaves it to the reference, see :mod:`gradops.backend`) and that
the package exports as a public function of its name. :data:`SPECS` adds the
ops no backend implements (``gradops.embedding``, the lookup: a gather with its backward attached).
"""

from __future__ import annotations

from .families import DECLARATIONS
from .spec import Bench, OpSpec

#: Every declared op: each declaration module :mod:`gradops.families` lists declares its ``SPECS``, in that order
#: (tests/test_op_spec.py: every family folder is listed).
SPECS: tuple[OpSpec, ...] = tuple(op for family in DECLARATIONS for op in family.SPECS)

#: The ops the backends implement.
OPS: tuple[OpSpec, ...] = tuple(spec for spec in SPECS if spec.kernels)

#: Their names, in the order above.
NAMES: tuple[str, ...] = tuple(op.name for op in OPS)

#: The ``gradops bench`` cases, in the order above: every backward operator is timed by one of them.
BENCH: tuple[str, ...] = tuple(dict.fromkeys(op.bench for op in OPS if op.bench))

#: The first backward op: the one whose backend decision a run's provenance records (every op decides alike).
PROBE: str = next(op.name for op in OPS if op.backward)

#: Each declaration by its op's name.
BY_NAME: dict[str, OpSpec] = {spec.name: spec for spec in SPECS}


def spec(name: str) -> OpSpec:
    """The declaration of op ``name``; KeyError for a name no family declares."""
    return BY_NAME[name]


def timing(case: str) -> tuple[Bench, OpSpec]:
    """The :class:`gradops.spec.Bench` of ``gradops bench`` case ``case`` and the op it belongs to (the first op
    declaring it)."""
    op = next(op for op in OPS if op.bench == case)
    return op.timing, op
