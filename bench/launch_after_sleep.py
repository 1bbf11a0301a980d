"""What a host thread's sleep costs its next kernel launch: the expert FFN's launch and GPU time
after the launching thread slept for a while, as a client thread does when it waits for a slot
on its futex instead of spinning.

For each ``--arch`` (expert shapes of bench/decode.py; 16 experts, one token row) and each
``--sleeps-ms`` S, the thread sleeps S ms before every expert, then:
- ``idle``: records a CUDA event, launches the fused FFN (``cuda_ops.swiglu_bf16``, two
  launches), records a second event and waits for it. The GPU is idle at the first event, so
  the events' interval holds the host's launch as well as the kernels: the figure a decode loop
  that times an expert with events around its launches reads.
- ``queued``: the same behind a ``dpu_wait_ready`` kernel on a mapped slot-state word that the
  host sets READY only after both events and the launches are queued (as
  ``AcquireHandle.enqueue_wait`` does): the events' interval is the kernels' own GPU time.
Per cell, p50 over ``--repeats`` passes over the experts (the first pass dropped): the host's
launch time (``host_launch_us``, wall clock around the FFN call) and the events' interval
(``events_us``). Baseline in the same run: the same cell at a 0 ms sleep.

Usage: python bench/launch_after_sleep.py [--sleeps-ms 0 0.2 1 5 10] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, median, write
from bench.decode import ARCHS
from dpu_offload import abi
from dpu_offload.channel import state_word

EXPERTS = 16
GENERATION = 1
MODES = ("idle", "queued")


def measure(cp: Any, arch: str, sleeps_s: list[float], repeats: int) -> dict[str, Any]:
    """One arch's cells: ``{"S ms": {mode: {"host_launch_us", "events_us"}}}``."""
    from gpu_kernels import cuda_ops, reference
    from host_client.cuda_device import device_pointer

    _, hidden, inter, _ = ARCHS[arch]
    rng = cp.random.default_rng(0)
    weights = [tuple(reference.f32_to_bf16(rng.standard_normal(s, dtype=cp.float32) * 0.02)
                     for s in ((inter, hidden), (inter, hidden), (hidden, inter)))
               for _ in range(EXPERTS)]
    x = reference.f32_to_bf16(cp.linspace(-1, 1, hidden, dtype=cp.float32)[None])
    word = np.zeros(1, np.uint64)
    cp.cuda.runtime.hostRegister(word.ctypes.data, word.nbytes, 0x1 | 0x2)  # portable | mapped
    outcome = cp.zeros(1, cp.uint32)
    stream = cp.cuda.get_current_stream()
    try:
        for w in weights:
            cuda_ops.swiglu_bf16(x, *w)
        stream.synchronize()
        cells: dict[str, Any] = {}
        for sleep_s in sleeps_s:
            row = cells[f"{sleep_s * 1e3:g} ms"] = {}
            for mode in MODES:
                host, events = [], []
                for _ in range(repeats + 1):
                    for w in weights:
                        time.sleep(sleep_s)
                        if mode == "queued":
                            word[0] = state_word(GENERATION, abi.SlotState.FILLING)
                            cuda_ops.wait_ready(device_pointer(word.ctypes.data), GENERATION,
                                                5.0, outcome, stream)
                        begin, end = cp.cuda.Event(), cp.cuda.Event()
                        begin.record()
                        t0 = time.perf_counter()
                        cuda_ops.swiglu_bf16(x, *w)
                        t1 = time.perf_counter()
                        end.record()
                        word[0] = state_word(GENERATION, abi.SlotState.READY)
                        end.synchronize()
                        if mode == "queued" and int(outcome.get()[0]) != 0:
                            raise RuntimeError(
                                f"the gate's wait ended with outcome {outcome.get()[0]}")
                        host.append((t1 - t0) * 1e6)
                        events.append(cp.cuda.get_elapsed_time(begin, end) * 1e3)
                row[mode] = {"host_launch_us": median(host[EXPERTS:]),
                             "events_us": median(events[EXPERTS:])}
        return {"hidden": hidden, "intermediate": inter,
                "expert_bytes": 3 * hidden * inter * 2, "cells": cells}
    finally:
        cp.cuda.runtime.hostUnregister(word.ctypes.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", choices=list(ARCHS),
                    default=["qwen3-30b-a3b", "deepseek-v3-lite"])
    ap.add_argument("--sleeps-ms", type=float, nargs="+", default=[0, 0.2, 1, 5, 10],
                    help="the thread's sleep before each expert's launch, ms (0-100)")
    ap.add_argument("--repeats", type=int, default=5, help="passes over the experts (1-100)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not all(0 <= s <= 100 for s in args.sleeps_ms):
        ap.error("--sleeps-ms: each between 0 and 100")
    if 0 not in args.sleeps_ms:
        ap.error("--sleeps-ms: include 0, the baseline")
    if not 1 <= args.repeats <= 100:
        ap.error("--repeats: between 1 and 100")
    from gpu_kernels import launch

    cp = launch.cp
    launch.preload(cp.cuda.Device().id)
    results = {}
    for arch in args.arch:
        r = results[arch] = measure(cp, arch, [s / 1e3 for s in args.sleeps_ms], args.repeats)
        for sleep, row in r["cells"].items():
            print(f"{arch:18s} sleep {sleep:>7s}  " + "  ".join(
                f"{mode}: launch {c['host_launch_us']:5.0f} us, events {c['events_us']:5.0f} us"
                for mode, c in row.items()))
    data = envelope("launch_after_sleep", results, device="cuda", experts=EXPERTS,
                    command=" ".join(["python", "bench/launch_after_sleep.py", *sys.argv[1:]]),
                    repeats=args.repeats, sleeps_ms=args.sleeps_ms)
    print(f"wrote {write('launch_after_sleep', data, '-cuda')}")
    if args.json:
        print(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
