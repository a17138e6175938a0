"""An aclnn operator's C declaration: what ``gradops cann-home`` writes into its header and compiles into
``libopapi.so`` (:mod:`gradops.aclnn.capi`).

Each family's aclnn module declares its operators beside their Python phases, in CANN's own words::

    C_API = (CFunction(aclnnRmsNormGradGetWorkspaceSize, aclnnRmsNormGrad, "aclnn_rms_norm_grad.h",
                       "const aclTensor *dy, const aclTensor *x, ..."),)

The parameter list is the C one before ``workspaceSize`` and ``executor`` (every phase 1 ends with those two, every
phase 2 is ``(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)``); its names
are the Python phase 1's, in the same order (tests/test_capi.py holds each declaration to its function). The C types
say what the C surface converts each argument to before it calls the Python phase: nothing else is declared twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

#: C parameter type (without ``const`` and ``*``) -> the kind the C surface converts (gradops_capi.h's ``Kind``).
KINDS = {
    "aclTensor": "tensor",
    "aclIntArray": "int_array",
    "aclBoolArray": "bool_array",
    "aclFloatArray": "float_array",
    "int64_t": "int64",
    "uint64_t": "uint64",
    "double": "double",
    "float": "double",
    "bool": "bool",
}


@dataclass(frozen=True)
class Param:
    """One C parameter: ``ctype`` as written (``const aclTensor *``), ``name``, and the ``kind`` it converts as."""

    ctype: str
    name: str
    kind: str


def parse(signature: str) -> tuple[Param, ...]:
    """The parameters of a C parameter list (``"const aclTensor *x, double epsilon"``).

    Raises:
        ValueError: a parameter without a name or of a type the C surface does not convert.
    """
    params = []
    for part in signature.split(","):
        text = " ".join(part.replace("*", " * ").split())
        ctype, _, name = text.rpartition(" ")
        base = ctype.replace("const", "").replace("*", "").strip()
        if not name.isidentifier() or base not in KINDS:
            raise ValueError(f"cannot declare C parameter {part.strip()!r}: known types are {sorted(KINDS)}")
        pointer = "*" in ctype
        if pointer != base.startswith("acl"):
            raise ValueError(f"C parameter {part.strip()!r}: acl objects go by pointer, numbers by value")
        params.append(Param(ctype, name, KINDS[base]))
    return tuple(params)


@dataclass(frozen=True)
class CFunction:
    """One aclnn operator's C surface: its two Python phases, CANN's header name and the C parameters of phase 1."""

    phase1: Callable
    phase2: Callable
    header: str
    signature: str

    @property
    def name(self) -> str:
        """CANN's name of the operator (``aclnnRmsNormGrad``): its phase 2's."""
        return self.phase2.__name__

    @property
    def params(self) -> tuple[Param, ...]:
        """The parsed C parameters of phase 1 (before ``workspaceSize`` and ``executor``)."""
        return parse(self.signature)

    def mismatch(self) -> str | None:
        """How the declared names differ from the Python phase 1's parameters, or None when they agree."""
        declared = [p.name for p in self.params]
        python = list(inspect.signature(self.phase1).parameters)
        if declared != python:
            return f"{self.name}: C parameters {declared} but Python phase 1 takes {python}"
        if self.phase1.__name__ != self.name + "GetWorkspaceSize":
            return f"{self.name}: phase 1 is {self.phase1.__name__}"
        return None
