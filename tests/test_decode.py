"""The decode benchmark on the CPU reference device: a few tokens, offloaded experts through
the agent, outputs equal to the dense reference of the same layers (asserted inside run); the
GPU tests run it through the DMA engine with either wait."""

from __future__ import annotations

import pytest

from bench.decode import run


def test_decode_outputs_equal_dense_reference_and_figures_are_sane() -> None:
    """Two offload runs per fraction, each from cold slots: the median (of two, the faster)
    is the one reported."""
    r = run("qwen3-30b-a3b", [0.25, 1.0], None, tokens=3, layers=2, experts=8, shrink=8,
            repeats=2)
    low, full = r["runs"]
    assert low["slots"] < full["slots"] == 16
    assert full["hit_rate"] >= low["hit_rate"]
    for run_ in r["runs"]:
        off = run_["offload"]
        assert off["tokens_per_s"] > 0 and run_["bytes_fetched_per_token"] >= 0
        assert len(off["tokens_per_s_all"]) == 2
        assert off["tokens_per_s"] == max(off["tokens_per_s_all"])


def test_the_timeline_orders_each_layers_steps() -> None:
    """``timeline=True``: the first offload run of each fraction records every layer (tokens x
    layers records), each expert's host steps in order after the batch's grant and before
    the layer's wait for its kernels ended, the release last."""
    r = run("qwen3-30b-a3b", [0.5], None, tokens=2, layers=2, experts=8, shrink=8,
            timeline=True)
    (run_,) = r["runs"]
    records = run_["timeline"]
    assert [(rec["token"], rec["layer"]) for rec in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rec in records:
        assert len(rec["host"]) == len(rec["experts"]) == r["top_k"] and rec["gpu"] == []
        steps = [rec["begun"]] + [t for h in rec["host"] for t in h] + [rec["synced"],
                                                                         rec["released"]]
        assert steps == sorted(steps) and steps[0] >= 0


def test_with_prefetch_every_moved_byte_is_counted() -> None:
    """Without prefetch the agent moves exactly the misses' bytes; with next-layer prefetch
    (each layer's visit reported on the data plane) it moves at least those, with no gRPC call,
    and the outputs still equal the dense reference."""
    plain = run("qwen3-30b-a3b", [0.5], None, tokens=4, layers=2, experts=8, shrink=8)
    ahead = run("qwen3-30b-a3b", [0.5], None, tokens=4, layers=2, experts=8, shrink=8,
                prefetch=2)
    (p,), (a,) = plain["runs"], ahead["runs"]
    assert p["bytes_moved_per_token"] == p["bytes_fetched_per_token"]
    assert a["bytes_moved_per_token"] >= a["bytes_fetched_per_token"]
    assert p["offload"]["grpc_calls_per_token"] == a["offload"]["grpc_calls_per_token"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("wait", ["stream", "host"])
def test_gpu_decode_through_the_dma_engine_equals_the_dense_reference(wait: str) -> None:
    """On the GPU, each expert waited for on the compute stream (its FFN enqueued behind the
    wait) or on the host: the outputs equal the resident run's (asserted inside run) and the
    waits are counted apart from the expert compute."""
    pytest.importorskip("cupy")
    r = run("qwen3-30b-a3b", [0.25], None, tokens=3, layers=2, experts=8, shrink=8,
            device="cuda", delivery="engine", wait=wait)
    (run_,) = r["runs"]
    assert r["wait"] == wait
    assert run_["hit_rate"] < 1 and run_["offload"]["wait_s_per_token"] > 0
    assert run_["offload"]["gpu_compute_s_per_token"] > 0
    timed = run("qwen3-30b-a3b", [0.25], None, tokens=2, layers=2, experts=8, shrink=8,
                device="cuda", delivery="engine", wait=wait, timeline=True)
    for rec in timed["runs"][0]["timeline"]:
        # Per expert on the GPU: before the fetch <= READY <= FFN done <= accumulated.
        assert all(g == sorted(g) for g in rec["gpu"]) and len(rec["gpu"]) == len(rec["experts"])
