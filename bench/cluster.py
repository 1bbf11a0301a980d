"""Cluster rebalance on loopback: a real etcd and four agent processes.

For each fetch mode (peers preferred, and storage only as the baseline, same run, same model):

1. place the model over agents a0..a2 and wait until each reports holding its share;
2. start a3 and rebalance over the four: the time from writing the placement to every agent
   reporting it, the expert bytes that moved, the share of them that came from peers, and the
   etcd operations the whole cluster made for it (every agent's counter, plus the planner's);
3. kill a3 and time the planner's re-placement until its experts are held again.

Storage here is checkpoint files in the page cache, so "storage" is an optimistic baseline:
on a real cluster it is a network file system or object store.

Usage: python bench/cluster.py [--layers 4 --experts 16 --hidden 512] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import envelope, scrape, write
from dpu_agent.cluster import planner
from dpu_agent.cluster.placement import ClusterPlacement
from dpu_agent.cluster.store import ClusterStore
from dpu_agent.planning.placement import plan
from dpu_agent.weights.catalog import build_catalog
from dpu_offload.cli_args import positive
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess, EtcdProcess


def totals(agents: list[AgentProcess]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for a in agents:
        if a.proc is not None and a.proc.poll() is None:
            for k, v in scrape(a).items():
                sums[k] = sums.get(k, 0.0) + v
    return sums


def ops(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items()
               if k.startswith("dpu_agent_cluster_etcd_operations_total/"))


def converged(store: ClusterStore, p: ClusterPlacement) -> bool:
    held = {k.split("/")[-2]: json.loads(v) for k, v in store.get_prefix("actual").items()
            if k.endswith("/" + p.model)}
    return all(held.get(a, {}).get("version") == p.version and
               sorted(held[a]["held"]) == ks for a, ks in p.holders.items())


def wait(what: str, check, timeout: float = 120.0) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.perf_counter() - start


def warm_planner() -> None:
    """Load the planner's compiled loops and its matching solver in this process before any
    clock starts: the first mode measured had paid ~120 ms of imports in its rebalance."""
    plan([[1.0, 2.0]], 2, current=[[[1], [0]]])


def run_mode(etcd: EtcdProcess, ckpt: Path, mode: str) -> dict[str, float]:
    store = ClusterStore([etcd.endpoint], f"/bench/{mode}")
    store.connect(5)
    catalog = build_catalog(ckpt, "m")

    def agent(i: int) -> AgentProcess:
        return AgentProcess(
            f'[arena]\nbytes = "1GiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
            f'[cluster]\netcd_endpoints = "{etcd.endpoint}"\nagent_id = "a{i}"\n'
            f'prefix = "{store.prefix}"\nlease_seconds = 2\nresync_seconds = 1\n'
            f'peer_fetch = "{mode}"\n')

    agents = [agent(i).start() for i in range(3)]
    try:
        wait("3 members", lambda: len(store.members()) == 3)
        first = planner.rebalance(store, catalog)
        initial_s = wait("initial placement", lambda: converged(store, first))
        agents.append(agent(3).start())
        wait("4 members", lambda: len(store.members()) == 4)
        before, ops_before = totals(agents), sum(store.ops.values())
        start = time.perf_counter()
        second = planner.rebalance(store, catalog)
        wait("rebalance", lambda: converged(store, second))
        rebalance_s = time.perf_counter() - start
        after = totals(agents)
        moved = {src: after.get(f"dpu_agent_cache_fill_bytes_total/{src}", 0) -
                 before.get(f"dpu_agent_cache_fill_bytes_total/{src}", 0)
                 for src in ("peer", "storage")}
        etcd_ops = (ops(after) - ops(before) + sum(store.ops.values()) - ops_before)
        agents[3].kill()
        killed = time.perf_counter()
        wait("re-placement", lambda: (got := store.get_json(store.key("placement", "m")))
             is not None and "a3" not in got[0]["holders"] and converged(
                 store, ClusterPlacement.from_json(got[0])))
        replace_s = time.perf_counter() - killed
    finally:
        for a in agents:
            a.stop()
    total = moved["peer"] + moved["storage"]
    return {"initial_converge_s": initial_s, "rebalance_converge_s": rebalance_s,
            "bytes_moved": total, "peer_bytes": moved["peer"],
            "peer_share": moved["peer"] / total if total else 0.0,
            "etcd_ops_per_rebalance": etcd_ops, "resync_seconds": 1.0,
            "kill_to_replaced_s": replace_s, "lease_seconds": 2,
            "experts_moved": len({tuple(x) for x in second.holders.get("a3", [])})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=positive, default=4)
    ap.add_argument("--experts", type=positive, default=16)
    ap.add_argument("--hidden", type=positive, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EtcdProcess() as etcd:
        ckpt = make_checkpoint(Path(tmp) / "m", CheckpointSpec(
            "qwen3-moe", layers=args.layers, experts=args.experts, hidden=args.hidden,
            intermediate=args.hidden))
        catalog = build_catalog(ckpt, "m")
        warm_planner()
        results = {"model": {"layers": args.layers, "experts": args.experts,
                             "expert_bytes": catalog.expert_bytes,
                             "total_bytes": catalog.total_expert_bytes},
                   "peers": run_mode(etcd, ckpt, "always"),
                   "storage": run_mode(etcd, ckpt, "never")}
    p, s = results["peers"], results["storage"]
    results["rebalance_speedup_vs_storage"] = s["rebalance_converge_s"] / p["rebalance_converge_s"]
    data = envelope("cluster", results, command="python bench/cluster.py " +
                    " ".join(sys.argv[1:]))
    write("cluster", data)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for mode in ("peers", "storage"):
            r = results[mode]
            print(f"{mode:8s} rebalance {r['rebalance_converge_s'] * 1e3:7.0f} ms  "
                  f"{r['bytes_moved'] / 1e6:6.1f} MB moved, {r['peer_share']:.0%} from peers, "
                  f"{r['etcd_ops_per_rebalance']:.0f} etcd ops; re-placed after kill in "
                  f"{r['kill_to_replaced_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
