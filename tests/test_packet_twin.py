"""The compiled packet twin against the ABI's definitions: every header field as
abi.PACKET_HEADER_DTYPE names it, every checksum equal to dpu_offload.checksum's, and the
bytes back out unchanged; a flipped bit refused (CPU, no device)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_offload import abi, packets
from dpu_offload.checksum import chunk_checksum
from dpu_offload.ring import Ring
from gpu_kernels import packet_twin
from gpu_kernels.packet_ops import HostPacketOps

ROOM = 256
CAPACITY = 8


def _ring(start: int) -> Ring:
    buf = np.zeros(abi.ring_bytes(CAPACITY, 64 + ROOM), np.uint8)
    ring = Ring.format(buf, abi.RingKind.TX_PACKET, CAPACITY, 64 + ROOM)
    ring.advance_producer(start)  # start anywhere in the ring, wraps included
    ring.advance(start)
    return ring


@settings(max_examples=200, deadline=None)
@given(words=st.integers(0, CAPACITY * ROOM // 16), base=st.integers(0, 2**40),
       start=st.integers(0, 3 * CAPACITY), seed=st.integers(0, 2**32 - 1),
       slot=st.integers(0, 2**64 - 1), status=st.integers(0, 2**32 - 1))
def test_packets_carry_the_abi_fields_and_checksums(words: int, base: int, start: int,
                                                    seed: int, slot: int, status: int) -> None:
    base -= base % 16
    data = np.random.default_rng(seed).integers(0, 256, 16 * words, dtype=np.uint8)
    ring = _ring(start)
    n = packet_twin.send_packets(ring, data, 7, 3, 11, 5, base=base, total=base + data.size,
                                 slot=slot, status=status, flags=abi.PacketFlags.ERROR)
    assert n == max(1, -(-data.size // ROOM)) and ring.produced == start + n
    for p in range(n):
        i = (start + p) & (CAPACITY - 1)
        h, chunk = ring.entries[i], data[p * ROOM:(p + 1) * ROOM]
        assert int(h["seq"]) == start + p + 1
        assert (int(h["message_id"]), int(h["offset"]), int(h["length"])) == \
            (7, base + p * ROOM, chunk.size)
        assert (int(h["model"]), int(h["layer"]), int(h["expert"])) == (3, 11, 5)
        assert (int(h["total_length"]), int(h["slot"]), int(h["status"])) == \
            (base + data.size, slot, status)
        last = abi.PacketFlags.LAST | abi.PacketFlags.ERROR if p == n - 1 else 0
        assert int(h["flags"]) == last
        assert int(h["checksum"]) == chunk_checksum(chunk, base + p * ROOM)
        assert packet_twin.packet_at(ring, start + p) == tuple(
            int(h[f]) for f in packets.PacketHeader._fields)
    if base == 0:
        dst = np.zeros(data.size, np.uint8)
        assert HostPacketOps().receive(ring, dst, n) == (data.size, 0)
        np.testing.assert_array_equal(dst, data)


@settings(deadline=None)
@given(bit=st.integers(0, 2 * ROOM * 8 - 1))
def test_a_flipped_bit_is_refused_and_lands_nothing(bit: int) -> None:
    data = np.arange(2 * ROOM, dtype=np.uint8)
    ring = _ring(5)
    assert packet_twin.part_packets(ring) is None
    packet_twin.send_packets(ring, data, 1, 0, 0, 0)
    assert packet_twin.part_packets(ring) == 2
    ring.payload[(5 + bit // (ROOM * 8)) & (CAPACITY - 1), bit // 8 % ROOM] ^= 1 << bit % 8
    dst = np.zeros(data.size, np.uint8)
    assert packet_twin.receive_packets(ring, dst) == (1, ROOM, 1)
    bad = bit // (ROOM * 8)
    assert not dst[bad * ROOM:(bad + 1) * ROOM].any()
    good = 1 - bad
    np.testing.assert_array_equal(dst[good * ROOM:(good + 1) * ROOM],
                                  data[good * ROOM:(good + 1) * ROOM])


def test_a_length_no_packet_can_carry_is_refused_and_writes_nothing() -> None:
    ring = _ring(3)
    before = ring.buffer.copy()
    with pytest.raises(ValueError, match="multiples of 16"):
        packet_twin.send_packets(ring, np.zeros(20, np.uint8), 1, 0, 0, 0)
    assert ring.produced == 3
    np.testing.assert_array_equal(ring.buffer, before)
