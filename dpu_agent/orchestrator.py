"""The agent's core: models, the weight cache, sessions and the data plane tied together.

Every public method validates first and changes nothing when it raises :class:`AgentError`.
Methods may block (a cache fill reads checkpoint files), so the async servicer calls them in
worker threads; the data-plane loop (dataplane/loop.py) is its own thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dpu_agent.config import AgentConfig
from dpu_agent.dataplane.grants import SlotGrant, SlotGrants
from dpu_agent.dataplane.plane import DataPlane
from dpu_agent.dataplane.steering import FlowTable, owned_by
from dpu_agent.errors import (
    AgentError,
    ErrorKind,
    invalid,
    not_found,
    precondition,
)
from dpu_agent.identity import Binding, current_caller
from dpu_agent.models import Models
from dpu_agent.planning.apply import PlacementExecutor
from dpu_agent.planning.prediction import NextLayerPredictor
from dpu_agent.planning.scheduler import Priority, Scheduler
from dpu_agent.regions import Registrations
from dpu_agent.registry import (
    ARENA_REGION_ID,
    Device,
    Session,
)
from dpu_agent.routing.stats import RoutingStats
from dpu_agent.state import StateStore
from dpu_agent.weights.arena import Arena
from dpu_agent.weights.cache import WeightCache
from dpu_agent.weights.catalog import ExpertEntry, ModelCatalog
from dpu_agent.weights.policies import make_policy
from dpu_offload import abi
from dpu_offload.keys import ExpertKey
from dpu_offload.shm import sweep_stale

log = logging.getLogger("dpu_agent")

STALE_SEGMENTS = ("dpu-agent-arena", "dpu-channel", "dpu-pool", "dpu-bell", "dpu-engine-bell",
                  *(f"dpu-{side}-{kind.name.lower()}" for side in ("engine", "ring")
                    for kind in abi.RingKind))
"""Names of the segments agents and host clients create (``unique_name``): swept at start
when their creator is dead."""


class Orchestrator:
    """Owns the catalog, arena, cache, sessions and data plane of one agent."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.started = time.time()
        self.state = StateStore(config.state.dir) if config.state.dir else None
        self.saved_placements: dict[str, Any] = {}
        stale = sweep_stale(STALE_SEGMENTS)
        if stale:
            log.warning("removed %d shared-memory segments left by dead processes: %s",
                        len(stale), ", ".join(sorted(stale)[:8]))
        self.arena = Arena(config.arena.bytes)
        self.routing = RoutingStats()
        """The one store of routing statistics (the cache policy, the predictor and the
        placement planner read it)."""
        self.cache = WeightCache(self.arena, config.transfer.chunk_bytes,
                                 make_policy(config.cache.policy, self.routing))
        self.catalog = Models(self.cache, self.routing, config.prefetch.traces_dir)
        self.models = self.catalog.catalogs
        """Name -> catalog of every loaded model (``Models.catalogs``)."""
        self.sessions: dict[str, Session] = {}
        self._events_dropped_closed = 0
        """Events closed sessions' sinks dropped (their clients did not read them)."""
        self._lock = threading.RLock()
        self._fills = ThreadPoolExecutor(max_workers=4, thread_name_prefix="retry")
        self.plane = DataPlane(self, self.cache, config.transfer.chunk_bytes, self._fills,
                               lambda sid: sid in self.sessions, self._devices,
                               (self.arena.name, self.arena.size, ARENA_REGION_ID),
                               config.transfer.timeout_seconds, config.transfer.poll_spin_us / 1e6,
                               config.transfer.engine_polls)
        self.draining = False
        self._device_list: tuple[Device, ...] | None = None
        """Every session's devices, rebuilt only after a registration or a closure (the
        data-plane loop reads it on every pass)."""
        self.scheduler = Scheduler(config.transfer.link_concurrency)
        self.grants = SlotGrants(self, self.plane.deliveries, self.scheduler, self._fills,
                                 config.transfer.timeout_seconds)
        self.placements = PlacementExecutor(self)
        self.registrations = Registrations(self, config.sessions.max_devices)
        self.predictor = NextLayerPredictor(self.routing)
        self.flows = FlowTable()
        self.activations: Any = None
        """The ActivationRouter when [activations] is enabled (set by the server)."""
        self.cluster: Any = None
        """The ClusterAgent in cluster mode (set by the server)."""
        self.plane.start()
        if self.state is not None:
            self._restore()

    def _restore(self) -> None:
        assert self.state is not None
        saved = self.state.load()
        for m in saved.get("models", []):
            try:
                self.load_model(m["path"], m["name"], persist=False)
            except (AgentError, KeyError, TypeError) as exc:
                log.error("state: model %r not restored: %s", m,
                          getattr(exc, "message", exc))
        self.saved_placements: dict[str, Any] = dict(saved.get("placements", {}))
        log.info("state: restored %d models from %s", len(self.models), self.state.path)

    def persist(self) -> None:
        """Write the catalog and placements in force to the state directory (if any)."""
        if self.state is None:
            return
        with self._lock:
            models = [{"name": m.name, "path": str(m.path)} for m in self.models.values()]
        placements = dict(self.saved_placements)
        placements.update({model: st.assignment
                           for (_, model), st in self.placements.states.items()})
        self.state.save({"models": models, "placements": placements})

    # -- models ----------------------------------------------------------------------------
    def load_model(self, path: str, name: str = "", persist: bool = True) -> ModelCatalog:
        """LoadModel (``Models.load``), remembered in the state directory when new."""
        catalog, new = self.catalog.load(path, name)
        if new and persist:
            self.persist()
        return catalog

    def model_index(self, name: str) -> int:
        return self.catalog.index(name)

    def model_name(self, index: int) -> str:
        return self.catalog.name(index)

    def expert(self, key: ExpertKey) -> ExpertEntry:
        return self.catalog.expert(key)

    # -- sessions --------------------------------------------------------------------------
    def create_session(self, client_name: str, lease_seconds: int) -> tuple[Session, str]:
        """A new session bound to the calling identity, and its token (handed out once: every
        later call naming the session must present it)."""
        if len(client_name) > 64:
            raise invalid("client_name is longer than 64 characters")
        lease = lease_seconds or self.config.sessions.default_lease_seconds
        if lease > self.config.sessions.max_lease_seconds:
            raise invalid(f"lease_seconds {lease} exceeds the maximum "
                          f"{self.config.sessions.max_lease_seconds}")
        sid = secrets.token_hex(8)
        binding, token = Binding.issue(current_caller().identity)
        session = Session(sid, client_name, float(lease), time.monotonic() + lease,
                          binding=binding)
        with self._lock:
            if len(self.sessions) >= self.config.sessions.max_sessions:
                raise AgentError(ErrorKind.RESOURCE_EXHAUSTED,
                                 f"{len(self.sessions)} sessions are open, the most this agent "
                                 "takes (sessions.max_sessions); close one or wait for a lease "
                                 "to expire")
            self.sessions[sid] = session
        log.info("session %s opened by %r", sid, client_name,
                 extra={"session": sid, "client": client_name})
        return session, token

    def session(self, session_id: str) -> Session:
        with self._lock:
            s = self.sessions.get(session_id)
        if s is None:
            raise not_found(f"session {session_id[:40]!r} does not exist (expired or closed)")
        if s.binding is not None and not s.binding.admits(current_caller()):
            raise AgentError(ErrorKind.PERMISSION_DENIED,
                             f"session {session_id!r} belongs to another caller (the call "
                             "lacks its token, or comes from another identity)")
        s.touch()
        return s

    def device(self, session: Session, device_id: int) -> Device:
        dev = session.devices.get(device_id)
        if dev is None:
            with self._lock:
                owned = any(device_id in s.devices for s in self.sessions.values())
            if owned:
                raise AgentError(ErrorKind.PERMISSION_DENIED,
                                 f"device {device_id} belongs to another session")
            raise precondition(f"device {device_id} is not registered in session "
                               f"{session.session_id}")
        return dev

    def close_session(self, session_id: str, reason: str = "closed") -> None:
        with self._lock:
            session = self.sessions.pop(session_id, None)
            self._device_list = None
        if session is None:
            raise not_found(f"session {session_id!r} does not exist")
        devices = set(session.devices.values())
        self.scheduler.cancel(lambda job: job.link[0] == session_id)
        self.placements.forget_session(session_id)
        gone = [r.rule_id for r in self.flows.rules() if owned_by(r, session_id)]
        if gone:
            self.flows.update(delete=gone)  # its devices' queues are gone with it
        self.plane.deliveries.tracker.cancel(lambda t: t.owner in devices)
        for dev in devices:
            if dev.queue is not None:
                dev.queue.close()
            if dev.channel is not None:
                dev.channel.close()
            if dev.engine_rings is not None:
                self.plane.engine.detach(dev)
        session.events.close()
        with self._lock:
            self._events_dropped_closed += session.events.dropped
        log.info("session %s", reason, extra={"session": session_id})

    def events_dropped(self) -> int:
        """Session events dropped so far, open and closed sessions together (a counter)."""
        with self._lock:
            return self._events_dropped_closed + sum(s.events.dropped
                                                     for s in self.sessions.values())

    def expire_sessions(self) -> list[str]:
        """Close every session whose lease ran out; returns their ids."""
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, s in self.sessions.items() if s.expires_at < now]
        for sid in expired:
            try:
                self.close_session(sid, reason="lease expired")
            except AgentError:
                pass
        return expired

    # -- acquire / release (slots are granted by dataplane/grants.py) ---------------------
    def prefetch(self, session: Session, device_id: int, keys: list[ExpertKey]) -> int:
        """Queue deliveries of ``keys`` at prefetch priority, holding no reference."""
        self.device(session, device_id)
        for key in keys:
            self.expert(key)
        for key in keys:
            self.grants.start_background(session, device_id, key, Priority.PREFETCH,
                                         order=key.layer)
        return len(keys)

    # -- the channel's requests (dataplane/requests.py calls these by owner) ---------------
    def _owner(self, owner: tuple[str, int]) -> Session:
        with self._lock:
            session = self.sessions.get(owner[0])
        if session is None:
            raise AgentError(ErrorKind.UNAVAILABLE, "the channel's session is closed")
        return session

    def acquire_for(self, owner: tuple[str, int], key: ExpertKey, wait: bool) -> SlotGrant:
        return self.grants.acquire(self._owner(owner), owner[1], key, wait)

    def release_for(self, owner: tuple[str, int], key: ExpertKey) -> None:
        self.release(self._owner(owner), owner[1], key)

    def prefetch_for(self, owner: tuple[str, int], key: ExpertKey) -> None:
        self.prefetch(self._owner(owner), owner[1], [key])

    def release(self, session: Session, device_id: int, key: ExpertKey) -> None:
        self.device(session, device_id)
        if not session.drop_ref(device_id, key):
            raise precondition(f"{key} is not held on device {device_id}")

    def report_routing(self, model: str, steps: list[tuple[int, dict[int, int]]],
                       prefetch: tuple[Session, int, int] | None = None) -> int:
        """Fold observed routing (layer, {expert: tokens}) into the routing statistics and
        show each visit to the cache policy. With ``prefetch = (session, device_id, k)``, queue
        the k experts the predictor expects the MoE layer after the last step's to select;
        returns how many."""
        catalog = self.models.get(model)
        if catalog is None:
            raise not_found(f"model {model!r} is not loaded")
        layers = set(catalog.layout.moe_layers)
        for layer, counts in steps:
            if layer not in layers:
                raise invalid(f"layer {layer} is not an MoE layer of {model!r}")
            bad = [e for e in counts if e >= catalog.layout.experts_per_layer]
            if bad:
                raise invalid(f"expert {bad[0]} out of range for {model!r} "
                              f"({catalog.layout.experts_per_layer} per layer)")
        if prefetch is not None:
            self.device(prefetch[0], prefetch[1])
        for layer, counts in steps:
            self.cache.observe(self.routing, model, layer, counts)
        if prefetch is None or not steps:
            return 0
        session, device_id, k = prefetch
        nxt, experts = self.predictor.predict(model, k)
        return self.prefetch(session, device_id, [ExpertKey(model, nxt, e) for e in experts])

    # -- data plane ------------------------------------------------------------------------
    def exports(self) -> set[str | bytes]:
        """Every shared-memory name and CUDA IPC handle the agent knows memory by: the arena
        and each registered device's channel, rings and pools."""
        with self._lock:
            return {self.arena.name}.union(*(d.exports() for d in self._devices_locked()))

    def devices_changed(self) -> None:
        """A device or its queue came or went: the data-plane loop's list is rebuilt."""
        with self._lock:
            self._device_list = None

    def _devices(self) -> tuple[Device, ...]:
        with self._lock:
            return self._devices_locked()

    def _devices_locked(self) -> tuple[Device, ...]:
        if self._device_list is None:
            self._device_list = tuple(d for s in self.sessions.values()
                                      for d in list(s.devices.values()))
        return self._device_list

    def shutdown(self) -> None:
        self.plane.stop()
        for sid in list(self.sessions):
            try:
                self.close_session(sid, reason="agent stopping")
            except AgentError:
                pass
        self._fills.shutdown(wait=False, cancel_futures=True)
        self.arena.close()
