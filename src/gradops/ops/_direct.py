"""Custom ops whose eager calls skip the ``torch.library`` boundary when nothing needs it.

Going through a custom op costs about 60 µs of Python dispatch per call on CPU, and about 110 µs more when
its autograd formula records the call (measured with torch 2.13 at a small model's sizes: a hardswish forward
+ backward of 512 x 192 took 199 µs through the ops against 54 µs in ATen; an RMSNorm backward of 1024 x 96
took 117 µs through ``torch.ops.gradops.rms_norm_grad``, 55 µs in its body). The boundary is needed only by
something that watches or transforms the call: torch.compile / export / torch.jit.trace tracing, fake and
functional tensors, dispatch and function modes, functorch transforms and the legacy vmap of batched gradients,
tensor subclasses, meta tensors, tensors with a lazy negation or conjugation bit, and the profiler (so that
traces still name ``gradops::<op>``). When none of these is active, :class:`DirectOp` runs the op body - the
op's single dispatch point, which validates and picks the backend - directly, or, when autograd records the
call, through a ``torch.autograd.Function`` built from the same setup_context / backward pair the op
registers. Results are the same bits either way (tests/test_direct.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

_PLAIN = (Tensor, torch.nn.Parameter)

#: What :func:`eager_path` answers: run through the op, run the body, run the autograd.Function.
OP, BODY, FUNCTION = "op", "body", "function"


def eager_path(*args: object) -> str:
    """Which path a call with ``args`` may take (see the module docstring)."""
    # Dispatch modes: the per-thread stack for user modes (the global flag is_in_torch_dispatch_mode reads can be
    # cleared by another thread leaving its mode), the flag for infra modes (fake, functional, proxy) kept beside it.
    # The profiler: the C++ state, which also sees a profiler started without torch.profiler's Python wrapper.
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or is_in_torch_dispatch_mode()
            or torch.autograd._profiler_enabled() or torch._C._is_torch_function_mode_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None or torch._C._get_tracing_state() is not None):
        return OP
    grad = torch.is_grad_enabled()
    path = BODY
    for a in args:
        if isinstance(a, Tensor):
            # Exact types only: a subclass (DTensor, a user's wrapper) has its own __torch_dispatch__ to honour. The
            # op resolves a lazy negation / conjugation (``z.conj().imag``) before its body sees the data; the legacy
            # vmap of ``autograd.grad(is_grads_batched=True)`` wraps plain tensors and needs the op's batching.
            if (type(a) not in _PLAIN or a.is_meta or a.is_neg() or a.is_conj()
                    or torch._C._functorch.is_legacy_batchedtensor(a)):
                return OP
            if grad and a.requires_grad:
                path = FUNCTION
    return path


def own(*results: Tensor) -> Any:
    """A body's results as tensors that are not autograd views (``detach``: 0.3 µs each, no copy).

    Results are fresh, but often views of the backend's buffer (a 2-D result viewed in the caller's shape, a pooled
    int16 buffer viewed as float16). An op whose outputs are views refuses in-place changes to them under
    autograd ("Output 0 of rms_norm is a view and is being modified inplace"), which torch's own norms allow.
    One result comes back as a tensor, several as a tuple.
    """
    return results[0].detach() if len(results) == 1 else tuple(t.detach() for t in results)


class DirectOp:
    """``torch.library.custom_op(name)`` over ``body``, callable like the op with an eager fast path.

    ``register_fake`` and ``register_autograd`` register on the custom op; the latter also builds the eager
    ``torch.autograd.Function`` from the same pair of functions, so both paths share one formula.
    """

    def __init__(self, name: str, body: Callable[..., Any]) -> None:
        self.body = body
        self.op = torch.library.custom_op(name, mutates_args=())(body)
        self.function: type[torch.autograd.Function] | None = None

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fn)

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        self.op.register_autograd(backward, setup_context=setup_context)
        body = self.body

        # forward(ctx, *args) rather than a setup_context staticmethod: with the latter, Function.apply binds the
        # arguments through inspect.signature on every call (~10 µs).
        def forward(ctx: Any, *args: object) -> Any:
            output = body(*args)
            setup_context(ctx, args, output)
            return output

        name = body.__name__.removesuffix("_body").lstrip("_")
        self.function = type(name, (torch.autograd.Function,),
                             {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args: object, check: Callable[..., object] | None = None) -> Any:
        """Run the op on positional ``args``.

        ``check``: the op's validation, run before the custom op (the body runs it itself): the op's schema would
        answer a None or a mistyped scalar with a bare RuntimeError before the body could raise OpError.
        """
        path = eager_path(*args)
        if path == BODY:
            return self.body(*args)
        if path == FUNCTION and self.function is not None:
            return self.function.apply(*args)
        if check is not None:
            check(*args)
        return self.op(*args)
