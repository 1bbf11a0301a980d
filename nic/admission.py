"""What a REQUEST frame must satisfy before the NIC stand-in steers it, and why a steered one
has nowhere to go: each refusal is a frame status and a reason that names what was wrong
(the sender gets both in an ERROR frame)."""

from __future__ import annotations

from dpu_offload.frames import FrameStatus, Header
from dpu_offload.keys import ExpertKey
from dpu_offload.steering_snapshot import ModelEntry, Snapshot
from nic.ports import Port

Refusal = tuple[FrameStatus, str]


def admit(h: Header, key: ExpertKey, payload_bytes: int, snapshot: Snapshot, outstanding: int,
          credits: int) -> ModelEntry | Refusal:
    """The model entry a request of ``payload_bytes`` for ``key`` (the header's model, layer
    and expert) addresses, or why it is refused: the sender's ``outstanding`` requests at its
    ``credits``, the payload's size, the model, layer and expert against ``snapshot``, the
    rows' width against the model's hidden size."""
    if outstanding >= credits:
        return FrameStatus.NO_CREDIT, f"{credits} requests already outstanding"
    if payload_bytes == 0 or payload_bytes % 16:
        return (FrameStatus.BAD_FRAME, f"a payload of {payload_bytes} bytes: rows must fill a "
                "positive multiple of 16 bytes")
    model = key.model
    entry = snapshot.models.get(model)
    if entry is None or key.layer not in entry.layers or key.expert >= entry.experts:
        return (FrameStatus.UNKNOWN_EXPERT,
                f"model {model!r} is not loaded" if entry is None else
                f"{key} is not an expert of {model!r} (MoE layers "
                f"{min(entry.layers, default=0)}-{max(entry.layers, default=0)}, "
                f"{entry.experts} experts)")
    if h.row_bytes != entry.hidden * 2:
        return (FrameStatus.BAD_WIDTH, f"rows of {h.row_bytes} bytes; {model} takes "
                f"{entry.hidden} bf16 values ({entry.hidden * 2} bytes)")
    return entry


def no_route(key: ExpertKey, device: int | None, ports: dict[int, Port]) -> str:
    """Why ``key``, steered to ``device`` (None: no rule forwards it), reaches no worker and no
    other agent of the cluster."""
    if device is None:
        return f"no flow rule forwards {key}, and no other agent of the cluster holds it"
    port = ports.get(device)
    if port is None:
        return f"{key} goes to device {device}, which has no worker attached"
    if port.failed:
        return f"{key} goes to device {device}, whose worker failed ({port.failed})"
    return f"{key} goes to device {device}, which holds no placed copy of it"
