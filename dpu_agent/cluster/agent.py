"""One agent's part in a cluster: membership, reconciliation to the desired placement, the
planner role, and the cluster view the activation router forwards by.

Reconciliation is level-triggered: an etcd watch wakes the loop on any change, and a full
resync runs every ``resync_seconds`` anyway, so a missed event costs latency, never state.
Each pass reads members, placements and actual holdings; fetches what this agent should hold
(from a peer that reports holding it, else the checkpoint files), drops what it should not,
and writes what it holds under ``actual/{agent_id}/{model}``. The elected planner also
re-places the experts of agents whose membership expired.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dpu_agent.cluster import peer
from dpu_agent.cluster.placement import ClusterPlacement, PlacementError, check, plan_cluster
from dpu_agent.cluster.settings import ClusterSettings
from dpu_agent.cluster.store import ClusterStore, ClusterUnavailable, Member
from dpu_agent.errors import AgentError
from dpu_agent.weights.cache import CachedExpert, CacheFullError
from dpu_offload.keys import ExpertKey

if TYPE_CHECKING:
    from etcd3gw.lease import Lease

    from dpu_agent.weights.arena import Arena
    from dpu_agent.weights.cache import WeightCache
    from dpu_agent.weights.catalog import ExpertEntry, ModelCatalog

log = logging.getLogger("dpu_agent.cluster")


class ClusterCore(Protocol):
    """What the cluster agent needs of the agent's core (the Orchestrator)."""

    arena: Arena
    cache: WeightCache

    def load_model(self, path: str, name: str = "", persist: bool = True) -> ModelCatalog: ...
    def expert(self, key: ExpertKey) -> ExpertEntry: ...
    def steering_changed(self) -> int: ...


class ClusterAgent:
    """Joins the cluster on :meth:`start` (blocking until registered) and reconciles in a
    thread until :meth:`close`."""

    def __init__(self, core: ClusterCore, settings: ClusterSettings, grpc_address: str,
                 activations_address: str = "") -> None:
        self.core = core
        self.settings = settings
        self.id = settings.agent_id
        self.store = ClusterStore(list(settings.etcd_endpoints), settings.prefix,
                                  tls=(settings.etcd_ca, settings.etcd_cert, settings.etcd_key))
        self.server = peer.PeerServer(core.cache, settings.peer_address)
        self.links = peer.PeerLinks()
        self.rates = peer.SourceRates(settings.peer_fetch)
        self.grpc_address = grpc_address
        self.activations_address = activations_address
        self.placements: dict[str, ClusterPlacement] = {}
        self.actual: dict[str, dict[str, set[ExpertKey]]] = {}
        """agent id -> model -> experts it reports holding."""
        self.members: dict[str, Member] = {}
        self.held: dict[str, dict[ExpertKey, CachedExpert]] = {}
        """model -> experts this agent holds -> the arena copy it pins (one pin each)."""
        self.reconciles = 0
        self.replans = 0
        self.fetch_failures = 0
        self.leader = False
        self._reported: dict[str, object] = {}
        self._lease: Lease | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cancel_watch: Callable[[], None] | None = None
        self._watching = False
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect (retrying with backoff up to ``join_timeout_seconds``), register, reconcile
        once, then keep going in the background.

        Raises:
            ClusterUnavailable: etcd never answered, or the agent id is taken by a live agent.
        """
        try:
            self.store.connect(self.settings.join_timeout_seconds)
            self._register()
            self._watch()
        except ClusterUnavailable:
            self.server.close()
            raise
        self.reconcile()
        for name, fn in (("cluster-lease", self._keepalive), ("cluster-sync", self._loop)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("cluster: joined as %r (peer server %s)", self.id, self.server.address)

    def _register(self) -> None:
        self._lease = self.store.lease(self.settings.lease_seconds)
        record = {"agent_id": self.id, "grpc": self.grpc_address, "peer": self.server.address,
                  "activations": self.activations_address,
                  "arena_bytes": self.core.arena.size}
        if not self.store.create(self.store.key("members", self.id), record, self._lease):
            self._lease.revoke()
            raise ClusterUnavailable(f"agent id {self.id!r} is already registered by a live "
                                     "agent (cluster.agent_id must be unique)")
        self._reported.clear()

    def _keepalive(self) -> None:
        period = max(self.settings.lease_seconds / 3, 0.2)
        while not self._stop.wait(period):
            try:
                assert self._lease is not None
                if self.store.refresh(self._lease) <= 0:
                    log.error("cluster: lease expired; registering again")
                    self._register()
                    self._wake.set()
            except ClusterUnavailable as exc:
                log.warning("cluster: keep-alive failed: %s", exc)

    def _watch(self) -> None:
        self._watching = True

        def ended() -> None:
            self._watching = False
            self._wake.set()

        self._cancel_watch = self.store.watch(self._wake.set, ended)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.settings.resync_seconds)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if not self._watching:  # etcd went away and may be back: watch again
                    self._watch()
                self.reconcile()
            except ClusterUnavailable as exc:
                log.warning("cluster: reconcile skipped: %s", exc)

    def close(self) -> None:
        """Stop, drop the holds and leave (revoking the lease removes this agent's keys)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(5)
        if self._cancel_watch is not None:
            self._cancel_watch()
        with self._lock:
            for copies in self.held.values():
                for cached in copies.values():
                    self.core.cache.release(cached)
            self.held.clear()
            self.links.close()
        if self._lease is not None:
            try:
                self._lease.revoke()
            except Exception as exc:  # noqa: BLE001 - etcd may already be gone
                log.warning("cluster: lease not revoked: %s", exc)
        self.server.close()

    # -- reconciliation -------------------------------------------------------------------------
    def read(self) -> None:
        """Refresh members, placements and actual holdings from etcd (foreign keys counted)."""
        members = self.store.members()
        placements = {}
        for key, raw in self.store.get_prefix("placement").items():
            try:
                p = ClusterPlacement.from_json(json.loads(raw))
                if key.rsplit("/", 1)[1] != p.model:
                    raise ValueError(f"names model {p.model!r}")
            except (ValueError, KeyError, TypeError) as exc:
                self.store.foreign(key, f"not a placement ({exc})")
                continue
            placements[p.model] = p
        actual: dict[str, dict[str, set[ExpertKey]]] = {}
        for key, raw in self.store.get_prefix("actual").items():
            parts = key[len(self.store.prefix) + 1:].split("/")
            try:
                if len(parts) != 3:
                    raise ValueError("expected actual/AGENT/MODEL")
                held = json.loads(raw)["held"]
                actual.setdefault(parts[1], {})[parts[2]] = {
                    ExpertKey(parts[2], int(le[0]), int(le[1])) for le in held}
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                self.store.foreign(key, f"not an actual-holdings record ({exc})")
        changed = actual != self.actual or members != self.members
        self.members, self.placements, self.actual = members, placements, actual
        if changed:
            self.core.steering_changed()  # the NIC's routes to other agents follow holdings

    def reconcile(self) -> None:
        """One pass: read, (as planner) re-place lost experts, converge, report."""
        with self._lock:
            self.read()
            self._lead()
            for p in self.placements.values():
                self._converge(p)
            for model in [m for m in self.held if m not in self.placements]:
                self._drop(model, set(self.held[model]))
                self.held.pop(model)
                self.store.delete(self.store.key("actual", self.id, model))
                self._reported.pop(model, None)
            self.reconciles += 1

    def _lead(self) -> None:
        assert self._lease is not None
        key = self.store.key("planner")
        got = self.store.get_json(key)
        if got is None:
            self.store.create(key, self.id, self._lease)
            got = self.store.get_json(key)
        self.leader = got is not None and got[0] == self.id
        if not self.leader:
            return
        for model, p in self.placements.items():
            if all(a in self.members for a in p.holders):
                continue
            try:
                catalog = self.core.load_model(p.path, model, persist=False)
                new = plan_cluster(catalog, self.members, version=p.version + 1, current=p)
            except (AgentError, PlacementError) as exc:
                log.error("cluster: cannot re-place %s after losing %s: %s", model,
                          sorted(set(p.holders) - set(self.members)), exc)
                continue
            problems = check(new, self.members, catalog)
            current = self.store.get_json(self.store.key("placement", model))
            if problems or current is None:
                log.error("cluster: re-placement of %s refused: %s", model, problems)
                continue
            if self.store.compare_and_put(self.store.key("placement", model), new.to_json(),
                                          current[1]):
                self.replans += 1
                self.placements[model] = new
                log.warning("cluster: re-placed %s (v%d) after losing %s", model, new.version,
                            sorted(set(p.holders) - set(self.members)))

    def _converge(self, p: ClusterPlacement) -> None:
        try:
            catalog = self.core.load_model(p.path, p.model, persist=False)
        except AgentError as exc:
            log.error("cluster: cannot load %s from %s: %s", p.model, p.path, exc.message)
            return
        want = {k for k in p.keys_of(self.id) if k in catalog.experts}
        have = self.held.setdefault(p.model, {})
        for key in sorted(want - have.keys()):
            cached = self._fetch(key)
            if cached is not None:
                have[key] = cached
        # Make before break across agents: a copy goes only once every live agent meant to
        # hold it reports holding it, so peers can still fetch from here meanwhile.
        self._drop(p.model, {k for k in have.keys() - want if all(
            k in self.actual.get(a, {}).get(p.model, ()) for a in p.holders_of(k)
            if a in self.members)})
        report = {"version": p.version, "held": sorted([k.layer, k.expert] for k in have)}
        if self._reported.get(p.model) != report:
            self.store.put_json(self.store.key("actual", self.id, p.model), report, self._lease)
            self._reported[p.model] = report

    def _fetch(self, key: ExpertKey) -> CachedExpert | None:
        """Fill ``key`` into the arena (from a peer agent or the checkpoint) and pin it; None
        when it cannot be held."""
        entry = self.core.expert(key)
        peers = [self.members[a].peer for a, models in sorted(self.actual.items())
                 if a != self.id and a in self.members and key in models.get(key.model, ())]
        chunk = self.core.cache.chunk_bytes
        use_peer = bool(peers) and self.rates.prefer_peer()

        def from_peer(dest: object) -> list[int]:
            return self.rates.timed("peer", entry.blob_bytes,
                                    lambda: self.links.fetch(key, dest, peers, chunk))

        try:
            if use_peer:
                return self.core.cache.acquire(entry, from_peer)
            return self.rates.timed("storage", entry.blob_bytes,
                                    lambda: self.core.cache.acquire(entry))
        except (CacheFullError, OSError) as exc:
            self.fetch_failures += 1
            log.error("cluster: cannot hold %s: %s", key, exc)
            return None

    def _drop(self, model: str, keys: set[ExpertKey]) -> None:
        for key in keys:
            self.core.cache.release(self.held[model].pop(key))
            self.core.cache.invalidate(key)

    # -- queries --------------------------------------------------------------------------------
    def remote_holders(self) -> dict[ExpertKey, str]:
        """Expert -> the activation address of a live agent other than this one that holds it
        (the first by agent id): where the NIC sends what no local device serves."""
        out: dict[ExpertKey, str] = {}
        for agent, models in sorted(self.actual.items()):
            member = self.members.get(agent)
            if agent == self.id or member is None or not member.activations:
                continue
            for keys in models.values():
                for key in keys:
                    out.setdefault(key, member.activations)
        return out
