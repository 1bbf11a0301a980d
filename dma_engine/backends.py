"""How the engine reaches memory, moves bytes and verifies what landed: plain memory copies and
NumPy checksums (CPU reference device), or the GPU's copy engine (``cudaMemcpyAsync`` into pools
opened by CUDA IPC handle) followed by the segmented checksum kernel, in the engine's own CUDA
context. Both take runs with ``submit`` and hand them back from ``landed``, in order, with the
chunk checksums of the bytes as they lie in the slot.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_kernels.checksum import chunk_checksum
from gpu_kernels.copy_runs import CopyRun
from gpu_kernels.shm import SharedBuffer

Landed = tuple[CopyRun, np.ndarray | None]
"""A run that has landed, and ``uint32[run.count]`` checksums of its chunks in the slot (None
for a run nobody asked to verify)."""

SUM_SLOTS = 1 << 16
"""Chunk checksums a CUDA lane can have in flight (device words and pinned host words)."""
MAX_RUN_CHUNKS = 4096
"""The engine hands a lane no run of more chunks (it cuts longer ones)."""



class CpuLane:
    """Runs of one target on the CPU: copied and checked as they are submitted."""

    def __init__(self) -> None:
        self._landed: list[Landed] = []

    def room(self) -> int:
        """Chunks that may be submitted now (copies complete within ``submit``)."""
        return 1 << 30

    def submit(self, runs: list[CopyRun]) -> None:
        """Copy and check ``runs`` now; :meth:`landed` hands them out."""
        for run in runs:
            ctypes.memmove(run.dst, run.src, run.nbytes)
            if not run.verify:
                self._landed.append((run, None))
                continue
            landed = np.ctypeslib.as_array((ctypes.c_uint8 * run.nbytes).from_address(run.dst))
            self._landed.append((run, np.array(
                [chunk_checksum(landed[o:o + run.chunk_bytes], run.position + o)
                 for o in range(0, run.nbytes, run.chunk_bytes)], np.uint32)))

    def landed(self) -> list[Landed]:
        """Runs landed since the last call, in submission order."""
        out, self._landed = self._landed, []
        return out

    def close(self) -> None:
        self._landed.clear()


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

    def lane(self) -> CpuLane:
        """A queue of runs for one target."""
        return CpuLane()

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()


@dataclass
class _Pending:
    """A run submitted to the GPU: its sums at ``at`` (-1: not verified), the sum slots it
    took (with any skipped at the end of the buffer), and its events (the last one marks it
    done)."""

    run: CopyRun
    at: int
    slots: int
    events: list[Any]


class CudaBackend:
    """One GPU: the arena registered (pinned), pools opened by IPC handle, in the engine's own
    CUDA context; each target moves its runs on a :class:`CudaLane`."""

    def __init__(self, ordinal: int) -> None:
        import cupy as cp

        from gpu_kernels import launch

        self.cp = cp
        self.dev = cp.cuda.Device(ordinal)
        with self.dev:
            launch.preload(ordinal)
        self._arenas: dict[str, SharedBuffer] = {}
        self._registered: list[int] = []
        self._pools: list[int] = []

    def lane(self) -> CudaLane:
        """Streams, checksum words and events for one target."""
        return CudaLane(self.cp, self.dev)

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

    def close(self) -> None:
        with self.dev:
            self.cp.cuda.Device().synchronize()
            for ptr in self._pools:
                self.cp.cuda.runtime.ipcCloseMemHandle(ptr)
            for address in self._registered:
                self.cp.cuda.runtime.hostUnregister(address)
        self._pools.clear()
        self._registered.clear()
        for buf in self._arenas.values():
            buf.close()


class CudaLane:
    """One target's runs on the GPU: copied back to back on one stream, each checked on a
    second stream as soon as it has landed (the checksum kernel, its sums copied to pinned host
    memory), so checking overlaps copying the next. Nothing waits: :meth:`landed` polls events
    and hands runs out in order."""

    def __init__(self, cp: Any, dev: Any) -> None:
        from gpu_kernels import cuda_ops

        self.cp, self.dev, self.ops = cp, dev, cuda_ops
        with dev:
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.check_stream = cp.cuda.Stream(non_blocking=True)
            self._sums = cp.zeros(SUM_SLOTS, cp.uint32)
            self._host = cp.cuda.alloc_pinned_memory(4 * SUM_SLOTS)
            self._host_sums = np.frombuffer(self._host, np.uint32, SUM_SLOTS)
        self._pending: deque[_Pending] = deque()
        self._free_events: list[Any] = []
        """Reused (creating an event costs a runtime call)."""
        self._head = 0
        """Next free sum slot."""
        self._used = 0
        """Sum slots taken by runs in flight."""

    def _event(self) -> Any:
        if not self._free_events:
            with self.dev:
                return self.cp.cuda.Event(disable_timing=True)
        return self._free_events.pop()

    def room(self) -> int:
        """Chunks that may be submitted now (free sum slots, less one run's worth of skip at
        the end of the buffer)."""
        return max(0, SUM_SLOTS - self._used - MAX_RUN_CHUNKS)

    def submit(self, runs: list[CopyRun]) -> None:
        """Enqueue ``runs`` (at most :meth:`room` chunks) and return at once."""
        rt, s, c = self.cp.cuda.runtime, self.stream, self.check_stream
        with self.dev:
            for run in runs:
                rt.memcpyAsync(run.dst, run.src, run.nbytes, 4, s.ptr)  # Default: UVA
                copied = self._event()
                copied.record(s)
                if not run.verify:
                    self._pending.append(_Pending(run, -1, 0, [copied]))
                    continue
                skip = SUM_SLOTS - self._head if self._head + run.count > SUM_SLOTS else 0
                at = 0 if skip else self._head
                self._head = at + run.count
                self._used += skip + run.count
                out = self._sums.data.ptr + 4 * at
                rt.memsetAsync(out, 0, 4 * run.count, c.ptr)
                c.wait_event(copied)
                self.ops.launch_checksums(run.dst, run.nbytes, run.chunk_bytes, run.position,
                                          out, stream=c)
                rt.memcpyAsync(self._host_sums.ctypes.data + 4 * at, out, 4 * run.count, 2,
                               c.ptr)  # to host
                checked = self._event()
                checked.record(c)
                self._pending.append(_Pending(run, at, skip + run.count, [copied, checked]))

    def landed(self) -> list[Landed]:
        """The runs whose bytes landed (and were checked) since the last call, in submission
        order, with their chunk checksums."""
        out: list[Landed] = []
        while self._pending and self._pending[0].events[-1].done:
            p = self._pending.popleft()
            self._free_events.extend(p.events)
            if p.at < 0:
                out.append((p.run, None))
                continue
            self._used -= p.slots
            run = p.run
            words = np.full(run.count, run.chunk_bytes // 4, np.uint32)
            words[-1] = (run.nbytes - (run.count - 1) * run.chunk_bytes) // 4
            out.append((run, self._host_sums[p.at:p.at + run.count] ^ words))
        return out

    def close(self) -> None:
        with self.dev:
            self.stream.synchronize()
            self.check_stream.synchronize()
        self._pending.clear()
