"""A device is given back (``DeregisterDevice``) only when nothing of it is in use, and a
registration that fails half way leaves nothing registered: the same device registers again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from dpu_offload.keys import ExpertKey
from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
from host_client.errors import FailedPrecondition
from host_client.launcher import AgentProcess


def _devices(client: AgentClient) -> int:
    return next(s for s in client.status().sessions if s.session_id == client.session_id).devices


def test_a_device_given_back_registers_again(agent: AgentProcess, qwen_ckpt: Path) -> None:
    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "back")
        key = ExpertKey("back", model.moe_layers[0], 1)
        for delivery in ("pull", "engine", "pull"):
            dev = client.register_device(CpuReferenceDevice(3),
                                         [SlotPoolSpec(model.expert_bytes, 2)],
                                         delivery=delivery)
            assert _devices(client) == 1
            slot = client.acquire(dev, key).wait(30)
            assert slot.tensor("down_proj").shape == (256, 192)
            client.release(dev, key)
            client.deregister_device(dev)
            assert _devices(client) == 0 and dev.device_id not in client.devices


def test_a_device_in_use_is_not_given_back(agent: AgentProcess, qwen_ckpt: Path) -> None:
    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "held")
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(
            model.expert_bytes, model.experts_per_layer * len(model.moe_layers))])
        key = ExpertKey("held", model.moe_layers[0], 0)
        client.acquire(dev, key).wait(30)
        with pytest.raises(FailedPrecondition, match="held or under way; release them first"):
            client.deregister_device(dev)
        assert _devices(client) == 1
        client.acquire(dev, ExpertKey("held", model.moe_layers[0], 1)).wait(30)  # still serves
        client.release_batch(dev, [key, ExpertKey("held", model.moe_layers[0], 1)])
        placement = client.apply_placement(
            "held", [[[dev.device_id]] * model.experts_per_layer for _ in model.moe_layers])
        with pytest.raises(FailedPrecondition,
                           match=f"placement {placement.placement_id} of model 'held'"):
            client.deregister_device(dev)
        assert _devices(client) == 1


def test_another_sessions_device_is_not_given_back(agent: AgentProcess,
                                                   qwen_ckpt: Path) -> None:
    from dpu_offload.v1 import agent_pb2 as pb

    with AgentClient(agent.address) as mine, AgentClient(agent.address) as other:
        model = mine.load_model(str(qwen_ckpt), "mine")
        dev = mine.register_device(CpuReferenceDevice(), [SlotPoolSpec(model.expert_bytes, 2)])
        with pytest.raises(grpc.RpcError) as err:
            other.stub.DeregisterDevice(pb.DeviceRef(session_id=other.session_id,
                                                     device_id=dev.device_id), timeout=5)
        assert err.value.code() in (grpc.StatusCode.NOT_FOUND,
                                    grpc.StatusCode.PERMISSION_DENIED), err.value.details()
        assert _devices(mine) == 1
        mine.acquire(dev, ExpertKey("mine", model.moe_layers[0], 0)).wait(30)


class _OutOfMemory(CpuReferenceDevice):
    """A CPU reference device whose second allocation fails, as a GPU out of memory does."""

    def __init__(self, ordinal: int) -> None:
        super().__init__(ordinal)
        self.allocations = 0

    def allocate(self, nbytes: int, shared: str = "") -> Any:
        self.allocations += 1
        if self.allocations == 2:
            raise MemoryError(f"out of device memory for {nbytes} bytes")
        return super().allocate(nbytes, shared)


@pytest.mark.parametrize("delivery", ["pull", "engine"])
def test_a_registration_that_fails_half_way_leaves_nothing_registered(
        agent: AgentProcess, qwen_ckpt: Path, delivery: str) -> None:
    with AgentClient(agent.address) as client:
        model = client.load_model(str(qwen_ckpt), "half")
        pools = [SlotPoolSpec(model.expert_bytes, 2), SlotPoolSpec(model.expert_bytes, 2)]
        device = _OutOfMemory(5)
        with pytest.raises(MemoryError, match="out of device memory"):
            client.register_device(device, pools, delivery=delivery)
        assert _devices(client) == 0 and not client.devices
        dev = client.register_device(device, pools, delivery=delivery)  # the same one again
        assert len(dev.pools) == 2
        client.acquire(dev, ExpertKey("half", model.moe_layers[0], 2)).wait(30)
