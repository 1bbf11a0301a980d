"""The weight arena: one shared-memory region (DPU DRAM on a BlueField) and its allocator.

The allocator is first-fit over an address-ordered free list with coalescing on free; all
blocks are multiples of 256 bytes. ``fragmentation`` is 1 - largest free block / free bytes.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

from dpu_offload.blob import BLOB_ALIGN, align_up
from dpu_offload.shm import SharedBuffer, unique_name

ARENA_ALIGN = BLOB_ALIGN
"""Arena blocks hold expert blobs: their alignment."""


class Arena:
    """A byte budget of shared memory handed out in aligned blocks.

    Attributes:
        buffer: the shared segment; ``buffer.name`` is the export handle host clients map.
        size: bytes.
    """

    def __init__(self, size: int, prefix: str = "dpu-agent-arena") -> None:
        if size < ARENA_ALIGN:
            raise ValueError(f"arena size {size} is smaller than {ARENA_ALIGN} bytes")
        self.size = size - size % ARENA_ALIGN
        self.buffer = SharedBuffer(unique_name(prefix), self.size, create=True)
        self._lock = threading.Lock()
        self._free_starts: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: self.size}
        self._used: dict[int, int] = {}

    @property
    def name(self) -> str:
        return self.buffer.name

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """``uint8[nbytes]`` view of arena bytes (no copy)."""
        return self.buffer.array[offset : offset + nbytes]

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a fresh block of at least ``nbytes``; None when no free block fits."""
        need = max(ARENA_ALIGN, align_up(nbytes, ARENA_ALIGN))
        with self._lock:
            for start in self._free_starts:
                size = self._free_sizes[start]
                if size >= need:
                    self._take(start, size, need)
                    self._used[start] = need
                    return start
        return None

    def _take(self, start: int, size: int, need: int) -> None:
        i = bisect.bisect_left(self._free_starts, start)
        del self._free_starts[i]
        del self._free_sizes[start]
        if size > need:
            rest = start + need
            bisect.insort(self._free_starts, rest)
            self._free_sizes[rest] = size - need

    def free(self, offset: int) -> None:
        """Return a block; KeyError if ``offset`` is not an allocated block."""
        with self._lock:
            size = self._used.pop(offset)
            i = bisect.bisect_left(self._free_starts, offset)
            if i < len(self._free_starts) and self._free_starts[i] == offset + size:
                nxt = self._free_starts.pop(i)
                size += self._free_sizes.pop(nxt)
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free_sizes[prev] == offset:
                    self._free_sizes[prev] += size
                    return
            self._free_starts.insert(i, offset)
            self._free_sizes[offset] = size

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.size - self.used_bytes

    @property
    def fragmentation(self) -> float:
        """1 - (largest free block / free bytes); 0 when free space is one block."""
        with self._lock:
            free = sum(self._free_sizes.values())
            largest = max(self._free_sizes.values(), default=0)
        return 0.0 if free == 0 else 1.0 - largest / free

    def close(self) -> None:
        self.buffer.close()
        self.buffer.unlink()
