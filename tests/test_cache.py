"""Arena allocator under churn, and the weight cache under concurrent hits, misses and
evictions: bytes served always equal the checkpoint's."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dpu_agent.routing.stats import RoutingStats
from dpu_agent.weights.arena import ARENA_ALIGN, Arena
from dpu_agent.weights.cache import CachedExpert, CacheFullError, WeightCache, WouldBlock
from dpu_agent.weights.catalog import build_catalog
from dpu_agent.weights.policies import POLICIES, make_policy
from dpu_offload.blob import align_up
from dpu_offload.checksum import blob_checksums, terms_sum
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.checkpoints import CheckpointSpec, make_checkpoint
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes, policy_candidates


def test_allocator_survives_churn_and_coalesces() -> None:
    arena = Arena(64 << 20)
    rng = random.Random(5)
    live: dict[int, int] = {}
    try:
        for _ in range(4000):
            if live and (rng.random() < 0.5 or arena.free_bytes < 4 << 20):
                off = rng.choice(list(live))
                arena.free(off)
                del live[off]
            else:
                n = rng.choice([300_000, 1_100_000, 2_500_000, 4_000_000])
                off = arena.alloc(n)
                if off is not None:
                    assert off % ARENA_ALIGN == 0
                    for o, m in live.items():
                        assert off + n <= o or o + m <= off, "overlap"
                    live[off] = n
        assert 0.0 <= arena.fragmentation < 1.0
        for off in list(live):
            arena.free(off)
        assert arena.used_bytes == 0 and arena.fragmentation == 0.0
        assert arena.alloc(arena.size) == 0, "free space must coalesce back into one block"
    finally:
        arena.close()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_concurrent_hits_misses_evictions_serve_true_bytes(tmp_path: Path, policy: str) -> None:
    root = make_checkpoint(tmp_path / "m", CheckpointSpec("mixtral", layers=2, experts=8,
                                                          hidden=256, intermediate=128))
    cat = build_catalog(root)
    entries = list(cat.experts.values())
    truth = {}
    for e in entries:
        blob = np.zeros(e.blob_bytes, np.uint8)
        for t in e.tensors:
            blob[t.offset:t.offset + t.nbytes] = np.frombuffer(
                t.file.read_bytes()[t.file_offset:t.file_offset + t.nbytes], np.uint8)
        truth[e.key] = blob
    arena = Arena(6 * cat.expert_bytes)  # 6 of 16 experts fit: constant eviction
    cache = WeightCache(arena, 64 << 10, make_policy(policy, RoutingStats()))
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            e = rng.choice(entries)
            try:
                c = cache.acquire(e)
            except CacheFullError:
                continue
            got = arena.view(c.offset, e.blob_bytes)
            if not np.array_equal(got, truth[e.key]):
                errors.append(f"{e.key}: wrong bytes")
            if list(c.checksums) != blob_checksums(truth[e.key], 64 << 10):
                errors.append(f"{e.key}: wrong checksums")
            if c.expected != terms_sum(truth[e.key]):
                errors.append(f"{e.key}: wrong expected sum")
            cache.release(c)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors[:5]
        assert cache.stats.evictions > 0 and cache.stats.hits > 0
        assert cache.pinned() == 0
    finally:
        arena.close()


_OPS = st.lists(st.tuples(st.sampled_from(["acquire"] * 3 + ["release"] * 2
                                          + ["peek", "invalidate"]),
                          st.integers(0, 4)), min_size=1, max_size=40)


@pytest.fixture(scope="module")
def five_experts(tmp_path_factory: pytest.TempPathFactory) -> list:
    root = make_checkpoint(tmp_path_factory.mktemp("five") / "m",
                           CheckpointSpec("mixtral", layers=1, experts=5, hidden=64,
                                          intermediate=32))
    return list(build_catalog(root).experts.values())


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=100, deadline=None)
@given(ops=_OPS)
@example(ops=[("acquire", 0), ("release", 0), ("acquire", 0), ("acquire", 1), ("acquire", 2),
              ("acquire", 3)])  # a hit pins an expert nobody held
@example(ops=[("acquire", 0), ("release", 0), ("peek", 0), ("acquire", 1), ("acquire", 2),
              ("acquire", 3)])  # so does a peek
@example(ops=[("acquire", 0), ("invalidate", 0), ("acquire", 0), ("release", 0), ("acquire", 1),
              ("acquire", 2), ("acquire", 3)])  # the first pin's release is not the refill's
def test_an_eviction_takes_only_a_filled_unpinned_expert(five_experts: list, policy: str,
                                                         ops: list[tuple[str, int]]) -> None:
    """Any sequence of acquires, releases, peeks and invalidations on a cache of 3 of 5
    experts: an acquire that needs room evicts an expert nobody holds (what is pinned stays
    where it is, its bytes unchanged, an invalidated copy too until its last pin goes), and
    fails with CacheFullError, changing nothing, when the arena is all pinned; once every pin
    is given back, the arena holds exactly the resident experts. After every step the policy
    knows exactly the evictable experts (a victim is never searched for among pinned ones)."""
    arena = Arena(3 * five_experts[0].blob_bytes)
    cache = WeightCache(arena, 64 << 10, make_policy(policy, RoutingStats()))
    held: dict[int, list[CachedExpert]] = {j: [] for j in range(5)}  # the pins this test holds
    truth = [None] * 5
    try:
        for op, i in ops:
            entry = five_experts[i]
            if op == "acquire":
                before = cache.resident
                try:
                    got = cache.acquire(entry)
                except CacheFullError:
                    pinned = {id(c) for copies in held.values() for c in copies}
                    assert len(pinned) == 3 and cache.resident == before
                    continue
                held[i].append(got)
            elif op == "peek":
                got = cache.peek(entry.key)
                if got is not None:
                    held[i].append(got)
            elif op == "release" and held[i]:
                cache.release(held[i].pop())
            elif op == "invalidate":
                cache.invalidate(entry.key)
            if policy != "routing":  # it keeps no set: it ranks the candidates it is given
                assert policy_candidates(cache.policy) == cache.evictable
            for j, copies in held.items():  # read only: a pin held stays in place
                for c in copies:
                    view = arena.view(c.offset, five_experts[j].blob_bytes)
                    if truth[j] is None:
                        truth[j] = view.copy()
                    assert np.array_equal(view, truth[j]), f"expert {j} is pinned, was evicted"
        for copies in held.values():
            for c in copies:
                cache.release(c)
        assert cache.pinned() == 0
        assert arena.used_bytes == cache.resident * five_experts[0].blob_bytes
    finally:
        arena.close()


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_batch_finds_in_the_arena_what_it_asks_for_after_its_misses(tmp_path: Path,
                                                                      policy: str) -> None:
    """A batch whose arena misses come before experts it finds in the arena (a real agent, an
    arena of 8 experts): its fills evict neither of those, so only the misses are read from
    the checkpoint, and every slot holds the checkpoint's bytes. (Filled as the loop met them,
    the four misses evicted the four experts the batch asked for next: 16 reads, not 12.)"""
    root = make_checkpoint(tmp_path / "m", CheckpointSpec("qwen3-moe", layers=1, experts=12,
                                                          hidden=512, intermediate=512))
    truth = checkpoint_bytes(root)
    blob = next(iter(build_catalog(root).experts.values())).blob_bytes
    arena = 8 * align_up(blob, ARENA_ALIGN)
    with AgentProcess(f'[arena]\nbytes = {arena}\n[cache]\npolicy = "{policy}"\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(root), "m")
        warm = client.register_device(CpuReferenceDevice(0), [SlotPoolSpec(model.expert_bytes, 8)])
        cold = client.register_device(CpuReferenceDevice(1), [SlotPoolSpec(model.expert_bytes, 8)])
        keys = [ExpertKey("m", 0, e) for e in range(12)]
        for key in keys[:8]:  # one at a time: the arena holds 0-7, 0 used longest ago
            client.acquire(warm, key).wait(10)
            client.release(warm, key)
        assert client.status().cache_misses == 8
        batch = keys[8:] + keys[:4]
        slots = [h.wait(10) for h in client.acquire_batch(cold, batch)]
        assert client.status().cache_misses == 12
        for slot in slots:
            for role in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.0.mlp.experts.{slot.key.expert}.{role}.weight"
                assert slot.raw(role).tobytes() == truth[name], (slot.key, role)
        client.release_batch(cold, batch)


def test_acquire_without_waiting_serves_hits_only(tmp_path: Path) -> None:
    """``wait=False`` (the agent's event-loop fast path) returns a filled resident expert and
    refuses an absent or still-filling one with WouldBlock, changing nothing."""
    root = make_checkpoint(tmp_path / "m", CheckpointSpec("mixtral", layers=1, experts=2,
                                                          hidden=256, intermediate=128))
    e0, e1 = build_catalog(root).experts.values()
    arena = Arena(4 * e0.blob_bytes)
    cache = WeightCache(arena, 64 << 10, make_policy("lru", RoutingStats()))
    try:
        with pytest.raises(WouldBlock):
            cache.acquire(e0, wait=False)
        assert (cache.resident, cache.stats.misses, cache.stats.hits) == (0, 0, 0)
        filled = cache.acquire(e0)
        cache.release(filled)
        hit = cache.acquire(e0, wait=False)
        assert hit is filled and cache.pinned() == 1 and cache.stats.hits == 1
        cache.release(hit)
        cache.acquire(e1)  # a fill in progress is not a hit either
        cache._resident[e1.key].ready.clear()
        with pytest.raises(WouldBlock):
            cache.acquire(e1, wait=False)
        assert cache.pinned() == 1
    finally:
        arena.close()


def test_ingest_writes_manifest(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "q", CheckpointSpec("qwen3-moe", layers=1, experts=3))
    out = tmp_path / "manifest.json"
    res = subprocess.run([sys.executable, "-m", "dpu_agent.cli", "ingest", str(root), "--out",
                          str(out), "--chunk-bytes", "65536"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    manifest = json.loads(out.read_text())
    assert set(manifest["experts"]) == {f"l0-e{e}" for e in range(3)}
    cat = build_catalog(root)
    entry = cat.experts[next(iter(cat.experts))]
    blob = np.zeros(entry.blob_bytes, np.uint8)
    for t in entry.tensors:
        blob[t.offset:t.offset + t.nbytes] = np.frombuffer(
            t.file.read_bytes()[t.file_offset:t.file_offset + t.nbytes], np.uint8)
    key = f"l{entry.key.layer}-e{entry.key.expert}"
    assert manifest["experts"][key]["chunk_checksums"] == blob_checksums(blob, 65536)
    bad = subprocess.run([sys.executable, "-m", "dpu_agent.cli", "ingest", str(root), "--out",
                          str(out), "--chunk-bytes", "10"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--chunk-bytes" in bad.stderr
