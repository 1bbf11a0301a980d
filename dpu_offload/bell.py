"""The agent's doorbell (``abi.BELL_DTYPE``): how a client that posts a request wakes the
agent's data-plane loop when it sleeps for want of work, so an idle agent spends no CPU and
still answers the next request within a futex wake. Both sides' halves are here: a client's
:meth:`Bell.ring` after it published entries, the loop's :meth:`Bell.doze`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from dpu_offload import abi, futex
from dpu_offload.ring import store_fence
from dpu_offload.shm import SharedBuffer, unique_name

T = TypeVar("T")

BELL_BYTES = abi.BELL_DTYPE.itemsize


class Bell:
    """The doorbell laid out in ``segment`` (its first ``BELL_BYTES``), which it keeps mapped."""

    def __init__(self, segment: SharedBuffer) -> None:
        if segment.size < BELL_BYTES:
            raise ValueError(f"a doorbell needs {BELL_BYTES} bytes, got {segment.size}")
        self._segment = segment
        words = np.ndarray((2,), "<u4", buffer=segment.array)
        self._rings, self._sleeping = words[0:1], words[1:2]
        self._address = segment.address
        self.rung = False
        """Whether the last :meth:`doze` slept and was ended by a ring."""

    @classmethod
    def create(cls, prefix: str) -> Bell:
        """A new doorbell in a segment of this process's (``shm.unique_name(prefix)``)."""
        return cls(SharedBuffer(unique_name(prefix), BELL_BYTES, create=True))

    @classmethod
    def open(cls, name: str) -> Bell:
        """The doorbell another process created under ``name``."""
        return cls(SharedBuffer(name, BELL_BYTES))

    @property
    def name(self) -> str:
        """The segment's shared-memory name (what the other side opens)."""
        return self._segment.name

    def unlink(self) -> None:
        """Remove the name (the creator's duty); mappings stay valid."""
        self._segment.unlink()

    @property
    def asleep(self) -> bool:
        """Whether the loop said it is (about to be) asleep."""
        return bool(self._sleeping[0])

    def ring(self, yield_cpu: bool = True) -> None:
        """After publishing entries (or just before, ``yield_cpu`` False: the loop, woken to
        nothing, polls for a while as the caller goes on making its post): wake the loop if it
        sleeps. The fence orders the entries before the load of ``sleeping`` (the loop's
        mirror image: it stores ``sleeping``, fences, and looks for work once more), so no
        request is left until the timed wake. After a post the caller yields its CPU: the
        woken loop may have been placed on it."""
        store_fence()
        if self._sleeping[0]:
            self._rings[0] = (int(self._rings[0]) + 1) & 0xFFFFFFFF
            futex.wake(self._address)
            if yield_cpu:
                os.sched_yield()

    def doze(self, timeout: float, look: Callable[[], T], idle: Callable[[T], bool]) -> T:
        """Sleep until a client rings or ``timeout`` seconds pass, unless ``look()`` (one pass
        for work, after ``sleeping`` is published) finds some (``idle`` of its result False).
        Returns that last look's result."""
        seen = int(self._rings[0])
        self._sleeping[0] = 1
        store_fence()
        self.rung = False
        try:
            found = look()
            if idle(found):
                futex.wait(self._address, seen, timeout)
                self.rung = int(self._rings[0]) != seen
            return found
        finally:
            self._sleeping[0] = 0
