"""Property-based fuzzing (hypothesis): every RPC with valid-looking and hostile requests,
descriptors against the receive kernel's CPU twin, safetensors headers and index files.

Invariants: no crash, only documented status codes, no write outside a region (guard bytes),
and a refused request changes nothing. ``make test`` runs the short profile; ``make fuzz``
runs at least 10,000 examples per target (HYPOTHESIS_PROFILE=fuzz).
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_agent.weights.catalog import build_catalog
from dpu_agent.weights.layouts import LayoutError
from dpu_agent.weights.safetensors_file import CheckpointError, read_header
from dpu_offload import abi
from dpu_offload.channel import split_word
from dpu_offload.keys import ExpertKey
from dpu_offload.ring import Ring
from dpu_offload.v1 import agent_pb2 as pb
from gpu_kernels import packet_twin
from gpu_kernels.reference import ReceiveKernel
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.fuzz import FUZZ

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}


@pytest.fixture(scope="module")
def live(qwen_ckpt: Path) -> Iterator[tuple[AgentProcess, AgentClient, object]]:
    with AgentProcess('[arena]\nbytes = "32MiB"\n[sessions]\nmax_lease_seconds = 60\n'
                      ) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "fz")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)])
        yield agent, client, dev


texts = st.one_of(st.just(""), st.just("fz"), st.just("nope"), st.text(max_size=80))
u32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))
u16 = st.integers(0, 2**16 - 1)
keys = st.builds(pb.ExpertKey, model=texts, layer=u32, expert=u32)


def session_ids(client: AgentClient) -> st.SearchStrategy[str]:
    return st.one_of(st.just(client.session_id), texts)


def requests(client: AgentClient, keep: int) -> st.SearchStrategy[tuple[str, object]]:
    """Every RPC's requests; DeregisterDevice never names device ``keep`` (the one the other
    examples' acquires find)."""
    sid = session_ids(client)
    return st.one_of(
        st.tuples(st.just("Acquire"), st.builds(pb.AcquireRequest, session_id=sid,
                                                device_id=u32, key=keys)),
        st.tuples(st.just("AcquireBatch"), st.builds(
            pb.AcquireBatchRequest, session_id=sid, device_id=u32,
            keys=st.lists(keys, max_size=4))),
        st.tuples(st.just("Prefetch"), st.builds(pb.PrefetchRequest, session_id=sid,
                                                 device_id=u32, keys=st.lists(keys, max_size=4))),
        st.tuples(st.just("DescribeExperts"), st.builds(
            pb.DescribeExpertsRequest, session_id=sid, keys=st.lists(keys, max_size=4))),
        st.tuples(st.just("Release"), st.builds(pb.ReleaseRequest, session_id=sid,
                                                device_id=u32, key=keys)),
        st.tuples(st.just("RegisterRegion"), st.builds(
            pb.RegisterRegionRequest, session_id=sid, device_id=u32,
            kind=st.integers(0, 7), size_bytes=u64, shm_name=texts, slot_bytes=u64,
            slot_count=u32, cuda_ipc_handle=st.binary(max_size=80),
            home_layers=st.lists(u32, max_size=6))),
        st.tuples(st.just("RegisterDevice"), st.builds(
            pb.RegisterDeviceRequest, session_id=st.one_of(texts), kind=st.integers(0, 5),
            ordinal=u32, name=texts)),
        st.tuples(st.just("DeregisterRegion"), st.builds(pb.RegionRef, session_id=sid,
                                                         region_id=u32)),
        st.tuples(st.just("DeregisterDevice"), st.builds(
            pb.DeviceRef, session_id=sid, device_id=u32.filter(lambda d: d != keep))),
        st.tuples(st.just("LoadModel"), st.builds(pb.LoadModelRequest, path=texts,
                                                  name=texts)),
        st.tuples(st.just("ReportRouting"), st.builds(
            pb.ReportRoutingRequest, session_id=sid, model=texts,
            steps=st.lists(st.builds(pb.RoutingStep, layer=u32,
                                     experts=st.lists(u32, max_size=4),
                                     tokens=st.lists(u32, max_size=4)), max_size=3),
            prefetch_top_k=st.integers(0, 3), prefetch_device_id=u32)),
        st.tuples(st.just("ApplyPlacement"), st.builds(
            pb.ApplyPlacementRequest, session_id=sid, model=texts,
            layers=st.lists(st.builds(pb.LayerPlacement, experts=st.lists(
                st.builds(pb.DeviceList, device_ids=st.lists(u32, max_size=3)), max_size=7)),
                max_size=4))),
        st.tuples(st.just("Rebalance"), st.builds(pb.RebalanceRequest, session_id=sid,
                                                  model=texts, replicas=u32)),
        st.tuples(st.just("ServeActivations"), st.builds(
            pb.ServeActivationsRequest, session_id=sid, device_id=u32, serve=st.booleans())),
        st.tuples(st.just("CreateSession"), st.builds(
            pb.CreateSessionRequest, client_name=texts,
            lease_seconds=st.integers(1000, 2**32 - 1))),
    )


def _fingerprint(client: AgentClient) -> tuple:
    """Sessions, models and transfers in flight, once an earlier example's transfers have
    finished (up to 10 s): a refused call must not start one, and one still finishing from
    before must not count against it (seen once in 10,000 examples)."""
    deadline = time.monotonic() + 10
    while (st_ := client.status()).transfers_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return (len(st_.sessions), sorted(m.model for m in st_.models), st_.transfers_in_flight)


@FUZZ
@given(data=st.data())
def test_fuzz_rpcs(live, data: st.DataObject) -> None:
    agent, client, dev = live
    name, request = data.draw(requests(client, dev.device_id))
    before = _fingerprint(client)
    try:
        getattr(client.stub, name)(request, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code = exc.code()
        assert exc.details(), f"{name}: refusal without a message"
    assert code in DOCUMENTED, (name, code)
    assert agent.proc.poll() is None, "the agent died"
    if code != grpc.StatusCode.OK:
        assert _fingerprint(client) == before, f"{name} refused but changed state"


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 70), st.integers(0, 70),
                          st.integers(0, (1 << 16) + 64), st.integers(0, (1 << 16) + 64),
                          st.integers(0, 1 << 12), st.booleans()), min_size=1, max_size=24))
def test_fuzz_descriptors_against_cpu_twin(descs: list[tuple]) -> None:
    size, guard = 1 << 16, 256
    src = np.random.default_rng(len(descs)).integers(0, 256, size, np.uint8)
    dst_full = np.full(size + 2 * guard, 0xA5, np.uint8)
    regions = np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE)
    regions[0] = (src.ctypes.data, size, abi.RegionFlags.READABLE, 0)
    regions[1] = (dst_full.ctypes.data + guard, size, 3, 0)
    memory = {0: src, 1: dst_full[guard:]}
    work = Ring.format(np.zeros(abi.ring_bytes(32, 64), np.uint8), abi.RingKind.WORK, 32)
    comp = Ring.format(np.zeros(abi.ring_bytes(32, 32), np.uint8), abi.RingKind.COMPLETION, 32)
    kernel = ReceiveKernel(work, comp, regions, memory)
    for i, (op, sreg, dreg, so, do, length, verify) in enumerate(descs):
        work.push({"transfer_id": i, "opcode": op, "src_region": sreg, "dst_region": dreg,
                   "src_offset": so, "dst_offset": do, "length": length,
                   "flags": int(verify), "checksum": 0, "position": so % (1 << 31)})
        assert kernel.poll()
        rec = comp.pop()
        assert rec is not None and int(rec["status"]) in set(abi.Status)
    assert (dst_full[:guard] == 0xA5).all() and (dst_full[guard + size:] == 0xA5).all()


FIELDS = ["offset", "length", "checksum", "message_id", "layer", "expert", "total_length"]


@FUZZ
@given(size16=st.integers(1, 14 * 32), seed=st.integers(0, 2**32 - 1),
       mutations=st.lists(st.tuples(st.integers(0, 13), st.sampled_from([*FIELDS, "payload"]),
                                    st.integers(0, 2**64 - 1)), max_size=6),
       cut16=st.integers(0, 64))
def test_fuzz_packets_against_cpu_twin(size16: int, seed: int, mutations: list[tuple],
                                       cut16: int) -> None:
    """Hostile rx packets into the receive twin: exactly the intact packets that fit land,
    byte for byte; every other one is refused and writes nothing; nothing is written past
    the destination (guard bytes)."""
    data = np.random.default_rng(seed).integers(0, 256, 16 * size16, dtype=np.uint8)
    ring = Ring.format(np.zeros(abi.ring_bytes(16, 64 + 512), np.uint8), abi.RingKind.RX_PACKET,
                       16, 64 + 512)
    n = packet_twin.send_packets(ring, data, seed, 0, 1, 2)
    idx = [(ring.consumed + p) & 15 for p in range(n)]
    before = [(ring.entries[i].copy(), ring.payload[i].copy()) for i in idx]
    for p, field, value in mutations:
        if p >= n:
            continue
        if field == "payload":
            ring.payload[idx[p], value % 512] ^= 1 + value % 255
        else:
            kind = ring.entries.dtype[field]
            ring.entries[idx[p]][field] = value % (1 << (8 * kind.itemsize))
    size = max(16, data.size - 16 * cut16)
    full = np.full(size + 64, 0xA5, np.uint8)
    full[:size] = 0
    start = ring.consumed
    # A part ends before a packet of another message (a changed message id).
    ids = [int(ring.entries[i]["message_id"]) for i in idx]
    part = next((p for p in range(1, n) if ids[p] != ids[0]), n)
    _, written, refused = packet_twin.receive_packets(ring, full[:size])
    # What the receiver checks: where (offset, length), the checksum and the payload; totals
    # are informational, ids only end a part. A packet changed in those is refused (short of
    # a 2**-32 checksum collision), an intact one lands if it fits. One change is no collision but a
    # valid packet: length 0 with checksum 0 (an empty payload's) at an aligned offset inside
    # the destination writes nothing and is accepted; the worker catches the short message by
    # its byte count (test_activations: a part delivered short is delivered again).
    checked = ["offset", "length", "checksum"]
    fits = [p for p in range(part)
            if all(ring.entries[idx[p]][f] == before[p][0][f] for f in checked)
            and np.array_equal(ring.payload[idx[p]][:int(before[p][0]["length"])],
                               before[p][1][:int(before[p][0]["length"])])
            and int(before[p][0]["offset"]) + int(before[p][0]["length"]) <= size]
    empty = [p for p in range(part) if p not in fits and int(ring.entries[idx[p]]["length"]) == 0
             and int(ring.entries[idx[p]]["checksum"]) == 0
             and int(ring.entries[idx[p]]["offset"]) % 16 == 0
             and int(ring.entries[idx[p]]["offset"]) <= size]
    expect = np.zeros(size, np.uint8)
    for p in fits:
        off, length = int(before[p][0]["offset"]), int(before[p][0]["length"])
        expect[off:off + length] = data[off:off + length]
    assert (written, refused) == (sum(int(before[p][0]["length"]) for p in fits),
                                  part - len(fits) - len(empty))
    np.testing.assert_array_equal(full[:size], expect)
    assert (full[size:] == 0xA5).all(), "written past the destination"
    assert ring.consumed == start + part


@FUZZ
@given(header=st.one_of(st.binary(max_size=64), st.dictionaries(
    st.text(max_size=12), st.one_of(
        st.fixed_dictionaries({"dtype": st.sampled_from(["BF16", "F32", "F8_E4M3", "X", 3]),
                               "shape": st.lists(st.integers(-2, 64), max_size=3),
                               "data_offsets": st.lists(st.integers(-8, 600), max_size=3)}),
        st.integers(), st.text(max_size=8)), max_size=4)),
    body=st.binary(max_size=512), declared=st.one_of(st.none(), st.integers(0, 1 << 40)))
def test_fuzz_safetensors_headers(tmp_path_factory: pytest.TempPathFactory, header, body: bytes,
                                  declared: int | None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(raw) if declared is None else declared
    path = tmp_path_factory.mktemp("st") / "x.safetensors"
    path.write_bytes(struct.pack("<Q", length) + raw + body)
    try:
        tensors, size = read_header(path)
    except CheckpointError as exc:
        assert str(path) in str(exc)
        return
    for t in tensors.values():
        assert 0 <= t.start and t.start + t.nbytes <= size


@FUZZ
@given(weight_map=st.one_of(st.dictionaries(st.text(max_size=60), st.one_of(
    st.text(max_size=20), st.integers(), st.just("model-00001-of-00001.safetensors")),
    max_size=6), st.text(max_size=20), st.none()), config=st.one_of(
    st.just({"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 1,
             "hidden_size": 8, "moe_intermediate_size": 8}),
    st.dictionaries(st.text(max_size=10), st.one_of(st.integers(-3, 5), st.text(max_size=5)),
                    max_size=4)))
def test_fuzz_index_files(tmp_path_factory: pytest.TempPathFactory, weight_map, config) -> None:
    root = tmp_path_factory.mktemp("idx")
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises((CheckpointError, LayoutError)):
        build_catalog(root)


@pytest.fixture(scope="module")
def channel_live(qwen_ckpt: Path) -> Iterator[tuple[AgentProcess, AgentClient, object, object]]:
    """An agent, a DMA-engine device, and a sentinel expert held READY in one slot."""
    with AgentProcess('[arena]\nbytes = "32MiB"\n[sessions]\nmax_lease_seconds = 60\n'
                      ) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "fc")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 4)],
                                     delivery="engine")
        sentinel = client.acquire(dev, SENTINEL).wait(10)  # slot 0, state entry 0
        yield agent, client, dev, sentinel


SENTINEL = ExpertKey("fc", 2, 5)
"""Held for the whole module; the entries below never name it (expert 5 is left out)."""

request_entries = st.lists(st.fixed_dictionaries({
    "opcode": st.one_of(st.sampled_from(list(abi.RequestOp)), st.integers(0, 2**16 - 1)),
    "model": st.one_of(st.integers(0, 2), u32), "layer": st.one_of(st.integers(0, 3), u32),
    "expert": st.one_of(st.integers(0, 4), st.integers(6, 2**32 - 1)),
    "flags": st.one_of(st.integers(0, 1), st.integers(0, 2**16 - 1)), "reuse": st.booleans(),
    "count": st.one_of(st.integers(0, 3), u32), "prefetch": st.one_of(st.integers(0, 7), u16),
    "posted_ns": st.one_of(st.just(0), st.integers(0, 2**64 - 1))}), min_size=1, max_size=8)


@FUZZ
@given(entries=request_entries)
def test_fuzz_request_ring(channel_live, entries: list[dict[str, int]]) -> None:
    """Hostile request-ring entries (unknown ops, models, layers, experts; reused ids; any
    posting time; ROUTE visits with any flags, token counts and prefetch, broken off anywhere;
    releases of what is not held): every one is answered with a known status (a message when
    refused), the sentinel slot's bytes and state never change, the agent keeps serving, and
    whatever was granted is released again."""
    agent, client, dev, sentinel = channel_live
    view = dev.channel.view
    before, state = sentinel.blob.copy(), view.words.copy()
    ring = view.requests
    base = dev.channel._next_id
    positions = []
    for j, e in enumerate(entries):
        rid = 1 if e["reuse"] else base + j
        positions.append(ring.produced)
        assert ring.push({"request_id": rid, "opcode": e["opcode"], "flags": e["flags"],
                          "model": e["model"], "layer": e["layer"], "expert": e["expert"],
                          "posted_ns": e["posted_ns"], "count": e["count"],
                          "prefetch": e["prefetch"]})
    dev.channel._next_id = base + len(entries) + 1
    dev.channel._bell.ring()  # as every client does after it published entries
    granted = []
    for pos, e in zip(positions, entries, strict=True):
        deadline = time.monotonic() + 10
        while (reply := view.reply_at(pos)) is None:
            assert time.monotonic() < deadline and agent.proc.poll() is None, "no reply"
            time.sleep(0.0005)
        status = abi.RequestStatus(int(reply["status"]))
        if status != abi.RequestStatus.OK:
            assert bytes(reply["message"]).strip(b"\0"), f"{status.name} without a message"
        elif e["opcode"] == abi.RequestOp.ACQUIRE:
            granted.append(ExpertKey("fc", e["layer"], e["expert"]))
        elif e["opcode"] == abi.RequestOp.RELEASE:  # only what this example acquired
            granted.remove(ExpertKey("fc", e["layer"], e["expert"]))
    for k in granted:
        client.release(dev, k)
    np.testing.assert_array_equal(sentinel.blob, before)
    assert split_word(int(view.words[0])) == split_word(int(state[0]))  # READY, same generation
    assert agent.proc.poll() is None
