"""transformers' own expert parallelism with gradops (issue 13): a tiny Mixtral loaded with
``DistributedConfig(ep_size=2, ...)`` over 2 gloo processes, gradops' experts inside transformers' exchanges and
gradops' exchange (``ep_implementation="gradops"``), each result equal to one process running the same model."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads a distributed model through accelerate")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

import hf_ep_workers as w  # noqa: E402 (after the skips: it is useless without transformers)

WORLD = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    w.save_model(path)
    return path


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    """Every scenario of hf_ep_workers in 2 spawned processes; the directory of what they saved."""
    import gradops.transformers

    gradops.transformers.register()
    out = tmp_path_factory.mktemp("ep")
    try:
        mp.start_processes(w.run, args=(WORLD, str(out / "store"), str(model_dir), str(out)), nprocs=WORLD,
                           join=True, start_method="spawn")
    except mp.ProcessRaisedException:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("error-*.txt")))
        pytest.fail(f"a rank failed:\n{errors}")
    return out


def saved(out, scenario: str) -> list[dict]:
    return [torch.load(out / f"{scenario}-{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("implementation", ["gradops", "all_to_all"])
def test_fsdp_and_expert_parallel_training_equals_one_process(ranks, model_dir, implementation):
    """Each rank half of the batch, experts split over the ranks: the mean loss and the gradients (gathered) equal
    one process over the whole batch within float32 rounding (FSDP averages per-rank gradients, one process sums
    per-token ones: measured (torch 2.13 CPU) loss 4.8e-7 apart at ~4.2, gradients <= 1.5e-8 with transformers'
    exchange and bit for bit with gradops'; the bounds leave ~5x). With gradops' exchange a second step gives
    the same bits."""
    whole = w.step(w.load(model_dir), w.batch())
    got = saved(ranks, f"fsdp-{implementation}")
    torch.testing.assert_close((got[0]["loss"] + got[1]["loss"]) / 2, whole["loss"], rtol=1e-6, atol=0)
    for name in w.GRADS:
        assert torch.equal(got[0][name], got[1][name]), name
        torch.testing.assert_close(got[0][name], whole[name], rtol=1e-5, atol=1e-8, msg=name)
    if implementation == "gradops":
        assert all(bool(g["repeatable"]) for g in got)


def test_tensor_and_expert_parallel_training_with_the_gradops_exchange_equals_one_process(ranks, model_dir):
    """TP + EP: the ranks share the batch and gradops' exchange sends each one's slice of it. The tensor-parallel
    attention sums its partial products in another order, so a gradient entry may differ by a few float32 ulps of
    the largest entry it is summed with: measured (torch 2.13 CPU, transformers 5.23, 2026-11-24) at most 2.8, 3.1
    and 4.0 ulps of each tensor's largest entry (4.5e-8 of 0.136 for the embedding); the bound is 8."""
    whole = w.step(w.load(model_dir), w.batch())
    ulp = torch.finfo(torch.float32).eps
    for got in saved(ranks, "tp-gradops"):
        torch.testing.assert_close(got["loss"], whole["loss"], rtol=1e-6, atol=0)
        for name in w.GRADS:
            bound = 8 * ulp * float(whole[name].abs().max())
            torch.testing.assert_close(got[name], whole[name], rtol=0, atol=bound, msg=name)


def test_inference_over_a_shared_batch_runs_gradops_experts_with_sentinels(ranks, model_dir):
    """transformers' all-reduce EP hands each rank's experts every token, off-rank routes as sentinels (measured:
    logits <= 1.2e-7 apart, the all-reduce adds the ranks' partial outputs in another order)."""
    with torch.no_grad():
        logits = w.load(model_dir)(input_ids=w.batch()).logits
    for got in saved(ranks, "infer-auto"):
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts", ["gradops", "eager"])
def test_a_rank_whose_experts_get_no_rows_still_joins_the_backward(ranks, model_dir, experts):
    """Every route to rank 0's experts: rank 1's experts receive nothing, and its backward must still run the
    reverse exchange (else both ranks hang: ``"eager"`` experts skip empty input without touching a weight, so
    without the zero row kept in the graph rank 1 never joins the backward's all-to-all). Output and every
    gradient equal one process: bit for bit with gradops' experts (each expert gets the same rows in the same
    order as in one process and the merge sums the K copies in the same order), within float32 rounding with
    ``"eager"`` (called top-1 with unit weights, the weighting moves to the merge; measured <= 1.2e-8)."""
    whole = w.direct(w.load(model_dir, experts=experts))
    for got in saved(ranks, f"direct-{experts}"):
        assert set(got) == set(whole)
        for name, value in whole.items():
            if experts == "gradops":
                assert torch.equal(got[name], value), name
            else:
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7, msg=name)


def test_register_adds_the_gradops_expert_parallel_implementation():
    from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

    import gradops.transformers

    gradops.transformers.register()
    cls = EPImplementationInterface()[gradops.transformers.EP]
    assert issubclass(cls, EPImplementation) and cls is gradops.transformers.expert_parallel_class()


def test_the_example_trains_expert_parallel_beside_one_process():
    """examples/transformers_expert_parallel.py (the README's command): 2 ranks, 3 steps, agreement printed."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "examples" / "transformers_expert_parallel.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "4 of 8 experts per rank, ep_implementation='gradops'" in done.stdout
    assert ": agree" in done.stdout
