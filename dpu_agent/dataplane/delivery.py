"""Deliveries into device slots: a blob cut into chunk descriptors and posted on the device's
queue, its completions folded into one outcome, a checksum mismatch refetched from the
checkpoint, and whoever waits on it told. The slot's state is published here, so a slot is
never READY with unverified bytes: FILLING -> READY or FAILED where the device's consumer
checked each chunk as it copied (pull), FILLING -> LANDED where the DMA engine copied (it
cannot check; the engine itself writes LANDED behind the payload, a SIGNAL descriptor, so the
consumer need not wait for the agent), and then READY or FAILED as the consumer in the
inference process publishes after checking the slot; the agent takes that verdict up
(``check_landed``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor

from dpu_agent.dataplane.queues import QueueClosed
from dpu_agent.dataplane.transfers import Signal, Transfer, TransferPlan, TransferTracker
from dpu_agent.errors import AgentError, ErrorKind
from dpu_agent.registry import (
    ARENA_REGION_ID,
    Delivery,
    Device,
    ErrorEvent,
    Session,
)
from dpu_agent.slots import SlotPool
from dpu_agent.weights.cache import CacheFullError, WeightCache
from dpu_agent.weights.catalog import ExpertEntry
from dpu_agent.weights.safetensors_file import ShardChanged
from dpu_offload import abi
from dpu_offload.abi import SlotState
from dpu_offload.channel import state_word
from dpu_offload.keys import ExpertKey

log = logging.getLogger("dpu_agent")

MAX_VERIFY_RETRIES = 2
"""A chunk that fails its checksum is refetched from the checkpoint this many times."""

Waiter = Callable[[bool], None]


class Deliveries:
    """Every delivery in flight, and who waits on which.

    Args:
        cache: the arena's weight cache (the source of every first and repeated attempt).
        chunk_bytes: descriptor size, bytes.
        retries: where a refetch runs (it may read the checkpoint).
        alive: whether a session id is still open (no refetch for a closed one).
        wake: wakes the data-plane loop (it flushes and polls what was posted).
    """

    def __init__(self, cache: WeightCache, chunk_bytes: int, retries: Executor,
                 alive: Callable[[str], bool], wake: Callable[[], None]) -> None:
        self.cache = cache
        self.wake = wake
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        self.alive = alive
        self.tracker = TransferTracker()
        self.verify_failures = 0
        self.delivered_bytes: Counter[str] = Counter()
        """Bytes of verified deliveries by source: "arena" or "peer" (another device)."""
        self._lock = threading.Lock()
        self._waiters: dict[tuple[int, int, ExpertKey], list[Waiter]] = {}
        self._landed: dict[tuple[int, int], tuple[Session, SlotPool, int]] = {}
        """(pool id, slot) -> the LANDED slots whose consumer's verdict is not taken up yet."""

    def when_ready(self, dev: Device, key: ExpertKey, callback: Waiter) -> None:
        """Call ``callback(ok)`` once the delivery of ``key`` in flight to ``dev`` ends."""
        with self._lock:
            self._waiters.setdefault((dev.device_id, id(dev), key), []).append(callback)

    def _settle(self, dev: Device, key: ExpertKey, ok: bool) -> None:
        with self._lock:
            waiters = self._waiters.pop((dev.device_id, id(dev), key), [])
        for callback in waiters:
            callback(ok)

    def fail(self, dev: Device, key: ExpertKey) -> None:
        """The delivery of ``key`` to ``dev`` could not start: its waiters get False."""
        self._settle(dev, key, False)

    @staticmethod
    def _peer_slot(session: Session, dev: Device, key: ExpertKey
                   ) -> tuple[int, SlotPool, int] | None:
        """A verified slot holding ``key`` on a device ``dev`` can read, with a reference
        taken (so it is not evicted while copied from): (source device id, pool, slot)."""
        with session.lock:
            for sid in dev.peer_sources:
                src = session.devices.get(sid)
                for p in src.pools.values() if src is not None else ():
                    i = p.by_key.get(key)
                    if i is not None and p.state[i] == SlotState.READY and p.checksums[i]:
                        p.hold(i)
                        return sid, p, i
        return None

    def deliver(self, session: Session, dev: Device, pool: SlotPool, idx: int,
                entry: ExpertEntry, attempt: int = 0, wait: bool = True) -> Transfer:
        """Post the delivery of ``entry`` into slot ``idx`` of ``pool``. A first attempt
        copies from a peer device's verified slot when ``dev`` can read one (GPU-to-GPU);
        otherwise, and for every refetch, from the arena (``wait=False``: WouldBlock rather
        than fill it)."""
        peer = self._peer_slot(session, dev, entry.key) if attempt == 0 else None
        if peer is not None:
            sid, src, i = peer
            plan = TransferPlan(src.region_id, i * src.slot_bytes, pool.region_id,
                                idx * pool.slot_bytes, entry.blob_bytes, self.chunk_bytes,
                                src.checksums[i])
            source = "peer"

            def let_go() -> None:
                session.drop_ref(sid, entry.key)
        else:
            try:
                cached = self.cache.acquire(entry, wait=wait)
            except CacheFullError as exc:
                raise AgentError(ErrorKind.RESOURCE_EXHAUSTED, str(exc)) from exc
            except OSError as exc:
                raise AgentError(ErrorKind.UNAVAILABLE, f"reading {entry.key}: {exc}") from exc
            except ShardChanged as exc:
                # Short enough for a channel reply: GetStatus has the whole story.
                raise AgentError(ErrorKind.FAILED_PRECONDITION,
                                 f"model degraded: {exc.path.name} {exc.what} ({entry.key})"
                                 ) from exc
            checksums = cached.checksums
            signal = None
            if dev.delivery == Delivery.DMA_ENGINE:
                with session.lock:
                    pool.expect(idx, cached.expected)
                signal = Signal((pool.state_base + idx) * abi.SLOT_STATE_DTYPE.itemsize,
                                state_word(pool.generation[idx], SlotState.LANDED))
            plan = TransferPlan(ARENA_REGION_ID, cached.offset, pool.region_id,
                                idx * pool.slot_bytes, entry.blob_bytes, self.chunk_bytes,
                                checksums, verify=signal is None, signal=signal)
            source = "arena"

            def let_go() -> None:
                self.cache.release(cached)

        def done(t: Transfer) -> None:
            let_go()
            if t.status == abi.Status.OK:
                self.delivered_bytes[source] += t.bytes_done
            self._delivered(session, dev, pool, idx, entry, t, attempt)

        transfer = self.tracker.start(plan, done, owner=dev,
                                      rung=dev.delivery == Delivery.DMA_ENGINE)
        with session.lock:
            pool.transfer[idx] = transfer.transfer_id
            pool.checksums[idx] = plan.checksums
        assert dev.queue is not None
        try:
            dev.queue.submit(plan.descriptors(transfer.transfer_id))
        except QueueClosed as exc:  # the device went away after its transfers were cancelled
            self.tracker.cancel(lambda t: t is transfer)
            raise AgentError(ErrorKind.UNAVAILABLE, f"device {dev.device_id}: {exc}") from exc
        self.wake()  # posted from a thread of the agent's: the loop may be asleep
        return transfer

    def _delivered(self, session: Session, dev: Device, pool: SlotPool, idx: int,
                   entry: ExpertEntry, t: Transfer, attempt: int) -> None:
        status = t.status
        if status == abi.Status.CHECKSUM_MISMATCH:
            self.verify_failures += 1
            if attempt < MAX_VERIFY_RETRIES and self.alive(session.session_id):
                log.warning("checksum mismatch on %s chunks %s; refetching", entry.key,
                            t.failed_chunks)
                self.cache.invalidate(entry.key)
                self.retries.submit(self._retry, session, dev, pool, idx, entry, attempt + 1)
                return
        with session.lock:
            # The slot's current delivery only: a completion that comes after its slot was
            # freed and given to a new delivery of the same expert leaves that one alone.
            if (pool.keys[idx] == entry.key and pool.state[idx] == SlotState.FILLING
                    and pool.transfer[idx] == t.transfer_id):
                if status != abi.Status.OK:
                    pool.fail(idx, status)
                elif t.plan.verify:
                    pool.mark_ready(idx)
                else:
                    pool.mark_landed(idx)
                    with self._lock:
                        self._landed[(id(pool), idx)] = (session, pool, idx)
        self._settle(dev, entry.key, status == abi.Status.OK)

    def settle_landed(self, session: Session, pool: SlotPool, idx: int) -> None:
        """Take up the consumer's verdict on LANDED slot ``idx``: READY, or a checksum
        mismatch (counted; the arena's copy is dropped and the slot freed, so the next acquire
        refetches from the checkpoint). Nothing while unchecked."""
        with session.lock:
            if pool.state[idx] != SlotState.LANDED:
                verdict = None
            else:
                verdict = pool.verdict(idx)
                if verdict is None:
                    return
            key = pool.keys[idx]
            if verdict == SlotState.READY:
                pool.state[idx] = SlotState.READY
            elif verdict == SlotState.FAILED:
                pool.fail(idx, abi.Status.CHECKSUM_MISMATCH)
        with self._lock:
            self._landed.pop((id(pool), idx), None)
        if verdict == SlotState.FAILED and key is not None:
            self.verify_failures += 1
            log.warning("checksum mismatch on %s found by its consumer; its next acquire "
                        "refetches it from the checkpoint", key)
            self.cache.invalidate(key)

    @property
    def awaiting_verdicts(self) -> int:
        """LANDED slots whose consumer's verdict is not taken up yet (it comes without a
        ring: the loop polls for it)."""
        return len(self._landed)

    def check_landed(self) -> None:
        """Take up every verdict published on a LANDED slot (the data-plane loop calls this);
        a closed session's slots are forgotten."""
        with self._lock:
            landed = list(self._landed.values())
        for session, pool, idx in landed:
            if not self.alive(session.session_id):
                self.forget(pool)
            elif not pool.awaits_verdict(idx):
                self.settle_landed(session, pool, idx)

    def forget(self, pool: SlotPool) -> None:
        """Stop watching ``pool``'s LANDED slots (it was deregistered or its session closed)."""
        with self._lock:
            for k in [k for k in self._landed if k[0] == id(pool)]:
                del self._landed[k]

    def _retry(self, session: Session, dev: Device, pool: SlotPool, idx: int,
               entry: ExpertEntry, attempt: int) -> None:
        try:
            self.deliver(session, dev, pool, idx, entry, attempt)
        except AgentError as exc:
            with session.lock:
                pool.fail(idx, abi.Status.CANCELLED)
            self.fail(dev, entry.key)
            session.events.emit(ErrorEvent(f"refetch of {entry.key} failed: {exc.message}"))
