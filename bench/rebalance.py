"""End-to-end rebalance and prefetch on the CPU reference device (or a GPU with --device cuda).

1. Rebalance: all experts placed on device A, then half moved to device B through
   ApplyPlacement (make-before-break). Reports the time from ApplyPlacement to every new copy
   verified, against bytes moved / the delivery bandwidth measured in the same run.
2. Prefetch: a generated routing trace replayed through acquire/release on one device whose
   slots hold a quarter of the experts, each layer's visit reported on the device's ring,
   without and with routing-driven prefetch (the visit's prefetch count). Reports hit rates
   (an acquire that started no delivery: the expert was in its slot or on its way there) and
   the extra bytes prefetch moved.

Usage: python bench/rebalance.py [--device cpu|cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, write
from dpu_agent.routing.traces import RoutingStep, generate_trace
from dpu_offload.keys import ExpertKey
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, CpuReferenceDevice, Device, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess
from host_client.registration import AttachedDevice

LAYERS, EXPERTS, TOP_K = 4, 16, 2


def make_device(kind: str, ordinal: int) -> Device:
    if kind == "cuda":
        from host_client.cuda_device import CudaDevice

        return CudaDevice(0)
    return CpuReferenceDevice(ordinal)


def rebalance_case(client: AgentClient, model, kind: str) -> dict[str, float]:
    a = client.register_device(make_device(kind, 0), [SlotPoolSpec(model.expert_bytes, 64)])
    b = client.register_device(make_device(kind, 1), [SlotPoolSpec(model.expert_bytes, 64)])
    keys = [ExpertKey("m", layer, e) for layer in model.moe_layers for e in range(EXPERTS)]
    for h in client.acquire_batch(a, keys):  # warms the arena
        h.wait(60)
    for k in keys:
        client.release(a, k)
    t0 = time.perf_counter()
    for h in client.acquire_batch(b, keys[:32]):
        h.wait(60)
    bandwidth = 32 * model.expert_bytes / (time.perf_counter() - t0)
    for k in keys[:32]:
        client.release(b, k)
    everything_on_a = [[[a.device_id] for _ in range(EXPERTS)] for _ in model.moe_layers]
    client.wait_placement(client.apply_placement("m", everything_on_a).placement_id, 120)
    moved = [[[b.device_id] if e % 2 else [a.device_id] for e in range(EXPERTS)]
             for _ in model.moe_layers]
    t0 = time.perf_counter()
    r = client.apply_placement("m", moved)
    p = client.wait_placement(r.placement_id, 120)
    if p.failed:
        raise RuntimeError(f"placement {r.placement_id}: {p.failed} copies failed")
    elapsed = time.perf_counter() - t0
    nbytes = r.copies_to_add * model.expert_bytes
    return {"copies_moved": r.copies_to_add, "bytes_moved": nbytes,
            "delivery_gbps": bandwidth / 1e9, "apply_to_verified_s": elapsed,
            "bound_s": nbytes / bandwidth, "ratio_to_bound": elapsed / (nbytes / bandwidth)}


def replay_decode(client: AgentClient, dev: AttachedDevice, model: pb.LoadModelResponse,
                  steps: Iterable[RoutingStep], report: bool = True, prefetch: int = 0
                  ) -> tuple[int, int]:
    """Replay routing ``steps`` (``layer``: the index of a MoE layer of ``model``) on ``dev``
    as a decode does: each step's experts acquired as one batch, waited for and released; with
    ``report``, the visit then reported on the device's ring (and ``prefetch`` experts of the
    next layer prefetched). Returns (acquires that started no delivery: the expert was in
    its slot or on its way there, acquires)."""
    hits = total = 0
    for step in steps:
        layer = model.moe_layers[step.layer]
        batch = [ExpertKey(model.model, layer, e) for e in sorted(set(step.experts))]
        handles = client.acquire_batch(dev, batch)
        for h in handles:
            h.wait(60)
        hits += sum(bool(h.resident) for h in handles)
        total += len(handles)
        client.release_batch(dev, batch)
        if report:
            client.report_visit(dev, model.model, layer,
                                {e: step.experts.count(e) for e in set(step.experts)},
                                prefetch=prefetch)
    return hits, total


def prefetch_case(address: str, root: Path, kind: str, prefetch: bool) -> dict[str, float]:
    with AgentClient(address, client_name="bench-prefetch") as client:
        model = client.load_model(str(root), "m")
        dev = client.register_device(make_device(kind, 2),
                                     [SlotPoolSpec(model.expert_bytes, LAYERS * EXPERTS // 4)])
        before = client.status()
        hits, total = replay_decode(client, dev, model,
                                    generate_trace(LAYERS, EXPERTS, TOP_K, 60, seed=3),
                                    prefetch=TOP_K if prefetch else 0)
        after = client.status()
        deliveries = (after.cache_hits + after.cache_misses) - (before.cache_hits +
                                                               before.cache_misses)
        return {"hit_rate": hits / total, "acquires": total, "deliveries": deliveries,
                "bytes_delivered": deliveries * model.expert_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rebalance-") as tmp:
        root = make_checkpoint(Path(tmp) / "m", CheckpointSpec(
            "qwen3-moe", layers=LAYERS, experts=EXPERTS, hidden=1024, intermediate=768))
        with AgentProcess('[arena]\nbytes = "1GiB"\n') as agent:
            with AgentClient(agent.address, client_name="bench-rebalance") as client:
                model = client.load_model(str(root), "m")
                reb = rebalance_case(client, model, args.device)
            plain = prefetch_case(agent.address, root, args.device, prefetch=False)
            pre = prefetch_case(agent.address, root, args.device, prefetch=True)
    result = {"rebalance": reb, "prefetch_off": plain, "prefetch_on": pre,
              "prefetch_hits_gained": round((pre["hit_rate"] - plain["hit_rate"])
                                            * pre["acquires"]),
              "prefetch_extra_bytes": pre["bytes_delivered"] - plain["bytes_delivered"]}
    print(f"rebalance: {reb['copies_moved']} copies, {reb['bytes_moved'] / 1e6:.0f} MB in "
          f"{reb['apply_to_verified_s'] * 1e3:.0f} ms; bound at {reb['delivery_gbps']:.2f} GB/s "
          f"{reb['bound_s'] * 1e3:.0f} ms ({reb['ratio_to_bound']:.2f}x)", file=sys.stderr)
    print(f"prefetch: hit rate {plain['hit_rate']:.3f} -> {pre['hit_rate']:.3f} "
          f"(+{result['prefetch_hits_gained']} hits), extra bytes "
          f"{result['prefetch_extra_bytes'] / 1e6:.0f} MB", file=sys.stderr)
    data = envelope("rebalance", result, device=args.device,
                    command="python bench/rebalance.py " + " ".join(sys.argv[1:]))
    path = write("rebalance", data, f"-{args.device}")
    print(json.dumps(data) if args.json else f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
