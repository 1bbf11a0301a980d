"""The packet rings' doorbell FIFOs (dpu_offload.port_bell): a ring's wake reaches a consumer
asleep in another process, no wake is lost to a busy consumer, a planted file is refused by
the NIC, and a dead creator's FIFO is swept with its segment."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from dpu_offload import abi
from dpu_offload.port_bell import PortBell, bell_path
from dpu_offload.shm import SHM_DIR, SharedBuffer, sweep_stale, unique_name
from host_client.memory import SharedRing
from nic.ports import Port


def _wait_in_child(name: str, result: mp.Queue) -> None:
    bell = PortBell.open(name)
    assert bell is not None
    result.put("waiting")
    t0 = time.monotonic()
    woke = bell.wait(5.0)
    result.put((woke, time.monotonic() - t0))


def test_a_ring_wakes_a_consumer_asleep_in_another_process() -> None:
    ring = SharedRing(abi.RingKind.TX_PACKET, 8, 256)
    try:
        assert ring.bell is not None and os.path.exists(bell_path(ring.name))
        result: mp.Queue = mp.get_context("spawn").Queue()
        child = mp.get_context("spawn").Process(target=_wait_in_child, args=(ring.name, result))
        child.start()
        # Its start (a spawned interpreter) can take a second on a loaded machine: ring
        # once it is about to wait, and a while after, so that it is asleep.
        assert result.get(timeout=30) == "waiting"
        time.sleep(1.0)
        ring.bell.ring()
        woke, slept = result.get(timeout=10)
        child.join(5)
        assert woke and 0.5 < slept < 4.0
    finally:
        ring.close()
    assert not os.path.exists(bell_path(ring.name))


def test_wakes_rung_while_the_consumer_was_busy_are_kept_then_consumed() -> None:
    ring = SharedRing(abi.RingKind.RX_PACKET, 8, 256)
    try:
        consumer = PortBell.open(ring.name)
        assert ring.bell is not None and consumer is not None
        assert not consumer.wait(0.01)
        for _ in range(3):
            ring.bell.ring()
        assert consumer.wait(0.0)        # level-triggered: still pending after the rings
        assert not consumer.wait(0.01)   # and consumed by that wait
        for _ in range(70_000):          # more than the FIFO holds: rings never block
            ring.bell.ring()
        assert consumer.wait(0.0) and not consumer.wait(0.0)
        consumer.close()
    finally:
        ring.close()


def test_only_packet_rings_have_doorbells_and_the_header_says_who_rings() -> None:
    work = SharedRing(abi.RingKind.WORK, 8)
    tx = SharedRing(abi.RingKind.TX_PACKET, 8, 256)
    try:
        assert work.bell is None
        assert tx.bell is not None and not tx.ring.doorbell
        tx.ring.doorbell = True
        assert int(tx.ring.header["doorbell"]) == 1
    finally:
        work.close()
        tx.close()


@pytest.mark.parametrize("plant", ["file", "symlink", "open_fifo"])
def test_the_nic_refuses_a_port_whose_doorbell_is_not_the_owners_fifo(plant: str) -> None:
    rx = SharedRing(abi.RingKind.RX_PACKET, 8, 256)
    name = unique_name("dpu-ring-tx_packet")
    path = bell_path(name)
    if plant == "file":
        open(path, "w").close()
    elif plant == "symlink":
        os.symlink(os.path.join(SHM_DIR, rx.name), path)
    else:
        os.mkfifo(path, 0o600)
        os.chmod(path, 0o666)  # anyone could ring it, or read the wakes
    tx = SharedBuffer(name, abi.ring_bytes(8, 256), create=True)
    try:
        from dpu_offload.ring import Ring

        Ring.format(tx.array, abi.RingKind.TX_PACKET, 8, 256)
        with pytest.raises(ValueError, match="doorbell") as err:
            Port(0, rx.name, name)
        assert path in str(err.value)
    finally:
        os.unlink(path)
        tx.close()
        tx.unlink()
        rx.close()


def test_a_port_without_doorbells_is_polled() -> None:
    rx = SharedRing(abi.RingKind.RX_PACKET, 8, 256)
    tx = SharedRing(abi.RingKind.TX_PACKET, 8, 256)
    try:
        for ring in (rx, tx):
            assert ring.bell is not None
            ring.bell.unlink()  # as where FIFOs cannot be made
        port = Port(0, rx.name, tx.name)
        assert port.rx_bell is None and port.tx_bell is None and not port.tx_rings
        tx.ring.doorbell = True  # a promise without a FIFO is not believed
        assert not port.tx_rings
        port.close()
    finally:
        rx.close()
        tx.close()


def _exit_at_once() -> None:
    pass


def test_a_dead_creators_doorbell_is_swept_with_its_segment() -> None:
    child = mp.get_context("spawn").Process(target=_exit_at_once)
    child.start()
    child.join(10)
    name = f"dpu-ring-rx_packet-{child.pid}-{'ab' * 16}"
    os.mkfifo(bell_path(name), 0o600)
    SharedBuffer(name, 4096, create=True).close()
    removed = sweep_stale(("dpu-ring-rx_packet",))
    assert {name, os.path.basename(bell_path(name))} <= set(removed)
    assert not os.path.exists(bell_path(name))


def test_serve_activations_refuses_a_planted_doorbell_by_name(tmp_path) -> None:
    import grpc

    from dpu_offload.v1 import agent_pb2 as pb
    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
    from host_client.checkpoints import CheckpointSpec, make_checkpoint
    from host_client.launcher import AgentProcess

    root = make_checkpoint(tmp_path / "c", CheckpointSpec("qwen3-moe", layers=1, experts=4,
                                                          hidden=64, intermediate=32))
    with AgentProcess('[activations]\nlisten_address = "127.0.0.1:0"\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(root), "m")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        path = bell_path(dev.tx.name)
        os.unlink(path)
        open(path, "w").close()
        with pytest.raises(grpc.RpcError) as err:
            client.stub.ServeActivations(pb.ServeActivationsRequest(
                session_id=client.session_id, device_id=dev.device_id, serve=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert path in err.value.details() and "not a FIFO" in err.value.details()


@pytest.mark.parametrize(("capacity", "entry_size"), [(6, 256), (8, 100)])
def test_a_refused_ring_leaves_neither_segment_nor_doorbell(capacity: int,
                                                            entry_size: int) -> None:
    from dpu_offload.ring import RingError

    before = set(os.listdir(SHM_DIR))
    with pytest.raises(RingError):
        SharedRing(abi.RingKind.RX_PACKET, capacity, entry_size)
    assert set(os.listdir(SHM_DIR)) - before == set()
