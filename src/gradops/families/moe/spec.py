"""The MoE token permute family (aclnnMoeTokenPermute / Unpermute and their gradients): their declarations (see
:mod:`gradops.spec`)."""

from __future__ import annotations

import torch

from ...spec import Bench, Example, Golden, OpSpec, Timed, autograd, provided
from . import contract, reference

#: Experts per token in the examples (Mixtral's top-2).
TOP_K = 2
#: Expert ids are drawn as int64: a count must stay below this.
INDEX_LIMIT = 1 << 63


def _token_of_row(perm: torch.Tensor, k: int) -> torch.Tensor:
    """The token each permuted row came from (Megatron's bookkeeping: row ``perm[i]`` holds token ``i // k``)."""
    token_of_row = torch.empty(perm.numel(), dtype=torch.long, device=perm.device)
    token_of_row[perm.long()] = torch.arange(perm.numel(), device=perm.device) // k
    return token_of_row


def _unpermute(permuted, perm, probs):
    """Megatron's unfused unpermute: gather each token's K rows, weight, sum over k."""
    t, k = probs.shape
    picked = permuted.index_select(0, perm.long()).view(t, k, -1)
    return (picked.float() * probs.float()[:, :, None]).sum(1).to(permuted.dtype)


def _example(op):
    def example(m, n, dtype, device, gen):
        k = TOP_K

        def rnd(*shape):
            return torch.randn(shape, generator=gen).to(dtype).to(device)
        if op == "moe_token_permute":
            tokens, experts = rnd(m, n), torch.randint(0, 8, (m, k), generator=gen).to(device)

            def twin(t, e, rows):
                first = torch.argsort(e.flatten(), stable=True)
                return t[first[:rows] // k], torch.argsort(first).int()
            return Example((tokens, experts, m * k), (1, 0), twin)
        if op == "moe_token_permute_grad":
            grad, perm = rnd(m * k, n), torch.randperm(m * k, generator=gen).int().to(device)

            def index_add(grad, perm, k):  # Megatron's unfused backward: scatter-add rows to their tokens
                return (grad.new_zeros(m, n).index_add_(0, _token_of_row(perm, k), grad),)
            return Example((grad, perm, k), (k,), index_add)
        permuted, probs = rnd(m * k, n), torch.rand(m, k, generator=gen).to(dtype).to(device)
        perm = torch.randperm(m * k, generator=gen).int().to(device)
        if op == "moe_token_unpermute":
            return Example((permuted, perm, probs), (k,), lambda *a: (_unpermute(*a),))
        dy = rnd(m, n)
        return Example((permuted, dy, perm, probs), (1, n),
                       lambda p, dy, s, pr: autograd(lambda p, pr: _unpermute(p, s, pr), (p, pr), dy))
    return example


def _golden_inputs(op):
    def inputs(shape, dtype, draw, opts):
        if len(shape) != 2:
            draw.fail(f"{op}: --shape must be TxH (tokens x hidden), got {'x'.join(map(str, shape))}")
        t, h = shape
        k = int(opts.get("topk", 2))
        experts = int(opts.get("experts", 8))
        if not 1 <= k <= 512 or not 1 <= experts < INDEX_LIMIT:
            draw.fail(f"{op}: --topk must be in [1, 512] and --experts >= 1 (below 2^63), got {k} and {experts}")
        ids = torch.randint(0, experts, (t, k), generator=draw.gen)
        if t > 1:
            ids[1::5, :] = ids[1::5, :1]  # duplicate experts within a token: ties keep token order
        if op == "moe_token_permute":
            return {"tokens": draw.normal(t, h), "indices": ids.to(draw.index_dtype()),
                    "num_out_tokens": int(opts.get("num_out_tokens", 0))}
        sorted_indices = reference.moe_token_permute(torch.zeros(t, 0), ids, 0)[1]
        if op == "moe_token_permute_grad":
            return {"permuted_output_grad": draw.normal(t * k, h), "sorted_indices": sorted_indices, "num_topk": k}
        probs = torch.softmax(torch.randn(t, k, generator=draw.gen, dtype=torch.float64), -1).to(dtype)
        if op == "moe_token_unpermute":
            return {"permuted_tokens": draw.normal(t * k, h), "sorted_indices": sorted_indices, "probs": probs}
        return {"permuted_tokens": draw.normal(t * k, h), "grad_unpermuted": draw.normal(t, h),
                "sorted_indices": sorted_indices, "probs": probs}
    return inputs


def _permute_oracle(ref_args, args, like):
    t, k = args[1].shape[0], args[1].shape[1] if args[1].dim() == 2 else 1
    return reference.moe_token_permute(ref_args[0], ref_args[1], like[0].shape[0] if t * k else 0)


def _prepare_permute_grad(shape, dtype, device):
    t, k, h = shape["T"], shape["K"], shape["H"]
    grad = torch.randn(t * k, h, dtype=dtype, device=device)
    sorted_indices = torch.randperm(t * k, device=device).to(torch.int32)  # CANN's: destination row of (t, k)
    token_of_row = _token_of_row(sorted_indices, k)
    return Timed((grad, sorted_indices, k),
                 lambda: torch.zeros(t, h, dtype=dtype, device=device).index_add_(0, token_of_row, grad),
                 (reference.moe_token_permute_grad, (grad, sorted_indices, k)))


def _prepare_unpermute_grad(shape, dtype, device):
    t, k, h = shape["T"], shape["K"], shape["H"]
    permuted = torch.randn(t * k, h, dtype=dtype, device=device)
    grad = torch.randn(t, h, dtype=dtype, device=device)
    sorted_indices = torch.randperm(t * k, device=device).to(torch.int32)
    probs = torch.rand(t, k, dtype=dtype, device=device)
    # The eager twin: autograd of the unpermute written in torch ops (gather the K copies of each token, weight,
    # sum), the graph built once and its backward replayed; index_select's backward is an index_add_ into zeros.
    p_leaf, w_leaf = permuted.clone().requires_grad_(), probs.clone().requires_grad_()
    with torch.enable_grad():
        picked = p_leaf.index_select(0, sorted_indices.long()).view(t, k, h)
        merged = (picked * w_leaf.unsqueeze(-1)).sum(1)
    args = (permuted, grad, sorted_indices, probs)
    return Timed(args, lambda: torch.autograd.grad(merged, (p_leaf, w_leaf), grad, retain_graph=True),
                 (reference.moe_token_unpermute_grad, args))


_SHAPES = {
    "cpu": [{"T": 8192, "K": 8, "H": 2048}],
    "cuda": [{"T": 16384, "K": 2, "H": 4096}, {"T": 4096, "K": 8, "H": 7168}, {"T": 8192, "K": 8, "H": 4096}],
    "quick": [{"T": 256, "K": 4, "H": 256}], "gpu-check": [{"T": 8192, "K": 8, "H": 4096}],
    "dry": [{"T": 8, "K": 2, "H": 32}],
}


def _sizes(rows, cols, vocab, top_k):
    return {"T": rows, "K": top_k, "H": cols}


def _rows(s):
    return s["T"] * s["K"] * s["H"]


PERMUTE_GRAD = Bench("moe_token_permute_grad", _SHAPES, _sizes, _prepare_permute_grad,
                     lambda s, e: s["T"] * s["K"] * s["H"] * e + s["T"] * s["H"] * e + 4 * s["T"] * s["K"], _rows,
                     "index_add_ into zeros (Megatron)")
UNPERMUTE_GRAD = Bench("moe_token_unpermute_grad", _SHAPES, _sizes, _prepare_unpermute_grad,
                       lambda s, e: (2 * s["T"] * s["K"] * s["H"] * e + s["T"] * s["H"] * e + 4 * s["T"] * s["K"]
                                     + 2 * s["T"] * s["K"] * e), _rows,
                       "autograd of index_select, weight, sum")


def _permute_rule(R, P, Shard):
    def rule(tokens, indices, num_out_tokens, padded_mode):
        return [([R, R], [R, R, None, None]), ([Shard(1), R], [Shard(1), R, None, None])]
    return rule


def _permute_grad_rule(R, P, Shard):
    def rule(permuted_output_grad, sorted_indices, num_topk, padded_mode):
        return [([R], [R, R, None, None]), ([Shard(1)], [Shard(1), R, None, None])]
    return rule


def _unpermute_rule(R, P, Shard):
    def rule(permuted_tokens, sorted_indices, probs, padded_mode):
        p = None if probs is None else R
        return [([R], [R, R, p, None]), ([Shard(1)], [Shard(1), R, p, None])]
    return rule


def _unpermute_grad_rule(R, P, Shard):
    def rule(permuted_tokens, grad_unpermuted, sorted_indices, probs, padded_mode):
        if probs is None:  # the second result is an empty (0,) placeholder on every rank
            return [([R, R], [R, R, R, None, None]), ([Shard(1), R], [Shard(1), Shard(1), R, None, None])]
        return [([R, R], [R, R, R, R, None]), ([Shard(1), P], [Shard(1), Shard(1), R, R, None])]
    return rule


_MOE_OPTIONS = ("topk", "experts")


def _cpu():
    """The family's compiled CPU kernels (importing them loads or builds the native extension)."""
    from . import cpu

    return cpu


def _triton():
    """The family's Triton launchers (importing them needs triton)."""
    from . import launch

    return launch


#: The family's module for each backend: where each op's implementation (gradops.spec.Impl) is.
_BACKENDS = {"torch": lambda: reference, "cpu": _cpu, "triton": _triton}


#: The family's declarations, in the tables' order; each is also the module's constant of its name.
SPECS = (
    OpSpec("moe_token_permute", "aclnnMoeTokenPermute", False, example=_example("moe_token_permute"),
           golden=Golden(("permuted_tokens", "sorted_indices"), (*_MOE_OPTIONS, "num_out_tokens", "index_dtype"),
                         _golden_inputs("moe_token_permute"), oracle=_permute_oracle, index_dtypes=("int64", "int32"),
                         views=False),
           sharding=_permute_rule,
           check=contract.check_moe_token_permute, results=contract.moe_token_permute_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_PERMUTE)),
    OpSpec("moe_token_permute_grad", "aclnnMoeTokenPermuteGrad", True, example=_example("moe_token_permute_grad"),
           golden=Golden(("out",), _MOE_OPTIONS, _golden_inputs("moe_token_permute_grad"), views=False),
           timing=PERMUTE_GRAD, sharding=_permute_grad_rule, cann_args={"padded_mode": "paddedModeOptional"},
           check=contract.check_moe_token_permute_grad, results=contract.moe_token_permute_grad_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_PERMUTE_GRAD)),
    OpSpec("moe_token_unpermute", "aclnnMoeTokenUnpermute", False, example=_example("moe_token_unpermute"),
           golden=Golden(("out",), _MOE_OPTIONS, _golden_inputs("moe_token_unpermute"), views=False),
           sharding=_unpermute_rule, cann_args={"probs": "probsOptional"},
           check=contract.check_moe_token_unpermute, results=contract.moe_token_unpermute_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_UNPERMUTE)),
    OpSpec("moe_token_unpermute_grad", "aclnnMoeTokenUnpermuteGrad", True,
           example=_example("moe_token_unpermute_grad"),
           golden=Golden(("grad_permuted_tokens", "grad_probs"), _MOE_OPTIONS,
                         _golden_inputs("moe_token_unpermute_grad"), views=False),
           timing=UNPERMUTE_GRAD, sharding=_unpermute_grad_rule,
           cann_args={"permuted_tokens": "permutedTokensOptional", "grad_unpermuted": "unpermutedTokensGrad",
                      "probs": "probsOptional"},
           check=contract.check_moe_token_unpermute_grad, results=contract.moe_token_unpermute_grad_results,
           providers=provided(_BACKENDS, lambda m: m.MOE_TOKEN_UNPERMUTE_GRAD)),
)
MOE_TOKEN_PERMUTE, MOE_TOKEN_PERMUTE_GRAD, MOE_TOKEN_UNPERMUTE, MOE_TOKEN_UNPERMUTE_GRAD = SPECS
