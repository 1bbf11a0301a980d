"""The chunk checksum, NumPy definition (the CUDA twin is ``dpu_vec_terms`` in ring.cuh).

For a chunk of 32-bit little-endian words ``w[i]`` that starts ``offset`` bytes into its expert
blob, with ``g = offset // 4 + i``::

    checksum = (sum_i fmix32(w[i] ^ (g * 0x9E3779B1)) mod 2**32) ^ (number of words mod 2**32)

``fmix32`` (MurmurHash3's finaliser) is a bijection, so one flipped bit always changes the sum;
mixing in ``g`` makes a chunk copied to the wrong place fail; the sum is order-independent so a
GPU block can reduce it in any order. It is an integrity check, not a cryptographic one.

Computed here by one compiled loop (Numba), :func:`words_checksum`, which the packet engine's
compiled code calls too; ~14 GB/s on one core of the 2-core VM against ~2.6 for the NumPy
expression of the same formula (tests/test_ring_checksum.py keeps that expression as the
reference and holds the two equal).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from dpu_offload.jit import keep_cache

keep_cache(__file__)

_MASK32 = 0xFFFFFFFF


@njit(cache=True, nogil=True)
def words_checksum(words: np.ndarray, first: np.uint64) -> np.uint64:
    """The checksum of ``words`` (``uint32[n]``, little-endian) whose first word is word
    ``first`` of its blob. Unsigned 64-bit arithmetic masked to 32 bits throughout."""
    mask = np.uint64(_MASK32)
    total = np.uint64(0)
    for i in range(words.size):
        h = np.uint64(words[i]) ^ (((first + np.uint64(i)) * np.uint64(0x9E3779B1)) & mask)
        h ^= h >> np.uint64(16)
        h = (h * np.uint64(0x85EBCA6B)) & mask
        h ^= h >> np.uint64(13)
        h = (h * np.uint64(0xC2B2AE35)) & mask
        h ^= h >> np.uint64(16)
        total += h
    return (total & mask) ^ (np.uint64(words.size) & mask)


def finish(terms: Any, nbytes: Any) -> Any:
    """The checksum of ``nbytes`` bytes from their sum of terms: the sum xor the word count,
    mod 2**32 (the same step takes a checksum back to its sum). Ints, or NumPy arrays
    elementwise (``uint32``). ``dpu_checksum_finish`` in ring.cuh is its twin."""
    if isinstance(terms, np.ndarray) or isinstance(nbytes, np.ndarray):
        return np.asarray(terms).astype(np.uint32) ^ (np.asarray(nbytes) // 4).astype(np.uint32)
    return (int(terms) ^ (int(nbytes) // 4)) & 0xFFFFFFFF


def chunk_checksum(data: np.ndarray | memoryview | bytes, offset: int) -> int:
    """Checksum of ``data`` (length a multiple of 4 bytes) placed ``offset`` bytes into its blob.

    Args:
        data: the chunk's bytes, any contiguous buffer.
        offset: byte position of the chunk in its blob; a multiple of 4.

    Returns:
        The 32-bit checksum as a Python int.
    """
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    raw = raw.reshape(-1).view(np.uint8)
    if raw.size % 4 or offset % 4:
        raise ValueError(f"checksum needs 4-byte multiples: length {raw.size}, offset {offset}")
    if offset < 0:
        raise ValueError(f"checksum needs a non-negative offset, got {offset}")
    return int(words_checksum(raw.view("<u4"), np.uint64(offset // 4)))


def blob_checksums(blob: np.ndarray, chunk_bytes: int) -> list[int]:
    """Per-chunk checksums of a whole blob cut into ``chunk_bytes`` pieces (the last may be
    shorter)."""
    return [chunk_checksum(blob[start:start + chunk_bytes], start)
            for start in range(0, blob.size, chunk_bytes)]


def blob_sum(checksums: tuple[int, ...] | list[int], nbytes: int, chunk_bytes: int) -> int:
    """The sum of terms over a whole blob of ``nbytes`` (the ``expected`` a LANDED slot
    carries), from its per-chunk checksums (``chunk_bytes`` chunks, the last may be shorter):
    each chunk's checksum with its word count xored back out, added mod 2**32. Equals
    :func:`terms_sum` of the blob's bytes, so one pass over the slot checks it."""
    total = 0
    for c, checksum in enumerate(checksums):
        total += finish(checksum, min(chunk_bytes, nbytes - c * chunk_bytes))
    return total & 0xFFFFFFFF


def terms_sum(blob: np.ndarray | memoryview | bytes) -> int:
    """Sum of terms over a whole blob's bytes (placed at offset 0), mod 2**32."""
    raw = np.frombuffer(blob, np.uint8) if not isinstance(blob, np.ndarray) else blob
    return finish(chunk_checksum(raw, 0), raw.size)
