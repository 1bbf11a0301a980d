"""Devices that consume the agent's work ring: the CUDA device (the persistent receive kernel)
and the CPU reference device (its NumPy twin, on a thread, for machines without a GPU). Where
the DMA engine delivers instead, the device checks what landed (``start_check``).

Both hold a region table (``REGION_DTYPE[MAX_REGIONS]``): region 0 is the agent's arena, mapped
from its shared-memory handle; slot pools get the ids the agent assigned at registration.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple, Protocol

import numpy as np

from dpu_offload import abi
from dpu_offload.channel import Channel
from dpu_offload.ring import Ring
from dpu_offload.shm import SharedBuffer
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import reference
from gpu_kernels.reference import ReceiveKernel
from host_client.errors import status_text

RW = abi.RegionFlags.READABLE | abi.RegionFlags.WRITABLE


class DeviceFault(RuntimeError):
    """The device's consumer faulted or stopped answering; the message says how."""


class Doorbell:
    """How a polling consumer thread idles. Every poll takes the GIL from the inference thread
    of the same process, so a consumer with nothing to do polls rarely, and one that is owed
    work polls at once:

    - ``expect`` / ``settle``: the client counts transfers it awaits on this device (posted,
      not yet reported done). While any is owed, ``wait`` only yields the GIL: the agent posts
      a transfer's chunks in rounds, and a consumer asleep between rounds delays them.
    - otherwise ``wait`` sleeps ``first_s``, doubling up to ``max_s`` seconds while polls come
      back empty; ``ring`` (and ``expect``) end a sleep at once; ``reset`` after a poll that
      found work. The client rings after every request that makes the agent post work it does
      not wait for (prefetch, placement, rebalance), so only work the agent starts on its own
      (a periodic rebalance) waits out a nap: an idle consumer costs ~0.4 % of a core on the
      2-core CPU machine instead of ~8 % with naps of at most 1 ms.
    """

    def __init__(self, first_s: float = 20e-6, max_s: float = 0.1) -> None:
        self.first_s, self.max_s = first_s, max_s
        self._event = threading.Event()
        self._idle = 0
        self._lock = threading.Lock()
        self._owed = 0

    @property
    def owed(self) -> int:
        """Transfers expected and not yet settled."""
        return self._owed

    def wait(self) -> None:
        if self._owed:
            time.sleep(0)
            return
        self._event.wait(min(self.max_s, self.first_s * 2 ** self._idle))
        self._event.clear()
        self._idle = min(self._idle + 1, 16)

    def reset(self) -> None:
        self._idle = 0

    def ring(self) -> None:
        self._event.set()

    def expect(self) -> None:
        """A transfer to this device was posted; wake the consumer and keep it awake."""
        with self._lock:
            self._owed += 1
        self._event.set()

    def settle(self) -> None:
        """An expected transfer was reported done (or failed)."""
        with self._lock:
            self._owed = max(0, self._owed - 1)


CHECK_LANES = 4
"""Landed-slot checks run on this many lanes (threads of the twin, streams of a GPU), a slot's
always on the same one."""


class _CheckThread:
    """One daemon thread running submitted calls in order (a check abandoned by its waiter
    must not hold the process at exit, as a ThreadPoolExecutor's worker would)."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._calls = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._calls.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._calls.get()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever looks
                future.set_exception(exc)


class GrantCheck(NamedTuple):
    """One posted ACQUIRE whose slot a batch check takes from its reply
    (:meth:`Device.start_checks`): the request's ring ``position`` on the channel, its reply
    entry as the device sees it (``reply_address``) and the expert's blob size in bytes (a
    multiple of 16)."""

    position: int
    reply_address: int
    nbytes: int


class CheckTicket(Protocol):
    """A check started on a device (:meth:`Device.start_check`)."""

    def done(self) -> bool:
        """Whether the check has ended (it published a verdict, or had none to give)."""
        ...


class Device(ABC):
    """A consumer of one work ring and producer of one completion ring."""

    kind: int
    name: str
    xp: Any
    """The array module of this device's memory (numpy or cupy)."""
    verdict_wakes = False
    """Whether this device's landed-slot check wakes the slot word's sleepers once it published
    its verdict (the NumPy twin's thread does; a GPU kernel cannot, so its waiters poll)."""

    def __init__(self, ordinal: int = 0) -> None:
        self.ordinal = ordinal
        self.regions = np.zeros(abi.MAX_REGIONS, dtype=abi.REGION_DTYPE)
        self._arena: SharedBuffer | None = None
        self.work: Ring | None = None
        self.completion: Ring | None = None
        self.doorbell = Doorbell()
        self._check_lock = threading.Lock()
        self._checkers: dict[int, _CheckThread] = {}
        """Lane -> where the NumPy twin of the landed-slot check runs (started on first
        use)."""

    @property
    def memory_bytes(self) -> int:
        return 0

    def attach(self, arena_name: str, arena_size: int, arena_region: int, work: Ring,
               completion: Ring) -> None:
        """Map the agent's arena and take the rings this device consumes and produces."""
        self._arena = SharedBuffer(arena_name, arena_size)
        self.work, self.completion = work, completion
        self._set_region(arena_region, self._map_arena(self._arena, arena_region), arena_size,
                         abi.RegionFlags.READABLE)

    @abstractmethod
    def _map_arena(self, arena: SharedBuffer, region_id: int) -> int:
        """Register the arena with this device; returns its base as the consumer sees it."""

    @abstractmethod
    def allocate(self, nbytes: int, shared: str = "") -> Any:
        """``nbytes`` of zeroed device memory (``uint8`` array of this device's xp). With
        ``shared`` (a shared-memory name, ``shm.session_name``), memory another process (the
        DMA engine) can open: by :meth:`export_handle` (a GPU's own memory), or under that name
        (:meth:`export_shm`, the CPU reference device)."""

    def export_shm(self, memory: Any) -> str:
        """Shared-memory name of ``memory`` allocated ``shared`` (CPU reference device)."""
        return ""

    @abstractmethod
    def bind(self, region_id: int, memory: Any) -> None:
        """Make ``memory`` region ``region_id`` (readable and writable)."""

    def add_slot_pool(self, region_id: int, nbytes: int) -> None:
        """Allocate ``nbytes`` of device memory as region ``region_id``."""
        self.bind(region_id, self.allocate(nbytes))

    def export_handle(self, memory: Any) -> bytes:
        """Handle another process can open ``memory`` with (CUDA IPC); empty where the memory
        is private to this process (the CPU reference device)."""
        return b""

    def register_host_ring(self, buffer: np.ndarray) -> int:
        """Make a host ring visible to this device's kernels; returns its device address."""
        return int(buffer.ctypes.data)

    def can_read(self, other: Device) -> bool:
        """Whether this device's consumer can read ``other``'s memory in place."""
        return False

    def map_peer(self, region_id: int, memory: Any, owner: Device) -> None:
        """Make ``memory`` (a slot pool of ``owner``) readable here as ``region_id``."""
        raise DeviceFault(f"{self.name} cannot read the memory of {owner.name}")

    @abstractmethod
    def region_bytes(self, region_id: int, offset: int, nbytes: int) -> Any:
        """``uint8[nbytes]`` view of a region's memory on this device."""

    def start_check(self, states: np.ndarray, entry_address: int, index: int,
                    generation: int, blob: Any, timeout: float) -> CheckTicket:
        """Start the check of a slot the DMA engine fills and return at once: on the device,
        wait until ``states[index]`` (``SLOT_STATE_DTYPE`` entries; ``entry_address`` is that
        entry as the device sees it) reads LANDED for ``generation``, sum ``blob`` (the slot's
        ``uint8[n]`` bytes, n a multiple of 16) and publish READY, or FAILED with
        CHECKSUM_MISMATCH, against the entry's ``expected``. The caller reads the verdict from
        the word; the ticket tells when the check ended, verdict or not (it gives up after
        ``timeout`` s, or when the delivery failed or the slot moved on). Checks run on
        ``CHECK_LANES`` lanes by slot index, each lane in the order its checks were started
        (one slow delivery holds back only its lane). Here the NumPy twin, on this device's
        own threads: they stand for the GPU."""
        return self._checker(index).submit(reference.verify_landed, states, index, generation,
                                           blob, timeout)

    def start_checks(self, channel: Channel, states_address: int, checks: list[GrantCheck],
                     timeout: float) -> CheckTicket:
        """Start the checks of a batch of ACQUIREs just posted on ``channel`` (its slot-state
        table at ``states_address`` on the device), before the agent answered: each waits for
        its reply, takes the granted slot from it (bounds-checked against this device's region
        table) and is checked as :meth:`start_check` does, as soon as its own bytes land; one
        ticket for all. Here the NumPy twin, in order, on one lane (by the first request's
        position)."""
        return self._checker(checks[0].position).submit(
            reference.verify_granted_batch, channel, self.regions, self.region_bytes,
            [(c.position, c.nbytes) for c in checks], timeout)

    def _checker(self, index: int) -> _CheckThread:
        """The twin's check lane of slot-state ``index`` (started on first use)."""
        lane = index % CHECK_LANES
        with self._check_lock:
            if lane not in self._checkers:
                self._checkers[lane] = _CheckThread(f"{self.name}-check-{lane}")
            return self._checkers[lane]

    def enqueue_check(self, entry_address: int, index: int, generation: int, blob: Any,
                      timeout: float, result: Any, stream: Any) -> None:
        """The check of :meth:`start_check` enqueued on ``stream``, its outcome into ``result``
        (``uint32[1]``, an index into ``cuda_ops.WAIT_OUTCOMES``); only a device with streams
        has it."""
        raise DeviceFault(f"{self.name} has no streams to enqueue a check on")

    @abstractmethod
    def start(self) -> None:
        """Start consuming the work ring."""

    @abstractmethod
    def stop(self, timeout: float = 5.0) -> None:
        """Stop through the exit flag; DeviceFault if the consumer does not exit in time."""

    def check(self) -> None:
        """Raise DeviceFault if the consumer reported a fault against its rings."""
        if self.work is not None and int(self.work.header["fault"]):
            raise DeviceFault(f"{self.name}: receive kernel reported "
                              f"{status_text(int(self.work.header['fault']))}")

    def _set_region(self, region_id: int, base: int, size: int, flags: int) -> None:
        self.regions[region_id] = (base, size, flags, 0)
        self._publish_regions()

    def _publish_regions(self) -> None:  # noqa: B027 - the CPU twin reads the table in place
        """Make the region table visible to the consumer (a device copy on GPUs)."""

    def close(self) -> None:
        """Unmap the arena and forget every region; the device can be attached again."""
        if self._arena is not None:
            self._arena.close()
            self._arena = None
        self.regions[:] = 0
        self.work = self.completion = None


class CpuReferenceDevice(Device):
    """The receive kernel's NumPy twin, run by a thread of this process."""

    kind = pb.DEVICE_KIND_CPU_REFERENCE
    name = "cpu-reference"
    xp = np
    verdict_wakes = True

    def __init__(self, ordinal: int = 0) -> None:
        super().__init__(ordinal)
        self.memory: dict[int, np.ndarray] = {}
        self._shared: dict[int, SharedBuffer] = {}
        """address -> the shared buffer behind memory allocated ``shared``."""
        self._thread: threading.Thread | None = None
        self._kernel: ReceiveKernel | None = None
        self._running = threading.Event()
        self._running.set()

    def _map_arena(self, arena: SharedBuffer, region_id: int) -> int:
        self.memory[region_id] = arena.array
        return arena.address

    def allocate(self, nbytes: int, shared: str = "") -> np.ndarray:
        # Backed now, as a GPU's memory is when allocated: no page fault on the data path.
        if not shared:
            memory = np.empty(nbytes, dtype=np.uint8)
            memory.fill(0)
            return memory
        buf = SharedBuffer(shared, nbytes, create=True, populate=True)
        self._shared[buf.address] = buf
        return buf.array

    def export_shm(self, memory: np.ndarray) -> str:
        buf = self._shared.get(int(memory.ctypes.data))
        return buf.name if buf is not None else ""

    def bind(self, region_id: int, memory: np.ndarray) -> None:
        self.memory[region_id] = memory
        self._set_region(region_id, memory.ctypes.data, memory.size, RW)

    def region_bytes(self, region_id: int, offset: int, nbytes: int) -> np.ndarray:
        return self.memory[region_id][offset : offset + nbytes]

    def can_read(self, other: Device) -> bool:
        return isinstance(other, CpuReferenceDevice)  # one process: plain memory

    def map_peer(self, region_id: int, memory: np.ndarray, owner: Device) -> None:
        self.memory[region_id] = memory
        self._set_region(region_id, memory.ctypes.data, memory.size, abi.RegionFlags.READABLE)

    def start(self) -> None:
        assert self.work is not None and self.completion is not None, "attach first"
        self._kernel = ReceiveKernel(self.work, self.completion, self.regions, self.memory)
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="cpu-receive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._kernel is not None and self.work is not None
        while not self.work.exit_requested:
            if not self._running.wait(0.01):
                continue
            if self._kernel.poll():
                self.doorbell.reset()
            else:
                self.doorbell.wait()

    def pause(self) -> None:
        """Stop consuming (descriptors stay in the ring: the producer is held back)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def check(self) -> None:
        super().check()
        if self._thread is not None and not self._thread.is_alive() and self.work is not None \
                and not self.work.exit_requested:
            raise DeviceFault("cpu-reference: receive thread died")

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None or self.work is None:
            return
        self.work.request_exit()
        self.doorbell.ring()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DeviceFault("cpu-reference: receive thread did not exit")
        self._thread = None

    def close(self) -> None:
        super().close()
        self.memory.clear()
        for buf in self._shared.values():
            buf.unlink()
            buf.close()
        self._shared.clear()
