"""Routing reported on the data plane (ROUTE request entries, ``AgentClient.report_visit``):
visits are folded into the agent's routing statistics with no gRPC call, the next layer's
predicted experts are prefetched into the device, and hostile ROUTE entries are refused one by
one, folding nothing."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dpu_offload import abi
from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from host_client.registration import AttachedDevice
from tests.conftest import assert_prefetched

MODEL = "qroute"


def visits(agent: AgentProcess) -> float:
    """The agent's ``dpu_agent_routing_visits`` counter for :data:`MODEL`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics",
                                  timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "dpu_agent_routing_visits_total" and s.labels.get("model") == MODEL)


@pytest.fixture(scope="module")
def routed(agent: AgentProcess, qwen_ckpt: Path
           ) -> Iterator[tuple[AgentClient, AttachedDevice, list[int]]]:
    with AgentClient(agent.address) as client:
        info = client.load_model(str(qwen_ckpt), MODEL)
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(info.expert_bytes, 4)])
        yield client, dev, list(info.moe_layers)


def wait_visits(agent: AgentProcess, at_least: float) -> None:
    deadline = time.monotonic() + 10
    while visits(agent) < at_least:
        assert time.monotonic() < deadline, f"{visits(agent)} visits folded, not {at_least}"
        time.sleep(0.01)


def test_visits_on_the_data_plane_teach_the_predictor_and_prefetch(
        agent: AgentProcess, routed: tuple[AgentClient, AttachedDevice, list[int]]) -> None:
    """Layer 0's expert e is followed by layer 1's (e + 3) % 6, reported visit by visit through
    the ring with no gRPC call; a visit of layer 0 choosing 2 with ``prefetch=1`` then delivers
    layer 1's expert 5 ahead of use (its acquire is a hit), and layer 1's expert 0 is not."""
    client, dev, (l0, l1, *_) = routed
    before = visits(agent)
    calls = sum(n for call, n in client.rpc_calls.items() if call != "KeepAlive")
    for t in range(30):
        client.report_visit(dev, MODEL, l0, {t % 6: 1})
        client.report_visit(dev, MODEL, l1, {(t % 6 + 3) % 6: 2})
    client.report_visit(dev, MODEL, l0, {2: 1}, prefetch=1)
    assert sum(n for call, n in client.rpc_calls.items() if call != "KeepAlive") == calls
    wait_visits(agent, before + 61)
    assert_prefetched(client, dev, ExpertKey(MODEL, l1, 5), ExpertKey(MODEL, l1, 0))
    assert client.visits_refused == 0


def test_a_visit_does_not_wake_a_sleeping_agent_and_is_folded_at_its_next_wake(
        agent: AgentProcess, routed: tuple[AgentClient, AttachedDevice, list[int]]) -> None:
    """A visit without prefetch leaves the agent's loop asleep (the doorbell's ``rings``
    unmoved) and is folded when the loop next wakes: at the end of its doze (50 ms) or at the
    next post that rings. A visit with a prefetch rings at once."""
    from dpu_agent.dataplane.loop import DOZE_SECONDS

    client, dev, (l0, *_) = routed
    bell = dev.channel._bell
    assert bell is not None
    deadline = time.monotonic() + 5
    while not bell.asleep:
        assert time.monotonic() < deadline, "the agent's loop never slept"
        time.sleep(0.001)
    before, rings = visits(agent), int(bell._rings[0])
    client.report_visit(dev, MODEL, l0, {1: 2, 4: 1})
    assert int(bell._rings[0]) == rings  # not woken
    t0 = time.monotonic()
    wait_visits(agent, before + 1)
    assert time.monotonic() - t0 < DOZE_SECONDS + 1.0  # its doze ended, it looked
    assert int(bell._rings[0]) == rings
    while not bell.asleep:
        assert time.monotonic() < deadline + 10, "the agent's loop never slept again"
        time.sleep(0.001)
    client.report_visit(dev, MODEL, l0, {2: 1}, prefetch=1)
    assert int(bell._rings[0]) != rings  # woken to prefetch
    wait_visits(agent, before + 2)
    assert client.visits_refused == 0


def post_raw(dev: AttachedDevice, **fields: int) -> tuple[abi.RequestStatus, str]:
    """Publish one hand-made ROUTE entry (defaults: model 0's first layer, expert 1, one
    token, no flags) and wait for its reply: (status, message)."""
    ring = dev.channel.view.requests
    pos = ring.produced
    rid = dev.channel._next_id
    dev.channel._next_id += 1  # the client's own ids continue above this one
    entry = {"request_id": rid, "opcode": abi.RequestOp.ROUTE, "expert": 1, "count": 1,
             **fields}
    assert ring.push(entry)
    dev.channel._bell.ring()
    deadline = time.monotonic() + 5
    while (reply := dev.channel.view.reply_at(pos)) is None:
        assert time.monotonic() < deadline, "no reply"
        time.sleep(0.001)
    return (abi.RequestStatus(int(reply["status"])),
            bytes(reply["message"]).split(b"\0")[0].decode())


def test_hostile_route_entries_are_refused_and_fold_nothing(
        agent: AgentProcess, routed: tuple[AgentClient, AttachedDevice, list[int]]) -> None:
    client, dev, (l0, l1, *_) = routed
    index = client._index(MODEL)
    here = {"model": index, "layer": l0}
    words = dev.channel.view.words.copy()
    before = visits(agent)
    last = int(abi.RequestFlags.LAST)
    cases = [
        ({"count": 0}, abi.RequestStatus.INVALID_ARGUMENT, "ROUTE count 0"),
        ({"count": 2**21}, abi.RequestStatus.INVALID_ARGUMENT, "tokens must be"),
        ({"flags": 2}, abi.RequestStatus.INVALID_ARGUMENT, "flags 0x2"),
        ({"opcode": abi.RequestOp.ACQUIRE}, abi.RequestStatus.INVALID_ARGUMENT, "ROUTE's alone"),
        ({"prefetch": 2}, abi.RequestStatus.INVALID_ARGUMENT, "does not end its visit"),
        ({"layer": 10**6}, abi.RequestStatus.INVALID_ARGUMENT, "not an MoE layer"),
        ({"expert": 99}, abi.RequestStatus.INVALID_ARGUMENT, "expert 99 out of range"),
        ({"model": 999}, abi.RequestStatus.NOT_FOUND, "model index 999"),
        ({"expert": 3}, abi.RequestStatus.OK, ""),  # opens a visit of layer 0
        ({"expert": 3}, abi.RequestStatus.INVALID_ARGUMENT, "expert 3 twice"),
        ({"layer": l1}, abi.RequestStatus.FAILED_PRECONDITION, "dropped: a ROUTE of layer"),
        ({"flags": last, "prefetch": 7}, abi.RequestStatus.INVALID_ARGUMENT,
         "prefetch of 7 experts"),
    ]
    for change, status, words_in_message in cases:
        got, message = post_raw(dev, **{**here, **change})
        assert got == status, (change, message)
        assert words_in_message in message, (change, message)
    time.sleep(0.1)
    assert visits(agent) == before  # nothing folded: the one visit opened was dropped
    np.testing.assert_array_equal(dev.channel.view.words, words)
    # A well-formed visit after them is folded, and the client's own ids go on.
    assert post_raw(dev, **here, flags=last)[0] == abi.RequestStatus.OK
    wait_visits(agent, before + 1)
    client.report_visit(dev, MODEL, l1, {4: 1, 1: 3, 0: 2})  # three entries, one visit
    wait_visits(agent, before + 2)
    assert client.visits_refused == 0
    with pytest.raises(ValueError, match="chosen by >= 1 token"):
        client.report_visit(dev, MODEL, l1, {4: 0})
    # Beyond what an entry's fields carry: refused in the client, nothing posted.
    produced = dev.channel.view.requests.produced
    for args, words_in_message in [((l1, {4: abi.MAX_ROUTE_COUNT + 1}), "at most 1048576"),
                                   ((l1, {2**32: 1}), "experts at most 4294967295"),
                                   ((2**32, {4: 1}), "layer 4294967296"),
                                   ((l1, {4: 1}, 2**16), "prefetch 65536"),
                                   ((-1, {4: 1}), "layer -1")]:
        with pytest.raises(ValueError, match=words_in_message):
            client.report_visit(dev, MODEL, *args)
    assert dev.channel.view.requests.produced == produced
