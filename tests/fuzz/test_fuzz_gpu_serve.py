"""Hostile rx packets against the resident receiver (gpu_kernels/serve.cu), written straight into
its ring as a faulty NIC would: payload bytes flipped, offsets, lengths, totals, slots, models
and message ids changed, LAST flags dropped. After each example a valid probe message must be
answered with the FFN of its expert's slot; every answer is output of the right size or an
ERROR with a known status and a reason; the placed experts' slot bytes never change and the
kernel keeps running. Runs on the GPU machine (``gpu`` marker)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_offload import abi, packets
from dpu_offload.frames import FrameStatus
from dpu_offload.keys import ExpertKey
from gpu_kernels import packet_twin, reference
from host_client import AgentClient, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.fuzz import FUZZ

pytestmark = pytest.mark.gpu
HIDDEN = 256  # tests/conftest.py's qwen_ckpt


@pytest.fixture(scope="module")
def served(qwen_ckpt: Path) -> Iterator[dict]:
    pytest.importorskip("cupy")
    from host_client.cuda_device import CudaDevice
    from host_client.resident import ResidentReceiver

    with AgentProcess('[arena]\nbytes = "64MiB"\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "fg")
        dev = client.register_device(CudaDevice(0, mechanism="copy_engine"),
                                     [SlotPoolSpec(model.expert_bytes, 18)])
        keys = [ExpertKey("fg", la, e) for la in model.moe_layers
                for e in range(model.experts_per_layer)]
        slots = client.wait_all(client.acquire_batch(dev, keys))
        where = {}
        for key, slot in zip(keys, slots, strict=True):
            for rid, spec in dev.pools.items():
                base = dev.device.region_bytes(rid, 0, spec.slot_bytes * spec.slot_count)
                if base.data.ptr <= slot.blob.data.ptr < base.data.ptr + base.size:
                    where[key] = (slot, packets.pack_slot(rid, slot.blob.data.ptr - base.data.ptr))
        before = {k: s.blob.get() for k, (s, _) in where.items()}
        receiver = ResidentReceiver(dev, {model.model_index: client.model_manifest("fg")})
        try:
            yield {"dev": dev, "where": where, "before": before, "model": model,
                   "receiver": receiver, "ids": iter(range(1, 2**62))}
        finally:
            receiver.stop()
            client.release_batch(dev, keys)


def _answers(tx, until: int, timeout: float = 10.0) -> list[tuple[int, int, bytes]]:
    """(message id, status, payload) of every answer on ``tx`` up to message ``until``'s."""
    out = []
    deadline = time.monotonic() + timeout
    landing: dict[int, tuple[np.ndarray, int]] = {}
    while time.monotonic() < deadline:
        h = packet_twin.peek_packet(tx)
        if h is None:
            time.sleep(0.0005)
            continue
        nid, total = h.message_id, h.total_length
        buf, landed = landing.pop(nid, None) or (np.zeros(total, np.uint8), 0)
        _, written, refused = packet_twin.receive_packets(tx, buf)
        assert refused == 0, "the kernel wrote a packet that fails its own checksum"
        landed += written
        if h.flags & abi.PacketFlags.ERROR or landed >= total:
            out.append((nid, h.status, buf.tobytes()))
            if nid == until:
                return out
        else:
            landing[nid] = (buf, landed)
    raise AssertionError("the resident receiver stopped answering")


@FUZZ
@given(rows=st.integers(1, 40), expert=st.integers(0, 17), seed=st.integers(0, 2**32 - 1),
       mutations=st.lists(st.tuples(st.integers(0, 12), st.sampled_from(
           ["payload", "offset", "length", "total_length", "slot", "model", "message_id",
            "flags"]), st.integers(0, 2**64 - 1)), max_size=5))
def test_hostile_packets_leave_the_resident_receiver_serving(served, rows: int, expert: int,
                                                             seed: int,
                                                             mutations: list[tuple]) -> None:
    dev, where, model = served["dev"], served["where"], served["model"]
    keys = sorted(where)
    rx, tx = dev.rx.ring, dev.tx.ring
    rng = np.random.default_rng(seed)
    data = reference.f32_to_bf16(rng.standard_normal((rows, HIDDEN), dtype=np.float32))
    key = keys[expert % len(keys)]
    nid = next(served["ids"])
    first = rx.produced
    n = packet_twin.send_packets(rx, np.ascontiguousarray(data).view(np.uint8).reshape(-1), nid,
                               model.model_index, key.layer, key.expert, slot=where[key][1])
    for p, field, value in mutations:
        if p >= n:
            continue
        i = (first + p) & (rx.capacity - 1)
        if field == "payload":
            rx.payload[i, value % rx.payload.shape[1]] ^= 1 + value % 255
        elif field == "flags":
            rx.entries[i:i + 1]["flags"] = value % 4
        else:
            kind = rx.entries.dtype[field]
            rx.entries[i:i + 1][field] = value % (2 ** (8 * kind.itemsize))
    # The probe: a valid message after the hostile one.
    probe = next(served["ids"])
    pkey = keys[(expert + 1) % len(keys)]
    x = reference.f32_to_bf16(rng.standard_normal((3, HIDDEN), dtype=np.float32))
    packet_twin.send_packets(rx, np.ascontiguousarray(x).view(np.uint8).reshape(-1), probe,
                           model.model_index, pkey.layer, pkey.expert, slot=where[pkey][1])
    for mid, status, payload in _answers(tx, probe):
        if status:
            assert FrameStatus(status) != FrameStatus.OK and payload.rstrip(b"\0")
        elif mid == probe:
            slot = where[pkey][0]
            gate, up, down = (a.get() for a in slot.swiglu_weights())
            want = reference.swiglu_bf16(x, gate, up, down)
            got = np.frombuffer(payload, np.uint16).reshape(want.shape)
            diff = np.abs(reference.bf16_to_f32(got) - reference.bf16_to_f32(want)).max()
            assert diff <= 2 ** -6 * max(1.0, float(np.abs(reference.bf16_to_f32(want)).max()))
    for k, (slot, _) in where.items():
        np.testing.assert_array_equal(slot.blob.get(), served["before"][k])
