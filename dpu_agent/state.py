"""Persisted agent state: written atomically (temp file, fsync, rename, fsync of the
directory), so a crash at any point leaves the old state or the new one, never a torn one."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

STATE_VERSION = 1
STATE_FILE = "state.json"


class StateError(ValueError):
    """The state directory or file is unusable; the message names the path."""


class StateStore:
    """``state.json`` in a directory: ``{"version": 1, "models": [{"name", "path"}],
    "placements": {model: [[[device ids]]]}}``."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STATE_FILE
        self._lock = threading.Lock()
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.dir.stat().st_uid == os.geteuid():
                self.dir.chmod(0o700)  # what it holds names checkpoints and sessions' devices
            probe = self.dir / ".write-probe"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise StateError(f"state.dir {self.dir}: not writable ({exc.strerror})") from exc

    def load(self) -> dict[str, Any]:
        """The saved state, or an empty one when none was saved yet."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": STATE_VERSION, "models": [], "placements": {}}
        except (OSError, ValueError) as exc:
            raise StateError(f"{self.path}: unreadable state ({exc})") from exc
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
            raise StateError(f"{self.path}: not a version {STATE_VERSION} agent state")
        return data

    def save(self, state: dict[str, Any]) -> None:
        data = json.dumps({**state, "version": STATE_VERSION}, indent=1).encode()
        with self._lock:
            tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
