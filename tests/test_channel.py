"""The data-plane channel's views and the slot-state word, without an agent: publication
order, reply reuse, the futex wake, and the stream wait's CPU twin."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_offload import abi, futex
from dpu_offload.channel import Channel, split_word, state_word
from dpu_offload.ring import RingError
from gpu_kernels import reference


def make_channel(capacity: int = 8) -> Channel:
    return Channel.format(np.zeros(abi.channel_layout(capacity).total, np.uint8), capacity)


@given(generation=st.integers(0, 2**56 - 1), state=st.sampled_from(list(abi.SlotState)))
def test_state_word_round_trips(generation: int, state: abi.SlotState) -> None:
    assert split_word(state_word(generation, state)) == (generation, state)


def test_unknown_state_is_an_error() -> None:
    with pytest.raises(RingError, match="no known state"):
        split_word((5 << abi.SLOT_STATE_BITS) | 77)


def test_a_channel_needs_its_whole_layout() -> None:
    with pytest.raises(RingError, match="needs"):
        Channel.format(np.zeros(abi.channel_layout(8).total - 1, np.uint8), 8)


def test_replies_are_matched_by_position_and_reused_per_lap() -> None:
    ch = make_channel(4)
    for pos in range(10):
        assert ch.reply_at(pos) is None
        ch.reply(pos, 100 + pos, abi.RequestStatus.NOT_FOUND, f"no {pos}", slot_index=pos)
        got = ch.reply_at(pos)
        assert got is not None and int(got["request_id"]) == 100 + pos
        assert bytes(got["message"]).decode() == f"no {pos}"
        assert ch.reply_at(pos + 4) is None  # the next lap's reply is not this one
    assert ch.answered(6, 10).all() and not ch.answered(10, 14).any()


@pytest.mark.parametrize("says", ["this word", "several words", "another word", "nothing"])
def test_a_sleeping_waiter_is_woken_only_where_it_says_it_sleeps(says: str) -> None:
    """The publisher wakes only when the header's ``sleepers`` says someone may sleep on the
    word it published: a waiter that named this word (or several words) is woken at once; one
    that named another word, or nothing, sleeps out its timeout (no wake system call)."""
    ch = make_channel()
    ch.publish_state(3, 7, abi.SlotState.FILLING)
    seen = []
    hint = {"this word": (1, ch.word_address(3)), "several words": (2, None),
            "another word": (1, ch.word_address(4)), "nothing": (0, None)}[says]

    def waiter() -> None:
        value = int(ch.words[3])
        ch.set_sleepers(*hint)
        while split_word(int(ch.words[3]))[1] != abi.SlotState.READY:
            futex.wait(ch.word_address(3), value, 1.5)
        ch.set_sleepers(0, None)
        seen.append(time.monotonic())

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    published = time.monotonic()
    ch.publish_state(3, 7, abi.SlotState.READY)
    t.join(5)
    assert seen
    if says in ("this word", "several words"):
        assert seen[0] - published < 0.5  # woken, not timed out
    else:
        assert seen[0] - published > 1.0  # no wake system call was made


def _publish_rounds(channel: str, clock: str, rounds: int) -> None:
    """Another process's publisher: for each round the waiter opens (``clock[1]``), slot-state
    word 3 becomes READY of that round's generation 0-3 ms later, its time in ``clock[0]``."""
    from dpu_offload.shm import SharedBuffer

    buf, times = SharedBuffer(channel), SharedBuffer(clock)
    ch, t = Channel(buf.array), np.ndarray((2,), "<f8", buffer=times.array)
    for i in range(1, rounds + 1):
        while t[1] < i:
            time.sleep(0)
        time.sleep(random.uniform(0, 0.003))
        t[0] = time.monotonic()
        ch.publish_state(3, i, abi.SlotState.READY)


def test_no_wake_is_lost_between_processes() -> None:
    """The client's sleep (``ClientChannel.sleep``: counted in ``sleepers``, then the futex)
    against publications from another process at random moments, 300 rounds: every round ends
    by a wake or by a word already changed, none by sleeping out its 2 s nap (a lost wake)."""
    from dpu_agent.dataplane.channels import DeviceChannel
    from dpu_offload.shm import SharedBuffer, unique_name
    from host_client.requests import ClientChannel

    rounds, nap = 300, 2.0
    agent = DeviceChannel(("s", 1), capacity=16)
    client = ClientChannel(agent.name, agent.size)
    clock = SharedBuffer(unique_name("test-clock"), 16, create=True)
    t = np.ndarray((2,), "<f8", buffer=clock.array)
    publisher = multiprocessing.get_context("spawn").Process(
        target=_publish_rounds, args=(agent.name, clock.name, rounds))
    publisher.start()
    late = []
    try:
        view = client.view
        for i in range(1, rounds + 1):
            agent.store_word(3, state_word(i, abi.SlotState.FILLING))
            value = int(view.words[3])
            t[1] = i
            while int(view.words[3]) == value:
                assert publisher.is_alive(), f"the publisher died in round {i}"
                client.sleep(view.word_address(3), value, nap)
            late.append(time.monotonic() - t[0])
        publisher.join(10)
        assert publisher.exitcode == 0
    finally:
        publisher.kill()
        clock.unlink()
        agent.close()
    assert len(late) == rounds and max(late) < nap / 2, sorted(late)[-5:]


@pytest.mark.parametrize("raw", [2**64 - 1, (0xFFFFFFF0 << 32) | 7, 1 << 32, 3])
def test_a_hostile_sleepers_word_only_decides_a_wake(raw: int) -> None:
    """``sleepers`` is client-written: any value (an offset past the channel, a count with no
    word, every bit set) only decides whether the publisher makes the wake call; publications
    go on as before, nothing is read or written at the offset it names."""
    ch = make_channel()
    ch.requests.header["sleepers"] = raw
    ch.publish_state(3, 9, abi.SlotState.READY)
    ch.reply(0, 1, abi.RequestStatus.OK)
    assert split_word(int(ch.words[3])) == (9, abi.SlotState.READY)
    assert ch.reply_at(0) is not None and int(ch.requests.header["sleepers"]) == raw


def test_two_sleepers_on_two_words_are_each_woken() -> None:
    """Two client threads asleep on two slot words: ``sleepers`` says two on several words;
    once the first is woken and gone it names the other's word alone, and that one is woken
    by its own publication (not by sleeping out its nap)."""
    from dpu_agent.dataplane.channels import DeviceChannel
    from host_client.requests import ClientChannel

    agent = DeviceChannel(("s", 1), capacity=16)
    client = ClientChannel(agent.name, agent.size)
    view, woken = client.view, {}
    header = view.requests.header
    try:
        for i in (3, 4):
            agent.publish_state(i, 1, abi.SlotState.FILLING)

        def sleeper(i: int) -> None:
            value = int(view.words[i])
            while int(view.words[i]) == value:
                client.sleep(view.word_address(i), value, 3.0)
            woken[i] = time.monotonic()

        threads = [threading.Thread(target=sleeper, args=(i,)) for i in (3, 4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while int(header["sleepers"]) & 0xFFFFFFFF != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert int(header["sleepers"]) == (abi.SLEEPING_ON_ANY << 32) | 2
        agent.publish_state(4, 1, abi.SlotState.READY)
        threads[1].join(5)
        word3 = abi.channel_layout(16).states + 3 * abi.SLOT_STATE_DTYPE.itemsize
        assert int(header["sleepers"]) == (word3 << 32) | 1
        published = time.monotonic()
        agent.publish_state(3, 1, abi.SlotState.READY)
        threads[0].join(5)
        assert woken[3] - published < 1.0  # woken, not its 3 s nap
        assert int(header["sleepers"]) == 0
    finally:
        agent.close()


@pytest.mark.parametrize("final,expect", [(abi.SlotState.READY, 0), (abi.SlotState.FAILED, 1)])
def test_stream_wait_twin(final: abi.SlotState, expect: int) -> None:
    ch = make_channel()
    ch.publish_state(1, 4, abi.SlotState.FILLING)
    assert reference.wait_ready(ch.words, 1, 4, 0.05) == 3  # times out while FILLING
    threading.Timer(0.05, ch.publish_state, (1, 4, final)).start()
    assert reference.wait_ready(ch.words, 1, 4, 5.0) == expect
    ch.publish_state(1, 5, abi.SlotState.FILLING)
    assert reference.wait_ready(ch.words, 1, 4, 5.0) == 2  # the slot moved on


def test_a_post_reuses_a_reply_entry_only_after_its_reply_was_taken() -> None:
    """Client side against the agent's side, capacity 4: replies a handle has not taken yet
    are swept in (kept for it) when room is needed; with a reply not yet written the post
    waits, then fails with AgentUnavailable, writing nothing."""
    from dpu_agent.dataplane.channels import DeviceChannel
    from dpu_offload.keys import ExpertKey
    from host_client.errors import AgentUnavailable
    from host_client.requests import ClientChannel

    agent = DeviceChannel(("s", 1), capacity=4)
    client = ClientChannel(agent.name, agent.size)
    key = ExpertKey("m", 0, 1)

    def answer() -> int:
        first, batch = agent.take_requests()
        for j in range(batch.size):
            agent.reply(first + j, int(batch[j]["request_id"]), abi.RequestStatus.OK,
                        slot_index=first + j)
        return int(batch.size)

    old = client.post([(abi.RequestOp.ACQUIRE, 0, key)] * 4)
    assert answer() == 4
    new = client.post([(abi.RequestOp.ACQUIRE, 0, key)] * 2)  # sweeps two untaken replies
    assert new == [4, 5]
    assert [int(client.take(p)["slot_index"]) for p in old] == old  # kept, not overwritten
    with pytest.raises(AgentUnavailable):
        client.post([(abi.RequestOp.ACQUIRE, 0, key)] * 3, timeout=0.2)  # 4, 5 unanswered
    assert answer() == 2  # the refused post wrote nothing
    assert [int(client.take(p)["slot_index"]) for p in new] == new
    client.close()
    agent.close()


def test_a_post_publishes_its_entries_before_earlier_replies_callbacks_run() -> None:
    """Replies that came for an earlier post's callbacks (a layer's RELEASEs) are looked at
    after the next post's entries are in the ring, not before: the agent sees a layer's
    ACQUIREs without waiting for the client's bookkeeping of the previous layer. Only the
    refusals reach the callback (with their status)."""
    from dpu_agent.dataplane.channels import DeviceChannel
    from dpu_offload.keys import ExpertKey
    from host_client.requests import ClientChannel

    agent = DeviceChannel(("s", 1), capacity=16)
    client = ClientChannel(agent.name, agent.size)
    key = ExpertKey("m", 0, 1)
    seen: list[tuple[int, int, int]] = []
    client.post([(abi.RequestOp.RELEASE, 0, key)] * 3,
                on_refusal=lambda reply: seen.append((int(reply["seq"]) - 1,
                                                      int(reply["status"]),
                                                      client.view.requests.produced)))
    first, batch = agent.take_requests()
    statuses = [abi.RequestStatus.OK, abi.RequestStatus.NOT_FOUND, abi.RequestStatus.OK]
    for j in range(batch.size):
        agent.reply(first + j, int(batch[j]["request_id"]), statuses[j])
    assert seen == []  # nothing hands replies over until the client posts again
    acquires = client.post([(abi.RequestOp.ACQUIRE, 0, key)] * 2)
    assert acquires == [3, 4]
    # The refusal alone, handed over after the ACQUIREs were out.
    assert seen == [(1, abi.RequestStatus.NOT_FOUND, 5)]
    client.close()
    agent.close()


def test_a_reply_status_outside_the_abi_is_channel_corrupt() -> None:
    """A reply whose status the ABI does not define (a broken agent, overwritten memory) is
    ChannelCorrupt (DATA_LOSS) naming the number, for a waited request and for a callback's
    refusal alike; the callback path goes on to the next post."""
    import grpc

    from dpu_agent.dataplane.channels import DeviceChannel
    from dpu_offload.keys import ExpertKey
    from host_client.errors import ChannelCorrupt, refusal_of
    from host_client.requests import ClientChannel

    agent = DeviceChannel(("s", 1), capacity=8)
    client = ClientChannel(agent.name, agent.size)
    key = ExpertKey("m", 0, 1)
    refused: list[BaseException | None] = []
    client.post([(abi.RequestOp.RELEASE, 0, key)], on_refusal=lambda r: refused.append(
        refusal_of(r)))
    waited = client.post([(abi.RequestOp.ACQUIRE, 0, key)])[0]
    first, batch = agent.take_requests()
    for j in range(batch.size):
        agent.reply(first + j, int(batch[j]["request_id"]), 77, "garbled")  # type: ignore[arg-type]
    error = refusal_of(client.wait_reply(waited, 1.0))
    assert isinstance(error, ChannelCorrupt) and error.code() == grpc.StatusCode.DATA_LOSS
    assert "reply status 77 is not an abi.RequestStatus" in error.details()
    client.post([(abi.RequestOp.ACQUIRE, 0, key)])  # hands the release's reply over
    assert len(refused) == 1 and isinstance(refused[0], ChannelCorrupt)
    client.close()
    agent.close()


def test_a_slot_or_fault_status_outside_the_abi_is_named() -> None:
    from host_client.errors import status_text

    assert status_text(int(abi.Status.CHECKSUM_MISMATCH)) == "CHECKSUM_MISMATCH"
    assert status_text(4242) == "status 4242 (not an abi.Status)"


def test_a_lazy_post_rings_only_once_the_ring_is_half_full() -> None:
    """A routing visit (``Wake.LAZY``) leaves a sleeping loop asleep while the request ring is
    less than half full; the post that fills it to half rings the doorbell, as does any
    waited post."""
    from dpu_agent.dataplane.channels import DeviceChannel
    from dpu_offload.bell import Bell
    from dpu_offload.keys import ExpertKey
    from host_client.requests import ClientChannel

    agent = DeviceChannel(("s", 1), capacity=16)
    bell = Bell.create("test-bell")
    client = ClientChannel(agent.name, agent.size, bell)
    bell._sleeping[0] = 1  # the loop says it sleeps
    try:
        for _ in range(3):  # 3 x 2 entries: 10 of 16 free
            client.post_visit(0, 1, {2: 1, 5: 3}, 0, lambda reply: None)
        assert int(bell._rings[0]) == 0
        client.post_visit(0, 1, {2: 1, 5: 3}, 0, lambda reply: None)  # 8 of 16 free: half
        assert int(bell._rings[0]) == 0
        client.post_visit(0, 1, {2: 1}, 0, lambda reply: None)  # 7 free: past half
        assert int(bell._rings[0]) == 1
        client.post_visit(0, 1, {2: 1}, 1, lambda reply: None)  # a prefetch rings
        assert int(bell._rings[0]) == 2
        client.post([(abi.RequestOp.ACQUIRE, 0, ExpertKey("m", 1, 2))])
        assert int(bell._rings[0]) == 3
        first, batch = agent.take_requests()
        assert batch.size == 11 and first == 0
        assert batch["opcode"].tolist() == [abi.RequestOp.ROUTE] * 10 + [abi.RequestOp.ACQUIRE]
        assert batch["flags"].tolist()[:2] == [0, abi.RequestFlags.LAST]
        assert batch["count"].tolist()[:2] == [1, 3] and int(batch["prefetch"][9]) == 1
        assert batch["expert"].tolist()[:2] == [2, 5] and int(batch["layer"][10]) == 1
        assert batch["request_id"].tolist() == list(range(1, 12))
    finally:
        bell._sleeping[0] = 0
        client.close()
        agent.close()
        bell.unlink()


def test_a_delivery_failed_with_a_status_outside_the_abi_fails_its_handle_by_number() -> None:
    """A slot published FAILED with a status the ABI does not define (a broken agent,
    overwritten memory): the handle that holds the grant fails with TransferFailed naming the
    number, and is not retried as a mismatch would be."""
    from dpu_agent.dataplane.channels import DeviceChannel
    from dpu_offload.keys import ExpertKey
    from host_client.errors import TransferFailed
    from host_client.handles import AcquireHandle
    from host_client.requests import ClientChannel

    agent = DeviceChannel(("s", 1), capacity=8)
    client = ClientChannel(agent.name, agent.size)
    key = ExpertKey("m", 0, 1)
    position = client.post([(abi.RequestOp.ACQUIRE, 0, key)])[0]
    handle = AcquireHandle(key, client, position, lambda reply: None,  # type: ignore[arg-type]
                           lambda: None, lambda: None,
                           repost=lambda: client.post([(abi.RequestOp.ACQUIRE, 0, key)])[0])
    first, batch = agent.take_requests()
    agent.reply(first, int(batch[0]["request_id"]), abi.RequestStatus.OK, state_index=3,
                generation=5)
    agent.publish_state(3, 5, abi.SlotState.FAILED, status=4242)
    with pytest.raises(TransferFailed, match=r"delivery completed with status 4242 \(not an "
                                             r"abi.Status\)"):
        handle.wait(1.0)
    assert agent.take_requests()[1].size == 0  # not asked again
    client.close()
    agent.close()
