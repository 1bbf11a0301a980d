"""Ring publication semantics and the chunk checksum's properties (its compiled loop against
the formula written out in NumPy)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_offload import abi
from dpu_offload.checksum import blob_checksums, chunk_checksum
from dpu_offload.ring import Ring, RingError


def _ring(kind: abi.RingKind = abi.RingKind.WORK, capacity: int = 8) -> Ring:
    buf = np.zeros(abi.ring_bytes(capacity, abi.entry_dtype_for(kind).itemsize), np.uint8)
    return Ring.format(buf, kind, capacity)


def test_push_pop_in_order_and_full() -> None:
    r = _ring(capacity=4)
    consumer = Ring(r.buffer, abi.RingKind.WORK)
    for i in range(4):
        assert r.push({"transfer_id": i, "opcode": abi.Opcode.COPY})
    assert not r.push({"transfer_id": 99}), "a full ring must refuse, not overwrite"
    assert consumer.pop()["transfer_id"] == 0
    assert r.push({"transfer_id": 4})
    got = [int(consumer.pop()["transfer_id"]) for _ in range(4)]
    assert got == [1, 2, 3, 4]
    assert consumer.pop() is None


@given(st.lists(st.integers(1, 7), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_push_many_wraps_and_preserves_order(batches: list[int]) -> None:
    r = _ring(capacity=8)
    consumer = Ring(r.buffer, abi.RingKind.WORK)
    sent, got = 0, []
    for n in batches:
        recs = np.zeros(n, abi.DESCRIPTOR_DTYPE)
        recs["transfer_id"] = np.arange(sent, sent + n)
        pushed = r.push_many(recs)
        assert pushed == min(n, 8 - (sent - len(got)))
        sent += pushed
        while (rec := consumer.pop()) is not None:
            got.append(int(rec["transfer_id"]))
    assert got == list(range(sent))


@given(st.lists(st.integers(1, 9), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_push_packed_wraps_publishes_whole_entries_or_none(batches: list[int]) -> None:
    """Request entries packed as ``abi.packer`` writes them come out field for field, across
    the ring's wrap; a batch that does not fit is refused whole and writes nothing."""
    r = _ring(abi.RingKind.REQUEST, capacity=8)
    consumer = Ring(r.buffer, abi.RingKind.REQUEST)
    packed = abi.packer(abi.REQUEST_DTYPE)
    sent, got = 0, []
    for n in batches:
        raw = bytearray(n * packed.size)
        for j in range(n):
            packed.pack_into(raw, j * packed.size, sent + j, abi.RequestOp.ROUTE, j % 2, 3,
                             sent + j, 7, 11, n, j, 0xFFFF)  # a seq the ring must not take
        before = r.buffer.copy()
        fits = n <= 8 - (sent - len(got))
        assert r.push_packed(raw, n) == fits
        if fits:
            sent += n
        else:
            assert np.array_equal(r.buffer, before)
        while (rec := consumer.pop()) is not None:
            got.append((int(rec["request_id"]), int(rec["layer"]), int(rec["count"]),
                        int(rec["posted_ns"])))
    assert [g[0] for g in got] == list(range(sent))
    assert all(layer == rid and posted == 11 for rid, layer, _, posted in got)


@pytest.mark.parametrize("field,value,msg", [("magic", 0, "magic"), ("version", 9, "version"),
                                              ("kind", 2, "kind"), ("capacity", 6, "power")])
def test_bad_header_refused(field: str, value: int, msg: str) -> None:
    r = _ring()
    r.header[field] = value
    with pytest.raises(RingError, match=msg):
        Ring(r.buffer, abi.RingKind.WORK)


def _reference_checksum(data: bytes, offset: int) -> int:
    """The module docstring's formula as a NumPy expression (what the compiled loop must
    equal)."""
    words = np.frombuffer(data, "<u4")
    g = (np.arange(words.size, dtype=np.uint64) + np.uint64(offset // 4)).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = words ^ (g * np.uint32(0x9E3779B1))
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return (int(h.sum(dtype=np.uint64)) & 0xFFFFFFFF) ^ (words.size & 0xFFFFFFFF)


@given(data=st.binary(max_size=4096), offset=st.integers(0, 2**42), skew=st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_the_compiled_checksum_is_the_formula(data: bytes, offset: int, skew: int) -> None:
    data = data[:len(data) // 4 * 4]
    offset -= offset % 4  # word offsets past 2**32 wrap as the formula's uint32 g does
    buf = bytearray(skew) + bytearray(data)  # any alignment of the caller's buffer
    chunk = np.frombuffer(buf, np.uint8)[skew:]
    assert chunk_checksum(chunk, offset) == _reference_checksum(data, offset)
    assert chunk_checksum(memoryview(bytes(data)), offset) == _reference_checksum(data, offset)


def test_the_checksum_refuses_what_is_not_words() -> None:
    with pytest.raises(ValueError, match="4-byte multiples"):
        chunk_checksum(np.zeros(6, np.uint8), 0)
    with pytest.raises(ValueError, match="4-byte multiples"):
        chunk_checksum(np.zeros(8, np.uint8), 2)
    with pytest.raises(ValueError, match="non-negative"):
        chunk_checksum(np.zeros(8, np.uint8), -4)


def test_checksum_catches_every_single_bit_flip() -> None:
    data = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    base = chunk_checksum(data, 0)
    for bit in range(0, 4096 * 8, 97):
        flipped = data.copy()
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert chunk_checksum(flipped, 0) != base


def test_checksum_depends_on_position_and_is_partitionable() -> None:
    data = np.random.default_rng(2).integers(0, 256, 8192, dtype=np.uint8)
    assert chunk_checksum(data, 0) != chunk_checksum(data, 8192)
    # The checksum is a sum of per-word terms: any split gives the same total.
    whole = chunk_checksum(data, 256)
    a = chunk_checksum(data[:4096], 256) ^ 1024
    b = chunk_checksum(data[4096:], 256 + 4096) ^ 1024
    assert ((a + b) & 0xFFFFFFFF) ^ 2048 == whole


def test_blob_checksums_cover_every_chunk() -> None:
    blob = np.arange(10_000, dtype=np.uint32).view(np.uint8)
    sums = blob_checksums(blob, 16_384)
    assert len(sums) == 3
    assert sums[2] == chunk_checksum(blob[32_768:], 32_768)


@given(cap=st.sampled_from([2, 4, 16, 64]),
       ops=st.lists(st.tuples(st.integers(0, 80), st.integers(0, 90)), max_size=30))
def test_pop_many_takes_what_was_pushed_in_order_across_wraps(cap: int, ops: list) -> None:
    """Producer and consumer over one buffer: every batch popped (at most ``limit``, probing
    the first entries one by one, then as an array) is the next run of what was pushed."""
    prod = Ring.format(np.zeros(abi.ring_bytes(cap, 32), np.uint8), abi.RingKind.COMPLETION, cap)
    cons = Ring(prod.buffer, abi.RingKind.COMPLETION)
    sent = got = 0
    for push, limit in ops:
        recs = np.zeros(push, abi.COMPLETION_DTYPE)
        recs["transfer_id"] = np.arange(sent, sent + push)
        sent += prod.push_many(recs)
        out = cons.pop_many(limit or None)
        assert out["transfer_id"].tolist() == list(range(got, got + out.size))
        assert out.size <= (limit or cap)
        got += out.size
    assert got + cons.pop_many().size == sent
