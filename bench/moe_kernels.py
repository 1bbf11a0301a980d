"""Dispatch / combine kernels at DeepSeek-V3 shapes (hidden 7168, top-8, 256 experts) against a
device-to-device copy of the same bytes, measured in the same run with CUDA events.

Bytes counted: dispatch reads and writes tokens*top_k rows; combine reads tokens*top_k rows
and writes tokens rows (bf16, 14336 bytes a row).

Usage: python bench/moe_kernels.py [--device cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, median, write

HIDDEN, TOP_K, EXPERTS = 7168, 8, 256


def _time(cp, fn, repeats: int = 20, per_graph: int = 10) -> float:
    """Median seconds of one fn() on the GPU: ``per_graph`` launches captured in a CUDA graph
    and replayed between CUDA events, so host launch overhead stays out of the figure."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            fn()
        stream.begin_capture()
        for _ in range(per_graph):
            fn()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(repeats):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(stream)
            graph.launch(stream)
            b.record(stream)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) / 1e3 / per_graph)
    return median(times)


def measure(cp, cuda_ops, dispatch_plan, rng: np.random.Generator, tokens: int
            ) -> dict[str, float]:
    ids = np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
    w = cp.asarray(rng.random((tokens, TOP_K), dtype=np.float32))
    x = cp.asarray(rng.integers(0, 1 << 15, (tokens, HIDDEN), dtype=np.uint16))
    plan = dispatch_plan(cp, cp.asarray(ids), EXPERTS)
    rows, row = tokens * TOP_K, HIDDEN * 2
    packed = cp.empty((rows, HIDDEN), cp.uint16)
    outs = cp.asarray(rng.integers(0, 1 << 14, (rows, HIDDEN), dtype=np.uint16))
    combined = cp.empty((tokens, HIDDEN), cp.uint16)
    src = cp.empty(rows * row, cp.uint8)
    dst = cp.empty_like(src)
    t_disp = _time(cp, lambda: cuda_ops.dispatch(x, plan, out=packed))
    t_comb = _time(cp, lambda: cuda_ops.combine_bf16(outs, plan, w, out=combined))
    t_copy = _time(cp, lambda: cp.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, src.nbytes, 3, cp.cuda.get_current_stream().ptr))
    copy_bw = 2 * rows * row / t_copy / 1e9
    disp_bw = 2 * rows * row / t_disp / 1e9
    comb_bw = (rows + tokens) * row / t_comb / 1e9
    return {"d2d_copy_gbps": copy_bw, "dispatch_gbps": disp_bw, "combine_gbps": comb_bw,
            "dispatch_ratio": disp_bw / copy_bw, "combine_ratio": comb_bw / copy_bw,
            "dispatch_us": t_disp * 1e6, "combine_us": t_comb * 1e6,
            "copy_us": t_copy * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", choices=("cuda",), default="cuda")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import cupy as cp

    from gpu_kernels import cuda_ops
    from gpu_kernels.routing import dispatch_plan

    rng = np.random.default_rng(0)
    results = {}
    for tokens in (128, 512, 1024, 4096):
        r = measure(cp, cuda_ops, dispatch_plan, rng, tokens)
        results[str(tokens)] = r
        print(f"tokens {tokens:5d}  copy {r['d2d_copy_gbps']:7.0f} GB/s  dispatch "
              f"{r['dispatch_gbps']:7.0f} ({r['dispatch_ratio']:.2f}x)  combine "
              f"{r['combine_gbps']:7.0f} ({r['combine_ratio']:.2f}x)", file=sys.stderr)
    data = envelope("moe_kernels", results, device="cuda", target_ratio=0.6,
                    command="python bench/moe_kernels.py", repeats=20)
    path = write("moe_kernels", data, "-cuda")
    print(json.dumps(data) if args.json else f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
