"""The DPU-DRAM weight cache: experts staged as blobs in the arena, filled from checkpoint files
on a miss, pinned while a transfer reads them, evicted by a policy when space runs out.

Fills copy from the shards' memory maps into the arena (the storage-to-DRAM step; on a BlueField
a DMA from NVMe) and compute the per-chunk checksums that every later delivery is verified
against. A fill runs outside the lock, so hits are served while misses fill.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpu_agent.routing.stats import RoutingStats, Visit
from dpu_agent.weights.arena import Arena
from dpu_agent.weights.catalog import ExpertEntry
from dpu_agent.weights.policies import Evictable, EvictionPolicy
from dpu_agent.weights.safetensors_file import ShardChanged, ShardReader
from dpu_offload.checksum import blob_checksums, blob_sum
from dpu_offload.keys import ExpertKey

log = logging.getLogger("dpu_agent")

class CacheFullError(RuntimeError):
    """Every resident expert is pinned and the arena cannot hold another."""


class WouldBlock(RuntimeError):
    """``acquire(..., wait=False)`` of an expert that is not resident and filled: serving it
    would block on a fill. Raised before anything changed."""


@dataclass
class CachedExpert:
    """An expert resident in the arena."""

    entry: ExpertEntry
    offset: int
    """Byte offset of the blob in the arena."""
    checksums: tuple[int, ...] = ()
    """Per-chunk checksums of the blob (``chunk_bytes`` chunks), set by the fill."""
    expected: int = 0
    """The blob's sum of terms (``checksum.blob_sum``: what a LANDED slot's check compares
    with), set by the fill: once per fill, not once per delivery."""
    pins: int = 0
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    fill_seconds: float = 0.0
    storage_bytes: int = 0
    """Bytes filled from checkpoint files."""
    peer_bytes: int = 0
    """Bytes filled from another agent's arena (cluster mode)."""
    source_failures: int = 0
    """Fills whose ``source`` failed and fell back to the checkpoint files."""


FillSource = Callable[[np.ndarray], list[int]]
"""Fills an expert's blob (``uint8[blob_bytes]``) from elsewhere than the checkpoint files and
returns its verified per-chunk checksums; raises to fall back to the files."""


class WeightCache:
    """Experts resident in an :class:`Arena`, keyed by :class:`ExpertKey`.

    Args:
        arena: where blobs live.
        chunk_bytes: checksum granularity (and descriptor size), bytes, multiple of 16.
        policy: eviction order.
    """

    def __init__(self, arena: Arena, chunk_bytes: int, policy: EvictionPolicy) -> None:
        self.arena = arena
        self.chunk_bytes = chunk_bytes
        self.policy = policy
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._resident: dict[ExpertKey, CachedExpert] = {}
        self._evictable: Evictable[None] = Evictable(policy)
        """The resident experts that are filled and unpinned: what an eviction may take, and
        exactly what the policy knows (in as an expert's last pin goes, out as it is pinned,
        evicted or dropped), so its choice never walks past experts in use."""
        self._shards = ShardReader()
        self.degraded: dict[str, str] = {}
        """model -> why some of its experts cannot be read (a shard changed under the agent);
        cleared when the model is loaded again."""
        self._orphans: list[CachedExpert] = []

    def acquire(self, entry: ExpertEntry, source: FillSource | None = None,
                wait: bool = True) -> CachedExpert:
        """Return the expert resident and pinned, filling it first on a miss (from ``source``
        when given and it succeeds, else from the checkpoint files). The caller gives the pin
        back with :meth:`release` of what this returned.

        Blocks the calling thread during a fill (call it from a worker thread); with
        ``wait=False`` only a resident, filled expert is returned (a hit never blocks).

        Raises:
            CacheFullError: no room even after evicting every unpinned expert.
            WouldBlock: ``wait=False`` and the expert is absent or still filling.
        """
        key = entry.key
        with self._lock:
            cached = self._resident.get(key)
            if not wait and (cached is None or not cached.ready.is_set()):
                raise WouldBlock(f"{key} is not resident in the arena")
            if cached is not None:
                self._pin(cached)
                self.stats.hits += 1
                fill = False
            else:
                self.stats.misses += 1
                offset = self._allocate(entry.blob_bytes, key)
                cached = CachedExpert(entry, offset, pins=1)
                self._resident[key] = cached
                fill = True
        if fill:
            self._fill(cached, source)
        cached.ready.wait()
        if cached.error is not None:
            self.release(cached)
            raise cached.error
        return cached

    def _allocate(self, nbytes: int, key: ExpertKey) -> int:
        while True:
            offset = self.arena.alloc(nbytes)
            if offset is not None:
                return offset
            victim = self._evictable.evict(key)
            if victim is None:
                raise CacheFullError(f"arena of {self.arena.size} bytes cannot hold {nbytes} "
                                     "more: every resident expert is pinned")
            self._drop(victim[0])
            self.stats.evictions += 1

    def _drop(self, key: ExpertKey) -> None:
        """Free an unpinned resident expert."""
        cached = self._resident.pop(key)
        self._evictable.discard(key)
        self.arena.free(cached.offset)

    def _pin(self, cached: CachedExpert) -> None:
        """One more pin on a resident expert; an evictable one leaves the policy's view."""
        cached.pins += 1
        self._evictable.discard(cached.entry.key)

    def peek(self, key: ExpertKey) -> CachedExpert | None:
        """Pin the expert if it is resident and filled (no fill, no hit counted); the caller
        releases what this returned. None when it is not here."""
        with self._lock:
            cached = self._resident.get(key)
            if cached is None or not cached.ready.is_set() or cached.error is not None:
                return None
            self._pin(cached)
            return cached

    def _fill(self, cached: CachedExpert, source: FillSource | None) -> None:
        start = time.perf_counter()
        try:
            blob = self.arena.view(cached.offset, cached.entry.blob_bytes)
            if source is not None:
                try:
                    cached.checksums = tuple(source(blob))
                    self.stats.peer_bytes += blob.size
                    return
                except Exception as exc:  # noqa: BLE001 - any failed source falls back
                    self.stats.source_failures += 1
                    log.warning("%s: fill source failed (%s); reading checkpoint files",
                                cached.entry.key, exc)
            blob[:] = 0
            try:
                for t in cached.entry.tensors:
                    if t.file is None:
                        raise FileNotFoundError(f"{cached.entry.key}: shard for {t.role} not "
                                                "present")
                    self._shards.read_into(t.file, t.file_offset,
                                           blob[t.offset : t.offset + t.nbytes], t.stamp)
                cached.checksums = tuple(blob_checksums(blob, self.chunk_bytes))
                self._check_manifest(cached.entry, blob, cached.checksums)
            except ShardChanged as exc:
                self.degraded[cached.entry.key.model] = str(exc)
                raise
            self.stats.storage_bytes += blob.size
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter, then re-raised
            cached.error = exc
            with self._lock:
                if self._resident.get(cached.entry.key) is cached:
                    self._resident.pop(cached.entry.key)
                    self.arena.free(cached.offset)
        finally:
            self.stats.fill_seconds += time.perf_counter() - start
            if cached.error is None:
                cached.expected = blob_sum(cached.checksums, cached.entry.blob_bytes,
                                           self.chunk_bytes)
            cached.ready.set()

    def _check_manifest(self, entry: ExpertEntry, blob: np.ndarray, sums: tuple[int, ...]
                        ) -> None:
        """ShardChanged when the bytes read differ from the ingest manifest's (a change no
        stamp shows: same size, modification time put back)."""
        if not entry.expected:
            return
        got = sums if entry.expected_chunk_bytes == self.chunk_bytes else \
            blob_checksums(blob, entry.expected_chunk_bytes)
        if tuple(got) != entry.expected:
            bad = next(c for c, (a, b) in enumerate(zip(got, entry.expected, strict=True))
                       if a != b)
            at = bad * entry.expected_chunk_bytes
            t = next((t for t in entry.tensors if t.offset + t.nbytes > at), entry.tensors[-1])
            raise ShardChanged(t.file or Path("?"), "differs from manifest",
                               f"{entry.key} chunk {bad}, in {t.role}")

    def release(self, cached: CachedExpert) -> None:
        """Unpin once the copy that :meth:`acquire` or :meth:`peek` returned (a transfer that
        read it has completed): that copy, not whichever holds its key now (after an
        invalidation the key may have been filled again)."""
        with self._lock:
            if cached.pins <= 0:
                return
            cached.pins -= 1
            if cached.pins > 0:
                return
            key = cached.entry.key
            if cached in self._orphans:
                self._orphans.remove(cached)
                self.arena.free(cached.offset)
            elif self._resident.get(key) is cached and cached.ready.is_set() \
                    and cached.error is None:
                self._evictable.add(key, None)

    def observe(self, routing: RoutingStats, model: str, layer: int,
                tokens: Mapping[int, int], keep: bool = True) -> Visit | None:
        """Fold a visit of a MoE layer into ``routing`` (``tokens[e]``: tokens that selected
        expert e) and show it to the policy, under the cache's lock: visits reach the policy in
        the order they were folded in (its view of the layer's features before the visit is
        valid only until the next). With ``keep``, returns the visit with copies of its arrays
        (for the slot pools' policies, which see it after the lock); else None."""
        with self._lock:
            visit = routing.observe(model, layer, tokens)
            self.policy.observe(visit)
            if not keep:
                return None
            return visit._replace(before=visit.before.copy(), after=visit.after.copy())

    def invalidate(self, key: ExpertKey) -> None:
        """Forget an expert's arena copy (it failed verification) so the next acquire refills
        it from its source; a pinned copy is only forgotten, freed when the last pin goes."""
        with self._lock:
            cached = self._resident.get(key)
            if cached is None:
                return
            if cached.pins == 0:
                self._drop(key)
            else:
                self._resident.pop(key)
                self._orphans.append(cached)

    @property
    def evictable(self) -> frozenset[ExpertKey]:
        """The experts an eviction may take now (filled, unpinned): the policy's candidates."""
        with self._lock:
            return frozenset(self._evictable)

    @property
    def resident(self) -> int:
        with self._lock:
            return len(self._resident)

    def pinned(self) -> int:
        """Total pins held (0 when nothing reads the arena)."""
        with self._lock:
            return sum(c.pins for c in self._resident.values())
