"""The activation frame format: the contract between senders and the NIC stand-in (and between
the NIC stand-ins of a cluster's agents) on the ZeroMQ activation path (docs/ACTIVATIONS.md).
The standard library only.

A message is two ZeroMQ frames: a 64-byte header (:data:`HEADER`) and the payload as its
own frame (sent and received without copies). Rows are ``row_bytes`` each; ``payload_bytes``
must equal ``rows * row_bytes``.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

MAGIC = 0x41555044  # b"DPUA" little-endian
VERSION = 1
MODEL_BYTES = 16


class Kind(IntEnum):
    REQUEST = 2    # sender -> NIC (or NIC -> a peer agent's NIC): rows for (model, layer, expert)
    RESPONSE = 5   # NIC -> sender: output rows; returns one credit
    ERROR = 6      # NIC -> sender: status + reason text payload; returns a credit


class FrameStatus(IntEnum):
    OK = 0
    BAD_FRAME = 1        # magic, version, kind or lengths wrong
    UNKNOWN_EXPERT = 2   # model, layer or expert not loaded
    BAD_WIDTH = 3        # row width is not the model's hidden size
    NO_ROUTE = 4         # no flow rule forwards it (or its device has no worker)
    DROPPED = 5          # a DROP rule matched
    NO_CREDIT = 6        # the sender exceeded its credits
    WORKER_FAILED = 7    # the worker failed it, or did not answer in time
    BAD_CHECKSUM = 8     # worker -> NIC (tx ERROR packet): the rx packets failed their check


HEADER = struct.Struct("<IHHQIIIIQII16s")
"""The 64-byte header, little-endian: magic u32, version u16, kind u16, message_id u64, layer,
expert, rows, row_bytes u32, payload_bytes u64, status, credits u32, model (16 bytes, UTF-8,
NUL-padded)."""
assert HEADER.size == 64


class Header(NamedTuple):
    """A parsed header (the fields of :data:`HEADER`, in order)."""

    magic: int
    version: int
    kind: int
    message_id: int
    layer: int
    expert: int
    rows: int
    row_bytes: int
    payload_bytes: int
    status: int
    credits: int
    model: bytes

    @property
    def model_name(self) -> str:
        return self.model.rstrip(b"\0").decode(errors="replace")


_KINDS = frozenset(int(k) for k in Kind)
_ROWS = frozenset((int(Kind.REQUEST), int(Kind.RESPONSE)))
_STATUSES = frozenset(int(s) for s in FrameStatus)


class FrameError(ValueError):
    """A frame is malformed; ``status`` says how."""

    def __init__(self, status: FrameStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def pack(kind: Kind, message_id: int = 0, model: str = "", layer: int = 0, expert: int = 0,
         rows: int = 0, row_bytes: int = 0, payload_bytes: int = 0,
         status: FrameStatus = FrameStatus.OK, credits: int = 0) -> bytes:
    name = model.encode()
    if len(name) > MODEL_BYTES:
        raise ValueError(f"model name {model!r} is longer than {MODEL_BYTES} bytes")
    return HEADER.pack(MAGIC, VERSION, kind, message_id, layer, expert, rows, row_bytes,
                       payload_bytes, status, credits, name)


def unpack(header: bytes | memoryview, payload_bytes: int) -> Header:
    """Parse and check a header against the payload frame's length."""
    if len(header) != HEADER.size:
        raise FrameError(FrameStatus.BAD_FRAME, f"header of {len(header)} bytes, expected 64")
    h = Header._make(HEADER.unpack(header))
    if h.magic != MAGIC or h.version != VERSION:
        raise FrameError(FrameStatus.BAD_FRAME, "bad magic or version")
    if h.kind not in _KINDS:
        raise FrameError(FrameStatus.BAD_FRAME, f"unknown kind {h.kind}")
    if h.payload_bytes != payload_bytes:
        raise FrameError(FrameStatus.BAD_FRAME, f"header says {h.payload_bytes} "
                         f"payload bytes, frame has {payload_bytes}")
    if h.kind in _ROWS and h.rows * h.row_bytes != payload_bytes:
        raise FrameError(FrameStatus.BAD_FRAME, f"{h.rows} rows of {h.row_bytes} bytes != "
                         f"{payload_bytes} payload bytes")
    if h.kind == Kind.ERROR and h.status not in _STATUSES:
        raise FrameError(FrameStatus.BAD_FRAME, f"unknown status {h.status}")
    return h
