"""CANN aclnn status codes and the one exception type of gradops.

Every invalid input to a gradops operator raises :class:`OpError`, whose ``status`` is the code CANN's aclnn
API returns for the same mistake (``docs/zh/context/aclnn_return_code.md`` in hicann/ops-nn). The aclnn layer
(:mod:`gradops.aclnn`) runs the same validation and returns ``status`` instead of raising.
"""

from __future__ import annotations

from collections.abc import Callable

ACLNN_SUCCESS = 0
ACLNN_ERR_PARAM_NULLPTR = 161001
ACLNN_ERR_PARAM_INVALID = 161002
ACLNN_ERR_RUNTIME_ERROR = 361001
ACLNN_ERR_INNER = 561000
ACLNN_ERR_INNER_INFERSHAPE_ERROR = 561001
ACLNN_ERR_INNER_TILING_ERROR = 561002
ACLNN_ERR_INNER_FIND_KERNEL_ERROR = 561003
ACLNN_ERR_INNER_CREATE_EXECUTOR = 561101
ACLNN_ERR_INNER_NOT_TRANS_EXECUTOR = 561102
ACLNN_ERR_INNER_NULLPTR = 561103
ACLNN_ERR_INNER_WRONG_ATTR_INFO_SIZE = 561104
ACLNN_ERR_INNER_KEY_CONFLICT = 561105
ACLNN_ERR_INNER_INVALID_IMPL_MODE = 561106
ACLNN_ERR_INNER_OPP_PATH_NOT_FOUND = 561107
ACLNN_ERR_INNER_LOAD_JSON_FAILED = 561108
ACLNN_ERR_INNER_JSON_VALUE_NOT_FOUND = 561109
ACLNN_ERR_INNER_JSON_FORMAT_INVALID = 561110
ACLNN_ERR_INNER_PRE_ALLOC_FAILED = 561111
ACLNN_ERR_INNER_OP_NOT_REGISTERED = 561112
ACLNN_ERR_INNER_STATIC_WORKSPACE_INVALID = 561113
ACLNN_ERR_INNER_STATIC_BLOCK_DIM_INVALID = 561119

#: code -> constant name, for messages and for ``gradops.aclnn``.
STATUS_NAMES: dict[int, str] = {
    value: name for name, value in list(globals().items()) if name.startswith("ACLNN_")
}


class OpError(ValueError):
    """An operator refused its input.

    Attributes:
        status: the CANN aclnn status code of the refusal (161001 null, 161002 invalid, 561002 tiling, ...).
        op: the operator's name, e.g. ``"rms_norm_grad"``.
        arg: the argument at fault.
    """

    def __init__(self, status: int, op: str, arg: str, expected: str, given: str) -> None:
        self.status = status
        self.op = op
        self.arg = arg
        self.expected = expected
        self.given = given
        name = STATUS_NAMES.get(status, "UNKNOWN")
        super().__init__(f"{op}: {arg} must be {expected}, got {given} [{name} {status}]")

    def renamed(self, names: dict[str, str] | Callable[[str], str], op: str | None = None) -> OpError:
        """This error as another surface spells it: the argument's leading name through ``names`` (a mapping, or a
        function of the name: ``grad_output.dtype`` -> ``gradOutput.dtype``), and ``op`` if given; itself when
        nothing changes or it is a subclass."""
        head = self.arg.split(".", 1)[0].split("[", 1)[0]
        new = names(head) if callable(names) else names.get(head, head)
        if type(self) is not OpError or (new == head and op in (None, self.op)):
            return self
        return OpError(self.status, op or self.op, new + self.arg[len(head):], self.expected, self.given)

    def __reduce__(self):  # keep the fields across pickling (DDP workers, multiprocessing)
        return (OpError, (self.status, self.op, self.arg, self.expected, self.given))
