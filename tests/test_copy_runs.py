"""The copy-engine consumer's batch path: its vectorised descriptor check gives the statuses of
the per-descriptor check, and executing its runs (one copy each, checksums split per chunk) moves
the same bytes and yields the same per-chunk checksums as executing every descriptor alone."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dpu_agent.dataplane.transfers import TransferPlan
from dpu_offload import abi
from dpu_offload.checksum import chunk_checksum
from gpu_kernels.copy_runs import plan_runs
from gpu_kernels.reference import check_descriptor, check_descriptors

SRC_BASE, DST_BASE, SRC_BYTES, DST_BYTES = 1 << 20, 1 << 30, 1 << 16, 1 << 17


def _regions() -> np.ndarray:
    regions = np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE)
    regions[0] = (SRC_BASE, SRC_BYTES, abi.RegionFlags.READABLE, 0)
    regions[1] = (DST_BASE, DST_BYTES, abi.RegionFlags.READABLE | abi.RegionFlags.WRITABLE, 0)
    return regions


def test_batch_check_equals_per_descriptor_check() -> None:
    """Every combination of boundary values: sizes and offsets that meet exactly or miss by an
    alignment unit, misaligned values, offsets near 2**64 (where a sum would wrap), unusable
    regions (empty, no read, no write, unknown ids) and every opcode."""
    regions = np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE)
    regions[:5] = [(1 << 30, 4096, 1, 0), (1 << 31, 1 << 16, 3, 0), (0, 0, 3, 0),
                   (1 << 32, 4096, 2, 0), (1 << 33, 4096, 0, 0)]
    edges = [0, 8, 16, 4080, 4096, 4112, 1 << 16, 2**64 - 16, 2**64 - 1]
    grid = np.array(list(itertools.product(
        [*abi.Opcode, 9], [0, 1, 2, 3, 4, abi.MAX_REGIONS], [0, 1, 2, 3, 4, abi.MAX_REGIONS + 1],
        edges, edges, [0, 8, 16, 4096, 1 << 16], [0, 8])), dtype=np.uint64).T
    batch = np.zeros(grid.shape[1], abi.DESCRIPTOR_DTYPE)
    for name, column in zip(("opcode", "src_region", "dst_region", "src_offset", "dst_offset",
                             "length", "position"), grid, strict=True):
        batch[name] = column
    expected = np.array([check_descriptor(d, regions) for d in batch], np.uint32)
    np.testing.assert_array_equal(check_descriptors(batch, regions), expected)
    assert {abi.Status(int(v)) for v in expected} == {
        abi.Status.OK, abi.Status.BAD_OPCODE, abi.Status.BAD_REGION, abi.Status.BAD_ALIGNMENT,
        abi.Status.OUT_OF_BOUNDS}


transfer = st.tuples(st.integers(1, 64), st.integers(1, 16), st.integers(0, SRC_BYTES // 16 - 1),
                     st.booleans())


@given(st.lists(transfer, min_size=1, max_size=6), st.randoms(use_true_random=False),
       st.lists(st.integers(0, 200), max_size=4))
def test_runs_move_the_same_bytes_and_checksums(transfers: list[tuple], rnd, holes: list[int]
                                                ) -> None:
    src = np.random.default_rng(1).integers(0, 256, SRC_BYTES, dtype=np.uint8)
    batches, dst_at = [], 0
    for tid, (n16, chunk16, so16, verify) in enumerate(transfers):
        nbytes, so = 16 * n16, min(16 * so16, SRC_BYTES - 16 * n16)
        plan = TransferPlan(0, so, 1, dst_at, nbytes, 16 * chunk16, tuple(
            chunk_checksum(src[so + c:so + min(nbytes, c + 16 * chunk16)], c)
            for c in range(0, nbytes, 16 * chunk16)))
        d = plan.descriptors(tid + 1)
        if not verify:
            d["flags"] = 0
        batches.append(d)
        dst_at += nbytes + 16 * rnd.randint(0, 2)
    batch = np.concatenate(batches)
    if rnd.random() < 0.5:  # interleave transfers: runs must then break at every switch
        batch = batch[rnd.sample(range(batch.size), batch.size)]
    copy = np.ones(batch.size, bool)
    copy[[h % batch.size for h in holes]] = False  # refused descriptors move nothing
    verify = (batch["flags"] & abi.DescriptorFlags.VERIFY) != 0

    runs = plan_runs(batch, copy, verify, _regions())
    covered = [i for r in runs for i in range(r.first, r.first + r.count)]
    assert covered == np.flatnonzero(copy).tolist()

    by_runs, each = np.zeros(DST_BYTES, np.uint8), np.zeros(DST_BYTES, np.uint8)
    sums: dict[int, int] = {}
    for r in runs:
        got = src[r.src - SRC_BASE:r.src - SRC_BASE + r.nbytes]
        by_runs[r.dst - DST_BASE:r.dst - DST_BASE + r.nbytes] = got
        assert (r.count - 1) * r.chunk_bytes < r.nbytes <= r.count * r.chunk_bytes
        for c in range(r.count):
            part = got[c * r.chunk_bytes:(c + 1) * r.chunk_bytes]
            sums[r.first + c] = chunk_checksum(part, r.position + c * r.chunk_bytes)
            assert r.verify == bool(verify[r.first + c])
    for i in np.flatnonzero(copy).tolist():
        d = batch[i]
        so, do, n = int(d["src_offset"]), int(d["dst_offset"]), int(d["length"])
        each[do:do + n] = src[so:so + n]
        assert sums[i] == int(d["checksum"])
    np.testing.assert_array_equal(by_runs, each)


def test_one_transfer_is_one_run() -> None:
    plan = TransferPlan(0, 0, 1, 0, 10 * 4096 + 48, 4096, (0,) * 11)
    d = plan.descriptors(7)
    ok = np.ones(d.size, bool)
    runs = plan_runs(d, ok, ok, _regions())
    assert [(r.first, r.count, r.nbytes, r.chunk_bytes) for r in runs] == [
        (0, 11, 10 * 4096 + 48, 4096)]
