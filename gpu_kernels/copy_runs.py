"""Coalescing a batch of copy descriptors into runs for the copy-engine consumer.

A transfer's chunks are contiguous in source, destination and position, so the consumer moves
each run with one ``cudaMemcpyAsync`` and verifies it with one checksum launch instead of one of
each per chunk. A run's chunks have equal lengths except possibly the last (what the checksum
kernel's chunking assumes); per-chunk statuses are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CopyRun:
    """Descriptors ``first .. first + count - 1`` of a batch, moved as one copy.

    ``src`` / ``dst`` are device addresses (bytes), ``nbytes`` the run's total,
    ``chunk_bytes`` every chunk's length but the last's, ``position`` the first chunk's.
    """

    first: int
    count: int
    src: int
    dst: int
    nbytes: int
    chunk_bytes: int
    position: int
    verify: bool


def plan_runs(batch: np.ndarray, copy: np.ndarray, verify: np.ndarray,
              regions: np.ndarray) -> list[CopyRun]:
    """Group the descriptors of ``batch`` (``DESCRIPTOR_DTYPE[n]``) selected by ``copy`` (bool[n],
    validated COPY descriptors) into runs of consecutive, contiguous chunks with the same
    ``verify`` (bool[n]) flag, resolving addresses through ``regions`` (the region table).
    Every selected descriptor lands in exactly one run, in batch order."""
    idx = np.flatnonzero(copy)
    if idx.size == 0:
        return []
    d = batch[idx]
    src = (regions["base"][d["src_region"]].astype(np.uint64) + d["src_offset"]).tolist()
    dst = (regions["base"][d["dst_region"]].astype(np.uint64) + d["dst_offset"]).tolist()
    length, position = d["length"].tolist(), d["position"].tolist()
    at, ver = idx.tolist(), verify[idx].tolist()
    runs: list[CopyRun] = []
    start = 0
    for j in range(1, len(at) + 1):
        p = j - 1
        if (j < len(at) and at[j] == at[p] + 1 and ver[j] == ver[start]
                and src[j] == src[p] + length[p] and dst[j] == dst[p] + length[p]
                and position[j] == position[p] + length[p]
                and length[p] == length[start] and length[j] <= length[start]):
            continue
        runs.append(CopyRun(at[start], j - start, src[start], dst[start],
                            sum(length[start:j]), length[start], position[start], ver[start]))
        start = j
    return runs
