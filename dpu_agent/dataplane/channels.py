"""The agent's side of a device's data-plane channel: it creates the shared buffer (so no other
session can hand it a channel), reads requests and publishes replies and slot states.

On a BlueField the request ring is a DOCA Comch consumer (or a ring the DPU reads over PCIe) and
the slot-state table a buffer the DPU writes with DOCA DMA; see docs/DOCA.md.
"""

from __future__ import annotations

import numpy as np

from dpu_offload import abi
from dpu_offload.channel import Channel
from dpu_offload.shm import SharedBuffer, unique_name

_HEADER_CHECKED = abi.HEADER_DTYPE.fields["exit_flag"][1]
"""The header's first bytes (magic, version, kind, entry size, capacity) never change."""

CHANNEL_CAPACITY = 1024
"""Request-ring entries (and replies) of every channel."""


class DeviceChannel:
    """One device's channel, owned by the agent.

    Attributes:
        name: the shared-memory export handle the client maps (given only to the session).
        size: bytes.
        view: the :class:`Channel` views.
        last_request_id: the highest request id served; a request must exceed it.
    """

    def __init__(self, owner: tuple[str, int], capacity: int = CHANNEL_CAPACITY) -> None:
        self.owner = owner
        """(session id, device id) the channel belongs to."""
        total = abi.channel_layout(capacity).total
        self._buffer = SharedBuffer(unique_name("dpu-channel"), total, create=True)
        self.view = Channel.format(self._buffer.array, capacity)
        self.last_request_id = 0
        self.visit: tuple[str, int, dict[int, int]] | None = None
        """The open ROUTE visit: (model, layer, {expert: tokens}) taken so far, until its LAST
        entry (at most a layer's experts: an expert appears once)."""
        self.closed = False
        self.fault = ""
        """Why the channel stopped being served (its header was overwritten), or empty."""
        self._header = self.view.buffer[:_HEADER_CHECKED]
        self._expect = self._header.tobytes()

    @property
    def name(self) -> str:
        return self._buffer.name

    @property
    def size(self) -> int:
        return self._buffer.size

    def take_requests(self, limit: int = 256) -> tuple[int, np.ndarray]:
        """(ring position of the first, ``REQUEST_DTYPE[n]`` copies) of what was posted.
        A channel whose header the client overwrote is served no more (checked whenever an
        entry waits): its ``fault`` word says BAD_RING (the client's waits end with that
        error)."""
        ring = self.view.requests
        first = ring.consumed
        if self.fault or not ring.has_entries():
            return first, ring.entries[:0]
        if self._header.tobytes() != self._expect:
            self.fault = "the request ring's header was overwritten"
            ring.header["fault"] = int(abi.Status.BAD_RING)
            return first, ring.entries[:0]
        return first, ring.pop_many(limit)

    def publish_state(self, index: int, generation: int, state: abi.SlotState,
                      status: int = 0, expected: int = 0) -> None:
        if not self.closed:
            self.view.publish_state(index, generation, state, status, expected)

    def store_expected(self, index: int, expected: int) -> None:
        if not self.closed:
            self.view.store_expected(index, expected)

    def store_word(self, index: int, word: int) -> None:
        if not self.closed:
            self.view.store_word(index, word)

    def pins_after(self, index: int) -> tuple[int, int]:
        """(pins, touches) the client wrote for slot ``index``, read after a fence."""
        return self.view.pins_after(index)

    def touches(self, index: int) -> int:
        return self.view.touches(index)

    def wake_state(self, index: int) -> None:
        if not self.closed:
            self.view.wake_state(index)

    def reply(self, position: int, request_id: int, status: abi.RequestStatus,
              message: str = "", **slot: int) -> None:
        if not self.closed:
            self.view.reply(position, request_id, status, message, **slot)

    def close(self) -> None:
        """Unlink the name; later publications are dropped (the session is gone). The mapping
        goes with this object, so a thread still publishing never touches unmapped memory."""
        self.closed = True
        self._buffer.unlink()
