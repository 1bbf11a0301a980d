"""How the engine reaches memory and moves bytes: plain memory copies (CPU reference device),
or the GPU's copy engine (``cudaMemcpyAsync`` into pools opened by CUDA IPC handle) in the
engine's own CUDA context. Both take runs with ``submit`` and hand them back from ``landed``, in
order. Like a DMA engine, neither checks what it copied: the slot's consumer, in the inference
process, checks the landed blob (docs/ARCHITECTURE.md, "Verification").
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Any

from gpu_kernels.copy_runs import CopyRun
from gpu_kernels.shm import SharedBuffer


class CpuLane:
    """Runs of one target on the CPU: copied as they are submitted."""

    def __init__(self) -> None:
        self._landed: list[CopyRun] = []

    def submit(self, runs: list[CopyRun]) -> None:
        """Copy ``runs`` now; :meth:`landed` hands them out."""
        for run in runs:
            ctypes.memmove(run.dst, run.src, run.nbytes)
        self._landed.extend(runs)

    def landed(self) -> list[CopyRun]:
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


class CudaBackend:
    """One GPU: the arena registered (pinned), pools opened by IPC handle, in the engine's own
    CUDA context; each target moves its runs on a :class:`CudaLane`."""

    def __init__(self, ordinal: int) -> None:
        import cupy as cp

        self.cp = cp
        self.dev = cp.cuda.Device(ordinal)
        self._arenas: dict[str, SharedBuffer] = {}
        self._registered: list[int] = []
        self._pools: list[int] = []

    def lane(self) -> CudaLane:
        """A stream and events for one target."""
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
    """One target's runs on the GPU, copied back to back on one stream. Nothing waits:
    :meth:`landed` polls each run's event and hands runs out in order."""

    def __init__(self, cp: Any, dev: Any) -> None:
        self.cp, self.dev = cp, dev
        with dev:
            self.stream = cp.cuda.Stream(non_blocking=True)
        self._pending: deque[tuple[CopyRun, Any]] = deque()
        self._free_events: list[Any] = []
        """Reused (creating an event costs a runtime call)."""

    def _event(self) -> Any:
        if not self._free_events:
            with self.dev:
                return self.cp.cuda.Event(disable_timing=True)
        return self._free_events.pop()

    def submit(self, runs: list[CopyRun]) -> None:
        """Enqueue ``runs`` and return at once."""
        rt, s = self.cp.cuda.runtime, self.stream
        with self.dev:
            for run in runs:
                rt.memcpyAsync(run.dst, run.src, run.nbytes, 4, s.ptr)  # Default: UVA
                copied = self._event()
                copied.record(s)
                self._pending.append((run, copied))

    def landed(self) -> list[CopyRun]:
        """The runs whose bytes landed since the last call, in submission order."""
        out: list[CopyRun] = []
        while self._pending and self._pending[0][1].done:
            run, event = self._pending.popleft()
            self._free_events.append(event)
            out.append(run)
        return out

    def close(self) -> None:
        with self.dev:
            self.stream.synchronize()
        self._pending.clear()
