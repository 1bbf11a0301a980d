"""Registering a device with the agent in a session: its data-plane channel (from the agent),
its rings (work and completion where this process's consumer copies; the rx / tx packet rings
of the activation path) and slot pools, each region registered by name; the device's consumer
is started where it has one. Linking devices that read each other's pools (``link_peers``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from dpu_offload import abi
from dpu_offload.bell import Bell
from dpu_offload.blob import pool_problem
from dpu_offload.keys import ExpertKey
from dpu_offload.ring import capacity_problem
from dpu_offload.shm import session_name
from dpu_offload.v1 import agent_pb2 as pb
from dpu_offload.v1 import agent_pb2_grpc as pb_grpc
from host_client.devices import Device
from host_client.errors import InvalidArgument
from host_client.memory import ExpertSlot, SharedRing, SlotPoolSpec
from host_client.requests import ClientChannel

DELIVERIES = {"pull": pb.DELIVERY_DEVICE_PULL, "engine": pb.DELIVERY_DMA_ENGINE}
"""``register_device``'s ``delivery`` names -> ``pb.Delivery``."""
PACKET_RING_CAPACITY = 1024
PACKET_ENTRY_BYTES = 64 + 4096
"""Packet rings (rx / tx, the activation path): 1024 entries of a 64-byte header + 4 KiB, so a
4 MiB message goes in two parts (``packets.part_limit``) the consumer lands while the producer
writes the next (256 entries took four parts, each waited for in turn: measured on the H200,
docs/ACTIVATIONS.md)."""


@dataclass
class AttachedDevice:
    """A device registered with the agent: its id there, its rings and pools."""

    device_id: int
    device: Device
    channel: ClientChannel
    work: SharedRing | None
    """The device consumer's rings (None where the DMA engine delivers)."""
    completion: SharedRing | None
    rx: SharedRing
    tx: SharedRing
    pools: dict[int, SlotPoolSpec] = field(default_factory=dict)
    specs: list[SlotPoolSpec] = field(default_factory=list)
    ring_capacity: int = 1024
    delivery: str = "pull"
    """"pull" (the device's consumer copies) or "engine" (the agent's DMA engine does)."""
    slots: dict[tuple[int, int], ExpertSlot] = field(default_factory=dict)
    """(region id, slot offset) -> the views of the expert last granted there (views cost
    tens of microseconds to build; a slot holds the same expert across many acquires)."""
    rx_device_ptr: int = 0
    """Device address of the rx / tx packet rings (CUDA devices; 0 on the CPU device)."""
    tx_device_ptr: int = 0

    def slot_for(self, key: ExpertKey, where: tuple[int, int],
                 manifest_of: Callable[[ExpertKey], pb.ExpertManifest]) -> ExpertSlot:
        """The views of ``key`` in the slot at ``where`` (region id, byte offset): those last
        made there, shared where the slot held another expert of the same layout, made anew
        otherwise (``manifest_of(key)``, the expert's tensor layout, asked only then)."""
        slot = self.slots.get(where)
        if slot is not None and slot.key != key:
            slot = self.slots[where] = slot.holding(key, manifest_of(key))
        if slot is None:
            manifest = manifest_of(key)
            blob = self.device.region_bytes(*where, manifest.blob_bytes)
            slot = self.slots[where] = ExpertSlot(key, blob, manifest, where)
        return slot


@dataclass(frozen=True)
class SessionContext:
    """What registering a device needs of the client's session."""

    stub: pb_grpc.DpuAgentStub
    session_id: int
    token: str
    """The session's secret: shared-memory segment names are bound to it."""
    bell: Bell | None
    """The agent's doorbell (None: the agent has none)."""
    arena: Any
    """``pb.SharedRegion`` of the agent's weight arena."""
    rpc_timeout: float


def check_registration(specs: list[SlotPoolSpec], ring_capacity: int, delivery: str) -> None:
    """InvalidArgument, before anything is registered or made, for a device registration the
    agent would refuse or this process could not make: a ring capacity that is no power of two
    (or too large) where the device's consumer pulls, a slot pool of no slots or of a slot size
    that is no multiple of the blob alignment or homes it cannot be cut into, more slots than
    a channel's slot-state table.
    (``delivery`` is one of ``DELIVERIES``: ``AgentClient.register_device`` checks it.)"""
    problems = [capacity_problem(ring_capacity)] if delivery == "pull" else []
    problems += [pool_problem(spec.slot_bytes, spec.slot_count, spec.home_layers)
                 for spec in specs]
    slots = sum(spec.slot_count for spec in specs)
    if slots > abi.MAX_CHANNEL_SLOTS:
        problems.append(f"{slots} slots: a device's pools hold at most {abi.MAX_CHANNEL_SLOTS}")
    found = [p for p in problems if p]
    if found:
        raise InvalidArgument("RegisterDevice: " + "; ".join(found))


def attach(ctx: SessionContext, device: Device, specs: list[SlotPoolSpec], ring_capacity: int,
           into: AttachedDevice | None = None, delivery: str = "pull") -> AttachedDevice:
    """Register ``device`` in the session with fresh rings and pools; with ``into``, refill
    that record (a re-registration after the agent restarted). What can be refused or fail
    here is checked, and the rings made, before the agent hears of the device: a bad argument
    registers nothing."""
    check_registration(specs, ring_capacity, delivery)
    # A DMA-engine device has no consumer here: the agent's engine process moves and
    # checks the bytes; this process only polls slot-state words.
    engine = delivery == "engine"
    # Segment names are bound to the session's token: the agent registers them for it only.
    token = ctx.token
    made: list[SharedRing] = []
    try:
        for kind, capacity, entry in ((abi.RingKind.RX_PACKET, PACKET_RING_CAPACITY,
                                       PACKET_ENTRY_BYTES),
                                      (abi.RingKind.TX_PACKET, PACKET_RING_CAPACITY,
                                       PACKET_ENTRY_BYTES),
                                      *(() if engine else (
                                          (abi.RingKind.WORK, ring_capacity, None),
                                          (abi.RingKind.COMPLETION, ring_capacity, None)))):
            made.append(SharedRing(kind, capacity, entry, token))
        resp = ctx.stub.RegisterDevice(pb.RegisterDeviceRequest(
            session_id=ctx.session_id, kind=device.kind, ordinal=device.ordinal,
            name=device.name, memory_bytes=device.memory_bytes,
            delivery=DELIVERIES[delivery]), timeout=ctx.rpc_timeout)
    except BaseException:
        for ring in made:
            ring.close()
        raise
    rx, tx = made[0], made[1]
    work, completion = (None, None) if engine else (made[2], made[3])
    channel: ClientChannel | None = None
    started = False
    try:
        channel = ClientChannel(resp.channel.shm_name, resp.channel.size_bytes, ctx.bell)
        channel.device_address = device.register_host_ring(channel.view.buffer)
        attached = into or AttachedDevice(resp.device_id, device, channel, work, completion, rx, tx,
                                          specs=specs, ring_capacity=ring_capacity,
                                          delivery=delivery)
        attached.device_id, attached.channel = resp.device_id, channel
        attached.work, attached.completion, attached.rx, attached.tx = work, completion, rx, tx
        attached.pools = {}
        attached.slots = {}
        if work is not None and completion is not None:
            device.attach(ctx.arena.shm_name, ctx.arena.size_bytes, ctx.arena.region_id,
                          work.ring, completion.ring)
        for spec in specs:
            nbytes = spec.slot_bytes * spec.slot_count
            memory = device.allocate(nbytes, session_name("dpu-pool", token) if engine else "")
            rid = ctx.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=ctx.session_id, device_id=resp.device_id,
                kind=pb.REGION_KIND_SLOT_POOL, size_bytes=nbytes,
                slot_bytes=spec.slot_bytes, slot_count=spec.slot_count,
                home_layers=spec.home_layers, cuda_ipc_handle=device.export_handle(memory),
                shm_name=device.export_shm(memory)),
                timeout=ctx.rpc_timeout).region_id
            device.bind(rid, memory)
            attached.pools[rid] = spec
        rings = [(rx, pb.REGION_KIND_RX_RING), (tx, pb.REGION_KIND_TX_RING)]
        if work is not None and completion is not None:
            device.start()
            started = True
            rings += [(work, pb.REGION_KIND_WORK_RING),
                      (completion, pb.REGION_KIND_COMPLETION_RING)]
        attached.rx_device_ptr, attached.tx_device_ptr = (
            device.register_host_ring(ring.buffer.array) for ring in (rx, tx))
        for ring, kind in rings:
            ctx.stub.RegisterRegion(pb.RegisterRegionRequest(
                session_id=ctx.session_id, device_id=resp.device_id, kind=kind,
                size_bytes=ring.size, shm_name=ring.name), timeout=ctx.rpc_timeout)
        return attached
    except BaseException:
        _undo(ctx, device, resp.device_id, made, channel, started)
        raise


def _undo(ctx: SessionContext, device: Device, device_id: int, rings: list[SharedRing],
          channel: ClientChannel | None, started: bool) -> None:
    """Undo a registration that failed after RegisterDevice (a pool the device could not
    allocate, a region the agent refused): the agent drops the device (if it can still be
    reached), this process's rings and channel close and the device can be attached again."""
    try:
        if started:
            device.stop()
    finally:
        device.close()
        with contextlib.suppress(grpc.RpcError):
            ctx.stub.DeregisterDevice(pb.DeviceRef(session_id=ctx.session_id,
                                                   device_id=device_id),
                                      timeout=ctx.rpc_timeout)
        for ring in rings:
            ring.close()
        if channel is not None:
            channel.close()


def detach(dev: AttachedDevice) -> None:
    """Stop the device's consumer, close it, its rings and its channel."""
    dev.device.stop()
    dev.device.close()
    for ring in (dev.work, dev.completion, dev.rx, dev.tx):
        if ring is not None:
            ring.close()
    dev.channel.close()


def link_peers(ctx: SessionContext, devices: list[AttachedDevice]) -> dict[int, list[int]]:
    """Map into each pull device the slot pools of every other device it can read, and tell
    the agent (``LinkPeers``); returns device id -> the ids of the devices it can read."""
    links: dict[int, list[int]] = {}
    for dst in devices:
        sources = [src for src in devices if src is not dst and
                   dst.delivery == "pull" and dst.device.can_read(src.device)]
        for src in sources:
            for rid, spec in src.pools.items():
                dst.device.map_peer(rid, src.device.region_bytes(
                    rid, 0, spec.slot_bytes * spec.slot_count), src.device)
        links[dst.device_id] = [src.device_id for src in sources]
        ctx.stub.LinkPeers(pb.LinkPeersRequest(
            session_id=ctx.session_id, device_id=dst.device_id,
            sources=links[dst.device_id]), timeout=ctx.rpc_timeout)
    return links
