"""Hostile descriptors against the persistent CUDA receive kernel, each example checked against
the CPU twin on identical inputs: same statuses and counters, same destination bytes, guard
bytes intact. Runs on the GPU machine (``gpu`` marker); `make fuzz` there runs 10,000 examples.
Packets have their own module (test_fuzz_gpu_packets.py), so the persistent kernel started
here has ended before they run."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_offload import abi
from dpu_offload.checksum import chunk_checksum
from tests.fuzz import FUZZ
from tests.kernel_harness import GUARD, Harness
from tests.test_kernels import DST, SRC, _desc

pytestmark = pytest.mark.gpu
SLOTS = 32
SLOT = DST // SLOTS


@pytest.fixture(scope="module")
def harnesses() -> Iterator[dict[str, Harness]]:
    pytest.importorskip("cupy")
    src = np.random.default_rng(5).integers(0, 256, SRC, dtype=np.uint8)
    made = {b: Harness(b, src, DST, capacity=SLOTS) for b in ("cpu", "cuda")}
    yield SimpleNamespace(src=src, **made)
    for h in made.values():
        h.close()


@FUZZ
@given(st.lists(st.tuples(st.integers(1, SLOT // 16), st.integers(0, SRC // 16 - 1),
                          st.integers(0, 7), st.integers(0, 2**64 - 1)),
                min_size=1, max_size=SLOTS))
def test_descriptors_kernel_equals_twin(harnesses, descs: list[tuple]) -> None:
    src = harnesses.src
    d = _desc(len(descs))
    for i, (n16, so16, fault, bait) in enumerate(descs):
        length, so = 16 * n16, min(16 * so16, SRC - 16 * n16)
        d[i]["src_offset"], d[i]["dst_offset"], d[i]["length"], d[i]["position"] = (
            so, i * SLOT, length, so)
        d[i]["checksum"] = chunk_checksum(src[so:so + length], so)
        # Every fault keeps descriptors' destinations disjoint (the kernel runs them in
        # parallel, the twin in order): a fault either leaves the write inside slot i or
        # makes it refused.
        if fault == 1:
            d[i]["src_offset"] = bait % (2**64)
        elif fault == 2:
            d[i]["length"] = DST + 16 * (1 + bait % 2**27)  # uint32, past any slot
        elif fault == 3:
            d[i]["dst_offset"] = DST + bait % 2**63
        elif fault == 4:  # any opcode but EXIT, which would end the persistent kernel
            d[i]["opcode"] = bait % (2**16) if bait % (2**16) != abi.Opcode.EXIT else 2**15
        elif fault == 5:
            d[i]["checksum"] ^= 1 << (bait % 32)
        elif fault == 6:
            d[i]["dst_region"] = bait % (2**32)
        elif fault == 7:
            d[i]["length"] += 1 + bait % 15
    got = {b: getattr(harnesses, b).run(d.copy()) for b in ("cpu", "cuda")}
    assert {k: v[0] for k, v in got["cuda"].items()} == {k: v[0] for k, v in got["cpu"].items()}
    cpu, cuda = harnesses.cpu.dst(), harnesses.cuda.dst()
    np.testing.assert_array_equal(cuda, cpu)
    assert (cuda[:GUARD] == cpu[:GUARD]).all() and (cuda[GUARD + DST:] == cpu[GUARD + DST:]).all()
