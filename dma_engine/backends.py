"""How the engine reaches memory, moves bytes and verifies what landed: plain memory copies and
NumPy checksums (CPU reference device), or the GPU's copy engine (``cudaMemcpyAsync`` into pools
opened by CUDA IPC handle) followed by the segmented checksum kernel, in the engine's own CUDA
context. Both yield, per run, the chunk checksums of the bytes as they lie in the slot.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np

from gpu_kernels.checksum import chunk_checksum
from gpu_kernels.copy_runs import CopyRun
from gpu_kernels.shm import SharedBuffer

Landed = tuple[CopyRun, np.ndarray | None]
"""A run that has landed, and ``uint32[run.count]`` checksums of its chunks in the slot (None
for a run nobody asked to verify)."""


class CpuBackend:
    """Addresses are this process's own mappings of the shared buffers."""

    def __init__(self) -> None:
        self._buffers: dict[str, SharedBuffer] = {}

    def map_arena(self, name: str, size: int) -> int:
        return self._map(name, size)

    def open_pool(self, spec: dict[str, Any]) -> int:
        if not spec.get("shm"):
            raise ValueError("a CPU reference slot pool needs its shared-memory name")
        return self._map(spec["shm"], int(spec["size"]))

    def _map(self, name: str, size: int) -> int:
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = SharedBuffer(name, size)
        return buf.address

    def close_pool(self, base: int) -> None:
        for name, buf in list(self._buffers.items()):
            if buf.address == base:
                del self._buffers[name]
                buf.close()

    def copy(self, runs: list[CopyRun]) -> Iterator[Landed]:
        for run in runs:
            ctypes.memmove(run.dst, run.src, run.nbytes)
            if not run.verify:
                yield run, None
                continue
            landed = np.ctypeslib.as_array((ctypes.c_uint8 * run.nbytes).from_address(run.dst))
            yield run, np.array([chunk_checksum(landed[o:o + run.chunk_bytes], run.position + o)
                                 for o in range(0, run.nbytes, run.chunk_bytes)], np.uint32)

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()


class CudaBackend:
    """One GPU: the arena registered (pinned), pools opened by IPC handle. Runs are copied back
    to back on one stream; each landed run is checked on a second stream (the checksum kernel,
    its sums copied to pinned host memory), so checking a run overlaps copying the next, and
    each run is reported as soon as it has landed and been checked."""

    def __init__(self, ordinal: int) -> None:
        import cupy as cp

        from gpu_kernels import cuda_ops, launch

        self.cp, self.ops = cp, cuda_ops
        self.dev = cp.cuda.Device(ordinal)
        with self.dev:
            launch.preload(ordinal)
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.check_stream = cp.cuda.Stream(non_blocking=True)
            self._sums = cp.zeros(1 << 16, cp.uint32)
            self._host = cp.cuda.alloc_pinned_memory(4 << 16)
            self._host_sums = np.frombuffer(self._host, np.uint32, 1 << 16)
        self._arenas: dict[str, SharedBuffer] = {}
        self._registered: list[int] = []
        self._pools: list[int] = []
        self._events: list[Any] = []
        """Reused across batches (creating an event per run costs a runtime call)."""

    def _event(self, k: int) -> Any:
        while len(self._events) <= k:
            with self.dev:
                self._events.append(self.cp.cuda.Event(disable_timing=True))
        return self._events[k]

    def map_arena(self, name: str, size: int) -> int:
        buf = self._arenas.get(name)
        if buf is None:
            buf = self._arenas[name] = SharedBuffer(name, size)
            with self.dev:
                self.cp.cuda.runtime.hostRegister(buf.address, size, 0x1)  # Portable
            self._registered.append(buf.address)
        return buf.address

    def open_pool(self, spec: dict[str, Any]) -> int:
        handle = bytes.fromhex(spec.get("ipc", ""))
        if len(handle) != 64:
            raise ValueError("a CUDA slot pool needs its 64-byte CUDA IPC handle")
        with self.dev:
            ptr = int(self.cp.cuda.runtime.ipcOpenMemHandle(handle))
        self._pools.append(ptr)
        return ptr

    def close_pool(self, base: int) -> None:
        if base in self._pools:
            self._pools.remove(base)
            with self.dev:
                self.cp.cuda.runtime.ipcCloseMemHandle(base)

    def copy(self, runs: list[CopyRun]) -> Iterator[Landed]:
        rt, s, c = self.cp.cuda.runtime, self.stream, self.check_stream
        chunks = sum(r.count for r in runs if r.verify)
        if chunks > self._sums.size:  # more chunks than one batch normally has: grow
            with self.dev:
                self._sums = self.cp.zeros(chunks, self.cp.uint32)
                self._host = self.cp.cuda.alloc_pinned_memory(4 * chunks)
                self._host_sums = np.frombuffer(self._host, np.uint32, chunks)
        with self.dev:
            rt.memsetAsync(self._sums.data.ptr, 0, 4 * max(chunks, 1), c.ptr)
            pending, at = [], 0
            host = self._host_sums.ctypes.data
            for k, run in enumerate(runs):
                rt.memcpyAsync(run.dst, run.src, run.nbytes, 4, s.ptr)  # Default: UVA
                event = self._event(2 * k)
                event.record(s)
                if run.verify:
                    c.wait_event(event)
                    out = self._sums.data.ptr + 4 * at
                    self.ops.launch_checksums(run.dst, run.nbytes, run.chunk_bytes,
                                              run.position, out, stream=c)
                    rt.memcpyAsync(host + 4 * at, out, 4 * run.count, 2, c.ptr)  # to host
                    event = self._event(2 * k + 1)
                    event.record(c)
                pending.append((run, at if run.verify else -1, event))
                at += run.count if run.verify else 0
            for run, first, event in pending:
                event.synchronize()
                if first < 0:
                    yield run, None
                    continue
                words = np.full(run.count, run.chunk_bytes // 4, np.uint32)
                words[-1] = (run.nbytes - (run.count - 1) * run.chunk_bytes) // 4
                yield run, self._host_sums[first:first + run.count] ^ words

    def close(self) -> None:
        with self.dev:
            self.stream.synchronize()
            self.check_stream.synchronize()
            for ptr in self._pools:
                self.cp.cuda.runtime.ipcCloseMemHandle(ptr)
            for address in self._registered:
                self.cp.cuda.runtime.hostUnregister(address)
        self._pools.clear()
        self._registered.clear()
        for buf in self._arenas.values():
            buf.close()
