"""The activation path end to end: sender -> NIC stand-in (steering, its own process) -> the
worker's rx ring (receive twin, SwiGLU on the slot's weights, send twin) -> tx ring -> NIC ->
sender (combine), checked against a dense reference; refusals; credits; corrupted and short
packets written again; migration under traffic."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dpu_offload import frames
from dpu_offload.frames import FrameStatus, Kind
from gpu_kernels import packet_twin, reference
from gpu_kernels.packet_ops import CudaPacketOps
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationError, ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from nic.nic import PACKET_RETRIES
from tests.activation_serving import (
    METRICS,
    SETTINGS,
    dispatch_matches_dense,
    routing,
    serving,
)
from tests.conftest import checkpoint_bytes


@pytest.fixture
def served(qwen_ckpt: Path):
    with serving(qwen_ckpt) as s:
        yield s


def test_dispatch_compute_combine_matches_dense_reference(served, qwen_ckpt: Path) -> None:
    agent, _, model, devs, worker = served
    # The worker's thread rings the tx doorbell, so the NIC sleeps on it between answers.
    assert devs[0].tx.ring.doorbell and devs[0].tx.bell is not None
    ids = routing(model.experts_per_layer, 24, 2, seed=0)
    sent = dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                                  model.experts_per_layer, model.moe_layers[1], qwen_ckpt, ids)
    assert worker.served == sent and worker.refused_packets == 0
    worker.close()
    assert not devs[0].tx.ring.doorbell  # nobody rings it now: the NIC polls the ring


def test_a_worker_that_claims_the_doorbell_but_never_rings_is_still_answered(
        served, qwen_ckpt: Path) -> None:
    """The header's ``doorbell`` word is a hint: the NIC sleeps at most ``IDLE_POLL_MS`` at a
    time, so a worker that says it rings and does not only slows its own answers."""
    agent, _, model, devs, worker = served
    bell, devs[0].tx.bell = devs[0].tx.bell, None  # the worker's sends ring nothing now
    try:
        assert devs[0].tx.ring.doorbell
        ids = routing(model.experts_per_layer, 16, 2, seed=3)
        t0 = time.monotonic()
        sent = dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                                      model.experts_per_layer, model.moe_layers[0], qwen_ckpt,
                                      ids, 3)
        assert time.monotonic() - t0 < 5
        assert worker.served == sent
    finally:
        devs[0].tx.bell = bell


def _raw(agent: AgentProcess, header: bytes, payload: bytes) -> tuple[int, str]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{agent.activations_port}")
    try:
        sock.send_multipart([header, payload])
        assert sock.poll(5000)
        h, p = sock.recv_multipart()
        parsed = frames.unpack(h, len(p))
        return parsed.status, p.decode()
    finally:
        sock.close(0)


def test_refusals_are_answered_with_a_reason(served) -> None:
    agent, _, model, _, _ = served
    row = np.zeros((2, 256), np.uint16).tobytes()
    layer = model.moe_layers[0]
    cases = [
        (b"\0" * 64, row, FrameStatus.BAD_FRAME),
        (frames.pack(Kind.REQUEST, 1, "qa", layer, 0, 2, 512, len(row) + 16), row,
         FrameStatus.BAD_FRAME),
        (frames.pack(Kind.REQUEST, 1, "nope", layer, 0, 2, 512, len(row)), row,
         FrameStatus.UNKNOWN_EXPERT),
        (frames.pack(Kind.REQUEST, 1, "qa", layer, 99, 2, 512, len(row)), row,
         FrameStatus.UNKNOWN_EXPERT),
        (frames.pack(Kind.REQUEST, 1, "qa", layer, 0, 4, 256, len(row)), row,
         FrameStatus.BAD_WIDTH),
    ]
    for header, payload, status in cases:
        got, reason = _raw(agent, header, payload)
        assert got == status, (status, reason)
        assert reason


def test_unrouted_expert_and_credits(served) -> None:
    agent, client, model, devs, worker = served
    # Move nothing, but delete every placement rule for expert 5 of the last layer by placing
    # the model with that expert on device 1, which has no worker: NO_ROUTE.
    layers, experts = len(model.moe_layers), model.experts_per_layer
    placement = [[[devs[0].device_id]] * experts for _ in range(layers)]
    placement[-1][5] = [devs[1].device_id]
    client.wait_placement(client.apply_placement("qa", placement).placement_id)
    time.sleep(0.2)
    rows = np.zeros((1, 256), np.uint16)
    with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qa", experts) as s:
        s.request(model.moe_layers[-1], 5, rows)
        with pytest.raises(ActivationError) as err:
            s.receive()
        assert err.value.status == FrameStatus.NO_ROUTE
        # Credits: the worker is paused, 4 outstanding are accepted, the 5th is refused.
        worker._stop.set()
        worker._thread.join()
        for _ in range(5):
            s.request(model.moe_layers[0], 0, rows)
        with pytest.raises(ActivationError) as err:
            s.receive()
        assert err.value.status == FrameStatus.NO_CREDIT


def test_migration_under_traffic_loses_nothing(served) -> None:
    agent, client, model, devs, worker = served
    worker_b = ExpertWorker(client, devs[1])
    rng = np.random.default_rng(1)
    layer = model.moe_layers[0]
    sent = received = 0
    stop = threading.Event()
    errors: list[str] = []

    def traffic() -> None:
        nonlocal sent, received
        with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qa",
                              model.experts_per_layer, credits=4) as s:
            while not stop.is_set():
                x = reference.f32_to_bf16(rng.standard_normal((8, 256), dtype=np.float32))
                ids = np.stack([rng.choice(6, 2, replace=False) for _ in range(8)])
                try:
                    out = s.dispatch(layer, x, ids, np.full((8, 2), 0.5, np.float32))
                    sent += 1
                    received += int(out.shape == x.shape)
                except ActivationError as exc:
                    errors.append(str(exc))

    t = threading.Thread(target=traffic)
    t.start()
    try:
        for target in (devs[1], devs[0], devs[1]):
            time.sleep(0.3)
            placement = [[[target.device_id]] * model.experts_per_layer
                         for _ in model.moe_layers]
            client.wait_placement(client.apply_placement("qa", placement).placement_id)
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(30)
        worker_b.close()
    assert not errors, errors[:3]
    assert sent == received and sent > 3
    assert worker.served > 0 and worker_b.served > 0, "traffic did not follow the moves"


def metrics(agent: AgentProcess) -> dict[tuple[str, tuple], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_activation_metrics(qwen_ckpt: Path) -> None:
    from tests.test_config_metrics import dashboard_metrics_missing

    with AgentProcess(SETTINGS + METRICS) as agent:
        _raw(agent, b"\0" * 64, b"")
        status, _ = _raw(agent, frames.pack(frames.Kind.REQUEST, 1, "absent", 0, 0, 1, 16, 16),
                         b"\0" * 16)
        values = metrics(agent)
        assert dashboard_metrics_missing(agent.metrics_port, "dpu_agent_activation_") == []
    assert status == frames.FrameStatus.UNKNOWN_EXPERT
    assert values[("dpu_agent_activation_refused_total", (("reason", "BAD_FRAME"),))] == 1
    assert values[("dpu_agent_activation_refused_total", (("reason", "UNKNOWN_EXPERT"),))] == 1
    assert values[("dpu_agent_activation_messages_total", (("kind", "REQUEST"),))] == 1
    assert values[("dpu_agent_activation_outstanding", ())] == 0


class FlakyRxWorker(ExpertWorker):
    """A worker whose rx ring has one payload byte of the last packet of each of its next
    ``bad`` parts corrupted before the receiver reads it (a wire or NIC fault)."""

    bad = 0

    def _land(self, dst):
        rx = self.dev.rx.ring
        n = packet_twin.part_packets(rx)
        if n is not None and self.bad > 0:
            self.bad -= 1
            rx.payload[(rx.consumed + n - 1) % rx.capacity, 0] ^= 0xFF
        return super()._land(dst)


def retransmits(agent: AgentProcess) -> float:
    return metrics(agent)[("dpu_agent_activation_retransmits_total", ())]


def test_corrupted_packets_are_caught_delivered_again_and_counted(qwen_ckpt: Path) -> None:
    from prometheus_client import REGISTRY

    def refused(device: int) -> float:
        return REGISTRY.get_sample_value("dpu_worker_packets_refused_total",
                                         {"device": str(device)}) or 0.0

    with serving(qwen_ckpt, FlakyRxWorker) as (agent, _, model, devs, worker):
        dev = devs[0].device_id
        before = refused(dev)
        worker.bad = 2  # the first request's part fails twice, then arrives intact
        ids = routing(model.experts_per_layer, 8, 1, seed=3)
        dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                               model.experts_per_layer, model.moe_layers[0], qwen_ckpt, ids)
        assert worker.refused_packets == 2 and retransmits(agent) == 2
        assert refused(dev) - before == 2
        # A part that never arrives intact fails its request with a clear status; the sender's
        # credit comes back and the next request is served.
        worker.bad = 10**6
        x = reference.f32_to_bf16(np.ones((1, 256), np.float32))
        with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qa",
                              model.experts_per_layer, credits=1) as sender:
            with pytest.raises(ActivationError) as err:
                sender.dispatch(model.moe_layers[0], x, np.array([[0]]),
                                np.ones((1, 1), np.float32))
            assert err.value.status == FrameStatus.WORKER_FAILED
            assert "failed their checksum" in str(err.value)
            assert f"{PACKET_RETRIES + 1} times" in str(err.value)
            worker.bad = 0
            sender.dispatch(model.moe_layers[0], x, np.array([[0]]), np.ones((1, 1), np.float32))
        assert retransmits(agent) == 2 + PACKET_RETRIES


class EmptyingRxWorker(ExpertWorker):
    """A worker whose rx ring has the last packet of its first part rewritten as a valid
    empty one (length 0, checksum 0: the checksum of no bytes): nothing is refused, bytes are
    missing (found by the request-ring's fuzz of the packet twin)."""

    bad = 1

    def _land(self, dst):
        rx = self.dev.rx.ring
        n = packet_twin.part_packets(rx)
        if n is not None and self.bad > 0:
            self.bad -= 1
            i = (rx.consumed + n - 1) % rx.capacity
            rx.entries[i:i + 1]["length"] = 0
            rx.entries[i:i + 1]["checksum"] = 0
        return super()._land(dst)


def test_a_part_delivered_short_is_delivered_again(qwen_ckpt: Path) -> None:
    with serving(qwen_ckpt, EmptyingRxWorker) as (agent, _, model, _, worker):
        dispatch_matches_dense(f"127.0.0.1:{agent.activations_port}", "qa",
                               model.experts_per_layer, model.moe_layers[0], qwen_ckpt,
                               routing(model.experts_per_layer, 8, 1, seed=5))
        assert worker.bad == 0 and retransmits(agent) == 1 and worker.refused_packets == 0


def test_worker_vanishing_mid_request_fails_within_bound(qwen_ckpt: Path) -> None:
    settings = SETTINGS + "worker_timeout_seconds = 1\n"
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qv")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)])
        client.wait_placement(client.apply_placement(
            "qv", [[[dev.device_id]] * 6 for _ in model.moe_layers]).placement_id)
        worker = ExpertWorker(client, dev)
        worker._stop.set()          # the worker process "dies": its rings stay silent
        worker._thread.join()
        with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qv", 6) as s:
            t0 = time.monotonic()
            s.request(model.moe_layers[0], 1, np.zeros((2, 256), np.uint16))
            with pytest.raises(ActivationError) as err:
                s.receive()
            assert err.value.status == FrameStatus.WORKER_FAILED
            assert time.monotonic() - t0 < 3
            # The dead worker is no longer a route.
            s.request(model.moe_layers[0], 1, np.zeros((2, 256), np.uint16))
            with pytest.raises(ActivationError) as err:
                s.receive()
            assert err.value.status == FrameStatus.NO_ROUTE


def test_a_worker_stops_within_its_bound_when_the_agent_does_not_answer(
        qwen_ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    from host_client import worker as worker_module

    with serving(qwen_ckpt) as (agent, _client, _model, _devs, worker):
        assert agent.proc is not None
        os.kill(agent.proc.pid, signal.SIGSTOP)  # alive, answering nothing
        try:
            t0 = time.monotonic()
            worker.close()
            took = time.monotonic() - t0
        finally:
            os.kill(agent.proc.pid, signal.SIGCONT)
        assert took < worker_module.STOP_SECONDS + 3, took
        assert "was not told to stop serving it: StatusCode.DEADLINE_EXCEEDED" in caplog.text


@contextlib.contextmanager
def cuda_serving(ckpt: Path, name: str, resident: bool):
    """An agent with every expert placed on GPU 0, served by a worker with or without the
    resident receiver: (agent's activation address, model, worker)."""
    pytest.importorskip("cupy")
    from host_client.cuda_device import CudaDevice

    # A fresh GPU machine compiles the FFN's CuPy kernels on the first request (seconds).
    with AgentProcess(SETTINGS + "worker_timeout_seconds = 60\n") as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(ckpt), name)
        dev = client.register_device(CudaDevice(0, mechanism="copy_engine"),
                                     [SlotPoolSpec(model.expert_bytes, 18)])
        client.wait_placement(client.apply_placement(name, [
            [[dev.device_id]] * model.experts_per_layer for _ in model.moe_layers]).placement_id)
        worker = ExpertWorker(client, dev, resident=resident)
        try:
            yield f"127.0.0.1:{agent.activations_port}", model, worker
        finally:
            worker.close()


@pytest.mark.gpu
def test_cuda_worker_kernels_match_dense_reference(qwen_ckpt: Path) -> None:
    """The same path on the GPU with the worker's thread driving the packet-receive and send
    kernels and the FFN (``resident=False``: the path of layouts the resident kernel does not
    compute)."""
    with cuda_serving(qwen_ckpt, "qg", resident=False) as (address, model, worker):
        dispatch_matches_dense(address, "qg", model.experts_per_layer, model.moe_layers[0],
                               qwen_ckpt, routing(model.experts_per_layer, 40, 2, seed=4),
                               seed=4)
        assert isinstance(worker.packets, CudaPacketOps) and worker.resident is None
        assert worker.refused_packets == 0


@pytest.mark.gpu
def test_the_worker_thread_is_not_held_by_the_legacy_stream(qwen_ckpt: Path) -> None:
    """The worker's thread computes on a stream of its own: with the legacy default stream
    held by a wait on a word nobody has written (as inference code's stream waits on slots
    hold it), a dispatch is still answered, and only then is the wait let go."""
    cp = pytest.importorskip("cupy")
    import cupyx

    from dpu_offload import abi
    from dpu_offload.channel import state_word
    from gpu_kernels import cuda_ops

    with cuda_serving(qwen_ckpt, "ql", resident=False) as (address, model, worker):
        layer, experts = model.moe_layers[0], model.experts_per_layer
        # The same dispatch once before loads the FFN's modules and fills the worker's memory
        # pool with its messages' sizes (a module load waits for a busy device); the release's
        # pinned buffer and stream are made before the wait too.
        dispatch_matches_dense(address, "ql", experts, layer, qwen_ckpt,
                               routing(experts, 40, 2, seed=9), seed=9)
        word, result = cp.zeros(1, cp.uint64), cp.full(1, 99, cp.uint32)
        ready = cupyx.empty_pinned(1, np.uint64)
        ready[0] = state_word(1, abi.SlotState.READY)
        side = cp.cuda.Stream(non_blocking=True)
        legacy = cp.cuda.Stream.null
        legacy.synchronize()
        cuda_ops.wait_ready(word.data.ptr, 1, 60.0, result, legacy)
        try:
            dispatch_matches_dense(address, "ql", experts, layer, qwen_ckpt,
                                   routing(experts, 40, 2, seed=9), seed=9)
            assert not legacy.done  # the dispatch did not wait for the legacy stream
            # Messages of sizes the worker's memory pool has not seen: new device allocations.
            dispatch_matches_dense(address, "ql", experts, layer, qwen_ckpt,
                                   routing(experts, 57, 2, seed=10), seed=10)
            assert not legacy.done, "a message of a new size waited for the legacy stream"
        finally:
            word.set(ready, stream=side)
            side.synchronize()
            legacy.synchronize()
        assert int(result.get()[0]) == 0  # READY: let go by the write, not timed out
        assert worker.resident is None


@pytest.mark.gpu
def test_the_resident_receiver_serves_without_a_host_thread(qwen_ckpt: Path) -> None:
    """The persistent kernel (gpu_kernels/serve.cu) serves the path alone: a dispatch matches
    the dense reference, a message larger than the rx ring (in parts) equals the NumPy FFN of
    the slot's weights, and its counters say so; the receiver's thread only watches."""
    with cuda_serving(qwen_ckpt, "qr", resident=True) as (address, model, worker):
        ids = routing(model.experts_per_layer, 40, 2, seed=6)
        sent = dispatch_matches_dense(address, "qr", model.experts_per_layer,
                                      model.moe_layers[0], qwen_ckpt, ids, seed=6)
        layer = model.moe_layers[1]
        rows = reference.f32_to_bf16(np.random.default_rng(7).standard_normal(
            (9000, 256), dtype=np.float32))  # 4.6 MB: parts of 2 MiB, more than the ring
        with ActivationSender(address, "qr", model.experts_per_layer) as sender:
            sender.request(layer, 2, rows)
            _, got = sender.receive()
        truth = checkpoint_bytes(qwen_ckpt)
        names = [f"model.layers.{layer}.mlp.experts.2.{r}.weight"
                 for r in ("gate_proj", "up_proj", "down_proj")]
        weights = [np.frombuffer(truth[n], np.uint16) for n in names]
        want = reference.swiglu_bf16(rows, weights[0].reshape(-1, 256),
                                     weights[1].reshape(-1, 256), weights[2].reshape(256, -1))
        diff = np.abs(reference.bf16_to_f32(got) - reference.bf16_to_f32(want)).max()
        assert diff <= 2 ** -6 * max(1.0, float(np.abs(reference.bf16_to_f32(want)).max()))
        assert worker.resident.counters() == (sent + 1, 0, 0)


@pytest.mark.gpu
def test_a_device_goes_from_the_resident_receiver_to_the_thread_and_back(qwen_ckpt: Path
                                                                        ) -> None:
    """The resident kernel consumes the rx ring and fills the tx ring on the GPU; once it
    stops, the worker's thread (and then a new kernel) goes on from the positions it reached:
    every dispatch in the sequence matches the dense reference."""
    with cuda_serving(qwen_ckpt, "qs", resident=True) as (address, model, worker):
        client, dev = worker.client, worker.dev
        for step, resident in enumerate((True, False, True)):
            if step:
                worker.close()
                worker = ExpertWorker(client, dev, resident=resident)
            assert (worker.resident is not None) == resident
            assert dev.tx.ring.doorbell == (not resident)  # the kernel rings no doorbell
            dispatch_matches_dense(address, "qs", model.experts_per_layer,
                                   model.moe_layers[0], qwen_ckpt,
                                   routing(model.experts_per_layer, 24, 2, seed=step), step)
        worker.close()


def test_a_killed_nic_is_restarted_on_its_port_with_its_workers(qwen_ckpt: Path) -> None:
    """The NIC stand-in SIGKILLed: the agent notices within its liveness sweep (0.5 s) and
    starts a new one on the same port with every worker's rings attached again; the next
    requests are served as before, through the same address, by the same worker."""
    import os
    import signal as sig

    from bench.common import child_pid

    with serving(qwen_ckpt) as (agent, _, model, _, worker):
        address = f"127.0.0.1:{agent.activations_port}"
        layer = model.moe_layers[0]
        ids = routing(model.experts_per_layer, 8, 1, seed=9)
        dispatch_matches_dense(address, "qa", model.experts_per_layer, layer, qwen_ckpt, ids)
        old = child_pid(agent.proc.pid, "nic")
        assert old
        os.kill(old, sig.SIGKILL)
        deadline = time.monotonic() + 5
        while child_pid(agent.proc.pid, "nic") in (0, old):
            assert time.monotonic() < deadline, "the NIC was not restarted"
            time.sleep(0.05)
        served = worker.served
        dispatch_matches_dense(address, "qa", model.experts_per_layer, layer, qwen_ckpt, ids)
        assert worker.served > served  # the same worker, re-attached, served them
        assert agent.proc.poll() is None


def test_serve_activations_refuses_what_the_caller_cannot_serve(qwen_ckpt: Path) -> None:
    """ServeActivations names what was wrong and attaches nothing: a device the session does
    not have is FAILED_PRECONDITION (as on every RPC), so is an agent without [activations];
    stopping a device that never served is a no-op."""
    import grpc

    from dpu_offload.v1 import agent_pb2 as pb

    def serve(client: AgentClient, device_id: int, on: bool = True) -> None:
        client.stub.ServeActivations(pb.ServeActivationsRequest(
            session_id=client.session_id, device_id=device_id, serve=on), timeout=10)

    with serving(qwen_ckpt) as (_, client, _, devs, _):
        with pytest.raises(grpc.RpcError) as err:
            serve(client, 10_000)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "device 10000 is not registered" in err.value.details()
        serve(client, devs[1].device_id, on=False)
    with AgentProcess() as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "qn")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        with pytest.raises(grpc.RpcError) as err:
            serve(client, dev.device_id)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "activations" in err.value.details()


def test_the_sender_gives_up_after_its_timeout_when_nothing_answers() -> None:
    """A NIC address that takes frames and never answers: ``receive`` raises TimeoutError
    naming the wait after the sender's timeout (not before, not never), and the frame did go
    out."""
    sink = zmq.Context.instance().socket(zmq.ROUTER)
    sink.setsockopt(zmq.LINGER, 0)
    port = sink.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ActivationSender(f"127.0.0.1:{port}", "m", 4, timeout=0.3) as sender:
            sender.request(0, 1, np.zeros((2, 8), np.uint16))
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer from the agent in 300 ms"):
                sender.receive()
            assert 0.25 <= time.monotonic() - t0 < 5
        assert sink.poll(2000) and len(sink.recv_multipart()) == 3  # identity, header, rows
    finally:
        sink.close(0)


def test_a_small_message_is_computed_on_one_blas_thread_and_the_pool_is_restored() -> None:
    from threadpoolctl import threadpool_info

    from host_client.worker import SMALL_BATCH_ROWS, _one_blas_thread

    def blas_threads() -> list[int]:
        return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

    pool = blas_threads()
    seen: list[list[int]] = []
    ffn = _one_blas_thread(lambda x: seen.append(blas_threads()) or x)
    assert ffn(np.zeros((SMALL_BATCH_ROWS - 1, 4))).shape == (SMALL_BATCH_ROWS - 1, 4)
    ffn(np.zeros((SMALL_BATCH_ROWS, 4)))
    assert seen == [[1] * len(pool), pool]
    assert blas_threads() == pool
    with pytest.raises(ZeroDivisionError):  # restored after a failing FFN too
        _one_blas_thread(lambda x: 1 / 0)(np.zeros((1, 4)))
    assert blas_threads() == pool


def test_rows_of_nan_and_huge_values_come_back_as_a_gpu_computes_them_without_warnings(
        served) -> None:
    """A sender's rows are data: NaN in gives NaN out, huge values inf or NaN, and the CPU
    worker raises no floating-point warning for them (its thread's NumPy error state)."""
    import warnings

    agent, _, model, _, _ = served
    rows = np.full((4, 256), 0x7FC0, np.uint16)  # bf16 NaN
    rows[2:] = 0x7F7F  # bf16 near its largest finite value
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with ActivationSender(f"127.0.0.1:{agent.activations_port}", "qa",
                              model.experts_per_layer) as sender:
            sender.request(model.moe_layers[0], 1, rows)
            out = reference.bf16_to_f32(sender.receive()[1])
    assert np.isnan(out[:2]).all()
    assert not np.isfinite(out[2:]).all()
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], \
        [str(w.message) for w in seen]


def test_a_sender_refuses_hidden_rows_that_are_not_bf16_bits() -> None:
    """dispatch takes ``uint16[tokens, hidden]`` (bf16 bits): float rows or a flat vector are
    refused before anything is sent (a cast would send other numbers)."""
    with ActivationSender("127.0.0.1:1", "m", 4) as sender:
        ids, w = np.array([[0], [1]]), np.ones((2, 1), np.float32)
        with pytest.raises(ValueError, match=r"uint16\[tokens, hidden_size\].*float32\[2, 8\]"):
            sender.dispatch(0, np.zeros((2, 8), np.float32), ids, w)
        with pytest.raises(ValueError, match=r"uint16\[16\]"):
            sender.dispatch(0, np.zeros(16, np.uint16), ids, w)


def test_a_dispatch_after_a_failed_one_skips_its_late_answers() -> None:
    """A dispatch that timed out leaves its requests unanswered; the next dispatch through the
    same sender (its buffers reused) skips their late answers, RESPONSE and ERROR alike, and
    combines its own. The NIC here is a ROUTER socket answering each REQUEST with its rows
    times (expert + 1); an answer of the wrong shape is refused, named."""
    from gpu_kernels.routing import dispatch_plan

    nic = zmq.Context.instance().socket(zmq.ROUTER)
    nic.setsockopt(zmq.LINGER, 0)
    port = nic.bind_to_random_port("tcp://127.0.0.1")

    def answer(request: list[bytes], kind: Kind = Kind.RESPONSE, rows: int | None = None
               ) -> None:
        peer, header, payload = request
        h = frames.unpack(header, len(payload))
        if kind == Kind.ERROR:
            text = b"the worker failed it"
            nic.send_multipart([peer, frames.pack(Kind.ERROR, h.message_id, "m", h.layer,
                                                  h.expert, payload_bytes=len(text),
                                                  status=FrameStatus.WORKER_FAILED), text])
            return
        x = np.frombuffer(payload, np.uint16).reshape(h.rows, -1)[:rows]
        out = reference.f32_to_bf16(reference.bf16_to_f32(x) * np.float32(h.expert + 1))
        nic.send_multipart([peer, frames.pack(Kind.RESPONSE, h.message_id, "m", h.layer,
                                              h.expert, out.shape[0], h.row_bytes, out.nbytes),
                            out.tobytes()])

    rng = np.random.default_rng(7)
    x = reference.f32_to_bf16(rng.standard_normal((6, 16), dtype=np.float32))
    ids = np.array([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    w = rng.random((6, 2), dtype=np.float32)
    plan = dispatch_plan(np, ids, 4)
    scale = (ids.reshape(-1)[plan.order] + 1).astype(np.float32)[:, None]
    want = reference.combine_bf16(reference.f32_to_bf16(
        reference.bf16_to_f32(reference.dispatch(x, plan)) * scale), plan, w)
    try:
        with ActivationSender(f"127.0.0.1:{port}", "m", 4, credits=8, timeout=0.3) as sender:
            with pytest.raises(TimeoutError):
                sender.dispatch(0, x, ids, w)  # nobody answers in time
            assert 0.3 <= sender.phase_seconds["receive"] < 5  # waited out its timeout there
            stale = [nic.recv_multipart() for _ in range(4)]
            got: list[np.ndarray] = []
            second = threading.Thread(target=lambda: got.append(sender.dispatch(0, x, ids, w)))
            second.start()
            fresh = [nic.recv_multipart() for _ in range(4)]
            answer(stale[0], Kind.ERROR)
            for request in stale[1:]:
                answer(request)
            for request in fresh:
                answer(request)
            second.join(10)
            np.testing.assert_array_equal(got[0], want)
            assert all(v > 0 for v in sender.phase_seconds.values()), sender.phase_seconds
            # A third dispatch whose first answer has one row too few is refused, named.
            refused: list[ActivationError] = []

            def dispatch_refused() -> None:
                try:
                    sender.dispatch(0, x, ids, w)
                except ActivationError as exc:
                    refused.append(exc)

            third = threading.Thread(target=dispatch_refused)
            third.start()
            mine = [nic.recv_multipart() for _ in range(4)]
            answer(mine[0], rows=-1)
            third.join(10)
            assert refused[0].status == FrameStatus.BAD_FRAME
            assert "holds [2, 16] rows, expected [3, 16]" in str(refused[0])
    finally:
        nic.close(0)


@pytest.mark.parametrize("frame,reason", [
    ((Kind.ERROR, 0, 99, b"?"), "unknown status 99"),
    ((Kind.RESPONSE, 3, 0, b"abc"), "rows of 3 bytes (bf16: even)"),
])
def test_a_sender_refuses_an_answer_it_cannot_read(frame: tuple, reason: str) -> None:
    """An ERROR frame with a status no NIC sends, or a RESPONSE whose rows are not whole bf16
    values: the dispatch fails with ActivationError BAD_FRAME naming what was wrong (not a
    ValueError from deep in NumPy or the enum)."""
    kind, row_bytes, status, payload = frame
    nic = zmq.Context.instance().socket(zmq.ROUTER)
    nic.setsockopt(zmq.LINGER, 0)
    port = nic.bind_to_random_port("tcp://127.0.0.1")
    refused: list[ActivationError] = []
    try:
        with ActivationSender(f"127.0.0.1:{port}", "m", 2, timeout=10) as sender:
            def dispatch() -> None:
                try:
                    sender.dispatch(0, np.zeros((1, 4), np.uint16), np.array([[0]]),
                                    np.ones((1, 1), np.float32))
                except ActivationError as exc:
                    refused.append(exc)

            worker = threading.Thread(target=dispatch)
            worker.start()
            peer, header, _ = nic.recv_multipart()
            mid = frames.unpack(header, 8).message_id
            nic.send_multipart([peer, frames.HEADER.pack(
                frames.MAGIC, frames.VERSION, kind, mid, 0, 0, 1 if row_bytes else 0, row_bytes,
                len(payload), status, 0, b"m"), payload])
            worker.join(10)
    finally:
        nic.close(0)
    assert refused[0].status == FrameStatus.BAD_FRAME and reason in str(refused[0])
