"""Several devices under one host client (issue 10).

1. Aggregate delivery: every device acquires its own share of the experts at once (one
   AcquireBatch each, concurrently); bytes over time against N x the single-device host-to-
   device rate measured in the same run (pinned cudaMemcpy per GPU; a host memcpy for CPU
   reference devices).
2. Replication: one layer's experts placed on every device (ApplyPlacement), timed from the
   call to every copy verified, without and with GPU-to-GPU forwarding (LinkPeers: the arena
   is read once per expert and the other copies come from a peer's slot).

``--device cuda`` uses every visible GPU (needs two or more); ``--device cpu`` runs the same
code on N CPU reference devices, which shows the machinery, not GPU figures.

Usage: python bench/multi_gpu.py [--device cuda|cpu] [--devices N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, host_to_device_rate, write
from dpu_offload.cli_args import non_negative, positive
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess

LAYERS, EXPERTS = 2, 16


def make(device: str, ordinal: int) -> Any:
    if device == "cuda":
        from host_client.cuda_device import CudaDevice

        return CudaDevice(ordinal, mechanism="copy_engine")
    return CpuReferenceDevice(ordinal)


def replicate(agent: AgentProcess, device: str, n: int, model: Any, link: bool) -> float:
    """Seconds from ApplyPlacement of layer 0 on every device to every copy verified."""
    with AgentClient(agent.address, rpc_timeout=120) as client:
        devs = [client.register_device(make(device, i), [SlotPoolSpec(
            model.expert_bytes, EXPERTS * LAYERS)]) for i in range(n)]
        if link:
            client.link_peers()
        everywhere = [[d.device_id for d in devs]] * EXPERTS
        assignment = [everywhere] + [[[devs[0].device_id]] * EXPERTS] * (LAYERS - 1)
        t0 = time.perf_counter()
        client.wait_placement(client.apply_placement("m", assignment).placement_id, 300)
        return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--devices", type=non_negative, default=0,
                    help="how many (default: all GPUs / 4)")
    ap.add_argument("--hidden", type=positive, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.device == "cuda":
        import cupy as cp

        n = args.devices or cp.cuda.runtime.getDeviceCount()
        if n < 2:
            print(f"bench/multi_gpu.py: needs 2 or more GPUs, this machine has {n}",
                  file=sys.stderr)
            return 2
    else:
        n = args.devices or 4
    with tempfile.TemporaryDirectory(prefix="bench-mgpu-") as tmp:
        root = make_checkpoint(Path(tmp) / "m", CheckpointSpec(
            "qwen3-moe", layers=LAYERS, experts=EXPERTS, hidden=args.hidden,
            intermediate=args.hidden * 3 // 8))
        with AgentProcess('[arena]\nbytes = "2GiB"\n') as agent, \
                AgentClient(agent.address, rpc_timeout=120) as client:
            model = client.load_model(str(root), "m")
            keys = [ExpertKey("m", la, e) for la in range(LAYERS) for e in range(EXPERTS)]
            warm = client.register_device(CpuReferenceDevice(n), [SlotPoolSpec(
                model.expert_bytes, len(keys))])
            for h in client.acquire_batch(warm, keys):  # the arena (DPU cache) warm
                h.wait(300)
            devs = [client.register_device(make(args.device, i), [SlotPoolSpec(
                model.expert_bytes, len(keys))]) for i in range(n)]
            single = [host_to_device_rate(args.device, i, model.expert_bytes * 4)
                      for i in range(n)]
            shares = [keys[i::n] for i in range(n)]

            def pull(i: int) -> None:
                for h in client.acquire_batch(devs[i], shares[i]):
                    h.wait(300)

            threads = [threading.Thread(target=pull, args=(i,)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            aggregate = len(keys) * model.expert_bytes / (time.perf_counter() - t0)
            without = replicate(agent, args.device, n, model, link=False)
            with_fwd = replicate(agent, args.device, n, model, link=True)
    result = {"devices": n, "device": args.device, "expert_bytes": model.expert_bytes,
              "aggregate_gbps": aggregate / 1e9,
              "single_device_h2d_gbps": [r / 1e9 for r in single],
              "aggregate_vs_n_times_single": aggregate / (n * min(single)),
              "replicate_layer_s": {"arena_only": without, "gpu_to_gpu": with_fwd},
              "forwarding_speedup": without / with_fwd}
    print(f"{n} {args.device} devices: aggregate {aggregate / 1e9:.2f} GB/s "
          f"({result['aggregate_vs_n_times_single']:.2f}x of {n} x single); replicate "
          f"layer: arena only {without * 1e3:.0f} ms, with forwarding {with_fwd * 1e3:.0f} ms",
          file=sys.stderr)
    path = write("multi_gpu", envelope("multi_gpu", result, command="python bench/multi_gpu.py "
                                       + " ".join(sys.argv[1:])), f"-{args.device}")
    print(json.dumps(result) if args.json else f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
