"""systemd integration without a dependency: the sd_notify datagram protocol (READY, STATUS,
WATCHDOG, STOPPING, RELOADING) and a watchdog whose pings depend on real liveness."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """Sends sd_notify messages to ``$NOTIFY_SOCKET``; a no-op when the variable is unset.

    Attributes:
        watchdog_seconds: ping interval (half of ``$WATCHDOG_USEC``), or None when systemd
            set no watchdog for this process.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_seconds: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_seconds = int(usec) / 2e6

    def send(self, *lines: str) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto("\n".join(lines).encode(), self._address)
        except OSError:
            pass  # systemd gone; nothing to tell

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def reloading(self) -> None:
        self.send("RELOADING=1")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
