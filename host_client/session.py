"""A session with the DPU agent and its upkeep, apart from what the session is used for
(``AgentClient``): the gRPC connection, the session and its lease (renewed by a background
thread), the event stream (read by another), and recovery when the agent goes away: every
handle posted before fails with AgentUnavailable, the client looks for the agent with a
bounded back-off, opens a new session and restores what it had (``_restore``).
"""

from __future__ import annotations

import math
import threading
from collections import Counter

import grpc

from dpu_offload.bell import Bell
from dpu_offload.shm import may_share_with, share_with_group
from dpu_offload.v1 import agent_pb2 as pb
from host_client.connection import TlsFiles, open_channel, typed_stub
from host_client.errors import AgentUnavailable

RECOVER_FIRST_PAUSE, RECOVER_MAX_PAUSE = 0.2, 1.6
"""While the agent is away the client looks for it after 0.2 s, then twice as long each time
up to 1.6 s (seconds): a restart is found within ~2 s, and waiting costs next to no CPU."""


class AgentSession:
    """A session with one agent. Subclasses set up their own state before calling this
    constructor (the background threads may call their hooks from its end on): ``_on_event``
    (an event of the stream), ``_restore`` (after a new session was opened in a recovery) and
    ``_release`` (at close, before the session's channel goes). The arguments are
    :class:`~host_client.client.AgentClient`'s, documented there.
    """

    def __init__(self, address: str, *, client_name: str = "host-client",
                 lease_seconds: int = 0, connect_timeout: float = 5.0,
                 rpc_timeout: float = 60.0, tls: TlsFiles | None = None) -> None:
        for name, seconds in (("connect_timeout", connect_timeout),
                              ("rpc_timeout", rpc_timeout)):
            if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{name}: a number of seconds above 0, got {seconds!r}")
        if not (isinstance(lease_seconds, int) and lease_seconds >= 0):
            raise ValueError(f"lease_seconds: an int >= 0 (0: the agent's), got {lease_seconds!r}")
        self.address = address
        self.rpc_timeout = rpc_timeout
        self.channel = open_channel(address, tls)
        ready = grpc.channel_ready_future(self.channel)
        try:
            ready.result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()
            self.channel.close()
            raise AgentUnavailable(f"no agent answers at {address} "
                                   f"(waited {connect_timeout} s)") from None
        self.rpc_calls: Counter[str] = Counter()
        """gRPC calls this client made, by method (the data path makes none)."""
        self._token = ""
        self.stub = typed_stub(self.channel, self.rpc_calls, lambda: self._token)
        self.client_name = client_name
        self._lease_request = lease_seconds
        self._lock = threading.Lock()
        self._epoch = 0
        """Bumped when the agent goes away and when it is back; a handle of an older epoch
        fails."""
        self._down = False
        """Between the agent going away and the recovery: requests fail at once."""
        self._outage: BaseException = AgentUnavailable("the agent went away")
        self._closed = threading.Event()
        self._restoring = threading.RLock()
        """Held by a recovery while it opens a new session and restores, and by ``close``
        while it ends the session and releases: a close waits for a restore under way, and a
        recovery after a close restores nothing."""
        self.reconnected = threading.Event()
        """Set each time the client has re-created its session after the agent came back."""
        self.generation = 0
        """Sessions this client has had minus one (0 until the first reconnect)."""
        self._open_session()
        self._event_thread = threading.Thread(target=self._event_loop, name="agent-events",
                                              daemon=True)
        self._event_thread.start()
        self._keepalive = threading.Thread(target=self._keepalive_loop, name="agent-lease",
                                           daemon=True)
        self._keepalive.start()

    @property
    def session_token(self) -> str:
        """The session's secret (a tool acting on this session, such as ``expertctl flows``,
        needs it; the agent refuses calls naming the session without it)."""
        return self._token

    def _open_session(self) -> None:
        resp = self.stub.CreateSession(pb.CreateSessionRequest(
            client_name=self.client_name, lease_seconds=self._lease_request),
            timeout=self.rpc_timeout)
        self.session_id = resp.session_id
        self._token = resp.session_token
        self.lease_seconds = resp.lease_seconds
        self.arena = resp.arena
        self.activations_port = resp.activations_port
        # The segments this client makes are shared as the agent's are, where it may (else
        # they stay its own user's).
        if resp.HasField("shm_gid") and may_share_with(resp.shm_gid):
            share_with_group(resp.shm_gid)
        self._bell = Bell.open(resp.bell_shm_name) if resp.bell_shm_name else None
        self._ref = pb.SessionRef(session_id=self.session_id)
        self._events = self.stub.Events(self._ref)

    # -- hooks -----------------------------------------------------------------------------
    def _on_event(self, event: pb.Event) -> None:
        """An event of the session's stream (placement progress, errors)."""

    def _restore(self) -> None:
        """A new session is open after the agent came back: restore what the old one had."""

    def _release(self) -> None:
        """The client is closing: release what it holds (before the channel closes)."""

    # -- background ------------------------------------------------------------------------
    def _event_loop(self) -> None:
        while not self._closed.is_set():
            try:
                for event in self._events:
                    self._on_event(event)
                why = "closed by the agent"  # a graceful shutdown ends the stream with OK
            except grpc.RpcError as exc:
                why = exc.code().name
            if self._closed.is_set():
                return
            self._fail_all(AgentUnavailable(f"agent event stream ended: {why}"))
            self._recover()

    def _recover(self) -> None:
        """The agent went away: wait for it, open a new session and restore (``_restore``).
        Slots held before are gone (their acquires failed with AgentUnavailable)."""
        self.reconnected.clear()
        pause = RECOVER_FIRST_PAUSE
        while not self._closed.is_set():
            ready = grpc.channel_ready_future(self.channel)
            try:
                ready.result(timeout=pause)
                with self._restoring:
                    if self._closed.is_set():
                        return
                    self._open_session()
                    self._restore()
                    self.generation += 1
                    self._epoch += 1  # a handle posted on a dead channel before never resolves
                    self._down = False
                self.reconnected.set()
                return
            except (grpc.FutureTimeoutError, grpc.RpcError):
                ready.cancel()
                self._closed.wait(pause)
                pause = min(2 * pause, RECOVER_MAX_PAUSE)  # bounded back-off while it is down
            except ValueError:  # the channel was closed: the client is closing
                ready.cancel()
                return

    def _fail_all(self, exc: BaseException) -> None:
        """Every handle posted so far fails with ``exc`` (its wait raises it)."""
        self._outage = exc
        self._down = True
        self._epoch += 1

    def _keepalive_loop(self) -> None:
        interval = max(0.2, self.lease_seconds / 3)
        while not self._closed.wait(interval):
            try:
                self.stub.KeepAlive(self._ref, timeout=interval)
            except grpc.RpcError:
                pass  # the event stream reports the outage
            except ValueError:
                return  # the channel was closed under us: the client is closing

    def close(self) -> None:
        """End the session (after ``_release``) and close the connection."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._restoring:  # the session a recovery under way opens is the one ended here
            try:
                self.stub.CloseSession(self._ref, timeout=5)
            except grpc.RpcError:
                pass
            self._events.cancel()
            self._release()
        self._fail_all(AgentUnavailable("client closed"))
        # A recovery in progress polls the channel for up to a second; let it see the close
        # before the channel goes away under its polling thread.
        if self._event_thread is not threading.current_thread():
            self._event_thread.join(2.0)
        self.channel.close()

    def __enter__(self) -> AgentSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
