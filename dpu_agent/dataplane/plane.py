"""The agent's data plane as one object: the deliveries in flight, the server of the devices'
request rings, the DMA-engine process, and the loop thread that polls them (one pass: every
channel's requests, every queue's completions, the consumers' verdicts on LANDED slots; every
sweep: stuck transfers and a dead engine). The core (the Orchestrator) owns sessions and slots
and is called back through the :class:`RequestCore` protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from dpu_agent.dataplane.delivery import Deliveries
from dpu_agent.dataplane.engine import EngineDevices
from dpu_agent.dataplane.loop import DOZE_SECONDS, SPIN_SECONDS, DataPlaneLoop
from dpu_agent.dataplane.requests import RequestCore, RequestServer
from dpu_agent.dataplane.transfers import Transfer
from dpu_agent.registry import Delivery
from dpu_offload.bell import Bell

if TYPE_CHECKING:
    from dpu_agent.registry import Device
    from dpu_agent.weights.cache import WeightCache

log = logging.getLogger("dpu_agent.dataplane")

LANDED_CHECK_SECONDS = 0.001
"""How often the loop takes up consumers' verdicts on LANDED slots, while any is awaited: it
sleeps on the doorbell for at most this long, not polling between (an acquire of a LANDED
slot takes its verdict up at once; an eviction reads it from the slot's word)."""


class DataPlane:
    """Deliveries, request serving and the DMA engine, polled by one loop thread.

    Args:
        core: what serving requests calls (acquire, release, prefetch by owner).
        cache: the arena's weight cache; ``chunk_bytes``: descriptor size, bytes.
        fills: where arena fills and refetches run (they read checkpoint files).
        alive: whether a session id is still open.
        devices: every registered device, as the loop should poll them now.
        arena: (shared-memory name, bytes, region id) of the arena the DMA engine maps.
        transfer_timeout: seconds a transfer may go without completing, and a parked ACQUIRE
            may wait for a slot to land (read at each use: ``transfer.timeout_seconds`` is live).
        spin: seconds the loop polls after work before it sleeps (``transfer.poll_spin_us``).
        engine_polls: whether the DMA-engine process polls without sleeping while it serves a
            device (``transfer.engine_poll``).
    """

    def __init__(self, core: RequestCore, cache: WeightCache, chunk_bytes: int, fills: Executor,
                 alive: Callable[[str], bool], devices: Callable[[], tuple[Device, ...]],
                 arena: tuple[str, int, int], transfer_timeout: Callable[[], float],
                 spin: float = SPIN_SECONDS, engine_polls: bool = False) -> None:
        self.bell = Bell.create("dpu-bell")
        """The doorbell clients ring after posting (its name goes to every session)."""
        self.deliveries = Deliveries(cache, chunk_bytes, fills, alive, self.bell.ring)
        self.requests = RequestServer(core, fills, transfer_timeout)
        self.engine = EngineDevices(*arena, devices, self._engine_died, self.bell.name,
                                    engine_polls)
        """Devices the DMA-engine process serves (it starts when the first registers; it rings
        ``bell`` when it completes work)."""
        self.loop = DataPlaneLoop(self._poll_once, self._doze_limit,
                                  [self._cancel_stuck, self.engine.supervisor.check], self.bell,
                                  spin)
        self._devices = devices
        self._transfer_timeout = transfer_timeout
        self._landed_checked = 0.0

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self.engine.stop()
        self.bell.unlink()

    def _doze_limit(self) -> float:
        """How long the loop may sleep on the doorbell: not at all while a device consumer's
        completions are awaited (they come without a ring), ``LANDED_CHECK_SECONDS`` while only
        consumers' verdicts are, or an ACQUIRE is parked."""
        if self.deliveries.tracker.unrung:
            return 0.0
        if self.deliveries.awaiting_verdicts or self.requests.parked:
            return LANDED_CHECK_SECONDS
        return DOZE_SECONDS

    def _engine_died(self, devices: set[Device]) -> None:
        """The DMA engine died: its devices' transfers in flight end CANCELLED (their slots go
        FAILED, their waiters get an error); their queues were replaced."""
        gone = self.deliveries.tracker.cancel(lambda t: t.owner in devices)
        log.error("DMA engine died: %d transfers cancelled on devices %s", len(gone),
                  sorted(d.device_id for d in devices))

    def _cancel_stuck(self) -> None:
        """Transfers without a completion for the transfer timeout: a device consumer's are
        cancelled; a DMA engine that holds one is killed instead (its transfers are cancelled
        as it is restarted, in the same sweep), so that no copy or SIGNAL of a cancelled
        delivery can land after its slot was given to another."""
        limit = self._transfer_timeout()
        now = time.monotonic()

        def stuck(t: Transfer) -> bool:
            return now - t.started > limit

        def engine_held(t: Transfer) -> bool:
            return getattr(t.owner, "delivery", None) == Delivery.DMA_ENGINE

        held = [t for t in self.deliveries.tracker.live() if stuck(t) and engine_held(t)]
        if held:
            self.engine.supervisor.kill(f"transfer {held[0].transfer_id} had no completion "
                                        f"within {limit} s")
        for t in self.deliveries.tracker.cancel(lambda t: stuck(t) and not engine_held(t)):
            log.error("transfer %d cancelled: no completion within %s s (device consumer "
                      "stuck or gone)", t.transfer_id, limit)

    def _poll_once(self) -> tuple[int, int]:
        """One pass of the loop: every queue's backlog and completions, the consumers'
        verdicts when due, the parked ACQUIREs, then every channel's requests (completions
        first: a slot whose copy completed is evictable for the requests that follow).
        Returns (requests answered, completions handled)."""
        requests = completions = 0
        devices = self._devices()
        for q in (dev.queue for dev in devices if dev.queue is not None):
            try:
                q.flush()
                recs = q.poll_completions()
            except (ValueError, OSError) as exc:  # a queue closed under us
                log.debug("data plane: %s", exc)
                continue
            if recs.size:
                completions += int(recs.size)
                self.deliveries.tracker.complete_many(recs)
        now = time.monotonic()
        verdicts = now - self._landed_checked > LANDED_CHECK_SECONDS
        if verdicts:
            self._landed_checked = now
            self.deliveries.check_landed()
        requests += self.requests.retry_parked(bool(completions) or verdicts)
        for dev in devices:
            if dev.channel is not None and not dev.channel.closed:
                requests += self.requests.serve(dev.channel)
        return requests, completions
