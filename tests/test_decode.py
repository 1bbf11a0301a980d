"""The decode benchmark on the CPU reference device: a few tokens, offloaded experts through
the agent, outputs equal to the dense reference of the same layers (asserted inside run)."""

from __future__ import annotations

from bench.decode import run


def test_decode_outputs_equal_dense_reference_and_figures_are_sane() -> None:
    r = run("qwen3-30b-a3b", [0.25, 1.0], None, tokens=3, layers=2, experts=8, shrink=8)
    low, full = r["runs"]
    assert low["slots"] < full["slots"] == 16
    assert full["hit_rate"] >= low["hit_rate"]
    for run_ in r["runs"]:
        assert run_["offload"]["tokens_per_s"] > 0 and run_["bytes_fetched_per_token"] >= 0
