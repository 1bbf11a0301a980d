"""The activation frame format: the contract between senders and the NIC stand-in (and between
the NIC stand-ins of a cluster's agents) on the ZeroMQ activation path (docs/ACTIVATIONS.md).
NumPy only.

A message is two ZeroMQ frames: a 64-byte header (:data:`HEADER_DTYPE`) and the payload as its
own frame (sent and received without copies). Rows are ``row_bytes`` each; ``payload_bytes``
must equal ``rows * row_bytes``.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

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


HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "kind", "message_id", "layer", "expert", "rows", "row_bytes",
              "payload_bytes", "status", "credits", "model"],
    "formats": ["<u4", "<u2", "<u2", "<u8", "<u4", "<u4", "<u4", "<u4", "<u8", "<u4", "<u4",
                f"S{MODEL_BYTES}"],
    "offsets": [0, 4, 6, 8, 16, 20, 24, 28, 32, 40, 44, 48],
    "itemsize": 64,
})


class FrameError(ValueError):
    """A frame is malformed; ``status`` says how."""

    def __init__(self, status: FrameStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def pack(kind: Kind, message_id: int = 0, model: str = "", layer: int = 0, expert: int = 0,
         rows: int = 0, row_bytes: int = 0, payload_bytes: int = 0,
         status: FrameStatus = FrameStatus.OK, credits: int = 0) -> bytes:
    if len(model.encode()) > MODEL_BYTES:
        raise ValueError(f"model name {model!r} is longer than {MODEL_BYTES} bytes")
    h = np.zeros(1, HEADER_DTYPE)
    h[0] = (MAGIC, VERSION, int(kind), message_id, layer, expert, rows, row_bytes,
            payload_bytes, int(status), credits, model.encode())
    return h.tobytes()


def unpack(header: bytes | memoryview, payload_bytes: int) -> np.void:
    """Parse and check a header against the payload frame's length."""
    if len(header) != HEADER_DTYPE.itemsize:
        raise FrameError(FrameStatus.BAD_FRAME, f"header of {len(header)} bytes, expected 64")
    h = np.frombuffer(header, HEADER_DTYPE)[0]
    if int(h["magic"]) != MAGIC or int(h["version"]) != VERSION:
        raise FrameError(FrameStatus.BAD_FRAME, "bad magic or version")
    if int(h["kind"]) not in set(Kind):
        raise FrameError(FrameStatus.BAD_FRAME, f"unknown kind {int(h['kind'])}")
    if int(h["payload_bytes"]) != payload_bytes:
        raise FrameError(FrameStatus.BAD_FRAME, f"header says {int(h['payload_bytes'])} "
                         f"payload bytes, frame has {payload_bytes}")
    if int(h["kind"]) in (Kind.REQUEST, Kind.RESPONSE) and \
            int(h["rows"]) * int(h["row_bytes"]) != payload_bytes:
        raise FrameError(FrameStatus.BAD_FRAME, f"{int(h['rows'])} rows of "
                         f"{int(h['row_bytes'])} bytes != {payload_bytes} payload bytes")
    return h


def model_of(h: np.void) -> str:
    return bytes(h["model"]).rstrip(b"\0").decode(errors="replace")
