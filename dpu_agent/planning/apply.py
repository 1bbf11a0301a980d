"""Applying a placement to a session's devices, make-before-break.

A placement holds one reference on every slot it places, so those experts are never evicted.
Applying a new one:

1. validates it whole (model, shape, device ids, slot capacity per device) and refuses it
   with the failing constraint, leaving the placement in force untouched;
2. cancels the queued moves of the previous placement of that model;
3. queues every new copy at REBALANCE priority on its device link (layer order);
4. releases an old copy only once every new copy of that expert is verified READY, so there
   is never a moment when neither serves it. A failed new copy keeps the old ones.

Progress goes to the session's event stream (``PlacementProgress``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dpu_agent.dataplane.steering import placement_origin, placement_rules
from dpu_agent.errors import AgentError, ErrorKind, invalid, not_found
from dpu_agent.planning.placement import PlacementError, plan
from dpu_agent.planning.scheduler import Priority
from dpu_agent.registry import PlacementProgressEvent, Session
from dpu_offload.keys import ExpertKey

if TYPE_CHECKING:
    from dpu_agent.dataplane.grants import SlotGrants
    from dpu_agent.planning.scheduler import Scheduler
    from dpu_agent.registry import Device
    from dpu_agent.routing.stats import RoutingStats
    from dpu_agent.weights.catalog import ModelCatalog
    from dpu_offload.flows import FlowTable

Copy = tuple[int, ExpertKey]
"""(device id, expert)."""


@dataclass
class PlacementState:
    """One applied placement of one model in one session."""

    placement_id: int
    owner: str
    """The session id whose placement this is."""
    model: str
    assignment: list[list[list[int]]]
    """[MoE layer position][expert] -> device ids."""
    replicas: int = 0
    held: set[Copy] = field(default_factory=set)
    pending: dict[ExpertKey, set[int]] = field(default_factory=dict)
    retire: dict[ExpertKey, set[int]] = field(default_factory=dict)
    total: int = 0
    done: int = 0
    failed: int = 0
    dropped: int = 0


class PlacementCore(Protocol):
    """What applying placements needs of the agent's core (the Orchestrator)."""

    models: dict[str, ModelCatalog]
    sessions: dict[str, Session]
    grants: SlotGrants
    flows: FlowTable
    routing: RoutingStats
    scheduler: Scheduler

    def device(self, session: Session, device_id: int) -> Device: ...
    def persist(self) -> None: ...
    def steering_changed(self) -> int: ...
    def when_steering_drained(self, version: int, then: Callable[[], None]) -> None: ...


class PlacementExecutor:
    """Turns placements into scheduled moves for the agent's core."""

    def __init__(self, core: PlacementCore) -> None:
        self.core = core
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.states: dict[tuple[str, str], PlacementState] = {}
        """(session id, model) -> placement in force."""

    # -- validation ------------------------------------------------------------------------
    def _check(self, session: Session, model: str, assignment: list[list[list[int]]]) -> None:
        catalog = self.core.models.get(model)
        if catalog is None:
            raise not_found(f"model {model!r} is not loaded")
        layers, experts = len(catalog.layout.moe_layers), catalog.layout.experts_per_layer
        if len(assignment) != layers or any(len(row) != experts for row in assignment):
            raise invalid(f"placement must be [{layers} MoE layers][{experts} experts]")
        need: dict[int, int] = {}
        for li, row in enumerate(assignment):
            for e, devs in enumerate(row):
                if not devs:
                    raise invalid(f"layer {catalog.layout.moe_layers[li]} expert {e} is placed "
                                  "nowhere")
                if len(set(devs)) != len(devs):
                    raise invalid(f"layer {catalog.layout.moe_layers[li]} expert {e} names a "
                                  "device twice")
                for d in devs:
                    self.core.device(session, d)  # another session's: PERMISSION_DENIED
                    need[d] = need.get(d, 0) + 1
        size = catalog.expert_bytes
        for d, n in need.items():
            slots = sum(p.slot_count for p in session.devices[d].pools.values()
                        if p.slot_bytes >= size)
            if n > slots:
                raise AgentError(ErrorKind.FAILED_PRECONDITION,
                                 f"device {d} is assigned {n} experts but has {slots} slots "
                                 f"that fit them ({size} bytes each)")

    # -- apply -----------------------------------------------------------------------------
    def apply(self, session: Session, model: str, assignment: list[list[list[int]]],
              replicas: int = 0) -> PlacementState:
        self._check(session, model, assignment)
        catalog = self.core.models[model]
        layers = catalog.layout.moe_layers
        wanted = {(d, ExpertKey(model, layers[li], e))
                  for li, row in enumerate(assignment) for e, devs in enumerate(row)
                  for d in devs}
        with self._lock:
            old = self.states.get((session.session_id, model))
            state = PlacementState(next(self._ids), session.session_id, model, assignment,
                                   replicas)
            if old is not None:
                self.core.scheduler.cancel(lambda job: job.tag == old.placement_id)
                state.held = old.held & wanted
                stale = old.held - wanted
            else:
                stale = set()
            to_add = sorted(wanted - state.held, key=lambda c: (c[1].layer, c[1].expert, c[0]))
            for d, key in to_add:
                state.pending.setdefault(key, set()).add(d)
            for d, key in stale:
                state.retire.setdefault(key, set()).add(d)
            state.total = len(to_add)
            self.states[(session.session_id, model)] = state
        for key in list(state.retire):
            self._maybe_retire(session, state, key)
        targets: dict[ExpertKey, list[int]] = {}
        for d, key in to_add:
            targets.setdefault(key, []).append(d)
        for key, devs in targets.items():
            # Fan-out: devices that can read the first target's slots wait for its copy and
            # take theirs from it (GPU to GPU), so the arena is read once per expert.
            first = devs[0]
            followers = [d for d in devs[1:] if first in session.devices[d].peer_sources]
            for d in devs:
                if d == first:
                    self._copy(session, state, d, key, then=followers)
                elif d not in followers:
                    self._copy(session, state, d, key)
        self._progress(session, state)
        self.core.persist()
        return state

    def _copy(self, session: Session, state: PlacementState, device_id: int, key: ExpertKey,
              then: tuple[int, ...] | list[int] = ()) -> None:
        """Queue one new copy; when it ends (either way), queue the copies in ``then`` while
        this placement is still the one in force."""
        def ready(ok: bool) -> None:
            self._copy_done(session, state, device_id, key, ok)
            if self.states.get((session.session_id, state.model)) is state:
                for d in then:
                    self._copy(session, state, d, key)

        self.core.grants.start_background(session, device_id, key, Priority.REBALANCE, refs=1,
                                          order=key.layer, tag=state.placement_id,
                                          on_ready=ready)

    def _copy_done(self, session: Session, state: PlacementState, device_id: int,
                   key: ExpertKey, ok: bool) -> None:
        with self._lock:
            state.pending.get(key, set()).discard(device_id)
            if ok:
                state.held.add((device_id, key))
                state.done += 1
            else:
                state.failed += 1
                state.retire.pop(key, None)  # keep the old copies: the new one did not make it
            if not state.pending.get(key):
                state.pending.pop(key, None)
        self._maybe_retire(session, state, key)
        self._progress(session, state)

    def _maybe_retire(self, session: Session, state: PlacementState, key: ExpertKey) -> None:
        """Retire ``key``'s old copies once its new ones are all made (or failed): steering
        stops sending to them first, and their slots are let go once the messages already
        steered there are answered."""
        with self._lock:
            if state.pending.get(key):
                return
            devices = state.retire.pop(key, set())
            for d in devices:
                state.held.discard((d, key))
                state.dropped += 1
        if not devices:
            return
        version = self._sync_flows(state)

        def let_go() -> None:
            for d in devices:
                session.drop_ref(d, key)
        self.core.when_steering_drained(version, let_go)

    def routed_copies(self) -> list[tuple[str, int, ExpertKey]]:
        """(session id, device id, expert) of every copy steering may send to: placed ones and
        those waiting to be retired."""
        out: list[tuple[str, int, ExpertKey]] = []
        with self._lock:
            for (sid, _), st in self.states.items():
                out += [(sid, d, k) for d, k in st.held]
                out += [(sid, d, k) for k, devices in st.retire.items() for d in devices]
        return out

    def _sync_flows(self, state: PlacementState) -> int:
        """Steering follows placement, make-before-break: an expert's rule forwards to every
        device that holds a placed copy now (new copies join when verified, old ones leave
        when retired), so activations never reach a device without the expert. A placement no
        longer in force (replaced, or its session closed) writes nothing: its completions may
        come after the close removed its session's rules."""
        catalog = self.core.models.get(state.model)
        if catalog is None:
            return self.core.steering_changed()
        with self._lock:
            held: dict[ExpertKey, set[int]] = {}
            for d, key in state.held:
                held.setdefault(key, set()).add(d)
            for key, devs in state.retire.items():
                held.setdefault(key, set()).update(devs)
        layers = list(catalog.layout.moe_layers)
        serving = [[sorted(held.get(ExpertKey(state.model, layer, e), ()))
                    for e in range(catalog.layout.experts_per_layer)] for layer in layers]
        rules = [r for r in placement_rules(state.owner, state.model, layers, serving)
                 if r.queues]
        with self._lock:  # only a placement in force writes rules (its session may be closing)
            if self.states.get((state.owner, state.model)) is not state:
                return self.core.steering_changed()
            self.core.flows.update(add=rules,
                                   replace_origin=placement_origin(state.owner, state.model))
        return self.core.steering_changed()

    def _progress(self, session: Session, state: PlacementState) -> None:
        self._sync_flows(state)
        # Snapshot and emit under the lock: events leave in the order the counts grew (two
        # copies finishing at once could otherwise emit done=N after done=N+1).
        with self._lock:
            session.events.emit(PlacementProgressEvent(
                state.placement_id, state.model, state.done, state.failed, state.total,
                state.dropped))

    # -- rebalance -------------------------------------------------------------------------
    def rebalance(self, session: Session, model: str, replicas: int
                  ) -> tuple[PlacementState, float, int]:
        """Plan from reported routing load across the session's devices and apply it.
        Returns (state, max_load_ratio, bytes_moved)."""
        catalog = self.core.models.get(model)
        if catalog is None:
            raise not_found(f"model {model!r} is not loaded")
        load = self.core.routing.load(model)
        if load is None:
            raise AgentError(ErrorKind.FAILED_PRECONDITION,
                             f"no routing reported for {model!r} yet (ReportRouting)")
        device_ids = sorted(session.devices)
        if not device_ids:
            raise AgentError(ErrorKind.FAILED_PRECONDITION, "the session has no devices")
        layers = len(catalog.layout.moe_layers)
        size = catalog.expert_bytes
        slots = [sum(p.slot_count for p in session.devices[d].pools.values()
                     if p.slot_bytes >= size) // layers for d in device_ids]
        index = {d: i for i, d in enumerate(device_ids)}
        old = self.states.get((session.session_id, model))
        current = None
        if old is not None and all(d in index for row in old.assignment for devs in row
                                   for d in devs):
            current = [[[index[d] for d in devs] for devs in row] for row in old.assignment]
        try:
            p = plan(load, slots, current=current, replicas=replicas, expert_bytes=size)
        except PlacementError as exc:
            raise AgentError(ErrorKind.FAILED_PRECONDITION, f"rebalance: {exc}") from exc
        assignment = [[[device_ids[g] for g in gpus] for gpus in row] for row in p.assignment]
        state = self.apply(session, model, assignment, replicas)
        return state, p.max_load_ratio, p.bytes_moved

    def rebalance_all(self) -> None:
        """The periodic loop's step: re-plan every placed model of every live session."""
        for (sid, model), state in list(self.states.items()):
            session = self.core.sessions.get(sid)
            if session is None:
                self.states.pop((sid, model), None)
                continue
            try:
                self.rebalance(session, model, state.replicas)
            except AgentError:
                pass  # no new statistics or no capacity: keep the placement in force

    def naming(self, session_id: str, device_id: int) -> PlacementState | None:
        """A placement of the session whose assignment places experts on ``device_id``."""
        with self._lock:
            return next((st for (sid, _), st in self.states.items() if sid == session_id
                         and any(device_id in ids for row in st.assignment for ids in row)),
                        None)

    def forget_session(self, session_id: str) -> None:
        for key in [k for k in self.states if k[0] == session_id]:
            del self.states[key]
