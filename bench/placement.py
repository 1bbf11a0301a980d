"""Placement planner at DeepSeek-V3 scale (58 MoE layers x 256 experts, 44 MB experts): Zipf
loads that drift between windows, for 8, 16 and 64 GPUs with and without redundant experts.

Figures per case: max_load_ratio of the plan against a greedy LPT packing of the same load
(the baseline, measured in the same run), bytes moved per rebalance against re-planning from
scratch (placing the new LPT packing as is), planning time (initial and rebalance).
Targets: balance within 2% of LPT; bytes moved at most half of scratch; planning at most 50 ms
(8 GPUs) and 500 ms (64 GPUs). The planner's compiled loops are loaded (or compiled) before the
clock starts, as the agent does at start.

Usage: python bench/placement.py [--windows N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, envelope, figure, median, save_figure, write
from dpu_agent.planning.placement import plan, warm_up
from dpu_offload.cli_args import positive

LAYERS, EXPERTS, EXPERT_BYTES = 58, 256, 44_050_944


def drifting_loads(windows: int, seed: int = 0) -> list[np.ndarray]:
    """Zipf(1.0) popularity per layer over a random ranking; between windows each expert's
    rate moves by up to +-30% and 4 pairs of ranks swap per layer."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, EXPERTS + 1)
    ranks = [rng.permutation(EXPERTS) for _ in range(LAYERS)]
    loads = []
    for _ in range(windows):
        for r in ranks:
            for _ in range(4):
                i, j = rng.integers(0, EXPERTS, 2)
                r[i], r[j] = r[j], r[i]
        rate = np.stack([base[np.argsort(r)] for r in ranks]) * rng.uniform(0.7, 1.3, (LAYERS,
                                                                                 EXPERTS))
        loads.append(rng.poisson(rate * 4096 * 8 / rate.sum(axis=1, keepdims=True)
                                 ).astype(np.float64))
    return loads


def case(loads: list[np.ndarray], gpus: int, replicas: int) -> dict[str, float]:
    t0 = time.perf_counter()
    current = plan(loads[0], gpus, replicas=replicas, expert_bytes=EXPERT_BYTES)
    first_ms = (time.perf_counter() - t0) * 1e3
    ratios, lpt_ratios, moved, scratch, times = [], [], [], [], []
    for load in loads[1:]:
        t0 = time.perf_counter()
        new = plan(load, gpus, replicas=replicas, current=current.assignment,
                   expert_bytes=EXPERT_BYTES)
        times.append((time.perf_counter() - t0) * 1e3)
        fresh = plan(load, gpus, replicas=replicas, expert_bytes=EXPERT_BYTES)
        ratios.append(new.max_load_ratio)
        lpt_ratios.append(fresh.max_load_ratio)
        moved.append(new.bytes_moved)
        scratch.append(sum(len(set(fresh.assignment[la][e]) - set(current.assignment[la][e]))
                           for la in range(LAYERS) for e in range(EXPERTS)) * EXPERT_BYTES)
        current = new
    return {"gpus": gpus, "replicas": replicas, "max_load_ratio": median(ratios),
            "lpt_max_load_ratio": median(lpt_ratios),
            "balance_vs_lpt": median([r / b for r, b in zip(ratios, lpt_ratios, strict=True)]),
            "bytes_moved": median(moved), "scratch_bytes_moved": median(scratch),
            "moved_vs_scratch": median([m / s if s else 0.0
                                        for m, s in zip(moved, scratch, strict=True)]),
            "plan_ms": first_ms, "rebalance_ms": median(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=positive, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loads = drifting_loads(max(2, args.windows))
    warm_up()
    rows = []
    for gpus in (8, 16, 64):
        for replicas in (0, gpus):
            r = case(loads, gpus, replicas)
            rows.append(r)
            print(f"{gpus:3d} GPUs +{replicas:3d} replicas: ratio {r['max_load_ratio']:.4f} "
                  f"(LPT {r['lpt_max_load_ratio']:.4f}, x{r['balance_vs_lpt']:.4f})  moved "
                  f"{r['bytes_moved'] / 1e9:7.1f} GB vs scratch "
                  f"{r['scratch_bytes_moved'] / 1e9:7.1f} ({r['moved_vs_scratch']:.2f})  "
                  f"plan {r['plan_ms']:.0f} ms  rebalance {r['rebalance_ms']:.0f} ms",
                  file=sys.stderr)
    data = envelope("placement", {"cases": rows}, windows=len(loads),
                    command="python bench/placement.py " + " ".join(sys.argv[1:]))
    path = write("placement", data)
    plot(rows, RESULTS / "placement.png")
    print(json.dumps(data) if args.json else f"wrote {path}")
    return 0


def plot(rows: list[dict[str, float]], path: Path) -> None:
    fig, (a, b) = figure(2, (10, 4))
    for replicas_on in (False, True):
        sel = [r for r in rows if bool(r["replicas"]) == replicas_on]
        label = "with replicas" if replicas_on else "no replicas"
        a.plot([r["gpus"] for r in sel], [r["max_load_ratio"] for r in sel], "o-",
               label=f"planner, {label}")
        a.plot([r["gpus"] for r in sel], [r["lpt_max_load_ratio"] for r in sel], "x--",
               label=f"LPT, {label}")
        b.plot([r["gpus"] for r in sel], [r["bytes_moved"] / 1e9 for r in sel], "o-",
               label=f"planner, {label}")
        b.plot([r["gpus"] for r in sel], [r["scratch_bytes_moved"] / 1e9 for r in sel], "x--",
               label=f"from scratch, {label}")
    a.set(xscale="log", xlabel="GPUs", ylabel="max load / mean", title="load balance")
    b.set(xscale="log", xlabel="GPUs", ylabel="GB moved per rebalance", title="bytes moved")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
