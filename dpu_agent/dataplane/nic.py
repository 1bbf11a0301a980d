"""The agent's side of the NIC stand-in (``python -m nic``, docs/ACTIVATIONS.md): it starts and
supervises the process, programs it (the steering snapshot, the workers' ports) and reads its
counters. No activation byte passes through the agent; on a BlueField this is the agent
programming DOCA Flow and the GPUNetIO queues, not forwarding packets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpu_agent.dataplane.child import ChildError, ChildProcess
from dpu_offload.steering_snapshot import Snapshot, SnapshotSegment

if TYPE_CHECKING:
    from dpu_agent.config import ActivationSettings

log = logging.getLogger("dpu_agent.nic")

SWEEP_SECONDS = 0.005
"""How often the supervisor looks for drained versions while retirements wait on them."""
LIVENESS_SECONDS = 0.5
"""How often it checks that the NIC process lives (a dead one is restarted)."""


@dataclass(frozen=True)
class NicCounters:
    """The NIC's counters as the agent reports them (zero without a NIC)."""

    lookups: int = 0
    misses: int = 0
    rules: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """rule id -> (packets, bytes, dropped) it matched."""
    messages: dict[str, int] = field(default_factory=dict)
    """Frames received, by kind."""
    bytes: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)
    """Frames answered with an error, by reason (NO_CREDIT counts credit stalls)."""
    forwarded: int = 0
    retransmits: int = 0
    outstanding: int = 0

    @classmethod
    def of(cls, stats: dict[str, Any]) -> NicCounters:
        if not stats:
            return cls()
        return cls(int(stats["lookups"]), int(stats["misses"]),
                   {int(r): (int(p), int(b), int(d)) for r, (p, b, d) in stats["rules"].items()},
                   dict(stats["messages"]), dict(stats["bytes"]), dict(stats["refused"]),
                   int(stats["forwarded"]), int(stats["retransmits"]), int(stats["outstanding"]))


class ActivationNic:
    """The NIC process, its steering snapshot and its ports.

    Args:
        settings: ``[activations]``.
        build: the snapshot of the agent's steering state, given the version to stamp.
    """

    def __init__(self, settings: ActivationSettings, build: Callable[[int], Snapshot]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self.segment = SnapshotSegment()
        self._version = 0
        self._ports: dict[int, tuple[str, str]] = {}
        """device id -> (rx, tx) ring names of every worker serving."""
        self._retiring: list[tuple[int, Callable[[], None]]] = []
        self.restarts = 0
        self.publish()
        self._settings = settings
        self.child = ChildProcess("the NIC stand-in", "nic", self._args(settings.listen_address))
        try:
            self.child.start()
            self.child.call("start")
        except ChildError as exc:
            self.segment.unlink()
            raise OSError(str(exc)) from exc
        self.port = int(self.child.ready["port"])
        """The port senders connect to (a restarted NIC binds it again)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="nic-supervisor",
                                        daemon=True)
        self._thread.start()

    def _args(self, listen: str) -> list[str]:
        s = self._settings
        return ["--listen", listen, "--snapshot", self.segment.name,
                "--credits", str(s.credits_per_sender),
                "--worker-timeout", str(s.worker_timeout_seconds),
                *(["--curve-server-cert", s.curve_server_cert,
                   "--curve-clients-dir", s.curve_clients_dir] if s.curve_server_cert else [])]

    def publish(self) -> int:
        """Publish the agent's steering state as a new version; returns it."""
        with self._lock:
            self._version += 1
            self.segment.publish(self._build(self._version))
            return self._version

    def when_drained(self, version: int, then: Callable[[], None]) -> None:
        """Run ``then`` once no message the NIC routed under a version before ``version`` is
        unanswered (at once if none is): an expert's old copy is released only after the
        messages steered to it are served."""
        with self._lock:
            if self.segment.drained < version:
                self._retiring.append((version, then))
                self._wake.set()
                return
        then()

    def serve(self, device_id: int, rx: str, tx: str) -> None:
        """Attach a worker's port: messages steered to ``device_id`` go into its rx ring."""
        try:
            self.child.call("attach", device=device_id, rx=rx, tx=tx)
        except ChildError as exc:
            raise ValueError(f"the NIC cannot attach device {device_id}'s rings: {exc}") from exc
        with self._lock:
            self._ports[device_id] = (rx, tx)

    def stop_serving(self, device_id: int) -> None:
        with self._lock:
            if self._ports.pop(device_id, None) is None:
                return
        try:
            self.child.call("detach", device=device_id)
        except ChildError as exc:
            log.warning("detaching device %d from the NIC: %s", device_id, exc)

    def counters(self) -> NicCounters:
        """The NIC's counters (zero while it restarts)."""
        try:
            return NicCounters.of(self.child.call("stats")["stats"])
        except ChildError as exc:
            log.warning("NIC stats: %s", exc)
            return NicCounters()

    def _supervise(self) -> None:
        checked = 0.0
        while not self._stop.is_set():
            self._wake.wait(SWEEP_SECONDS if self._retiring else LIVENESS_SECONDS)
            self._wake.clear()
            self._run_retirements()
            now = time.monotonic()
            if now - checked > LIVENESS_SECONDS:
                checked = now
                self._restart_if_dead()

    def _run_retirements(self) -> None:
        with self._lock:
            drained = self.segment.drained
            due = [then for v, then in self._retiring if v <= drained]
            self._retiring = [(v, t) for v, t in self._retiring if v > drained]
        for then in due:
            try:
                then()
            except Exception:
                log.exception("retiring an expert copy after the NIC drained")

    def _restart_if_dead(self) -> None:
        if not self.child.reap() and self.child.pid is not None:
            return
        self.restarts += 1
        # Messages in flight died with it; their senders time out. Bind the same port.
        self.child = ChildProcess("the NIC stand-in", "nic",
                                  self._args(f"{self._settings.listen_address.rpartition(':')[0]}"
                                             f":{self.port}"))
        try:
            self.child.start()
            for device_id, (rx, tx) in list(self._ports.items()):
                self.child.call("attach", device=device_id, rx=rx, tx=tx)
            self.child.call("start")
        except ChildError as exc:
            log.error("restarting the NIC stand-in: %s", exc)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(2)
        self.child.stop()
        self.segment.close()
        self.segment.unlink()
