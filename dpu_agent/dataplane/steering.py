"""What the agent programs into the NIC: which rules go into the flow table
(``dpu_offload.flows``), who made a rule (its origin), the rules that follow a session's
placement, and the steering snapshot the NIC stand-in steers by
(``dpu_offload.steering_snapshot``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from dpu_agent.errors import AgentError, ErrorKind, invalid, not_found
from dpu_agent.slots import SlotState
from dpu_offload.flows import Action, FlowRule, FlowTable, SteeringError, TrafficClass
from dpu_offload.keys import ExpertKey
from dpu_offload.steering_snapshot import ModelEntry, Snapshot

if TYPE_CHECKING:
    from dpu_agent.models import Models
    from dpu_agent.registry import Device, Session


def manual_origin(session_id: str) -> str:
    """The origin of the rules a session adds with ApplyFlows (only it may delete them)."""
    return f"manual:{session_id}"


def placement_origin(session_id: str, model: str) -> str:
    """The origin of the rules that follow a session's placement of ``model``."""
    return f"placement:{session_id}:{model}"


def owned_by(rule: FlowRule, session_id: str) -> bool:
    """Whether ``rule`` came from the session (ApplyFlows or one of its placements)."""
    return rule.origin == manual_origin(session_id) or \
        rule.origin.startswith(placement_origin(session_id, ""))


def placement_rules(session_id: str, model: str, layers: list[int],
                    assignment: list[list[list[int]]]) -> list[FlowRule]:
    """One FORWARD rule per placed expert (activations), queues = the devices holding it."""
    origin = placement_origin(session_id, model)
    return [FlowRule(0, TrafficClass.ACTIVATIONS, Action.FORWARD, model=model,
                     layer_min=layers[li], layer_max=layers[li], expert=e,
                     queues=tuple(devs), priority=0, origin=origin)
            for li, row in enumerate(assignment) for e, devs in enumerate(row)]


class PlacedCopies(Protocol):
    """Where placement put experts (``PlacementExecutor``)."""

    def routed_copies(self) -> list[tuple[str, int, ExpertKey]]: ...


class SteeringCore(Protocol):
    """What the steering snapshot is built from (the Orchestrator)."""

    flows: FlowTable
    catalog: Models
    sessions: dict[str, Session]
    placements: PlacedCopies
    cluster: Any


def _slot_of(dev: Device, key: ExpertKey) -> tuple[int, int] | None:
    """(region id, byte offset) of the READY slot holding ``key`` on ``dev``, if any."""
    for pool in dev.pools.values():
        idx = pool.by_key.get(key)
        if idx is not None and pool.state[idx] == SlotState.READY:
            return pool.region_id, idx * pool.slot_bytes
    return None


def build_snapshot(core: SteeringCore, version: int) -> Snapshot:
    """The agent's steering state as the NIC takes it: every rule, every loaded model, where
    each placed copy lies on its device, and which experts other agents of the cluster serve."""
    models = {name: ModelEntry(core.catalog.index(name), cat.layout.hidden_size,
                               cat.layout.experts_per_layer,
                               frozenset(cat.layout.moe_layers))
              for name, cat in list(core.catalog.catalogs.items())}
    slots: dict[tuple[int, ExpertKey], tuple[int, int]] = {}
    for sid, device_id, key in core.placements.routed_copies():
        session = core.sessions.get(sid)
        dev = session.devices.get(device_id) if session is not None else None
        where = _slot_of(dev, key) if dev is not None else None
        if where is not None:
            slots[(device_id, key)] = where
    remotes = core.cluster.remote_holders() if core.cluster is not None else {}
    return Snapshot(version, core.flows.rules(), models, slots, remotes)


def apply_session_flows(table: FlowTable, session_id: str, add: list[FlowRule],
                        delete: list[int]) -> tuple[int, list[int]]:
    """A session's ApplyFlows on ``table``, all of it or none: ``add`` (rules the session
    writes: no id or origin yet, each becomes ``manual_origin(session_id)``'s) and ``delete``
    (ids of rules the session added). Returns (the table's version, the ids added); NOT_FOUND,
    INVALID_ARGUMENT or PERMISSION_DENIED naming the rule."""
    for i, rule in enumerate(add):
        if rule.rule_id or rule.origin:
            raise invalid(f"add[{i}]: rule_id and origin are assigned by the agent")
    origins = {r.rule_id: r.origin for r in table.rules()}
    for rid in delete:
        origin = origins.get(rid)
        if origin is None:
            raise not_found(f"rule {rid} does not exist")
        if origin.startswith("placement:"):
            raise invalid(f"rule {rid} follows a placement (ApplyPlacement changes it)")
        if origin != manual_origin(session_id):
            raise AgentError(ErrorKind.PERMISSION_DENIED, f"rule {rid} belongs to another session")
    mine = [replace(r, origin=manual_origin(session_id)) for r in add]
    try:
        version = table.update(add=mine, delete=list(delete))
    except SteeringError as exc:
        raise invalid(str(exc)) from exc
    return version, sorted({r.rule_id for r in table.rules()} - set(origins))
