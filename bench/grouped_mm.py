"""What a slot pool's group count costs transformers' experts forward: torch's ``grouped_mm``
takes every slot of a pool view as a group (the offloaded layer's ``num_experts`` is the pool's
slots), and on Hopper and Blackwell its CUTLASS kernel refuses 1,024 groups or more
(``host_client.integrations.pool_views.MAX_GROUPS``).

Per group count (Qwen3-30B-A3B expert shapes, bfloat16, the views strided as the pool lays
experts out, eight rows routed to eight distinct groups, as at batch 1): one ``grouped_mm``
call's host time and GPU time, or the error it raised; then transformers' grouped-mm experts
forward on resident-like contiguous parameters (128 experts) and on pool views (128, 256 and
1,023 slots), its host time with the GPU kept busy (calls back to back, as the resident model
runs) and with the GPU idle before each call (a synchronize first, as the offloaded layer
starts after its routing copy). Baseline in the same run: the contiguous 128-expert forward.
``--device cpu``: torch's CPU kernel (a loop over the groups; the CPU reference device's), the
widths divided by ``--shrink`` (default 4) so that 1,536 slots fit, host time only.

    python bench/grouped_mm.py [--device cuda] [--groups 8 128 256 512 1023 1024 1536]
        [--calls 200] [--shrink N]
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, median, write
from dpu_offload.cli_args import positive

HIDDEN, INTER, TOP_K = 2048, 768, 8
"""Qwen3-30B-A3B's expert shapes and its experts per token."""


@dataclass(frozen=True)
class Where:
    """The device the calls run on and the expert widths (``HIDDEN``, ``INTER`` divided by a
    shrink factor)."""

    device: str
    hidden: int
    inter: int

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def _pool(torch: Any, at: Where, slots: int) -> tuple[Any, Any]:
    """``gate_up_proj`` ``[slots, 2I, H]`` and ``down_proj`` ``[slots, H, I]`` views of one
    pool, each slot's blob the two side by side (bfloat16, small random values)."""
    h, i = at.hidden, at.inter
    slot = 3 * i * h
    pool = torch.randn(slots * slot, dtype=torch.bfloat16, device=at.device) * 0.01
    return (pool.as_strided((slots, 2 * i, h), (slot, h, 1), 0),
            pool.as_strided((slots, h, i), (slot, i, 1), 2 * i * h))


def _synchronize(torch: Any, at: Where) -> None:
    if at.cuda:
        torch.cuda.synchronize()


def _host_and_gpu_us(torch: Any, at: Where, fn: Any, calls: int) -> tuple[float, float | None]:
    """(host us per call with calls back to back, GPU us per call between CUDA events; None
    on the CPU, where the host time is all)."""
    for _ in range(10):
        fn()
    if not at.cuda:
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls * 1e6, None
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls
    end.record()
    end.synchronize()
    return host * 1e6, start.elapsed_time(end) / calls * 1e3


def groups_row(torch: Any, at: Where, groups: int, calls: int) -> dict[str, Any]:
    """One ``grouped_mm`` over ``groups`` pool-strided groups, eight rows in eight of them."""
    gate_up, _ = _pool(torch, at, groups)
    rows = torch.randn(TOP_K, at.hidden, dtype=torch.bfloat16, device=at.device)
    chosen = torch.randperm(groups, device=at.device)[:TOP_K].sort().values
    offsets = torch.cumsum(torch.bincount(chosen, minlength=groups), 0, dtype=torch.int32)
    try:
        host, gpu = _host_and_gpu_us(torch, at, lambda: torch.nn.functional.grouped_mm(
            rows, gate_up.transpose(-2, -1), offs=offsets), calls)
    except RuntimeError as exc:
        return {"groups": groups, "error": str(exc).splitlines()[0][:200]}
    return {"groups": groups, "host_us": host, "gpu_us": gpu}


def forward_row(torch: Any, at: Where, slots: int, pooled: bool, calls: int
                ) -> dict[str, Any]:
    """transformers' grouped-mm experts forward for one token over ``slots`` experts (pool
    views, or contiguous parameters): host us per call back to back and after a synchronize,
    GPU us per call."""
    from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

    experts = types.SimpleNamespace(num_experts=slots, has_gate=True, has_bias=False,
                                    is_transposed=False, has_post_expert_norm=False,
                                    _is_expert_parallel=False,
                                    act_fn=torch.nn.functional.silu)
    experts._apply_gate = lambda x: _default_apply_gate(experts, x)
    h, i = at.hidden, at.inter
    if pooled:
        experts.gate_up_proj, experts.down_proj = _pool(torch, at, slots)
    else:
        experts.gate_up_proj, experts.down_proj = (
            torch.randn(shape, dtype=torch.bfloat16, device=at.device) * 0.01
            for shape in ((slots, 2 * i, h), (slots, h, i)))
    hidden = torch.randn(1, h, dtype=torch.bfloat16, device=at.device)
    weights = torch.rand(1, TOP_K, dtype=torch.bfloat16, device=at.device)
    index = torch.randperm(slots, device=at.device)[:TOP_K].reshape(1, TOP_K)

    def forward() -> Any:
        return grouped_mm_experts_forward(experts, hidden, index, weights)

    busy, gpu = _host_and_gpu_us(torch, at, forward, calls)
    idle = []
    for _ in range(calls):
        _synchronize(torch, at)
        t = time.perf_counter()
        forward()
        idle.append(time.perf_counter() - t)
    return {"slots": slots, "pool_views": pooled, "host_busy_us": busy,
            "host_idle_p50_us": median(idle) * 1e6, "gpu_us": gpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=positive, nargs="+",
                    default=[8, 128, 256, 512, 1023, 1024, 1536])
    ap.add_argument("--calls", type=positive, default=200)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shrink", type=positive, default=None,
                    help="divide the widths (default: 1 on a GPU, 4 on the CPU)")
    a = ap.parse_args()
    if max(a.groups) > 4096:
        ap.error(f"--groups: at most 4096 (a pool of 9.4 MB experts each), got {max(a.groups)}")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU (--device cpu: torch's CPU kernel)")
    shrink = a.shrink or (1 if a.device == "cuda" else 4)
    at = Where(a.device, HIDDEN // shrink, INTER // shrink)
    groups = [groups_row(torch, at, g, a.calls) for g in a.groups]
    forwards = [forward_row(torch, at, slots, pooled, a.calls)
                for slots, pooled in ((128, False), (128, True), (256, True), (1023, True))]
    gpu = (lambda us: f", GPU {us:6.1f} us") if at.cuda else (lambda us: "")
    for r in groups:
        print(f"grouped_mm, {r['groups']:5d} groups: " + (
            r["error"] if "error" in r else
            f"host {r['host_us']:6.1f} us{gpu(r['gpu_us'])} per call"))
    for r in forwards:
        kind = "pool views" if r["pool_views"] else "contiguous"
        print(f"experts forward, {r['slots']:5d} {kind}:"
              f" host {r['host_busy_us']:6.1f} us (back to back), {r['host_idle_p50_us']:6.1f} "
              f"us (after a synchronize){gpu(r['gpu_us'])}")
    extra = {"gpu": torch.cuda.get_device_name()} if at.cuda else {}
    write("grouped-mm", envelope("grouped-mm", {"groups": groups, "forwards": forwards,
                                                "hidden": at.hidden, "inter": at.inter},
                                 device=a.device, **extra), f"-{a.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
