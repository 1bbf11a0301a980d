"""Host-side (Python) producer and consumer of an ABI ring over any writable buffer.

Used by the agent's queues (producer of work, consumer of completions), the CPU reference
device (the kernel's twin) and the tests. The GPU side is receive.cu over the same bytes.
"""

from __future__ import annotations

import threading

import numpy as np

from dpu_offload import abi

_FENCE = threading.Lock()
_PROBE = 16
"""pop_many checks this many entries one by one before it checks the rest as an array;
push_many writes up to this many entries one by one (byte and element stores, no array
temporaries)."""
_PRODUCER_AT = abi.HEADER_DTYPE.fields["producer"][1]
_CONSUMER_AT = abi.HEADER_DTYPE.fields["consumer"][1]
_DOORBELL_AT = abi.HEADER_DTYPE.fields["doorbell"][1]


# Words another process or a device reads while they change (``seq``, ``producer``, slot-state
# words) are stored through NumPy views: a NumPy element store of an aligned u64 is one 8-byte
# store. ``struct.pack_into("<Q")`` is not: CPython writes such a value's bytes in steps, and a
# reader in another process saw 0 in between (tests/test_pinned_hits.py).


def store_fence() -> None:
    """A full memory barrier: CPython's lock acquire/release are atomic read-modify-writes, which
    order every earlier store before every later one on x86 and on Arm."""
    _FENCE.acquire()
    _FENCE.release()


MAX_RING_CAPACITY = 1 << 20
"""The most entries a ring may hold (64 MiB of work descriptors)."""


def capacity_problem(capacity: int) -> str | None:
    """What is wrong with a ring of ``capacity`` entries, or None."""
    if capacity <= 0 or capacity & (capacity - 1) or capacity > MAX_RING_CAPACITY:
        return f"ring capacity must be a power of two up to {MAX_RING_CAPACITY}, got {capacity}"
    return None


class RingError(ValueError):
    """The ring's header is not a valid ring of the expected kind; the message says why."""


class Ring:
    """A ring laid out per :mod:`dpu_offload.abi` in ``buffer`` (uint8 array of
    ``ring_bytes(capacity, entry_size)`` bytes).

    Attributes:
        header: structured scalar view (``HEADER_DTYPE``) of the live header.
        entries: ``[capacity]`` structured view of each entry's fixed part.
        payload: ``uint8[capacity, entry_size - 64]`` for packet rings, else None.
        raw: ``uint8[capacity, entry_size]``, every entry's bytes (what the compiled packet
            loops of ``gpu_kernels.packet_twin`` take).
    """

    def __init__(self, buffer: np.ndarray, kind: abi.RingKind) -> None:
        self.buffer = buffer
        self._header_arr = np.ndarray((1,), abi.HEADER_DTYPE, buffer=buffer, offset=0)
        self.header = self._header_arr[0]
        self.kind = kind
        self.validate()
        cap = int(self.header["capacity"])
        size = int(self.header["entry_size"])
        self.capacity = cap
        self.entry_size = size
        dtype = abi.entry_dtype_for(kind)
        self.entries = np.ndarray((cap,), dtype, buffer=buffer, offset=abi.HEADER_BYTES,
                                  strides=(size,))
        self._seq = np.ndarray((cap,), "<u8", buffer=buffer,
                               offset=abi.HEADER_BYTES + dtype.fields["seq"][1], strides=(size,))
        self._seq_at = dtype.fields["seq"][1]
        assert self._seq_at == dtype.itemsize - 8, "seq is the last word of every entry"
        self._bytes = memoryview(buffer)
        self._producer_word = np.ndarray((1,), "<u8", buffer=buffer, offset=_PRODUCER_AT)
        self._consumer_word = np.ndarray((1,), "<u8", buffer=buffer, offset=_CONSUMER_AT)
        self._doorbell_word = np.ndarray((1,), "<u4", buffer=buffer, offset=_DOORBELL_AT)
        self.raw = np.ndarray((cap, size), np.uint8, buffer=buffer, offset=abi.HEADER_BYTES)
        self.payload = None
        if size > dtype.itemsize:
            self.payload = np.ndarray((cap, size - dtype.itemsize), np.uint8, buffer=buffer,
                                      offset=abi.HEADER_BYTES + dtype.itemsize,
                                      strides=(size, 1))
        self._producer = int(self.header["producer"])
        self._consumer = int(self.header["consumer"])

    @classmethod
    def format(cls, buffer: np.ndarray, kind: abi.RingKind, capacity: int,
               entry_size: int | None = None) -> Ring:
        """Write a fresh header and zeroed entries into ``buffer`` and return the ring."""
        dtype = abi.entry_dtype_for(kind)
        entry_size = dtype.itemsize if entry_size is None else entry_size
        problem = capacity_problem(capacity)
        if problem:
            raise RingError(problem)
        if entry_size < dtype.itemsize or entry_size % abi.COPY_ALIGN_BYTES:
            raise RingError(f"entry size {entry_size} must be >= {dtype.itemsize} and a "
                            f"multiple of {abi.COPY_ALIGN_BYTES}")
        need = abi.ring_bytes(capacity, entry_size)
        if buffer.size < need:
            raise RingError(f"ring of {capacity} x {entry_size} B needs {need} bytes, "
                            f"buffer has {buffer.size}")
        buffer[:need] = 0
        header = np.ndarray((1,), abi.HEADER_DTYPE, buffer=buffer, offset=0)[0]
        header["version"] = abi.ABI_VERSION
        header["kind"] = int(kind)
        header["entry_size"] = entry_size
        header["capacity"] = capacity
        store_fence()
        header["magic"] = abi.RING_MAGIC
        return cls(buffer, kind)

    def validate(self) -> None:
        """Raise :class:`RingError` unless the header is a valid ring of this kind."""
        h = self.header
        if int(h["magic"]) != abi.RING_MAGIC:
            raise RingError(f"bad ring magic {int(h['magic']):#x}")
        if int(h["version"]) != abi.ABI_VERSION:
            raise RingError(f"ring ABI version {int(h['version'])}, expected {abi.ABI_VERSION}")
        if int(h["kind"]) != int(self.kind):
            raise RingError(f"ring kind {int(h['kind'])}, expected {int(self.kind)}")
        cap, size = int(h["capacity"]), int(h["entry_size"])
        if cap <= 0 or cap & (cap - 1):
            raise RingError(f"ring capacity {cap} is not a power of two")
        if size < abi.entry_dtype_for(self.kind).itemsize:
            raise RingError(f"ring entry size {size} is too small")
        if self.buffer.size < abi.ring_bytes(cap, size):
            raise RingError("ring buffer is shorter than its header says")

    # -- producer side ---------------------------------------------------------------------
    def free_entries(self) -> int:
        """Entries the producer may publish now without overwriting unconsumed ones."""
        return self.capacity - (self._producer - int(self._consumer_word[0]))

    def push(self, entry: np.void | dict[str, int], payload: np.ndarray | None = None) -> bool:
        """Publish one entry (its ``seq`` is set here); False, writing nothing, when full."""
        if self.free_entries() <= 0:
            return False
        pos = self._producer
        i = pos & (self.capacity - 1)
        self._seq[i] = 0
        store_fence()
        slot = self.entries[i : i + 1]
        if isinstance(entry, dict):
            slot[0] = 0
            for name, value in entry.items():
                if name != "seq":
                    slot[name] = value
        else:
            record = entry.copy()
            record["seq"] = 0
            slot[0] = record
        if payload is not None:
            assert self.payload is not None, "not a packet ring"
            self.payload[i, : payload.size] = payload
        store_fence()
        self._seq[i] = pos + 1
        self._producer = pos + 1
        self._producer_word[0] = pos + 1
        return True

    def push_many(self, records: np.ndarray) -> int:
        """Publish as many of ``records`` (an entry-dtype array) as fit, in order, with one
        fence; returns how many were published. Their ``seq`` fields are overwritten."""
        n = min(int(records.size), self.free_entries())
        if n <= 0:
            return 0
        pos = self._producer
        first = pos & (self.capacity - 1)
        if n <= _PROBE and first + n <= self.capacity:
            self._push_bytes(records[:n].tobytes(), n, pos, first)
            return n
        batch = records[:n]
        batch["seq"] = 0
        # At most two contiguous spans of the ring (the second after a wrap).
        spans = [(first, 0, min(n, self.capacity - first))]
        if spans[0][2] < n:
            spans.append((0, spans[0][2], n - spans[0][2]))
        for at, _, m in spans:
            self._seq[at:at + m] = 0
        store_fence()
        for at, k, m in spans:
            self.entries[at:at + m] = batch[k:k + m]
        store_fence()
        for at, k, m in spans:
            self._seq[at:at + m] = np.arange(pos + k + 1, pos + k + m + 1, dtype=np.uint64)
        self._producer = pos + n
        self._producer_word[0] = pos + n
        return n

    def push_packed(self, raw: bytes | bytearray, n: int) -> bool:
        """Publish ``n`` entries packed in ``raw`` (``n`` whole entries of the ring's entry
        dtype, as ``abi.packer`` writes them; their ``seq`` bytes are not read) with byte
        stores, no array temporaries; False, writing nothing, when they do not all fit."""
        if n <= 0 or n > self.free_entries():
            return n <= 0
        pos = self._producer
        first = pos & (self.capacity - 1)
        if first + n <= self.capacity:
            self._push_bytes(raw, n, pos, first)
            return True
        item = len(raw) // n
        head = self.capacity - first
        self._push_bytes(raw[:head * item], head, pos, first)
        self._push_bytes(raw[head * item:], n - head, pos + head, 0)
        return True

    def _push_bytes(self, raw: bytes | bytearray, n: int, pos: int, first: int) -> None:
        """Publish ``n`` entries packed in ``raw`` at ring index ``first`` (no wrap), position
        ``pos`` on: their bodies by byte stores, then each ``seq`` (one fence before, one
        after the bodies)."""
        mem, size, body, seq = self._bytes, self.entry_size, self._seq_at, self._seq
        item = len(raw) // n
        view = memoryview(raw)
        at = abi.HEADER_BYTES + first * size
        for j in range(n):
            seq[first + j] = 0
        store_fence()
        for j in range(n):
            mem[at + j * size:at + j * size + body] = view[j * item:j * item + body]
        store_fence()
        for j in range(n):
            seq[first + j] = pos + j + 1
        self._producer = pos + n
        self._producer_word[0] = pos + n

    def advance_producer(self, n: int) -> None:
        """Account for ``n`` entries published by another agent of this producer (a kernel
        launched on our behalf), in order from the current position."""
        self._producer += n
        self._producer_word[0] = self._producer

    # -- consumer side ---------------------------------------------------------------------
    def peek(self) -> np.void | None:
        """The next entry if published, else None. The record is a view: copy before pop."""
        i = self._consumer & (self.capacity - 1)
        if int(self._seq[i]) != self._consumer + 1:
            return None
        store_fence()
        return self.entries[i]

    def pop(self) -> np.void | None:
        """Take the next published entry (a copy) and release its place to the producer."""
        rec = self.peek()
        if rec is None:
            return None
        out = rec.copy()
        self.advance()
        return out

    def has_entries(self) -> bool:
        """Whether the next entry is published (one load: the cheap test of an idle poll)."""
        pos = self._consumer
        return int(self._seq[pos & (self.capacity - 1)]) == pos + 1

    def pop_many(self, limit: int | None = None) -> np.ndarray:
        """Take every published entry, oldest first (at most ``limit``), as a copied array,
        releasing their places with one consumer-index store."""
        n_max = min(self.capacity, limit or self.capacity)
        pos, mask, seq = self._consumer, self.capacity - 1, self._seq
        if int(seq[pos & mask]) != pos + 1:
            return self.entries[:0]  # nothing published: no copy, no fence
        # A few entries are the common case: probe them one by one (no array temporaries).
        n = 1
        while n < min(n_max, _PROBE) and int(seq[(pos + n) & mask]) == pos + n + 1:
            n += 1
        if n == _PROBE and n < n_max:
            want = np.arange(pos + 1, pos + n_max + 1, dtype=np.uint64)
            ready = seq[((want - np.uint64(1)) & np.uint64(mask)).astype(np.intp)] == want
            n = n_max if ready.all() else int(np.argmin(ready))
        store_fence()
        first = pos & mask
        if first + n <= self.capacity:
            out = self.entries[first:first + n].copy()
        else:
            out = np.concatenate([self.entries[first:], self.entries[:first + n - self.capacity]])
        self._consumer = pos + n
        self._consumer_word[0] = self._consumer
        return out

    def advance(self, count: int = 1) -> None:
        """Release the entry last returned by :meth:`peek` (or the next ``count``)."""
        self._consumer += count
        self._consumer_word[0] = self._consumer

    @property
    def consumed(self) -> int:
        """Entries this consumer has released."""
        return self._consumer

    @property
    def produced(self) -> int:
        """Entries this producer has published."""
        return self._producer

    @property
    def doorbell(self) -> bool:
        """Whether the producer rings the ring's doorbell after each publication (the header's
        ``doorbell`` word; ``dpu_offload.port_bell``): the consumer may sleep on it."""
        return bool(self._doorbell_word[0])

    @doorbell.setter
    def doorbell(self, rings: bool) -> None:
        self._doorbell_word[0] = int(rings)

    def request_exit(self) -> None:
        """Ask the ring's persistent consumer to stop."""
        store_fence()
        self.header["exit_flag"] = 1

    @property
    def exit_requested(self) -> bool:
        return int(self.header["exit_flag"]) != 0
