"""The DMA engine's target, in this process on the CPU backend (real shared memory, real rings):
copies land, a SIGNAL writes the slot-state entry only behind its transfer's copies, and a
SIGNAL the engine may not write is refused with its own status, writing nothing."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dma_engine.backends import CpuBackend
from dma_engine.engine import Target
from dma_engine.signals import TABLE_BYTES, SlotStates
from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.dataplane.queues import DeviceQueue, EngineRings
from dpu_agent.dataplane.transfers import Signal, TransferPlan
from dpu_offload import abi
from dpu_offload.channel import split_word, state_word
from dpu_offload.checksum import blob_checksums, blob_sum
from dpu_offload.ring import Ring
from dpu_offload.shm import SHM_DIR, SharedBuffer, unique_name
from host_client import CpuReferenceDevice

CHUNK = 4096
ARENA, POOL = 0, 1


class Rig:
    """An engine target over an arena and a pool in shared memory, and the agent's queue."""

    def __init__(self) -> None:
        self.channel = DeviceChannel(("session", 1))
        self.rings = EngineRings(64)
        self.queue = DeviceQueue(self.rings.work, self.rings.completions)
        self.arena = SharedBuffer(unique_name("test-arena"), 1 << 20, create=True)
        self.pool = SharedBuffer(unique_name("test-pool"), 1 << 20, create=True)
        self.arena.array[:] = np.random.default_rng(1).integers(0, 256, 1 << 20, np.uint8)
        self.backend = CpuBackend()
        buffers = [SharedBuffer(self.rings.work), SharedBuffer(self.rings.completions)]
        self.target = Target(1, self.backend, Ring(buffers[0].array, abi.RingKind.WORK),
                             Ring(buffers[1].array, abi.RingKind.COMPLETION),
                             SlotStates(self.channel.name, self.channel.size), buffers)
        rw = abi.RegionFlags.READABLE | abi.RegionFlags.WRITABLE
        self.target.regions[ARENA] = (self.backend.map_arena(self.arena.name, self.arena.size),
                                      self.arena.size, abi.RegionFlags.READABLE, 0)
        self.target.regions[POOL] = (self.backend.open_pool(
            {"shm": self.pool.name, "size": self.pool.size}), self.pool.size, rw, 0)

    def plan(self, src: int, dst: int, nbytes: int, index: int, generation: int
             ) -> TransferPlan:
        blob = self.arena.array[src:src + nbytes]
        sums = tuple(int(s) for s in blob_checksums(blob, CHUNK))
        # As the agent does before it posts a delivery: FILLING, with the sum to land.
        self.channel.publish_state(index, generation, abi.SlotState.FILLING,
                                   expected=blob_sum(sums, nbytes, CHUNK))
        return TransferPlan(ARENA, src, POOL, dst, nbytes, CHUNK, sums, verify=False,
                            signal=Signal(index * abi.SLOT_STATE_DTYPE.itemsize,
                                          state_word(generation, abi.SlotState.LANDED)))

    def run(self, descriptors: np.ndarray) -> np.ndarray:
        """Post, serve until every descriptor completed; the completions."""
        self.queue.submit(descriptors)
        out = []
        for _ in range(100):
            self.target.serve()
            got = self.queue.poll_completions()
            out.append(got)
            if sum(g.size for g in out) >= descriptors.size:
                break
        return np.concatenate(out)

    def entry(self, index: int) -> tuple[int, abi.SlotState, int]:
        e = self.channel.view.states[index]
        return (*split_word(int(e["word"])), int(e["expected"]))

    def close(self) -> None:
        self.target.close()
        self.backend.close()
        self.queue.close()
        self.rings.close()
        self.channel.close()
        for buf in (self.arena, self.pool):
            buf.unlink()
            buf.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_signal_lands_behind_its_copies(rig: Rig) -> None:
    plan = rig.plan(8192, 65536, 3 * CHUNK + 512, index=5, generation=3)
    done = rig.run(plan.descriptors(42))
    assert done.size == plan.descriptor_count == 2  # the blob as one COPY, then the SIGNAL
    assert done["nbytes"].tolist() == [plan.nbytes, 0]
    assert (done["status"] == 0).all() and (done["transfer_id"] == 42).all()
    np.testing.assert_array_equal(rig.pool.array[65536:65536 + plan.nbytes],
                                  rig.arena.array[8192:8192 + plan.nbytes])
    expected = blob_sum(plan.checksums, plan.nbytes, CHUNK)
    assert rig.entry(5) == (3, abi.SlotState.LANDED, expected)
    assert rig.entry(4)[1] == abi.SlotState.FREE


def test_a_refused_copy_cancels_its_transfers_signal(rig: Rig) -> None:
    plan = rig.plan(0, 0, 2 * CHUNK, index=7, generation=1)
    d = plan.descriptors(9)
    d["dst_offset"][0] = 1 << 40  # the blob lands nowhere
    done = rig.run(d)
    by_chunk = dict(zip(done["chunk_index"].tolist(), done["status"].tolist(), strict=True))
    assert by_chunk == {0: int(abi.Status.OUT_OF_BOUNDS), 1: int(abi.Status.CANCELLED)}
    assert rig.entry(7)[:2] == (1, abi.SlotState.FILLING)  # the agent fails it
    # The next transfer into the same entry is signalled as usual.
    ok = rig.plan(0, 0, CHUNK, index=7, generation=2)
    assert (rig.run(ok.descriptors(10))["status"] == 0).all()
    assert rig.entry(7)[:2] == (2, abi.SlotState.LANDED)


@pytest.mark.parametrize(("offset", "state", "status"), [
    (TABLE_BYTES, abi.SlotState.LANDED, abi.Status.OUT_OF_BOUNDS),
    (2 ** 63, abi.SlotState.LANDED, abi.Status.OUT_OF_BOUNDS),
    (24, abi.SlotState.LANDED, abi.Status.BAD_ALIGNMENT),
    (32, abi.SlotState.READY, abi.Status.BAD_OPCODE),
    (32, abi.SlotState.FAILED, abi.Status.BAD_OPCODE),
])
def test_a_signal_it_may_not_write_is_refused(rig: Rig, offset: int, state: abi.SlotState,
                                              status: abi.Status) -> None:
    before = rig.channel.view.buffer.copy()
    d = np.zeros(1, abi.DESCRIPTOR_DTYPE)
    d["transfer_id"], d["opcode"], d["dst_offset"] = 3, abi.Opcode.SIGNAL, offset
    d["src_offset"] = state_word(9, state)
    done = rig.run(d)
    assert done["status"].tolist() == [int(status)]
    np.testing.assert_array_equal(rig.channel.view.buffer, before)


def test_completions_ring_the_agents_bell_when_it_sleeps(rig: Rig) -> None:
    """The engine rings the agent's doorbell after it pushed completions, so the agent's loop
    may sleep through copies; a pass that completes nothing rings nothing."""
    from dma_engine.engine import Engine
    from dpu_offload.bell import Bell

    agent_bell = Bell.create("test-agent-bell")
    engine = Engine(agent_bell=Bell.open(agent_bell.name))
    engine.targets[1] = rig.target
    try:
        agent_bell._sleeping[0] = 1  # as the agent's loop publishes before it dozes
        engine._serve_all()
        assert int(agent_bell._rings[0]) == 0
        rig.queue.submit(rig.plan(0, 0, 3 * CHUNK, 2, 1).descriptors(7))
        for _ in range(100):
            engine._serve_all()
            if rig.queue.poll_completions().size:
                break
        assert int(agent_bell._rings[0]) >= 1
    finally:
        engine.targets.clear()
        agent_bell.unlink()


def test_a_doorbell_that_does_not_exist_is_refused_at_start() -> None:
    """The engine's command line is checked: a bell name that names no segment ends the
    process with a usage error naming the flag, before it serves anything."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "dma_engine", "--agent-bell",
                          "dpu-bell-no-such"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "--agent-bell 'dpu-bell-no-such'" in res.stderr and "does not exist" in res.stderr
    assert res.stdout == ""  # never said ready


@pytest.mark.parametrize("polls", [False, True])
def test_a_polling_engine_never_sleeps_while_it_serves_a_device(rig: Rig, polls: bool) -> None:
    """``--poll`` (``transfer.engine_poll``): with a device attached the engine's loop never
    sleeps on its doorbell, so work it is not rung for is taken at once, as by the hardware it
    stands for; without one it sleeps like the dozing engine. The dozing engine sleeps once
    its 2 ms spin after work has passed, and a push it is not rung for waits for its timeout."""
    import threading
    import time

    from dma_engine.engine import Engine
    from dpu_offload.bell import Bell

    bell = Bell.create("test-engine-bell")
    engine = Engine(Bell.open(bell.name), polls=polls)

    def slept_within(seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if bell.asleep:
                return True
            time.sleep(0.001)
        return False

    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        assert slept_within(2.0)  # no device: both sleep on the bell
        with engine.lock:
            engine.targets[1] = rig.target
        bell.ring()
        time.sleep(0.01)
        assert slept_within(0.3) is not polls
        rig.queue.submit(rig.plan(0, 0, 3 * CHUNK, 2, 1).descriptors(7))  # no bell (None)
        t0 = time.monotonic()
        while not rig.queue.poll_completions().size:
            assert time.monotonic() - t0 < 5.0
            time.sleep(0.0005)
    finally:
        engine.stopping = True
        bell.ring()
        thread.join(5)
        with engine.lock:
            engine.targets.clear()
        bell.unlink()


def _resident_bytes(address: int) -> int:
    """Resident bytes (``Rss`` in /proc/self/smaps) of this process's mapping at ``address``."""
    lines = iter(Path("/proc/self/smaps").read_text().splitlines())
    for line in lines:
        start = line.split("-", 1)[0]
        if " " not in start and start.isalnum() and int(start, 16) == address:
            for field in lines:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping starts at {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_POPULATE is Linux's")
def test_a_slot_pool_is_backed_when_allocated_and_the_arena_as_it_fills() -> None:
    """A CPU reference pool is all backed when the client allocates it and when the engine maps
    it, as device memory is (a first write would otherwise fault on the data path); the arena,
    filled as experts are read, is mapped without backing it."""
    nbytes = 4 << 20
    device = CpuReferenceDevice()
    name = unique_name("test-backed-pool")
    pool = device.allocate(nbytes, shared=name)
    arena = SharedBuffer(unique_name("test-sparse-arena"), nbytes, create=True)
    backend = CpuBackend()
    try:
        assert os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512 >= nbytes
        assert _resident_bytes(int(pool.ctypes.data)) >= nbytes
        assert _resident_bytes(backend.open_pool({"shm": name, "size": nbytes})) >= nbytes
        assert os.stat(os.path.join(SHM_DIR, arena.name)).st_blocks == 0
        assert _resident_bytes(backend.map_arena(arena.name, nbytes)) == 0
    finally:
        backend.close()
        arena.close()
        arena.unlink()
        os.unlink(os.path.join(SHM_DIR, name))
