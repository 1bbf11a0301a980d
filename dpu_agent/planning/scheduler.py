"""The distribution scheduler: which delivery starts next on each device link.

Deliveries come in three classes, served in this order: an ``ACQUIRE`` a GPU waits on (never
held back), ``PREFETCH`` ahead of use (lower layers first), ``REBALANCE`` moves of a placement.
Background classes are bounded per link (``link_concurrency`` transfers in flight on a device);
when one finishes the next waiting job of that link starts. Links are served independently, so
bandwidth is shared fairly across GPUs. Jobs can be cancelled while they wait.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from enum import IntEnum


class Priority(IntEnum):
    ACQUIRE = 0
    PREFETCH = 1
    REBALANCE = 2


@dataclass(order=True)
class Job:
    """A delivery waiting for its link. ``start`` returns True when a transfer was started
    (the scheduler then counts it in flight until :meth:`Scheduler.finished`), False when
    there was nothing to move (e.g. the expert is already resident)."""

    priority: int
    order: int
    """Tie-break within a class (layer-major for prefetch), then submission order."""
    seq: int
    link: Hashable = field(compare=False)
    start: Callable[[], bool] = field(compare=False, repr=False)
    tag: object = field(compare=False, default=None)
    cancelled: bool = field(compare=False, default=False)


class Scheduler:
    """Per-link priority queues with a bound on background transfers in flight."""

    def __init__(self, link_concurrency: int = 4) -> None:
        if link_concurrency <= 0:
            raise ValueError("link_concurrency must be positive")
        self.link_concurrency = link_concurrency
        self._lock = threading.Lock()
        self._queues: dict[Hashable, list[Job]] = {}
        self._in_flight: dict[Hashable, int] = {}
        self._seq = itertools.count()

    def submit(self, link: Hashable, priority: Priority, start: Callable[[], bool], *,
               order: int = 0, tag: object = None) -> Job:
        job = Job(int(priority), order, next(self._seq), link, start, tag)
        with self._lock:
            heapq.heappush(self._queues.setdefault(link, []), job)
        self._pump(link)
        return job

    def finished(self, link: Hashable) -> None:
        """A background transfer on ``link`` completed (in any state)."""
        with self._lock:
            self._in_flight[link] = max(0, self._in_flight.get(link, 0) - 1)
        self._pump(link)

    def cancel(self, predicate: Callable[[Job], bool]) -> int:
        """Cancel every waiting job matching ``predicate``; returns how many."""
        n = 0
        with self._lock:
            for queue in self._queues.values():
                for job in queue:
                    if not job.cancelled and predicate(job):
                        job.cancelled = True
                        n += 1
        return n

    def waiting(self, link: Hashable | None = None) -> int:
        with self._lock:
            queues = [self._queues.get(link, [])] if link is not None else \
                list(self._queues.values())
            return sum(1 for q in queues for j in q if not j.cancelled)

    def _pump(self, link: Hashable) -> None:
        while True:
            with self._lock:
                queue = self._queues.get(link)
                while queue and queue[0].cancelled:
                    heapq.heappop(queue)
                if not queue:
                    return
                head = queue[0]
                if head.priority != Priority.ACQUIRE and \
                        self._in_flight.get(link, 0) >= self.link_concurrency:
                    return
                heapq.heappop(queue)
                if head.priority != Priority.ACQUIRE:
                    self._in_flight[link] = self._in_flight.get(link, 0) + 1
            started = False
            try:
                started = head.start()
            finally:
                if not started and head.priority != Priority.ACQUIRE:
                    with self._lock:
                        self._in_flight[link] = max(0, self._in_flight.get(link, 0) - 1)
