"""Grants held by the client's pins (``ReplyFlags.PIN_HELD``, docs/ABI.md): on a device the DMA
engine serves, the client holds each granted slot by a pin it takes with the reply, the agent
drops the grant's reference once it sees the pin's touch, and a release is the client's unpin,
with nothing posted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dpu_agent import slots
from dpu_agent.slots import SlotPool
from dpu_offload import abi
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, AgentError, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes
from tests.test_engine import metric


def _granted(pool: SlotPool, key: ExpertKey) -> int:
    """A slot allocated for ``key`` with one reference, handed off as a PIN_HELD grant."""
    idx = pool.allocate(key, refs=1)
    assert idx is not None
    pool.hand_off(idx)
    return idx


def test_the_grant_reference_goes_once_the_pin_is_in_place(pool: SlotPool) -> None:
    a, b, c = (ExpertKey("m", 0, e) for e in range(3))
    ia, ib = _granted(pool, a), _granted(pool, b)
    pool.mark_ready(ia)
    pool.mark_ready(ib)
    view = pool.channel.view
    assert pool.allocate(c) is None  # no pin yet: both still held through the agent
    assert pool.refs == [1, 1]
    assert view.hold(ia, pool.generation[ia])
    assert pool.allocate(c) is None  # a's reference went to its pin, which holds it
    assert pool.refs[ia] == 0 and int(view.pins["pins"][ia]) == 1
    assert int(view.words[ia]) >> abi.SLOT_STATE_BITS == pool.generation[ia]
    view.unpin(ia)  # the client's release
    assert pool.allocate(c) == ia
    assert pool.held_count() == 2  # b's grant, never pinned, and c's


def test_two_grants_of_one_slot_are_handed_off_one_pin_at_a_time(pool: SlotPool) -> None:
    a = ExpertKey("m", 0, 0)
    ia = _granted(pool, a)
    pool.mark_ready(ia)
    pool.hold(ia)
    pool.hand_off(ia)  # the same expert granted again (a hit) before either pin
    view = pool.channel.view
    assert view.hold(ia, pool.generation[ia])
    pool.settle_handoffs()
    assert pool.refs[ia] == 1
    assert view.hold(ia, pool.generation[ia])
    pool.settle_handoffs()
    assert pool.refs[ia] == 0 and int(view.pins["pins"][ia]) == 2
    assert pool.is_idle(ia)  # a candidate the pins keep: the other slot goes first
    assert pool.allocate(ExpertKey("m", 0, 1), refs=0) == 1
    pool.mark_ready(1)
    assert pool.allocate(ExpertKey("m", 0, 2)) == 1
    view.unpin(ia)
    view.unpin(ia)
    assert pool.allocate(ExpertKey("m", 0, 3)) == ia


def test_grants_waiting_for_their_pins_are_bounded(pool: SlotPool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_HANDOFFS`` slots waiting for their pins a grant keeps the agent's reference
    (answered without PIN_HELD: the client releases it with a RELEASE), so a client that takes
    no replies cannot make every eviction read a whole pool's touches."""
    monkeypatch.setattr(slots, "MAX_HANDOFFS", 1)
    a, b = ExpertKey("m", 0, 0), ExpertKey("m", 0, 1)
    ia = pool.allocate(a, refs=1)
    ib = pool.allocate(b, refs=1)
    assert ia is not None and ib is not None
    assert pool.hand_off(ia) and pool.hand_off(ia)  # the same slot again: still one waiting
    assert not pool.hand_off(ib)
    view = pool.channel.view
    assert view.hold(ia, pool.generation[ia]) and view.hold(ia, pool.generation[ia])
    pool.settle_handoffs()
    assert pool.refs[ia] == 0 and pool.hand_off(ib)


def test_a_hold_on_a_generation_that_moved_is_undone(pool: SlotPool) -> None:
    ia = _granted(pool, ExpertKey("m", 0, 0))
    view = pool.channel.view
    assert not view.hold(ia, pool.generation[ia] + 1)
    assert int(view.pins["pins"][ia]) == 0


def test_touches_the_client_never_pinned_for_cost_only_its_own_grants(pool: SlotPool) -> None:
    """``touches`` is client-written: a touch with no pin lets the agent drop only the
    references it handed off (never more, never another's), so it costs the client its own
    grant's protection and nothing else."""
    a, b = ExpertKey("m", 0, 0), ExpertKey("m", 0, 1)
    ia = _granted(pool, a)
    ib = pool.allocate(b, refs=2)  # held through the agent (an RPC grant): no hand-off
    assert ib is not None
    pool.mark_ready(ia)
    pool.mark_ready(ib)
    touches = pool.channel.view.pins["touches"]
    touches[ia] = 0xFFFFFFFF
    touches[ib] = 12345
    pool.settle_handoffs()
    assert pool.refs == [0, 2]
    assert pool.allocate(ExpertKey("m", 0, 2)) == ia  # a is the client's loss, b stays
    assert pool.keys[ib] == b and pool.refs[ib] == 2


@pytest.fixture
def client(agent: AgentProcess) -> Iterator[AgentClient]:
    c = AgentClient(agent.address, client_name="pytest-pin-held")
    yield c
    c.close()


def test_a_layer_released_by_its_pins_posts_nothing(agent: AgentProcess, client: AgentClient,
                                                    qwen_ckpt: Path) -> None:
    """Batches filling a pool exactly (each evicts the last): every expert's bytes equal the
    checkpoint's, the agent is asked only for the acquires, and holds nothing after the
    releases; a client that keeps its pins keeps its slots (a clear refusal)."""
    truth = checkpoint_bytes(qwen_ckpt)
    model = client.load_model(str(qwen_ckpt), "qwen-pin-held")
    dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)],
                                 delivery="engine")
    layer = model.moe_layers[0]
    batches = [[ExpertKey(model.model, layer, e) for e in pair] for pair in ((0, 1), (2, 3))]
    served = "dpu_agent_dataplane_requests_total"
    before = metric(agent, served)
    for r in range(4):
        keys = batches[r % 2]
        handles = client.acquire_batch(dev, keys)
        assert all(int(h._reply["flags"]) & abi.ReplyFlags.PIN_HELD for h in handles)
        for key, slot in zip(keys, client.wait_all(handles, 10), strict=True):
            name = f"model.layers.{layer}.mlp.experts.{key.expert}.down_proj.weight"
            assert slot.raw("down_proj").tobytes() == truth[name]
        posted = dev.channel.view.requests.produced
        client.release_batch(dev, keys)
        assert dev.channel.view.requests.produced == posted  # released by unpinning
    # The acquires alone, each once (one that found its slot's copy complete before the
    # agent took up the completion waits in the loop: taken once, answered later)
    assert metric(agent, served) - before == 8
    session = next(s for s in client.status().sessions if s.session_id == client.session_id)
    assert session.slots_held == 0
    held = client.acquire_batch(dev, batches[0])
    client.wait_all(held, 10)
    with pytest.raises(AgentError) as err:
        client.acquire_batch(dev, batches[1])
    assert "pinned" in str(err.value)
    client.release_batch(dev, batches[0])
    client.wait_all(client.acquire_batch(dev, batches[1]), 10)
