"""aclnnMoeTokenPermute, aclnnMoeTokenPermuteGrad and the unpermute pair on the CPU: the host entries of the native
kernels ``moe_token_permute``, ``moe_token_permute_grad``, ``moe_token_unpermute`` and ``moe_token_unpermute_grad``
(moe_permute.cpp: the permute's counting sort and row gather, gather-sums of each token's K rows and
the scatter of their gradients; no zero-fill, no atomics: each output row has one writer), and of the routing-map
ops' kernels (the same file: each op's slot tables in integer passes, then the same gather-sums and scatters).

Byte models: permute ``T·K·H·s + T·K·(s_idx + 4)`` (a token's row is read once per copy, from cache); permute
grad and unpermute ``T·K·H·s_in + T·H·s_out + T·K·s_idx`` (+ ``T·K·s_p`` for probs); unpermute grad
``T·H·s_g + A·H·(s_x + s_dx) + T·K·(s_idx + s_p + s_dp)`` (the gradient row of a token is read once per pass over
its K copies, from cache).
"""

from __future__ import annotations

from torch import Tensor

from ...contract._common import Outputs, written
from ...cpu._host import allocate, dense, finish, kernel, output
from ...cpu.programs import Program, arg
from ...spec import Impl
from . import routing_reference as routing
from .contract import (
    MoeShape,
    expert_id_error,
    moe_token_permute_grad_results,
    moe_token_permute_results,
    moe_token_unpermute_grad_results,
    moe_token_unpermute_results,
    negative_id_error,
    permutation_error,
    sorted_index_error,
)
from .routing_contract import (
    RouteShape,
    moe_token_permute_with_routing_map_grad_results,
    moe_token_permute_with_routing_map_results,
    moe_token_unpermute_with_routing_map_grad_results,
    moe_token_unpermute_with_routing_map_results,
)


def _permute_run(tokens: Tensor, indices: Tensor, permuted: Tensor, inverse: Tensor, k: int) -> None:
    idx = dense(indices)
    bad = kernel("moe_token_permute", (dense(tokens), idx), (permuted, inverse), (k,))
    if bad >= 0:
        raise negative_id_error(idx) or expert_id_error("a value changed again before it could be shown", -1)


def moe_token_permute(tokens: Tensor, indices: Tensor, num_rows: int, *,
                      out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenPermute: ``tokens (T, H)``, expert ids ``indices (T, K)`` or ``(T,)`` -> ``(permuted (num_rows,
    H), sorted_indices (T·K,) int32)`` with ``permuted[sorted_indices[i]] = tokens[i // K]`` for the kept rows
    (sorted_indices = the ranks of the stable sort of the flattened ids, CANN's convention).

    Args:
        tokens: (T, H) float32/float16/bfloat16.
        indices: int32 / int64 ids >= 0 (a counting sort over their span, a comparison sort when it is wide); a
            negative id raises OpError 161002 before anything is written.
        num_rows: the first rows of the permuted order to keep (<= T·K).
        out: optional preallocated ``(permuted, sorted_indices)``.
    """
    h = tokens.shape[1]
    total = indices.numel()
    k = indices.shape[1] if indices.dim() == 2 else 1
    specs = written(moe_token_permute_results(MoeShape(total // k, k, h, num_rows), tokens, indices))
    permuted, inverse = (output(None if out is None else out[i], *spec) for i, spec in enumerate(specs))
    _permute_run(tokens, indices, permuted, inverse, k)
    if out is None:
        return permuted, inverse
    return finish(permuted, out[0]), finish(inverse, out[1])


def moe_token_permute_shaped(outputs: Outputs, shape: MoeShape, tokens: Tensor, indices: Tensor,
                             num_out_tokens: int | None, padded_mode: bool = False) -> tuple[Tensor, Tensor]:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones)."""
    permuted, inverse = allocate(outputs, (tokens, indices, num_out_tokens, padded_mode))
    _permute_run(tokens, indices, permuted, inverse, shape.topk)
    return permuted, inverse


def _permute_grad_run(grad: Tensor, sorted_indices: Tensor, num_topk: int, buf: Tensor) -> None:
    idx = dense(sorted_indices)
    bad = kernel("moe_token_permute_grad", (dense(grad), idx), (buf,), (num_topk,))
    if bad >= 0:
        raise permutation_error(idx, "moe_token_permute_grad") or sorted_index_error(
            "a value changed again before it could be shown", -1, sorted_indices.numel())


def moe_token_permute_grad(grad: Tensor, sorted_indices: Tensor, num_topk: int, *, trusted: bool = False,
                           out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenPermuteGrad: ``grad[A,H]``, checked ``sorted_indices[T·K]`` -> ``out[T,H]`` (grad's dtype).

    Args:
        grad: (A, H) float32/float16/bfloat16.
        sorted_indices: (T·K,) int32 or int64, CANN's convention, a permutation of [0, T·K): an entry outside it
            or a repeated one raises OpError 161002 before anything is read with it or written. Never trusted,
            whatever ``trusted`` says: the kernel reads rows with the entries, and its one bitmap pass
            (T·K·(s_idx + 1) bytes against the sums' T·K·H·s) is what keeps those reads in bounds.
        num_topk: K.
        out: optional preallocated (T, H).

    Returns:
        The (T, H) token gradient.
    """
    total = sorted_indices.numel()
    shape = MoeShape(total // num_topk, num_topk, grad.shape[1], grad.shape[0])
    (spec,) = written(moe_token_permute_grad_results(shape, grad, sorted_indices, num_topk))
    buf = output(out, *spec)
    _permute_grad_run(grad, sorted_indices, num_topk, buf)
    return finish(buf, out)


def moe_token_permute_grad_shaped(outputs: Outputs, shape: MoeShape, grad: Tensor, sorted_indices: Tensor,
                                  num_topk: int, padded_mode: bool = False, *, checked: bool = False) -> Tensor:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones). The
    permutation test runs in the kernel whatever ``checked`` says (it is cheap here)."""
    (buf,) = allocate(outputs, (grad, sorted_indices, num_topk, padded_mode))
    _permute_grad_run(grad, sorted_indices, num_topk, buf)
    return buf


def _unpermute_run(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None, buf: Tensor) -> None:
    weights = None if probs is None else dense(probs)
    bad = kernel("moe_token_unpermute", (dense(permuted_tokens), dense(sorted_indices), weights), (buf,))
    if bad >= 0:
        raise permutation_error(sorted_indices, "moe_token_unpermute")


def moe_token_unpermute(permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None, *,
                        out: Tensor | None = None) -> Tensor:
    """aclnnMoeTokenUnpermute: ``(A, H)`` rows, ``sorted_indices (T·K,)``, ``probs (T, K)`` or None (K = 1)
    -> ``out (T, H)`` in permuted_tokens' dtype.

    sorted_indices must be a permutation of [0, T·K) (CANN: no repeated index), checked in the kernel in one
    bitmap pass before anything is read with it (OpError 161002).
    """
    total = sorted_indices.numel()
    topk = 1 if probs is None else probs.shape[1]
    shape = MoeShape(total // topk, topk, permuted_tokens.shape[1], permuted_tokens.shape[0])
    (spec,) = written(moe_token_unpermute_results(shape, permuted_tokens, sorted_indices, probs))
    buf = output(out, *spec)
    _unpermute_run(permuted_tokens, sorted_indices, probs, buf)
    return finish(buf, out)


def moe_token_unpermute_shaped(outputs: Outputs, shape: MoeShape, permuted_tokens: Tensor, sorted_indices: Tensor,
                               probs: Tensor | None, padded_mode: bool = False) -> Tensor:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones)."""
    (buf,) = allocate(outputs, (permuted_tokens, sorted_indices, probs, padded_mode))
    _unpermute_run(permuted_tokens, sorted_indices, probs, buf)
    return buf


def _unpermute_grad_run(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                        probs: Tensor | None, trusted: bool, dx: Tensor, dp: Tensor) -> None:
    weights = None if probs is None else dense(probs)
    bad = kernel("moe_token_unpermute_grad",
                 (dense(permuted_tokens), dense(grad_unpermuted), dense(sorted_indices), weights), (dx, dp),
                 (0 if trusted else 1,))
    if bad >= 0:
        raise permutation_error(sorted_indices, "moe_token_unpermute_grad")


def moe_token_unpermute_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor, sorted_indices: Tensor,
                             probs: Tensor | None, *, trusted: bool = False,
                             out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteGrad -> ``(grad_permuted (A, H) in permuted_tokens' dtype, grad_probs (T, K) in
    probs' dtype)``; without probs the second is an empty tensor of permuted_tokens' dtype.

    sorted_indices: a permutation of [0, T·K), so that every row of grad_permuted is written once; checked here
    unless ``trusted`` (autograd's backward of this package's own forward, which checked it and whose saved copy
    autograd's version counter guards); an entry outside [0, A) is never read or written with either way.
    ``out``: optional preallocated pair (the second ignored without probs).
    """
    shape = MoeShape(grad_unpermuted.shape[0], 1 if probs is None else probs.shape[1], permuted_tokens.shape[1],
                     permuted_tokens.shape[0])
    dx_spec, dp_spec = written(moe_token_unpermute_grad_results(shape, permuted_tokens, grad_unpermuted,
                                                                sorted_indices, probs))
    dx = output(None if out is None else out[0], *dx_spec)
    dp = output(None if out is None or probs is None else out[1], *dp_spec)  # no probs: out[1] is not written
    _unpermute_grad_run(permuted_tokens, grad_unpermuted, sorted_indices, probs, trusted, dx, dp)
    if out is None:
        return dx, dp
    return finish(dx, out[0]), (finish(dp, out[1]) if probs is not None else dp)


def moe_token_unpermute_grad_shaped(outputs: Outputs, shape: MoeShape, permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                    sorted_indices: Tensor, probs: Tensor | None, padded_mode: bool = False, *,
                                    trusted: bool = False) -> tuple[Tensor, Tensor]:
    """The op as its public function takes it (see :mod:`gradops.ops._plan`; the shapes are the 2-D ones)."""
    dx, dp = allocate(outputs, (permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode))
    _unpermute_grad_run(permuted_tokens, grad_unpermuted, sorted_indices, probs, trusted, dx, dp)
    return dx, dp

# ---------------------------------------------------------------- the routing-map ops
# One kernel per op (moe_permute.cpp: the slot tables of gradops.families.moe.routing_reference built in integer passes,
# then the gather-sums above on them). A value the kernel refuses is raised by the same tables on the family
# kernels, the Python form of the op, which names it (docs/semantics.md §5b).
_TABLES = routing.ops_on(routing.Kernels(moe_token_permute, moe_token_permute_grad, moe_token_unpermute,
                                         moe_token_unpermute_grad))


def _refused(table_op, *args) -> None:
    """Raise the OpError of a call whose routing-map kernel refused a value: the slot tables' (a table that
    accepts what the kernel refused is gradops' bug, said as such)."""
    table_op(*args)
    raise RuntimeError("gradops: the routing-map kernel refused a value its slot tables accept; please report it")


def _detached(results: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The slot tables' results as the op returns them: not autograd views (gradops.ops._direct.own's rule; that
    module is not imported here, it would close an import cycle through the registry)."""
    return tuple(t.detach() for t in results)


def _optional(t: Tensor | None) -> Tensor | None:
    return None if t is None else dense(t)


def moe_token_permute_with_routing_map(tokens: Tensor, routing_map: Tensor, probs: Tensor | None,
                                       num_out_tokens: int | None, drop_and_pad: bool
                                       ) -> tuple[Tensor, Tensor, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMap on the CPU: ``(permuted (A, H), permuted_probs (A,), sorted_indices
    int32)``, permuted_probs an empty tensor of tokens' dtype without probs (see gradops.moe_token_permute_with_-
    routing_map for the layouts)."""
    t, h = tokens.shape
    e = routing_map.shape[1]
    wanted = t if num_out_tokens is None else num_out_tokens
    per = wanted // e if drop_and_pad else (wanted // t if t else 0)
    if not t or not per:
        return _TABLES[0](tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    args = (tokens, routing_map, probs, num_out_tokens, drop_and_pad)
    shape = RouteShape(t, e, h, per * (e if drop_and_pad else t), per)
    outs = [output(None, *spec) for spec in written(moe_token_permute_with_routing_map_results(shape, *args))]
    return _permute_with_routing_map_run(args, per, outs)


def _permute_with_routing_map_run(args: tuple, per: int, outs: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    tokens, routing_map, probs, _, drop_and_pad = args
    if kernel("moe_token_permute_with_routing_map", (dense(tokens), dense(routing_map), _optional(probs)), outs,
              (per, int(drop_and_pad))) >= 0:
        _refused(_TABLES[0], *args)
    return tuple(outs)


def moe_token_permute_with_routing_map_shaped(outputs: Outputs, shape: RouteShape, *args
                                              ) -> tuple[Tensor, Tensor, Tensor]:
    """The op on its call plan's outputs (see :mod:`gradops.ops._plan`)."""
    if not shape.tokens or not shape.per:
        return _detached(_TABLES[0](*args))
    return _permute_with_routing_map_run(args, shape.per, allocate(outputs, args))


def moe_token_permute_with_routing_map_grad(grad: Tensor, grad_probs: Tensor | None, sorted_indices: Tensor,
                                            routing_map: Tensor | None, num_experts: int, num_tokens: int,
                                            drop_and_pad: bool) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenPermuteWithRoutingMapGrad on the CPU: ``(tokens_grad (T, H), probs_grad (T, E))``, probs_grad an
    empty tensor of grad's dtype without grad_probs."""
    args = (grad, grad_probs, sorted_indices, routing_map, num_experts, num_tokens, drop_and_pad)
    if not num_tokens or not sorted_indices.numel():
        return _TABLES[1](*args)
    slots_of = num_experts if drop_and_pad else num_tokens  # per = total // slots_of: K, or C with drop_and_pad
    shape = RouteShape(num_tokens, num_experts, grad.shape[1], grad.shape[0],
                       sorted_indices.numel() // slots_of if slots_of else 0)
    outs = [output(None, *spec) for spec in written(moe_token_permute_with_routing_map_grad_results(shape, *args))]
    return _permute_with_routing_map_grad_run(args, outs)


def _permute_with_routing_map_grad_run(args: tuple, outs: list[Tensor]) -> tuple[Tensor, Tensor]:
    grad, grad_probs, sorted_indices, routing_map, num_experts, num_tokens, drop_and_pad = args
    if kernel("moe_token_permute_with_routing_map_grad",
              (dense(grad), _optional(grad_probs), dense(sorted_indices), _optional(routing_map)), outs,
              (num_experts, num_tokens, int(drop_and_pad))) >= 0:
        _refused(_TABLES[1], *args)
    return tuple(outs)


def moe_token_permute_with_routing_map_grad_shaped(outputs: Outputs, shape: RouteShape, *args
                                                   ) -> tuple[Tensor, Tensor]:
    """The op on its call plan's outputs (see :mod:`gradops.ops._plan`)."""
    if not args[5] or not args[2].numel():  # no token, no slot
        return _detached(_TABLES[1](*args))
    return _permute_with_routing_map_grad_run(args, allocate(outputs, args))


def _capacity(rows: int, probs: Tensor | None, routing_map: Tensor | None) -> int:
    """drop_and_pad's rows per expert C = A // E (0 where neither probs nor the map says E)."""
    known = probs if probs is not None else routing_map
    return rows // known.shape[1] if known is not None and known.shape[1] else 0


def _unpermute_shape(tokens: int, permuted_tokens: Tensor, sorted_indices: Tensor, probs: Tensor | None,
                     routing_map: Tensor | None, drop_and_pad: bool) -> RouteShape:
    """The view of an unpermute (or its gradient) on T tokens: E where probs or the map says it (else 0), A rows,
    K or C slots."""
    known = probs if probs is not None else routing_map
    experts = known.shape[1] if known is not None else 0
    rows = permuted_tokens.shape[0]
    per = _capacity(rows, probs, routing_map) if drop_and_pad else sorted_indices.numel() // tokens
    return RouteShape(tokens, experts, permuted_tokens.shape[1], rows, per)


def moe_token_unpermute_with_routing_map(permuted_tokens: Tensor, sorted_indices: Tensor, restore_shape,
                                         probs: Tensor | None, routing_map: Tensor | None, drop_and_pad: bool
                                         ) -> Tensor:
    """aclnnMoeTokenUnpermuteWithRoutingMap on the CPU: ``out (T, H)`` in permuted_tokens' dtype."""
    args = (permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad)
    tokens = restore_shape[0]
    if not tokens or not sorted_indices.numel():
        return _TABLES[2](*args)
    shape = _unpermute_shape(tokens, permuted_tokens, sorted_indices, probs, routing_map, drop_and_pad)
    (spec,) = written(moe_token_unpermute_with_routing_map_results(shape, *args))
    return _unpermute_with_routing_map_run(args, output(None, *spec))


def _unpermute_with_routing_map_run(args: tuple, out: Tensor) -> Tensor:
    permuted_tokens, sorted_indices, _, probs, routing_map, drop_and_pad = args
    if kernel("moe_token_unpermute_with_routing_map",
              (dense(permuted_tokens), dense(sorted_indices), _optional(probs), _optional(routing_map)), (out,),
              (int(drop_and_pad), _capacity(permuted_tokens.shape[0], probs, routing_map))) >= 0:
        _refused(_TABLES[2], *args)
    return out


def moe_token_unpermute_with_routing_map_shaped(outputs: Outputs, shape: RouteShape, *args) -> Tensor:
    """The op on its call plan's outputs (see :mod:`gradops.ops._plan`)."""
    if not args[2][0] or not args[1].numel():  # no token (restore_shape), no slot
        return _TABLES[2](*args).detach()
    (out,) = allocate(outputs, args)
    return _unpermute_with_routing_map_run(args, out)


def moe_token_unpermute_with_routing_map_grad(permuted_tokens: Tensor, grad_unpermuted: Tensor,
                                              sorted_indices: Tensor, probs: Tensor | None,
                                              routing_map: Tensor | None, drop_and_pad: bool
                                              ) -> tuple[Tensor, Tensor]:
    """aclnnMoeTokenUnpermuteWithRoutingMapGrad on the CPU: ``(grad_permuted (A, H), grad_probs (T, E))``,
    grad_probs an empty tensor of permuted_tokens' dtype without probs."""
    args = (permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad)
    if not grad_unpermuted.shape[0] or not sorted_indices.numel():
        return _TABLES[3](*args)
    shape = _unpermute_shape(grad_unpermuted.shape[0], permuted_tokens, sorted_indices, probs, routing_map,
                             drop_and_pad)
    outs = [output(None, *spec) for spec in written(moe_token_unpermute_with_routing_map_grad_results(shape, *args))]
    return _unpermute_with_routing_map_grad_run(args, outs)


def _unpermute_with_routing_map_grad_run(args: tuple, outs: list[Tensor]) -> tuple[Tensor, Tensor]:
    permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map, drop_and_pad = args
    if kernel("moe_token_unpermute_with_routing_map_grad",
              (dense(permuted_tokens), dense(grad_unpermuted), dense(sorted_indices), _optional(probs),
               _optional(routing_map)), outs,
              (int(drop_and_pad), _capacity(permuted_tokens.shape[0], probs, routing_map))) >= 0:
        _refused(_TABLES[3], *args)
    return tuple(outs)


def moe_token_unpermute_with_routing_map_grad_shaped(outputs: Outputs, shape: RouteShape, *args
                                                     ) -> tuple[Tensor, Tensor]:
    """The op on its call plan's outputs (see :mod:`gradops.ops._plan`)."""
    if not args[1].shape[0] or not args[2].numel():  # no token, no slot
        return _detached(_TABLES[3](*args))
    return _unpermute_with_routing_map_grad_run(args, allocate(outputs, args))


# ---------------------------------------------------------------- the direct calls' programs
# Each: the Python path above as the extension replays it (see gradops.cpu.programs; the op's call plan loads
# it): the same registered kernel on outputs of the same shapes, or None where the Python path does what a
# program does not.
def program_moe_token_permute(shape, tokens, indices, num_out_tokens, padded_mode):
    if not indices.numel() or tokens.dim() != 2:
        return None
    p = Program()
    out, inverse = p.declared(moe_token_permute_results(shape, tokens, indices, num_out_tokens, padded_mode))
    p.kernel("moe_token_permute", [arg(0), arg(1)], [out, inverse], [shape.topk])
    return p.returns(out, inverse)


def program_moe_token_permute_grad(shape, grad, sorted_indices, num_topk, padded_mode):
    tokens, h = sorted_indices.numel() // num_topk, grad.shape[1]
    if not tokens or not h:
        return None
    p = Program()
    (out,) = p.declared(moe_token_permute_grad_results(shape, grad, sorted_indices, num_topk, padded_mode))
    p.kernel("moe_token_permute_grad", [arg(0), arg(1)], [out], [num_topk])
    return p.returns(out)


def program_moe_token_unpermute(shape, permuted_tokens, sorted_indices, probs, padded_mode):
    h = permuted_tokens.shape[1]
    tokens = sorted_indices.numel() // (1 if probs is None else probs.shape[1])
    if not tokens or not h:
        return None
    p = Program()
    (out,) = p.declared(moe_token_unpermute_results(shape, permuted_tokens, sorted_indices, probs, padded_mode))
    p.kernel("moe_token_unpermute", [arg(0), arg(1), None if probs is None else arg(2)], [out])
    return p.returns(out)


def program_moe_token_unpermute_grad(shape, permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode):
    tokens = grad_unpermuted.shape[0]
    if not tokens or not permuted_tokens.shape[1]:
        return None
    p = Program()
    # Without probs: no probs gradient, an empty tensor of permuted_tokens' dtype (the Python path's).
    dx, dp = p.declared(moe_token_unpermute_grad_results(shape, permuted_tokens, grad_unpermuted, sorted_indices,
                                                         probs, padded_mode))
    p.kernel("moe_token_unpermute_grad", [arg(0), arg(1), arg(2), None if probs is None else arg(3)], [dx, dp], [1])
    return p.returns(dx, dp)


def _slots(*tensors: Tensor | None) -> list[tuple[int, int] | None]:
    """The kernel input slots of the op's tensor arguments, in order: None for an absent optional one (the call's
    tensors are counted over those present)."""
    slots, i = [], 0
    for t in tensors:
        slots.append(None if t is None else arg(i))
        i += t is not None
    return slots


def _routing_program(name: str, inputs: list, results: list, ints: list) -> Program:
    p = Program()
    made = p.declared(results)
    p.kernel(name, inputs, made, ints)
    return p.returns(*made)


def program_moe_token_permute_with_routing_map(shape, tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    if not shape.tokens or not shape.hidden or not shape.per:
        return None
    results = moe_token_permute_with_routing_map_results(shape, tokens, routing_map, probs, num_out_tokens,
                                                         drop_and_pad)
    return _routing_program("moe_token_permute_with_routing_map", _slots(tokens, routing_map, probs), results,
                            [shape.per, int(drop_and_pad)])


def program_moe_token_permute_with_routing_map_grad(shape, grad, grad_probs, sorted_indices, routing_map, num_experts,
                                           num_tokens, drop_and_pad):
    if not num_tokens or not shape.hidden or not sorted_indices.numel():
        return None
    results = moe_token_permute_with_routing_map_grad_results(shape, grad, grad_probs, sorted_indices, routing_map,
                                                              num_experts, num_tokens, drop_and_pad)
    return _routing_program("moe_token_permute_with_routing_map_grad",
                            _slots(grad, grad_probs, sorted_indices, routing_map), results,
                            [num_experts, num_tokens, int(drop_and_pad)])


def program_moe_token_unpermute_with_routing_map(shape, permuted_tokens, sorted_indices, restore_shape, probs,
                                                 routing_map, drop_and_pad):
    if not shape.tokens or not shape.hidden or not sorted_indices.numel():
        return None
    results = moe_token_unpermute_with_routing_map_results(shape, permuted_tokens, sorted_indices, restore_shape,
                                                           probs, routing_map, drop_and_pad)
    return _routing_program("moe_token_unpermute_with_routing_map",
                            _slots(permuted_tokens, sorted_indices, probs, routing_map), results,
                            [int(drop_and_pad), _capacity(shape.rows, probs, routing_map)])


def program_moe_token_unpermute_with_routing_map_grad(shape, permuted_tokens, grad_unpermuted, sorted_indices, probs,
                                             routing_map, drop_and_pad):
    if not shape.tokens or not shape.hidden or not sorted_indices.numel():
        return None
    results = moe_token_unpermute_with_routing_map_grad_results(shape, permuted_tokens, grad_unpermuted,
                                                                sorted_indices, probs, routing_map, drop_and_pad)
    return _routing_program("moe_token_unpermute_with_routing_map_grad",
                            _slots(permuted_tokens, grad_unpermuted, sorted_indices, probs, routing_map), results,
                            [int(drop_and_pad), _capacity(shape.rows, probs, routing_map)])


# ---------------------------------------------------------------- what the family's declarations provide
# Each op's implementation on this backend (gradops.spec.Impl), which its OpSpec's providers load.
MOE_TOKEN_PERMUTE = Impl(moe_token_permute, shaped=moe_token_permute_shaped)
MOE_TOKEN_PERMUTE_GRAD = Impl(moe_token_permute_grad, shaped=moe_token_permute_grad_shaped)
MOE_TOKEN_UNPERMUTE = Impl(moe_token_unpermute, shaped=moe_token_unpermute_shaped)
MOE_TOKEN_UNPERMUTE_GRAD = Impl(moe_token_unpermute_grad, shaped=moe_token_unpermute_grad_shaped)
MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP = Impl(moe_token_permute_with_routing_map,
                                          shaped=moe_token_permute_with_routing_map_shaped)
MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD = Impl(moe_token_permute_with_routing_map_grad,
                                               shaped=moe_token_permute_with_routing_map_grad_shaped)
MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP = Impl(moe_token_unpermute_with_routing_map,
                                            shaped=moe_token_unpermute_with_routing_map_shaped)
MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP_GRAD = Impl(moe_token_unpermute_with_routing_map_grad,
                                                 shaped=moe_token_unpermute_with_routing_map_grad_shaped)
