"""Sessions, their devices, regions and expert slots: who owns what, and for how long."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from enum import Enum

from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.dataplane.queues import DeviceQueue, EngineRings
from dpu_agent.identity import Binding
from dpu_offload.keys import ExpertKey
from gpu_kernels.abi import SlotState
from gpu_kernels.channel import split_word, state_word
from gpu_kernels.ring import RingError


class DeviceKind(Enum):
    """What a registered device is."""

    CUDA = "cuda"
    CPU_REFERENCE = "cpu reference"


class Delivery(Enum):
    """Who moves a device's expert bytes: its own consumer pulls them from the arena through
    the work ring, or the DMA engine pushes them into its slot pools."""

    DEVICE_PULL = "device pull"
    DMA_ENGINE = "DMA engine"


class RegionKind(Enum):
    """What a registered region of a device is."""

    SLOT_POOL = "slot pool"
    WORK_RING = "work ring"
    COMPLETION_RING = "completion ring"
    RX_RING = "rx ring"
    TX_RING = "tx ring"


_SETTLED = (SlotState.READY, SlotState.LANDED)
"""States in which a slot nobody holds may be evicted."""

ARENA_REGION_ID = 0
"""Every session's region table holds the agent's arena at id 0."""
CHECK_GRACE_SECONDS = 0.1
"""A LANDED slot whose generation a client was granted is not given to another delivery for
this long after it landed unless its verdict came: the client's check may be summing it, and
a check that saw LANDED publishes within microseconds of the bytes (docs/ABI.md)."""


@dataclass
class SlotPool:
    """A registered pool of equal-size expert slots on one device (one size class)."""

    region_id: int
    slot_bytes: int
    slot_count: int
    ipc_handle: bytes = b""
    """CUDA IPC handle of the pool's device memory, for a process that must open it."""
    shm_name: str = ""
    """Shared-memory name of a CPU reference pool a DMA engine writes."""
    state: list[SlotState] = field(default_factory=list)
    keys: list[ExpertKey | None] = field(default_factory=list)
    refs: list[int] = field(default_factory=list)
    transfer: list[int] = field(default_factory=list)
    checksums: list[tuple[int, ...]] = field(default_factory=list)
    """Per slot, the chunk checksums of the blob it holds (to verify copies made from it)."""
    by_key: dict[ExpertKey, int] = field(default_factory=dict)
    idle: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """READY or LANDED slots nobody holds through the agent, least recently released first:
    eviction candidates, each with the client's ``touches`` count of the slot when it was
    queued (a slot the client hit since, by a pin, gets a second chance)."""
    generation: list[int] = field(default_factory=list)
    """Per slot, how many deliveries it was given (the slot-state table's generation)."""
    granted: list[bool] = field(default_factory=list)
    """Per slot, whether a client was granted its current generation (so may check it)."""
    landed_at: list[float] = field(default_factory=list)
    """Per slot, when the agent saw its delivery land (monotonic seconds)."""
    channel: DeviceChannel | None = None
    """The device's data-plane channel, whose slot-state table mirrors ``state``."""
    state_base: int = 0
    """Index of slot 0 in the channel's slot-state table."""

    def __post_init__(self) -> None:
        n = self.slot_count
        self.state = [SlotState.FREE] * n
        self.keys = [None] * n
        self.refs = [0] * n
        self.transfer = [0] * n
        self.checksums = [()] * n
        self.generation = [0] * n
        self.granted = [False] * n
        self.landed_at = [0.0] * n

    def _publish(self, idx: int, status: int = 0) -> None:
        if self.channel is not None:
            self.channel.publish_state(self.state_base + idx, self.generation[idx],
                                       self.state[idx], status)

    def expect(self, idx: int, expected: int) -> None:
        """Write the blob sum the FILLING slot's delivery must land beside its word (a
        DMA-engine device: the engine publishes LANDED, the consumer checks against this);
        the word, already FILLING, is not published again."""
        if self.channel is not None:
            self.channel.store_expected(self.state_base + idx, expected)

    def unheld_landing(self) -> int:
        """Slots nobody holds whose delivery is still in flight (a prefetch, or an acquire
        released before the agent saw its copy complete), or whose check may still be
        running (:meth:`checking`): evictable in a moment."""
        return sum(1 for i, r in enumerate(self.refs)
                   if r == 0 and (self.state[i] == SlotState.FILLING or self.checking(i)))

    def checking(self, idx: int) -> bool:
        """Whether the slot is LANDED, granted to a client, without a verdict yet and landed
        less than ``CHECK_GRACE_SECONDS`` ago: a check of the client's may be summing its
        bytes, and would publish the old generation's verdict over the next delivery's word
        (the GPU cannot compare-and-swap host memory)."""
        return (self.state[idx] == SlotState.LANDED and self.granted[idx]
                and time.monotonic() - self.landed_at[idx] < CHECK_GRACE_SECONDS
                and self.verdict(idx) is None)

    # The reference rule, in one place: a slot someone holds through the agent is never an
    # eviction candidate; one nobody holds is, once its delivery settled (READY or LANDED).
    def hold(self, idx: int, refs: int = 1) -> None:
        """Take ``refs`` references on slot ``idx``; a held slot leaves the eviction queue."""
        self.refs[idx] += refs
        if self.refs[idx]:
            self.idle.pop(idx, None)

    def let_go(self, idx: int) -> bool:
        """Drop one reference on slot ``idx`` (queued for eviction if that was the last and its
        delivery settled); False when nobody held it."""
        if self.refs[idx] <= 0:
            return False
        self.refs[idx] -= 1
        self._idle_if_unheld(idx)
        return True

    def _idle_if_unheld(self, idx: int) -> None:
        if self.refs[idx] == 0 and self.state[idx] in _SETTLED:
            self.idle[idx] = self._touches(idx)

    def _touches(self, idx: int) -> int:
        return 0 if self.channel is None else self.channel.touches(self.state_base + idx)

    def allocate(self, key: ExpertKey, refs: int = 1) -> int | None:
        """A slot for ``key`` in FILLING state with ``refs`` references; None when every slot
        is held or pinned. Free slots first, then idle ones, least recently used first: an idle
        slot the client hit (pinned) since it was queued goes to the back once."""
        start = 0
        while (idx := self._next_free(start)) is not None:
            if self._claim(idx, key, refs):
                return idx
            start = idx + 1
        for _ in range(2 * len(self.idle)):
            idx, seen = self.idle.popitem(last=False)
            touches = self._touches(idx)
            if touches == seen and not self.checking(idx):
                old = self.keys[idx]
                if self._claim(idx, key, refs):
                    del self.by_key[old]  # type: ignore[arg-type]
                    return idx
            self.idle[idx] = touches
        return None

    def _next_free(self, start: int) -> int | None:
        try:
            return self.state.index(SlotState.FREE, start)
        except ValueError:
            return None

    def _claim(self, idx: int, key: ExpertKey, refs: int) -> bool:
        """Give slot ``idx`` to a delivery of ``key`` (FILLING, the next generation, ``refs``
        references) unless the client has it pinned. EVICTING is stored before the pins are read
        (the client's mirror image: ``Channel.try_pin``); a pinned slot gets its old word back
        and keeps its expert (a waiter on that word sees EVICTING come and go, no new
        generation)."""
        channel, index = self.channel, self.state_base + idx
        if channel is not None:
            old_word = int(channel.view.words[index])
            channel.store_word(index, state_word(self.generation[idx], SlotState.EVICTING))
            if channel.pins_after(index)[0]:
                channel.store_word(index, old_word)
                channel.wake_state(index)
                return False
        self.state[idx] = SlotState.FILLING
        self.keys[idx] = key
        self.refs[idx] = refs
        self.by_key[key] = idx
        self.generation[idx] += 1
        self.granted[idx] = False
        self._publish(idx)
        return True

    def mark_ready(self, idx: int) -> None:
        """Every chunk of the slot's delivery was verified: READY (idle if nobody holds it)."""
        self.state[idx] = SlotState.READY
        self._publish(idx)
        self._idle_if_unheld(idx)

    def mark_landed(self, idx: int) -> None:
        """Every chunk was copied, unchecked (a DMA-engine device), and the engine published
        LANDED (a SIGNAL; the expected sum was published with :meth:`expect`): the slot waits
        for its consumer's verdict (idle if nobody holds it). Nothing is published here: the
        consumer may have written its verdict already."""
        self.state[idx] = SlotState.LANDED
        self.landed_at[idx] = time.monotonic()
        self._idle_if_unheld(idx)

    def verdict(self, idx: int) -> SlotState | None:
        """What the consumer published for a LANDED slot's generation: READY, FAILED, or None
        while unchecked (any other word, which only the session's own process could have
        written, counts as unchecked)."""
        if self.channel is None:
            return None
        try:
            generation, state = split_word(int(self.channel.view.words[self.state_base + idx]))
        except RingError:  # no state at all
            return None
        if generation != self.generation[idx]:
            return None
        return state if state in (SlotState.READY, SlotState.FAILED) else None

    def fail(self, idx: int, status: int) -> None:
        """The slot's delivery failed for good with ``status`` (an ``abi.Status``): watchers
        see FAILED for this generation, and the slot is free again."""
        self.state[idx] = SlotState.FAILED
        self._publish(idx, status)
        self.free(idx)

    def free(self, idx: int) -> None:
        """Forget the slot's expert. The slot-state word keeps its last value (a FAILED stays
        visible) until the next :meth:`allocate` bumps the generation."""
        key = self.keys[idx]
        if key is not None and self.by_key.get(key) == idx:
            del self.by_key[key]
        self.idle.pop(idx, None)
        self.state[idx] = SlotState.FREE
        self.keys[idx] = None
        self.refs[idx] = 0
        self.transfer[idx] = 0
        self.checksums[idx] = ()

    def ready_count(self) -> int:
        return sum(1 for s in self.state if s == SlotState.READY)

    def held_count(self) -> int:
        """Slots someone holds a reference on."""
        return sum(1 for r in self.refs if r > 0)


@dataclass(eq=False)
class Device:
    """A GPU (or CPU reference device) registered by a session (compared by identity)."""

    device_id: int
    kind: DeviceKind
    ordinal: int
    name: str
    queue: DeviceQueue | None = None
    work_shm: str = ""
    completion_shm: str = ""
    pools: dict[int, SlotPool] = field(default_factory=dict)
    regions: dict[int, RegionKind] = field(default_factory=dict)
    """region id -> kind of every region registered on this device."""
    packet_rings: dict[int, str] = field(default_factory=dict)
    """RingKind (RX_PACKET / TX_PACKET) -> export handle; the activation path's rings."""
    peer_sources: tuple[int, ...] = ()
    """Devices of the session whose slot pools this device's consumer can read (LinkPeers)."""
    channel: DeviceChannel | None = None
    """The device's data-plane channel (requests, replies, slot states), made by the agent."""
    delivery: Delivery = Delivery.DEVICE_PULL
    engine_rings: EngineRings | None = None
    """The agent-owned rings to the DMA engine (DMA-engine devices, once attached)."""

    def exports(self) -> set[str | bytes]:
        """Every shared-memory name and CUDA IPC handle this device's memory is known by."""
        names: set[str | bytes] = {self.work_shm, self.completion_shm,
                                   *self.packet_rings.values()}
        if self.channel is not None:
            names.add(self.channel.name)
        if self.engine_rings is not None:
            names.update((self.engine_rings.work, self.engine_rings.completions))
        for pool in self.pools.values():
            names.update((pool.shm_name, pool.ipc_handle))
        return names - {"", b""}


@dataclass(frozen=True)
class ErrorEvent:
    """Something went wrong off the session's request path (a background delivery, a
    refetch): what, in words."""

    message: str


@dataclass(frozen=True)
class PlacementProgressEvent:
    """How far an applied placement got, in copies: ``total`` new ones to make, ``done``
    verified, ``failed``, and ``dropped`` old ones released after their replacements."""

    placement_id: int
    model: str
    done: int
    failed: int
    total: int
    dropped: int


SessionEvent = ErrorEvent | PlacementProgressEvent
"""What a session's event stream carries (the service layer turns each into a ``pb.Event``)."""


class EventSink:
    """Events of one session, delivered in order to the (at most one) Events stream. At most
    ``capacity`` wait, attached or not: a client that does not read its stream (or has none)
    loses the oldest, counted in ``dropped``, rather than growing the agent's memory. The
    end-of-session marker (None) is never dropped."""

    def __init__(self, capacity: int = 4096) -> None:
        self._lock = threading.Lock()
        self._buffer: deque[SessionEvent | None] = deque(maxlen=capacity)
        self._queue: asyncio.Queue[SessionEvent | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dropped = 0

    def emit(self, event: SessionEvent | None) -> None:
        with self._lock:
            if self._queue is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(self._put, self._queue, event)
                return
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._buffer.append(event)

    def _put(self, q: asyncio.Queue[SessionEvent | None], event: SessionEvent | None) -> None:
        """On the stream's loop: queue ``event``, dropping the oldest when full."""
        if q.full():
            q.get_nowait()
            with self._lock:
                self.dropped += 1
        q.put_nowait(event)

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[SessionEvent | None]:
        with self._lock:
            q: asyncio.Queue[SessionEvent | None] = asyncio.Queue(self._buffer.maxlen or 0)
            while self._buffer:
                q.put_nowait(self._buffer.popleft())
            self._queue, self._loop = q, loop
            return q

    def detach(self, q: asyncio.Queue[SessionEvent | None]) -> None:
        with self._lock:
            if self._queue is q:
                self._queue, self._loop = None, None

    def close(self) -> None:
        """Wake an attached stream with the end-of-session marker (None)."""
        self.emit(None)


@dataclass
class Session:
    """A client of the agent; everything it registered is reclaimed when it closes or its
    lease runs out."""

    session_id: str
    client_name: str
    lease_seconds: float
    expires_at: float
    devices: dict[int, Device] = field(default_factory=dict)
    events: EventSink = field(default_factory=EventSink)
    next_region_id: int = ARENA_REGION_ID + 1
    """Region ids index the session's per-device region tables, so they are per session;
    device ids are global (naming another session's device is PERMISSION_DENIED)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    binding: Binding | None = None
    """Who may name the session (None only for sessions the agent makes for itself)."""

    def touch(self) -> None:
        self.expires_at = time.monotonic() + self.lease_seconds

    def drop_ref(self, device_id: int, key: ExpertKey) -> bool:
        """Drop one reference on the slot holding ``key``; a READY or LANDED slot nobody holds
        becomes an eviction candidate. False when no reference was held."""
        dev = self.devices.get(device_id)
        if dev is None:
            return False
        with self.lock:
            for pool in dev.pools.values():
                idx = pool.by_key.get(key)
                if idx is not None and pool.let_go(idx):
                    return True
        return False

    @property
    def lease_remaining(self) -> float:
        return max(0.0, self.expires_at - time.monotonic())
