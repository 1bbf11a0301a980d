"""A slot pool cut into homes, one run of slots per MoE layer (``SlotPoolSpec.home_layers``):
a layer's misses take the slots of its home (free first, then the idle one the policy names
there) and another home's only when its own has neither, so a layer's experts can be computed
over its home's views alone. Unit cases on the agent's pool, a property that the homes'
bookkeeping follows every fill, hit, release and failure, and the path through a real agent
process: registration refused with a named reason, deliveries landing in their homes byte for
byte."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.slot_pool import hold_layer
from dpu_agent.routing.stats import RoutingStats
from dpu_agent.slots import SlotPool
from dpu_agent.weights.policies import make_policy
from dpu_offload import abi
from dpu_offload.keys import ExpertKey
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.errors import InvalidArgument
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes, pool_step


def _pool(policy: str, homes: tuple[int, ...], per_home: int) -> SlotPool:
    stats = RoutingStats()
    stats.declare("m", range(3), 8)
    return SlotPool(1, 64, per_home * len(homes), policy=make_policy(policy, stats),
                    home_layers=homes)


def _release(pool: SlotPool, slots: list[int]) -> None:
    for idx in slots:
        assert pool.let_go(idx)


def _home(pool: SlotPool, layer: int) -> range:
    first = pool.home_layers.index(layer) * pool.home_size
    return range(first, first + pool.home_size)


@pytest.mark.parametrize("policy", ["lru", "reuse"])
def test_a_layers_misses_stay_in_its_home_while_it_has_room(policy: str) -> None:
    """Three layers, homes of two slots, filled in decode order; then layer 1 needs a new
    expert while layer 0's are the least recently used: LRU over the whole pool would take a
    layer-0 slot, the home takes one of layer 1's own."""
    pool = _pool(policy, (0, 1, 2), 2)
    for layer in range(3):
        slots = hold_layer(pool, [ExpertKey("m", layer, e) for e in (0, 1)])
        assert set(slots) == set(_home(pool, layer))
        _release(pool, slots)
    [idx] = hold_layer(pool, [ExpertKey("m", 1, 5)])
    assert idx in _home(pool, 1)
    gone = {ExpertKey("m", la, e) for la in range(3) for e in (0, 1)} - set(pool.by_key)
    assert len(gone) == 1 and next(iter(gone)).layer == 1


def test_a_layer_whose_home_is_full_of_its_batch_overflows_by_the_policy() -> None:
    """Layer 1 holds three experts at once in a home of two: the third takes the slot the
    policy names among the other homes' idle ones (LRU: layer 0's), not a held one."""
    pool = _pool("lru", (0, 1, 2), 2)
    for layer in range(3):
        _release(pool, hold_layer(pool, [ExpertKey("m", layer, e) for e in (0, 1)]))
    held = hold_layer(pool, [ExpertKey("m", 1, e) for e in (0, 1, 2)])
    assert set(held[:2]) == set(_home(pool, 1)) and held[2] in _home(pool, 0)
    assert ExpertKey("m", 0, 0) not in pool.by_key  # layer 0's least recently used went


def test_a_layer_without_a_home_takes_any_slot() -> None:
    pool = _pool("lru", (0, 1), 2)
    slots = hold_layer(pool, [ExpertKey("m", 2, e) for e in range(4)])
    assert sorted(slots) == [0, 1, 2, 3]


@settings(deadline=None, max_examples=150)
@given(ops=st.lists(st.tuples(st.sampled_from(["use", "release", "fail"]),
                              st.integers(0, 2), st.integers(0, 5)), max_size=80))
def test_the_homes_know_exactly_their_idle_slots(ops: list[tuple[str, int, int]]) -> None:
    """Whatever the order of fills, hits, releases and failures: every idle slot's expert is a
    candidate of exactly the home its slot lies in, and a miss with room in its home (a free
    or idle slot there) is given a slot of its home."""
    pool = _pool("reuse", (0, 1), 3)
    held: list[int] = []
    for op, layer, expert in ops:
        key = ExpertKey("m", layer, expert)
        home = range(0) if layer == 2 else _home(pool, layer)
        miss = op == "use" and key not in pool.by_key
        room = any(pool.keys[i] is None or pool.is_idle(i) for i in home)
        pool_step(pool, held, op, key, expert)
        if miss and room:
            assert pool.by_key[key] in home
        for g in range(2):
            in_home = {k for k in pool.idle if pool.idle.get(k)[0] in _home(pool, g)}
            victim = pool.idle.evict(None, g)
            assert (victim is None) == (not in_home)
            if victim is not None:
                assert victim[0] in in_home
                pool.idle.add(*victim, g)


@pytest.mark.parametrize(("homes", "count", "named"), [
    ((0, 1, 2), 4, "multiple of the number of home_layers"),
    ((0, 0), 4, "names a layer twice"),
    ((0, -1), 4, "layer -1 is not an integer in"),
    ((0, 1.5), 4, "layer 1.5 is not an integer in"),
    (tuple(range(5)), 4, "cannot be cut into 5"),
    (tuple(range(abi.MAX_CHANNEL_SLOTS + 1)), 4, "home_layers"),
])
def test_homes_a_pool_cannot_be_cut_into_are_refused_by_both_sides(
        agent: AgentProcess, homes: tuple[int, ...], count: int, named: str) -> None:
    """The client refuses before RegisterDevice; the agent refuses the same pool sent to it
    directly (INVALID_ARGUMENT naming the reason) and registers nothing."""
    with AgentClient(agent.address) as client:
        with pytest.raises(InvalidArgument, match=named):
            client.register_device(CpuReferenceDevice(3), [SlotPoolSpec(256, count, homes)])
        if not all(isinstance(la, int) and la >= 0 for la in homes):
            return  # not a uint32: the message cannot carry it
        dev = client.stub.RegisterDevice(pb.RegisterDeviceRequest(
            session_id=client.session_id, kind=pb.DEVICE_KIND_CPU_REFERENCE, ordinal=4))
        with pytest.raises(grpc.RpcError) as err:
            client.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=client.session_id, device_id=dev.device_id,
                kind=pb.REGION_KIND_SLOT_POOL, size_bytes=256 * count, slot_bytes=256,
                slot_count=count, home_layers=homes))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named.split()[0] in err.value.details()


def test_deliveries_land_in_their_layers_homes(agent: AgentProcess, qwen_ckpt: Path) -> None:
    """Through a real agent: a pool with a home of two slots per MoE layer; each layer's two
    experts land in its home, byte for byte, and a third expert of a layer whose home holds
    two released ones replaces one of them there."""
    truth = checkpoint_bytes(qwen_ckpt)
    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "homes")
        layers = tuple(model.moe_layers)
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(
            model.expert_bytes, 2 * len(layers), layers)])
        size = model.expert_bytes

        def index(handle: object) -> int:
            return handle.where[1] // size  # type: ignore[attr-defined]

        for i, layer in enumerate(layers):
            for e in (0, 1):
                handle = client.acquire(dev, ExpertKey("homes", layer, e))
                slot = handle.wait(10)
                assert index(handle) in range(2 * i, 2 * i + 2)
                name = f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"
                assert slot.raw("down_proj").tobytes() == truth[name]
                client.release(dev, slot.key)
        handle = client.acquire(dev, ExpertKey("homes", layers[1], 5))
        slot = handle.wait(10)
        assert index(handle) in (2, 3)
        assert slot.raw("down_proj").tobytes() == \
            truth[f"model.layers.{layers[1]}.mlp.experts.5.down_proj.weight"]


@pytest.mark.parametrize("homes", [True, False])
def test_a_transformers_layer_computes_over_its_home_alone(tmp_path: Path, agent: AgentProcess,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           homes: bool) -> None:
    """``offload_experts`` on a pool that holds every expert: with homes each MoE layer's
    forward spans its home's slots only (one layer's experts), without them the whole pool;
    the logits equal the resident model's either way."""
    torch = pytest.importorskip("torch")
    from host_client.integrations.transformers import _Layer, offload_experts
    from tests.test_transformers_checkpoints import _model

    model = _model("qwen3_moe").eval()
    model.save_pretrained(tmp_path / "m")
    ids = torch.tensor([[3, 17, 42, 5, 99, 1, 64, 8]])
    with torch.no_grad():
        want = model(ids).logits
    spans: list[int] = []
    forward = _Layer._forward

    def spy(self: _Layer, window: object, *args: object) -> object:
        spans.append(window.count)  # type: ignore[attr-defined]
        return forward(self, window, *args)

    monkeypatch.setattr(_Layer, "_forward", spy)
    with AgentClient(agent.address) as client:
        offload = offload_experts(model, client, tmp_path / "m", CpuReferenceDevice(),
                                  cache=1.0, name=f"homes-{homes}", layer_homes=homes)
        with torch.no_grad():
            got = model(ids).logits
    per_layer = int(next(iter(offload.layers.values())).num_experts)
    assert torch.equal(got, want), (got - want).abs().max()
    assert spans and set(spans) == {per_layer if homes else per_layer * len(offload.layers)}
