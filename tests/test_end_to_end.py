"""The thin slice through the whole system: checkpoint -> agent process -> rings -> CPU
reference device -> slots, with bytes checked against the checkpoint files."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from dpu_offload import abi
from dpu_offload.keys import ExpertKey
from dpu_offload.shm import session_name
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, AgentUnavailable, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes


@pytest.fixture
def client(agent: AgentProcess) -> AgentClient:
    c = AgentClient(agent.address, client_name="pytest")
    yield c
    c.close()


def test_every_expert_lands_byte_for_byte(client: AgentClient, qwen_ckpt: Path) -> None:
    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-e2e")
    assert model.architecture == "qwen3_moe" and list(model.moe_layers) == [0, 1, 2]
    keys = [ExpertKey("qwen-e2e", layer, e) for layer in model.moe_layers for e in range(6)]
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)])
    handles = [client.acquire(dev, k) for k in keys]
    slots = [h.wait(10) for h in handles]
    assert [h.resident for h in handles] == [False] * len(keys)  # each began a delivery
    for slot in slots:
        for role in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.layers.{slot.key.layer}.mlp.experts.{slot.key.expert}.{role}.weight"
            assert slot.raw(role).tobytes() == truth[name], (slot.key, role)
        assert slot.tensor("down_proj").shape == (256, 192)
    # A second acquire of a resident expert is a hit: READY at once, same bytes.
    again = client.acquire(dev, keys[0])
    assert again.wait(1) and again.resident
    assert again.wait(1).raw("up_proj").tobytes() == slots[0].raw("up_proj").tobytes()
    np.testing.assert_array_equal(again.wait(1).blob, slots[0].blob)
    st = client.status()
    assert st.sessions and any(s.slots_ready == 18 for s in st.sessions)


def test_pools_past_4096_slots_land_byte_for_byte(client: AgentClient, qwen_ckpt: Path
                                                  ) -> None:
    """A device's pools may hold every expert of gpt-oss-120b (4,608) or DeepSeek-V3 (14,848):
    behind a pool of 5,000 small slots, the experts' pool's slot-state entries lie past the
    4,096 the channel had before ABI 4, and its deliveries land and are checked there."""
    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-wide")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(256, 5000),
                                                        SlotPoolSpec(model.expert_bytes, 4)])
    keys = [ExpertKey("qwen-wide", model.moe_layers[0], e) for e in range(4)]
    handles = [client.acquire(dev, k) for k in keys]
    for handle in handles:
        slot = handle.wait(10)
        assert int(handle._reply["state_index"]) >= 5000
        name = f"model.layers.{slot.key.layer}.mlp.experts.{slot.key.expert}.down_proj.weight"
        assert slot.raw("down_proj").tobytes() == truth[name]


def test_slot_reuse_evicts_idle_experts(client: AgentClient, qwen_ckpt: Path) -> None:
    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-evict")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
    views: dict[tuple[int, int], int] = {}
    for e in range(6):
        key = ExpertKey("qwen-evict", 1, e)
        handle = client.acquire(dev, key)
        slot = handle.wait(10)
        assert handle.resident is False  # a new generation of one of two slots
        name = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
        assert slot.raw("up_proj").tobytes() == truth[name]
        # A slot's tensor views are made once and serve each expert it holds in turn.
        up = slot.tensor("up_proj")
        assert up.tobytes() == truth[name] and slot.key == key
        assert views.setdefault(handle.where, id(up)) == id(up)
        client.release(dev, key)
    assert len(views) == 2
    # Two held experts fill the pool: a third is refused, and nothing changes.
    held = [ExpertKey("qwen-evict", 2, e) for e in range(2)]
    for k in held:
        client.acquire(dev, k).wait(10)
    with pytest.raises(grpc.RpcError) as err:
        client.acquire(dev, ExpertKey("qwen-evict", 2, 5)).wait(10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A batch refused part-way gives back what it had taken: the key it got a slot for is not
    # held afterwards, and that slot serves the next request. Layer 0's experts are arena
    # misses (acquired on a worker thread), layer 1's arena hits (on the agent's event loop).
    client.release(dev, held[1])
    for layer in (0, 1):
        with pytest.raises(grpc.RpcError) as err:
            client.acquire_batch(dev, [ExpertKey("qwen-evict", layer, e) for e in (0, 1)])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as err:
            client.release(dev, ExpertKey("qwen-evict", layer, 0))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # The refused batch's slot serves the next request once its delivery has ended.
        deadline = time.monotonic() + 10
        while True:
            try:
                client.acquire(dev, ExpertKey("qwen-evict", layer, 2)).wait(10)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline
                time.sleep(0.01)
        client.release(dev, ExpertKey("qwen-evict", layer, 2))


def test_a_slot_shares_its_views_only_with_an_expert_laid_out_alike() -> None:
    """``ExpertSlot.holding``: the next expert in the same place, described by another
    manifest of the same layout, gets the same view objects (over its own bytes: the blob is
    the slot's); a manifest whose tensors lie otherwise gets none (its slot makes its own)."""
    from host_client.memory import ExpertSlot

    def manifest(expert: int, shape: tuple[int, int]) -> pb.ExpertManifest:
        return pb.ExpertManifest(key=pb.ExpertKey(model="m", layer=0, expert=expert),
                                 blob_bytes=512, tensors=[pb.TensorEntry(
                                     name="up_proj", dtype="BF16", shape=list(shape),
                                     offset=0, nbytes=512)])

    blob = np.arange(512, dtype=np.uint8)
    first = ExpertSlot(ExpertKey("m", 0, 0), blob, manifest(0, (16, 16)))
    view = first.tensor("up_proj")
    alike = first.holding(ExpertKey("m", 0, 1), manifest(1, (16, 16)))
    assert alike is not None and alike.key == ExpertKey("m", 0, 1)
    assert alike.tensor("up_proj") is view
    blob[:2] = (7, 9)
    assert int(alike.tensor("up_proj")[0, 0]) == 7 | 9 << 8
    assert first.holding(ExpertKey("m", 0, 2), manifest(2, (8, 32))) is None


def test_the_layout_memo_is_bounded_and_starts_again_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``blob_layout`` remembers at most ``MAX_LAYOUTS`` manifests and their distinct layouts;
    once full both start again, and a layout made after that is equal to, not the same object
    as, one made before (a slot then builds its views anew instead of sharing them)."""
    from host_client import memory

    monkeypatch.setattr(memory, "MAX_LAYOUTS", 4)
    monkeypatch.setattr(memory, "_LAYOUTS", {})
    monkeypatch.setattr(memory, "_INTERNED", {})

    def manifest(width: int) -> pb.ExpertManifest:
        return pb.ExpertManifest(blob_bytes=2 * width, tensors=[pb.TensorEntry(
            name="up_proj", dtype="BF16", shape=[width], offset=0, nbytes=2 * width)])

    kept = [manifest(16 * (1 + i)) for i in range(12)]
    first = memory.blob_layout(kept[0])
    assert memory.blob_layout(manifest(16)) is first  # another manifest, the same layout
    for m in kept[1:]:
        memory.blob_layout(m)
        assert len(memory._LAYOUTS) <= 4 and len(memory._INTERNED) <= 4
    again = memory.blob_layout(manifest(16))
    assert again == first and again is not first


def test_a_batch_posted_without_waiting_is_granted_in_turn(client: AgentClient,
                                                          qwen_ckpt: Path) -> None:
    """``acquire_batch(wait=False)`` returns without waiting for the agent: each handle then
    resolves on its own (its checkpoint bytes, through the DMA engine), the one the agent
    refuses (two slots, three experts) raises its own ResourceExhausted, and
    ``release_granted`` gives back the two granted ones, whose slots serve the next batch."""
    from host_client import ResourceExhausted

    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-nowait")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)],
                                 delivery="engine")
    handles = client.acquire_batch(dev, [ExpertKey("qwen-nowait", 1, e) for e in range(3)],
                                   wait=False)
    for e, h in enumerate(handles[:2]):
        assert h.wait(10).raw("up_proj").tobytes() == \
            truth[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
    with pytest.raises(ResourceExhausted, match="held"):
        handles[2].wait(10)
    assert client.release_granted(dev, handles) == 2
    keys = [ExpertKey("qwen-nowait", 2, e) for e in (0, 1)]
    deadline = time.monotonic() + 5  # a slot that just landed is kept through its check grace
    while True:
        try:
            slots = [h.wait(10) for h in client.acquire_batch(dev, keys)]
            break
        except ResourceExhausted:
            assert time.monotonic() < deadline, "the released slots never served a batch"
            time.sleep(0.2)
    assert [s.raw("down_proj").tobytes() for s in slots] == [
        truth[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] for e in (0, 1)]
    client.release_batch(dev, keys)


@pytest.mark.parametrize("mutate,code", [
    (lambda r: r.key.__setattr__("model", "nope"), grpc.StatusCode.NOT_FOUND),
    (lambda r: r.key.__setattr__("expert", 99), grpc.StatusCode.NOT_FOUND),
    (lambda r: r.key.__setattr__("layer", 7), grpc.StatusCode.NOT_FOUND),
    (lambda r: r.key.__setattr__("model", ""), grpc.StatusCode.INVALID_ARGUMENT),
    (lambda r: r.__setattr__("device_id", 42), grpc.StatusCode.FAILED_PRECONDITION),
    (lambda r: r.__setattr__("session_id", "feedface"), grpc.StatusCode.NOT_FOUND),
])
def test_bad_acquire_gets_specific_status(client: AgentClient, qwen_ckpt: Path, mutate,
                                          code: grpc.StatusCode) -> None:
    client.load_model(str(qwen_ckpt), "qwen-bad")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(1 << 20, 2)])
    req = pb.AcquireRequest(session_id=client.session_id, device_id=dev.device_id,
                            key=pb.ExpertKey(model="qwen-bad", layer=0, expert=0))
    mutate(req)
    before = client.status()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Acquire(req)
    assert err.value.code() == code, err.value.details()
    assert err.value.details()
    after = client.status()
    assert (after.cache_misses, after.transfers_in_flight) == (before.cache_misses,
                                                               before.transfers_in_flight)


def test_load_model_refusals(client: AgentClient, tmp_path: Path, qwen_ckpt: Path) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.load_model(str(tmp_path / "missing"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(grpc.RpcError) as err:
        client.load_model(str(tmp_path), "bert")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bert" in err.value.details()
    names = [m.model for m in client.status().models]
    assert "bert" not in names


def test_unregistered_ring_and_pool_refusals(client: AgentClient) -> None:
    dev = client.stub.RegisterDevice(pb.RegisterDeviceRequest(
        session_id=client.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=5))
    for req, code in [
        (pb.RegisterRegionRequest(session_id=client.session_id, device_id=dev.device_id,
                                  kind=pb.REGION_KIND_SLOT_POOL, size_bytes=100, slot_bytes=100,
                                  slot_count=1), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.RegisterRegionRequest(session_id=client.session_id, device_id=dev.device_id,
                                  kind=pb.REGION_KIND_WORK_RING, shm_name="no-such-ring"),
         grpc.StatusCode.PERMISSION_DENIED),  # not a name made for this session
        (pb.RegisterRegionRequest(session_id=client.session_id, device_id=dev.device_id,
                                  kind=pb.REGION_KIND_WORK_RING,
                                  shm_name=session_name("dpu-ring-work", client.session_token)),
         grpc.StatusCode.INVALID_ARGUMENT),  # made for it, but no such segment
        (pb.RegisterRegionRequest(session_id=client.session_id, device_id=99,
                                  kind=pb.REGION_KIND_SLOT_POOL, size_bytes=256, slot_bytes=256,
                                  slot_count=1), grpc.StatusCode.FAILED_PRECONDITION),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            client.stub.RegisterRegion(req)
        assert err.value.code() == code, err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Acquire(pb.AcquireRequest(session_id=client.session_id,
                                              device_id=dev.device_id,
                                              key=pb.ExpertKey(model="m", layer=0, expert=0)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_unreachable_agent_is_a_clear_error() -> None:
    with pytest.raises(AgentUnavailable, match=r"127\.0\.0\.1:9"):
        AgentClient("127.0.0.1:9", connect_timeout=0.5)


def test_health_service_reports_serving(agent: AgentProcess) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(agent.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="dpu_offload.v1.DpuAgent"), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_expired_lease_reclaims_session(agent: AgentProcess, qwen_ckpt: Path) -> None:
    import time

    with AgentClient(agent.address) as observer:
        baseline = observer.status()
        for round_ in range(2):  # twice: the reaper must survive reclaiming a session
            c = AgentClient(agent.address, client_name="vanishing", lease_seconds=1)
            model = c.load_model(str(qwen_ckpt), "qwen-lease")
            dev = c.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
            c.acquire(dev, ExpertKey("qwen-lease", 0, round_)).wait(10)
            c._closed.set()  # the process "dies": no more keep-alives
            assert [s.session_id for s in c.status().sessions] == [c.session_id]
            deadline = time.monotonic() + 5
            while c.session_id in [s.session_id for s in c.status().sessions]:
                assert time.monotonic() < deadline, "session not reclaimed after its lease"
                time.sleep(0.1)
            c.close()
        after = observer.status()
        assert after.transfers_in_flight == 0
        assert after.other_sessions <= baseline.other_sessions


def test_report_routing_validates(client: AgentClient, qwen_ckpt: Path) -> None:
    client.load_model(str(qwen_ckpt), "qwen-routing")
    client.report_routing("qwen-routing", [(0, {1: 3, 2: 1}), (1, {5: 4})])
    for model, steps, code in [
        ("qwen-routing", [(9, {1: 1})], grpc.StatusCode.INVALID_ARGUMENT),
        ("qwen-routing", [(0, {6: 1})], grpc.StatusCode.INVALID_ARGUMENT),
        ("nope", [(0, {1: 1})], grpc.StatusCode.NOT_FOUND),
        # refused by the client before the call (a protobuf field cannot hold them)
        ("qwen-routing", [(0, {1: -1})], grpc.StatusCode.INVALID_ARGUMENT),
        ("qwen-routing", [(-1, {1: 1})], grpc.StatusCode.INVALID_ARGUMENT),
        ("qwen-routing", [(0, {"1": 1})], grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            client.report_routing(model, steps)
        assert err.value.code() == code, err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.ReportRouting(pb.ReportRoutingRequest(
            session_id=client.session_id, model="qwen-routing",
            steps=[pb.RoutingStep(layer=0, experts=[1, 2], tokens=[1])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_stuck_consumer_is_an_error_not_a_hang(qwen_ckpt: Path) -> None:
    from host_client import TransferFailed

    with AgentProcess('[transfer]\ntimeout_seconds = 1\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qwen-stuck")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        dev.device.stop()  # the consumer is gone; descriptors will never complete
        handle = client.acquire(dev, ExpertKey("qwen-stuck", 0, 1))
        with pytest.raises(TransferFailed, match="CANCELLED"):
            handle.wait(10)
        # The slot was freed: nothing is READY, and the pool can be used again.
        st = client.status()
        assert st.transfers_in_flight == 0
        assert all(s.slots_ready == 0 for s in st.sessions)


def test_expertctl_status_and_top(agent: AgentProcess, qwen_ckpt: Path) -> None:
    import subprocess
    import sys

    with AgentClient(agent.address, client_name="ctl-visible") as c:
        c.load_model(str(qwen_ckpt), "qwen-ctl")
        base = [sys.executable, "-m", "host_client.cli"]
        out = subprocess.run([*base, "status", "--agent", agent.address], capture_output=True,
                             text=True, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0, out.stderr
        assert "ctl-visible" not in out.stdout and "qwen-ctl" in out.stdout  # not its session
        assert "other session(s)" in out.stdout
        env = {**os.environ, "COLUMNS": "200", "DPU_AGENT_SESSION_TOKEN": c.session_token}
        out = subprocess.run([*base, "status", "--agent", agent.address], capture_output=True,
                             text=True, env=env)
        assert out.returncode == 0 and "ctl-visible" in out.stdout, out.stderr
        top = subprocess.run([*base, "top", "--agent", agent.address, "--interval", "0.1",
                              "--iterations", "2"], capture_output=True, text=True,
                             env={**os.environ, "COLUMNS": "200"})
        assert top.returncode == 0 and "qwen-ctl" in top.stdout
        # Left running, top quits on q, and on Ctrl-C without a traceback.
        # SIGINT as a terminal gives it: a suite started in the background (``make test &``)
        # passes SIGINT on ignored, so the child takes Python's handler back before the CLI
        # runs. Not by ``preexec_fn``: that forks this process, whose gRPC threads are busy,
        # and gRPC's fork handlers can abort the child before it execs.
        interactive = [sys.executable, "-c", "import runpy, signal; signal.signal("
                       "signal.SIGINT, signal.default_int_handler); runpy.run_module("
                       "'host_client.cli', run_name='__main__', alter_sys=True)"]
        for stop in ("q", signal.SIGINT):
            live = subprocess.Popen([*interactive, "top", "--agent", agent.address,
                                     "--interval", "0.2"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(1.5)
            if live.poll() is not None:  # it must still be running: say why it is not
                _, err = live.communicate()
                raise AssertionError(f"top exited with {live.returncode} before {stop!r}: {err}")
            if stop == "q":
                try:
                    live.stdin.write("q")
                    live.stdin.flush()
                except BrokenPipeError:  # it exited after the check above: say why
                    _, err = live.communicate()
                    raise AssertionError(f"top exited with {live.returncode} before 'q': {err}"
                                         ) from None
            else:
                live.send_signal(stop)
            _, err = live.communicate(timeout=10)
            assert live.returncode == 0 and "Traceback" not in err, (stop, err)
    down = subprocess.run([*base, "status", "--agent", "127.0.0.1:9", "--timeout", "0.5"],
                          capture_output=True, text=True)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_acquire_wakes_a_backed_off_consumer(client: AgentClient, qwen_ckpt: Path) -> None:
    """A consumer that backs off while idle (here 30 s per wait) still delivers at once: the
    client rings its doorbell after an acquire that posted descriptors, and settles what it
    expected once each transfer is reported done (a count left owed would keep the consumer
    polling forever)."""
    from host_client.devices import Doorbell

    model = client.load_model(str(qwen_ckpt), "qwen-doorbell")
    device = CpuReferenceDevice()
    device.doorbell = Doorbell(first_s=30.0, max_s=30.0)
    dev = client.register_device(device, [SlotPoolSpec(model.expert_bytes, 2)])
    for expert in range(4):  # cold (arena fill) and warm misses; 2 slots force eviction
        key = ExpertKey("qwen-doorbell", 0, expert)
        slot = client.acquire(dev, key).wait(10)
        assert slot.key == key
        assert device.doorbell.owed == 0
        client.release(dev, key)
    handles = client.acquire_batch(dev, [ExpertKey("qwen-doorbell", 1, e) for e in range(2)])
    assert device.doorbell.owed <= 2
    for h in handles:
        h.wait(10)
    assert device.doorbell.owed == 0


def test_doorbell_wait_backs_off_and_ring_ends_it() -> None:
    import threading
    import time

    from host_client.devices import Doorbell

    bell = Doorbell(first_s=0.001, max_s=0.004)
    t0 = time.monotonic()
    for _ in range(6):  # 1 + 2 + 4 + 4 + 4 + 4 ms at least
        bell.wait()
    assert time.monotonic() - t0 >= 0.019
    bell = Doorbell(first_s=60.0, max_s=60.0)
    threading.Timer(0.05, bell.ring).start()
    t0 = time.monotonic()
    bell.wait()
    assert time.monotonic() - t0 < 30


def test_doorbell_keeps_an_owed_consumer_awake() -> None:
    import time

    from host_client.devices import Doorbell

    bell = Doorbell(first_s=60.0, max_s=60.0)
    bell.expect()
    bell.expect()
    bell.settle()
    t0 = time.monotonic()
    for _ in range(100):  # owed: each wait only yields
        bell.wait()
    assert time.monotonic() - t0 < 1 and bell.owed == 1
    bell.settle()
    bell.settle()  # more settles than expects never go below zero
    assert bell.owed == 0


def test_refusals_are_typed_whichever_way_they_came(client: AgentClient, qwen_ckpt: Path,
                                                    tmp_path: Path) -> None:
    """One hierarchy for gRPC and channel refusals: the class of the status code, the code,
    the agent's message; still a grpc.RpcError for code written against raw gRPC."""
    from host_client import (
        AgentError,
        FailedPrecondition,
        InvalidArgument,
        NotFound,
        ResourceExhausted,
    )

    with pytest.raises(NotFound) as err:  # gRPC
        client.load_model(str(tmp_path / "nowhere"), "typed")
    assert err.value.status is None and "nowhere" in err.value.details()
    with pytest.raises(InvalidArgument):
        client.load_model("", "typed")
    model = client.load_model(str(qwen_ckpt), "typed")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 1)])
    with pytest.raises(NotFound) as err:  # the expert's manifest, over gRPC
        client.acquire(dev, ExpertKey("typed", 0, 99)).wait(10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "l0-e99" in err.value.details()
    with pytest.raises(FailedPrecondition) as err:  # the channel from here on
        client.release(dev, ExpertKey("typed", 0, 1))
    assert err.value.status == abi.RequestStatus.FAILED_PRECONDITION
    client.acquire(dev, ExpertKey("typed", 0, 1)).wait(10)
    with pytest.raises(ResourceExhausted) as err:
        client.acquire(dev, ExpertKey("typed", 0, 2)).wait(10)
    assert err.value.status == abi.RequestStatus.RESOURCE_EXHAUSTED
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "held" in \
        err.value.details()
    assert isinstance(err.value, AgentError) and isinstance(err.value, grpc.RpcError)
