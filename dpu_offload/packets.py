"""Packets in rx / tx packet rings, read and written by the layout ``abi.PACKET_HEADER_DTYPE``
defines (docs/ABI.md, docs/ACTIVATIONS.md): a header as Python ints, how many packets a message
part takes, the ``slot`` word the NIC stamps, and an ERROR packet's payload."""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from dpu_offload import abi


class PacketHeader(NamedTuple):
    """A packet header as Python ints (fields and meaning: ``abi.PACKET_HEADER_DTYPE``), read
    with :func:`packet_header`: a NumPy record and its field reads cost ~10x more, on the
    path of every activation message."""

    message_id: int
    offset: int
    length: int
    flags: int
    checksum: int
    layer: int
    expert: int
    model: int
    status: int
    total_length: int
    slot: int
    seq: int


_PACKET_HEADER_STRUCT = struct.Struct("<" + "".join(
    {2: "H", 4: "I", 8: "Q"}[abi.PACKET_HEADER_DTYPE.fields[name][0].itemsize]
    for name in PacketHeader._fields))
assert _PACKET_HEADER_STRUCT.size == abi.PACKET_HEADER_DTYPE.itemsize  # no padding: same layout


def packet_header(buffer: np.ndarray, offset: int) -> PacketHeader:
    """The packet header at byte ``offset`` of ``buffer`` (a ring's bytes)."""
    return PacketHeader._make(_PACKET_HEADER_STRUCT.unpack_from(buffer, offset))


def packet_room(entry_size: int) -> int:
    """Payload bytes a packet entry of ``entry_size`` bytes carries."""
    return entry_size - abi.PACKET_HEADER_DTYPE.itemsize


def packet_count(nbytes: int, entry_size: int) -> int:
    """Packets a part of ``nbytes`` takes in entries of ``entry_size`` bytes (an empty part
    takes one, flagged LAST)."""
    return max(1, -(-nbytes // packet_room(entry_size)))


def part_limit(capacity: int) -> int:
    """The most packets a producer writes as one part of a message into a packet ring of
    ``capacity`` entries: half of it, so that the consumer lands one part while the producer
    writes the next (the rule of the NIC stand-in, the worker and serve.cu alike)."""
    return max(1, capacity // 2)


def pack_slot(region_id: int, offset: int) -> int:
    """The ``slot`` word of a packet header for the slot at ``offset`` bytes in ``region_id``."""
    if not 0 <= offset < 1 << abi.SLOT_OFFSET_BITS or not 0 <= region_id < abi.MAX_REGIONS:
        raise ValueError(f"slot (region {region_id}, offset {offset}) does not fit a packet")
    return region_id << abi.SLOT_OFFSET_BITS | offset


def error_payload(reason: str, limit: int) -> np.ndarray:
    """The payload of an ERROR packet: ``reason`` in UTF-8, cut to ``limit`` bytes (a multiple
    of 16) and NUL-padded to a multiple of 16, ``uint8``."""
    raw = reason.encode()[:limit]
    out = np.zeros(max(16, -(-len(raw) // 16) * 16), np.uint8)
    out[:len(raw)] = np.frombuffer(raw, np.uint8)
    return out


def unpack_slot(word: int) -> tuple[int, int]:
    """(region id, byte offset) of a packet's ``slot`` word."""
    return word >> abi.SLOT_OFFSET_BITS, word & ((1 << abi.SLOT_OFFSET_BITS) - 1)
