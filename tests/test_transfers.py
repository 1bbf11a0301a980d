"""TransferTracker.complete_many folds completions the same whether they come in one large
batch (array passes) or a few at a time (the dict path for small batches)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_agent.dataplane.transfers import TransferPlan, TransferTracker
from gpu_kernels import abi


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
