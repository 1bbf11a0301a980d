"""Shared fixtures: real checkpoints on disk, a real agent process on loopback."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.slots import SlotPool
from dpu_agent.weights.policies import EvictionPolicy, LfuPolicy, LruPolicy
from dpu_agent.weights.reuse import LearnedReusePolicy
from dpu_agent.weights.reuse_state import HELD
from dpu_offload.keys import ExpertKey
from host_client import AgentClient
from host_client.checkpoints import CheckpointSpec, make_checkpoint, read_tensor_bytes
from host_client.launcher import AgentProcess
from host_client.registration import AttachedDevice

settings.register_profile("ci", max_examples=60)
settings.register_profile("fuzz", max_examples=10_000)
settings.register_profile("gpu", max_examples=1_000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

collect_ignore = [] if os.environ.get("DPU_TEST_ARM64") else ["arm64"]
"""tests/arm64 needs the aarch64 environment; `make test-arm64` builds it and runs them."""
ROOT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """This process's environment for a child Python that imports the project: the checkout
    first on PYTHONPATH, then whatever PYTHONPATH held already (on the GPU machine, the wheels
    `make gpu-check` carries: without them a child imports the machine's own, older gRPC)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="session")
def qwen_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen",
                           CheckpointSpec("qwen3-moe", layers=3, experts=6, hidden=256,
                                          intermediate=192))


@pytest.fixture(scope="session")
def agent() -> Iterator[AgentProcess]:
    with AgentProcess('[arena]\nbytes = "64MiB"\n[sessions]\ndefault_lease_seconds = 3\n'
                      '[metrics]\nlisten_address = "127.0.0.1:0"\n'
                      ) as proc:
        yield proc


checkpoint_bytes = read_tensor_bytes
"""Every tensor's bytes, read by the safetensors library (independent of the agent)."""


def assert_prefetched(client: AgentClient, dev: AttachedDevice, hit: ExpertKey,
                      miss: ExpertKey) -> None:
    """Once the agent's transfers are done (10 s at most), ``hit`` is resident on ``dev`` (its
    acquire starts no delivery: it was prefetched) and ``miss`` is not; both released after."""
    deadline = time.monotonic() + 10
    while client.status().transfers_in_flight or not client.status().experts_cached:
        assert time.monotonic() < deadline, "the prefetch did not land"
        time.sleep(0.02)
    got, other = client.acquire(dev, hit), client.acquire(dev, miss)
    assert got.wait(10) and got.resident, f"{hit} was not prefetched"
    assert other.wait(10) and other.resident is False, f"{miss} was resident"
    client.release_batch(dev, [hit, miss])


def policy_candidates(policy: EvictionPolicy) -> set[ExpertKey]:
    """The experts an LRU, LFU or learned-reuse policy knows as evictable (what it would
    choose among)."""
    if isinstance(policy, LruPolicy):
        return set(policy._order)
    if isinstance(policy, LfuPolicy):
        return set(policy._tick)
    assert isinstance(policy, LearnedReusePolicy)
    return {model.keys[at][e] for model in policy._models.values()
            for at, e in zip(*np.nonzero(model.grid[HELD]), strict=True)}


def pool_step(pool: SlotPool, held: list[int], op: str, key: ExpertKey, pick: int) -> None:
    """One step of a random workload on an agent-side slot pool: ``use`` (``key`` held: a hit
    holds its slot, a miss allocates one and makes it READY; nothing when every slot is in
    use), ``release`` (the held slot ``held[pick % len(held)]`` let go), ``fail`` (``key``'s
    slot failed, if nobody holds it). ``held`` lists the slots held, as the steps leave them."""
    idx = pool.by_key.get(key)
    if op == "use":
        if idx is None:
            idx = pool.allocate(key)
            if idx is None:  # every slot in use
                return
            pool.mark_ready(idx)
        else:
            pool.hold(idx)
        held.append(idx)
    elif op == "release" and held:
        assert pool.let_go(held.pop(pick % len(held)))
    elif op == "fail" and idx is not None and pool.refs[idx] == 0:
        pool.fail(idx, 1)


def place_and_close(address: str, ckpt: Path, model: str) -> str:
    """A session that loads ``ckpt`` as ``model``, registers a CPU reference device with a slot
    for every expert, places every expert there and closes at once, its placement's fills
    still under way; returns its session id."""
    from host_client import CpuReferenceDevice, SlotPoolSpec

    with AgentClient(address) as client:
        info = client.load_model(str(ckpt), model)
        dev = client.register_device(CpuReferenceDevice(), [SlotPoolSpec(
            info.expert_bytes, info.experts_per_layer * len(info.moe_layers))])
        client.apply_placement(model, [[[dev.device_id]] * info.experts_per_layer
                                       for _ in info.moe_layers])
        return client.session_id


@pytest.fixture
def pool() -> Iterator[SlotPool]:
    """A two-slot pool of 64-byte slots with a channel of its own (the agent's side)."""
    channel = DeviceChannel(("session", 1), capacity=8)
    yield SlotPool(region_id=1, slot_bytes=64, slot_count=2, channel=channel)
    channel.close()
