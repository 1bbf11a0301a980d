"""Transfers in flight: an expert delivery cut into chunk descriptors, and the bookkeeping
that turns completion entries into one outcome per transfer."""

from __future__ import annotations

import functools
import itertools
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dpu_offload import abi


@dataclass(frozen=True)
class Signal:
    """What the DMA engine writes once a delivery's bytes have landed: the slot-state entry at
    byte ``offset`` of the device's slot-state table gets ``word`` (LANDED for the delivery's
    generation)."""

    offset: int
    word: int


@dataclass(frozen=True)
class TransferPlan:
    """The byte moves of one delivery: a blob of ``nbytes`` at (src_region, src_offset) to
    (dst_region, dst_offset), cut into ``chunk_bytes`` chunks with their checksums, each
    checked where it lands when ``verify`` (VERIFY set), else left to the slot's consumer."""

    src_region: int
    src_offset: int
    dst_region: int
    dst_offset: int
    nbytes: int
    chunk_bytes: int
    checksums: tuple[int, ...]
    verify: bool = True
    signal: Signal | None = None
    """A DMA-engine delivery's SIGNAL, posted after its chunks."""

    @property
    def span(self) -> bool:
        """Whether the blob is posted as one COPY spanning it: a DMA-engine delivery (one with
        a SIGNAL), which the engine moves as one run either way and whose chunks nothing
        checks where they land (the slot's consumer checks the blob's sum)."""
        return self.signal is not None

    @property
    def descriptor_count(self) -> int:
        """Descriptors posted, so completions expected: the chunks (one spanning the blob
        when ``span``) and the SIGNAL if any."""
        return (1 if self.span else len(self.checksums)) + (self.signal is not None)

    def descriptors(self, transfer_id: int) -> np.ndarray:
        """``DESCRIPTOR_DTYPE[descriptor_count]`` for this plan: its chunks (VERIFY on each if
        ``verify``), or, when ``span``, one COPY of the whole blob (checksum 0) and its
        SIGNAL."""
        if self.signal is not None:
            return self._span_descriptors(transfer_id, self.signal)
        source, positions = _source_side(self.src_region, self.src_offset, self.nbytes,
                                         self.chunk_bytes, self.checksums, self.verify)
        d = source.copy()
        words = d.view(np.uint64).reshape(d.size, _WORDS)
        words[:, _W_TRANSFER] = transfer_id
        d.view(np.uint32).reshape(d.size, 2 * _WORDS)[:, _H_DST_REGION] = self.dst_region
        words[:, _W_DST_OFFSET] = positions + np.uint64(self.dst_offset)
        return d

    def _span_descriptors(self, transfer_id: int, signal: Signal) -> np.ndarray:
        """A DMA-engine delivery's two descriptors: the cached source side's bytes with this
        delivery's fields packed in (a few ``struct`` stores, no array operation: this runs
        for every cold acquire on the agent's data path)."""
        buf = bytearray(_span_source(self.src_region, self.src_offset, self.nbytes,
                                     self.verify))
        _U64.pack_into(buf, _AT["transfer_id"], transfer_id)
        _COPY_DESTINATION.pack_into(buf, _AT["dst_region"], self.dst_region, 0, self.dst_offset)
        _U64.pack_into(buf, _ROW + _AT["transfer_id"], transfer_id)
        _SIGNAL_TARGET.pack_into(buf, _ROW + _AT["src_offset"], signal.word, 0, 0,
                                 signal.offset)
        return np.frombuffer(buf, abi.DESCRIPTOR_DTYPE)


_ROW = abi.DESCRIPTOR_DTYPE.itemsize
_WORDS = _ROW // 8
_AT = {name: f[1] for name, f in abi.DESCRIPTOR_DTYPE.fields.items()}
"""Field -> byte offset in a descriptor row."""
_W_TRANSFER, _W_DST_OFFSET = _AT["transfer_id"] // 8, _AT["dst_offset"] // 8
_H_DST_REGION = _AT["dst_region"] // 4


@functools.lru_cache(maxsize=1024)
def _source_side(src_region: int, src_offset: int, nbytes: int, chunk_bytes: int,
                 checksums: tuple[int, ...], verify: bool) -> tuple[np.ndarray, np.ndarray]:
    """The chunk descriptors of a blob's delivery without their destination and transfer id
    (the same for every delivery of a cached blob, so built once), and the chunks' positions
    (``uint64[chunks]``, bytes)."""
    n = len(checksums)
    d = np.zeros(n, dtype=abi.DESCRIPTOR_DTYPE)
    pos = np.arange(n, dtype=np.uint64) * np.uint64(chunk_bytes)
    d["chunk_count"] = n
    d["chunk_index"] = np.arange(n)
    d["opcode"] = abi.Opcode.COPY
    d["flags"] = abi.DescriptorFlags.VERIFY if verify else 0
    d["src_region"] = src_region
    d["src_offset"] = pos + np.uint64(src_offset)
    d["length"] = np.minimum(np.uint64(chunk_bytes), np.uint64(nbytes) - pos)
    d["position"] = pos
    d["checksum"] = np.asarray(checksums, dtype=np.uint32)
    d.flags.writeable = False
    pos.flags.writeable = False
    return d, pos


assert _AT["src_offset"] + 8 == _AT["dst_region"] and _AT["dst_region"] + 4 == _AT["checksum"] \
    and _AT["checksum"] + 4 == _AT["dst_offset"], "the span path packs these fields as one run"
_U64 = struct.Struct("<Q")
_COPY_DESTINATION = struct.Struct("<IIQ")
"""A span COPY's dst_region, checksum (0) and dst_offset, one run of the row."""
_SIGNAL_TARGET = struct.Struct("<QIIQ")
"""A SIGNAL's src_offset (the word it writes), dst_region and checksum (0) and dst_offset (the
slot-state entry's byte offset), one run of the row."""


@functools.lru_cache(maxsize=1024)
def _span_source(src_region: int, src_offset: int, nbytes: int, verify: bool) -> bytes:
    """A span delivery's two descriptors (a COPY of the blob, its SIGNAL) without their
    transfer id, destination and SIGNAL word, as bytes."""
    d = np.zeros(2, dtype=abi.DESCRIPTOR_DTYPE)
    d["chunk_count"] = 2
    d["chunk_index"] = [0, 1]
    d["opcode"] = [abi.Opcode.COPY, abi.Opcode.SIGNAL]
    d["flags"][0] = abi.DescriptorFlags.VERIFY if verify else 0
    d["src_region"][0] = src_region
    d["src_offset"][0] = src_offset
    d["length"][0] = nbytes
    return d.tobytes()


_FEW = 64
"""complete_many folds at most this many completions in plain Python (cheaper than the
array passes for the few runs a single delivery lands as)."""


def _fold_few(recs: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """(transfer ids, completions per id, bytes per id) of ``recs``, ids in first-seen order."""
    count: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    for tid, n in zip(recs["transfer_id"].tolist(), recs["nbytes"].tolist(), strict=True):
        count[tid] = count.get(tid, 0) + 1
        nbytes[tid] = nbytes.get(tid, 0) + n
    return list(count), list(count.values()), list(nbytes.values())


@dataclass
class Transfer:
    """One delivery in flight."""

    transfer_id: int
    plan: TransferPlan
    on_done: Callable[[Transfer], None]
    chunks_done: int = 0
    bytes_done: int = 0
    status: abi.Status = abi.Status.OK
    failed_chunks: list[int] = field(default_factory=list)
    owner: object | None = None
    """What the transfer serves (the agent's Device); cancellation selects by it."""
    rung: bool = False
    """Whether its completions come with a ring of the agent's doorbell (the DMA engine's
    do; a device consumer's are only found by polling)."""
    started: float = field(default_factory=time.monotonic)
    """When the descriptors were posted (monotonic seconds)."""

    @property
    def chunk_count(self) -> int:
        """Completions that finish the transfer (a SIGNAL's included)."""
        return self.plan.descriptor_count


_STATUSES: dict[int, abi.Status] = dict(abi.Status._value2member_map_)  # type: ignore[arg-type]
"""A completion's ``status`` as :class:`abi.Status`; one the ABI does not define (the ring's
writer is a consumer the agent does not trust) fails its transfer as BAD_RING."""


class TransferTracker:
    """Assigns transfer ids and folds completion entries into transfers.

    ``on_done`` of a transfer is called exactly once, from the thread that delivered its last
    completion, with ``status`` OK only if every chunk completed OK.
    """

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._live: dict[int, Transfer] = {}
        self._unrung = 0

    def start(self, plan: TransferPlan, on_done: Callable[[Transfer], None],
              owner: object | None = None, rung: bool = False) -> Transfer:
        with self._lock:
            t = Transfer(next(self._ids), plan, on_done, owner=owner, rung=rung)
            self._live[t.transfer_id] = t
            self._unrung += not rung
        return t

    def _forget(self, t: Transfer) -> None:
        del self._live[t.transfer_id]
        self._unrung -= not t.rung

    def complete_many(self, recs: np.ndarray) -> list[Transfer]:
        """Fold a batch of completion entries in (one pass per transfer, not per chunk: array
        passes for a large batch, a dict for a few entries); returns the transfers they
        finished, whose ``on_done`` has been called."""
        if recs.size == 0:
            return []
        if recs.size <= _FEW:
            ids, counts, nbytes = _fold_few(recs)
        else:
            uniq, inverse = np.unique(recs["transfer_id"], return_inverse=True)
            ids = uniq.tolist()
            counts = np.bincount(inverse, minlength=uniq.size).tolist()
            nbytes = np.bincount(inverse, weights=recs["nbytes"].astype(np.float64),
                                 minlength=uniq.size).tolist()
        bad = np.flatnonzero(recs["status"] != 0)
        finished = []
        with self._lock:
            for j, tid in enumerate(ids):
                t = self._live.get(tid)
                if t is None:
                    continue
                t.chunks_done += int(counts[j])
                t.bytes_done += int(nbytes[j])
                if t.chunks_done >= t.chunk_count:
                    self._forget(t)
                    finished.append(t)
            for i in bad.tolist():
                t = self._live.get(int(recs["transfer_id"][i])) or next(
                    (f for f in finished if f.transfer_id == int(recs["transfer_id"][i])), None)
                if t is not None:
                    t.failed_chunks.append(int(recs["chunk_index"][i]))
                    if t.status == abi.Status.OK:
                        t.status = _STATUSES.get(int(recs["status"][i]), abi.Status.BAD_RING)
        for t in finished:
            t.on_done(t)
        return finished

    def cancel(self, predicate: Callable[[Transfer], bool]) -> list[Transfer]:
        """Finish every live transfer matching ``predicate`` as CANCELLED (their device went
        away); late completions for them are ignored."""
        with self._lock:
            gone = [t for t in self._live.values() if predicate(t)]
            for t in gone:
                self._forget(t)
                t.status = abi.Status.CANCELLED
        for t in gone:
            t.on_done(t)
        return gone

    def live(self) -> list[Transfer]:
        """The transfers in flight now."""
        with self._lock:
            return list(self._live.values())

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def unrung(self) -> int:
        """Transfers in flight whose completions come without a ring (found by polling)."""
        return self._unrung
