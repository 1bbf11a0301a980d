"""Registration and the DMA engine's command channel, with the engine stopped (SIGSTOP) under a
command: nothing else waits behind it (the data-plane loop, other devices' requests, other
RPCs), a session closed meanwhile leaves nothing attached, and a deregistered pool leaves the
engine. Real agent and engine processes, CPU reference devices."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import child_pids
from dpu_offload.keys import ExpertKey
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, CpuReferenceDevice, NotFound, SlotPoolSpec
from host_client.launcher import AgentProcess
from host_client.registration import AttachedDevice
from tests.conftest import checkpoint_bytes


def engine_pids(agent: AgentProcess) -> list[int]:
    """Processes whose parent is the agent and that run ``python -m dma_engine``."""
    assert agent.proc is not None
    return child_pids(agent.proc.pid, "dma_engine")


def engine_rings(pid: int) -> set[str]:
    """The agent's rings to the engine that process ``pid`` has mapped (one pair a device)."""
    return {line.rsplit("/", 1)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if "/dpu-engine-work-" in line or "/dpu-engine-completion-" in line}


@pytest.fixture
def client(agent: AgentProcess) -> Iterator[AgentClient]:
    with AgentClient(agent.address) as c:
        yield c


@pytest.fixture
def engine_dev(client: AgentClient, qwen_ckpt: Path) -> Iterator[AttachedDevice]:
    model = client.load_model(str(qwen_ckpt), "qwen-engine")
    yield client.register_device(CpuReferenceDevice(7), [SlotPoolSpec(model.expert_bytes, 18)],
                                 delivery="engine")


def test_a_slow_engine_command_does_not_stall_other_devices(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice,
        qwen_ckpt: Path) -> None:
    """While a device's attach waits on the DMA engine (stopped here; on a GPU host its start
    and CUDA IPC opens take about a second), a device of the same session that the engine
    does not serve gets its experts at once (the data-plane loop takes neither the engine's
    command channel nor the session's lock for that wait) and other calls are answered (the
    gRPC loop is not blocked: the session's lease, 3 s here, is kept). The attach completes
    once the engine resumes and that device is served too."""
    truth = checkpoint_bytes(qwen_ckpt)
    client.acquire(engine_dev, ExpertKey("qwen-engine", 0, 0)).wait(10)  # engine running
    (pid,) = engine_pids(agent)
    model = client.load_model(str(qwen_ckpt), "qwen-beside")
    own = client.register_device(CpuReferenceDevice(12), [SlotPoolSpec(model.expert_bytes, 4)])
    attached: list[AttachedDevice] = []
    os.kill(pid, signal.SIGSTOP)
    try:
        attaching = threading.Thread(target=lambda: attached.append(client.register_device(
            CpuReferenceDevice(13), [SlotPoolSpec(model.expert_bytes, 4)], delivery="engine")))
        attaching.start()
        time.sleep(3.5)  # sweeps of the data-plane loop and a lease's length: the command waits
        assert attaching.is_alive() and not attached
        t0 = time.monotonic()
        assert client.status().sessions
        assert time.monotonic() - t0 < 1.0
        slot = client.acquire(own, ExpertKey("qwen-beside", 2, 3)).wait(5)
        assert time.monotonic() - t0 < 1.0
        assert slot.raw("down_proj").tobytes() == truth[
            "model.layers.2.mlp.experts.3.down_proj.weight"]
    finally:
        os.kill(pid, signal.SIGCONT)
    attaching.join(15)
    (late,) = attached
    slot = client.acquire(late, ExpertKey("qwen-beside", 1, 2)).wait(10)
    assert slot.raw("down_proj").tobytes() == truth["model.layers.1.mlp.experts.2.down_proj.weight"]
    assert engine_pids(agent) == [pid]


def test_a_deregistered_pool_is_closed_in_the_engine(
        agent: AgentProcess, client: AgentClient, qwen_ckpt: Path) -> None:
    """DeregisterRegion of a DMA-engine device's pool closes it in the engine (its mapping
    goes from the engine process), and a restarted engine reopens only the pools still
    registered: the other pool is served, bytes verified, after the engine is killed."""
    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-unpool")
    device = CpuReferenceDevice(14)
    dev = client.register_device(device, [SlotPoolSpec(model.expert_bytes, 2),
                                           SlotPoolSpec(2 * model.expert_bytes, 2)],
                                 delivery="engine")
    client.acquire(dev, ExpertKey("qwen-unpool", 0, 0)).wait(10)  # engine running
    (pid,) = engine_pids(agent)
    kept, gone = sorted(dev.pools)
    names = {rid: device.export_shm(device.memory[rid]) for rid in (kept, gone)}
    maps = Path(f"/proc/{pid}/maps")
    assert all(name in maps.read_text() for name in names.values())
    client.stub.DeregisterRegion(pb.RegionRef(session_id=client.session_id, region_id=gone))
    assert names[gone] not in maps.read_text() and names[kept] in maps.read_text()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not (fresh := [p for p in engine_pids(agent) if p != pid]):
        assert time.monotonic() < deadline, "the engine was not restarted"
        time.sleep(0.05)
    slot = client.acquire(dev, ExpertKey("qwen-unpool", 2, 4)).wait(10)
    assert slot.raw("down_proj").tobytes() == truth["model.layers.2.mlp.experts.4.down_proj.weight"]
    fresh_maps = Path(f"/proc/{fresh[0]}/maps").read_text()
    assert names[kept] in fresh_maps and names[gone] not in fresh_maps


def test_a_session_closed_while_its_device_attaches_leaves_nothing_attached(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice,
        qwen_ckpt: Path) -> None:
    """A session closes while one of its devices is attaching (the engine stopped under the
    attach) and another is attached: the close detaches what it can once the engine answers,
    the other session's calls are answered meanwhile, the attach ends NOT_FOUND naming the
    close, and the engine is left with the rings of the other session's device only."""
    client.acquire(engine_dev, ExpertKey("qwen-engine", 0, 0)).wait(10)  # engine running
    (pid,) = engine_pids(agent)
    before = engine_rings(pid)
    closing = AgentClient(agent.address)
    model = closing.load_model(str(qwen_ckpt), "qwen-closing")
    closing.register_device(CpuReferenceDevice(40), [SlotPoolSpec(model.expert_bytes, 2)],
                            delivery="engine")
    assert len(engine_rings(pid)) == len(before) + 2
    outcome: list[BaseException] = []

    def attach() -> None:
        try:
            closing.register_device(CpuReferenceDevice(41),
                                    [SlotPoolSpec(model.expert_bytes, 2)], delivery="engine")
        except BaseException as exc:  # noqa: BLE001 - the outcome under test
            outcome.append(exc)

    rings_before = set(Path("/dev/shm").glob("dpu-engine-work-*"))
    os.kill(pid, signal.SIGSTOP)
    try:
        attaching = threading.Thread(target=attach)
        attaching.start()
        # The agent makes the device's rings to the engine once it has taken the registration
        # (past the session's lookup): the close must come after that, however loaded the host.
        deadline = time.monotonic() + 10
        while not set(Path("/dev/shm").glob("dpu-engine-work-*")) - rings_before:
            assert time.monotonic() < deadline, "the attach never reached the engine"
            time.sleep(0.01)
        close = threading.Thread(target=lambda: closing.stub.CloseSession(
            pb.SessionRef(session_id=closing.session_id), timeout=20))
        close.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        assert client.status().sessions  # the gRPC loop is not held by the close
        assert time.monotonic() - t0 < 1.0
        assert attaching.is_alive() and close.is_alive()
    finally:
        os.kill(pid, signal.SIGCONT)
    attaching.join(20)
    close.join(20)
    (err,) = outcome
    assert isinstance(err, NotFound) and "closed while device 41" in str(err), err
    assert engine_rings(pid) == before
    closing.close()
    slot = client.acquire(engine_dev, ExpertKey("qwen-engine", 1, 3)).wait(10)
    assert slot.raw("down_proj").tobytes() == checkpoint_bytes(qwen_ckpt)[
        "model.layers.1.mlp.experts.3.down_proj.weight"]
