"""The host's packet engine: twin of ``dpu_send`` (send.cu, packets.cuh) and
``dpu_receive_packets`` (receive_packets.cu) over the same packet rings
(``abi.PACKET_HEADER_DTYPE`` entries, docs/ABI.md), compiled with Numba.

The NIC stand-in writes every routed message into a worker's rx ring and reads every answer
from its tx ring through these functions, and the CPU reference device's worker does the
other half; interpreted NumPy cost ~100 us per 8 KiB message in each (measured,
docs/ACTIVATIONS.md), which is what the hardware they stand for spends nothing on. The loops
read like the kernels: one packet at a time, its checksum by ``dpu_offload.checksum``'s
compiled loop.

Publication order is the ABI's: payload and header first, then a full fence, then ``seq``
(a compiled loop may reorder its own stores, so the fence sits between two compiled calls);
a consumer reads ``seq``, fences, then the header and payload.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dpu_offload import abi
from dpu_offload.checksum import words_checksum
from dpu_offload.jit import keep_cache
from dpu_offload.packets import PacketHeader, packet_count, packet_header
from dpu_offload.ring import Ring, store_fence

keep_cache(__file__)

_HEADER = abi.PACKET_HEADER_DTYPE.itemsize
_F = abi.PACKET_HEADER_DTYPE.fields
# Header fields as word indices of an entry seen as u64 or u32 words.
_W64 = {name: _F[name][1] // 8 for name in ("message_id", "offset", "total_length", "slot",
                                            "seq")}
_W32 = {name: _F[name][1] // 4 for name in ("length", "flags", "checksum", "model", "status")}
_LAYER_EXPERT = _F["layer"][1] // 4
assert _F["expert"][1] == _F["layer"][1] + 2, "layer and expert share one u32 word"
_MID, _OFF, _TOTAL, _SLOT, _SEQ = (_W64[k] for k in ("message_id", "offset", "total_length",
                                                     "slot", "seq"))
_LEN, _FLAGS, _SUM, _MODEL, _STATUS = (_W32[k] for k in ("length", "flags", "checksum", "model",
                                                         "status"))
_LAST = int(abi.PacketFlags.LAST)


@njit(cache=True, nogil=True)
def _copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` as a loop: Numba compiles the loop to a memcpy (~39 GB/s measured),
    a slice assignment of bytes to a byte loop (~2 GB/s)."""
    for i in range(src.size):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def _write(raw: np.ndarray, data: np.ndarray, pos: int, message_id: np.uint64, model: int,
           layer: int, expert: int, base: np.uint64, total: np.uint64, slot: np.uint64,
           status: int, flags: int) -> int:
    """Payloads and headers (not ``seq``) of ``data``'s packets from ring position ``pos``;
    returns how many. The 64-bit fields come as ``uint64`` (any value), the rest as ints."""
    cap, size = raw.shape
    room = size - _HEADER
    w32, w64 = raw.view(np.uint32), raw.view(np.uint64)
    packets = max(1, (data.size + room - 1) // room)
    for p in range(packets):
        i = (pos + p) & (cap - 1)
        off = p * room
        n = min(room, data.size - off)
        at = base + np.uint64(off)
        _copy(raw[i, _HEADER:_HEADER + n], data[off:off + n])
        w64[i, _MID] = message_id
        w64[i, _OFF] = at
        w32[i, _LEN] = n
        w32[i, _FLAGS] = flags | _LAST if p == packets - 1 else 0
        w32[i, _SUM] = words_checksum(w32[i, _HEADER // 4:(_HEADER + n) // 4], at // np.uint64(4))
        w32[i, _LAYER_EXPERT] = (layer & 0xFFFF) | (expert & 0xFFFF) << 16
        w32[i, _MODEL] = model
        w32[i, _STATUS] = status
        w64[i, _TOTAL] = total
        w64[i, _SLOT] = slot
    return packets


@njit(cache=True, nogil=True)
def _publish(raw: np.ndarray, pos: int, packets: int) -> None:
    cap = raw.shape[0]
    w64 = raw.view(np.uint64)
    for p in range(packets):
        w64[(pos + p) & (cap - 1), _SEQ] = pos + p + 1


@njit(cache=True, nogil=True)
def _part(raw: np.ndarray, pos: int) -> int:
    """Packets of the next part from ``pos`` once all published, else -1 (part_packets)."""
    cap = raw.shape[0]
    w32, w64 = raw.view(np.uint32), raw.view(np.uint64)
    first = np.uint64(0)
    for k in range(cap):
        i = (pos + k) & (cap - 1)
        if w64[i, _SEQ] != pos + k + 1:
            return -1
        if k == 0:
            first = w64[i, _MID]
        elif w64[i, _MID] != first:
            return k
        if w32[i, _FLAGS] & _LAST:
            return k + 1
    return cap


@njit(cache=True, nogil=True)
def _land(raw: np.ndarray, pos: int, packets: int, dst: np.ndarray) -> tuple[int, int, int]:
    """Check and land ``packets`` packets from ``pos`` into ``dst``: (bytes written, packets
    refused, the last packet's message id)."""
    cap, size = raw.shape
    room = size - _HEADER
    w32, w64 = raw.view(np.uint32), raw.view(np.uint64)
    written = refused = 0
    message_id = np.uint64(0)
    for k in range(packets):
        i = (pos + k) & (cap - 1)
        off, n = w64[i, _OFF], np.uint64(w32[i, _LEN])
        message_id = w64[i, _MID]
        # Unsigned throughout, and no sum that could wrap: off <= dst.size, n <= dst.size - off.
        fits = (n <= np.uint64(room) and n % np.uint64(16) == 0 and off % np.uint64(16) == 0
                and off <= np.uint64(dst.size) and n <= np.uint64(dst.size) - off)
        if not fits or words_checksum(w32[i, _HEADER // 4:_HEADER // 4 + n // np.uint64(4)],
                                      off // np.uint64(4)) != np.uint64(w32[i, _SUM]):
            refused += 1
            continue
        _copy(dst[off:off + n], raw[i, _HEADER:_HEADER + n])
        written += np.int64(n)
    return written, refused, message_id


def _raw(ring: Ring) -> np.ndarray:
    assert ring.payload is not None, "not a packet ring"
    return ring.raw


def send_packets(tx: Ring, data: np.ndarray, message_id: int, model: int, layer: int,
                 expert: int, *, base: int = 0, total: int | None = None, slot: int = 0,
                 status: int = 0, flags: int = 0) -> int:
    """Twin of ``dpu_send``: publish ``data`` (``uint8``, length a multiple of 16), the part of
    a message of ``total`` bytes (default: ``data`` is all of it) that starts ``base`` bytes
    in, as packets on ``tx``, its last packet flagged LAST (and ``flags``); each header carries
    ``slot`` and ``status``. Returns packets written. Raises ValueError for a length that is
    not a multiple of 16 (no packet could carry it: a receiver refuses it), BufferError when
    the ring lacks room for them all (the kernel would wait instead)."""
    if data.size % 16:
        raise ValueError(f"{data.size} bytes: packets carry multiples of 16 bytes")
    raw = _raw(tx)
    packets = packet_count(data.size, tx.entry_size)
    if tx.free_entries() < packets:
        raise BufferError(f"{packets} packets, {tx.free_entries()} free entries")
    pos = tx.produced
    _write(raw, np.ascontiguousarray(data).reshape(-1).view(np.uint8), pos,
           np.uint64(message_id), int(model), int(layer), int(expert), np.uint64(base),
           np.uint64(data.size if total is None else total), np.uint64(slot), int(status),
           int(flags))
    store_fence()
    _publish(raw, pos, packets)
    tx.advance_producer(packets)
    return packets


def part_packets(rx: Ring) -> int | None:
    """How many packets the next part on ``rx`` has (up to its LAST one, or up to a packet of
    another message; a whole ring without either counts as a part, as the kernels take it)
    once they are all published, else None; nothing is consumed (the host's count for
    ``dpu_receive_packets``)."""
    n = _part(_raw(rx), rx.consumed)
    return None if n < 0 else n


def packet_at(ring: Ring, position: int) -> PacketHeader:
    """The header of the packet at ``position`` (a running count: taken modulo the ring's
    capacity) as it is now."""
    at = abi.HEADER_BYTES + (position & (ring.capacity - 1)) * ring.entry_size
    return packet_header(ring.buffer, at)


def peek_packet(rx: Ring) -> PacketHeader | None:
    """The header of the next packet on ``rx`` once it is published, else None; nothing is
    consumed."""
    assert rx.payload is not None, "not a packet ring"
    if not rx.has_entries():
        return None
    store_fence()
    return packet_at(rx, rx.consumed)


def receive_packets(rx: Ring, dst: np.ndarray, packets: int | None = None
                    ) -> tuple[int, int, int]:
    """Twin of ``dpu_receive_packets``: consume the next part's packets (``packets`` of them,
    default :func:`part_packets`) from ``rx`` into ``dst`` (``uint8``): a packet whose payload
    is 16-byte aligned, fits its entry and lands inside ``dst`` has its checksum verified and,
    when it matches, its payload written at its offset; nothing is written past ``dst``.
    Returns (message id of the last packet, bytes written, packets refused). Raises
    BufferError if the part is not complete in the ring yet (nothing is consumed then)."""
    if not dst.flags.c_contiguous:
        raise ValueError("dst must be one contiguous buffer")
    raw = _raw(rx)
    n = _part(raw, rx.consumed) if packets is None else packets
    if n < 0:
        raise BufferError("message incomplete in the rx ring")
    store_fence()
    written, refused, message_id = _land(raw, rx.consumed, int(n),
                                         dst.reshape(-1).view(np.uint8))
    rx.advance(n)
    return int(message_id), int(written), int(refused)


def warm_up() -> None:
    """Compile (or load from Numba's cache) every loop here, so that the first message does
    not pay for it (seconds on a cold cache, ~0.3 s warm)."""
    buf = np.zeros(abi.ring_bytes(2, _HEADER + 16), np.uint8)
    ring = Ring.format(buf, abi.RingKind.TX_PACKET, 2, _HEADER + 16)
    send_packets(ring, np.zeros(16, np.uint8), 0, 0, 0, 0)
    receive_packets(ring, np.zeros(16, np.uint8))
