"""The scheduler's ordering and bounds, and placements applied make-before-break through a
real agent with two CPU reference devices."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from dpu_agent.planning.scheduler import Priority, Scheduler
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes, place_and_close


def test_scheduler_orders_by_class_and_bounds_background_per_link() -> None:
    sched = Scheduler(link_concurrency=2)
    started: list[str] = []

    def job(name: str, background: bool = True):
        def start() -> bool:
            started.append(name)
            return background
        return start

    sched.submit("a", Priority.REBALANCE, job("r1"))
    sched.submit("a", Priority.REBALANCE, job("r2"))
    sched.submit("a", Priority.REBALANCE, job("r3"))      # waits: 2 in flight on link a
    sched.submit("a", Priority.PREFETCH, job("p1"), order=5)
    sched.submit("a", Priority.PREFETCH, job("p0"), order=1)
    sched.submit("b", Priority.REBALANCE, job("b1"))      # another link is not held back
    acq = sched.submit("a", Priority.ACQUIRE, job("acq", background=False))
    assert started == ["r1", "r2", "b1", "acq"] and acq.cancelled is False
    assert sched.waiting("a") == 3
    cancelled = sched.cancel(lambda j: j.priority == Priority.REBALANCE)
    assert cancelled == 1
    sched.finished("a")
    sched.finished("a")
    assert started == ["r1", "r2", "b1", "acq", "p0", "p1"]  # prefetch in layer order
    assert sched.waiting() == 0


@pytest.fixture
def two_devices(qwen_ckpt: Path):
    with AgentProcess('[arena]\nbytes = "64MiB"\n[transfer]\ntimeout_seconds = 5\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qp")
        devs = [client.register_device(CpuReferenceDevice(ordinal=i),
                                       [SlotPoolSpec(model.expert_bytes, 18)]) for i in range(2)]
        yield client, model, devs


def _held_ready(client: AgentClient, dev, key: ExpertKey) -> bool:
    (h,) = client.acquire_batch(dev, [key])  # returns once granted: a hit is READY already
    ready = h.done()
    h.wait(10)
    client.release(dev, key)
    return ready


def test_apply_then_move_make_before_break(two_devices, qwen_ckpt: Path) -> None:
    client, model, (a, b) = two_devices
    truth = checkpoint_bytes(qwen_ckpt)
    layers, experts = len(model.moe_layers), model.experts_per_layer
    first = [[[a.device_id] for _ in range(experts)] for _ in range(layers)]
    r = client.apply_placement("qp", first)
    assert r.copies_to_add == layers * experts
    p = client.wait_placement(r.placement_id)
    assert (p.done, p.failed) == (layers * experts, 0)
    key = ExpertKey("qp", model.moe_layers[1], 3)
    assert _held_ready(client, a, key)
    # Move layer position 1 to device b while b's consumer is stopped: the new copies cannot
    # complete, so the old ones on a must keep serving (and stay after the copies fail).
    b.device.stop()
    second = [row[:] for row in first]
    second[1] = [[b.device_id] for _ in range(experts)]
    r2 = client.apply_placement("qp", second)
    assert r2.copies_to_add == experts
    assert _held_ready(client, a, key), "old copy dropped before the new one was verified"
    p2 = client.wait_placement(r2.placement_id)
    assert p2.failed == experts and p2.dropped == 0
    assert _held_ready(client, a, key)
    slot = client.acquire(a, key).wait(5)
    name = f"model.layers.{key.layer}.mlp.experts.3.gate_proj.weight"
    assert slot.raw("gate_proj").tobytes() == truth[name]
    client.release(a, key)


def test_move_completes_and_releases_old_copies(two_devices) -> None:
    client, model, (a, b) = two_devices
    layers, experts = len(model.moe_layers), model.experts_per_layer
    first = [[[a.device_id] for _ in range(experts)] for _ in range(layers)]
    client.wait_placement(client.apply_placement("qp", first).placement_id)
    second = [[[b.device_id] if e % 2 else [a.device_id, b.device_id] for e in range(experts)]
              for _ in range(layers)]
    r = client.apply_placement("qp", second)
    p = client.wait_placement(r.placement_id)
    assert p.done == layers * experts and p.failed == 0
    deadline = time.monotonic() + 5
    while client.placement_progress(r.placement_id).dropped < layers * experts // 2:
        assert time.monotonic() < deadline, client.placement_progress(r.placement_id)
        time.sleep(0.02)
    for layer in model.moe_layers:
        assert _held_ready(client, b, ExpertKey("qp", layer, 1))


@pytest.mark.parametrize("mutate,code,msg", [
    (lambda p, a, b: p.pop(), grpc.StatusCode.INVALID_ARGUMENT, "MoE layers"),
    (lambda p, a, b: p[0][0].append(77), grpc.StatusCode.FAILED_PRECONDITION, "device 77"),
    (lambda p, a, b: p[0].__setitem__(0, []), grpc.StatusCode.INVALID_ARGUMENT, "nowhere"),
    # refused by the client before the call (no protobuf message can carry them)
    (lambda p, a, b: p[0].__setitem__(0, 3), grpc.StatusCode.INVALID_ARGUMENT,
     "assignment[0][0]: a list of device ids, got 3"),
    (lambda p, a, b: p[0][1].append(-1), grpc.StatusCode.INVALID_ARGUMENT,
     "assignment[0][1]: a list of device ids"),
    (lambda p, a, b: p.__setitem__(1, None), grpc.StatusCode.INVALID_ARGUMENT,
     "assignment[1]: a list of experts' device lists"),
])
def test_bad_placements_are_refused(two_devices, mutate, code, msg: str) -> None:
    client, model, (a, b) = two_devices
    placement = [[[a.device_id] for _ in range(model.experts_per_layer)]
                 for _ in model.moe_layers]
    mutate(placement, a, b)
    with pytest.raises(grpc.RpcError) as err:
        client.apply_placement("qp", placement)
    assert err.value.code() == code and msg in err.value.details()


def test_a_placement_naming_another_sessions_device_is_permission_denied(
        two_devices, qwen_ckpt: Path) -> None:
    """As every other RPC answers for another session's device (it once said
    INVALID_ARGUMENT here), and the other session's device is untouched."""
    client, model, (a, _) = two_devices
    with AgentClient(client.address) as other:
        other.load_model(str(qwen_ckpt), "qp")
        theirs = other.register_device(CpuReferenceDevice(ordinal=7),
                                       [SlotPoolSpec(model.expert_bytes, 4)])
        placement = [[[a.device_id, theirs.device_id]
                      for _ in range(model.experts_per_layer)] for _ in model.moe_layers]
        with pytest.raises(grpc.RpcError) as err:
            client.apply_placement("qp", placement)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        st = next(s for s in other.status().sessions if s.session_id == other.session_id)
        assert st.slots_ready == 0 and st.slots_held == 0


def test_over_capacity_placement_refused(qwen_ckpt: Path) -> None:
    with AgentProcess() as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qc")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        placement = [[[dev.device_id] for _ in range(model.experts_per_layer)]
                     for _ in model.moe_layers]
        with pytest.raises(grpc.RpcError) as err:
            client.apply_placement("qc", placement)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "18 experts but has 4 slots" in err.value.details()


def test_prefetch_and_routing_driven_prefetch_turn_acquires_into_hits(two_devices) -> None:
    client, model, (a, _) = two_devices
    keys = [ExpertKey("qp", model.moe_layers[0], e) for e in range(3)]
    assert client.prefetch(a, keys) == 3
    deadline = time.monotonic() + 10
    while client.status().transfers_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.05)
    assert all(_held_ready(client, a, k) for k in keys)
    # Report layer 0 routing; the agent prefetches layer 1's most selected experts.
    l0, l1 = model.moe_layers[0], model.moe_layers[1]
    client.report_routing("qp", [(l1, {4: 5, 5: 2}), (l0, {0: 1})], prefetch_to=a,
                          prefetch_top_k=2)
    deadline = time.monotonic() + 10
    while not all(_held_ready(client, a, ExpertKey("qp", l1, e)) for e in (4, 5)):
        assert time.monotonic() < deadline, "routing-driven prefetch did not land"
        time.sleep(0.05)


def test_rebalance_from_routing_statistics(two_devices) -> None:
    client, model, _ = two_devices
    with pytest.raises(grpc.RpcError) as err:
        client.rebalance("qp")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    steps = [(layer, {e: (6 - e) * 10}) for layer in model.moe_layers for e in range(6)]
    client.report_routing("qp", steps)
    r = client.rebalance("qp", replicas=2)
    assert r.max_load_ratio >= 1.0 and r.copies_to_add == len(model.moe_layers) * 8
    p = client.wait_placement(r.placement_id)
    assert p.failed == 0
    again = client.rebalance("qp", replicas=2)
    assert again.bytes_moved == 0 and again.copies_to_add == 0


def test_expertctl_rebalance(two_devices) -> None:
    import subprocess
    import sys

    client, model, _ = two_devices
    client.report_routing("qp", [(layer, {0: 3}) for layer in model.moe_layers])
    cmd = [sys.executable, "-m", "host_client.cli", "rebalance", "--agent", client.address,
           "--session", client.session_id, "--session-token", client.session_token,
           "--model", "qp", "--replicas", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0 and "copies to add" in out.stdout, out.stderr
    bad = subprocess.run([*cmd[:-4], "--model", "nope"], capture_output=True, text=True)
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr


def test_a_session_closed_while_its_placement_fills_leaves_no_transfer(qwen_ckpt: Path) -> None:
    """A placement's background fills may start a delivery after the closing session's
    transfers were cancelled: that one is cancelled too (it once stayed in flight until the
    transfer timeout, in about one close in three)."""
    with AgentProcess('[arena]\nbytes = "64MiB"\n') as agent, \
            AgentClient(agent.address) as observer:
        for _ in range(6):
            place_and_close(agent.address, qwen_ckpt, "closing")
            deadline = time.monotonic() + 5
            while (left := observer.status().transfers_in_flight) and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            assert left == 0, f"{left} transfers still in flight 5 s after the session closed"
