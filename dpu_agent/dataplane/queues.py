"""The agent's side of a device's rings: producer of the work ring, consumer of the completion
ring. This class is the DOCA swap point (docs/DOCA.md): on a BlueField the same two methods
post DOCA DMA / GPUNetIO work and read GPUNetIO semaphores instead of shared-memory rings.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from gpu_kernels import abi
from gpu_kernels.ring import Ring
from gpu_kernels.shm import SharedBuffer


def check_ring(shm_name: str, kind: abi.RingKind) -> None:
    """Open a ring by its export handle and validate its header (RingError or
    SharedBufferError naming what is wrong); nothing stays open."""
    with SharedBuffer(shm_name) as buf:
        Ring(buf.array, kind)


class DeviceQueue:
    """Work and completion rings of one registered device, opened from their export handles.

    Descriptors that do not fit wait in a backlog, in order, and are pushed as the consumer
    frees entries (:meth:`flush`): the producer is held back, nothing is dropped.
    """

    def __init__(self, work_shm: str, completion_shm: str) -> None:
        self._work_buf = SharedBuffer(work_shm)
        try:
            self._comp_buf = SharedBuffer(completion_shm)
        except BaseException:
            self._work_buf.close()
            raise
        try:
            self.work = Ring(self._work_buf.array, abi.RingKind.WORK)
            self.completion = Ring(self._comp_buf.array, abi.RingKind.COMPLETION)
        except BaseException:
            self.close()
            raise
        self._lock = threading.Lock()
        self._backlog: deque[np.ndarray] = deque()

    def submit(self, records: np.ndarray) -> None:
        """Queue ``DESCRIPTOR_DTYPE[n]`` for the device, in order."""
        with self._lock:
            self._backlog.append(records)
            self._flush_locked()

    def flush(self) -> int:
        """Push backlog into freed ring entries; returns descriptors still waiting."""
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> int:
        while self._backlog:
            head = self._backlog[0]
            n = self.work.push_many(head)
            if n < head.size:
                self._backlog[0] = head[n:]
                break
            self._backlog.popleft()
        return sum(int(b.size) for b in self._backlog)

    def poll_completions(self, limit: int = 4096) -> np.ndarray:
        """Completed entries (``COMPLETION_DTYPE[n]``), oldest first, at most ``limit``."""
        return self.completion.pop_many(limit)

    def close(self) -> None:
        self._backlog.clear()
        for buf in (getattr(self, "_work_buf", None), getattr(self, "_comp_buf", None)):
            if buf is not None:
                buf.close()
