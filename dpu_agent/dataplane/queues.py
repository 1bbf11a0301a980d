"""The agent's side of a device's rings: producer of the work ring, consumer of the completion
ring. This class is the DOCA swap point (docs/DOCA.md): on a BlueField the same two methods
post DOCA DMA / GPUNetIO work and read GPUNetIO semaphores instead of shared-memory rings.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from dpu_offload import abi
from dpu_offload.bell import Bell
from dpu_offload.ring import Ring
from dpu_offload.shm import SharedBuffer, unique_name


def check_ring(shm_name: str, kind: abi.RingKind) -> None:
    """Open a ring by its export handle and validate its header (RingError or
    SharedBufferError naming what is wrong); nothing stays open."""
    with SharedBuffer(shm_name) as buf:
        Ring(buf.array, kind)


class QueueClosed(ValueError):
    """A submission to the queue of a device that went away."""


class DeviceQueue:
    """The work and completion rings of one registered device, opened from their export
    handles: the device consumer's rings, or the agent's rings to and from the DMA engine.

    Descriptors that do not fit wait in a backlog, in order, and are pushed as the consumer
    frees entries (:meth:`flush`): the producer is held back, nothing is dropped.
    """

    def __init__(self, work_shm: str, completion_shm: str, bell: Bell | None = None) -> None:
        self._bell = bell
        """Rung after descriptors are pushed (the DMA engine's; a device's own consumer has
        none: the client keeps it awake while it expects work)."""
        self._buffers: list[SharedBuffer] = []
        try:
            self.work = self._open(work_shm, abi.RingKind.WORK)
            self.completion = self._open(completion_shm, abi.RingKind.COMPLETION)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._backlog: deque[np.ndarray] = deque()
        self._closed = False

    def _open(self, name: str, kind: abi.RingKind) -> Ring:
        buf = SharedBuffer(name)
        self._buffers.append(buf)
        return Ring(buf.array, kind)

    def submit(self, records: np.ndarray) -> None:
        """Queue ``DESCRIPTOR_DTYPE[n]`` for the device, in order; QueueClosed once the
        device went away (its rings are unmapped)."""
        with self._lock:
            if self._closed:
                raise QueueClosed("the device's queue is closed (the device went away)")
            self._backlog.append(records)
            pushed, _ = self._flush_locked()
        if pushed and self._bell is not None:
            self._bell.ring()

    def flush(self) -> int:
        """Push backlog into freed ring entries; returns descriptors still waiting."""
        if not self._backlog:
            return 0
        with self._lock:
            if self._closed:
                return 0
            pushed, waiting = self._flush_locked()
        if pushed and self._bell is not None:
            self._bell.ring()
        return waiting

    def _flush_locked(self) -> tuple[int, int]:
        """(descriptors pushed, descriptors still waiting)."""
        pushed = 0
        while self._backlog:
            head = self._backlog[0]
            n = self.work.push_many(head)
            pushed += n
            if n < head.size:
                self._backlog[0] = head[n:]
                break
            self._backlog.popleft()
        return pushed, sum(int(b.size) for b in self._backlog)

    def poll_completions(self, limit: int = 4096) -> np.ndarray:
        """Completed entries (``COMPLETION_DTYPE[n]``), oldest first, at most ``limit``."""
        return self.completion.pop_many(limit)

    def close(self) -> None:
        if hasattr(self, "_lock"):
            with self._lock:
                self._closed = True
                self._backlog.clear()
        for buf in self._buffers:
            buf.close()


ENGINE_RING_CAPACITY = 4096
"""Entries of the work and completion rings between the agent and the DMA engine (a batch of
8 DeepSeek-V3 experts at 1 MiB chunks is 352 descriptors)."""


class EngineRings:
    """The agent-owned rings between the agent and the engine for one device: the work ring
    (agent -> engine) and the engine's completion ring (engine -> agent)."""

    def __init__(self, capacity: int = ENGINE_RING_CAPACITY) -> None:
        self.buffers = []
        for kind in (abi.RingKind.WORK, abi.RingKind.COMPLETION):
            size = abi.ring_bytes(capacity, abi.entry_dtype_for(kind).itemsize)
            buf = SharedBuffer(unique_name(f"dpu-engine-{kind.name.lower()}"), size, create=True)
            Ring.format(buf.array, kind, capacity)
            self.buffers.append(buf)
        self.work, self.completions = (b.name for b in self.buffers)

    def close(self) -> None:
        for buf in self.buffers:
            buf.unlink()
            buf.close()
