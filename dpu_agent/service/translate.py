"""Translation between the v1 protocol and the core's domain types (the core speaks no
protobuf): enums, keys, manifests, session events, and how a refusal's message is shown."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from dpu_agent.errors import ErrorKind, invalid
from dpu_agent.registry import (
    Delivery,
    DeviceKind,
    ErrorEvent,
    RegionKind,
    SessionEvent,
)
from dpu_agent.weights.catalog import ExpertEntry
from dpu_offload.keys import MAX_KEYS_PER_CALL, ExpertKey
from dpu_offload.v1 import agent_pb2 as pb

CODES = {kind: getattr(grpc.StatusCode, kind.value) for kind in ErrorKind}
DEVICE_KINDS = {pb.DEVICE_KIND_CUDA: DeviceKind.CUDA,
                 pb.DEVICE_KIND_CPU_REFERENCE: DeviceKind.CPU_REFERENCE}
DELIVERIES = {pb.DELIVERY_DEVICE_PULL: Delivery.DEVICE_PULL,
               pb.DELIVERY_DMA_ENGINE: Delivery.DMA_ENGINE}
REGION_KINDS = {pb.REGION_KIND_SLOT_POOL: RegionKind.SLOT_POOL,
                 pb.REGION_KIND_WORK_RING: RegionKind.WORK_RING,
                 pb.REGION_KIND_COMPLETION_RING: RegionKind.COMPLETION_RING,
                 pb.REGION_KIND_RX_RING: RegionKind.RX_RING,
                 pb.REGION_KIND_TX_RING: RegionKind.TX_RING}
"""The protocol's enums as the core's (the core speaks no protobuf)."""


def event(event: SessionEvent) -> pb.Event:
    if isinstance(event, ErrorEvent):
        return pb.Event(error=event.message)
    return pb.Event(placement_progress=pb.PlacementProgress(
        placement_id=event.placement_id, model=event.model, done=event.done,
        failed=event.failed, total=event.total, dropped=event.dropped))


def key(msg: pb.ExpertKey, what: str = "key") -> ExpertKey:
    if not msg.model:
        raise invalid(f"{what}.model is empty")
    return ExpertKey.from_proto(msg)


def manifest(entry: ExpertEntry, chunk_bytes: int, checksums: tuple[int, ...] = ()
              ) -> pb.ExpertManifest:
    return pb.ExpertManifest(
        key=entry.key.to_proto(), blob_bytes=entry.blob_bytes, chunk_bytes=chunk_bytes,
        tensors=[pb.TensorEntry(name=t.role, dtype=t.dtype, shape=list(t.shape), offset=t.offset,
                                nbytes=t.nbytes) for t in entry.tensors],
        chunk_checksums=list(checksums), activation=ACTIVATIONS[entry.activation.kind],
        swiglu_alpha=entry.activation.alpha, swiglu_limit=entry.activation.limit)


ACTIVATIONS = {"swiglu": pb.EXPERT_ACTIVATION_SWIGLU,
                "clamped_swiglu": pb.EXPERT_ACTIVATION_CLAMPED_SWIGLU}


MAX_DETAILS_CHARS = 1000
"""A refusal's message is cut to this many characters: messages quote the input, and details
beyond gRPC's metadata limit turn the answer into RESOURCE_EXHAUSTED."""


def shown(message: str) -> str:
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}... ({len(message)} characters)"


def bounded(keys: Sequence[pb.ExpertKey]) -> None:
    """INVALID_ARGUMENT before any work when a call names more than MAX_KEYS_PER_CALL keys."""
    if len(keys) > MAX_KEYS_PER_CALL:
        raise invalid(f"{len(keys)} keys in one call; at most {MAX_KEYS_PER_CALL}")
