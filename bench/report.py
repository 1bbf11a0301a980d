"""Turn the latest results under bench/results/ into docs/PERFORMANCE.md: for each benchmark
the figure, its baseline from the same run, the ratio, the target and whether it is met, how it
was obtained (command, machine, date, repeats), and a flag when the result is older than the
code it describes (its source hash differs from the tree's).

Usage: python bench/report.py
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, ROOT, changed_since, source_hash
from bench.report_control import arm64, cache, cluster, load_bench, placement, rebalance
from bench.report_dataplane import (
    activations,
    agent_requests,
    decode,
    delivery,
    launch_after_sleep,
    moe_kernels,
    multi_gpu,
    slot_check,
    slot_pool,
    steering,
    transformers_decode,
    transformers_load,
)
from bench.report_rows import Row


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


SECTIONS: list[tuple[str, str, Callable[[dict[str, Any]], list[Row]], str]] = [
    ("Delivery, arena to GPU", "delivery-cuda", delivery, "delivery-cuda.png"),
    ("The agent's CPU per request, DMA-engine delivery (copies out of the way)",
     "agent-requests-cpu-engine", agent_requests, ""),
    ("The agent's CPU per request, device-pull delivery (a consumer that never runs)",
     "agent-requests-cpu-pull", agent_requests, ""),
    ("The agent's cost of finding a slot for a delivery", "slot-pool-cpu", slot_pool, ""),
    ("The GPU's check of a landed slot, by launch form", "slot_check-cuda", slot_check, ""),
    ("A kernel launch after the host thread slept", "launch_after_sleep-cuda",
     launch_after_sleep, ""),
    ("Dispatch / combine kernels", "moe_kernels-cuda", moe_kernels, ""),
    ("Cache policies, Mixtral trace", "cache-mixtral-8x7b-humaneval-sample", cache,
     "cache-mixtral-8x7b-humaneval-sample.png"),
    ("Cache policies, OLMoE trace", "cache-olmoe-1b-7b-layer0-gsm8k", cache,
     "cache-olmoe-1b-7b-layer0-gsm8k.png"),
    ("Placement planner", "placement", placement, "placement.png"),
    ("Rebalance and prefetch", "rebalance-cpu", rebalance, ""),
    ("Steering", "steering", steering, ""),
    ("Cluster mode (etcd, four agents on loopback)", "cluster", cluster, ""),
    ("Several GPUs under one host client", "multi_gpu-cuda", multi_gpu, ""),
    ("Several devices, CPU reference devices (the machinery, not GPU figures)",
     "multi_gpu-cpu", multi_gpu, ""),
    ("Activations (CPU reference worker)", "activations-cpu", activations,
     "activations-cpu.png"),
    ("Activations (GPU worker: the resident receiver, one persistent kernel)",
     "activations-cuda", activations, "activations-cuda.png"),
    ("Activations (GPU worker, its thread driving the packet kernels and the FFN)",
     "activations-cuda-thread", activations, "activations-cuda-thread.png"),
    ("Load", "load", load_bench, ""),
    ("Decode with offloaded experts, Qwen3-30B-A3B shapes", "decode-qwen3-30b-a3b-cuda",
     decode, "decode-qwen3-30b-a3b-cuda.png"),
    ("Decode, Qwen3-30B-A3B shapes, the DMA-engine process delivering",
     "decode-qwen3-30b-a3b-cuda-engine", decode, "decode-qwen3-30b-a3b-cuda-engine.png"),
    ("Decode, Qwen3-30B-A3B shapes, 128 experts per layer, DMA engine",
     "decode-qwen3-30b-a3b-cuda-engine-128experts", decode,
     "decode-qwen3-30b-a3b-cuda-engine-128experts.png"),
    ("Decode with offloaded experts, DeepSeek-V3 expert shapes",
     "decode-deepseek-v3-lite-cuda", decode, "decode-deepseek-v3-lite-cuda.png"),
    ("Decode, DeepSeek-V3 expert shapes, the DMA-engine process delivering",
     "decode-deepseek-v3-lite-cuda-engine", decode, "decode-deepseek-v3-lite-cuda-engine.png"),
    ("transformers generate(), Qwen3-30B-A3B shapes, offload_experts",
     "transformers-decode-qwen3-30b-a3b-cuda", transformers_decode,
     "transformers-decode-qwen3-30b-a3b-cuda.png"),
    ("transformers generate(), OLMoE-1B-7B shapes, the OLMoE routing trace replayed",
     "transformers-decode-olmoe-1b-7b-cuda-olmoe-1b-7b-layer0-gsm8k", transformers_decode,
     "transformers-decode-olmoe-1b-7b-cuda-olmoe-1b-7b-layer0-gsm8k.png"),
    ("transformers generate(), Mixtral-8x7B shapes, the Mixtral routing trace replayed",
     "transformers-decode-mixtral-8x7b-cuda-mixtral-8x7b-humaneval-sample", transformers_decode,
     "transformers-decode-mixtral-8x7b-cuda-mixtral-8x7b-humaneval-sample.png"),
    ("Loading a transformers model without its experts", "transformers-load",
     transformers_load, ""),
    ("Decode with offloaded experts (CPU reference device)", "decode-qwen3-30b-a3b-cpu",
     decode, "decode-qwen3-30b-a3b-cpu.png"),
    ("The agent on Arm", "arm64", arm64, ""),
]


def main() -> int:
    current = source_hash()
    out = ["# Performance", "",
           f"Generated by `bench/report.py` from bench/results/ (tree source {current}). Each "
           "section says how its figures were obtained; a result whose source hash differs from "
           "the tree's is marked **stale**: it describes older code (results that record their "
           "files name the ones changed since). Ratios are against a "
           "baseline measured in the same run.", ""]
    for title, name, fn, plot in SECTIONS:
        d = load(name)
        if d is None:
            out += [f"## {title}", "", f"No results yet (`{name}.json`).", ""]
            continue
        m = d["machine"]
        if m.get("gpu"):
            title += f" ({m['gpu']})"
        out += [f"## {title}", ""]
        where = m.get("gpu") or m.get("cpu") or m["arch"]
        stale = " **stale**" if d["source_hash"] != current else ""
        if stale and "source_files" in d:
            # The product's files first: the benchmarks' own changes say less of a result.
            changed = sorted(changed_since(d["source_files"]), key=lambda f: f.startswith("bench/"))
            stale += (f" (changed since: {', '.join(changed[:6])}"
                      + (f" and {len(changed) - 6} more" if len(changed) > 6 else "") + ")")
        out += [f"`{d.get('command', '')}` on {where} ({m['host']}, {m['cpus']} cores), "
                f"{d['date'][:16]} UTC, source {d['source_hash']}{stale}"
                + (f", repeats {d['repeats']}" if "repeats" in d else "") + ".", "",
                "| figure | measured | baseline (same run) | ratio | target | met |",
                "|---|---|---|---|---|---|"]
        for fig, meas, base, ratio, target, met in fn(d):
            mark = "" if met is None else "yes" if met else "**no**"
            out.append(f"| {fig} | {meas} | {base} | {ratio} | {target} | {mark} |")
        if plot and (RESULTS / plot).exists():
            out += ["", f"![{title}](../bench/results/{plot})"]
        out.append("")
    (ROOT / "docs" / "PERFORMANCE.md").write_text("\n".join(out))
    print("wrote docs/PERFORMANCE.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
