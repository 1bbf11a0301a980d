"""Flow steering: priorities, versions, counters, atomic updates under concurrent lookups,
replica choice, placement-derived rules (make-before-break), ApplyFlows and expertctl flows."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_offload.flows import (
    Action,
    FlowRule,
    FlowTable,
    SteeringError,
    TrafficClass,
)
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.conftest import place_and_close

ACT = TrafficClass.ACTIVATIONS


def rule(action: Action, **kw) -> FlowRule:
    return FlowRule(0, kw.pop("traffic", ACT), action, **kw)


def test_priority_then_age_wins_and_counters_count() -> None:
    t = FlowTable()
    t.update(add=[rule(Action.FORWARD, model="m", queues=(1,)),
                  rule(Action.DROP, model="m", expert=3, priority=5),
                  rule(Action.COUNT, priority=9),
                  rule(Action.FORWARD, model="m", queues=(2,))])
    assert t.lookup(ACT, "m", 0, 3, nbytes=100).action == Action.DROP
    d = t.lookup(ACT, "m", 0, 1, nbytes=50)
    assert (d.action, d.queue) == (Action.FORWARD, 1)          # older of equal priority
    assert t.lookup(TrafficClass.WEIGHTS, "m", 0, 1).rule is None
    assert t.misses == 1 and t.lookups == 3
    by_action = {r.action: t.counters[r.rule_id] for r in t.rules()}
    assert by_action[Action.COUNT].packets == 2 and by_action[Action.COUNT].bytes == 150
    assert by_action[Action.DROP].dropped == 1


def test_layer_ranges_sources_and_replica_choice() -> None:
    t = FlowTable()
    t.update(add=[rule(Action.FORWARD, model="m", layer_min=2, layer_max=4, source="s1",
                       queues=(7, 8, 9))])
    load = {7: 5, 8: 1, 9: 3}
    assert t.lookup(ACT, "m", 3, 0, "s1", load=load.get).queue == 8
    assert t.lookup(ACT, "m", 5, 0, "s1").rule is None
    assert t.lookup(ACT, "m", 3, 0, "s2").rule is None


def test_a_rule_that_decides_alone_answers_from_its_decisions_made_in_advance() -> None:
    """Placement's rules (one model, layer and expert, nothing wider for that model): the
    lookup hands back a decision made when the table was built (the same object each time),
    picks the less loaded replica and counts as the scan would; a wildcard rule for the model
    makes the same keys go the general way again."""
    t = FlowTable()
    t.update(add=[rule(Action.FORWARD, model="m", layer_min=1, layer_max=1, expert=2,
                       queues=(4, 5)),
                  rule(Action.DROP, model="m", layer_min=1, layer_max=1, expert=3)])
    load = {4: 2, 5: 1}
    first = t.lookup(ACT, "m", 1, 2, nbytes=10, load=load.get)
    assert (first.action, first.queue) == (Action.FORWARD, 5)
    assert t.lookup(ACT, "m", 1, 2, nbytes=10, load=load.get) is first
    load[5] = 3
    assert t.lookup(ACT, "m", 1, 2, nbytes=10, load=load.get).queue == 4
    assert t.lookup(ACT, "m", 1, 2).queue == 4  # no load: the first replica
    dropped = t.lookup(ACT, "m", 1, 3, nbytes=7)
    assert dropped.action == Action.DROP and dropped is t.lookup(ACT, "m", 1, 3, nbytes=7)
    by_action = {r.action: t.counters[r.rule_id] for r in t.rules()}
    fwd, drop = by_action[Action.FORWARD], by_action[Action.DROP]
    assert (fwd.packets, fwd.bytes, fwd.dropped) == (4, 30, 0)
    assert (drop.packets, drop.bytes, drop.dropped) == (2, 14, 2)
    t.update(add=[rule(Action.COUNT, model="m", priority=1)])
    again = t.lookup(ACT, "m", 1, 3, nbytes=7)
    assert again.action == Action.DROP and again is not dropped
    assert drop.packets == 3 and t.lookups == 7 and t.misses == 0


small = st.integers(-1, 3)
rules_st = st.lists(st.builds(
    lambda traffic, action, model, lo, hi, expert, source, prio, q: FlowRule(
        0, traffic, action, model, lo, hi if hi == -1 or lo == -1 else max(lo, hi), expert,
        source, (q, q + 1) if action == Action.FORWARD else (), prio),
    st.sampled_from(list(TrafficClass)), st.sampled_from(list(Action)),
    st.sampled_from(["", "m", "n"]), small, small, small, st.sampled_from(["", "s"]),
    st.integers(0, 3), st.integers(0, 5)), max_size=12)


@given(rules_st, st.lists(st.tuples(st.sampled_from(list(TrafficClass)),
                                    st.sampled_from(["m", "n", "o"]), st.integers(0, 3),
                                    st.integers(0, 3), st.sampled_from(["", "s", "t"])),
                          min_size=1, max_size=8))
def test_indexed_lookup_equals_a_linear_scan(rules: list[FlowRule], queries: list) -> None:
    """Decision, replica and every rule's counters as a scan of the rules in order gives them
    (COUNT rules count and go on; the first other match decides)."""
    t = FlowTable()
    t.update(add=rules)
    ordered = sorted(t.rules(), key=lambda r: (-r.priority, r.rule_id))
    counted = {r.rule_id: [0, 0, 0] for r in ordered}
    load = {q: q % 3 for q in range(8)}.get
    for i, (traffic, model, layer, expert, source) in enumerate(queries):
        want = None
        for r in ordered:
            if r.matches(traffic, model, layer, expert, source):
                counted[r.rule_id][0] += 1
                counted[r.rule_id][1] += i
                if r.action != Action.COUNT:
                    counted[r.rule_id][2] += r.action == Action.DROP
                    want = r
                    break
        got = t.lookup(traffic, model, layer, expert, source, nbytes=i, load=load)
        assert got.rule == want and got.version == t.version
        assert got.queue == (min(want.queues, key=load) if want is not None
                             and want.action == Action.FORWARD else None)
    assert {rid: [c.packets, c.bytes, c.dropped] for rid, c in t.counters.items()} == counted


def test_bad_updates_change_nothing() -> None:
    t = FlowTable()
    v = t.update(add=[rule(Action.DROP)])
    for bad in ([rule(Action.FORWARD)], [rule(Action.DROP, queues=(1,))],
                [rule(Action.DROP, layer_min=5, layer_max=2)], [rule(Action.DROP, expert=-7)]):
        with pytest.raises(SteeringError):
            t.update(add=bad)
    with pytest.raises(SteeringError, match="no rule 999"):
        t.update(add=[rule(Action.COUNT)], delete=[999])
    assert t.version == v and len(t.rules()) == 1


def test_readers_see_old_or_new_table_never_a_mix() -> None:
    t = FlowTable()
    # Each version holds rules for experts 0..7 all forwarding to queue == version parity.
    t.update(add=[rule(Action.FORWARD, expert=e, queues=(0,), origin="gen") for e in range(8)])
    stop = threading.Event()
    mixed = []

    def reader() -> None:
        while not stop.is_set():
            table = t._table  # a reader's snapshot, as lookup takes it
            queues = {r.queues for r in table.rules}
            if len(queues) != 1:
                mixed.append(queues)

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    for v in range(1, 200):
        t.update(add=[rule(Action.FORWARD, expert=e, queues=(v % 2,), origin="gen")
                      for e in range(8)], replace_origin="gen")
    stop.set()
    for th in threads:
        th.join()
    assert not mixed
    assert t.version == 200


def test_placement_rules_follow_make_before_break(qwen_ckpt: Path) -> None:
    with AgentProcess() as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "st")
        a, b = (client.register_device(CpuReferenceDevice(i),
                                       [SlotPoolSpec(model.expert_bytes, 18)]) for i in range(2))
        L, E = len(model.moe_layers), model.experts_per_layer
        p1 = client.apply_placement("st", [[[a.device_id]] * E for _ in range(L)])
        client.wait_placement(p1.placement_id)

        def queues_of(expert: int) -> list[int]:
            rules = client.stub.ListFlows(pb.ListFlowsRequest()).rules
            return next(list(r.queues) for r in rules
                        if r.layer_min == model.moe_layers[0] and r.expert == expert)

        assert queues_of(0) == [a.device_id]
        b.device.pause()
        p2 = client.apply_placement("st", [[[b.device_id]] * E for _ in range(L)])
        time.sleep(0.2)
        assert queues_of(0) == [a.device_id], "steered to b before its copy was verified"
        b.device.resume()
        client.wait_placement(p2.placement_id)
        deadline = time.monotonic() + 5
        while queues_of(0) != [b.device_id]:
            assert time.monotonic() < deadline, queues_of(0)
            time.sleep(0.05)




def test_apply_flows_rpc_and_cli(agent: AgentProcess) -> None:
    with AgentClient(agent.address) as client:
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(1 << 16, 1)])
        base = [sys.executable, "-m", "host_client.cli", "flows", "--agent", agent.address]
        out = subprocess.run([*base, "add", "--session", client.session_id, "--session-token",
                              client.session_token, "--action",
                              "forward", "--model", "x", "--expert", "4", "--queue",
                              str(dev.device_id)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        listed = client.stub.ListFlows(pb.ListFlowsRequest())
        mine = [r for r in listed.rules if r.model == "x"]
        assert len(mine) == 1 and list(mine[0].queues) == [dev.device_id]
        shown = subprocess.run([*base, "list"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "250"})
        assert f"{mine[0].rule_id}" in shown.stdout and "forward" in shown.stdout
        for req, code in [
            (pb.ApplyFlowsRequest(session_id=client.session_id, add=[pb.FlowRule(
                traffic="activations", action="teleport")]), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.ApplyFlowsRequest(session_id=client.session_id, add=[pb.FlowRule(
                traffic="activations", action="forward")]), grpc.StatusCode.INVALID_ARGUMENT),
            (pb.ApplyFlowsRequest(session_id=client.session_id, add=[pb.FlowRule(
                traffic="activations", action="forward", queues=[4242])]),
             grpc.StatusCode.FAILED_PRECONDITION),
            (pb.ApplyFlowsRequest(session_id=client.session_id, delete=[10**9]),
             grpc.StatusCode.NOT_FOUND),
        ]:
            before = client.stub.ListFlows(pb.ListFlowsRequest()).version
            with pytest.raises(grpc.RpcError) as err:
                client.stub.ApplyFlows(req)
            assert err.value.code() == code, err.value.details()
            assert client.stub.ListFlows(pb.ListFlowsRequest()).version == before
        out = subprocess.run([*base, "delete", "--session", client.session_id, "--session-token",
                              client.session_token,
                              str(mine[0].rule_id)], capture_output=True, text=True)
        assert out.returncode == 0
        assert not [r for r in client.stub.ListFlows(pb.ListFlowsRequest()).rules
                    if r.model == "x"]


def test_rules_belong_to_their_session(agent: AgentProcess, qwen_ckpt: Path) -> None:
    """Two sessions place the same model: each keeps its own rules (origin names the
    session). A session cannot delete another's rule (PERMISSION_DENIED, nothing changes), and
    a closed session's rules go with it."""
    with AgentClient(agent.address) as a, AgentClient(agent.address) as b:
        rules: dict[str, list] = {}
        for c in (a, b):
            model = c.load_model(str(qwen_ckpt), "owned")
            dev = c.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 18)])
            L, E = len(model.moe_layers), model.experts_per_layer
            c.wait_placement(c.apply_placement("owned", [[[dev.device_id]] * E
                                                         for _ in range(L)]).placement_id)
            c.stub.ApplyFlows(pb.ApplyFlowsRequest(session_id=c.session_id, add=[pb.FlowRule(
                traffic="activations", action="forward", model="m", expert=1,
                queues=[dev.device_id])]))
        for r in a.stub.ListFlows(pb.ListFlowsRequest()).rules:
            rules.setdefault(r.origin, []).append(r)
        for c in (a, b):
            assert len(rules[f"placement:{c.session_id}:owned"]) == L * E
            assert len(rules[f"manual:{c.session_id}"]) == 1
        version = a.stub.ListFlows(pb.ListFlowsRequest()).version
        with pytest.raises(grpc.RpcError) as err:
            b.stub.ApplyFlows(pb.ApplyFlowsRequest(
                session_id=b.session_id, delete=[rules[f"manual:{a.session_id}"][0].rule_id]))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert a.stub.ListFlows(pb.ListFlowsRequest()).version == version
        a.close()
        left = {r.origin for r in b.stub.ListFlows(pb.ListFlowsRequest()).rules}
        assert left == {f"placement:{b.session_id}:owned", f"manual:{b.session_id}"}


def test_the_snapshot_is_read_whole_while_it_is_republished() -> None:
    """The agent's steering snapshot (shared memory, two halves, a sequence lock): a reader
    that keeps reading while versions are published sees each version with exactly its own
    rules, never a mix; the NIC's acknowledgement words read back; a segment that is not a
    snapshot is refused by name."""
    from dpu_offload.shm import SharedBuffer, unique_name
    from dpu_offload.steering_snapshot import (
        SEGMENT_BYTES,
        Snapshot,
        SnapshotError,
        SnapshotSegment,
    )

    def snapshot(version: int) -> Snapshot:
        return Snapshot(version, tuple(rule(Action.FORWARD, model="m", expert=e, queues=(1,))
                                       for e in range(version % 7 + 1)))

    writer = SnapshotSegment()
    reader = SnapshotSegment(writer.name)
    stop, seen, bad = threading.Event(), set(), []

    def read() -> None:
        while not stop.is_set():
            got = reader.read()
            if got.version:
                seen.add(got.version)
                if len(got.rules) != got.version % 7 + 1:
                    bad.append(got.version)

    t = threading.Thread(target=read)
    t.start()
    try:
        for v in range(1, 400):
            writer.publish(snapshot(v))
            time.sleep(0)  # let the reader in between publications
    finally:
        stop.set()
        t.join()
    assert not bad and seen and reader.read().version == 399
    reader.acknowledge(399, 398)
    assert (writer.applied, writer.drained) == (399, 398)
    other = SharedBuffer(unique_name("dpu-test"), SEGMENT_BYTES, create=True)
    try:
        with pytest.raises(SnapshotError, match="not a steering snapshot"):
            SnapshotSegment(other.name)
    finally:
        other.unlink()
        reader.close()
        writer.close()
        writer.unlink()


def test_a_session_closed_while_placing_leaves_no_rule(qwen_ckpt: Path) -> None:
    """A placement's completions may come after its session closed and took its rules away:
    they write none back (a closed session's placement rules once stayed, forwarding to a
    device that was gone)."""
    with AgentProcess('[arena]\nbytes = "64MiB"\n') as agent, \
            AgentClient(agent.address) as observer:
        for _ in range(6):
            sid = place_and_close(agent.address, qwen_ckpt, "closing")
            time.sleep(0.5)  # the fills started before the close end
            origins = {r.origin for r in observer.stub.ListFlows(pb.ListFlowsRequest()).rules}
            assert not [o for o in origins if sid in o], origins
