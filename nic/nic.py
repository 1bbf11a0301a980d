"""The NIC stand-in's data path: senders' frames in, steering, workers' rx rings out, and their
tx rings back to the senders (docs/ACTIVATIONS.md). One thread polls everything; the agent only
programs it (the steering snapshot, ports attached and detached) and reads its counters.

Per REQUEST: the frame is checked (magic, lengths; the model, layer and expert against the
snapshot's models; the row width against the model's hidden size), the sender's credits are
checked, the flow table decides (forward to a device, drop), and a forwarded message is
stamped with the expert's slot on that device and written into the device's rx ring, or sent
to the NIC of another agent that holds the expert (cluster mode). Every refusal is answered
with an ERROR frame naming what was wrong and counted by reason. A message its worker leaves
unanswered for ``worker_timeout`` seconds is answered WORKER_FAILED, and the port stops being
a route until the agent attaches it again.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import zmq

from dpu_offload import frames, futex, packets
from dpu_offload.flows import Action, FlowTable, TrafficClass
from dpu_offload.frames import FrameError, FrameStatus, Header, Kind
from dpu_offload.keys import ExpertKey
from dpu_offload.steering_snapshot import Snapshot, SnapshotSegment
from nic.admission import admit, no_route
from nic.ports import Answer, Outbound, Port, TxBells
from nic.remotes import Remotes

log = logging.getLogger("nic")
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
"""As ints: pyzmq's enums cost a Python call at each use."""

PACKET_RETRIES = 2
"""Times a message whose rx packets failed the worker's check is written again before it is
answered WORKER_FAILED."""
SWEEP_SECONDS = 0.05
SPIN_SECONDS = futex.SPARE_CORE_SPIN_SECONDS
"""The loop polls without pausing this long after work moved, on a machine with a core to
spare for it (as the hardware it stands for); on a small one spinning starves the worker."""
NAP_SECONDS = 50e-6
"""Otherwise, with messages in flight on a port whose worker does not ring its tx doorbell (a
resident GPU kernel answering) or waiting for rx room, it naps this long between passes."""
IDLE_POLL_MS = 10
"""Else it sleeps in poll(2) this long at most (milliseconds): a sender's frame or a worker's
tx doorbell wakes it. What comes unannounced waits at most this: a new steering snapshot is
acknowledged to the agent (which releases a migrated expert's old copy only after), a worker
that claims the doorbell and does not ring is looked at. Idle it costs ~8 ms of CPU a second
on the 2-core VM (1 ms: ~44)."""


@dataclass
class Pending:
    """A message routed and not yet answered."""

    sender: bytes
    message_id: int
    device: int | None
    """The port's device, or None: forwarded to another agent."""
    version: int
    """The snapshot version it was routed under."""
    started: float
    header: Header
    payload: np.ndarray
    tries: int = 0


class Nic:
    """The sockets, the ports and the loop.

    Args:
        sock: the bound ROUTER socket senders connect to.
        snapshot: the agent's steering snapshot segment.
        credits: requests a sender may have outstanding.
        worker_timeout: seconds a worker may take to answer, or a peer agent.
    """

    def __init__(self, sock: zmq.Socket, snapshot: SnapshotSegment, credits: int,
                 worker_timeout: float) -> None:
        self.sock = sock
        self.segment = snapshot
        self.credits = credits
        self.worker_timeout = worker_timeout
        self.flows = FlowTable()
        self.snapshot = Snapshot(0)
        self._acked = (-1, -1)
        self.ports: dict[int, Port] = {}
        self.lock = threading.Lock()
        """Held by the loop while it works and by the control thread to attach or detach."""
        self.pending: dict[int, Pending] = {}
        self.outstanding: Counter[bytes] = Counter()
        self.in_flight: Counter[int] = Counter()
        self.messages: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.forwarded = self.retransmits = 0
        self._ids = itertools.count(1)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._remotes = Remotes(self._poller, self.refused)
        self._bells = TxBells(self._poller)
        self._naps = False
        """Whether the loop awaits something no doorbell announces (``_wakes_on_bells``)."""
        self._last_work = self._last_sweep = 0.0
        """When a pass last moved something, and last swept for expired messages (monotonic
        seconds)."""
        self.stopping = False
        self.started = threading.Event()
        """Set by the agent's ``start`` once it attached the ports it has: until then frames
        wait in the socket's queue (a restarted NIC must not answer NO_ROUTE for a worker
        the agent is about to attach again)."""

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        """Poll until stopped: without a pause while work moved in the last ``SPIN_SECONDS``,
        napping between passes while it awaits what no doorbell announces, else sleeping up to
        ``IDLE_POLL_MS`` until a frame or a worker's tx doorbell comes."""
        futex.tight_timer_slack("nic")
        self.started.wait()
        while not self.stopping:
            self._one_pass()

    def _one_pass(self) -> None:
        """Wait for work as :meth:`run` says, then move what is there: doorbells drained, a
        new snapshot taken, senders' frames steered, rx rings filled, answers sent back."""
        busy = time.monotonic() - self._last_work < SPIN_SECONDS
        ready = dict(self._poller.poll(0 if busy or self._naps else IDLE_POLL_MS))
        if not ready and not busy and self._naps:
            time.sleep(NAP_SECONDS)
        with self.lock:
            self._bells.update(self.ports.values(), ready)
            self._take_snapshot()
            moved = len(ready)
            if self.sock in ready:
                self._receive()
            for h, payload in self._remotes.answers(ready):
                self._from_remote(h, payload)
            for port in list(self.ports.values()):
                moved += port.pump()
                for answer in port.answers(lambda nid, port=port: self._expected(port, nid)):
                    moved += 1
                    self._answered(port, answer)
            now = time.monotonic()
            if moved:
                self._last_work = now
            if now - self._last_sweep > SWEEP_SECONDS:
                self._last_sweep = now
                self._expire(now)
            self._acknowledge()
            self._naps = bool(self.pending) and not self._wakes_on_bells()

    def _wakes_on_bells(self) -> bool:
        """Whether all the loop awaits from the ports comes with a wake: no message waits for
        rx room, and each port with messages in flight has a worker that rings its tx
        doorbell."""
        for port in self.ports.values():
            if port.queue or (self.in_flight[port.device_id] and not port.tx_rings):
                return False
        return True

    def _take_snapshot(self) -> None:
        if self.segment.version == self.snapshot.version:
            return
        snap = self.segment.read()
        self.flows.install(snap.version, snap.rules)
        self.snapshot = snap

    def _acknowledge(self) -> None:
        """Tell the agent the version steered by and the oldest one still in flight (only on
        a change: this runs on every pass)."""
        oldest = min((p.version for p in self.pending.values()), default=self.snapshot.version)
        acked = (self.snapshot.version, oldest)
        if acked != self._acked:
            self._acked = acked
            self.segment.acknowledge(*acked)

    # -- senders ---------------------------------------------------------------------------
    def _send(self, identity: bytes, header: bytes, payload: object = b"") -> None:
        try:
            self.sock.send_multipart([identity, header, payload], copy=False)
        except zmq.ZMQError as exc:  # the sender went away
            log.warning("activation sender gone: %s", exc)

    def _refuse(self, identity: bytes, message_id: int, status: FrameStatus,
                reason: str) -> None:
        self.refused[status.name] += 1
        text = reason.encode()
        self._send(identity, frames.pack(Kind.ERROR, message_id, status=status,
                                         payload_bytes=len(text), credits=1), text)

    def _receive(self) -> None:
        for _ in range(64):  # a bounded batch, so the rings are pumped between batches
            if not self.sock.get(_EVENTS) & _POLLIN:  # cheaper than raising zmq.Again
                return
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            identity = parts[0].bytes
            if len(parts) != 3:
                self._refuse(identity, 0, FrameStatus.BAD_FRAME,
                             f"expected header and payload frames, got {len(parts) - 1}")
                continue
            try:
                h = frames.unpack(parts[1].bytes, len(parts[2].buffer))
            except FrameError as exc:
                self._refuse(identity, 0, exc.status, str(exc))
                continue
            kind = Kind(h.kind)
            self.messages[kind.name] += 1
            self.bytes[kind.name] += len(parts[2].buffer)
            if kind != Kind.REQUEST:
                self._refuse(identity, h.message_id, FrameStatus.BAD_FRAME,
                             f"{kind.name} is not for the NIC: send REQUEST frames")
                continue
            try:
                self._request(identity, h, np.frombuffer(parts[2].buffer, np.uint8))
            except Exception as exc:  # one frame must not stop the NIC
                log.exception("request %d failed in the NIC", h.message_id)
                self._refuse(identity, h.message_id, FrameStatus.WORKER_FAILED,
                             f"the NIC failed on this request: {type(exc).__name__}: {exc}")

    def _request(self, identity: bytes, h: Header, payload: np.ndarray) -> None:
        mid = h.message_id
        model = h.model_name
        key = ExpertKey(model, h.layer, h.expert)
        entry = admit(h, key, payload.size, self.snapshot, self.outstanding[identity],
                      self.credits)
        if isinstance(entry, tuple):
            self._refuse(identity, mid, *entry)
            return
        d = self.flows.lookup(TrafficClass.ACTIVATIONS, model, key.layer, key.expert,
                              identity.hex(), payload.size, self._load)
        if d.action == Action.DROP:
            self._refuse(identity, mid, FrameStatus.DROPPED, f"dropped by rule {d.rule.rule_id}"
                         if d.rule is not None else "dropped")
            return
        port = self.ports.get(d.queue) if d.action == Action.FORWARD else None
        slot = self.snapshot.slots.get((d.queue, key)) if port is not None else None
        if port is None or port.failed or slot is None:
            remote = self.snapshot.remotes.get(key)
            if remote is None:
                self._refuse(identity, mid, FrameStatus.NO_ROUTE,
                             no_route(key, d.queue, self.ports))
                return
            self._forward(identity, h, payload, remote)
            return
        nid = next(self._ids)
        self.pending[nid] = Pending(identity, mid, port.device_id, self.snapshot.version,
                                    time.monotonic(), h, payload)
        self.outstanding[identity] += 1
        self.in_flight[port.device_id] += 1
        port.queue.append(Outbound(nid, payload, entry.index, key, packets.pack_slot(*slot)))

    def _load(self, device: int) -> int:
        return self.in_flight[device]

    # -- answers ---------------------------------------------------------------------------
    def _expected(self, port: Port, nid: int) -> int | None:
        """The answer's size for a message in flight on ``port`` (None: no such message: a
        worker answers only what was steered to it)."""
        p = self.pending.get(nid)
        return p.payload.size if p is not None and p.device == port.device_id else None

    def _answered(self, port: Port, answer: Answer) -> None:
        p = self.pending.get(answer.nid)
        if p is None:
            return
        if answer.status == FrameStatus.BAD_CHECKSUM and p.tries < PACKET_RETRIES:
            p.tries += 1
            self.retransmits += 1
            key = ExpertKey(p.header.model_name, p.header.layer, p.header.expert)
            slot = self.snapshot.slots.get((port.device_id, key))
            entry = self.snapshot.models.get(key.model)
            if slot is not None and entry is not None:
                port.drop(answer.nid)  # its parts not yet sent go again from the start
                port.queue.append(Outbound(answer.nid, p.payload, entry.index, key,
                                           packets.pack_slot(*slot)))
                return
        del self.pending[answer.nid]
        self.outstanding[p.sender] -= 1
        self.in_flight[port.device_id] -= 1
        h = p.header
        if answer.status == FrameStatus.OK:
            assert answer.data is not None
            self._send(p.sender, frames.pack(Kind.RESPONSE, p.message_id, h.model_name,
                                             h.layer, h.expert, h.rows, h.row_bytes,
                                             answer.data.size, credits=1), answer.data)
            return
        status = (FrameStatus.WORKER_FAILED if answer.status == FrameStatus.BAD_CHECKSUM
                  else answer.status)
        reason = answer.reason
        if answer.status == FrameStatus.BAD_CHECKSUM:
            reason = f"{reason}, {p.tries + 1} times"
        self._refuse(p.sender, p.message_id, status, reason)

    def _expire(self, now: float) -> None:
        for nid, p in list(self.pending.items()):
            if now - p.started <= self.worker_timeout:
                continue
            del self.pending[nid]
            self.outstanding[p.sender] -= 1
            if p.device is None:
                text = f"no answer from the peer agent in {self.worker_timeout} s"
            else:
                self.in_flight[p.device] -= 1
                port = self.ports.get(p.device)
                if port is not None:
                    port.drop(nid)
                    port.failed = f"no answer in {self.worker_timeout} s"
                text = f"no answer from device {p.device}'s worker in {self.worker_timeout} s"
            self.refused["WORKER_FAILED"] += 1
            self._send(p.sender, frames.pack(Kind.ERROR, p.message_id,
                                             status=FrameStatus.WORKER_FAILED,
                                             payload_bytes=len(text), credits=1),
                       text.encode())

    # -- other agents (cluster mode) -------------------------------------------------------
    def _forward(self, identity: bytes, h: Header, payload: np.ndarray, address: str) -> None:
        nid = next(self._ids)
        self.pending[nid] = Pending(identity, h.message_id, None,
                                    self.snapshot.version, time.monotonic(), h, payload)
        self.outstanding[identity] += 1
        self.forwarded += 1
        self._remotes.send(address, nid, h, payload)

    def _from_remote(self, h: Header, payload: zmq.Frame) -> None:
        p = self.pending.pop(h.message_id, None)
        if p is None or p.device is not None:
            self.refused["UNKNOWN_RESULT"] += 1
            return
        self.outstanding[p.sender] -= 1
        kind = Kind.ERROR if h.kind == Kind.ERROR else Kind.RESPONSE
        self._send(p.sender, frames.pack(kind, p.message_id, h.model_name, h.layer, h.expert,
                                         h.rows, h.row_bytes, len(payload.buffer),
                                         FrameStatus(h.status), credits=1), payload)

    # -- control ---------------------------------------------------------------------------
    def attach(self, device_id: int, rx: str, tx: str) -> None:
        port = Port(device_id, rx, tx)
        with self.lock:
            old = self.ports.pop(device_id, None)
            self._fail_port(old, "its worker attached again")
            self.ports[device_id] = port
            self._bells.changed = True

    def detach(self, device_id: int) -> None:
        with self.lock:
            self._fail_port(self.ports.pop(device_id, None), "its worker detached")

    def _fail_port(self, port: Port | None, why: str) -> None:
        """Answer every message still on ``port`` WORKER_FAILED and close it."""
        if port is None:
            return
        for nid, p in list(self.pending.items()):
            if p.device == port.device_id:
                del self.pending[nid]
                self.outstanding[p.sender] -= 1
                self.in_flight[port.device_id] -= 1
                self._refuse(p.sender, p.message_id, FrameStatus.WORKER_FAILED,
                             f"device {port.device_id}: {why}")
        port.close()
        self._bells.detached(port)

    def stats(self) -> dict[str, object]:
        with self.lock:
            return {
                "messages": dict(self.messages), "bytes": dict(self.bytes),
                "refused": dict(self.refused), "forwarded": self.forwarded,
                "retransmits": self.retransmits, "outstanding": len(self.pending),
                "lookups": self.flows.lookups, "misses": self.flows.misses,
                "applied": self.snapshot.version,
                "rules": {str(rid): [c.packets, c.bytes, c.dropped]
                          for rid, c in self.flows.counters.items()},
                "ports": {str(d): {"failed": p.failed, "refused_packets": p.refused_packets,
                                   "in_flight": self.in_flight[d]}
                          for d, p in self.ports.items()},
            }

    def close(self) -> None:
        with self.lock:
            for port in self.ports.values():
                port.close()
                port.close_bells()
            self.ports.clear()
            self._bells.close()
            self._remotes.close()
            self.sock.close(0)
