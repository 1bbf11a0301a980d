"""The DMA engine's batch planner (dma_engine/plan.py) against the descriptor check's twin:
for any batch (deliveries cut into chunks, then fields overwritten at random), every
descriptor's status is what ``check_descriptor`` (or the SIGNAL rules) gives it alone, and the
planned runs move exactly the valid copies' bytes, each once, in batch order."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dma_engine.plan import Planner
from dma_engine.signals import TABLE_BYTES, SignalWrite, check_signal
from dpu_offload import abi
from dpu_offload.channel import state_word
from gpu_kernels.reference import check_descriptor

ALIGN = abi.COPY_ALIGN_BYTES
SIZE = 1 << 20
BASES = {0: 1 << 40, 1: 2 << 40, 2: 3 << 40}
FIELDS = ("opcode", "src_region", "src_offset", "dst_region", "dst_offset", "length",
          "position", "transfer_id")


def regions() -> np.ndarray:
    table = np.zeros(abi.MAX_REGIONS, abi.REGION_DTYPE)
    table[0] = (BASES[0], SIZE, abi.RegionFlags.READABLE, 0)
    table[1] = (BASES[1], SIZE, abi.RegionFlags.READABLE | abi.RegionFlags.WRITABLE, 0)
    table[2] = (BASES[2], SIZE // 2, abi.RegionFlags.WRITABLE, 0)
    return table


@st.composite
def batches(draw: st.DrawFn) -> np.ndarray:
    rows = []
    for tid in range(1, draw(st.integers(1, 4)) + 1):
        chunk = draw(st.sampled_from([ALIGN, 4 * ALIGN, 16 * ALIGN]))
        count = draw(st.integers(1, 6))
        src, dst = draw(st.integers(0, 8)) * chunk, draw(st.integers(0, 8)) * chunk
        last = draw(st.integers(1, chunk // ALIGN)) * ALIGN
        # Ragged: contiguous chunks of any lengths (a run must still be checked chunk-wise).
        ragged = draw(st.booleans())
        at = 0
        for k in range(count):
            length = (draw(st.sampled_from([chunk, ALIGN, 200, 100, 56])) if ragged
                      else last if k == count - 1 else chunk)
            rows.append((tid, abi.Opcode.COPY, 0, k, count + 1, 0, src + at, 1, 0, dst + at,
                         length, at, 0))
            at += length
        if draw(st.booleans()):
            word = state_word(tid, draw(st.sampled_from(list(abi.SlotState))))
            offset = draw(st.sampled_from([16 * tid, 16 * tid + 8, TABLE_BYTES]))
            rows.append((tid, abi.Opcode.SIGNAL, 0, count, count + 1, 0, word, 0, 0, offset, 0,
                         0, 0))
    if draw(st.booleans()):
        rows.append((0, draw(st.sampled_from([abi.Opcode.NOP, abi.Opcode.EXIT, 77])), 0, 0, 0,
                     0, 0, 0, 0, 0, 0, 0, 0))
    batch = np.array(rows, abi.DESCRIPTOR_DTYPE)
    for _ in range(draw(st.integers(0, 4))):  # hostile or corrupted fields
        i = draw(st.integers(0, len(rows) - 1))
        name = draw(st.sampled_from(FIELDS))
        if name == "opcode":
            value = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 9]))
        elif name.endswith("region"):
            value = draw(st.sampled_from([0, 1, 2, 3, 63, 2**32 - 1]))
        else:
            value = draw(st.one_of(st.integers(0, 2 * SIZE), st.just(2**32 - 1)))
        bits = np.iinfo(batch.dtype[name]).max
        batch[i][name] = min(value, bits)
    return batch


def expected(batch: np.ndarray, table: np.ndarray) -> tuple[list[int], set[int]]:
    """Each descriptor's status checked alone (and the SIGNAL rules), and the valid copies."""
    status, valid, refused = [], set(), set()
    for i, d in enumerate(batch):
        op = int(d["opcode"])
        if op == abi.Opcode.SIGNAL:
            bad = int(check_signal(int(d["dst_offset"]), int(d["src_offset"])))
            tid = int(d["transfer_id"])
            if tid in refused:
                refused.discard(tid)
                bad = bad or int(abi.Status.CANCELLED)
            status.append(bad)
            continue
        s = int(check_descriptor(d, table))
        status.append(s)
        if op == abi.Opcode.COPY:
            if s:
                refused.add(int(d["transfer_id"]))
            else:
                valid.add(i)
    return status, valid


@settings(max_examples=max(500, settings.default.max_examples))
@given(batches())
def test_statuses_and_runs_are_those_of_each_descriptor_alone(batch: np.ndarray) -> None:
    table = regions()
    plan = Planner(table).plan(batch)
    status, valid = expected(batch, table)
    assert plan.status.tolist() == status
    assert set(np.flatnonzero(plan.copied).tolist()) == valid
    signals = {i for i, d in enumerate(batch)
               if int(d["opcode"]) == abi.Opcode.SIGNAL and status[i] == 0}
    assert set(np.flatnonzero(plan.moved).tolist()) == valid | signals
    covered: list[int] = []
    for op in plan.ops:
        if isinstance(op, SignalWrite):
            d = batch[op.first]
            assert op.first in signals and op.word == int(d["src_offset"])
            assert op.index * abi.SLOT_STATE_DTYPE.itemsize == int(d["dst_offset"])
            covered.append(op.first)
            continue
        at_src, at_dst, total = op.src, op.dst, 0
        for i in range(op.first, op.first + op.count):
            d = batch[i]
            assert i in valid
            assert at_src == BASES[int(d["src_region"])] + int(d["src_offset"])
            assert at_dst == BASES[int(d["dst_region"])] + int(d["dst_offset"])
            at_src += int(d["length"])
            at_dst += int(d["length"])
            total += int(d["length"])
            covered.append(i)
        assert total == op.nbytes
    assert covered == sorted(valid | signals)  # each once, in batch order


def test_a_refused_copy_cancels_its_signal_in_a_later_batch() -> None:
    table = regions()
    planner = Planner(table)
    bad = np.array([(9, abi.Opcode.COPY, 0, 0, 2, 0, 0, 1, 0, 0, 3 * SIZE, 0, 0)],
                   abi.DESCRIPTOR_DTYPE)
    sig = np.array([(9, abi.Opcode.SIGNAL, 0, 1, 2, 0, state_word(1, abi.SlotState.LANDED), 0,
                     0, 16, 0, 0, 0)], abi.DESCRIPTOR_DTYPE)
    assert planner.plan(bad).status.tolist() == [abi.Status.OUT_OF_BOUNDS]
    later = planner.plan(sig)
    assert later.status.tolist() == [abi.Status.CANCELLED] and not later.ops
    assert planner.plan(sig).status.tolist() == [0]  # remembered once
