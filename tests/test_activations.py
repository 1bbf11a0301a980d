"""The activation path end to end: sender -> NIC stand-in (steering, its own process) -> the
worker's rx ring (receive twin, SwiGLU on the slot's weights, send twin) -> tx ring -> NIC ->
sender (combine), checked against a dense reference; refusals; credits; metrics; migration
under traffic; the sender's own checks (faults: test_activation_faults.py; the GPU worker:
test_activations_cuda.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from dpu_offload import frames
from dpu_offload.frames import FrameStatus, Kind
from gpu_kernels import reference
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationError, ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from tests.activation_serving import (
    METRICS,
    SETTINGS,
    dispatch_matches_dense,
    metrics,
    routing,
    serving,
)


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
            # Waited out its timeout there (ZeroMQ's poll counts whole milliseconds on its own
            # clock: 0.29991 s was seen).
            assert 0.295 <= sender.phase_seconds["receive"] < 5
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
