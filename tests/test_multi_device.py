"""Several devices under one host client (CPU reference devices here; the same code drives
several GPUs): per-device pools and rings, peer links, GPU-to-GPU forwarding as a delivery
source, fan-out of a placement (the arena read once per expert), and a corrupted peer copy
refetched from the arena. The multi-GPU run is bench/multi_gpu.py on a machine with 2+ GPUs."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from dpu_offload.keys import ExpertKey
from dpu_offload.v1 import agent_pb2 as pb
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.launcher import AgentProcess
from tests.conftest import checkpoint_bytes


def delivered(agent: AgentProcess) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics").read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("dpu_agent_delivered_bytes_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture
def three(qwen_ckpt: Path) -> Iterator[tuple[AgentProcess, AgentClient, object, list]]:
    with AgentProcess('[arena]\nbytes = "64MiB"\n[metrics]\nlisten_address = "127.0.0.1:0"\n'
                      ) as agent, AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "mg")
        devs = [client.register_device(CpuReferenceDevice(i), [SlotPoolSpec(
            model.expert_bytes, 18)]) for i in range(3)]
        yield agent, client, model, devs


def assert_bytes(slot, ckpt: Path) -> None:
    truth = checkpoint_bytes(ckpt)
    for role in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.{slot.key.layer}.mlp.experts.{slot.key.expert}.{role}.weight"
        assert slot.raw(role).tobytes() == truth[name], (slot.key, role)


def test_forwarding_from_a_peer_slot(three, qwen_ckpt: Path) -> None:
    agent, client, model, devs = three
    links = client.link_peers()
    assert links == {d.device_id: [o.device_id for o in devs if o is not d] for d in devs}
    key = ExpertKey("mg", model.moe_layers[0], 2)
    assert_bytes(client.acquire(devs[0], key).wait(10), qwen_ckpt)
    first = delivered(agent)
    assert first["arena"] > 0 and first["peer"] == 0
    for dev in devs[1:]:
        assert_bytes(client.acquire(dev, key).wait(10), qwen_ckpt)
    after = delivered(agent)
    assert after["arena"] == first["arena"], "the arena was read again"
    assert after["peer"] == 2 * first["arena"]


def test_placement_fans_out_reading_the_arena_once_per_expert(three, qwen_ckpt: Path) -> None:
    agent, client, model, devs = three
    client.link_peers()
    everywhere = [d.device_id for d in devs]
    layer = [[everywhere] * model.experts_per_layer]
    rest = [[[devs[0].device_id]] * model.experts_per_layer
            for _ in model.moe_layers[1:]]
    p = client.wait_placement(client.apply_placement("mg", layer + rest).placement_id)
    assert (p.done, p.failed) == (p.total, 0)
    got = delivered(agent)
    per_expert = model.expert_bytes
    experts = model.experts_per_layer * len(model.moe_layers)
    assert got["arena"] == experts * per_expert        # every expert read once
    assert got["peer"] == 2 * model.experts_per_layer * per_expert  # the layer fanned out
    for dev in devs:
        assert_bytes(client.acquire(dev, ExpertKey("mg", model.moe_layers[0], 5)).wait(10),
                     qwen_ckpt)


def test_a_corrupted_peer_copy_is_refetched_from_the_arena(three, qwen_ckpt: Path) -> None:
    agent, client, model, devs = three
    client.link_peers()
    key = ExpertKey("mg", model.moe_layers[1], 0)
    src = client.acquire(devs[0], key).wait(10)
    src.blob[1000] ^= 0xFF  # the source slot goes bad after it was verified
    assert_bytes(client.acquire(devs[1], key).wait(10), qwen_ckpt)
    got = delivered(agent)
    assert got["peer"] == 0 and got["arena"] == 2 * model.expert_bytes


def test_link_peers_refusals(three) -> None:
    _, client, _, devs = three
    for sources, code in (([devs[0].device_id], grpc.StatusCode.INVALID_ARGUMENT),
                          ([devs[1].device_id] * 2, grpc.StatusCode.INVALID_ARGUMENT),
                          ([999], grpc.StatusCode.FAILED_PRECONDITION)):
        with pytest.raises(grpc.RpcError) as err:
            client.stub.LinkPeers(pb.LinkPeersRequest(session_id=client.session_id,
                                                      device_id=devs[0].device_id,
                                                      sources=sources))
        assert err.value.code() == code, (sources, err.value.details())


def test_a_dma_engine_device_takes_no_peer_sources(qwen_ckpt: Path) -> None:
    """The DMA engine reads the arena, not other devices' pools (a BlueField's DMA engine
    writes GPU memory; GPU-to-GPU copies are the GPUs'): LinkPeers naming an engine device as
    the destination is refused, and the device's deliveries still come from the arena, whole."""
    with AgentProcess('[arena]\nbytes = "64MiB"\n') as agent, \
            AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "mg")
        pull, engine = (client.register_device(CpuReferenceDevice(i), [SlotPoolSpec(
            model.expert_bytes, 4)], delivery=d) for i, d in enumerate(("pull", "engine")))
        with pytest.raises(grpc.RpcError) as err:
            client.stub.LinkPeers(pb.LinkPeersRequest(session_id=client.session_id,
                                                      device_id=engine.device_id,
                                                      sources=[pull.device_id]))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "DMA engine" in err.value.details()
        links = client.link_peers()  # the pull device may still read the engine device's pool
        assert links == {pull.device_id: [engine.device_id], engine.device_id: []}
        key = ExpertKey("mg", model.moe_layers[0], 1)
        client.acquire(pull, key).wait(10)
        assert_bytes(client.acquire(engine, key).wait(10), qwen_ckpt)
        assert_bytes(client.acquire(pull, ExpertKey("mg", model.moe_layers[0], 1)).wait(10),
                     qwen_ckpt)
