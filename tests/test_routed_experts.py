"""A layer's routing counted on the host (``layer_fetch.routed_experts``): a decode step's few
ids through a list, larger ones through NumPy; both give each chosen expert's token count, in
expert order, ids outside the layer's experts dropped."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from host_client.integrations.layer_fetch import SMALL_ROUTING, routed_experts  # noqa: E402

EXPERTS = 64


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-3, EXPERTS + 3), min_size=1, max_size=3 * SMALL_ROUTING),
       st.sampled_from([1, 2, 8]))
def test_counts_equal_a_plain_count_on_both_sides_of_the_cut(ids: list[int], k: int) -> None:
    ids = ids[:len(ids) // k * k] or ids[:1] * k
    indices = torch.tensor(ids).reshape(-1, k)
    want = Counter(e for e in ids if 0 <= e < EXPERTS)
    got = routed_experts(indices, EXPERTS)
    assert got == dict(want)
    assert list(got) == sorted(got)
