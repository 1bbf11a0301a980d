"""Cluster mode against a real etcd on loopback and three real agent processes: membership,
reconciliation to a placement, peer fetch with verified bytes, cross-agent activation
forwarding, re-placement after a kill; and every refusal."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from dpu_agent.cluster import planner
from dpu_agent.cluster.peer import PeerFetchError, PeerLinks, PeerServer
from dpu_agent.cluster.placement import ClusterPlacement, PlacementError
from dpu_agent.cluster.store import ClusterStore
from dpu_agent.weights.arena import Arena
from dpu_agent.weights.cache import WeightCache
from dpu_agent.weights.catalog import build_catalog
from dpu_agent.weights.policies import LruPolicy
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess, EtcdProcess, free_port
from host_client.worker import ExpertWorker
from tests.activation_serving import dispatch_matches_dense
from tests.conftest import checkpoint_bytes
from tests.test_config_metrics import dashboard_metrics_missing
from tests.test_security import _ca, _leaf

pytestmark = pytest.mark.skipif(not EtcdProcess.available(),
                                reason="etcd is not installed (Debian package etcd-server)")


def settings(etcd: str, agent_id: str, **extra: object) -> str:
    cluster = {"etcd_endpoints": etcd, "agent_id": agent_id, "lease_seconds": 2,
               "resync_seconds": 1, "peer_fetch": "always", **extra}
    return ('[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
            '[activations]\nlisten_address = "127.0.0.1:0"\n[cluster]\n' +
            "".join(f"{k} = {json.dumps(v)}\n" for k, v in cluster.items()))


def until(what: str, check: Callable[[], object], timeout: float = 20.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def metric(agent: AgentProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics").read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith(name))


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdProcess]:
    with EtcdProcess() as proc:
        yield proc


@pytest.fixture
def store(etcd: EtcdProcess, request: pytest.FixtureRequest) -> ClusterStore:
    s = ClusterStore([etcd.endpoint], f"/test/{request.node.name}")
    s.connect(5)
    return s


def actual(store: ClusterStore, model: str) -> dict[str, dict]:
    return {k.split("/")[-2]: json.loads(v) for k, v in store.get_prefix("actual").items()
            if k.endswith("/" + model)}


def test_three_agents_reconcile_fetch_from_peers_forward_and_survive_a_kill(
        etcd: EtcdProcess, store: ClusterStore, qwen_ckpt: Path) -> None:
    agents = [AgentProcess(settings(etcd.endpoint, f"a{i}", prefix=store.prefix))
              for i in range(3)]
    try:
        for a in agents:
            a.start()
        until("three members", lambda: set(store.members()) == {"a0", "a1", "a2"})
        catalog = build_catalog(qwen_ckpt, "qc")
        every = sorted([k.layer, k.expert] for k in catalog.experts)
        # Everything on a0 first (from storage), then balanced over three: a1 and a2 must fetch
        # from a0, and a0 keeps its copies until they report theirs.
        planner.publish(store, ClusterPlacement("qc", str(qwen_ckpt), 0, {"a0": every}),
                        catalog)
        until("a0 holds everything", lambda: len(actual(store, "qc").get("a0", {}).get(
            "held", [])) == len(every))
        p = planner.rebalance(store, catalog)
        assert sorted(len(v) for v in p.holders.values()) == [6, 6, 6]
        until("converged", lambda: all(
            actual(store, "qc").get(a, {}).get("version") == p.version and
            sorted(actual(store, "qc")[a]["held"]) == p.holders[a] for a in p.holders))
        for a in agents[1:]:
            assert metric(a, 'dpu_agent_cache_fill_bytes_total{source="peer"}') > 0
            assert metric(a, 'dpu_agent_cache_fill_bytes_total{source="storage"}') == 0
        assert metric(agents[0], "dpu_agent_cluster_peer_served_bytes") > 0
        assert sum(metric(a, "dpu_agent_cluster_leader") for a in agents) == 1

        # Bytes a1 fetched from a0 equal the checkpoint's.
        truth = checkpoint_bytes(qwen_ckpt)
        misses = metric(agents[1], "dpu_agent_cache_misses")
        with AgentClient(agents[1].address) as client:
            model = client.load_model(str(qwen_ckpt), "qc")
            dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(
                model.expert_bytes, 18)])
            for layer, e in p.holders["a1"]:
                slot = client.acquire(dev, ExpertKey("qc", layer, e)).wait(10)
                for role in ("gate_proj", "up_proj", "down_proj"):
                    name = f"model.layers.{layer}.mlp.experts.{e}.{role}.weight"
                    assert slot.raw(role).tobytes() == truth[name]
            assert metric(agents[1], "dpu_agent_cache_misses") == misses  # all held: hits

            # Activations sent to a0 for experts only a1 holds are forwarded to a1's worker.
            client.wait_placement(client.apply_placement("qc", [
                [[dev.device_id]] * model.experts_per_layer for _ in model.moe_layers
            ]).placement_id)
            worker = ExpertWorker(client, dev)
            try:
                layer = p.holders["a1"][0][0]
                mine = [e for lyr, e in p.holders["a1"] if lyr == layer]
                sent = dispatch_matches_dense(
                    f"127.0.0.1:{agents[0].activations_port}", "qc", model.experts_per_layer,
                    layer, qwen_ckpt, np.array([[mine[t % len(mine)]] for t in range(8)]))
                assert worker.served == sent
            finally:
                worker.close()
            assert metric(agents[0], "dpu_agent_activation_forwarded") == sent

        # a2 dies: its key expires within the lease, the planner re-places its experts on the
        # survivors, and every expert is held again.
        lost = set(map(tuple, p.holders["a2"]))
        agents[2].kill()
        killed = time.monotonic()
        until("a2 expired", lambda: "a2" not in store.members(), timeout=10)
        until("re-placed and held", lambda: (
            (q := ClusterPlacement.from_json(store.get_json(store.key("placement", "qc"))[0]))
            and "a2" not in q.holders and
            {tuple(x) for a in ("a0", "a1") for x in actual(store, "qc").get(a, {}).get(
                "held", [])} >= {tuple(x) for x in every}), timeout=15)
        assert time.monotonic() - killed < 15
        assert lost  # the kill did cost something that had to move
        assert sum(metric(a, "dpu_agent_cluster_replans") for a in agents[:2]) == 1
    finally:
        for a in agents:
            a.stop()


def test_agents_ride_out_an_etcd_restart(qwen_ckpt: Path) -> None:
    """etcd stops under two agents and comes back on the same data: the agents keep serving,
    stay members, watch again, and reconcile to a placement written after the restart."""
    with EtcdProcess() as etcd:
        store = ClusterStore([etcd.endpoint], "/restart")
        store.connect(5)
        agents = [AgentProcess(settings(etcd.endpoint, f"r{i}", prefix=store.prefix,
                                        peer_fetch="never")).start() for i in range(2)]
        try:
            until("two members", lambda: set(store.members()) == {"r0", "r1"})
            etcd.stop()
            time.sleep(3)
            with AgentClient(agents[0].address) as client:  # the data plane does not need etcd
                assert client.load_model(str(qwen_ckpt), "qr").experts_per_layer == 6
            etcd.start()
            until("members again", lambda: set(store.members()) == {"r0", "r1"}, timeout=15)
            catalog = build_catalog(qwen_ckpt, "qr")
            p = planner.rebalance(store, catalog)
            until("reconciled after the restart", lambda: all(
                actual(store, "qr").get(a, {}).get("version") == p.version for a in p.holders),
                timeout=15)
            assert all(a.proc is not None and a.proc.poll() is None for a in agents)
            assert "etcd watch ended" in agents[0].log()
        finally:
            for a in agents:
                a.stop()


def test_placement_naming_a_missing_agent_or_overfilling_is_refused_unwritten(
        etcd: EtcdProcess, store: ClusterStore, qwen_ckpt: Path) -> None:
    catalog = build_catalog(qwen_ckpt, "qr")
    every = sorted([k.layer, k.expert] for k in catalog.experts)
    key = store.key("placement", "qr")
    with AgentProcess(settings(etcd.endpoint, "small", prefix=store.prefix,
                               peer_fetch="auto").replace('"64MiB"', '"1MiB"')):
        with pytest.raises(PlacementError, match="'ghost' is not a live member"):
            planner.publish(store, ClusterPlacement("qr", str(qwen_ckpt), 0,
                                                    {"ghost": every}), catalog)
        with pytest.raises(PlacementError, match="overfill its arena"):
            planner.publish(store, ClusterPlacement("qr", str(qwen_ckpt), 0,
                                                    {"small": every}), catalog)
        with pytest.raises(PlacementError, match="held by no agent"):
            planner.publish(store, ClusterPlacement("qr", str(qwen_ckpt), 0,
                                                    {"small": every[:1]}), catalog)
        assert store.get_json(key) is None


def test_foreign_keys_are_ignored_and_counted(etcd: EtcdProcess, store: ClusterStore) -> None:
    store.put_json(store.key("placement", "junk"), {"not": "a placement"})
    store.put_json(store.key("members", "impostor"), {"agent_id": "someone-else", "grpc": "",
                                                      "peer": "", "arena_bytes": 1})
    store.put_json(store.key("actual", "x"), {"held": []})
    with AgentProcess(settings(etcd.endpoint, "watcher", prefix=store.prefix)) as agent:
        assert until("counted", lambda: metric(agent, "dpu_agent_cluster_foreign_keys") >= 3)
        assert metric(agent, "dpu_agent_cluster_members") == 1
        assert "ignoring" in agent.log()


def test_grafana_cluster_panels_use_exported_metrics(etcd: EtcdProcess,
                                                      store: ClusterStore) -> None:
    with AgentProcess(settings(etcd.endpoint, "dash", prefix=store.prefix)) as agent:
        assert dashboard_metrics_missing(agent.metrics_port, "dpu_agent_cluster_") == []


def test_duplicate_agent_id_is_refused(etcd: EtcdProcess, store: ClusterStore) -> None:
    with AgentProcess(settings(etcd.endpoint, "twin", prefix=store.prefix)):
        second = AgentProcess(settings(etcd.endpoint, "twin", prefix=store.prefix))
        with pytest.raises(RuntimeError, match="already registered by a live agent"):
            second.start()


def test_unreachable_etcd_retries_then_fails_clearly() -> None:
    agent = AgentProcess(settings(f"127.0.0.1:{free_port()}", "lonely",
                                  join_timeout_seconds=2))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"etcd unreachable at 127\.0\.0\.1"):
        agent.start()
    assert time.monotonic() - start >= 1.5  # it retried for the join timeout
    assert "retrying in" in agent.log()


def test_peer_fetch_verifies_chunks_and_falls_back(qwen_ckpt: Path) -> None:
    """Two real arenas serving over ZeroMQ: a corrupted byte in the first makes its chunk fail
    its checksum; the second delivers; with only the bad one, the cache fills from files."""
    catalog = build_catalog(qwen_ckpt, "qp")
    entry = next(iter(catalog.experts.values()))
    truth = WeightCache(Arena(8 << 20), 1 << 16, LruPolicy())
    caches = [WeightCache(Arena(8 << 20), 1 << 16, LruPolicy()) for _ in range(3)]
    servers = [PeerServer(c, "127.0.0.1:0") for c in caches[:2]]
    links = PeerLinks()
    peer_fetch = links.fetch
    try:
        good = truth.acquire(entry)
        expected = truth.arena.view(good.offset, entry.blob_bytes).copy()
        for c in caches[:2]:
            c.acquire(entry)
        bad = caches[0].peek(entry.key)
        caches[0].arena.view(bad.offset, entry.blob_bytes)[70_000] ^= 0x40
        caches[0].release(bad)
        dest = np.zeros(entry.blob_bytes, np.uint8)
        with pytest.raises(PeerFetchError, match="chunk 1 failed its checksum"):
            peer_fetch(entry.key, dest, [servers[0].address], 1 << 16)
        sums = peer_fetch(entry.key, dest, [s.address for s in servers], 1 << 16)
        np.testing.assert_array_equal(dest, expected)
        assert tuple(sums) == good.checksums
        # Only the corrupted peer: the fill falls back to the checkpoint files, bytes right.
        got = caches[2].acquire(entry, lambda d: peer_fetch(entry.key, d, [servers[0].address],
                                                            1 << 16))
        np.testing.assert_array_equal(caches[2].arena.view(got.offset, entry.blob_bytes),
                                      expected)
        assert caches[2].stats.source_failures == 1 and caches[2].stats.peer_bytes == 0
        # A peer that takes the request and never answers: timed out, its link dropped (a late
        # answer must not pass for the next request's), the next peer serves.
        silent = zmq.Context.instance().socket(zmq.ROUTER)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        dest[:] = 0
        with pytest.raises(PeerFetchError, match=r"no answer in 0\.2 s"):
            peer_fetch(entry.key, dest, [f"127.0.0.1:{port}"], 1 << 16, timeout=0.2)
        assert silent.poll(1000)  # it did get the request
        sums = peer_fetch(entry.key, dest, [f"127.0.0.1:{port}", servers[1].address], 1 << 16,
                          timeout=0.2)
        np.testing.assert_array_equal(dest, expected)
        silent.close(0)
    finally:
        links.close()
        for s in servers:
            s.close()
        for c in (truth, *caches):
            c.arena.close()


def test_etcd_over_mutual_tls(tmp_path: Path) -> None:
    """etcd requiring client certificates: an agent with the cluster's CA and a client
    certificate joins; one without TLS, or with a certificate from another CA, cannot."""
    _ca(tmp_path, "ca")
    _ca(tmp_path, "otherca")
    _leaf(tmp_path, "etcd", "ca", "IP:127.0.0.1,DNS:localhost")
    _leaf(tmp_path, "agent", "ca")
    _leaf(tmp_path, "intruder", "otherca")
    pem = {n: str(tmp_path / f"{n}.pem") for n in ("ca", "etcd", "agent", "intruder")}
    key = {n: str(tmp_path / f"{n}.key") for n in ("etcd", "agent", "intruder")}
    with EtcdProcess(tls=(pem["ca"], pem["etcd"], key["etcd"])) as etcd:
        good = settings(etcd.endpoint, "secure", etcd_ca=pem["ca"], etcd_cert=pem["agent"],
                        etcd_key=key["agent"])
        with AgentProcess(good) as agent:
            store = ClusterStore([etcd.endpoint], "/dpu-offload",
                                 tls=(pem["ca"], pem["agent"], key["agent"]))
            store.connect(5)
            assert set(store.members()) == {"secure"}
            assert metric(agent, "dpu_agent_cluster_members") == 1
        for bad in (settings(etcd.endpoint, "plain", join_timeout_seconds=1),
                    settings(etcd.endpoint, "foreign", join_timeout_seconds=1,
                             etcd_ca=pem["ca"], etcd_cert=pem["intruder"],
                             etcd_key=key["intruder"])):
            with pytest.raises(RuntimeError, match="etcd unreachable"):
                AgentProcess(bad).start()


def test_dpu_agent_cluster_commands(etcd: EtcdProcess, store: ClusterStore,
                                    qwen_ckpt: Path, tmp_path: Path) -> None:
    """`dpu-agent cluster` (agent-side administration, no agent process of its own): status
    lists the live members, rebalance plans the checkpoint over them and writes it, apply
    refuses a placement naming an agent that is not a member and writes nothing."""
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dpu_agent.cli", "cluster", "--etcd",
                               etcd.endpoint, "--prefix", store.prefix, *args],
                              capture_output=True, text=True, timeout=60)

    with AgentProcess(settings(etcd.endpoint, "solo", prefix=store.prefix)):
        until("the agent joined", lambda: "solo" in store.members())
        status = cli("status")
        assert status.returncode == 0 and "solo" in status.stdout, status.stderr
        done = cli("rebalance", "--path", str(qwen_ckpt), "--model", "qc")
        assert done.returncode == 0 and "placement of qc v" in done.stdout, done.stderr
        got = store.get_json(store.key("placement", "qc"))
        assert got is not None and list(got[0]["holders"]) == ["solo"]
        every = got[0]["holders"]["solo"]
        (tmp_path / "ghost.json").write_text(json.dumps(ClusterPlacement(
            "qg", str(qwen_ckpt), 0, {"ghost": every}).to_json()))
        refused = cli("apply", "--file", str(tmp_path / "ghost.json"))
        assert refused.returncode == 1 and "'ghost' is not a live member" in refused.stderr
        assert store.get_json(store.key("placement", "qg")) is None
