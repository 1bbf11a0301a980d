"""Coalescing a batch of copy descriptors into runs, for the consumers that move bytes with a
copy engine (the client's copy-engine thread, the DMA-engine process), and the bookkeeping
they share around it: which descriptors to copy and verify, and their completions.

A transfer's chunks are contiguous in source, destination and position, so the consumer moves
each run with one ``cudaMemcpyAsync`` and verifies it with one checksum launch instead of one of
each per chunk. A run's chunks have equal lengths except possibly the last (what the checksum
kernel's chunking assumes); per-chunk statuses are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpu_offload import abi
from gpu_kernels.reference import check_descriptors


def classify(batch: np.ndarray, regions: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                np.ndarray]:
    """(status ``uint32[n]``, copy ``bool[n]``, verify ``bool[n]``) of a batch
    (``DESCRIPTOR_DTYPE[n]``): each descriptor's check against ``regions``, the valid COPY
    descriptors, and those of them that ask for verification."""
    status = check_descriptors(batch, regions)
    copy = (status == 0) & (batch["opcode"] == int(abi.Opcode.COPY))
    return status, copy, copy & ((batch["flags"] & int(abi.DescriptorFlags.VERIFY)) != 0)


def completions(batch: np.ndarray, status: np.ndarray, copy: np.ndarray,
                idx: np.ndarray | slice = slice(None)) -> np.ndarray:
    """``COMPLETION_DTYPE`` entries for descriptors ``idx`` of ``batch``: their statuses, and
    the bytes written (a copy's length, 0 for anything else)."""
    ids = batch["transfer_id"][idx]
    out = np.zeros(ids.size, abi.COMPLETION_DTYPE)
    out["transfer_id"] = ids
    out["chunk_index"] = batch["chunk_index"][idx]
    out["status"] = status[idx]
    out["nbytes"] = np.where(copy[idx], batch["length"][idx], 0)
    return out


def asks_exit(batch: np.ndarray, status: np.ndarray) -> bool:
    """Whether the batch holds a valid EXIT descriptor."""
    return bool(np.any((batch["opcode"] == int(abi.Opcode.EXIT)) & (status == 0)))


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
