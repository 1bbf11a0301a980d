"""Hostile packets against the CUDA packet-receive kernel, each example checked against the CPU
twin on identical inputs: same counters, same destination bytes, guard bytes after the
destination intact. Runs on the GPU machine (``gpu`` marker)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_kernels import packet_twin
from tests.fuzz import FUZZ
from tests.test_moe_kernels import PacketRing, _backend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rings() -> Iterator[dict[str, PacketRing]]:
    made = {b: PacketRing(_backend(b), b, 16, 64 + 512) for b in ("cpu", "cuda")}
    yield made
    for r in made.values():
        r.close()


@FUZZ
@given(size16=st.integers(1, 14 * 32), seed=st.integers(0, 2**32 - 1),
       mutations=st.lists(st.tuples(st.integers(0, 13), st.sampled_from(
           ["offset", "length", "checksum", "payload", "flags"]), st.integers(0, 2**32 - 1)),
           max_size=6), dst_cut=st.integers(0, 64))
def test_packets_kernel_equals_twin(rings, size16: int, seed: int, mutations: list[tuple],
                                    dst_cut: int) -> None:
    data = np.random.default_rng(seed).integers(0, 256, 16 * size16, dtype=np.uint8)
    results = {}
    for b, pr in rings.items():
        n = packet_twin.send_packets(pr.ring, data, seed, 0, 1, 2)
        first = pr.ring.consumed
        for p, field, value in mutations:
            if p >= n:
                continue
            idx = (first + p) & (pr.ring.capacity - 1)
            if field == "payload":
                pr.ring.payload[idx, value % 512] ^= 1 + value % 255
            elif field == "flags":  # the LAST flag stays where the sender put it
                continue
            else:
                pr.ring.entries[idx][field] = value % (2**32)
        size = max(16, data.size - 16 * dst_cut)
        results[b] = pr.receive(size, n)
    (cpu_counts, cpu_dst), (gpu_counts, gpu_dst) = results["cpu"], results["cuda"]
    assert gpu_counts == cpu_counts
    np.testing.assert_array_equal(gpu_dst, cpu_dst)  # includes the guard bytes after dst
