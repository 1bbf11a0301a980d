"""The agent's CPU per request on the data plane (issue 19: "its CPU time per request ... is
measured"), on any machine: the same agent process, channel and DMA-engine process as
everywhere, a CPU reference device and experts so small (12 KiB) that their copies cost next to
nothing; the agent's data-plane thread's own CPU time (schedstat) is what is reported, so other
processes sharing the CPUs do not count in it. On a GPU host the agent's pace bounds
small-expert batches (a 4.7 MB copy takes 88 us on the H200). ``--delivery pull`` measures the
other path (work entries into the device's ring; a device whose consumer never runs).

    python bench/agent_requests.py [--experts 1024] [--batch 8] [--rounds 3] [--delivery pull]

Per round, a fresh session acquires every expert of a checkpoint (``--experts`` of them, tiny)
in batches of ``--batch`` on a pool that holds them all, the arena already warm (a first pass in
another session read the checkpoint): ``miss`` is an ACQUIRE that allocates a slot and posts its
delivery; then the same experts again (``again``): with the DMA engine they have landed and
the client's checks (started at posting) verified them, so each is a pinned hit the agent
never sees; with ``--delivery pull`` they are still under way and the agent answers from its
slot table. Reported: the agent's data-plane
thread CPU per request (microseconds, from schedstat) and the client's wall time per batch
from post to its last grant, medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CpuSnapshot, envelope, write
from dpu_offload.cli_args import positive
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess

LAYERS = 16
"""MoE layers of the checkpoint; experts per layer follow from ``--experts``."""


class StalledDevice(CpuReferenceDevice):
    """A CPU reference device whose consumer never runs (``--delivery pull``): work entries
    stay in its ring, slots stay FILLING, and no thread of this process competes with the
    agent for a CPU."""

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass


def acquire_all(client: AgentClient, dev: object, keys: list[ExpertKey], batch: int
                ) -> list[float]:
    """Acquire ``keys`` in batches (all or nothing each, grants only); seconds per batch."""
    times = []
    for first in range(0, len(keys), batch):
        t0 = time.perf_counter()
        client.acquire_batch(dev, keys[first:first + batch])  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    return times


def agent_cpu(agent: AgentProcess) -> CpuSnapshot:
    assert agent.proc is not None
    return CpuSnapshot.take(agent.proc.pid)


def run(experts: int, batch: int, rounds: int, delivery: str, workdir: Path
        ) -> dict[str, object]:
    per_layer = max(1, experts // LAYERS)
    root = make_checkpoint(workdir / "ckpt", CheckpointSpec(
        "qwen3-moe", layers=LAYERS, experts=per_layer, hidden=64, intermediate=32,
        dense_layers=0), layers_per_shard=LAYERS)
    settings = '[arena]\nbytes = "256MiB"\n[sessions]\nmax_lease_seconds = 600\n'
    out: dict[str, list[float]] = {"miss_agent_us": [], "again_agent_us": [],
                                   "miss_batch_ms": [], "again_batch_ms": []}
    with AgentProcess(settings) as agent:
        def session() -> tuple[AgentClient, object, list[ExpertKey]]:
            client = AgentClient(agent.address, client_name="bench-agent-requests")
            model = client.load_model(str(root), "m")
            keys = [ExpertKey("m", layer, e) for layer in model.moe_layers
                    for e in range(model.experts_per_layer)]
            device = StalledDevice() if delivery == "pull" else CpuReferenceDevice()
            dev = client.register_device(device, [SlotPoolSpec(model.expert_bytes, len(keys))],
                                         ring_capacity=4 * 4096, delivery=delivery)
            return client, dev, keys

        client, dev, keys = session()
        acquire_all(client, dev, keys, batch)  # the arena reads the checkpoint once
        client.close()
        for _ in range(rounds):
            client, dev, keys = session()
            for kind in ("miss", "again"):
                cpu0 = agent_cpu(agent)
                times = acquire_all(client, dev, keys, batch)
                used = agent_cpu(agent).since(cpu0).get("dataplane", 0.0)
                out[f"{kind}_agent_us"].append(used / len(keys) * 1e6)
                out[f"{kind}_batch_ms"].append(median(times) * 1e3)
            client.close()
    return {"experts": len(keys), "batch": batch, "rounds": rounds, "delivery": delivery,
            **{k: median(v) for k, v in out.items()}, "per_round": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=positive, default=1024)
    ap.add_argument("--batch", type=positive, default=8)
    ap.add_argument("--rounds", type=positive, default=3)
    ap.add_argument("--delivery", choices=("engine", "pull"), default="engine")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.experts < LAYERS or args.batch < 1 or args.rounds < 1:
        ap.error(f"--experts needs at least {LAYERS}; --batch and --rounds at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-agent-requests-") as tmp:
        r = run(args.experts, args.batch, args.rounds, args.delivery, Path(tmp))
    print(f"agent data-plane CPU per ACQUIRE ({r['delivery']}): miss "
          f"{r['miss_agent_us']:.1f} us, again {r['again_agent_us']:.1f} us; batch of "
          f"{r['batch']} post-to-last-grant: miss {r['miss_batch_ms']:.3f} ms, again "
          f"{r['again_batch_ms']:.3f} ms ({r['experts']} experts, median of {r['rounds']} "
          "rounds)")
    if not args.no_save:
        path = write("agent-requests", envelope(
            "agent-requests", r, command="python bench/agent_requests.py "
            + " ".join(sys.argv[1:])), f"-cpu-{args.delivery}")
        print(f"wrote {path}")
    print(json.dumps({k: v for k, v in r.items() if k != "per_round"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
