"""What one popped batch of descriptors asks the engine to do, planned row by row in plain
Python: the copies grouped into runs (a delivery's chunks are contiguous, so a run is usually
the whole delivery), each run checked once as one descriptor spanning it, the SIGNALs checked,
and every descriptor's status. A run that fails its check is checked chunk by chunk, so the
statuses are exactly those of ``check_descriptor`` applied to each descriptor (both check a
copy with ``check_copy``; tests/test_engine_plan.py holds them equal). No NumPy per batch: the
engine's batches are a delivery or a few (tens of descriptors), where fixed per-call costs of
array operations dominate (docs/PERFORMANCE-NOTES.md).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dma_engine.signals import SignalWrite, check_signal
from dpu_offload import abi
from gpu_kernels.copy_runs import CopyRun
from gpu_kernels.reference import check_copy

_ENTRY = abi.SLOT_STATE_DTYPE.itemsize
MAX_FAILED_TRANSFERS = 4096
"""Transfers with a refused copy whose SIGNAL has not come yet (oldest forgotten beyond)."""
_COPY, _SIGNAL = int(abi.Opcode.COPY), int(abi.Opcode.SIGNAL)
_CONTROL = frozenset(int(o) for o in (abi.Opcode.NOP, abi.Opcode.FENCE, abi.Opcode.EXIT))
_EXIT = int(abi.Opcode.EXIT)
_ALIGN = abi.COPY_ALIGN_BYTES
# Field positions in a DESCRIPTOR_DTYPE row as ``tolist`` gives it.
_F = {name: i for i, name in enumerate(abi.DESCRIPTOR_DTYPE.names)}
_TID, _OP, _SRC_R, _SRC_O = _F["transfer_id"], _F["opcode"], _F["src_region"], _F["src_offset"]
_DST_R, _DST_O, _LEN, _POS = _F["dst_region"], _F["dst_offset"], _F["length"], _F["position"]


@dataclass
class BatchPlan:
    """A batch's plan.

    Attributes:
        ops: copy runs and SIGNAL writes, in batch order (each completes its descriptors).
        status: ``uint32[n]``, each descriptor's status (0 is OK).
        copied: ``bool[n]``, the valid COPY descriptors (their completions report their
            length as written).
        moved: ``bool[n]``, descriptors completed when their op lands (valid copies and
            SIGNALs); every other one is completed at once.
        exit: the batch holds a valid EXIT.
    """

    ops: list[CopyRun | SignalWrite]
    status: np.ndarray
    copied: np.ndarray
    moved: np.ndarray
    exit: bool


class Planner:
    """Plans batches against ``regions`` (``REGION_DTYPE[MAX_REGIONS]``, this process's
    addresses), remembering transfers one of whose copies was refused, so their SIGNAL (in a
    later batch too) is CANCELLED."""

    def __init__(self, regions: np.ndarray) -> None:
        self.regions = regions
        self._failed: OrderedDict[int, None] = OrderedDict()

    def plan(self, batch: np.ndarray) -> BatchPlan:
        """The plan of ``batch`` (``DESCRIPTOR_DTYPE[n]``)."""
        rows = batch.tolist()
        n = len(rows)
        status = [0] * n
        moved = [False] * n
        signals: list[int] = []
        ops: list[CopyRun | SignalWrite] = []
        start = -1  # first row of the open run
        exit_ = False
        for i, row in enumerate(rows):
            op = row[_OP]
            if op == _COPY:
                if start >= 0 and self._extends(rows[start], rows[i - 1], row):
                    continue
                if start >= 0:
                    self._close(rows, start, i, status, moved, ops)
                start = i
                continue
            if start >= 0:
                self._close(rows, start, i, status, moved, ops)
                start = -1
            if op == _SIGNAL:
                signals.append(i)
                self._signal(i, row, status, moved, ops)
            elif op in _CONTROL:
                exit_ = exit_ or op == _EXIT
            else:
                status[i] = abi.Status.BAD_OPCODE
        if start >= 0:
            self._close(rows, start, n, status, moved, ops)
        copied = np.array(moved, bool)
        copied[signals] = False
        return BatchPlan(ops, np.array(status, np.uint32), copied, np.array(moved, bool), exit_)

    @staticmethod
    def _extends(first: tuple, last: tuple, row: tuple) -> bool:
        """Whether ``row`` continues the run ``first .. last``: same regions, contiguous in
        source, destination and position, chunks of the first's length (the last may be
        shorter)."""
        step = last[_LEN]
        return (row[_SRC_R] == first[_SRC_R] and row[_DST_R] == first[_DST_R]
                and row[_SRC_O] == last[_SRC_O] + step and row[_DST_O] == last[_DST_O] + step
                and row[_POS] == last[_POS] + step and step == first[_LEN]
                and row[_LEN] <= step)

    def _close(self, rows: list[tuple], start: int, end: int, status: list[int],
               moved: list[bool], ops: list[CopyRun | SignalWrite]) -> None:
        """Check rows ``start .. end - 1`` (one run) and plan it: as one copy when the span is
        valid (then so is every chunk in it), else chunk by chunk."""
        first = rows[start]
        total = sum(r[_LEN] for r in rows[start:end])
        verdict = check_copy(self.regions, first[_SRC_R], first[_SRC_O], first[_DST_R],
                             first[_DST_O], total, first[_POS])
        if verdict == abi.Status.OK and first[_LEN] % _ALIGN == 0:
            self._run(start, end - start, first, total, moved, ops)
            return
        for i in range(start, end):
            r = rows[i]
            status[i] = check_copy(self.regions, r[_SRC_R], r[_SRC_O], r[_DST_R], r[_DST_O],
                                   r[_LEN], r[_POS])
            if status[i]:
                self._refused(r[_TID])
            else:
                self._run(i, 1, r, r[_LEN], moved, ops)

    def _run(self, first: int, count: int, row: tuple, total: int, moved: list[bool],
             ops: list[CopyRun | SignalWrite]) -> None:
        src_base = int(self.regions[row[_SRC_R]]["base"])
        dst_base = int(self.regions[row[_DST_R]]["base"])
        ops.append(CopyRun(first, count, src_base + row[_SRC_O], dst_base + row[_DST_O], total,
                           row[_LEN], row[_POS], False))
        moved[first:first + count] = [True] * count

    def _refused(self, transfer_id: int) -> None:
        self._failed[transfer_id] = None
        if len(self._failed) > MAX_FAILED_TRANSFERS:
            self._failed.popitem(last=False)

    def _signal(self, i: int, row: tuple, status: list[int], moved: list[bool],
                ops: list[CopyRun | SignalWrite]) -> None:
        offset, word = row[_DST_O], row[_SRC_O]
        bad = check_signal(offset, word)
        if row[_TID] in self._failed:
            del self._failed[row[_TID]]
            bad = bad or abi.Status.CANCELLED
        status[i] = bad
        if not bad:
            ops.append(SignalWrite(i, offset // _ENTRY, word))
            moved[i] = True
