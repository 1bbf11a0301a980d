"""Granting slots: the slot that holds an expert on a session's device, or one allocated for it
and its delivery started; deliveries queued in the background (prefetch, placement). The
reference-count and landing rules of a slot are the pool's (``SlotPool``); which slot an
expert gets and when a delivery starts are decided here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from dpu_agent.dataplane.delivery import Deliveries
from dpu_agent.dataplane.transfers import Transfer
from dpu_agent.errors import AgentError, ErrorKind, SlotsLanding, precondition
from dpu_agent.registry import Delivery, Device, ErrorEvent, Session
from dpu_agent.slots import SlotPool, SlotState
from dpu_agent.weights.cache import WouldBlock
from dpu_agent.weights.catalog import ExpertEntry
from dpu_offload import abi
from dpu_offload.keys import ExpertKey

LANDING_POLL_SECONDS = 0.001
"""An acquire that waits for an unheld slot to land looks again this often (a fill thread's;
the data-plane loop parks such a request instead and retries it as deliveries complete)."""


class WaitForLanding(WouldBlock):
    """``acquire(..., wait=False)`` found every slot that fits held or still landing: a slot
    will be free once a delivery in flight lands (or its check ends). Raised before anything
    changed; retrying once a completion or a verdict was taken up may succeed."""


@dataclass(frozen=True)
class SlotGrant:
    """Where an acquired expert lives (or will) on the device."""

    transfer_id: int
    region_id: int
    slot_index: int
    slot_offset: int
    ready: bool
    entry: ExpertEntry
    checksums: tuple[int, ...]
    state_index: int
    """The slot's entry in the device channel's slot-state table."""
    generation: int
    """The slot's generation when granted: READY / FAILED of this generation ends the wait."""
    resident: bool
    """The slot already held the expert or was receiving it: no delivery was started."""
    pin_held: bool = False
    """The client holds the grant by a pin (``abi.ReplyFlags.PIN_HELD``); the agent drops the
    grant's reference once the pin is in place."""


class GrantCore(Protocol):
    """What granting needs of the agent's core (the Orchestrator)."""

    def device(self, session: Session, device_id: int) -> Device: ...
    def expert(self, key: ExpertKey) -> ExpertEntry: ...


class BackgroundQueue(Protocol):
    """Where background deliveries wait their turn (``planning.scheduler.Scheduler``)."""

    def submit(self, link: tuple[str, int], priority: Any, start: Callable[[], bool], *,
               order: int = 0, tag: object = None) -> object: ...
    def finished(self, link: tuple[str, int]) -> None: ...


class SlotGrants:
    """Slots for experts on sessions' devices.

    Args:
        core: the devices and experts.
        deliveries: where a fresh slot's delivery is posted.
        queue: background deliveries' scheduler.
        fills: where a background delivery's end is reported to ``queue``.
        transfer_timeout: seconds an acquire waits for an unheld slot to land (read at each
            acquire: ``transfer.timeout_seconds`` is live).
    """

    def __init__(self, core: GrantCore, deliveries: Deliveries, queue: BackgroundQueue,
                 fills: Executor, transfer_timeout: Callable[[], float]) -> None:
        self.core = core
        self.deliveries = deliveries
        self.queue = queue
        self._fills = fills
        self._transfer_timeout = transfer_timeout

    def acquire(self, session: Session, device_id: int, key: ExpertKey, wait: bool = True,
                pin_held: bool = False) -> SlotGrant:
        """Grant a slot holding ``key`` on the device (one reference), starting its delivery
        if needed. With ``wait=False`` the call never blocks: where the delivery would need
        an arena fill it raises WouldBlock, its reservation undone (an idle slot it evicted
        for ``key`` stays free: the retry on a worker thread would evict it too); where it
        would need a slot another delivery is still landing in, WaitForLanding. With
        ``wait=True``, where every fitting slot is held or still landing, it waits (up to the
        transfer timeout) for an unheld one to land. ``pin_held``: the grant is answered
        through the device's channel, whose client will hold it by a pin where the device's
        consumer checks what lands (a DMA-engine device): the reference taken here is then
        handed to that pin (``SlotPool.hand_off``)."""
        deadline = time.monotonic() + self._transfer_timeout()
        while True:
            try:
                dev, pool, idx, entry, fresh = self._reserve(session, device_id, key, refs=1)
                break
            except SlotsLanding as exc:
                if not wait:
                    raise WaitForLanding(exc.message) from exc
                if time.monotonic() > deadline:
                    raise
                time.sleep(LANDING_POLL_SECONDS)
        pool.granted[idx] = True  # the client may check this generation from now on
        pin_held = pin_held and dev.delivery == Delivery.DMA_ENGINE and pool.channel is not None
        if not fresh:
            return self._grant(session, pool, idx, entry, (), resident=True,
                               pin_held=pin_held)
        transfer = self._deliver_fresh(session, dev, pool, idx, entry, wait)
        return self._grant(session, pool, idx, entry, transfer.plan.checksums,
                           resident=False, pin_held=pin_held)

    def _reserve(self, session: Session, device_id: int, key: ExpertKey, refs: int
                 ) -> tuple[Device, SlotPool, int, ExpertEntry, bool]:
        """Find the slot holding ``key`` or allocate one (FILLING); adds ``refs`` references.
        Returns (device, pool, slot, entry, whether a delivery must start)."""
        dev = self.core.device(session, device_id)
        if dev.queue is None:
            raise precondition(f"device {device_id} has no work and completion rings registered")
        entry = self.core.expert(key)
        with session.lock:
            fitting = sorted((p for p in dev.pools.values() if p.slot_bytes >= entry.blob_bytes),
                             key=lambda p: p.slot_bytes)
            if not fitting:
                raise precondition(f"no slot pool on device {device_id} holds {key} "
                                   f"({entry.blob_bytes} bytes)")
            for pool in fitting:
                idx = pool.by_key.get(key)
                if idx is not None and pool.state[idx] == SlotState.LANDED:
                    # A verdict may have come since the loop last looked: a mismatch frees it.
                    self.deliveries.settle_landed(session, pool, idx)
                    idx = pool.by_key.get(key)
                if idx is not None and pool.state[idx] == SlotState.FILLING \
                        and pool.verdict(idx) == SlotState.FAILED:
                    # The consumer failed the landed bytes before the loop took up the copy's
                    # completion: granting this generation again would hand back the same
                    # failure. Once taken up, the slot is freed and its arena copy dropped.
                    raise SlotsLanding(f"{key}: its failed delivery is still being taken up")
                if idx is not None:
                    pool.hold(idx, refs)
                    return dev, pool, idx, entry, False
            for pool in fitting:
                idx = pool.allocate(key, refs)
                if idx is not None:
                    return dev, pool, idx, entry, True
            landing = sum(pool.unheld_landing() for pool in fitting)
        if landing:
            raise SlotsLanding(f"every slot that fits {key} on device {device_id} is held or "
                               f"still landing ({landing} unheld)")
        raise AgentError(ErrorKind.RESOURCE_EXHAUSTED,
                         f"every slot that fits {key} on device {device_id} is held "
                         "(or pinned by the client's hits)")

    def _deliver_fresh(self, session: Session, dev: Device, pool: SlotPool, idx: int,
                       entry: ExpertEntry, wait: bool = True) -> Transfer:
        try:
            return self.deliveries.deliver(session, dev, pool, idx, entry, wait=wait)
        except BaseException:
            with session.lock:
                pool.fail(idx, abi.Status.CANCELLED)  # ends any watcher of this generation
            raise

    def start_background(self, session: Session, device_id: int, key: ExpertKey,
                         priority: object, *, refs: int = 0, order: int = 0,
                         tag: object = None,
                         on_ready: Callable[[bool], None] | None = None) -> None:
        """Queue a delivery of ``key`` to the device on the scheduler. ``refs`` references are
        taken when it starts; ``on_ready(ok)`` is called when the copy is verified (or at once
        if it already was) or has failed."""
        link = (session.session_id, device_id)

        def start() -> bool:
            try:
                dev, pool, idx, entry, fresh = self._reserve(session, device_id, key, refs)
            except AgentError as exc:
                session.events.emit(ErrorEvent(f"background delivery of {key}: "
                                               f"{exc.message}"))
                if on_ready:
                    on_ready(False)
                return False
            if not fresh:
                if on_ready:
                    if pool.state[idx] in (SlotState.READY, SlotState.LANDED):
                        on_ready(True)
                    else:
                        self.deliveries.when_ready(dev, key, on_ready)
                return False
            self.deliveries.when_ready(
                dev, key, lambda ok: self._fills.submit(self.queue.finished, link))
            if on_ready:
                self.deliveries.when_ready(dev, key, on_ready)
            try:
                self._deliver_fresh(session, dev, pool, idx, entry)
            except AgentError as exc:
                self.deliveries.fail(dev, key)
                session.events.emit(ErrorEvent(f"background delivery of {key}: "
                                               f"{exc.message}"))
            return True

        self.queue.submit(link, priority, start, order=order, tag=tag)

    @staticmethod
    def _grant(session: Session, pool: SlotPool, idx: int, entry: ExpertEntry,
               checksums: tuple[int, ...], *, resident: bool, pin_held: bool) -> SlotGrant:
        """The grant of slot ``idx``; a ``pin_held`` one's reference is handed off (under
        ``session``'s lock) before the client can see the reply."""
        if pin_held:
            with session.lock:
                pin_held = pool.hand_off(idx)
        ready = pool.state[idx] == SlotState.READY
        return SlotGrant(0 if ready else pool.transfer[idx], pool.region_id, idx,
                         idx * pool.slot_bytes, ready, entry, checksums,
                         pool.state_base + idx, pool.generation[idx], resident, pin_held)
