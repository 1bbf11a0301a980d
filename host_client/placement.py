"""Placement and routing reports, the control-plane calls of :class:`~host_client.client.
AgentClient` that move experts between devices rather than through one device's channel:
apply a placement or have the agent plan one from reported routing, follow its progress (the
session's event stream), report routing over gRPC.
"""

from __future__ import annotations

import time

from dpu_offload import abi
from dpu_offload.v1 import agent_pb2 as pb
from host_client.connection import TlsFiles
from host_client.errors import InvalidArgument
from host_client.registration import AttachedDevice
from host_client.session import AgentSession

__all__ = ["PlacementCalls"]


def visit_problem(layer: int, tokens: dict[int, int], least: int = 1) -> str | None:
    """What makes one MoE layer's routing unusable (None when it is fine): ``tokens[e]``, the
    tokens that chose expert ``e``, must name at least one expert, experts and the layer within
    a request entry's fields, each count from ``least`` (ReportRouting takes 0: not chosen) to
    ``abi.MAX_ROUTE_COUNT``."""
    if not isinstance(tokens, dict) or not tokens or not all(
            isinstance(e, int) and isinstance(n, int) for e, n in tokens.items()):
        return f"a visit is {{expert: tokens}} of ints, got {tokens!r}"[:200]
    if min(tokens.values()) < least or min(tokens) < 0:
        return (f"a visit needs experts >= 0 each chosen by >= {least} token"
                f"{'s' if least != 1 else ''}; got {tokens}")[:200]
    if max(tokens.values()) > abi.MAX_ROUTE_COUNT or max(tokens) > abi.MAX_KEY_FIELD:
        return (f"a visit's counts are at most {abi.MAX_ROUTE_COUNT} tokens and its experts at "
                f"most {abi.MAX_KEY_FIELD}; got {tokens}")[:200]
    if not isinstance(layer, int) or not 0 <= layer <= abi.MAX_KEY_FIELD:
        return f"layer {layer!r}: expected an int in [0, {abi.MAX_KEY_FIELD}]"
    return None


def assignment_problem(assignment: list[list[list[int]]]) -> str | None:
    """What makes a placement's ``assignment[moe layer position][expert]`` -> device ids
    unusable (None when it is fine): rows of lists of device ids, each an int >= 0."""
    for la, row in enumerate(assignment if isinstance(assignment, list) else [None]):
        if not isinstance(row, list):
            return f"assignment[{la}]: a list of experts' device lists, got {row!r}"[:200]
        for e, ids in enumerate(row):
            if not isinstance(ids, list | tuple) or not all(
                    isinstance(d, int) and 0 <= d < 2**32 for d in ids):
                return f"assignment[{la}][{e}]: a list of device ids, got {ids!r}"[:200]
    return None


class PlacementCalls(AgentSession):
    """The session's placement calls and the devices they wake (``devices``: device id ->
    the devices this client registered, filled by ``AgentClient``). Arguments as
    :class:`~host_client.session.AgentSession`."""

    def __init__(self, address: str, *, client_name: str, lease_seconds: int,
                 connect_timeout: float, rpc_timeout: float, tls: TlsFiles | None) -> None:
        self._placements: dict[int, pb.PlacementProgress] = {}
        self.devices: dict[int, AttachedDevice] = {}
        super().__init__(address, client_name=client_name, lease_seconds=lease_seconds,
                         connect_timeout=connect_timeout, rpc_timeout=rpc_timeout, tls=tls)

    def apply_placement(self, model: str, assignment: list[list[list[int]]]
                        ) -> pb.ApplyPlacementResponse:
        """Place ``assignment[moe layer position][expert]`` -> device ids, make-before-break;
        progress arrives as ``placement_progress`` events (see :meth:`placement_progress`)."""
        problem = assignment_problem(assignment)
        if problem:
            raise InvalidArgument(f"ApplyPlacement: {problem}")
        resp = self.stub.ApplyPlacement(pb.ApplyPlacementRequest(
            session_id=self.session_id, model=model,
            layers=[pb.LayerPlacement(experts=[pb.DeviceList(device_ids=d) for d in row])
                    for row in assignment]), timeout=self.rpc_timeout)
        self._ring_all()
        return resp

    def rebalance(self, model: str, replicas: int = 0) -> pb.RebalanceResponse:
        """Re-plan ``model`` over this session's devices from reported routing and apply it."""
        resp = self.stub.Rebalance(pb.RebalanceRequest(
            session_id=self.session_id, model=model, replicas=replicas),
            timeout=self.rpc_timeout)
        self._ring_all()
        return resp

    def _ring_all(self) -> None:
        """Wake every device's consumer: the agent has work for them it was not asked for
        through their channels."""
        for dev in self.devices.values():
            dev.device.doorbell.ring()

    def wait_placement(self, placement_id: int, timeout: float = 60.0) -> pb.PlacementProgress:
        """Block until every new copy of a placement is verified or failed; returns the final
        progress. TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.placement_progress(placement_id)
            if p is not None and p.done + p.failed == p.total:
                return p
            if time.monotonic() > deadline:
                raise TimeoutError(f"placement {placement_id} unfinished after {timeout} s: "
                                   f"{p}")
            time.sleep(0.01)

    def placement_progress(self, placement_id: int) -> pb.PlacementProgress | None:
        """The latest progress event seen for a placement."""
        with self._lock:
            return self._placements.get(placement_id)

    def report_routing(self, model: str, steps: list[tuple[int, dict[int, int]]],
                       prefetch_to: AttachedDevice | None = None, prefetch_top_k: int = 0
                       ) -> None:
        """Tell the agent which experts the last steps selected: (layer, {expert: tokens});
        optionally have it prefetch the likeliest experts of the next MoE layer."""
        for layer, tokens in steps:
            problem = visit_problem(layer, tokens, least=0)
            if problem:
                raise InvalidArgument(f"ReportRouting: {problem}")
        self.stub.ReportRouting(pb.ReportRoutingRequest(
            session_id=self.session_id, model=model,
            steps=[pb.RoutingStep(layer=layer, experts=list(c), tokens=list(c.values()))
                   for layer, c in steps],
            prefetch_top_k=prefetch_top_k if prefetch_to is not None else 0,
            prefetch_device_id=prefetch_to.device_id if prefetch_to is not None else 0),
            timeout=self.rpc_timeout)
        if prefetch_to is not None:
            prefetch_to.device.doorbell.ring()

    # -- the session's hooks -----------------------------------------------------------------
    def _on_event(self, event: pb.Event) -> None:
        if event.HasField("placement_progress"):
            p = event.placement_progress
            with self._lock:  # progress only grows: never let an older count replace a newer
                seen = self._placements.get(p.placement_id)
                if seen is None or p.done + p.failed + p.dropped >= \
                        seen.done + seen.failed + seen.dropped:
                    self._placements[p.placement_id] = p
