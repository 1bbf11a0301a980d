"""Serving a channel's request ring: each entry is untrusted; it is checked, turned into a call
of the agent's core, and answered in the reply table with a status that names what was wrong.
A refused request changes nothing. An ACQUIRE whose expert must first be read into the arena
is finished on a fill thread, so the loop keeps serving; the fills of what the loop took at once
(a client's batch) start after its other entries are served, so the experts the batch finds in
the arena are pinned before any of its fills evicts. An ACQUIRE that finds every slot that fits
held or still landing is parked: the loop tries it again after it took up completions or
verdicts (and at least every ``RETRY_SECONDS``), and refuses it RESOURCE_EXHAUSTED if no slot
came within the transfer timeout. ROUTE entries gather a layer's visit on
the channel; its last entry folds the visit into the routing statistics (and may prefetch), in
order with the channel's acquires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Protocol

from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.dataplane.grants import WaitForLanding
from dpu_agent.errors import AgentError, ErrorKind, invalid, not_found, precondition
from dpu_agent.weights.cache import WouldBlock
from dpu_offload import abi
from dpu_offload.keys import ExpertKey

log = logging.getLogger("dpu_agent.dataplane")

MAX_WAIT_NS = 10 * 10**9
"""A posting time further back than this is not believed (a client's clock field)."""
_ID, _OP, _FLAGS, _MODEL, _LAYER, _EXPERT, _POSTED, _COUNT, _PREFETCH = (
    abi.REQUEST_DTYPE.names.index(f) for f in ("request_id", "opcode", "flags", "model",
                                               "layer", "expert", "posted_ns", "count",
                                               "prefetch"))
_KNOWN_FLAGS = sum(abi.RequestFlags)
RETRY_SECONDS = 0.001
"""A parked ACQUIRE is tried again at least this often (a check's grace period ends
unannounced)."""


@dataclass
class Parked:
    """An ACQUIRE waiting in the loop for a slot to land."""

    channel: DeviceChannel
    position: int
    request_id: int
    key: ExpertKey
    deadline: float
    """Monotonic seconds after which it is refused."""


class Grant(Protocol):
    region_id: int
    slot_index: int
    slot_offset: int
    state_index: int
    generation: int
    resident: bool
    pin_held: bool


class RequestCore(Protocol):
    """What serving requests needs of the agent's core (the Orchestrator)."""

    def model_name(self, index: int) -> str: ...
    def acquire_for(self, owner: tuple[str, int], key: ExpertKey, wait: bool) -> Grant:
        """Grant ``key`` to the channel's client; ``Grant.pin_held``: it holds it by a pin."""
    def release_for(self, owner: tuple[str, int], key: ExpertKey) -> None: ...
    def prefetch_for(self, owner: tuple[str, int], key: ExpertKey) -> None: ...
    def check_routed(self, key: ExpertKey) -> None:
        """Raise AgentError unless ``key``'s layer is a MoE layer and its expert in range."""
    def route_for(self, owner: tuple[str, int], model: str, layer: int,
                  tokens: dict[int, int], prefetch: int) -> None: ...


def _status(kind: ErrorKind) -> abi.RequestStatus:
    return abi.RequestStatus[kind.value]


class RequestServer:
    """Serves request entries of any channel against ``core``.

    Args:
        core: the agent's core.
        fills: where an ACQUIRE that needs an arena fill finishes.
        landing_timeout: seconds a parked ACQUIRE waits for a slot to land (read at each
            parking).
    """

    def __init__(self, core: RequestCore, fills: Executor,
                 landing_timeout: Callable[[], float]) -> None:
        self.core = core
        self.fills = fills
        self.landing_timeout = landing_timeout
        self.parked: list[Parked] = []
        """ACQUIREs waiting for a slot to land, oldest first."""
        self.parked_total = 0
        """ACQUIREs ever parked."""
        self._retried = 0.0
        self._released = False
        """Whether a RELEASE was served since the parked ACQUIREs were last tried."""
        self.taken = 0
        """Request-ring entries taken from the channels (a parked ACQUIRE counted once)."""
        self.refused = 0
        """Requests answered with an error status."""
        self.timed = 0
        """Requests whose posting time (``posted_ns``) was plausible, and so were timed."""
        self.waited_ns = 0
        """Sum over timed requests of posting -> taken by the loop (nanoseconds)."""
        self.served_ns = 0
        """Sum over timed requests of taken -> answered (or handed to a fill thread, or parked)."""

    def serve(self, channel: DeviceChannel) -> int:
        """Take and answer what ``channel`` has posted; returns how many requests."""
        first, batch = channel.take_requests()
        if batch.size == 0:
            return 0
        taken = time.monotonic_ns()
        self.taken += int(batch.size)
        rows = batch.tolist()  # plain tuples: a field of a NumPy record costs a microsecond
        fills: list[tuple[int, int, ExpertKey]] = []
        for j, row in enumerate(rows):
            self._one(channel, first + j, row, fills)
        for position, rid, key in fills:
            self.fills.submit(self._acquire_filling, channel, position, rid, key)
        # A diagnostic, client-written: only plausible times count.
        waits = [taken - row[_POSTED] for row in rows
                 if row[_POSTED] and 0 <= taken - row[_POSTED] < MAX_WAIT_NS]
        if waits:
            self.timed += len(waits)
            self.waited_ns += sum(waits)
            self.served_ns += len(waits) * (time.monotonic_ns() - taken)
        return int(batch.size)

    def _one(self, channel: DeviceChannel, position: int, req: tuple[int, ...],
             fills: list[tuple[int, int, ExpertKey]]) -> None:
        """Serve one entry (``REQUEST_DTYPE`` fields, in order); an ACQUIRE that needs an arena
        fill is added to ``fills`` (position, request id, key) instead, one that must wait for
        a slot to land is parked."""
        rid = req[_ID]
        if rid <= channel.last_request_id:
            self._refuse(channel, position, rid, abi.RequestStatus.REQUEST_REUSED,
                         f"request id {rid} is not above the last one served "
                         f"({channel.last_request_id})")
            return
        channel.last_request_id = rid
        op = req[_OP]
        if op not in abi.RequestOp._value2member_map_:
            self._refuse(channel, position, rid, abi.RequestStatus.BAD_OPCODE,
                         f"request opcode {op} is not ACQUIRE, RELEASE, PREFETCH or ROUTE")
            return
        if req[_FLAGS] & ~_KNOWN_FLAGS or (op != abi.RequestOp.ROUTE and (
                req[_FLAGS] or req[_COUNT] or req[_PREFETCH])):
            self._refuse(channel, position, rid, abi.RequestStatus.INVALID_ARGUMENT,
                         f"flags {req[_FLAGS]:#x} / count {req[_COUNT]} / prefetch "
                         f"{req[_PREFETCH]}: ROUTE's alone (flag LAST only)")
            return
        try:
            key = ExpertKey(self.core.model_name(req[_MODEL]), req[_LAYER], req[_EXPERT])
            if op == abi.RequestOp.ROUTE:
                self._route(channel, position, rid, key, req)
            elif op == abi.RequestOp.ACQUIRE:
                self._acquire(channel, position, rid, key, fills)
            elif op == abi.RequestOp.RELEASE:
                self.core.release_for(channel.owner, key)
                self._released = True
                channel.reply(position, rid, abi.RequestStatus.OK)
            else:
                self.core.prefetch_for(channel.owner, key)
                channel.reply(position, rid, abi.RequestStatus.OK)
        except AgentError as exc:
            self._refuse(channel, position, rid, _status(exc.kind), exc.message)
        except Exception as exc:
            log.exception("request %d on channel %s failed", rid, channel.name)
            self._refuse(channel, position, rid, abi.RequestStatus.UNAVAILABLE,
                         f"the agent failed serving request {rid}: {exc}")

    def retry_parked(self, landed: bool) -> int:
        """Try the parked ACQUIREs again, oldest first, if a slot may have come free since
        (``landed``: completions or verdicts were taken up; a RELEASE was served) or
        ``RETRY_SECONDS`` passed; one past its deadline is refused. Returns how many were
        answered."""
        now = time.monotonic()
        if not self.parked or not (landed or self._released
                                   or now - self._retried >= RETRY_SECONDS):
            return 0
        self._retried, self._released = now, False
        waiting, self.parked = self.parked, []
        for p in waiting:
            if not p.channel.closed:
                self._acquire(p.channel, p.position, p.request_id, p.key, None, p.deadline)
        return len(waiting) - len(self.parked)

    def _acquire(self, channel: DeviceChannel, position: int, rid: int, key: ExpertKey,
                 fills: list[tuple[int, int, ExpertKey]] | None,
                 deadline: float | None = None) -> None:
        """Serve an ACQUIRE without blocking: granted, refused, parked (every slot that fits
        is landing, and ``deadline`` is ahead; None: a new request, parked for the landing
        timeout), or handed to a fill thread (added to ``fills``, or submitted at once when
        None)."""
        try:
            grant = self.core.acquire_for(channel.owner, key, False)
        except WaitForLanding as exc:
            now = time.monotonic()
            if deadline is None:
                self.parked_total += 1
                deadline = now + self.landing_timeout()
            if now < deadline:
                self.parked.append(Parked(channel, position, rid, key, deadline))
            else:
                self._refuse(channel, position, rid, abi.RequestStatus.RESOURCE_EXHAUSTED,
                             f"{exc} for {self.landing_timeout()} s")
        except WouldBlock:
            if fills is None:
                self.fills.submit(self._acquire_filling, channel, position, rid, key)
            else:
                fills.append((position, rid, key))
        except AgentError as exc:
            self._refuse(channel, position, rid, _status(exc.kind), exc.message)
        except Exception as exc:
            log.exception("acquire %d of %s failed", rid, key)
            self._refuse(channel, position, rid, abi.RequestStatus.UNAVAILABLE,
                         f"the agent failed serving request {rid}: {exc}")
        else:
            self._granted(channel, position, rid, grant)

    def _route(self, channel: DeviceChannel, position: int, rid: int, key: ExpertKey,
               req: tuple[int, ...]) -> None:
        """One ROUTE entry: checked, added to the channel's open visit (replied OK), and on
        the visit's LAST entry the visit is folded in (and its prefetch queued); the reply to
        the last entry says how that went. A visit of another layer while one is open drops the
        open one (its entries folded nothing) and is refused."""
        count, last = req[_COUNT], bool(req[_FLAGS] & abi.RequestFlags.LAST)
        if not 0 < count <= abi.MAX_ROUTE_COUNT:
            raise invalid(f"ROUTE count {count}: tokens must be 1..{abi.MAX_ROUTE_COUNT}")
        if req[_PREFETCH] and not last:
            raise invalid(f"ROUTE prefetch {req[_PREFETCH]} on an entry that does not end "
                          "its visit (flag LAST)")
        self.core.check_routed(key)
        visit = channel.visit
        if visit is not None and (visit[0], visit[1]) != (key.model, key.layer):
            channel.visit = None
            raise precondition(f"visit of layer {visit[1]} dropped: a ROUTE of layer "
                               f"{key.layer} came before its LAST")
        tokens = visit[2] if visit is not None else {}
        if key.expert in tokens:
            raise invalid(f"expert {key.expert} twice in one visit of layer {key.layer}")
        tokens[key.expert] = count
        channel.visit = None if last else (key.model, key.layer, tokens)
        if last:
            self.core.route_for(channel.owner, key.model, key.layer, tokens, req[_PREFETCH])
        channel.reply(position, rid, abi.RequestStatus.OK)

    def _acquire_filling(self, channel: DeviceChannel, position: int, rid: int,
                         key: ExpertKey) -> None:
        try:
            self._granted(channel, position, rid, self.core.acquire_for(channel.owner, key, True))
        except AgentError as exc:
            self._refuse(channel, position, rid, _status(exc.kind), exc.message)
        except Exception as exc:
            log.exception("acquire of %s failed", key)
            self._refuse(channel, position, rid, abi.RequestStatus.UNAVAILABLE,
                         f"acquire of {key} failed in the agent: {exc}")

    @staticmethod
    def _granted(channel: DeviceChannel, position: int, rid: int, grant: Grant) -> None:
        channel.reply(position, rid, abi.RequestStatus.OK, region_id=grant.region_id,
                      slot_index=grant.slot_index, slot_offset=grant.slot_offset,
                      state_index=grant.state_index, generation=grant.generation,
                      flags=(abi.ReplyFlags.RESIDENT if grant.resident else 0)
                      | (abi.ReplyFlags.PIN_HELD if grant.pin_held else 0))

    def _refuse(self, channel: DeviceChannel, position: int, rid: int,
                status: abi.RequestStatus, message: str) -> None:
        self.refused += 1
        channel.reply(position, rid, status, message)


def unknown_model(index: int, loaded: int) -> AgentError:
    """The error for a request naming a model index nothing was loaded under."""
    return not_found(f"model index {index} is not loaded ({loaded} models are)")
