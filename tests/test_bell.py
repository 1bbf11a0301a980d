"""The agent's doorbell (dpu_offload/bell.py, docs/ABI.md "The agent's doorbell"): a loop
that dozes on it is woken by every ring that follows work it had not seen, across processes,
and an idle agent's data-plane loop sleeps on it instead of polling."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np

from dpu_offload.bell import Bell
from dpu_offload.shm import SharedBuffer, unique_name
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess

ROUNDS = 300
DOZE = 2.0
"""A lost wake-up would cost the dozer this long; every round must take far less."""


def _dozer(bell_name: str, work_name: str) -> None:
    """Acknowledge each piece of work the other process posts, dozing in between."""
    bell, work_buf = Bell.open(bell_name), SharedBuffer(work_name, 16)
    words = np.ndarray((2,), "<u8", buffer=work_buf.array)
    posted, acked = words[0:1], words[1:2]
    while int(acked[0]) < ROUNDS:
        if int(posted[0]) != int(acked[0]):
            acked[0] = int(posted[0])
            continue
        bell.doze(DOZE, lambda: int(posted[0]) != int(acked[0]), lambda found: not found)


def test_every_ring_after_new_work_wakes_the_dozer_across_processes() -> None:
    """The store-fence-load on both sides: the poster stores work, fences, reads
    ``sleeping``; the dozer stores ``sleeping``, fences, looks for work. Whatever the
    interleaving, no piece of work waits for the dozer's timeout."""
    bell = Bell.create("test-bell")
    work_buf = SharedBuffer(unique_name("test-work"), 16, create=True)
    words = np.ndarray((2,), "<u8", buffer=work_buf.array)
    posted, acked = words[0:1], words[1:2]
    proc = mp.get_context("spawn").Process(target=_dozer, args=(bell.name, work_buf.name))
    proc.start()
    try:
        worst, slept = 0.0, 0
        for i in range(1, ROUNDS + 1):
            if i % 3 == 0:  # some rounds find the dozer asleep, others about to doze
                deadline = time.monotonic() + 5
                while not bell.asleep and time.monotonic() < deadline:
                    time.sleep(0.0002)
                slept += bell.asleep
            t0 = time.monotonic()
            posted[0] = i
            bell.ring()
            while int(acked[0]) < i:
                assert time.monotonic() - t0 < 2 * DOZE, f"round {i} never acknowledged"
                time.sleep(0)
            worst = max(worst, time.monotonic() - t0)
        assert worst < DOZE / 2, f"a ring was lost: round took {worst:.3f} s"
        assert slept > ROUNDS // 6, slept
    finally:
        proc.join(10)
        bell.unlink()
        work_buf.unlink()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_bell(agent_pid: int) -> Bell:
    """The DMA engine's doorbell of the agent ``agent_pid`` (its segment, mapped here)."""
    names = [n for n in os.listdir("/dev/shm") if n.startswith(f"dpu-engine-bell-{agent_pid}-")]
    assert len(names) == 1, names
    return Bell.open(names[0])


def test_an_idle_agent_sleeps_on_the_bell_and_a_post_wakes_it(qwen_ckpt: Path) -> None:
    """With nothing to do the data-plane loop and the DMA engine sleep on their bells (each
    process under 4 % of a core; ~11 % and ~9 % on the 2-core VM while they polled, ~1 % and
    ~0.4 % with the bells), and a client's post rings the agent awake, whose delivery rings the
    engine: the acquire is served and both bells' ``rings`` moved."""
    from bench.common import child_pid
    from dpu_offload.keys import ExpertKey

    with AgentProcess() as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "bell")
        dev = client.register_device(CpuReferenceDevice(),
                                     [SlotPoolSpec(model.expert_bytes, 2)], delivery="engine")
        key = ExpertKey("bell", model.moe_layers[0], 1)
        client.acquire(dev, key).wait(10)
        client.release(dev, key)
        time.sleep(0.5)
        bell, engine_bell = dev.channel._bell, _engine_bell(agent.proc.pid)
        assert bell is not None and bell.asleep and engine_bell.asleep
        pids = (agent.proc.pid, child_pid(agent.proc.pid, "dma_engine"))
        c0, t0 = [_cpu_seconds(p) for p in pids], time.monotonic()
        time.sleep(3.0)
        for pid, c in zip(pids, c0, strict=True):
            share = (_cpu_seconds(pid) - c) / (time.monotonic() - t0)
            assert share < 0.04, f"idle process {pid} used {share:.1%} of a core"
        rings = int(bell._rings[0]), int(engine_bell._rings[0])
        other = ExpertKey("bell", model.moe_layers[0], 2)
        slot = client.acquire(dev, other).wait(10)
        assert slot.key == other
        assert int(bell._rings[0]) != rings[0] and int(engine_bell._rings[0]) != rings[1]
        client.release(dev, other)
        assert os.path.exists(f"/dev/shm/{client._bell.name}")


def _asleep(bell: Bell, seconds: float) -> bool:
    """Whether the loop says it sleeps on ``bell`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not bell.asleep and time.monotonic() < deadline:
        time.sleep(0.001)
    return bell.asleep


def test_the_loop_sleeps_only_when_what_it_waits_for_rings() -> None:
    """While something it waits for closely comes without a ring (a device consumer's
    completions) the data-plane loop keeps polling; while only something it may take up later
    does (a consumer's verdict), it sleeps on the bell at most that bound; when all of it rings
    (the DMA engine's completions), it sleeps after its spin, and a ring wakes it."""
    from dpu_agent.dataplane.loop import DataPlaneLoop

    bell = Bell.create("test-loop-bell")
    limit, passes = [0.0], [0]

    def poll() -> tuple[int, int]:
        passes[0] += 1
        return 0, 0

    loop = DataPlaneLoop(poll, lambda: limit[0], [], bell, spin=0.001)
    loop.start()
    try:
        time.sleep(0.2)
        assert not bell.asleep and passes[0] > 100
        limit[0] = 0.02  # bounded dozes: ~10 in 0.2 s (each pass in a doze counts 2)
        time.sleep(0.05)
        before = passes[0]
        time.sleep(0.2)
        assert 4 <= passes[0] - before <= 40, passes[0] - before
        limit[0] = 1.0
        assert _asleep(bell, 5)
        before = passes[0]
        bell.ring()
        deadline = time.monotonic() + 1
        while passes[0] == before and time.monotonic() < deadline:
            time.sleep(0.001)
        assert passes[0] > before
    finally:
        loop.stop()
        bell.unlink()


def test_a_ring_to_nothing_yet_keeps_the_loop_polling_for_its_spin() -> None:
    """A client rings before it posts (``ClientChannel.announce``): the loop, woken to an
    empty ring, polls for its spin instead of going back to sleep at once, so the post that
    follows is taken without a second wake-up; a doze that times out leaves it asleep."""
    from dpu_agent.dataplane.loop import DataPlaneLoop

    bell = Bell.create("test-announce-bell")
    passes = [0]

    def poll() -> tuple[int, int]:
        passes[0] += 1
        return 0, 0

    loop = DataPlaneLoop(poll, lambda: 1.0, [], bell, spin=0.05)
    loop.start()
    try:
        assert _asleep(bell, 5)
        before = passes[0]
        bell.ring()
        time.sleep(0.03)  # within the spin: polling, awake
        assert not bell.asleep and passes[0] - before > 20, passes[0] - before
        assert _asleep(bell, 2) and not bell.rung  # the spin ended: asleep again
    finally:
        loop.stop()
        bell.unlink()
