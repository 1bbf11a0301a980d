"""The agent's sessions and their leases: a session is opened for the calling identity and
handed a token once; every later call naming it is checked against that identity; a lease
renewed by any call, expired ones closed; limits from ``[sessions]`` (live: a reload's new
limits apply to the next call).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

from dpu_agent.config import SessionSettings
from dpu_agent.errors import AgentError, ErrorKind, invalid, not_found, precondition
from dpu_agent.identity import Binding, current_caller
from dpu_agent.registry import Device, EventSink, Session, Tally

log = logging.getLogger("dpu_agent")

MAX_CLIENT_NAME = 64
"""Characters of a session's client name."""


class SessionTable:
    """Every open session of the agent.

    Args:
        settings: the ``[sessions]`` settings in force (called on each use: they reload live).
        on_close: releases what a closing session owned (its devices' queues, channels,
            deliveries, flows); called after the session left the table.
        lock: guards the table (shared with the core, whose device list follows it).

    Attributes:
        open: session id -> session (read by the core's other parts; changed only here).
    """

    def __init__(self, settings: Callable[[], SessionSettings],
                 on_close: Callable[[Session], None], lock: threading.RLock) -> None:
        self._settings = settings
        self._on_close = on_close
        self._lock = lock
        self.open: dict[str, Session] = {}
        self._events_dropped = Tally()
        """Events every session's sink dropped, open or closed (their clients did not read
        them)."""

    def create(self, client_name: str, lease_seconds: int) -> tuple[Session, str]:
        """A new session bound to the calling identity, and its token (handed out once: every
        later call naming the session must present it). ``lease_seconds`` 0: the default."""
        limits = self._settings()
        if len(client_name) > MAX_CLIENT_NAME:
            raise invalid(f"client_name is longer than {MAX_CLIENT_NAME} characters")
        lease = lease_seconds or limits.default_lease_seconds
        if lease > limits.max_lease_seconds:
            raise invalid(f"lease_seconds {lease} exceeds the maximum "
                          f"{limits.max_lease_seconds}")
        sid = secrets.token_hex(8)
        binding, token = Binding.issue(current_caller().identity)
        session = Session(sid, client_name, float(lease), time.monotonic() + lease,
                          events=EventSink(dropped=self._events_dropped), binding=binding)
        with self._lock:
            if len(self.open) >= limits.max_sessions:
                raise AgentError(ErrorKind.RESOURCE_EXHAUSTED,
                                 f"{len(self.open)} sessions are open, the most this agent "
                                 "takes (sessions.max_sessions); close one or wait for a lease "
                                 "to expire")
            self.open[sid] = session
        log.info("session %s opened by %r", sid, client_name,
                 extra={"session": sid, "client": client_name})
        return session, token

    def get(self, session_id: str) -> Session:
        """The session, if the caller owns it (its lease renewed); NOT_FOUND or
        PERMISSION_DENIED naming why not."""
        with self._lock:
            s = self.open.get(session_id)
        if s is None:
            raise not_found(f"session {session_id[:40]!r} does not exist (expired or closed)")
        if s.binding is not None and not s.binding.admits(current_caller()):
            raise AgentError(ErrorKind.PERMISSION_DENIED,
                             f"session {session_id!r} belongs to another caller (the call "
                             "lacks its token, or comes from another identity)")
        s.touch()
        return s

    def device(self, session: Session, device_id: int) -> Device:
        """The session's device ``device_id``; PERMISSION_DENIED if another session's."""
        dev = session.devices.get(device_id)
        if dev is None:
            with self._lock:
                owned = any(device_id in s.devices for s in self.open.values())
            if owned:
                raise AgentError(ErrorKind.PERMISSION_DENIED,
                                 f"device {device_id} belongs to another session")
            raise precondition(f"device {device_id} is not registered in session "
                               f"{session.session_id}")
        return dev

    def close(self, session_id: str, reason: str = "closed") -> None:
        """Close the session and release what it owned (``on_close``)."""
        with self._lock:
            session = self.open.pop(session_id, None)
        if session is None:
            raise not_found(f"session {session_id!r} does not exist")
        with session.lock:
            session.closed = True
        self._on_close(session)
        session.events.close()
        log.info("session %s", reason, extra={"session": session_id})

    def events_dropped(self) -> int:
        """Session events dropped so far, open and closed sessions together (a counter)."""
        return self._events_dropped.value

    def expire(self) -> list[str]:
        """Close every session whose lease ran out; returns their ids."""
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, s in self.open.items() if s.expires_at < now]
        for sid in expired:
            try:
                self.close(sid, reason="lease expired")
            except AgentError:
                pass
        return expired
