"""How the engine reaches memory and moves bytes: plain memory copies (CPU reference device),
or the GPU's copy engine (``cudaMemcpyAsync`` into pools opened by CUDA IPC handle) in the
engine's own CUDA context. Both take copy runs and SIGNAL writes with ``submit``, execute them
in order (a SIGNAL lands after every copy before it) and hand them back from ``landed``, in
order. Like a DMA engine, neither checks what it copied: the slot's consumer, in the inference
process, checks the landed blob (docs/ARCHITECTURE.md, "Verification").
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable
from typing import Any

from dma_engine.signals import SignalWrite, SlotStates
from dpu_offload import abi
from dpu_offload.jit import keep_cupy_cache
from dpu_offload.shm import SharedBuffer
from gpu_kernels.copy_runs import CopyRun

Op = CopyRun | SignalWrite
ENTRY_BYTES = abi.SLOT_STATE_DTYPE.itemsize


class CpuLane:
    """Runs and SIGNALs of one target on the CPU: executed as they are submitted."""

    def __init__(self, states: SlotStates) -> None:
        self._states = states
        self._landed: list[Op] = []

    def submit(self, ops: list[Op]) -> None:
        """Execute ``ops`` now, in order; :meth:`landed` hands them out."""
        for op in ops:
            if isinstance(op, SignalWrite):
                self._states.write(op)
            else:
                ctypes.memmove(op.dst, op.src, op.nbytes)
        self._landed.extend(ops)

    def landed(self) -> list[Op]:
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
        return self._map(name, size, populate=False)  # sparse: filled as experts are read

    def open_pool(self, spec: dict[str, Any]) -> int:
        if not spec.get("shm"):
            raise ValueError("a CPU reference slot pool needs its shared-memory name")
        return self._map(spec["shm"], int(spec["size"]), populate=True)

    def _map(self, name: str, size: int, populate: bool) -> int:
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = SharedBuffer(name, size, populate=populate)
        return buf.address

    def close_pool(self, base: int) -> None:
        for name, buf in list(self._buffers.items()):
            if buf.address == base:
                del self._buffers[name]
                buf.close()

    def lane(self, states: SlotStates) -> CpuLane:
        """A queue of runs for one target, whose SIGNALs write ``states``."""
        return CpuLane(states)

    def close(self) -> None:
        for buf in self._buffers.values():
            buf.close()
        self._buffers.clear()


class CudaBackend:
    """One GPU: the arena registered (pinned), pools opened by IPC handle, in the engine's own
    CUDA context; each target moves its runs on a :class:`CudaLane`."""

    def __init__(self, ordinal: int) -> None:
        keep_cupy_cache()
        import cupy as cp

        self.cp = cp
        self.dev = cp.cuda.Device(ordinal)
        self._arenas: dict[str, SharedBuffer] = {}
        self._registered: list[int] = []
        self._pools: list[int] = []

    def lane(self, states: SlotStates) -> CudaLane:
        """A stream and events for one target, whose SIGNALs write ``states`` from the GPU
        (its table registered, mapped, in this context)."""
        return CudaLane(self.cp, self.dev, states)

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


def _write_value64() -> Callable[[int, int, int, int], int]:
    """``cuStreamWriteValue64(stream, device address, value, flags)`` of the CUDA driver: a
    64-bit write the stream performs once the work before it is done, fenced after it (no
    kernel, so no time slice of the GPU's compute is taken from the client's context)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuStreamWriteValue64_v2", None) or lib.cuStreamWriteValue64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class CudaLane:
    """One target's runs on the GPU, copied back to back on one stream, each SIGNAL written
    by the stream behind the copies before it (``cuStreamWriteValue64``). Nothing waits:
    :meth:`landed` polls each op's event and hands ops out in order."""

    def __init__(self, cp: Any, dev: Any, states: SlotStates) -> None:
        self.cp, self.dev = cp, dev
        buffer = states.buffer
        with dev:
            self.stream = cp.cuda.Stream(non_blocking=True)
            cp.cuda.runtime.hostRegister(buffer.address, buffer.size, 0x1 | 0x2)  # Mapped
            self._registered = buffer.address
            self._table = int(cp.cuda.runtime.pointerGetAttributes(states.address
                                                                   ).devicePointer)
        self._write_value = _write_value64()
        self._pending: deque[tuple[Op, Any]] = deque()
        self._free_events: list[Any] = []
        """Reused (creating an event costs a runtime call)."""

    def _event(self) -> Any:
        if not self._free_events:
            with self.dev:
                return self.cp.cuda.Event(disable_timing=True)
        return self._free_events.pop()

    def submit(self, ops: list[Op]) -> None:
        """Enqueue ``ops`` in order and return at once."""
        rt, s = self.cp.cuda.runtime, self.stream
        with self.dev:
            for op in ops:
                if isinstance(op, SignalWrite):
                    error = self._write_value(s.ptr, self._table + op.index * ENTRY_BYTES,
                                              op.word, 0)
                    if error:
                        raise RuntimeError(f"cuStreamWriteValue64 failed: CUresult {error}")
                else:
                    rt.memcpyAsync(op.dst, op.src, op.nbytes, 4, s.ptr)  # Default: UVA
                done = self._event()
                done.record(s)
                self._pending.append((op, done))

    def landed(self) -> list[Op]:
        """The ops that landed since the last call, in submission order."""
        out: list[Op] = []
        while self._pending and self._pending[0][1].done:
            op, event = self._pending.popleft()
            self._free_events.append(event)
            out.append(op)
        return out

    def close(self) -> None:
        with self.dev:
            self.stream.synchronize()
            self.cp.cuda.runtime.hostUnregister(self._registered)
        self._pending.clear()
