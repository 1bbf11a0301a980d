"""The activation router: ZeroMQ in, steering, ZeroMQ out (docs/ACTIVATIONS.md).

Senders send REQUEST frames (rows for one expert) to the agent's ROUTER socket; the flow table
picks the device holding the expert; the frame goes as DELIVER to the host worker that
registered that device's session (HELLO); its RESULT goes back to the sender as RESPONSE.
Senders never need the placement: in cluster mode, an expert no local device serves is
forwarded to the router of an agent that holds it (cluster placement) and its answer relayed
back. Each sender may have ``credits`` requests outstanding;
beyond that it gets NO_CREDIT, so no queue grows without bound and a slow worker slows its
senders instead of losing messages. Every refusal is counted by reason and answered.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dpu_agent.dataplane.steering import Action, TrafficClass
from dpu_agent.errors import AgentError
from dpu_offload import frames
from dpu_offload.frames import FrameError, FrameStatus, Kind
from dpu_offload.keys import ExpertKey

if TYPE_CHECKING:
    from dpu_agent.orchestrator import Orchestrator

log = logging.getLogger("dpu_agent")

REMOTE = -1
"""The device of a pending request forwarded to another agent (cluster mode)."""


class ActivationRouter:
    """One ROUTER socket and the thread that serves it."""

    def __init__(self, core: Orchestrator, address: str, credits: int,
                 worker_timeout: float = 5.0, curve_server_cert: str = "",
                 curve_clients_dir: str = "") -> None:
        self.core = core
        self.credits = credits
        self.worker_timeout = worker_timeout
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._auth = None
        if curve_server_cert:
            # Only peers whose public certificate is in curve_clients_dir get through.
            self._auth = ThreadAuthenticator(ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve_clients_dir)
            public, secret = zmq.auth.load_certificate(curve_server_cert)
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
            self.sock.curve_server = True
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host, port = address.rsplit(":", 1)
        if port == "0":
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        else:
            self.sock.bind(f"tcp://{address}")
            self.port = int(port)
        self.workers: dict[int, bytes] = {}
        """device id -> the worker socket identity serving it."""
        self._pending: dict[int, tuple[bytes, int, int, float]] = {}
        self._outstanding: Counter[bytes] = Counter()
        self.in_flight: Counter[int] = Counter()
        self.messages: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._ids = itertools.count(1)
        self._remotes: dict[str, zmq.Socket] = {}
        """Peer agents' activation routers by address (cluster mode)."""
        self.forwarded = 0
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="activations", daemon=True)
        self._thread.start()

    def _send(self, identity: bytes, header: bytes, payload: object = b"") -> None:
        try:
            self.sock.send_multipart([identity, header, payload], copy=False)
        except zmq.ZMQError as exc:  # the peer went away
            log.warning("activation peer gone: %s", exc)

    def _refuse(self, identity: bytes, h: object, status: FrameStatus, reason: str) -> None:
        self.refused[status.name] += 1
        message_id = int(h["message_id"]) if h is not None else 0
        text = reason.encode()
        self._send(identity, frames.pack(Kind.ERROR, message_id, status=status,
                                         payload_bytes=len(text), credits=1), text)

    def _loop(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() - last_sweep > 0.1:
                last_sweep = time.monotonic()
                self._expire()
            ready = dict(self._poller.poll(100))
            for sock in self._remotes.values():
                if sock in ready:
                    self._from_remote(sock)
            if self.sock not in ready:
                continue
            parts = self.sock.recv_multipart(copy=False)
            identity = parts[0].bytes
            if len(parts) != 3:
                self._refuse(identity, None, FrameStatus.BAD_FRAME,
                             f"expected header and payload frames, got {len(parts) - 1}")
                continue
            header, payload = parts[1], parts[2]
            try:
                h = frames.unpack(header.bytes, len(payload.buffer))
            except FrameError as exc:
                self._refuse(identity, None, exc.status, str(exc))
                continue
            kind = Kind(int(h["kind"]))
            self.messages[kind.name] += 1
            self.bytes[kind.name] += len(payload.buffer)
            if kind == Kind.HELLO:
                self._hello(identity, h, payload.bytes)
            elif kind == Kind.REQUEST:
                self._request(identity, h, payload)
            elif kind in (Kind.RESULT, Kind.ERROR):
                self._result(h, payload, kind)
            else:
                self._refuse(identity, h, FrameStatus.BAD_FRAME, f"{kind.name} is not for the "
                             "agent")

    def _hello(self, identity: bytes, h: object, payload: bytes) -> None:
        """A worker announces itself: payload ``SESSION_ID:DEVICE_ID``."""
        sid, _, dev = payload.decode(errors="replace").partition(":")
        session = self.core.sessions.get(sid)
        if session is None or not dev.isdigit() or int(dev) not in session.devices:
            self._refuse(identity, h, FrameStatus.NO_ROUTE,
                         f"no device {dev!r} in session {sid!r}")
            return
        self.workers[int(dev)] = identity
        self._send(identity, frames.pack(Kind.RESPONSE, int(h["message_id"])))

    def _request(self, identity: bytes, h: object, payload: zmq.Frame) -> None:
        if self._outstanding[identity] >= self.credits:
            self._refuse(identity, h, FrameStatus.NO_CREDIT,
                         f"{self.credits} requests already outstanding")
            return
        model = frames.model_of(h)
        key = ExpertKey(model, int(h["layer"]), int(h["expert"]))
        try:
            self.core.expert(key)
        except AgentError as exc:
            self._refuse(identity, h, FrameStatus.UNKNOWN_EXPERT, exc.message)
            return
        hidden = self.core.models[model].layout.hidden_size
        if int(h["row_bytes"]) != hidden * 2:
            self._refuse(identity, h, FrameStatus.BAD_WIDTH, f"rows of {int(h['row_bytes'])} "
                         f"bytes; {model} takes {hidden} bf16 values ({hidden * 2} bytes)")
            return
        d = self.core.flows.lookup(TrafficClass.ACTIVATIONS, model, key.layer, key.expert,
                                   identity.hex(), len(payload.buffer), self.in_flight.get)
        if d.action == Action.DROP:
            self._refuse(identity, h, FrameStatus.DROPPED, f"dropped by rule {d.rule.rule_id}")
            return
        worker = self._worker_of(d.queue) if d.action == Action.FORWARD else None
        if worker is None:
            remote = self._remote_for(key)
            if remote is None:
                self._refuse(identity, h, FrameStatus.NO_ROUTE,
                             f"no flow rule forwards {key} to a device with a worker, and no "
                             "other agent of the cluster holds it")
                return
            aid = next(self._ids)
            self._pending[aid] = (identity, int(h["message_id"]), REMOTE, time.monotonic())
            self._outstanding[identity] += 1
            self.forwarded += 1
            remote.send_multipart([frames.pack(Kind.REQUEST, aid, model, key.layer, key.expert,
                                               int(h["rows"]), int(h["row_bytes"]),
                                               len(payload.buffer)), payload], copy=False)
            return
        aid = next(self._ids)
        self._pending[aid] = (identity, int(h["message_id"]), d.queue, time.monotonic())
        self._outstanding[identity] += 1
        self.in_flight[d.queue] += 1
        self._send(worker, frames.pack(Kind.DELIVER, aid, model, key.layer, key.expert,
                                       int(h["rows"]), int(h["row_bytes"]),
                                       len(payload.buffer), credits=d.queue), payload)

    def _remote_for(self, key: ExpertKey) -> zmq.Socket | None:
        """A DEALER socket to the activation router of another agent holding ``key`` (cluster
        mode), created on first use and served by the loop's poller."""
        cluster = self.core.cluster
        member = cluster.holder_of(key) if cluster is not None else None
        if member is None:
            return None
        sock = self._remotes.get(member.activations)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{member.activations}")
            self._remotes[member.activations] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _from_remote(self, sock: zmq.Socket) -> None:
        parts = sock.recv_multipart(copy=False)
        try:
            if len(parts) != 2:
                raise FrameError(FrameStatus.BAD_FRAME, f"{len(parts)} frames from a peer agent")
            h = frames.unpack(parts[0].bytes, len(parts[1].buffer))
        except FrameError as exc:
            self.refused["BAD_PEER_FRAME"] += 1
            log.warning("activation frame from a peer agent refused: %s", exc)
            return
        self._result(h, parts[1], Kind(int(h["kind"])))

    def _worker_of(self, device_id: int | None) -> bytes | None:
        if device_id is None:
            return None
        if not any(device_id in s.devices for s in list(self.core.sessions.values())):
            self.workers.pop(device_id, None)  # its session is gone
            return None
        return self.workers.get(device_id)

    def _result(self, h: object, payload: zmq.Frame, kind: Kind) -> None:
        entry = self._pending.pop(int(h["message_id"]), None)
        if entry is None:
            self.refused["UNKNOWN_RESULT"] += 1
            return
        sender, message_id, device, _ = entry
        self._outstanding[sender] -= 1
        if device != REMOTE:
            self.in_flight[device] -= 1
        out = Kind.ERROR if kind == Kind.ERROR else Kind.RESPONSE
        self._send(sender, frames.pack(out, message_id, frames.model_of(h), int(h["layer"]),
                                       int(h["expert"]), int(h["rows"]), int(h["row_bytes"]),
                                       len(payload.buffer), FrameStatus(int(h["status"])),
                                       credits=1), payload)

    def _expire(self) -> None:
        """A worker that vanished mid-request (or stalls past ``worker_timeout``): answer its
        senders with WORKER_FAILED and free their credits, within a bounded time."""
        now = time.monotonic()
        for aid, (sender, message_id, device, started) in list(self._pending.items()):
            if now - started > self.worker_timeout:
                del self._pending[aid]
                self._outstanding[sender] -= 1
                self.refused["WORKER_FAILED"] += 1
                if device == REMOTE:
                    text = f"no answer from the peer agent in {self.worker_timeout} s"
                else:
                    self.in_flight[device] -= 1
                    self.workers.pop(device, None)  # none there until it says HELLO again
                    text = f"no answer from device {device}'s worker in {self.worker_timeout} s"
                self._send(sender, frames.pack(Kind.ERROR, message_id,
                                               status=FrameStatus.WORKER_FAILED,
                                               payload_bytes=len(text), credits=1),
                           text.encode())

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)
        for sock in self._remotes.values():
            sock.close(0)
        if self._auth is not None:
            self._auth.stop()
