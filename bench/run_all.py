"""`make bench`: every benchmark this machine can run, with progress, then the report.

CPU benchmarks run anywhere; GPU ones only where CuPy sees a GPU (on the GPU machine
`make gpu-check` is the entry point), multi_gpu only where it sees two or more. Each writes
its JSON (machine, date, source hash) under bench/results/; bench/report.py then rewrites
docs/PERFORMANCE.md.

Usage: python bench/run_all.py [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"

CPU = [
    ("cache policies (generated trace)", ["cache_policies.py", "--generate", "16", "64", "6",
                                          "400", "--cache-experts", "64", "128", "256", "384",
                                          "512", "--prefetch", "6"]),
    ("placement (58 x 256, 8-64 GPUs)", ["placement.py"]),
    ("rebalance and prefetch (CPU device)", ["rebalance.py"]),
    ("steering lookups", ["steering.py"]),
    ("finding a slot for a delivery (64-4,096 slots)", ["slot_pool.py"]),
    ("cluster rebalance (etcd, 4 agents)", ["cluster.py"]),
    ("several devices (CPU reference devices)", ["multi_gpu.py", "--device", "cpu",
                                                 "--devices", "3", "--hidden", "1024"]),
    ("activation round trips (CPU device)", ["activations.py", "--repeats", "200"]),
    ("the agent's CPU per request, DMA engine", ["agent_requests.py", "--rounds", "5"]),
    ("the agent's CPU per request, device pull", ["agent_requests.py", "--rounds", "5",
                                                  "--delivery", "pull"]),
    ("delivery through the whole system (CPU device)", [
        "delivery.py", "--device", "cpu", "--quick", "--mechanisms", "engine", "auto",
        "--experts", "8", "--repeats", "3"]),
    ("load: 64 clients", ["load.py", "--seconds", "20"]),
    ("decode with offloaded experts (CPU device)", ["decode.py", "--tokens", "8"]),
    ("loading a transformers model without its experts", ["transformers_load.py"]),
]
GPU = [
    ("delivery arena -> GPU", ["delivery.py", "--device", "cuda", "--experts", "16",
                               "--repeats", "6", "--mechanisms", "auto", "engine"]),
    ("dispatch / combine kernels", ["moe_kernels.py"]),
    ("decode with offloaded experts (GPU, device pull)", ["decode.py", "--device", "cuda"]),
    ("decode with offloaded experts (GPU, DMA engine)", ["decode.py", "--device", "cuda",
                                                         "--delivery", "engine"]),
    ("decode, 128 experts per layer (GPU, DMA engine)", ["decode.py", "--device", "cuda",
                                                         "--delivery", "engine",
                                                         "--experts", "128"]),
    ("activation round trips (GPU worker)", ["activations.py", "--device", "cuda"]),
]
MULTI_GPU = [("several GPUs: aggregate delivery, replication", ["multi_gpu.py"])]


def gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy or no driver: no GPU
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="skip the 20 s load run")
    args = ap.parse_args()
    console = Console(stderr=True)
    jobs = list(CPU)
    for trace in sorted(TRACES.glob("*.jsonl")):
        jobs.insert(0, (f"cache policies ({trace.stem})", ["cache_policies.py", "--trace",
                                                            str(trace), "--prefetch", "2", "4"]))
    if args.quick:
        jobs = [j for j in jobs if j[1][0] != "load.py"]
    gpus = gpu_count()
    if gpus:
        jobs += GPU + (MULTI_GPU if gpus > 1 else [])
    else:
        console.print("[yellow]no GPU here: GPU benchmarks skipped (make gpu-check on the GPU "
                      "machine)[/]")
    failed = []
    for i, (name, cmd) in enumerate(jobs, 1):
        t0 = time.perf_counter()
        with console.status(f"[{i}/{len(jobs)}] {name}"):
            res = subprocess.run([sys.executable, str(ROOT / "bench" / cmd[0]), *cmd[1:]],
                                 cwd=ROOT, capture_output=True, text=True)
        ok = res.returncode == 0
        console.print(f"[{'green' if ok else 'red'}]{'done' if ok else 'FAILED'}[/] "
                      f"[{i}/{len(jobs)}] {name} ({time.perf_counter() - t0:.0f} s)")
        if not ok:
            failed.append(name)
            console.print(res.stderr[-2000:])
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "report.py")], cwd=ROOT)
    return 1 if failed or res.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
