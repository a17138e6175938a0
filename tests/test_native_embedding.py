"""gradops.native's Embedding node (gradops.nn.Embedding's eager CPU training path): bit for bit against the Python
path on every dtype, index dtype and code path of the backward, the index refusals, the double backward."""

from __future__ import annotations

import pytest
import torch

import gradops
import gradops.nn as gnn
from native_paths import DTYPES, both, on_threads, same, skip_unless_native, step

pytestmark = skip_unless_native

# (indices, table rows): fewer indices than rows (the sorting path: the table zeroed, the touched rows written), more
# (the counting sort, every row in fixed blocks), 4096 x 64 = 256 Ki table items (blocks split over the threads),
# 600 x 64 gradient items above the parallel threshold on the sorting path (runs split over the threads), 3-D
# indices, repeats of a few rows (row sums of several gradient rows), no index at all.
EMBEDDING_CASES = [((4, 7), 100), ((300,), 100), ((2, 3, 5), 16), ((5000,), 4096), ((600,), 4096), ((64,), 3),
                   ((0,), 10)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize(("shape", "rows"), EMBEDDING_CASES, ids=str)
@pytest.mark.parametrize("options", [(None, False), (3, False), (None, True), (-2, True)], ids=str)
def test_embedding_node_matches_python_path(shape, rows, index_dtype, dtype, options):
    padding_idx, scale = options
    if padding_idx is not None and padding_idx >= rows:
        padding_idx = rows - 1
    torch.manual_seed(0)
    module = gnn.Embedding(rows, 64 if rows >= 4096 else 24, padding_idx=padding_idx, scale_grad_by_freq=scale)
    module.to(dtype)
    indices = torch.randint(0, rows, shape, dtype=index_dtype)
    w = torch.randn(*shape, module.embedding_dim).to(dtype)
    name, _, ours, python = both(module, indices, lambda y: (y * w).sum())
    assert name == "gradops_native::EmbeddingBackward"
    same(ours, python)


@pytest.mark.parametrize("count", [1000, 6000], ids=["sorting", "counting-sort"])
def test_embedding_same_bits_on_any_number_of_threads(count):
    """Runs of one index far longer than a thread's share (8 distinct rows): on the sorting path a run belongs to
    the piece holding its first sorted position and is summed whole there, so 1 and 2 threads give the same bits;
    the counting sort's fixed row blocks likewise."""
    torch.manual_seed(0)
    module = gnn.Embedding(4096 if count < 4096 else 1024, 64)
    indices = torch.randint(0, 8, (count,))
    w = torch.randn(count, 64)

    def run():
        name, y, grads = step(module, indices, lambda y: (y * w).sum())
        assert name == "gradops_native::EmbeddingBackward"
        return [y, *grads]

    results = on_threads((1, 2), run)
    same(*results)
    _, _, ours, python = both(module, indices, lambda y: (y * w).sum())
    same(ours, python)


def test_embedding_indices_outside_the_table_are_refused():
    """The node tests the range before reading a row (forward); an index changed behind autograd's back after the
    forward (``.data``: no version bump) is refused by the backward's own test, with the op's OpError."""
    module = gnn.Embedding(10, 4)
    for bad in (torch.tensor([3, 10]), torch.tensor([[-1, 2]], dtype=torch.int32)):
        with pytest.raises(gradops.OpError) as err:
            module(bad)
        assert err.value.status == 161002
    for count in (3, 30):  # the sorting path, the counting sort
        indices = torch.randint(0, 10, (count,))
        y = module(indices)
        assert y.grad_fn.name() == "gradops_native::EmbeddingBackward"
        indices.data[1] = 10
        with pytest.raises(gradops.OpError, match="got 10 at flat position 1"):
            y.sum().backward()


def test_embedding_double_backward_and_other_index_dtypes():
    """create_graph=True records the op's differentiable backward (the weight's gradient is linear in the upstream
    gradient: its derivative is a gather); uint8 / float indices keep the Python path (CANN's conversion)."""
    torch.manual_seed(0)
    module = gnn.Embedding(20, 8)
    indices = torch.randint(0, 20, (30,))
    g = torch.randn(30, 8, requires_grad=True)
    y = module(indices)
    (dw,) = torch.autograd.grad(y, module.weight, g, create_graph=True)
    (dg,) = torch.autograd.grad((dw * dw).sum(), g)
    torch.testing.assert_close(dg, 2 * dw.detach()[indices], rtol=0, atol=0)
    for other in (indices.to(torch.uint8), indices.float()):
        assert "gradops_native" not in module(other).grad_fn.name()
