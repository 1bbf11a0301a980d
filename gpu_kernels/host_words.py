"""Result words in registered (mapped) host memory: a kernel writes one through its device
address and the host reads it after synchronising the kernel's stream, with no copy. A word in
device memory costs the host a device-to-host copy per read (~20-40 us of its time on an H100
host) and a memset per use; a stream wait's outcome is read once per expert.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

import numpy as np

from gpu_kernels.launch import cp

CHUNK_WORDS = 1024
"""Words registered at a time (one 4 KiB page)."""


class HostWord:
    """One ``uint32`` word: ``device`` (a CuPy ``uint32[1]`` over its device address: what a
    kernel is given, made on GPU ``ordinal``) and ``host`` (a NumPy ``uint32[1]`` over the same
    bytes)."""

    __slots__ = ("device", "host", "ordinal")

    def __init__(self, device: Any, host: np.ndarray, ordinal: int) -> None:
        self.device, self.host, self.ordinal = device, host, ordinal


class HostWords:
    """The process's result words, registered with CUDA (portable, mapped) a page at a time
    and never unregistered, kept apart per current device (a word's ``device`` array belongs
    to the device it was made on). :meth:`take` hands a word out with a value stored;
    :meth:`give` takes it back once nothing will write it (its kernel's stream was
    synchronised): a word not given back is only lost, never handed out twice."""

    def __init__(self) -> None:
        self._free: dict[int, list[HostWord]] = {}
        self._lock = threading.Lock()
        self._pages: list[mmap.mmap] = []

    def take(self, value: int) -> HostWord:
        """A free word of the current device holding ``value`` (stored before any kernel is
        given it)."""
        ordinal = cp.cuda.Device().id
        with self._lock:
            free = self._free.setdefault(ordinal, [])
            if not free:
                self._grow(ordinal, free)
            word = free.pop()
        word.host[0] = value
        return word

    def give(self, word: HostWord) -> None:
        """Return ``word``; its kernel's stream must have been synchronised."""
        with self._lock:
            self._free[word.ordinal].append(word)

    def _grow(self, ordinal: int, free: list[HostWord]) -> None:
        rt = cp.cuda.runtime
        nbytes = CHUNK_WORDS * 4
        page = mmap.mmap(-1, nbytes)  # page-aligned, as registration wants
        host = np.frombuffer(page, np.uint32)
        address = int(host.ctypes.data)
        rt.hostRegister(address, nbytes, 0x1 | 0x2)  # Portable | Mapped
        device_address = int(rt.pointerGetAttributes(address).devicePointer)
        memory = cp.cuda.UnownedMemory(device_address, nbytes, page, device_id=ordinal)
        device = cp.ndarray((CHUNK_WORDS,), cp.uint32, cp.cuda.MemoryPointer(memory, 0))
        self._pages.append(page)
        free += [HostWord(device[i:i + 1], host[i:i + 1], ordinal) for i in range(CHUNK_WORDS)]


WORDS = HostWords()
"""The process-wide pool."""
