"""Hostile activation frames against the NIC stand-in (hypothesis): wrong magic, versions and
kinds, lengths that disagree, models, layers and experts outside the snapshot, row widths,
payloads of any size, extra or missing frames, and floods past the sender's credits.

Invariants: every frame is answered with one well-formed frame (RESPONSE only for a valid
request, else ERROR with a documented status and a reason), the placed experts' slot bytes
never change, the NIC keeps serving (a valid request is answered after every example), and the
agent and the NIC stay up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from dpu_offload import frames
from dpu_offload.frames import FrameStatus, Kind
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.activations import ActivationSender
from host_client.launcher import AgentProcess
from host_client.worker import ExpertWorker
from tests.fuzz import FUZZ

CREDITS = 4
HIDDEN = 256  # tests/conftest.py's qwen_ckpt


@pytest.fixture(scope="module")
def nic_live(qwen_ckpt: Path) -> Iterator[tuple[AgentProcess, AgentClient, object, list]]:
    settings = ('[activations]\nlisten_address = "127.0.0.1:0"\n'
                f"credits_per_sender = {CREDITS}\nworker_timeout_seconds = 10\n")
    with AgentProcess(settings) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "fz")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)])
        client.wait_placement(client.apply_placement("fz", [
            [[dev.device_id]] * model.experts_per_layer for _ in model.moe_layers]).placement_id)
        slots = [client.acquire(dev, ExpertKey("fz", la, e)).wait(10)
                 for la in model.moe_layers for e in range(model.experts_per_layer)]
        worker = ExpertWorker(client, dev)
        try:
            yield agent, client, model, [(s, s.blob.copy()) for s in slots]
        finally:
            worker.close()
            client.release_batch(dev, [s.key for s in slots])


u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
headers = st.fixed_dictionaries({
    "magic": st.one_of(st.just(frames.MAGIC), st.integers(0, 2**32 - 1)),
    "version": st.one_of(st.just(frames.VERSION), st.integers(0, 2**16 - 1)),
    "kind": st.one_of(st.sampled_from([int(k) for k in Kind]), st.integers(0, 2**16 - 1)),
    "message_id": st.integers(0, 2**64 - 1),
    "layer": st.one_of(st.integers(0, 3), u32), "expert": st.one_of(st.integers(0, 6), u32),
    "rows": st.one_of(st.integers(0, 4), u32),
    "row_bytes": st.one_of(st.just(2 * HIDDEN), st.sampled_from([0, 16, 100, 4096]), u32),
    "status": u32, "credits": u32,
    "model": st.one_of(st.just(b"fz"), st.just(b"nope"), st.binary(max_size=16)),
    "payload_delta": st.one_of(st.just(0), st.integers(-64, 64)),
    "header_lies": st.one_of(st.just(0), st.just(0), st.integers(-32, 32)),
    "extra_frames": st.sampled_from([0, 0, 0, -1, 1]),
})


def _frame(h: dict) -> list[bytes]:
    """Header and payload per ``h``: rows x row_bytes bytes of payload (off by
    ``payload_delta``, capped), the header's payload_bytes off by ``header_lies``."""
    rows, row_bytes = h["rows"] % 64, h["row_bytes"] % (8 << 10)
    size = max(0, min(64 << 10, rows * row_bytes + h["payload_delta"]))
    header = frames.HEADER.pack(h["magic"], h["version"], h["kind"], h["message_id"], h["layer"],
                                h["expert"], rows, row_bytes, max(0, size + h["header_lies"]),
                                h["status"], h["credits"], h["model"])
    payload = np.random.default_rng(h["message_id"] % 2**32).integers(0, 256, size,
                                                                      dtype=np.uint8)
    parts = [header, payload.tobytes()]
    if h["extra_frames"] < 0:
        return parts[:1]
    return parts + [b"x"] * h["extra_frames"]


@FUZZ
@given(batch=st.lists(headers, min_size=1, max_size=2 * CREDITS))
def test_fuzz_frames_against_the_nic(nic_live, batch: list[dict]) -> None:
    agent, _, model, slots = nic_live
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{agent.activations_port}")
    try:
        for h in batch:
            sock.send_multipart(_frame(h))
        for _ in batch:
            assert sock.poll(15000), "a frame was left unanswered"
            parts = sock.recv_multipart()
            assert len(parts) == 2
            got = frames.unpack(parts[0], len(parts[1]))
            kind = Kind(got.kind)
            assert kind in (Kind.RESPONSE, Kind.ERROR)
            if kind == Kind.ERROR:
                assert FrameStatus(got.status) != FrameStatus.OK
                assert parts[1], "an ERROR without a reason"
            else:
                assert len(parts[1]) == got.rows * got.row_bytes > 0
    finally:
        sock.close(0)
    for slot, before in slots:
        np.testing.assert_array_equal(slot.blob, before)
    with ActivationSender(f"127.0.0.1:{agent.activations_port}", "fz",
                          model.experts_per_layer) as sender:
        sender.request(model.moe_layers[0], 1, np.ones((2, HIDDEN), np.uint16))
        assert sender.receive()[1].shape == (2, HIDDEN)
    assert agent.proc.poll() is None
