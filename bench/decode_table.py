"""The console table and the plot of a bench/decode.py result."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import figure, save_figure


def plot(r: dict[str, Any], path: Path) -> None:
    """Tokens per second against the cache fraction, one line per path."""
    runs = sorted(r["runs"], key=lambda run: run["fraction"])
    x = [100 * run["fraction"] for run in runs]
    fig, ax = figure(size=(6.5, 4))
    for label, get, style in (
            ("offload (agent)", lambda run: run["offload"]["tokens_per_s"], "o-"),
            ("bound: missed bytes / pinned H2D", lambda run: run["bound_tokens_per_s"], "k:"),
            ("pageable copy on miss", lambda run: run["pageable"]["tokens_per_s"], "x--"),
            ("host-staged HTTP", lambda run: run["http"]["tokens_per_s"], "x--"),
            ("all resident", lambda run: run["resident_tokens_per_s"], "g-.")):
        ax.plot(x, [get(run) for run in runs], style, label=label)
    ax.set(yscale="log", xlabel="GPU expert cache (% of all experts)", ylabel="tokens/s",
           title=f"decode, {r['arch']} ({r['layers']} layers x {r['experts']} experts), "
                 f"{r['device']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def gpu_ratio(run: dict[str, Any], resident_gpu: float | None) -> str:
    """The run's expert-kernel GPU time over the resident run's ("-" without a GPU)."""
    gpu = run.get("gpu_compute_s_per_token")
    return f"{gpu / resident_gpu:.2f}" if gpu and resident_gpu else "-"


def beside_ratio(run: dict[str, Any], resident: float, resident_gpu: float | None) -> str:
    """The resident kernels' compute (GPU) time with the run's agent and engine up, over the
    resident run's before the agent started ("-" for results without it)."""
    beside = run.get("resident_beside_agent")
    if beside is None:
        return "-"
    return (f"{beside['compute_s_per_token'] / resident:.2f} "
            f"({gpu_ratio(beside, resident_gpu)})")


def print_table(r: dict[str, Any]) -> None:
    print(f"{r['arch']}: {r['layers']} layers x {r['experts']} experts, top-{r['top_k']}, "
          f"{r['tokens']} tokens; resident {r['resident']['tokens_per_s']:.1f} tok/s"
          + (f"; next-layer prefetch of {r['prefetch']}" if r.get("prefetch") else ""),
          file=sys.stderr)
    print(" cache  hit rate  offload tok/s  (after the 1st)  (wait ms/tok)  compute x resident  "
          "(GPU x res.)  "
          "(resident beside agent)  gRPC/tok  MB/tok missed (moved)  bound  pageable  http  "
          "x bound  x http", file=sys.stderr)
    resident = r["resident"]["compute_s_per_token"]
    resident_gpu = r["resident"].get("gpu_compute_s_per_token")
    for run in r["runs"]:
        o = run["offload"]
        steady = o.get("steady_tokens_per_s")
        print(f" {run['fraction']:5.0%}  {run['hit_rate']:8.2f}  {o['tokens_per_s']:13.1f}  "
              f"({'-' if steady is None else f'{steady:.1f}':>13})  "
              f"({o['wait_s_per_token'] * 1e3:11.1f})  "
              f"{o['compute_s_per_token'] / resident:18.2f}  "
              f"({gpu_ratio(o, resident_gpu):>11})  "
              f"({beside_ratio(o, resident, resident_gpu):>21})  "
              f"{o.get('grpc_calls_per_token', float('nan')):8.2f}  "
              f"{run['bytes_fetched_per_token'] / 1e6:9.1f} "
              f"({run.get('bytes_moved_per_token', float('nan')) / 1e6:7.1f})  "
              f"{run['bound_tokens_per_s']:5.1f}  "
              f"{run['pageable']['tokens_per_s']:8.1f}  {run['http']['tokens_per_s']:4.1f}  "
              f"{run['offload_vs_bound']:7.2f}  {run['offload_vs_http']:6.2f}", file=sys.stderr)
    if all("offload_vs_bound_beside_agent" in run for run in r["runs"]):
        print(" x the bound from the resident kernels run beside the agent just before each "
              "offload run: " + "; ".join(
                  f"{run['fraction']:.0%} {run['offload_vs_bound_beside_agent']:.2f} "
                  f"(bound {run['bound_beside_agent_tokens_per_s']:.1f})" for run in r["runs"]),
              file=sys.stderr)
    resident_ffn = r["resident"].get("gpu_ffn_s_per_token")
    if resident_ffn:
        cells = []
        for run in r["runs"]:
            off = run["offload"]
            cells.append(f"{run['fraction']:.0%} offload {off['gpu_ffn_s_per_token'] * 1e3:.2f} "
                         f"({off['gpu_ffn_s_per_token'] / resident_ffn:.2f}x; host "
                         f"{off['host_ffn_launch_s_per_token'] * 1e3:.2f}), beside the agent "
                         f"{off['resident_beside_agent']['gpu_ffn_s_per_token'] * 1e3:.2f}")
        print(" the FFN's own launches, ms per token between CUDA events (the host's launch "
              f"time): resident {resident_ffn * 1e3:.2f} "
              f"({r['resident']['host_ffn_launch_s_per_token'] * 1e3:.2f}); "
              + "; ".join(cells), file=sys.stderr)
    if any(run["offload"].get("parked_acquires_per_token") for run in r["runs"]):
        print(" acquires parked for a landing slot per token: " + "; ".join(
            f"{run['fraction']:.0%} {run['offload'].get('parked_acquires_per_token', 0):.2f}"
            for run in r["runs"]), file=sys.stderr)
    if r.get("repeats", 1) > 1:
        print(" offload tok/s of each run (the median above): " + "; ".join(
            f"{run['fraction']:.0%} " + " / ".join(
                f"{v:.1f}" for v in run["offload"]["tokens_per_s_all"]) for run in r["runs"]),
            file=sys.stderr)


def print_timeline(r: dict[str, Any]) -> None:
    """Where an offload layer's time went (``--timeline``): medians over the layers after the
    first token, ms from the layer's start."""
    for run in r["runs"]:
        layers = [rec for rec in run.get("timeline", []) if rec["token"] > 0]
        if not layers:
            continue

        def med(get: Any, layers: list[dict[str, Any]] = layers) -> float:
            return statistics.median(get(rec) for rec in layers)

        n = min(len(rec["host"]) for rec in layers)
        line = (f" timeline at {run['fraction']:.0%} (ms from a layer's start, median of "
                f"{len(layers)} layers): posted {med(lambda rec: rec['begun']):.2f}; each "
                f"expert's fetch returned " + " ".join(
                    f"{med(lambda rec, i=i: rec['host'][i][1]):.2f}" for i in range(n))
                + f"; host launches done {med(lambda rec: rec['host'][-1][2]):.2f}")
        if all(len(rec["gpu"]) >= n for rec in layers):
            ready = " ".join(f"{med(lambda rec, i=i: rec['gpu'][i][1]):.2f}" for i in range(n))
            line += (f"; GPU: each expert READY {ready}, kernels done "
                     f"{med(lambda rec: rec['gpu'][-1][3]):.2f}")
        line += (f"; synced {med(lambda rec: rec['synced']):.2f}, released "
                 f"{med(lambda rec: rec['released']):.2f}")
        print(line, file=sys.stderr)
