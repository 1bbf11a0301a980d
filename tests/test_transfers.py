"""Descriptors say what a delivery plan means, and TransferTracker.complete_many folds
completions the same whether they come in one large batch (array passes) or a few at a time
(the dict path for small batches)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.dataplane.transfers import Signal, TransferPlan, TransferTracker
from dpu_offload import abi


def _fold(chunks: list[int], bad: set[tuple[int, int]], step: int
          ) -> list[tuple[int, int, int, list[int]]]:
    tracker = TransferTracker()
    finished: list[tuple[int, int, int, list[int]]] = []
    transfers = [tracker.start(TransferPlan(0, 0, 1, 0, n * 256, 256, tuple(range(n))),
                               lambda t: finished.append((t.transfer_id, int(t.status),
                                                          t.bytes_done, sorted(t.failed_chunks))))
                 for n in chunks]
    recs = np.zeros(sum(chunks), abi.COMPLETION_DTYPE)
    at = 0
    for t, n in zip(transfers, chunks, strict=True):
        for c in range(n):
            failed = (t.transfer_id, c) in bad
            recs[at] = (t.transfer_id, c, int(abi.Status.CHECKSUM_MISMATCH) if failed else 0,
                        256, 0)
            at += 1
    order = np.random.default_rng(len(recs)).permutation(len(recs))
    recs = recs[order]
    for i in range(0, len(recs), step):
        tracker.complete_many(recs[i:i + step])
    assert tracker.in_flight == 0
    return sorted(finished)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=8), st.data())
def test_small_and_large_batches_fold_alike(chunks: list[int], data: st.DataObject) -> None:
    bad = set(data.draw(st.lists(st.tuples(st.integers(1, len(chunks)), st.integers(0, 39)),
                                 max_size=6)))
    whole = _fold(chunks, bad, step=10_000)
    assert whole == _fold(chunks, bad, step=3) == _fold(chunks, bad, step=64)
    for (tid, status, nbytes, failed), n in zip(whole, chunks, strict=True):
        assert failed == sorted(c for t, c in bad if t == tid and c < n)
        assert status == (int(abi.Status.CHECKSUM_MISMATCH) if failed else 0)
        assert nbytes == n * 256


def _expected_rows(plan: TransferPlan, tid: int) -> np.ndarray:
    """The descriptors a plan means, written field by field (the oracle)."""
    if plan.signal is not None:
        rows = [dict(opcode=abi.Opcode.COPY, src_region=plan.src_region,
                     src_offset=plan.src_offset, dst_region=plan.dst_region,
                     dst_offset=plan.dst_offset, length=plan.nbytes, position=0, checksum=0,
                     flags=abi.DescriptorFlags.VERIFY if plan.verify else 0),
                dict(opcode=abi.Opcode.SIGNAL, src_offset=plan.signal.word,
                     dst_offset=plan.signal.offset)]
    else:
        rows = [dict(opcode=abi.Opcode.COPY, src_region=plan.src_region,
                     src_offset=plan.src_offset + pos, dst_region=plan.dst_region,
                     dst_offset=plan.dst_offset + pos,
                     length=min(plan.chunk_bytes, plan.nbytes - pos), position=pos,
                     checksum=plan.checksums[i],
                     flags=abi.DescriptorFlags.VERIFY if plan.verify else 0)
                for i, pos in enumerate(range(0, plan.nbytes, plan.chunk_bytes))]
    out = np.zeros(len(rows), abi.DESCRIPTOR_DTYPE)
    for i, row in enumerate(rows):
        out[i]["transfer_id"], out[i]["chunk_index"], out[i]["chunk_count"] = tid, i, len(rows)
        for name, value in row.items():
            out[i][name] = value
    return out


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 15), st.integers(0, 2**40), st.integers(0, 15), st.integers(0, 2**40),
       st.integers(1, 64), st.integers(1, 8), st.booleans(), st.booleans(),
       st.integers(1, 2**63), st.integers(0, 2**62), st.integers(0, 2**20))
def test_descriptors_say_what_the_plan_means(src: int, so: int, dst: int, do: int,
                                             chunks: int, chunk16: int, verify: bool,
                                             span: bool, tid: int, word: int,
                                             entry: int) -> None:
    """Both ways descriptors are built (a DMA-engine delivery's two rows packed into cached
    bytes; a device consumer's chunks through array views of a cached template) write, row
    by row and byte by byte, what the plan means; a second delivery of the same blob (the
    cached side) too."""
    chunk = 16 * chunk16
    nbytes = chunks * chunk - (chunk // 2 if chunks > 1 else 0)
    sums = tuple((7 * i + 1) & 0xFFFFFFFF for i in range(-(-nbytes // chunk)))
    signal = Signal(entry, word) if span else None
    plan = TransferPlan(src, so, dst, do, nbytes, chunk, sums, verify=verify, signal=signal)
    want = _expected_rows(plan, tid)
    assert plan.descriptors(tid).tobytes() == want.tobytes()
    assert plan.descriptors(tid).tobytes() == want.tobytes()
    assert len(want) == plan.descriptor_count


@given(st.integers(1, 2**32 - 1).filter(lambda v: v not in abi.Status._value2member_map_))
def test_a_completion_status_outside_the_abi_fails_its_transfer(status: int) -> None:
    """A consumer's completion with a status the ABI does not define (the consumer may be a
    client's process) fails its transfer as BAD_RING; the fold goes on."""
    tracker = TransferTracker()
    finished: list[tuple[int, int]] = []
    t = tracker.start(TransferPlan(0, 0, 1, 0, 512, 256, (0, 1)),
                      lambda t: finished.append((t.transfer_id, int(t.status))))
    recs = np.zeros(2, abi.COMPLETION_DTYPE)
    recs[0] = (t.transfer_id, 0, status, 256, 0)
    recs[1] = (t.transfer_id, 1, 0, 256, 0)
    tracker.complete_many(recs)
    assert finished == [(t.transfer_id, int(abi.Status.BAD_RING))]
    assert tracker.in_flight == 0
