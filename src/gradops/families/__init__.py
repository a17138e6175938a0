"""The op families, one folder each: everything that is only that family's lives there.

A family folder holds the declaration (``spec.py``: what :mod:`gradops.registry` and every tool read), the
validation table (``contract.py``), the pure-torch reference (``reference.py``), the ``torch.library`` ops and the
public functions (``ops.py``), the CPU host entries and their C++ kernels (``cpu.py``, ``<family>.cpp``), the Triton
kernels and their launchers (``kernels.py``, ``launch.py``) and the CANN surfaces (``aclnn.py``, AscendC where CANN
has one). What the families share - the call plan, the executors, the vector layer, the output pool - lives outside
and names no op. docs/adding-an-op.md lists what a new family adds.

:data:`DECLARATIONS` lists the families' declaration modules in the order of every table (``gradops check``,
``gradops bench``, ``env``).
"""

from __future__ import annotations

from .embedding import spec as _embedding
from .hardswish import spec as _hardswish
from .layer_norm import spec as _layer_norm
from .moe import routing_spec as _moe_routing
from .moe import spec as _moe_permute
from .rms_norm import spec as _rms_norm
from .swiglu import spec as _swiglu

#: The declaration modules, each with its ``SPECS``, in the tables' order.
DECLARATIONS = (_rms_norm, _layer_norm, _hardswish, _embedding, _moe_permute, _moe_routing, _swiglu)
