"""A process the agent starts and commands over its stdin and stdout, one JSON object a line:
the DMA engine (``python -m dma_engine``) and the NIC stand-in (``python -m nic``), the pieces
that stand for a BlueField's hardware. The first line the child writes says it is ready; every
later line answers one command, ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
from typing import Any

log = logging.getLogger("dpu_agent.child")

COMMAND_TIMEOUT_SECONDS = 30.0
"""A command answered later than this counts as the child hanging (CUDA IPC opens and the
arena's registration are the slow ones)."""


class ChildError(RuntimeError):
    """The child refused a command or is not running; the message says which and why."""


class ChildProcess:
    """One child process and its command channel.

    Args:
        title: what log lines and errors call it ("the DMA engine").
        module: run as ``python -m module``.
        args: its command line after the module.
    """

    def __init__(self, title: str, module: str, args: list[str]) -> None:
        self.title, self._module, self._args = title, module, args
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        """The child's first line (what it says once started)."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self._module, *self._args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.ready = self._read()
        log.info("%s started (pid %d)", self.title, self._proc.pid)

    def _read(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], COMMAND_TIMEOUT_SECONDS)
        if not ready:
            self._proc.kill()
            raise ChildError(f"{self.title} (pid {self._proc.pid}) did not answer within "
                             f"{COMMAND_TIMEOUT_SECONDS} s; killed (it is restarted)")
        line = self._proc.stdout.readline()
        if not line:
            raise ChildError(f"{self.title} (pid {self._proc.pid}) exited "
                             f"(status {self._proc.poll()})")
        return json.loads(line)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one command and return its answer; ChildError when refused or dead."""
        with self._lock:
            return self._call_locked({"op": op, **fields})

    def _call_locked(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if self._proc is None:
            self._start()
        elif self._proc.poll() is not None:
            # Restarting here would skip what the sweep does first: fail the dead child's
            # work and re-attach every device.
            raise ChildError(f"{self.title} exited (status {self._proc.returncode}); it is "
                             "restarted within a sweep (0.5 s)")
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(cmd) + "\n")
            self._proc.stdin.flush()
            answer = self._read()
        except (BrokenPipeError, OSError) as exc:
            raise ChildError(f"{self.title} is gone: {exc}") from exc
        if not answer.get("ok"):
            raise ChildError(answer.get("error", "refused"))
        return answer

    def start(self) -> None:
        """Start the child now, if it is not running."""
        with self._lock:
            if self._proc is None:
                self._start()

    def kill(self, why: str) -> None:
        """Kill a hung child (SIGKILL); the next sweep restarts it like any dead one. Skipped
        while a command holds the child (a hung child fails that command within
        ``COMMAND_TIMEOUT_SECONDS`` and is killed then): the sweep that asks must not wait."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._proc is not None and self._proc.poll() is None:
                log.error("killing %s (pid %d): %s", self.title, self._proc.pid, why)
                self._proc.kill()
                self._proc.wait(5)
        finally:
            self._lock.release()

    def _reap_locked(self) -> bool:
        """Whether the child died since it was started (it is then forgotten)."""
        if self._proc is None or self._proc.poll() is None:
            return False
        log.error("%s (pid %d) died with status %s; restarting it", self.title,
                  self._proc.pid, self._proc.returncode)
        self._proc = None
        return True

    def reap(self) -> bool:
        """Whether the child died since it was started (it is then forgotten)."""
        with self._lock:
            return self._reap_locked()

    def stop(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
