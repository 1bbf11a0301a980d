"""The ring ABI: the one memory contract between the agent, the host client and the kernels.

Everything here is plain NumPy so that the agent (aarch64, no CUDA) can import it. The C view of
the same layout is ``dpu_offload/include/ring.cuh``; ``tests/test_abi.py`` compiles that header
and proves every size, offset and constant identical to what this module declares.

A ring is one contiguous buffer: a 256-byte :data:`HEADER_DTYPE` followed by ``capacity``
entries of ``entry_size`` bytes. Publication is store-only (no CPU-GPU atomics exist on the H200
host): the producer writes an entry's fields, fences, then writes the entry's ``seq`` word as
``position + 1``. The consumer polls ``seq`` and alone advances ``consumer``. See docs/ABI.md.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import numpy as np

RING_MAGIC = 0x52555044  # b"DPUR" read little-endian
ABI_VERSION = 4
HEADER_BYTES = 256
CACHE_LINE_BYTES = 64
COPY_ALIGN_BYTES = 16
"""Offsets and lengths of COPY descriptors must be multiples of this (one 16-byte vector load)."""
MAX_REGIONS = 64
"""Entries of a region table; region ids are indexes into it."""


class RingKind(IntEnum):
    """What a ring carries; recorded in the header so a consumer can refuse the wrong ring."""

    WORK = 1
    COMPLETION = 2
    RX_PACKET = 3
    TX_PACKET = 4
    REQUEST = 5


class Opcode(IntEnum):
    """Work descriptor opcodes."""

    NOP = 0
    COPY = 1
    PACKET = 2
    FENCE = 3
    EXIT = 4
    SIGNAL = 5
    """DMA-engine rings only: once every earlier descriptor of the ring has landed, write a
    slot-state entry of the device's channel (``dst_offset``: its byte offset in the slot-state
    table; ``checksum``: its ``expected``; ``src_offset``: its word, which must read LANDED), as a
    DMA engine writes a semaphore after the payload. Skipped (CANCELLED) when a COPY of the
    same ``transfer_id`` failed."""


class Status(IntEnum):
    """Completion statuses. Anything but OK means no byte outside the regions was touched and
    the destination must not be considered valid."""

    OK = 0
    CHECKSUM_MISMATCH = 1
    OUT_OF_BOUNDS = 2
    BAD_OPCODE = 3
    BAD_ALIGNMENT = 4
    BAD_REGION = 5
    BAD_RING = 6
    CANCELLED = 7


class DescriptorFlags(IntEnum):
    """Bits of a work descriptor's ``flags``."""

    VERIFY = 1
    """Compute the chunk checksum over the copied bytes and compare it with ``checksum``."""


class ReplyFlags(IntEnum):
    """Bits of a reply's ``flags``."""

    RESIDENT = 1
    """The slot already held the expert, or was receiving it: this acquire started no
    delivery (a cache hit)."""
    PIN_HELD = 2
    """The client holds this grant by a pin: it adds one to the slot's ``pins`` and
    ``touches`` when it takes the reply, the agent drops the grant's reference once it sees
    ``touches`` move past their value at the grant, and the client releases by unpinning
    (no RELEASE posted). Granted on devices whose consumer checks what lands (DMA engine)."""


class RegionFlags(IntEnum):
    """Bits of a region table entry's ``flags``."""

    READABLE = 1
    WRITABLE = 2


HEADER_DTYPE = np.dtype(
    {
        "names": ["magic", "version", "kind", "entry_size", "capacity", "exit_flag", "fault",
                  "producer", "doorbell", "sleepers", "consumer"],
        "formats": ["<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u4", "<u8", "<u4", "<u8", "<u8"],
        "offsets": [0, 4, 8, 12, 16, 20, 24, 64, 76, 80, 128],
        "itemsize": HEADER_BYTES,
    }
)
"""Ring header. ``producer`` and ``consumer`` are monotonically increasing positions (entries,
not bytes), each on its own cache line and written only by its owner. ``exit_flag`` is set by
the host to stop a persistent consumer; ``fault`` holds a :class:`Status` a consumer reports
when the ring itself is unusable (wrong magic or version). ``sleepers`` (request rings): who of
the producer's threads sleep on a futex of the channel (a reply's ``seq`` or a slot-state
``word``), one 64-bit store: the low 32 bits count them, the high 32 bits hold the channel byte
offset of the word they all sleep on, or ``SLEEPING_ON_ANY`` when they sleep on several. The
agent and the DMA engine make the wake system call only for a word someone may sleep on (a
hint: a wrong value costs the producer its own latency, nothing else). ``doorbell`` (packet
rings) is 1 while the producer writes a byte into the ring's doorbell FIFO after each
publication (``dpu_offload.port_bell``), so the consumer may sleep on it; 0 (a GPU kernel
producing, or no FIFO): the consumer polls."""

SLEEPING_ON_ANY = 0xFFFFFFFF
"""``sleepers``' high half when the producer's sleepers wait on more than one word."""

DESCRIPTOR_DTYPE = np.dtype(
    {
        "names": ["transfer_id", "opcode", "flags", "chunk_index", "chunk_count", "src_region",
                  "src_offset", "dst_region", "checksum", "dst_offset", "length", "position",
                  "seq"],
        "formats": ["<u8", "<u2", "<u2", "<u4", "<u4", "<u4", "<u8", "<u4", "<u4", "<u8", "<u4",
                    "<u4", "<u8"],
        "offsets": [0, 8, 10, 12, 16, 20, 24, 32, 36, 40, 48, 52, 56],
        "itemsize": 64,
    }
)
"""Work descriptor, 64 bytes: move ``length`` bytes from (src_region, src_offset) to
(dst_region, dst_offset); with the VERIFY flag, check ``checksum`` (see checksum.py) over the
bytes copied, mixed with ``position``: the chunk's byte offset within its object (an expert
blob or a message), so a chunk delivered to the wrong place fails. A SIGNAL has no source:
its ``src_offset`` holds the word it writes."""

COMPLETION_DTYPE = np.dtype(
    {
        "names": ["transfer_id", "chunk_index", "status", "nbytes", "seq"],
        "formats": ["<u8", "<u4", "<u4", "<u8", "<u8"],
        "offsets": [0, 8, 12, 16, 24],
        "itemsize": 32,
    }
)
"""Completion entry, 32 bytes: one per consumed descriptor; ``nbytes`` is what was written."""

REGION_DTYPE = np.dtype(
    {
        "names": ["base", "size", "flags", "generation"],
        "formats": ["<u8", "<u8", "<u4", "<u4"],
        "offsets": [0, 8, 16, 20],
        "itemsize": 32,
    }
)
"""Region table entry, 32 bytes: a consumer's own address of region ``id`` (device pointer on
a GPU, offset into a process mapping on the CPU reference device) and its size in bytes. An
entry with ``size == 0`` is unregistered."""

PACKET_HEADER_DTYPE = np.dtype(
    {
        "names": ["message_id", "offset", "length", "flags", "checksum", "layer", "expert",
                  "model", "status", "total_length", "slot", "seq"],
        "formats": ["<u8", "<u8", "<u4", "<u4", "<u4", "<u2", "<u2", "<u4", "<u4", "<u8", "<u8",
                    "<u8"],
        "offsets": [0, 8, 16, 20, 24, 28, 30, 32, 36, 40, 48, 56],
        "itemsize": 64,
    }
)
"""Header of an rx/tx packet ring entry; the payload (``length`` bytes, at most the entry size
minus 64) follows it in the same entry. ``offset`` is the payload's byte position within the
message of ``total_length`` bytes; ``checksum`` covers the payload mixed with ``offset``.
On the activation path (docs/ACTIVATIONS.md) the NIC stamps each rx packet with the expert's
``slot`` on the worker's device (``pack_slot``), and a tx packet flagged ``ERROR`` carries a
``FrameStatus`` in ``status`` and the reason as its payload."""


SLOT_OFFSET_BITS = 48
"""A packet's ``slot``: region id above this many bits, the slot's byte offset in the region
below."""


class PacketFlags(IntEnum):
    """Bits of a packet header's ``flags``."""

    LAST = 1
    ERROR = 2
    """A tx packet answering its message with an error (``status``, reason in the payload)."""




# -- the data-plane channel: client requests, agent replies, slot states ---------------------

MAX_CHANNEL_SLOTS = 16384
"""Slot-state entries of a channel: the most slots one device's pools may hold together
(DeepSeek-V3's 14,848 routed experts, gpt-oss-120b's 4,608: every expert of either fits)."""
SLOT_STATE_BITS = 8
"""A slot-state ``word`` is ``generation << SLOT_STATE_BITS | SlotState``."""


class RequestOp(IntEnum):
    """What a request-ring entry asks of the agent."""

    ACQUIRE = 1
    """Hold (model, layer, expert) in a slot of this device, delivering it if needed."""
    RELEASE = 2
    """Drop one reference taken by an ACQUIRE of the same expert."""
    PREFETCH = 3
    """Deliver the expert ahead of use; no reference is taken."""
    ROUTE = 4
    """One expert a MoE layer's routing selected (``count`` tokens chose it): a visit of the
    layer is its consecutive ROUTE entries, the last flagged :attr:`RequestFlags.LAST`; the
    agent folds the visit into its routing statistics and, with ``prefetch`` k > 0 on the last
    entry, prefetches into this device the k experts it expects the next MoE layer to select."""


MAX_ROUTE_COUNT = 2**20
"""The most tokens one ROUTE entry may say chose its expert (a step's batch is far smaller)."""


class RequestFlags(IntEnum):
    """Bits of a request entry's ``flags``; any other bit is refused (INVALID_ARGUMENT)."""

    LAST = 1
    """ROUTE: the entry ends its layer's visit."""


class RequestStatus(IntEnum):
    """A reply's ``status``: OK, or what was wrong with the request (the reply's ``message``
    says more). Nothing changed for a request answered with an error."""

    OK = 0
    BAD_OPCODE = 1
    INVALID_ARGUMENT = 2
    NOT_FOUND = 3
    ALREADY_EXISTS = 4
    FAILED_PRECONDITION = 5
    PERMISSION_DENIED = 6
    RESOURCE_EXHAUSTED = 7
    UNAVAILABLE = 8
    REQUEST_REUSED = 9
    """``request_id`` is not greater than the channel's previous one."""


class SlotState(IntEnum):
    """State of a slot in the slot-state table (the low bits of its ``word``)."""

    FREE = 0
    FILLING = 1
    READY = 2
    """Every chunk of the expert's bytes was verified in the slot."""
    FAILED = 3
    """The delivery of this generation failed for good; ``status`` is an :class:`Status`."""
    LANDED = 4
    """Every chunk was copied into the slot and nothing has checked it yet (a DMA-engine
    device): ``expected`` holds the blob's sum, and the slot's consumer, in the inference
    process, checksums the slot and writes READY, or FAILED with CHECKSUM_MISMATCH."""
    EVICTING = 5
    """The agent is about to give the slot to another delivery and reads its pins first
    (:data:`PIN_DTYPE`): the slot's previous word comes back if the client pinned it, else the
    next generation's FILLING follows. A waiter keeps waiting; a pin fails."""


REQUEST_DTYPE = np.dtype(
    {
        "names": ["request_id", "opcode", "flags", "model", "layer", "expert", "posted_ns",
                  "count", "prefetch", "seq"],
        "formats": ["<u8", "<u2", "<u2", "<u4", "<u4", "<u4", "<u8", "<u4", "<u2", "<u8"],
        "offsets": [0, 8, 10, 12, 16, 20, 24, 32, 36, 56],
        "itemsize": 64,
    }
)
"""Request-ring entry, 64 bytes (client -> agent): ``opcode`` a :class:`RequestOp` on expert
(``model`` index from LoadModel, ``layer``, ``expert``). ``request_id`` increases strictly per
channel; the reply to the entry at ring position ``p`` is ``replies[p % capacity]``.
``posted_ns``: the client's CLOCK_MONOTONIC when it posted (nanoseconds), a diagnostic only: the
agent measures how long entries wait to be served from it (one clock on one host; a BlueField
reads another clock, and a client can write anything: never trusted beyond the metric).
``count`` and ``prefetch`` are ROUTE's (tokens that chose the expert; experts of the next layer
to prefetch, on the visit's last entry), 0 in every other entry."""

MAX_ROUTE_PREFETCH = int(np.iinfo(REQUEST_DTYPE["prefetch"]).max)
"""The most experts a ROUTE entry's ``prefetch`` can ask for (its field's range; the agent
refuses more than the next layer has)."""
MAX_KEY_FIELD = int(np.iinfo(REQUEST_DTYPE["layer"]).max)
"""The largest ``layer`` or ``expert`` a request entry can carry."""

REPLY_DTYPE = np.dtype(
    {
        "names": ["request_id", "status", "region_id", "slot_index", "state_index",
                  "generation", "slot_offset", "message", "flags", "seq"],
        "formats": ["<u8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u8", "S76", "<u4", "<u8"],
        "offsets": [0, 8, 12, 16, 20, 24, 32, 40, 116, 120],
        "itemsize": 128,
    }
)
"""Reply-table entry, 128 bytes (agent -> client), published like a ring entry (``seq`` =
request position + 1, written last). For an ACQUIRE: the slot (``region_id``, ``slot_index``,
``slot_offset`` in bytes) and where to watch it (``state_index`` into the slot-state table,
``generation``) and ``flags`` (:class:`ReplyFlags`). ``message``: UTF-8, NUL-padded, says
what was wrong when ``status`` is not OK."""

SLOT_STATE_DTYPE = np.dtype(
    {
        "names": ["word", "status", "expected"],
        "formats": ["<u8", "<u4", "<u4"],
        "offsets": [0, 8, 12],
        "itemsize": 16,
    }
)
"""Slot-state entry, 16 bytes: ``word`` = ``generation << SLOT_STATE_BITS | SlotState``, one
64-bit store, so a reader sees state and generation together; ``status`` (a :class:`Status`) is
written before ``word`` when the state is FAILED; ``expected`` (written before ``word`` when
the state is LANDED) is ``checksum.blob_sum`` of the blob that should be in the slot. The
generation grows each time the slot is given to a new delivery."""


CHECK_DTYPE = np.dtype(
    {
        "names": ["reply", "seq", "states", "n16"],
        "formats": ["<u8", "<u8", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24],
        "itemsize": 32,
    }
)
"""One slot of a batch check (``cuda_ops.verify_granted_batch``), 32 bytes, in host memory the
device maps, written when the batch's ACQUIREs are posted, before any is answered: the device
address of the request's reply entry (``reply``) and the ``seq`` that entry reads once answered
(ring position + 1), the device address of the channel's slot-state table (``states``) and the
blob's length in 16-byte vectors (``n16``). The check takes the slot from the reply (its
``region_id`` in the device's region table, ``slot_offset``, ``state_index``, ``generation``),
bounds-checked there. Written by the client, read only by its own kernels."""


PIN_DTYPE = np.dtype(
    {
        "names": ["pins", "touches"],
        "formats": ["<u4", "<u4"],
        "offsets": [0, 4],
        "itemsize": 8,
    }
)
"""Pin-table entry, 8 bytes (client -> agent), one per slot-state entry: ``pins`` counts the
references the client holds on the slot without the agent (pinned hits on its READY generation,
and ``ReplyFlags.PIN_HELD`` grants; the agent never gives a pinned slot to another delivery),
``touches`` how many pins the slot has had (mod 2^32): uses the agent's eviction order was not
told of, and the sign that a PIN_HELD grant's pin is in place. Written by the client only; the
agent reads it and trusts it with nothing but the client's own slots."""


BELL_DTYPE = np.dtype(
    {
        "names": ["rings", "sleeping"],
        "formats": ["<u4", "<u4"],
        "offsets": [0, 4],
        "itemsize": 64,
    }
)
"""The agent's doorbell, 64 bytes, one per agent, mapped by every client: ``rings`` (a futex
word) changes each time a client rang while the agent's data-plane loop was asleep on it,
``sleeping`` is 1 while the loop is (about to be) asleep. A client that posted a request fences
and, if ``sleeping``, adds one to ``rings`` and wakes it; the loop stores ``sleeping``, fences,
looks once more for work, then sleeps while ``rings`` is unchanged (docs/ABI.md, "The agent's
doorbell"). It carries no data: a client that writes garbage into it can wake the agent, make
posts pay a wake, or leave posts until the loop's timed wake-up (50 ms), nothing more."""


class ChannelLayout(NamedTuple):
    """Byte offsets of a channel's parts (the request ring starts at 0) and its size."""

    replies: int
    states: int
    pins: int
    total: int


def channel_layout(capacity: int) -> ChannelLayout:
    """Where the parts of a channel whose request ring holds ``capacity`` entries lie."""
    replies = ring_bytes(capacity, REQUEST_DTYPE.itemsize)
    states = replies + capacity * REPLY_DTYPE.itemsize
    pins = states + MAX_CHANNEL_SLOTS * SLOT_STATE_DTYPE.itemsize
    return ChannelLayout(replies, states, pins, pins + MAX_CHANNEL_SLOTS * PIN_DTYPE.itemsize)


def ring_bytes(capacity: int, entry_size: int) -> int:
    """Total bytes of a ring of ``capacity`` entries of ``entry_size`` bytes, header included."""
    return HEADER_BYTES + capacity * entry_size


def packer(dtype: np.dtype) -> struct.Struct:
    """The :class:`struct.Struct` of ``dtype`` (little-endian, gaps as pad bytes): writing one
    entry with ``pack_into`` costs a fraction of a NumPy structured assignment."""
    codes = {(np.dtype(t).kind, np.dtype(t).itemsize): c for t, c in
             (("<u1", "B"), ("<u2", "H"), ("<u4", "I"), ("<u8", "Q"), ("<i4", "i"),
              ("<i8", "q"))}
    fmt, at = "<", 0
    for ftype, offset in sorted((f[:2] for f in dtype.fields.values()), key=lambda f: f[1]):
        fmt += f"{offset - at}x" if offset > at else ""
        fmt += f"{ftype.itemsize}s" if ftype.kind == "S" else codes[(ftype.kind, ftype.itemsize)]
        at = offset + ftype.itemsize
    fmt += f"{dtype.itemsize - at}x" if dtype.itemsize > at else ""
    packed = struct.Struct(fmt)
    assert packed.size == dtype.itemsize, (dtype, fmt)
    return packed


def entry_dtype_for(kind: RingKind) -> np.dtype:
    """The fixed entry layout of a ring kind (packet rings carry a header plus payload)."""
    return {
        RingKind.WORK: DESCRIPTOR_DTYPE,
        RingKind.COMPLETION: COMPLETION_DTYPE,
        RingKind.RX_PACKET: PACKET_HEADER_DTYPE,
        RingKind.TX_PACKET: PACKET_HEADER_DTYPE,
        RingKind.REQUEST: REQUEST_DTYPE,
    }[kind]


for _dtype, _size in ((DESCRIPTOR_DTYPE, 64), (COMPLETION_DTYPE, 32), (REGION_DTYPE, 32),
                      (HEADER_DTYPE, HEADER_BYTES), (PACKET_HEADER_DTYPE, 64),
                      (REQUEST_DTYPE, 64), (REPLY_DTYPE, 128), (SLOT_STATE_DTYPE, 16),
                      (PIN_DTYPE, 8)):
    assert _dtype.itemsize == _size, _dtype
