"""The engine's targets (one per attached device) and its polling loop."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dma_engine.backends import CpuBackend, CudaBackend
from dma_engine.plan import Planner
from dma_engine.signals import SignalWrite, SlotStates
from dpu_offload import abi, futex
from dpu_offload.bell import Bell
from dpu_offload.ring import Ring
from dpu_offload.shm import SharedBuffer
from gpu_kernels.copy_runs import completions

SPIN_SECONDS = 0.002
"""After work the loop only yields for this long."""
NAP_SECONDS = 20e-6
"""Nap between passes while runs are in flight (their events complete without a bell)."""
DOZE_SECONDS = 0.05
"""With nothing in flight the loop sleeps on the agent's bell for at most this long."""

log = logging.getLogger("dma_engine")

@dataclass
class _Batch:
    """A popped batch whose runs are in flight: completions are written per run as it lands."""

    entries: np.ndarray
    status: np.ndarray
    copy: np.ndarray
    runs_left: int
    exit: bool


@dataclass
class Target:
    """One device as the engine sees it.

    Attributes:
        work: the agent's work ring for this device (the engine consumes it).
        completions: the engine's completion ring to the agent (one entry per descriptor).
        regions: ``REGION_DTYPE[MAX_REGIONS]`` with this process's addresses.
    """

    device_id: int
    backend: Any
    work: Ring
    completions: Ring
    states: SlotStates
    """The device's slot-state table (its channel), which SIGNALs write."""
    buffers: list[SharedBuffer]
    regions: np.ndarray = field(
        default_factory=lambda: np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE))
    lane: Any = None
    """Where this target's runs are moved (``backend.lane()``)."""
    _in_flight: deque[_Batch] = field(default_factory=deque)
    """The batch of each run submitted and not landed, in submission order."""
    _owed: int = 0
    """Completions owed for runs in flight (room kept for them in the completion ring)."""

    planner: Planner = field(init=False)

    def __post_init__(self) -> None:
        self.lane = self.backend.lane(self.states)
        self.planner = Planner(self.regions)

    def busy(self) -> bool:
        """Whether runs are in flight (the loop keeps polling closely)."""
        return bool(self._in_flight)

    def serve(self) -> tuple[int, int]:
        """Complete the runs that landed, then take what the work ring holds (as far as the
        completion ring has room) and submit it without waiting for it to land; returns how
        many descriptors were (completed, taken). Each run is completed as soon as it landed,
        so copying never waits for the agent and new work never waits for old. VERIFY is not
        acted on: a DMA engine cannot check bytes (the slot's consumer checks the blob); a
        SIGNAL is written behind the copies before it and completed once written. The batch
        is planned by :class:`~dma_engine.plan.Planner`."""
        done = self._finish()
        if not self.work.has_entries():
            return done, 0
        room = self.completions.free_entries() - self._owed
        batch = self.work.pop_many(room) if room > 0 else self.work.entries[:0]
        if batch.size == 0:
            return done, 0
        plan = self.planner.plan(batch)
        job = _Batch(batch, plan.status, plan.copied, len(plan.ops), plan.exit)
        self._in_flight.extend(job for _ in plan.ops)
        self._owed += sum(op.count for op in plan.ops)
        self.lane.submit(plan.ops)
        if not plan.moved.all():  # refused, or nothing to move: completed at once
            now = np.flatnonzero(~plan.moved)
            self.completions.push_many(completions(batch, plan.status, plan.copied, now))
            done += int(now.size)
        if not plan.ops and job.exit:
            self.work.request_exit()
        return done, int(batch.size)

    def _finish(self) -> int:
        done = 0
        for op in self.lane.landed():
            job = self._in_flight.popleft()
            if isinstance(op, SignalWrite):
                self.states.wake(op)
            span = slice(op.first, op.first + op.count)
            self.completions.push_many(completions(job.entries, job.status, job.copy, span))
            self._owed -= op.count
            done += op.count
            job.runs_left -= 1
            if job.runs_left == 0 and job.exit:
                self.work.request_exit()
        return done

    def close(self) -> None:
        self.lane.close()
        self.states.close()
        for base in self.regions["base"][1:][self.regions["size"][1:] > 0].tolist():
            self.backend.close_pool(int(base))
        for buf in self.buffers:
            buf.close()


class Engine:
    """Every attached target, served by :meth:`run` on the calling thread; ``lock`` guards the
    target table against the control thread."""

    def __init__(self, bell: Bell | None = None, agent_bell: Bell | None = None,
                 polls: bool = False) -> None:
        self.targets: dict[int, Target] = {}
        self.lock = threading.Lock()
        self._backends: dict[tuple[str, int], Any] = {}
        self.stopping = False
        self._bell = bell
        """What :meth:`run` sleeps on with nothing in flight (None: it naps)."""
        self._agent_bell = agent_bell
        """Rung after completions are pushed (the agent's loop may sleep through copies)."""
        self._polls = polls
        """Poll without sleeping while any target is attached."""

    def backend(self, kind: str, ordinal: int) -> Any:
        key = (kind, ordinal)
        if key not in self._backends:
            self._backends[key] = CudaBackend(ordinal) if kind == "cuda" else CpuBackend()
        return self._backends[key]

    def _serve_all(self) -> tuple[int, bool]:
        """One pass over every target: (descriptors taken, whether runs are in flight)."""
        with self.lock:
            completed = taken = 0
            for t in self.targets.values():
                c, n = t.serve()
                completed += c
                taken += n
            busy = any(t.busy() for t in self.targets.values())
        if completed and self._agent_bell is not None:
            self._agent_bell.ring()
        return taken, busy

    def run(self) -> None:
        """Serve until ``stopping``: spin 2 ms after work (always, while a target is attached,
        when the engine polls), nap 20 us while runs are in flight or without a bell, else
        sleep on the bell (at most ``DOZE_SECONDS``)."""
        futex.tight_timer_slack("engine")
        last_work = time.monotonic()
        while not self.stopping:
            taken, busy = self._serve_all()
            now = time.monotonic()
            if taken or busy:
                last_work = now
                if taken:
                    continue
            if now - last_work < SPIN_SECONDS or (self._polls and self.targets):
                time.sleep(0)
            elif busy or self._bell is None:
                time.sleep(NAP_SECONDS)
            else:
                taken, busy = self._bell.doze(DOZE_SECONDS, self._serve_all,
                                              lambda found: not (found[0] or found[1]))
                if taken or busy:
                    last_work = time.monotonic()

    def close(self) -> None:
        with self.lock:
            for t in self.targets.values():
                t.close()
            self.targets.clear()
            for b in self._backends.values():
                b.close()
