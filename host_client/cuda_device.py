"""The CUDA device: slot pools in GPU memory and the persistent receive kernel (receive.cu)
consuming the agent's work ring from registered host memory."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from dpu_offload import abi, checksum
from dpu_offload.channel import Channel
from dpu_offload.shm import SharedBuffer
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import cuda_ops, launch
from gpu_kernels.copy_runs import asks_exit, classify, completions, plan_runs
from host_client.cuda_checks import CudaSlotChecks
from host_client.devices import (
    RW,
    CheckTicket,
    Device,
    DeviceFault,
    GrantCheck,
)

_STATE_WORDS = 4  # dpu_receive_state in receive.cu
MECHANISMS = ("kernel", "copy_engine", "auto")
PROBE_BYTES = 64 << 20


def device_pointer(host_address: int) -> int:
    """The device address of registered (mapped) host memory."""
    return int(launch.cp.cuda.runtime.pointerGetAttributes(host_address).devicePointer)


class CudaDevice(Device):
    """One GPU. Host regions (arena, rings) are registered mapped, so the kernel reads them in
    place (``canUseHostPointerForRegisteredMem``); slot pools are ``cudaMalloc`` memory.

    Two delivery mechanisms consume the same work ring:

    - ``kernel``: the persistent receive kernel pulls each chunk from the registered arena with
      16-byte loads and verifies it (the GPUNetIO shape; no host CPU per byte or descriptor).
    - ``copy_engine``: a host thread takes descriptors, checks them against the region table,
      issues ``cudaMemcpyAsync`` per chunk, verifies with the checksum kernel and publishes the
      completions (host CPU per descriptor, none per byte).
    - ``auto``: at start, time both reading the arena (``PROBE_BYTES``) and take the faster;
      ``mechanism`` and ``probe`` say which and why.

    Args:
        ordinal: CUDA device ordinal.
        blocks: persistent blocks (default: one per multiprocessor).
        threads: threads per block.
        mechanism: one of ``MECHANISMS``.
    """

    kind = pb.DEVICE_KIND_CUDA

    def __init__(self, ordinal: int = 0, blocks: int | None = None, threads: int = 512,
                 mechanism: str = "auto") -> None:
        if mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
        super().__init__(ordinal)
        self.mechanism = mechanism
        self.probe: dict[str, float] = {}
        self._copier: threading.Thread | None = None
        self._launch = launch
        self.cp = launch.cp
        self.xp = self.cp
        self.dev = self.cp.cuda.Device(ordinal)
        with self.dev:
            props = self.cp.cuda.runtime.getDeviceProperties(ordinal)
            self.name = props["name"].decode() if isinstance(props["name"], bytes) \
                else str(props["name"])
            self._memory_bytes = int(props["totalGlobalMem"])
            self.blocks = blocks or launch.sm_count(ordinal)
            self.threads = threads
            self.stream = launch.non_blocking_stream()
            self._table_stream = launch.non_blocking_stream()
            self._table = self.cp.zeros(self.regions.nbytes, dtype=self.cp.uint8)
            self._state = self.cp.zeros(_STATE_WORDS, dtype=self.cp.uint64)
            self._kernel = launch.kernel("receive", "dpu_receive", ordinal)
        self._pools: dict[int, Any] = {}
        self._registered: list[int] = []
        self.checks = CudaSlotChecks(self.ordinal, self._register_host, self._table)
        self.dev.synchronize()  # zeroed on the null stream, which the lanes' streams ignore
        self._running = False
        self._done_event: Any = None

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    def _register_host(self, address: int, nbytes: int) -> int:
        rt = self.cp.cuda.runtime
        with self.dev:
            rt.hostRegister(address, nbytes, 0x1 | 0x2)  # Portable | Mapped
            self._registered.append(address)
            return device_pointer(address)

    def _map_arena(self, arena: SharedBuffer, region_id: int) -> int:
        return self._register_host(arena.address, arena.size)

    def allocate(self, nbytes: int, shared: str = "") -> Any:
        with self.dev:
            # Its own cudaMalloc, not a pool sub-allocation, so a CUDA IPC handle covers it.
            mem = self.cp.cuda.memory.Memory(nbytes)
            arr = self.cp.ndarray(nbytes, self.cp.uint8,
                                  self.cp.cuda.MemoryPointer(mem, 0))
            arr.fill(0)
            return arr

    def bind(self, region_id: int, memory: Any) -> None:
        self._pools[region_id] = memory
        self._set_region(region_id, int(memory.data.ptr), int(memory.size), RW)

    def export_handle(self, memory: Any) -> bytes:
        with self.dev:
            return bytes(self.cp.cuda.runtime.ipcGetMemHandle(int(memory.data.ptr)))

    def register_host_ring(self, buffer: np.ndarray) -> int:
        return self._register_host(int(buffer.ctypes.data), int(buffer.size))

    def region_bytes(self, region_id: int, offset: int, nbytes: int) -> Any:
        return self._pools[region_id][offset : offset + nbytes]

    def can_read(self, other: Device) -> bool:
        return (isinstance(other, CudaDevice) and other.ordinal != self.ordinal and
                bool(self.cp.cuda.runtime.deviceCanAccessPeer(self.ordinal, other.ordinal)))

    def map_peer(self, region_id: int, memory: Any, owner: Device) -> None:
        """Peer access to ``owner``'s GPU (NVLink or PCIe), then its pool as a readable region:
        both mechanisms read it through the unified address (the kernel with loads, the copy
        engine with a peer cudaMemcpyAsync)."""
        if not self.can_read(owner):
            raise DeviceFault(f"{self.name} {self.ordinal} has no peer access to "
                              f"{owner.name} {owner.ordinal}")
        with self.dev:
            try:
                self.cp.cuda.runtime.deviceEnablePeerAccess(owner.ordinal)
            except self.cp.cuda.runtime.CUDARuntimeError as exc:
                if "AlreadyEnabled" not in str(exc):
                    raise
        self._set_region(region_id, int(memory.data.ptr), int(memory.size),
                         abi.RegionFlags.READABLE)

    def _publish_regions(self) -> None:
        with self.dev:
            host = np.ascontiguousarray(self.regions).view(np.uint8)
            self._table.set(host, stream=self._table_stream)
            self._table_stream.synchronize()

    def _ring_pointers(self) -> tuple[int, int, int, int]:
        assert self.work is not None and self.completion is not None
        ptrs = []
        for ring in (self.work, self.completion):
            base = self._register_host(int(ring.buffer.ctypes.data), int(ring.buffer.size))
            ptrs += [base, base + abi.HEADER_BYTES]
        return ptrs[0], ptrs[1], ptrs[2], ptrs[3]

    def enqueue_check(self, entry_address: int, index: int, generation: int, blob: Any,
                      timeout: float, result: Any, stream: Any) -> None:
        self.checks.enqueue(entry_address, index, generation, blob, timeout, result, stream)

    def start_check(self, states: np.ndarray, entry_address: int, index: int,
                    generation: int, blob: Any, timeout: float) -> CheckTicket:
        """The check's kernels on a stream of this device's, not waited for: the wait kernel
        polls the word on the GPU until the bytes have landed."""
        with self._check_lock:
            return self.checks.start(entry_address, index, generation, blob, timeout)

    def start_checks(self, channel: Channel, states_address: int, checks: list[GrantCheck],
                     timeout: float) -> CheckTicket:
        """One launch per ``MAX_BATCH_CHECKS`` requests (``cuda_ops.verify_granted_batch``) on
        the lanes' streams in turn, each slot checked as soon as its reply came and its bytes
        landed; the ticket ends with the last launch."""
        with self._check_lock:
            return self.checks.start_batch(states_address, checks, timeout)

    def warm_up(self) -> None:
        """Load every kernel module, then launch the receive kernel once against a ring whose
        exit flag is already set, so module loads and first-launch costs are paid before the
        real persistent launch (a module loaded beside it would wait for it to end)."""
        from dpu_offload.ring import Ring

        self._launch.preload(self.ordinal)
        with self.dev:
            bufs = [np.zeros(abi.ring_bytes(2, abi.entry_dtype_for(k).itemsize), np.uint8)
                    for k in (abi.RingKind.WORK, abi.RingKind.COMPLETION)]
            work = Ring.format(bufs[0], abi.RingKind.WORK, 2)
            Ring.format(bufs[1], abi.RingKind.COMPLETION, 2)
            work.request_exit()
            dev_bufs = [self.cp.asarray(b) for b in bufs]
            state = self.cp.zeros(_STATE_WORDS, dtype=self.cp.uint64)
            self._kernel((1,), (self.threads,),
                         (dev_bufs[0], dev_bufs[0][abi.HEADER_BYTES:], dev_bufs[1],
                          dev_bufs[1][abi.HEADER_BYTES:], self._table, state),
                         stream=self.stream)
            self.stream.synchronize()

    def start(self) -> None:
        self.warm_up()
        if self.mechanism == "auto":
            self.mechanism = self._choose_mechanism()
        if self.mechanism == "copy_engine":
            self._copier = threading.Thread(target=self._copy_engine_loop, daemon=True,
                                            name=f"copy-engine-{self.ordinal}")
            self._running = True
            self._copier.start()
            return
        wh, we, ch, ce = self._ring_pointers()
        with self.dev:
            self._state.fill(0)
            self.cp.cuda.runtime.deviceSynchronize()  # before the persistent launch only
            self._kernel((self.blocks,), (self.threads,),
                         (np.uint64(wh), np.uint64(we), np.uint64(ch), np.uint64(ce),
                          self._table, self._state), stream=self.stream)
            self._done_event = self.cp.cuda.Event(disable_timing=True)
            self._done_event.record(self.stream)
        self._running = True

    def _arena_region(self) -> int:
        readable_only = np.flatnonzero((self.regions["size"] > 0)
                                       & (self.regions["flags"] == abi.RegionFlags.READABLE))
        return int(readable_only[0])

    def _choose_mechanism(self) -> str:
        """Time a kernel read and a copy-engine read of the arena; the faster wins."""
        cp = self.cp
        arena = self.regions[self._arena_region()]
        n = min(PROBE_BYTES, int(arena["size"])) // 16 * 16
        src = int(arena["base"])
        with self.dev:
            scratch = cp.empty(n, cp.uint8)
            out = cp.zeros(1, cp.uint32)

            def kernel_read() -> None:
                cuda_ops.launch_checksums(src, n, n, 0, out.data.ptr, stream=self.stream,
                                          blocks_per_chunk=self.blocks * 4)

            def copy_read() -> None:
                cp.cuda.runtime.memcpyAsync(scratch.data.ptr, src, n, 4, self.stream.ptr)

            for name, fn in (("kernel", kernel_read), ("copy_engine", copy_read)):
                fn()
                self.stream.synchronize()
                t0 = time.perf_counter()
                for _ in range(3):
                    fn()
                self.stream.synchronize()
                self.probe[f"{name}_gbps"] = 3 * n / (time.perf_counter() - t0) / 1e9
        return max(("kernel", "copy_engine"), key=lambda m: self.probe[f"{m}_gbps"])

    def _copy_engine_loop(self) -> None:
        assert self.work is not None and self.completion is not None
        cp = self.cp
        # CuPy's own work (the sums' fill and read) on this device's stream too: on the legacy
        # default stream it would queue behind the inference code's stream waits on the very
        # slots this loop fills (a deadlock until the transfer timeout).
        with self.dev, self.stream:
            sums = cp.zeros(self.work.capacity, cp.uint32)
            while not self.work.exit_requested:
                batch = self.work.pop_many(min(self.work.capacity,
                                               max(1, self.completion.free_entries())))
                if batch.size == 0:
                    self.doorbell.wait()
                    continue
                self.doorbell.reset()
                status, copy, verify = classify(batch, self.regions)
                sums[:batch.size].fill(0)
                for run in plan_runs(batch, copy, verify, self.regions):
                    cp.cuda.runtime.memcpyAsync(run.dst, run.src, run.nbytes, 4, self.stream.ptr)
                    if run.verify:
                        cuda_ops.launch_checksums(run.dst, run.nbytes, run.chunk_bytes,
                                                  run.position, sums.data.ptr + 4 * run.first,
                                                  stream=self.stream)
                self.stream.synchronize()
                got = checksum.finish(sums[:batch.size].get(), batch["length"])
                status[verify & (got != batch["checksum"])] = abi.Status.CHECKSUM_MISMATCH
                out = completions(batch, status, copy)
                sent = 0
                while sent < out.size:
                    sent += self.completion.push_many(out[sent:])
                if asks_exit(batch, status):
                    self.work.request_exit()

    def check(self) -> None:
        super().check()
        if self._copier is not None:
            if self._running and not self._copier.is_alive() and not (
                    self.work and self.work.exit_requested):
                raise DeviceFault(f"{self.name}: copy-engine consumer stopped unasked")
            return
        if self._done_event is not None and self._running:
            try:
                if self._done_event.done:
                    self._running = False
                    if not self.work or not self.work.exit_requested:
                        raise DeviceFault(f"{self.name}: receive kernel exited unasked")
            except self.cp.cuda.runtime.CUDARuntimeError as exc:
                raise DeviceFault(f"{self.name}: receive kernel faulted: {exc}") from exc

    def stop(self, timeout: float = 5.0) -> None:
        if not self._running or self.work is None:
            return
        self.work.request_exit()
        self.doorbell.ring()
        if self._copier is not None:
            self._copier.join(timeout)
            if self._copier.is_alive():
                raise DeviceFault(f"{self.name}: copy-engine consumer did not exit")
            self._running = False
            return
        deadline = time.monotonic() + timeout
        while not self._done_event.done:
            if time.monotonic() > deadline:
                raise DeviceFault(f"{self.name}: receive kernel did not exit within {timeout} s")
            time.sleep(0.001)
        self._running = False

    def close(self) -> None:
        rt = self.cp.cuda.runtime
        with self.dev:
            for address in self._registered:
                rt.hostUnregister(address)
        self._registered.clear()
        self._pools.clear()
        self._done_event = None
        self._copier = None
        super().close()
