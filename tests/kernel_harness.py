"""Runs descriptors through a real device (the CUDA receive kernel or its CPU twin) with guard
bytes planted around the destination region."""

from __future__ import annotations

import time

import numpy as np

from dpu_offload import abi
from dpu_offload.shm import SharedBuffer, unique_name
from host_client.devices import CpuReferenceDevice, Device
from host_client.memory import SharedRing

GUARD = 4096
GUARD_BYTE = 0xA5
ARENA_REGION = 0
DST_REGION = 1


def make_device(backend: str) -> Device:
    if backend.startswith("cuda"):
        from host_client.cuda_device import CudaDevice

        mechanism = "copy_engine" if backend == "cuda-copy" else "kernel"
        return CudaDevice(0, blocks=16, threads=256, mechanism=mechanism)
    return CpuReferenceDevice()


class Harness:
    """An arena of ``src`` bytes (region 0) and a destination of ``dst_size`` bytes (region 1)
    with ``GUARD`` bytes of 0xA5 on each side that no descriptor may touch."""

    def __init__(self, backend: str, src: np.ndarray, dst_size: int, capacity: int = 64) -> None:
        self.arena = SharedBuffer(unique_name("test-arena"), src.size, create=True)
        self.arena.array[:] = src
        self.work = SharedRing(abi.RingKind.WORK, capacity)
        self.completion = SharedRing(abi.RingKind.COMPLETION, capacity)
        self.device = make_device(backend)
        self.device.attach(self.arena.name, src.size, ARENA_REGION, self.work.ring,
                           self.completion.ring)
        self.dst_size = dst_size
        self.device.add_slot_pool(DST_REGION, dst_size + 2 * GUARD)
        full = self.device.region_bytes(DST_REGION, 0, dst_size + 2 * GUARD)
        full.fill(GUARD_BYTE)
        self._full = full
        base = int(self.device.regions[DST_REGION]["base"])
        self.device.regions[DST_REGION] = (base + GUARD, dst_size, 3, 0)
        if isinstance(self.device, CpuReferenceDevice):
            self.device.memory[DST_REGION] = full[GUARD:]
        self.device._publish_regions()
        self.device.start()

    def run(self, descs: np.ndarray, timeout: float = 30.0) -> dict[int, tuple[int, int]]:
        """Publish every descriptor; returns transfer_id -> (status, nbytes)."""
        out: dict[int, tuple[int, int]] = {}
        sent = 0
        deadline = time.monotonic() + timeout
        while len(out) < descs.size:
            if sent < descs.size:
                sent += self.work.ring.push_many(descs[sent:])
            while (rec := self.completion.ring.pop()) is not None:
                out[int(rec["transfer_id"])] = (int(rec["status"]), int(rec["nbytes"]))
            self.device.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(out)}/{descs.size} completions after {timeout} s")
        return out

    def dst(self) -> np.ndarray:
        full = self._full.get() if hasattr(self._full, "get") else np.array(self._full)
        return full

    def close(self) -> None:
        self.device.stop()
        self.device.close()
        self.work.close()
        self.completion.close()
        self.arena.close()
        self.arena.unlink()
