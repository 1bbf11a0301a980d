"""Pinned hits: a client acquires an expert its slot still holds READY through the channel's pin
table, with no request posted, and the agent never gives a pinned slot to another delivery
(docs/ABI.md, "Pinned hits")."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent.slots import CHECK_GRACE_SECONDS, SlotPool
from dpu_offload import abi
from dpu_offload.channel import Channel, state_word
from dpu_offload.keys import ExpertKey
from dpu_offload.shm import SharedBuffer
from host_client import AgentClient, AgentError, CpuReferenceDevice, SlotPoolSpec
from host_client.errors import NotFound
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes

READY, FILLING = abi.SlotState.READY, abi.SlotState.FILLING


def _fill(pool: SlotPool, key: ExpertKey) -> int:
    idx = pool.allocate(key, refs=0)
    assert idx is not None
    pool.mark_ready(idx)
    return idx


def test_a_pinned_slot_is_not_given_to_another_delivery(pool: SlotPool) -> None:
    """The agent stores the new word, reads the pin, and puts the old word back."""
    a, b, c = (ExpertKey("m", 0, e) for e in range(3))
    ia, ib = _fill(pool, a), _fill(pool, b)
    view = pool.channel.view
    word_a = state_word(pool.generation[ia], READY)
    assert view.try_pin(ia, word_a)
    assert pool.allocate(c) == ib  # a is older but pinned: b goes
    assert int(view.words[ia]) == word_a and pool.keys[ia] == a and pool.by_key[a] == ia
    assert pool.allocate(ExpertKey("m", 0, 3)) is None  # b is held now, a pinned
    assert int(view.words[ia]) == word_a
    view.unpin(ia)
    assert pool.allocate(ExpertKey("m", 0, 3)) == ia
    assert int(view.words[ia]) == state_word(pool.generation[ia], FILLING)
    assert not view.try_pin(ia, word_a)  # the generation moved on: no hit on it
    assert int(view.pins["pins"][ia]) == 0


def test_free_slots_go_lowest_first_and_a_pinned_one_stays_free(pool: SlotPool) -> None:
    """``allocate`` takes the lowest free slot (a heap of the slots freed, not a scan of the
    pool); a free slot the client still has pinned is passed over (the idle one is evicted
    instead) and stays free for the next allocate once unpinned."""
    a, b, c, d = (ExpertKey("m", 0, e) for e in range(4))
    ia, ib = _fill(pool, a), _fill(pool, b)
    assert (ia, ib) == (0, 1)
    pool.free(ib)
    pool.free(ia)
    assert _fill(pool, a) == 0  # the lowest of the two freed
    view = pool.channel.view
    assert view.try_pin(0, state_word(pool.generation[0], READY))
    pool.free(0)  # freed while the client still pins it
    assert pool.allocate(c) == 1  # slot 0 passed over: pinned
    assert pool.state[0] == abi.SlotState.FREE and pool.keys[0] is None
    view.unpin(0)
    assert pool.allocate(d) == 0


def test_a_granted_landed_slot_waits_for_its_verdict_before_reuse(pool: SlotPool) -> None:
    """An unheld LANDED slot whose generation a client was granted may be under its check:
    it goes to another delivery only once the verdict came (or the grace passed), so the old
    generation's verdict is never written over the new FILLING word. One never granted (a
    prefetch nobody acquired) has no check and goes at once."""
    a, b, c = (ExpertKey("m", 0, e) for e in range(3))
    view = pool.channel.view
    ia = pool.allocate(a)
    ib = pool.allocate(b)
    assert ia is not None and ib is not None
    pool.granted[ia] = True  # SlotGrants.acquire granted a; b was a prefetch
    for i in (ia, ib):
        assert pool.let_go(i)
        pool.mark_landed(i)
    assert pool.checking(ia) and not pool.checking(ib)
    assert pool.unheld_landing() == 1
    assert pool.allocate(c) == ib  # a is older but may be under its check
    assert pool.let_go(ib)
    pool.mark_landed(ib)
    assert pool.allocate(ExpertKey("m", 0, 3)) == ib  # ib again, never granted; a still not
    view.store_word(ia, state_word(pool.generation[ia], READY))  # the client's verdict
    assert not pool.checking(ia)
    assert pool.allocate(ExpertKey("m", 0, 4)) == ia
    pool.granted[ia] = True
    assert pool.let_go(ia)
    pool.mark_landed(ia)
    pool.landed_at[ia] -= CHECK_GRACE_SECONDS  # no verdict, but long landed: no check runs
    assert not pool.checking(ia) and pool.unheld_landing() == 0


def test_a_slot_hit_by_a_pin_since_it_went_idle_is_evicted_last(pool: SlotPool) -> None:
    a, b = ExpertKey("m", 0, 0), ExpertKey("m", 0, 1)
    ia, ib = _fill(pool, a), _fill(pool, b)  # a went idle first
    view = pool.channel.view
    assert view.try_pin(ia, state_word(pool.generation[ia], READY))
    view.unpin(ia)  # used since: a second chance
    assert pool.allocate(ExpertKey("m", 0, 2)) == ib
    assert pool.let_go(ib)
    pool.mark_ready(ib)
    assert pool.allocate(ExpertKey("m", 0, 3)) == ia  # its chance was used


def test_a_pin_on_a_word_that_moved_is_undone(pool: SlotPool) -> None:
    ia = _fill(pool, ExpertKey("m", 0, 0))
    view = pool.channel.view
    assert not view.try_pin(ia, state_word(pool.generation[ia] + 1, READY))
    assert int(view.pins["pins"][ia]) == 0


def _pinner(name: str, size: int, slots: int, stop_at: float, out: mp.Queue) -> None:
    """Client process: pin whatever the first ``slots`` slots hold READY, in one batch
    (``try_pin_many``), then check that each pinned word stays put while held."""
    buf = SharedBuffer(name, size)
    view = Channel(buf.array)
    hits = moved = 0
    while time.monotonic() < stop_at:
        words = [int(view.words[i]) for i in range(slots)]
        wanted = [(i, w) for i, w in enumerate(words) if w & 0xFF == READY]
        held = [iw for iw, ok in zip(wanted, view.try_pin_many(wanted), strict=True) if ok]
        hits += len(held)
        for _ in range(50):  # the agent may store EVICTING and put the word back, no more
            moved += sum(int(view.words[i]) not in (w, w - READY + abi.SlotState.EVICTING)
                         for i, w in held)
        for i, _ in held:
            view.unpin(i)
    out.put((hits, moved))
    del view
    buf.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_pins_and_reuse_exclude_each_other_across_processes(pool: SlotPool, slots: int) -> None:
    """A client process pins the pool's slots as often as it can (two: both in one batch,
    one fence) while this process (the agent) keeps giving them to new experts: a pinned word
    never changes under its pin."""
    some = SlotPool(region_id=2, slot_bytes=64, slot_count=slots, channel=pool.channel)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    stop_at = time.monotonic() + 6.0
    proc = ctx.Process(target=_pinner, args=(pool.channel.name, pool.channel.size, slots,
                                             stop_at + 1.0, out))
    proc.start()
    try:
        refused = reused = 0
        e = 0
        while time.monotonic() < stop_at:
            e += 1
            idx = some.allocate(ExpertKey("m", 0, e))
            if idx is None:
                refused += 1
                continue
            reused += 1
            some.refs[idx] = 0
            some.mark_ready(idx)
        hits, moved = out.get(timeout=30)
    finally:
        proc.join(10)
    assert moved == 0
    assert hits > 100 and reused > 100 and refused > 0, (hits, reused, refused)


@pytest.fixture
def client(agent: AgentProcess) -> Iterator[AgentClient]:
    c = AgentClient(agent.address, client_name="pytest-pins")
    yield c
    c.close()


@pytest.mark.parametrize("delivery", ["pull", "engine"])
def test_a_resident_expert_is_a_pinned_hit_with_nothing_posted(
        client: AgentClient, qwen_ckpt: Path, delivery: str) -> None:
    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), f"qwen-pin-{delivery}")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 1)],
                                 delivery=delivery)
    key, other = ExpertKey(model.model, 1, 2), ExpertKey(model.model, 1, 3)
    first = client.acquire(dev, key)
    first.wait(10)
    assert not first.pinned_hit and first.resident is False
    client.release(dev, key)
    posted = dev.channel.view.requests.produced
    hit = client.acquire(dev, key)
    assert hit.pinned_hit and hit.resident and hit.done()
    assert dev.channel.view.requests.produced == posted  # no request on the ring
    down = "model.layers.1.mlp.experts.2.down_proj.weight"
    assert hit.wait(0).raw("down_proj").tobytes() == truth[down]
    # Pinned, the pool's one slot cannot take another expert: a clear refusal.
    with pytest.raises(AgentError) as err:
        client.acquire(dev, other).wait(10)
    assert "pinned" in str(err.value)
    assert hit.wait(0).raw("down_proj").tobytes() == truth[down]
    client.release(dev, key)  # drops the pin, posts nothing
    assert dev.channel.view.requests.produced == posted + 1
    slot = client.acquire(dev, other).wait(10)
    assert slot.raw("down_proj").tobytes() == truth["model.layers.1.mlp.experts.3.down_proj.weight"]
    client.release(dev, other)
    again = client.acquire(dev, key)  # its slot went to `other`: asked for, delivered anew
    assert not again.pinned_hit
    assert again.wait(10).raw("down_proj").tobytes() == truth[down]


def test_a_batch_refused_before_its_post_keeps_none_of_its_pins(
        client: AgentClient, qwen_ckpt: Path) -> None:
    """A batch of a pinned hit and a miss whose model is not loaded: NOT_FOUND, and the
    hit's pin is given back (the slot can take another expert), nothing posted."""
    model = client.load_model(str(qwen_ckpt), "qwen-pin-batch")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 1)])
    key = ExpertKey(model.model, 1, 2)
    client.acquire(dev, key).wait(10)
    client.release(dev, key)
    posted = dev.channel.view.requests.produced
    index = dev.channel._granted[key][0]
    with pytest.raises(NotFound, match="never-loaded"):
        client.acquire_batch(dev, [key, ExpertKey("never-loaded", 1, 2)])
    assert int(dev.channel.view.pins[index]["pins"]) == 0
    assert dev.channel.view.requests.produced == posted
    other = ExpertKey(model.model, 1, 3)
    client.acquire(dev, other).wait(10)  # the one slot was not left pinned
    client.release(dev, other)


def test_a_pin_table_full_of_garbage_costs_only_its_own_session(agent: AgentProcess,
                                                                 qwen_ckpt: Path) -> None:
    """The pin table is client-written: a session that fills its own with garbage only keeps
    its own slots from being reused (RESOURCE_EXHAUSTED naming the pins, nothing changed);
    another session is served, and once the table is sane again so is the first."""
    truth = checkpoint_bytes(qwen_ckpt)
    with AgentClient(agent.address) as bad, AgentClient(agent.address) as good:
        model = bad.load_model(str(qwen_ckpt), "qwen-garbage")
        dev = bad.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        gdev = good.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        pins = dev.channel.view.pins
        pins["pins"] = 0xFFFFFFFF
        pins["touches"] = 0xDEADBEEF
        key = ExpertKey(model.model, 0, 1)
        with pytest.raises(AgentError) as err:
            bad.acquire(dev, key).wait(10)
        assert "pinned" in str(err.value)
        name = "model.layers.0.mlp.experts.1.down_proj.weight"
        assert good.acquire(gdev, key).wait(10).raw("down_proj").tobytes() == truth[name]
        pins["pins"] = 0
        assert bad.acquire(dev, key).wait(10).raw("down_proj").tobytes() == truth[name]


def test_references_decide_eviction(pool: SlotPool) -> None:
    """The reference rule (``SlotPool.hold`` / ``let_go``): a held slot is never an eviction
    candidate; the last reference dropped on a settled slot queues it, on one still filling
    does not (it is queued when it lands)."""
    a, b = ExpertKey("m", 0, 0), ExpertKey("m", 0, 1)
    ia = _fill(pool, a)
    assert pool.is_idle(ia)
    pool.hold(ia, 2)
    assert not pool.is_idle(ia) and pool.refs[ia] == 2
    assert pool.let_go(ia) and not pool.is_idle(ia)
    assert pool.let_go(ia) and pool.is_idle(ia)
    assert not pool.let_go(ia), "nobody holds it: nothing to drop"
    ib = pool.allocate(b)
    assert ib is not None and pool.let_go(ib) and not pool.is_idle(ib)  # still FILLING
    pool.mark_ready(ib)
    assert pool.is_idle(ib)
