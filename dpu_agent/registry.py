"""Sessions, their devices and regions (the slots are ``dpu_agent.slots``'): who owns what, and
for how long."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.dataplane.queues import DeviceQueue, EngineRings
from dpu_agent.identity import Binding
from dpu_agent.slots import SlotPool
from dpu_offload.keys import ExpertKey


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


ARENA_REGION_ID = 0
"""Every session's region table holds the agent's arena at id 0."""


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


class Tally:
    """A running count, safe to add to from any thread (the events every session's sink
    dropped: a counter that closing a session does not race)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._value += n

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


class EventSink:
    """Events of one session, delivered in order to the (at most one) Events stream. At most
    ``capacity`` wait, attached or not: a client that does not read its stream (or has none)
    loses the oldest, counted in ``dropped``, rather than growing the agent's memory. The
    end-of-session marker (None) is never dropped, and what is emitted after it is counted as
    dropped (no stream will read it). A stream that goes away hands what it had not sent back
    to the buffer, for the next one."""

    def __init__(self, capacity: int = 4096, dropped: Tally | None = None) -> None:
        self._lock = threading.Lock()
        self._buffer: deque[SessionEvent | None] = deque(maxlen=capacity)
        self._queue: asyncio.Queue[SessionEvent | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.dropped = dropped or Tally()

    def emit(self, event: SessionEvent | None) -> None:
        with self._lock:
            if self._closed:
                if event is not None:
                    self.dropped.add()
                return
            self._closed = event is None
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._put, event)
                return
            self._buffer_locked(event)

    def _buffer_locked(self, event: SessionEvent | None) -> None:
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped.add()
        self._buffer.append(event)

    def _put(self, event: SessionEvent | None) -> None:
        """On the streams' loop: queue ``event`` for the attached stream, dropping the oldest
        when full (or buffer it, when the stream has gone since the emit)."""
        with self._lock:
            q = self._queue
            if q is None:
                self._buffer_locked(event)
                return
            if q.full():
                q.get_nowait()
                self.dropped.add()
            q.put_nowait(event)

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[SessionEvent | None]:
        with self._lock:
            q: asyncio.Queue[SessionEvent | None] = asyncio.Queue(self._buffer.maxlen or 0)
            while self._buffer:
                q.put_nowait(self._buffer.popleft())
            self._queue, self._loop = q, loop
            return q

    def detach(self, q: asyncio.Queue[SessionEvent | None]) -> None:
        """``q``'s stream ended: what it had not sent waits in the buffer again (or, when a
        newer stream had replaced it, is counted as dropped)."""
        with self._lock:
            if self._queue is q:
                self._queue, self._loop = None, None
                while not q.empty():
                    self._buffer_locked(q.get_nowait())
                return
            while not q.empty():
                if q.get_nowait() is not None:
                    self.dropped.add()

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
    """Guards the session's tables; the data-plane loop takes it for each request, so it is
    never held across a wait on the DMA engine."""
    registering: threading.Lock = field(default_factory=threading.Lock)
    """Serialises the session's registrations and deregistrations, which may wait on the DMA
    engine (its start, CUDA IPC opens: a second or more on a GPU host) outside ``lock``."""
    closed: bool = False
    """Set (under ``lock``) when the session closes: a registration that waited on the engine
    meanwhile finds it and undoes itself."""
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
