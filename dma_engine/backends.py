"""How the engine reaches memory and moves bytes: plain memory copies (CPU reference device)
or the GPU's copy engine (``cudaMemcpyAsync`` into pools opened by CUDA IPC handle)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

from gpu_kernels.copy_runs import CopyRun
from gpu_kernels.shm import SharedBuffer


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

    def copy(self, runs: list[CopyRun]) -> Iterator[CopyRun]:
        for run in runs:
            ctypes.memmove(run.dst, run.src, run.nbytes)
            yield run

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()


class CudaBackend:
    """One GPU: the arena registered (pinned), pools opened by IPC handle, copies on one
    non-blocking stream with an event per run, so each run is posted as soon as it landed."""

    def __init__(self, ordinal: int) -> None:
        import cupy as cp

        self.cp = cp
        self.dev = cp.cuda.Device(ordinal)
        with self.dev:
            self.stream = cp.cuda.Stream(non_blocking=True)
        self._arenas: dict[str, SharedBuffer] = {}
        self._registered: list[int] = []
        self._pools: list[int] = []

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

    def copy(self, runs: list[CopyRun]) -> Iterator[CopyRun]:
        rt = self.cp.cuda.runtime
        with self.dev:
            events = []
            for run in runs:
                rt.memcpyAsync(run.dst, run.src, run.nbytes, 4, self.stream.ptr)  # Default
                event = self.cp.cuda.Event(disable_timing=True)
                event.record(self.stream)
                events.append(event)
            for run, event in zip(runs, events, strict=True):
                event.synchronize()
                yield run

    def close(self) -> None:
        with self.dev:
            self.stream.synchronize()
            for ptr in self._pools:
                self.cp.cuda.runtime.ipcCloseMemHandle(ptr)
            for address in self._registered:
                self.cp.cuda.runtime.hostUnregister(address)
        self._pools.clear()
        self._registered.clear()
        for buf in self._arenas.values():
            buf.close()
