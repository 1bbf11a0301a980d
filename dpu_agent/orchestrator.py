"""The agent's core: models, the weight cache, sessions and the data plane tied together.

Every public method validates first and changes nothing when it raises :class:`AgentError`.
Methods may block (a cache fill reads checkpoint files), so the async servicer calls them in
worker threads; the data-plane loop (dataplane/loop.py) is its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from dpu_agent.config import AgentConfig
from dpu_agent.dataplane.grants import SlotGrant, SlotGrants
from dpu_agent.dataplane.nic import NicCounters
from dpu_agent.dataplane.plane import DataPlane
from dpu_agent.dataplane.steering import owned_by
from dpu_agent.errors import (
    AgentError,
    ErrorKind,
    invalid,
    not_found,
    precondition,
)
from dpu_agent.models import Models
from dpu_agent.planning.apply import PlacementExecutor
from dpu_agent.planning.placement import warm_up as warm_up_planner
from dpu_agent.planning.prediction import NextLayerPredictor
from dpu_agent.planning.prediction import warm_up as warm_up_predictor
from dpu_agent.planning.scheduler import Priority, Scheduler
from dpu_agent.regions import Registrations
from dpu_agent.registry import (
    ARENA_REGION_ID,
    Device,
    Session,
)
from dpu_agent.routing.stats import RoutingStats, Visit
from dpu_agent.sessions import SessionTable
from dpu_agent.state import StateStore
from dpu_agent.weights.arena import Arena
from dpu_agent.weights.cache import WeightCache
from dpu_agent.weights.catalog import ExpertEntry, ModelCatalog
from dpu_agent.weights.policies import EvictionPolicy, make_policy, reads_routing
from dpu_agent.weights.reuse import warm_up as warm_up_routing
from dpu_offload import abi
from dpu_offload.flows import FlowTable
from dpu_offload.keys import ExpertKey
from dpu_offload.shm import group_id, share_with_group, sweep_stale

if TYPE_CHECKING:
    from dpu_agent.dataplane.nic import ActivationNic
    from dpu_agent.weights.layouts import ModelLayout

log = logging.getLogger("dpu_agent")

STALE_SEGMENTS = ("dpu-agent-arena", "dpu-channel", "dpu-pool", "dpu-bell", "dpu-engine-bell",
                  "dpu-steer",
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
        self.shm_group = (group_id(config.sessions.shm_group) if config.sessions.shm_group
                          else None)
        """The group this agent's shared memory is shared with (None: its user's alone)."""
        share_with_group(self.shm_group)
        self.arena = Arena(config.arena.bytes)
        warm_up_routing()
        warm_up_planner()
        warm_up_predictor()
        self.routing = RoutingStats()
        """The one store of routing statistics (the cache policy, the predictor and the
        placement planner read it)."""
        self.cache = WeightCache(self.arena, config.transfer.chunk_bytes,
                                 make_policy(config.cache.policy, self.routing))
        self.catalog = Models(self.cache, self.routing, config.prefetch.traces_dir)
        self.models = self.catalog.catalogs
        """Name -> catalog of every loaded model (``Models.catalogs``)."""
        self._lock = threading.RLock()
        self.leases = SessionTable(lambda: self.config.sessions, self._session_closed,
                                   self._lock)
        self.sessions = self.leases.open
        """Session id -> every open session (``SessionTable``)."""
        self._fills = ThreadPoolExecutor(max_workers=4, thread_name_prefix="retry")
        self.plane = DataPlane(self, self.cache, config.transfer.chunk_bytes, self._fills,
                               lambda sid: sid in self.sessions, self._devices,
                               (self.arena.name, self.arena.size, ARENA_REGION_ID),
                               self.transfer_timeout, config.transfer.poll_spin_us / 1e6,
                               config.transfer.engine_polls)
        self.draining = False
        self._device_list: tuple[Device, ...] | None = None
        """Every session's devices, rebuilt only after a registration or a closure (the
        data-plane loop reads it on every pass)."""
        self.scheduler = Scheduler(config.transfer.link_concurrency)
        self.grants = SlotGrants(self, self.plane.deliveries, self.scheduler, self._fills,
                                 self.transfer_timeout)
        self.placements = PlacementExecutor(self)
        self.registrations = Registrations(self, config.sessions.max_devices)
        self.predictor = NextLayerPredictor(self.routing)
        self.flows = FlowTable()
        self.activations: ActivationNic | None = None
        """The NIC stand-in when [activations] is enabled (set by the server)."""
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
        if new:
            self.steering_changed()
            if persist:
                self.persist()
        return catalog

    def model_index(self, name: str) -> int:
        return self.catalog.index(name)

    def model_name(self, index: int) -> str:
        return self.catalog.name(index)

    def expert(self, key: ExpertKey) -> ExpertEntry:
        return self.catalog.expert(key)

    # -- sessions (dpu_agent/sessions.py) --------------------------------------------------
    def create_session(self, client_name: str, lease_seconds: int) -> tuple[Session, str]:
        return self.leases.create(client_name, lease_seconds)

    def session(self, session_id: str) -> Session:
        return self.leases.get(session_id)

    def device(self, session: Session, device_id: int) -> Device:
        return self.leases.device(session, device_id)

    def close_session(self, session_id: str, reason: str = "closed") -> None:
        self.leases.close(session_id, reason)

    def events_dropped(self) -> int:
        return self.leases.events_dropped()

    def expire_sessions(self) -> list[str]:
        return self.leases.expire()

    def _session_closed(self, session: Session) -> None:
        """What a closed session owned goes: queued deliveries, placements, flows, its
        devices' deliveries in flight, queues, channels and engine rings."""
        with self._lock:
            self._device_list = None
        devices = set(session.devices.values())
        sid = session.session_id
        self.scheduler.cancel(lambda job: job.link[0] == sid)
        self.placements.forget_session(sid)
        gone = [r.rule_id for r in self.flows.rules() if owned_by(r, sid)]
        if gone:
            self.flows.update(delete=gone)  # its devices' queues are gone with it
        if self.activations is not None:
            for dev in devices:
                self.activations.stop_serving(dev.device_id)
            self.steering_changed()
        for dev in devices:
            self._close_device(dev)

    def _close_device(self, dev: Device) -> None:
        """Close a device's queue, cancel its transfers in flight (after the close, so a
        background fill cannot start one the cancel missed: later ones find the queue closed),
        close its channel and rings to the DMA engine, and stop watching its pools' landed
        slots (its activations were stopped)."""
        if dev.queue is not None:
            dev.queue.close()
        self.plane.deliveries.tracker.cancel(lambda t: t.owner is dev)
        if dev.channel is not None:
            dev.channel.close()
        if dev.engine_rings is not None:
            self.plane.engine.detach(dev)
        for pool in dev.pools.values():
            self.plane.deliveries.forget(pool)

    def device_removed(self, dev: Device) -> None:
        """A device deregistered by its session (nothing held or under way on it): its
        activations stop, its channel and rings close."""
        if self.activations is not None:
            self.activations.stop_serving(dev.device_id)
            self.steering_changed()
        self._close_device(dev)
        self.devices_changed()

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

    def transfer_timeout(self) -> float:
        """``transfer.timeout_seconds`` as configured now (live: a SIGHUP changes it)."""
        return float(self.config.transfer.timeout_seconds)

    # -- the channel's requests (dataplane/requests.py calls these by owner) ---------------
    def _owner(self, owner: tuple[str, int]) -> Session:
        with self._lock:
            session = self.sessions.get(owner[0])
        if session is None:
            raise AgentError(ErrorKind.UNAVAILABLE, "the channel's session is closed")
        return session

    def acquire_for(self, owner: tuple[str, int], key: ExpertKey, wait: bool) -> SlotGrant:
        return self.grants.acquire(self._owner(owner), owner[1], key, wait, pin_held=True)

    def release_for(self, owner: tuple[str, int], key: ExpertKey) -> None:
        self.release(self._owner(owner), owner[1], key)

    def prefetch_for(self, owner: tuple[str, int], key: ExpertKey) -> None:
        self.prefetch(self._owner(owner), owner[1], [key])

    def check_routed(self, key: ExpertKey) -> None:
        _check_visit(key.model, self._layout(key.model), key.layer, (key.expert,))

    def route_for(self, owner: tuple[str, int], model: str, layer: int,
                  tokens: dict[int, int], prefetch: int) -> None:
        self.report_routing(model, [(layer, tokens)],
                            (self._owner(owner), owner[1], prefetch) if prefetch else None)

    def slot_policy(self) -> EvictionPolicy:
        """A new slot pool's eviction policy: the configured one (``cache.policy``), reading
        the agent's routing statistics."""
        return make_policy(self.config.cache.policy, self.routing)

    def _show_pools(self, visit: Visit) -> None:
        """A visit to every slot pool's policy, each under its session's lock."""
        for session in list(self.sessions.values()):
            with session.lock:
                for dev in session.devices.values():
                    for pool in dev.pools.values():
                        pool.observe(visit)

    def _layout(self, model: str) -> ModelLayout:
        catalog = self.models.get(model)
        if catalog is None:
            raise not_found(f"model {model!r} is not loaded")
        return catalog.layout

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
        layout = self._layout(model)
        for layer, counts in steps:
            _check_visit(model, layout, layer, counts)
        if prefetch is not None:
            self.device(prefetch[0], prefetch[1])
            if prefetch[2] > layout.experts_per_layer:
                raise invalid(f"prefetch of {prefetch[2]} experts: a layer of {model!r} has "
                              f"{layout.experts_per_layer}")
        pools_read = reads_routing(self.config.cache.policy)
        for layer, counts in steps:
            visit = self.cache.observe(self.routing, model, layer, counts, keep=pools_read)
            if visit is not None:
                self._show_pools(visit)
        if prefetch is None or not steps:
            return 0
        session, device_id, k = prefetch
        nxt, experts = self.predictor.predict(model, k)
        return self.prefetch(session, device_id, [ExpertKey(model, nxt, e) for e in experts])

    # -- activations (the NIC stand-in steers them; dataplane/nic.py) ----------------------
    def steering_changed(self) -> int:
        """Rules, models, placed copies or cluster holdings changed: publish the NIC's next
        steering snapshot; returns its version (0 without activations)."""
        nic = self.activations
        return nic.publish() if nic is not None else 0

    def when_steering_drained(self, version: int, then: Callable[[], None]) -> None:
        """Run ``then`` once no message steered under a version before ``version`` is in
        flight (at once without activations)."""
        nic = self.activations
        if nic is None:
            then()
        else:
            nic.when_drained(version, then)

    def steering_counters(self) -> NicCounters:
        """What the NIC counted (rules matched, frames, refusals); zero without it."""
        nic = self.activations
        return nic.counters() if nic is not None else NicCounters()

    def serve_activations(self, session: Session, device_id: int, serve: bool) -> None:
        """ServeActivations: the NIC writes the messages steered to the device into its rx
        packet ring (registered with the device) and answers from its tx ring."""
        dev = self.device(session, device_id)
        nic = self.activations
        if nic is None:
            raise precondition("the agent has no [activations] listen_address")
        if not serve:
            nic.stop_serving(device_id)
            return
        rings = [dev.packet_rings.get(k) for k in (abi.RingKind.RX_PACKET,
                                                   abi.RingKind.TX_PACKET)]
        if not all(rings):
            raise precondition(f"device {device_id} has no rx and tx packet rings registered")
        try:
            nic.serve(device_id, *rings)
        except ValueError as exc:
            raise invalid(str(exc)) from exc

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


def _check_visit(model: str, layout: ModelLayout, layer: int, experts: Iterable[int]) -> None:
    """Raise INVALID_ARGUMENT unless ``layer`` is a MoE layer of ``model`` and every expert
    is below its experts per layer (a routing visit, reported by ReportRouting or ROUTE)."""
    if layer not in layout.moe_layers:
        raise invalid(f"layer {layer} is not an MoE layer of {model!r}")
    bad = [e for e in experts if e >= layout.experts_per_layer]
    if bad:
        raise invalid(f"expert {bad[0]} out of range for {model!r} "
                      f"({layout.experts_per_layer} per layer)")
