"""The shared-memory data plane: acquire / release / prefetch through the device channel, the
DMA engine as its own process (the CPU reference device runs the same process structure as a
GPU host), its death noticed and survived, and hostile request entries refused one by one."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.common import child_pids
from dpu_offload import abi
from dpu_offload.channel import Channel, split_word
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec, TransferFailed
from host_client.devices import CheckTicket, GrantCheck
from host_client.launcher import AgentProcess
from host_client.registration import AttachedDevice
from tests.conftest import checkpoint_bytes


def metric(agent: AgentProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def engine_pids(agent: AgentProcess) -> list[int]:
    """Processes whose parent is the agent and that run ``python -m dma_engine``."""
    assert agent.proc is not None
    return child_pids(agent.proc.pid, "dma_engine")


@pytest.fixture
def engine_dev(client: AgentClient, qwen_ckpt: Path) -> Iterator[AttachedDevice]:
    model = client.load_model(str(qwen_ckpt), "qwen-engine")
    dev = client.register_device(CpuReferenceDevice(7), [SlotPoolSpec(model.expert_bytes, 18)],
                                 delivery="engine")
    yield dev


@pytest.fixture
def client(agent: AgentProcess) -> Iterator[AgentClient]:
    with AgentClient(agent.address) as c:
        yield c


class _CountingDevice(CpuReferenceDevice):
    """The CPU reference device, counting the checks it is asked to start."""

    def __init__(self, ordinal: int) -> None:
        super().__init__(ordinal)
        self.singles: list[int] = []
        self.batches: list[int] = []

    def start_check(self, *args: Any) -> CheckTicket:
        self.singles.append(1)
        return super().start_check(*args)

    def start_checks(self, channel: Channel, states_address: int, checks: list[GrantCheck],
                     timeout: float) -> CheckTicket:
        self.batches.append(len(checks))
        return super().start_checks(channel, states_address, checks, timeout)


def _counting_engine_device(client: AgentClient, ckpt: Path, name: str, ordinal: int,
                            slots: int) -> tuple[_CountingDevice, AttachedDevice]:
    """The checkpoint loaded as ``name`` and a counting device the DMA engine fills, with a
    pool of ``slots``."""
    model = client.load_model(str(ckpt), name)
    device = _CountingDevice(ordinal)
    return device, client.register_device(device, [SlotPoolSpec(model.expert_bytes, slots)],
                                          delivery="engine")


def _assert_checkpoint_bytes(ckpt: Path, slots: list[Any]) -> None:
    truth = checkpoint_bytes(ckpt)
    for slot in slots:
        name = f"model.layers.1.mlp.experts.{slot.key.expert}.down_proj.weight"
        assert slot.raw("down_proj").tobytes() == truth[name]


def test_a_batch_acquire_starts_its_checks_in_one_launch(client: AgentClient,
                                                        qwen_ckpt: Path) -> None:
    """AcquireBatch through the DMA engine: its slots are checked by one batch check (one kernel
    launch on a GPU) started when the batch was posted, before the agent answered; the bytes
    are the checkpoint's; a single acquire's check likewise starts with its post."""
    device, dev = _counting_engine_device(client, qwen_ckpt, "qwen-batch-check", 9, 8)
    keys = [ExpertKey("qwen-batch-check", 1, e) for e in range(6)]
    _assert_checkpoint_bytes(qwen_ckpt, [h.wait(10) for h in client.acquire_batch(dev, keys)])
    assert device.batches == [6] and device.singles == []
    client.release_batch(dev, keys)
    slot = client.acquire(dev, ExpertKey("qwen-batch-check", 2, 0)).wait(10)
    assert slot.raw("down_proj").tobytes() == checkpoint_bytes(qwen_ckpt)[
        "model.layers.2.mlp.experts.0.down_proj.weight"]
    assert device.batches == [6, 1] and device.singles == []


def test_a_refused_batch_ends_its_posted_checks_and_the_next_batch_lands(
        client: AgentClient, qwen_ckpt: Path) -> None:
    """A batch whose last ACQUIRE the agent refuses (two slots, three experts: every slot
    held) raises the refusal and releases the granted two; the checks started at posting end
    (the refused one at once, outcome 5), so the next batch on the same device lands and
    checks its bytes."""
    from host_client import ResourceExhausted

    device, dev = _counting_engine_device(client, qwen_ckpt, "qwen-refused-batch", 11, 2)
    keys = [ExpertKey("qwen-refused-batch", 1, e) for e in range(3)]
    with pytest.raises(ResourceExhausted, match="held"):
        client.acquire_batch(dev, keys)
    assert device.batches == [3]
    # A released slot that landed within the last CHECK_GRACE_SECONDS (0.1 s) may still be
    # under its check and is not given to another expert until then: on a loaded machine the
    # next batch can come that early, and is refused; it lands once the grace is over.
    deadline = time.monotonic() + 5
    while True:
        try:
            handles = client.acquire_batch(dev, keys[1:])
            break
        except ResourceExhausted:
            assert time.monotonic() < deadline, "the next batch never landed"
            time.sleep(0.2)
    _assert_checkpoint_bytes(qwen_ckpt, [h.wait(10) for h in handles])
    client.release_batch(dev, keys[1:])


def test_engine_delivers_every_expert_from_its_own_process(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice,
        qwen_ckpt: Path) -> None:
    truth = checkpoint_bytes(qwen_ckpt)
    keys = [ExpertKey("qwen-engine", layer, e) for layer in range(3) for e in range(6)]
    slots = [h.wait(10) for h in client.acquire_batch(engine_dev, keys)]
    for slot in slots:
        for role in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{slot.key.layer}.mlp.experts.{slot.key.expert}.{role}.weight"
            assert slot.raw(role).tobytes() == truth[name], (slot.key, role)
    pids = engine_pids(agent)
    assert len(pids) == 1 and pids[0] not in (os.getpid(), agent.proc.pid)
    for k in keys:
        client.release(engine_dev, k)
    # Released slots are READY and idle: the next acquire is a hit, same bytes.
    again = client.acquire(engine_dev, keys[3]).wait(5)
    np.testing.assert_array_equal(again.blob, slots[3].blob)


def test_engine_death_fails_in_flight_and_is_restarted(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice,
        qwen_ckpt: Path) -> None:
    truth = checkpoint_bytes(qwen_ckpt)
    client.acquire(engine_dev, ExpertKey("qwen-engine", 0, 0)).wait(10)  # engine running
    (pid,) = engine_pids(agent)
    restarts = metric(agent, "dpu_agent_engine_restarts_total")
    os.kill(pid, signal.SIGSTOP)  # the engine stops taking work ...
    stuck = client.acquire(engine_dev, ExpertKey("qwen-engine", 1, 1))
    time.sleep(0.2)
    assert not stuck.done()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # ... and dies
    with pytest.raises(TransferFailed, match="CANCELLED"):
        stuck.wait(5)
    assert time.monotonic() - t0 < 1.5  # noticed within a sweep (0.5 s) or two
    deadline = time.monotonic() + 10
    while not [p for p in engine_pids(agent) if p != pid] and time.monotonic() < deadline:
        time.sleep(0.05)
    # A fresh engine serves the same expert again, verified byte for byte.
    slot = client.acquire(engine_dev, ExpertKey("qwen-engine", 1, 1)).wait(10)
    name = "model.layers.1.mlp.experts.1.down_proj.weight"
    assert slot.raw("down_proj").tobytes() == truth[name]
    assert metric(agent, "dpu_agent_engine_restarts_total") == restarts + 1


@pytest.mark.parametrize("given", ["at start", "by SIGHUP"])
def test_a_hung_engine_is_killed_and_its_transfers_fail(qwen_ckpt: Path, given: str) -> None:
    """An engine that stops (SIGSTOP) without dying holds its transfers past the transfer
    timeout: the agent kills it rather than cancel them under it (a late SIGNAL or copy could
    land in a slot given to another delivery), the waiters get CANCELLED, and a fresh engine
    serves the same expert, verified. The timeout is live: set by SIGHUP (from 30 s), it
    applies to the data plane at once."""
    base = '[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
    one_second = base + "[transfer]\ntimeout_seconds = 1\n"
    truth = checkpoint_bytes(qwen_ckpt)
    with (AgentProcess(one_second if given == "at start" else base) as agent,
          AgentClient(agent.address) as client):
        if given == "by SIGHUP":
            agent.config_path.write_text(one_second)
            agent.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "transfer.timeout_seconds: 30 -> 1" not in agent.log():
                assert time.monotonic() < deadline, agent.log()
                time.sleep(0.05)
        model = client.load_model(str(qwen_ckpt), "qwen-hung")
        dev = client.register_device(CpuReferenceDevice(3),
                                     [SlotPoolSpec(model.expert_bytes, 4)], delivery="engine")
        client.acquire(dev, ExpertKey("qwen-hung", 0, 0)).wait(10)
        (pid,) = engine_pids(agent)
        os.kill(pid, signal.SIGSTOP)
        stuck = client.acquire(dev, ExpertKey("qwen-hung", 1, 1))
        with pytest.raises(TransferFailed, match="CANCELLED"):
            stuck.wait(5)
        deadline = time.monotonic() + 10
        while not [p for p in engine_pids(agent) if p != pid] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat"
                                                                ).read_text().split()[2]
        slot = client.acquire(dev, ExpertKey("qwen-hung", 1, 1)).wait(10)
        name = "model.layers.1.mlp.experts.1.down_proj.weight"
        assert slot.raw("down_proj").tobytes() == truth[name]
        assert metric(agent, "dpu_agent_engine_restarts_total") == 1


def test_the_check_starts_at_the_post_and_outlives_a_slow_delivery(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice,
        qwen_ckpt: Path) -> None:
    """The acquire starts the slot's check on the device with its post, and the check waits
    there for the grant and the bytes: with the engine stopped, a granted handle's check
    publishes READY by itself once the engine resumes (nobody waits on the handle). A check
    that gave up first (it waits at most the client's RPC timeout, here made short while the
    engine was stopped) is started again when the handle finds the bytes landed unchecked."""
    truth = checkpoint_bytes(qwen_ckpt)
    client.acquire(engine_dev, ExpertKey("qwen-engine", 0, 0)).wait(10)  # engine running
    (pid,) = engine_pids(agent)

    def word(h: object) -> tuple[int, abi.SlotState]:
        return split_word(engine_dev.channel.word(int(h._reply["state_index"])))

    def until(h: object, state: abi.SlotState) -> None:
        deadline = time.monotonic() + 10
        while word(h)[1] != state:
            assert time.monotonic() < deadline, (word(h), state)
            time.sleep(0.001)

    def verified(handle: object, key: ExpertKey) -> None:
        slot = handle.wait(10)
        name = f"model.layers.{key.layer}.mlp.experts.{key.expert}.up_proj.weight"
        assert slot.raw("up_proj").tobytes() == truth[name]
        assert word(handle)[1] == abi.SlotState.READY
        client.release(engine_dev, key)

    started, gave_up = ExpertKey("qwen-engine", 2, 4), ExpertKey("qwen-engine", 1, 5)
    os.kill(pid, signal.SIGSTOP)
    try:
        first = client.acquire(engine_dev, started)
        first.wait_granted(5)
        assert not first.done()  # granted, its check started, no bytes yet
    finally:
        os.kill(pid, signal.SIGCONT)
    until(first, abi.SlotState.READY)  # the check started at the grant gave the verdict
    verified(first, started)

    os.kill(pid, signal.SIGSTOP)
    rpc_timeout, client.rpc_timeout = client.rpc_timeout, 0.3
    try:
        second = client.acquire(engine_dev, gave_up)
        client.rpc_timeout = rpc_timeout
        with pytest.raises(TimeoutError):
            second.wait(0.3)  # the check it started gives up too
        deadline = time.monotonic() + 10
        while not second._ticket.done():  # its own clock started a moment later
            assert time.monotonic() < deadline, "the check never gave up"
            time.sleep(0.01)
    finally:
        client.rpc_timeout = rpc_timeout
        os.kill(pid, signal.SIGCONT)
    until(second, abi.SlotState.LANDED)
    time.sleep(0.2)
    assert word(second)[1] == abi.SlotState.LANDED  # nothing checks it until it is waited on
    verified(second, gave_up)


def test_an_acquire_waits_for_an_unheld_slot_still_landing(
        agent: AgentProcess, client: AgentClient, qwen_ckpt: Path) -> None:
    """The pool's one slot has a delivery in flight that nobody holds (a prefetch; likewise an
    acquire released before the agent saw its copy complete, which the engine's own LANDED
    makes possible): an acquire of another expert is not refused as if every slot were held;
    it waits in the agent's loop (parked, counted) for the slot to land, evicts it and gets
    the right bytes."""
    truth = checkpoint_bytes(qwen_ckpt)
    parked = metric(agent, "dpu_agent_dataplane_parked_requests_total")
    model = client.load_model(str(qwen_ckpt), "qwen-one")
    dev = client.register_device(CpuReferenceDevice(5), [SlotPoolSpec(model.expert_bytes, 1)],
                                 delivery="engine")
    first, landing, wanted = (ExpertKey("qwen-one", 0, e) for e in (0, 1, 2))
    client.acquire(dev, first).wait(10)
    client.release(dev, first, wait=True)
    generation = split_word(dev.channel.word(0))[0]
    (pid,) = engine_pids(agent)
    os.kill(pid, signal.SIGSTOP)
    try:
        client.prefetch(dev, [landing])
        deadline = time.monotonic() + 10
        # A newer generation, not generation + 1: where ``landing`` must first be read into
        # the arena (whether it is depends on what earlier tests left there), the prefetch's
        # first try frees the slot and the one after the fill allocates it again.
        while not (split_word(dev.channel.word(0))[0] > generation
                   and split_word(dev.channel.word(0))[1] == abi.SlotState.FILLING):
            assert time.monotonic() < deadline, split_word(dev.channel.word(0))
            time.sleep(0.005)
        taken = metric(agent, "dpu_agent_dataplane_requests_total")
        handle = client.acquire(dev, wanted)
        time.sleep(0.3)
        assert handle.refusal is None and not handle.done() and not handle.granted()
        assert metric(agent, "dpu_agent_dataplane_parked_requests_total") == parked + 1
    finally:
        os.kill(pid, signal.SIGCONT)
    slot = handle.wait(10)
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    assert slot.raw("gate_proj").tobytes() == truth[name]
    # One ring entry, counted once, though it was tried again once a slot landed.
    assert metric(agent, "dpu_agent_dataplane_requests_total") == taken + 1


def test_the_agent_times_how_long_requests_wait_and_take(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice) -> None:
    """Each entry carries the client's posting time: the agent's metrics sum how long entries
    waited to be taken and how long serving them took; a posting time that cannot be true
    (0, or in the future) is not counted."""
    names = ("dpu_agent_dataplane_timed_requests_total",
             "dpu_agent_dataplane_request_wait_seconds_total",
             "dpu_agent_dataplane_request_service_seconds_total")
    before = [metric(agent, n) for n in names]
    keys = [ExpertKey("qwen-engine", 0, e) for e in range(4)]
    for h in client.acquire_batch(engine_dev, keys):
        h.wait(10)
    client.release_batch(engine_dev, keys)
    index = client._index("qwen-engine")
    for posted in (0, 2**63):
        post_raw(engine_dev, {"request_id": 10**15 + posted % 7, "opcode": abi.RequestOp.PREFETCH,
                              "model": index, "layer": 0, "expert": 1, "posted_ns": posted})
    deadline = time.monotonic() + 5
    while metric(agent, names[0]) < before[0] + 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    timed, waited, served = (metric(agent, n) - b for n, b in zip(names, before, strict=True))
    # 4 acquires (their releases are the client's pins, nothing posted); the two implausible
    # prefetches not counted
    assert timed == 4
    assert 0 <= waited < 4 * 1.0 and 0 < served < 4 * 1.0, (waited, served)


def post_raw(dev: AttachedDevice, record: dict[str, int]) -> np.void:
    """Publish one hand-made request entry and wait for its reply."""
    ring = dev.channel.view.requests
    pos = ring.produced
    assert ring.push(record)
    deadline = time.monotonic() + 5
    while (reply := dev.channel.view.reply_at(pos)) is None:
        assert time.monotonic() < deadline, "no reply"
        time.sleep(0.001)
    return reply


def test_hostile_requests_are_refused_and_change_nothing(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice) -> None:
    key = ExpertKey("qwen-engine", 2, 4)
    slot = client.acquire(engine_dev, key).wait(10)
    before = slot.blob.copy()
    words = engine_dev.channel.view.words.copy()
    refused = metric(agent, "dpu_agent_dataplane_refused_requests_total")
    index = client._index("qwen-engine")
    base = {"request_id": 10**12, "opcode": abi.RequestOp.ACQUIRE, "model": index,
            "layer": 2, "expert": 4}
    cases = [
        ({"opcode": 77}, abi.RequestStatus.BAD_OPCODE, "opcode 77"),
        ({"model": 999}, abi.RequestStatus.NOT_FOUND, "model index 999"),
        ({"expert": 6}, abi.RequestStatus.NOT_FOUND, "not in model"),
        ({"layer": 2**31}, abi.RequestStatus.NOT_FOUND, "not in model"),
        ({"opcode": abi.RequestOp.RELEASE, "expert": 5}, abi.RequestStatus.FAILED_PRECONDITION,
         "not held"),
        ({"request_id": 1}, abi.RequestStatus.REQUEST_REUSED, "request id 1"),
    ]
    for j, (change, status, words_in_message) in enumerate(cases):
        reply = post_raw(engine_dev, {**base, "request_id": base["request_id"] + j, **change})
        assert abi.RequestStatus(int(reply["status"])) == status, change
        assert words_in_message in bytes(reply["message"]).decode(), reply["message"]
    np.testing.assert_array_equal(slot.blob, before)
    np.testing.assert_array_equal(engine_dev.channel.view.words, words)
    assert metric(agent, "dpu_agent_dataplane_refused_requests_total") == refused + len(cases)
    # The client's own ids continue above the hostile ones; the agent keeps serving.
    engine_dev.channel._next_id = base["request_id"] + 100
    client.release(engine_dev, key)
    assert client.acquire(engine_dev, ExpertKey("qwen-engine", 0, 2)).wait(10)


def test_refusals_reach_the_caller_with_their_status(
        client: AgentClient, engine_dev: AttachedDevice) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.release(engine_dev, ExpertKey("qwen-engine", 0, 0))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.prefetch(engine_dev, [ExpertKey("qwen-engine", 0, e) for e in range(3)]) == 3
    with pytest.raises(grpc.RpcError) as err:
        client.prefetch(engine_dev, [ExpertKey("qwen-engine", 9, 0)])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # A prefetched expert lands in its slot without any reference held, unchecked (LANDED):
    # the acquire that takes it checks it here (READY), and starts no delivery.
    view = engine_dev.channel.view
    deadline = time.monotonic() + 10
    while sum(split_word(int(w))[1] == abi.SlotState.LANDED for w in view.words) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle = client.acquire(engine_dev, ExpertKey("qwen-engine", 0, 1))
    handle.wait(10)
    assert handle.resident
    states = [split_word(int(w))[1] for w in view.words]
    assert states.count(abi.SlotState.READY) == 1 and states.count(abi.SlotState.LANDED) == 2
    client.release(engine_dev, ExpertKey("qwen-engine", 0, 1))


@pytest.mark.gpu
def test_engine_delivers_into_gpu_memory(client: AgentClient, qwen_ckpt: Path) -> None:
    """On a GPU: the engine process opens the pool by CUDA IPC handle, copies with the copy
    engine and checks the landed bytes; this process runs no kernel and no thread for it.
    Bytes in GPU memory equal the checkpoint's."""
    from host_client.cuda_device import CudaDevice

    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-engine-gpu")
    dev = client.register_device(CudaDevice(0), [SlotPoolSpec(model.expert_bytes, 18)],
                                 delivery="engine")
    assert dev.work is None and dev.completion is None
    keys = [ExpertKey("qwen-engine-gpu", layer, e) for layer in range(3) for e in range(6)]
    for slot in [h.wait(30) for h in client.acquire_batch(dev, keys)]:
        for role in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{slot.key.layer}.mlp.experts.{slot.key.expert}.{role}.weight"
            assert slot.raw(role).get().tobytes() == truth[name], (slot.key, role)


def test_overwritten_channel_header_stops_service_with_an_error(
        agent: AgentProcess, qwen_ckpt: Path) -> None:
    """A client that scribbles over its request ring's header loses the channel (BAD_RING in
    the header's fault word): its waits end with an error, never a hang; the agent and other
    sessions carry on."""
    with AgentClient(agent.address) as bad, AgentClient(agent.address) as good:
        for c in (bad, good):
            model = c.load_model(str(qwen_ckpt), "qwen-engine")
        devs = [c.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)],
                                  delivery="engine") for c in (bad, good)]
        devs[0].channel.view.requests.header["capacity"] = 4
        handle = bad.acquire(devs[0], ExpertKey("qwen-engine", 0, 1))
        with pytest.raises(grpc.RpcError) as err:
            handle.wait(5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "BAD_RING" in err.value.details()
        good.acquire(devs[1], ExpertKey("qwen-engine", 0, 1)).wait(10)


@pytest.mark.gpu
def test_compute_enqueued_behind_a_stream_wait_reads_the_landed_bytes(
        agent: AgentProcess, client: AgentClient, qwen_ckpt: Path) -> None:
    """A copy enqueued on a stream right after ``enqueue_wait``, while the expert is still in
    flight (the engine is stopped until every copy is enqueued), reads the expert's verified
    bytes once it lands."""
    import cupy as cp

    from host_client.cuda_device import CudaDevice

    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-wait")
    dev = client.register_device(CudaDevice(0), [SlotPoolSpec(model.expert_bytes, 5)],
                                 delivery="engine")
    first = client.acquire(dev, ExpertKey("qwen-wait", 0, 0)).wait(10)  # the engine runs
    (pid,) = engine_pids(agent)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # CuPy loads its copy kernel now: a module load behind a wait kernel that
        first.raw("down_proj").copy()  # polls for the stopped engine would never return
    stream.synchronize()
    outs = []
    os.kill(pid, signal.SIGSTOP)
    try:
        for e in range(4):
            handle = client.acquire(dev, ExpertKey("qwen-wait", 1, e))
            wait = handle.enqueue_wait(stream)
            with stream:
                outs.append((e, wait, wait.slot.raw("down_proj").copy()))
            assert not handle.done()  # enqueued before its bytes landed
    finally:
        os.kill(pid, signal.SIGCONT)
    for e, wait, out in outs:
        wait.check()
        assert out.get().tobytes() == truth[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]


def test_a_pool_naming_memory_the_agent_knows_is_refused(
        agent: AgentProcess, qwen_ckpt: Path) -> None:
    """The DMA engine writes whatever pool it is handed, so a DMA-engine pool may not be the
    arena, another session's pool, channel or ring (names are listed in /dev/shm), nor a
    session's own pool twice: PERMISSION_DENIED, nothing registered, the victim's bytes
    unchanged."""
    from dpu_offload.v1 import agent_pb2 as pb

    with AgentClient(agent.address) as victim, AgentClient(agent.address) as thief:
        model = victim.load_model(str(qwen_ckpt), "qwen-engine")
        vdev = victim.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)],
                                      delivery="engine")
        slot = victim.acquire(vdev, ExpertKey("qwen-engine", 0, 1)).wait(10)
        before = slot.blob.copy()
        victim_pool = vdev.device.export_shm(vdev.device.memory[next(iter(vdev.pools))])
        tdev = thief.stub.RegisterDevice(pb.RegisterDeviceRequest(
            session_id=thief.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=0,
            delivery=pb.DELIVERY_DMA_ENGINE), timeout=10)
        assert victim_pool
        for name in (victim_pool, victim.arena.shm_name, tdev.channel.shm_name):
            with pytest.raises(grpc.RpcError) as err:
                thief.stub.RegisterRegion(pb.RegisterRegionRequest(
                    session_id=thief.session_id, device_id=tdev.device_id,
                    kind=pb.REGION_KIND_SLOT_POOL, size_bytes=model.expert_bytes * 2,
                    slot_bytes=model.expert_bytes, slot_count=2, shm_name=name), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "not created for this session" in err.value.details()
        assert not [s for s in thief.status().sessions
                    if s.session_id == thief.session_id and s.regions]
        with pytest.raises(grpc.RpcError) as err:  # its own pool, a second time
            victim.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=victim.session_id, device_id=vdev.device_id,
                kind=pb.REGION_KIND_SLOT_POOL, size_bytes=model.expert_bytes * 2,
                slot_bytes=model.expert_bytes, slot_count=2, shm_name=victim_pool), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "already" in err.value.details()
        np.testing.assert_array_equal(slot.blob, before)


def test_describe_experts_is_bounded_and_checked(client: AgentClient, qwen_ckpt: Path) -> None:
    from dpu_offload.keys import MAX_KEYS_PER_CALL
    from dpu_offload.v1 import agent_pb2 as pb

    client.load_model(str(qwen_ckpt), "qwen-engine")
    good = ExpertKey("qwen-engine", 0, 0).to_proto()
    cases = [(client.session_id, [good] * (MAX_KEYS_PER_CALL + 1), "INVALID_ARGUMENT", "at most"),
             (client.session_id, [good, ExpertKey("qwen-engine", 0, 99).to_proto()],
              "NOT_FOUND", "not in model"),
             ("not-a-session", [good], "NOT_FOUND", "does not exist")]
    for sid, keys, code, words in cases:
        with pytest.raises(grpc.RpcError) as err:
            client.stub.DescribeExperts(pb.DescribeExpertsRequest(session_id=sid, keys=keys),
                                        timeout=10)
        assert err.value.code().name == code and words in err.value.details(), code
    got = client.stub.DescribeExperts(pb.DescribeExpertsRequest(
        session_id=client.session_id, keys=[good]), timeout=10)
    assert [t.name for t in got.manifests[0].tensors] == ["gate_proj", "up_proj", "down_proj"]


def test_scribbled_slot_states_mislead_only_their_own_client(
        agent: AgentProcess, client: AgentClient, engine_dev: AttachedDevice,
        qwen_ckpt: Path) -> None:
    """The slot-state table is the client's to write verdicts into; garbage there (unknown
    states, generations the agent never gave) is no verdict: the agent keeps its own view,
    counts no mismatch, keeps serving, and its next publication for a slot overwrites it."""
    truth = checkpoint_bytes(qwen_ckpt)
    key = ExpertKey("qwen-engine", 1, 3)
    client.acquire(engine_dev, key).wait(10)
    client.release(engine_dev, key)
    failures = metric(agent, "dpu_agent_checksum_failures_total")
    states = engine_dev.channel.view.states
    rng = np.random.default_rng(5)
    states["word"] = (rng.integers(1 << 40, 1 << 62, states.size, dtype=np.uint64) << 8) | \
        rng.integers(0, 256, states.size, dtype=np.uint64)
    states["status"] = rng.integers(0, 1 << 32, states.size, dtype=np.uint64).astype(np.uint32)
    with AgentClient(agent.address) as other:
        other.load_model(str(qwen_ckpt), "qwen-engine")
        dev = other.register_device(CpuReferenceDevice(3), [SlotPoolSpec(
            engine_dev.pools[next(iter(engine_dev.pools))].slot_bytes, 2)], delivery="engine")
        slot = other.acquire(dev, key).wait(10)
        assert slot.raw("up_proj").tobytes() == truth["model.layers.1.mlp.experts.3.up_proj.weight"]
    fresh = ExpertKey("qwen-engine", 2, 0)  # a new delivery publishes over the garbage
    slot = client.acquire(engine_dev, fresh).wait(10)
    assert slot.raw("down_proj").tobytes() == truth["model.layers.2.mlp.experts.0.down_proj.weight"]
    client.release(engine_dev, fresh)
    assert metric(agent, "dpu_agent_checksum_failures_total") == failures
