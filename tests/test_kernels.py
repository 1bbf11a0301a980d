"""One suite, two backends: the CUDA receive kernel (``gpu`` marker) and its CPU twin must give
the same statuses and the same bytes, and never write outside a region."""

from __future__ import annotations

import numpy as np
import pytest

from dpu_offload import abi
from dpu_offload.checksum import chunk_checksum
from tests.kernel_harness import GUARD, GUARD_BYTE, Harness

BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu),
            pytest.param("cuda-copy", marks=pytest.mark.gpu)]
SRC = 1 << 20
DST = 1 << 20


def _desc(n: int) -> np.ndarray:
    d = np.zeros(n, abi.DESCRIPTOR_DTYPE)
    d["transfer_id"] = np.arange(1, n + 1)
    d["opcode"] = abi.Opcode.COPY
    d["flags"] = abi.DescriptorFlags.VERIFY
    d["src_region"] = 0
    d["dst_region"] = 1
    return d


def _oracle(d: np.void, src: np.ndarray) -> int:
    """Expected status, written independently of gpu_kernels.reference."""
    op = int(d["opcode"])
    if op in (0, 3):
        return 0
    if op != 1:
        return int(abi.Status.BAD_OPCODE)
    if int(d["src_region"]) != 0 or int(d["dst_region"]) != 1:
        return int(abi.Status.BAD_REGION)
    n, so, do, pos = (int(d[k]) for k in ("length", "src_offset", "dst_offset", "position"))
    if any(v % 16 for v in (n, so, do, pos)):
        return int(abi.Status.BAD_ALIGNMENT)
    if so + n > SRC or do + n > DST:
        return int(abi.Status.OUT_OF_BOUNDS)
    if int(d["flags"]) & 1 and chunk_checksum(src[so:so + n], pos) != int(d["checksum"]):
        return int(abi.Status.CHECKSUM_MISMATCH)
    return 0


@pytest.fixture
def src() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, SRC, dtype=np.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_chunks_land_verified(backend: str, src: np.ndarray) -> None:
    chunk = 64 << 10
    d = _desc(SRC // chunk)
    offs = np.arange(d.size) * chunk
    d["src_offset"], d["dst_offset"], d["length"], d["position"] = offs, offs[::-1], chunk, offs
    d["checksum"] = [chunk_checksum(src[o:o + chunk], o) for o in offs]
    h = Harness(backend, src, DST)
    try:
        result = h.run(d)
        dst = h.dst()
    finally:
        h.close()
    assert all(st == (0, chunk) for st in result.values())
    body = dst[GUARD:GUARD + DST].reshape(-1, chunk)
    np.testing.assert_array_equal(body[::-1], src.reshape(-1, chunk))
    assert (dst[:GUARD] == GUARD_BYTE).all() and (dst[GUARD + DST:] == GUARD_BYTE).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fuzzed_descriptors_status_and_guards(backend: str, src: np.ndarray) -> None:
    rng = np.random.default_rng(11)
    n = 400
    d = _desc(n)
    slot = DST // n // 16 * 16
    for i in range(n):
        length = int(rng.integers(1, slot // 16 + 1)) * 16
        so = int(rng.integers(0, (SRC - length) // 16)) * 16
        do = i * slot
        d[i]["src_offset"], d[i]["dst_offset"], d[i]["length"], d[i]["position"] = (
            so, do, length, so)
        d[i]["checksum"] = chunk_checksum(src[so:so + length], so)
        fault = rng.integers(0, 8)
        if fault == 1:
            d[i]["src_offset"] = SRC - 16 * int(rng.integers(0, 4))      # runs past the source
        elif fault == 2:
            d[i]["dst_offset"] = DST - 16                                  # runs past the dest
            d[i]["length"] = 32 + 16 * int(rng.integers(0, 1 << 20))
        elif fault == 3:
            d[i]["length"] += int(rng.integers(1, 16))                     # misaligned
        elif fault == 4:
            d[i]["opcode"] = int(rng.integers(5, 1 << 16))                 # unknown opcode
        elif fault == 5:
            d[i]["checksum"] ^= 1 << int(rng.integers(0, 32))             # corrupted
        elif fault == 6:
            d[i]["dst_region"] = int(rng.choice([0, 2, 63, 64, 2**32 - 1]))  # not writable
        elif fault == 7:
            d[i]["src_offset"] = 2**63 + so                                # overflow bait
    expected = {int(x["transfer_id"]): _oracle(x, src) for x in d}
    h = Harness(backend, src, DST, capacity=32)
    try:
        result = h.run(d)
        dst = h.dst()
    finally:
        h.close()
    assert {k: v[0] for k, v in result.items()} == expected
    assert (dst[:GUARD] == GUARD_BYTE).all(), "write before the region"
    assert (dst[GUARD + DST:] == GUARD_BYTE).all(), "write after the region"
    body = dst[GUARD:GUARD + DST]
    for x in d:
        status = expected[int(x["transfer_id"])]
        so, do, n = int(x["src_offset"]), int(x["dst_offset"]), int(x["length"])
        if status in (0, int(abi.Status.CHECKSUM_MISMATCH)):
            np.testing.assert_array_equal(body[do:do + n], src[so:so + n])
        else:
            assert (body[do:do + min(n, slot)] == GUARD_BYTE).all(), "refused yet written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_exit_descriptor_stops_consumer(backend: str, src: np.ndarray) -> None:
    d = _desc(2)
    d["opcode"] = [abi.Opcode.NOP, abi.Opcode.EXIT]
    h = Harness(backend, src, DST)
    try:
        assert h.run(d) == {1: (0, 0), 2: (0, 0)}
        assert h.work.ring.exit_requested
    finally:
        h.close()
