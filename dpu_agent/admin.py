"""``dpu-agent`` verbs that administer placement without a running agent: ``plan`` (the
placement planner on a load array) and ``cluster`` (members and placements in etcd).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dpu_offload.cli_args import non_negative, positive, seconds

if TYPE_CHECKING:  # the commands import what they use: `dpu-agent serve` starts without them
    from dpu_agent.cluster.store import ClusterStore


def cmd_plan(args: argparse.Namespace) -> int:
    import numpy as np

    from dpu_agent.planning.placement import PlacementError, plan

    try:
        load = np.load(args.load, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--load {args.load}: not a .npy array ({exc})") from exc
    current = None
    if args.current:
        try:
            current = json.loads(open(args.current).read())
            current = current.get("assignment", current) if isinstance(current, dict) \
                else current
        except (OSError, ValueError) as exc:
            raise ValueError(f"--current {args.current}: not a placement JSON ({exc})") from exc
    try:
        p = plan(load, args.gpus, replicas=args.replicas, current=current,
                 expert_bytes=args.expert_bytes)
    except PlacementError as exc:
        raise ValueError(f"plan: {exc}") from exc
    if args.json:
        print(json.dumps(p.to_json()))
    else:
        print(f"max_load_ratio {p.max_load_ratio:.4f}  copies moved {p.copies_moved}  "
              f"bytes moved {p.bytes_moved}")
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from dpu_agent.cluster import planner
    from dpu_agent.cluster.placement import ClusterPlacement
    from dpu_agent.cluster.placement import PlacementError as ClusterPlacementError
    from dpu_agent.cluster.store import ClusterStore, ClusterUnavailable
    from dpu_agent.weights.catalog import build_catalog

    store = ClusterStore(args.etcd.split(","), args.prefix,
                         tls=(args.etcd_ca, args.etcd_cert, args.etcd_key))
    try:
        store.connect(args.timeout)
        if args.cluster_command == "status":
            _cluster_status(store)
            return 0
        if args.cluster_command == "apply":
            try:
                placement = ClusterPlacement.from_json(json.loads(Path(args.file).read_text()))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{args.file}: not a cluster placement ({exc})") from exc
            catalog = build_catalog(placement.path, placement.model)
            done = planner.publish(store, placement, catalog)
        else:
            catalog = build_catalog(args.path, args.model or Path(args.path).name)
            done = planner.rebalance(store, catalog, args.replicas)
    except (ClusterUnavailable, ClusterPlacementError) as exc:
        print(f"dpu-agent: cluster: {exc}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{a}: {len(k)}" for a, k in sorted(done.holders.items()))
    print(f"placement of {done.model} v{done.version} written ({counts})")
    return 0


def _cluster_status(store: ClusterStore) -> None:
    from rich.console import Console
    from rich.table import Table

    members = store.members()
    leader = store.get_json(store.key("planner"))
    table = Table("agent", "grpc", "peer", "activations", "arena", "planner",
                  title=f"{len(members)} live agents under {store.prefix}", title_justify="left")
    for a, m in sorted(members.items()):
        table.add_row(a, m.grpc, m.peer, m.activations or "-", f"{m.arena_bytes >> 20} MiB",
                      "yes" if leader and leader[0] == a else "")
    Console().print(table)
    actual = {k: json.loads(v) for k, v in store.get_prefix("actual").items()}
    for raw in dict(sorted(store.get_prefix("placement").items())).values():
        p = json.loads(raw)
        t = Table("agent", "desired", "held", "at version",
                  title=f"{p['model']} v{p['version']} ({p['path']})", title_justify="left")
        for a, ks in sorted(p["holders"].items()):
            rec = actual.get(store.key("actual", a, p["model"]), {})
            t.add_row(a + ("" if a in members else " (gone)"), str(len(ks)),
                      str(len(rec.get("held", []))), str(rec.get("version", "-")))
        Console().print(t)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``plan`` and ``cluster`` with the ``dpu-agent`` command line."""
    p = sub.add_parser("cluster", help="cluster mode: members, placements (etcd)")
    p.add_argument("--etcd", required=True, help="etcd endpoints, host:port[,host:port]")
    p.add_argument("--prefix", default="/dpu-offload")
    p.add_argument("--timeout", type=seconds, default=5.0)
    p.add_argument("--etcd-ca", default="", help="CA bundle for etcd over TLS")
    p.add_argument("--etcd-cert", default="", help="client certificate for etcd")
    p.add_argument("--etcd-key", default="", help="client key for etcd")
    csub = p.add_subparsers(dest="cluster_command", required=True)
    csub.add_parser("status", help="live agents, desired and actual holdings")
    cr = csub.add_parser("rebalance", help="plan a model over the live agents and write it")
    cr.add_argument("--path", required=True, help="checkpoint directory (same on every agent)")
    cr.add_argument("--model", default="", help="model name (default: the directory name)")
    cr.add_argument("--replicas", type=non_negative, default=0)
    ca = csub.add_parser("apply", help="write a placement JSON file after validating it")
    ca.add_argument("--file", required=True)
    p.set_defaults(fn=cmd_cluster)
    p = sub.add_parser("plan", help="plan a placement from a [layers, experts] load array")
    p.add_argument("--load", required=True, help=".npy file, shape [layers, experts]")
    p.add_argument("--gpus", required=True, type=positive)
    p.add_argument("--replicas", type=non_negative, default=0)
    p.add_argument("--current", help="JSON placement in force ([layers][experts] -> GPUs)")
    p.add_argument("--expert-bytes", type=positive, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_plan)
