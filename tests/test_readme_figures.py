"""The README's performance table says what bench/results/ says: each row below opens its
"measured" cell with the figures of the results file it quotes, formatted as the README does.
Re-measuring without updating the README fails here (the rows' comparisons with earlier runs
are prose and are not checked)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("deepseek-v3-44MB", "qwen3-30b-a3b-9.4MB", "small-4.7MB")


def results(name: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / f"{name}.json").read_text())["results"]


def joined(values: Iterable[float], digits: int) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values)


def engine(metric: str) -> list[float]:
    d = results("delivery-cuda")
    return [d[f"{s}/engine"][metric] for s in SHAPES]


def decode(name: str) -> str:
    return joined((r["offload"]["tokens_per_s"] for r in results(name)["runs"]), 1) + " tok/s"


def transformers(name: str) -> str:
    runs = results(name)["offload"]
    return (joined((r["tokens_per_s"]["1"] for r in runs), 1) + " tok/s ("
            + joined((r["tokens_per_s"]["8"] for r in runs), 1) + ")")


def activations(name: str) -> str:
    """8 KiB and 256 KiB to 0.1 ms, 4 MiB to the ms."""
    p50 = [v["agent_p50_us"] / 1e3 for v in results(name)["round_trips"].values()]
    return f"{joined(p50[:2], 1)} / {p50[2]:.0f} ms"


def cache() -> str:
    mix = results("cache-mixtral-8x7b-humaneval-sample")
    olmoe = results("cache-olmoe-1b-7b-layer0-gsm8k")
    at64 = mix["hit_rate"]["reuse"][mix["sizes"].index(64)]
    return (f"{at64:.3f}; {mix['mean_fraction_of_min']['reuse']:.3f} / "
            f"{olmoe['mean_fraction_of_min']['reuse']:.3f}")


def cpu_delivery() -> str:
    r = results("delivery-cpu")["small-4.7MB/engine"]
    return (f"{r['agent_delivery_gbps']:.1f} GB/s, acquire-to-ready p50 "
            f"{r['acquire_to_ready_p50_ms']:.2f} ms, inference-process CPU "
            f"{r['client_cpu_s_per_gb']:.3f} s per GB")


def placement() -> str:
    cases = {(c["gpus"], c["replicas"]): c for c in results("placement")["cases"]}
    big = cases[(64, 64)]
    return (f"{big['balance_vs_lpt']:.3f}x, {big['moved_vs_scratch']:.2f}x; "
            f"{cases[(8, 0)]['rebalance_ms']:.0f} / {cases[(64, 0)]['rebalance_ms']:.0f} ms")


ROWS: dict[str, Callable[[], str]] = {
    "arena -> GPU slots, batches of 8 experts": lambda: joined(
        engine("agent_delivery_gbps"), 1) + " GB/s",
    "same, device pull (copy-engine thread in the client)": lambda: joined(
        (results("delivery-cuda")[s]["agent_delivery_gbps"] for s in SHAPES), 1) + " GB/s",
    "acquire-to-ready p50 (p99), 44 / 9.4 / 4.7 MB, DMA engine": lambda: " / ".join(
        f"{p50:.2f} ({p99:.2f})" for p50, p99 in zip(engine("acquire_to_ready_p50_ms"),
                                                     engine("acquire_to_ready_p99_ms"),
                                                     strict=True)) + " ms",
    "acquire of an expert already READY": lambda: joined(
        engine("ready_hit_p50_us"), 0) + " us",
    "inference-process CPU per GB": lambda: joined(engine("client_cpu_s_per_gb"), 3) + " s",
    "agent CPU per GB": lambda: joined(engine("agent_cpu_s_per_gb")[:2], 3) + " s",
    "agent CPU per ACQUIRE": lambda: joined(
        (results(f"agent-requests-cpu-{d}")["miss_agent_us"] for d in ("engine", "pull")), 1)
        + " us per miss",
    "decode, Qwen3-30B-A3B experts, 2 layers x 16": lambda: decode(
        "decode-qwen3-30b-a3b-cuda-engine"),
    "same, 128 experts per layer": lambda: decode("decode-qwen3-30b-a3b-cuda-engine-128experts"),
    "decode, DeepSeek-V3 experts": lambda: decode("decode-deepseek-v3-lite-cuda-engine"),
    "transformers `generate()`, Qwen3-30B-A3B shapes": lambda: transformers(
        "transformers-decode-qwen3-30b-a3b-cuda"),
    "same, OLMoE-1B-7B shapes": lambda: transformers(
        "transformers-decode-olmoe-1b-7b-cuda-olmoe-1b-7b-layer0-gsm8k"),
    "same, Mixtral-8x7B shapes": lambda: transformers(
        "transformers-decode-mixtral-8x7b-cuda-mixtral-8x7b-humaneval-sample"),
    "same, Qwen3-30B-A3B shapes, pre-gated prefetch": lambda: transformers(
        "transformers-decode-qwen3-30b-a3b-cuda-prefetch"),
    "same with pre-gated prefetch, OLMoE-1B-7B shapes": lambda: transformers(
        "transformers-decode-olmoe-1b-7b-cuda-prefetch"),
    "arena cache hit rate": cache,
    "activation round trip p50 through the agent": lambda: activations("activations-cpu"),
    "same, GPU worker (resident receiver)": lambda: activations("activations-cuda"),
    "same, GPU worker, its thread driving the kernels": lambda: activations(
        "activations-cuda-thread"),
    "steering lookups": lambda: f"{results('steering')['lookups_per_second'] / 1e6:.2f} M/s",
    "placement rebalance (58 layers x 256 experts)": placement,
    "delivery on the CPU reference device": cpu_delivery,
    "cluster rebalance 3 -> 4 agents": lambda: (
        f"{results('cluster')['peers']['rebalance_converge_s'] * 1e3:.0f} ms"),
}


def measured(row_start: str) -> str:
    """The "measured" cell of the performance-table row whose first cell opens so."""
    rows = [line.split("|")[2].strip() for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| " + row_start)]
    assert len(rows) == 1, f"{len(rows)} README rows open with {row_start!r}"
    return rows[0]


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_readme_row_quotes_its_results_file(row: str) -> None:
    want = ROWS[row]()
    assert measured(row).startswith(want), f"README: {measured(row)[:80]!r}; results: {want!r}"
