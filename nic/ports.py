"""A worker device's port on the NIC stand-in: its rx packet ring, into which the NIC writes
each routed message as checksummed packets stamped with the expert's slot, and its tx packet
ring, from which it collects the answers (docs/ACTIVATIONS.md). Both rings belong to the
worker's process (registered with the agent with its device); the NIC maps them by name, as a
BlueField's NIC reaches a GPUNetIO receive and send queue.

Messages larger than ``packets.part_limit`` packets go in parts: each part as many whole packets as
the ring has room for, up to that limit, offsets counted from the message's start, the last
packet of a part flagged LAST.

Each ring may have a doorbell (``dpu_offload.port_bell``, made by the worker): the NIC rings
the rx one after writing packets, and sleeps on the tx one while the worker's header says it
rings it after answering (a resident GPU kernel does not: then the NIC polls).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import zmq

from dpu_offload import abi, packets
from dpu_offload.frames import FrameStatus
from dpu_offload.keys import ExpertKey
from dpu_offload.port_bell import PortBell
from dpu_offload.ring import Ring
from dpu_offload.shm import SharedBuffer
from gpu_kernels.packet_twin import peek_packet, receive_packets, send_packets


@dataclass
class Outbound:
    """A message on its way into a port's rx ring."""

    nid: int
    """The NIC's id of the message (its packets' ``message_id``)."""
    payload: np.ndarray
    """``uint8[rows * row_bytes]``."""
    model_index: int
    key: ExpertKey
    slot: int
    """``packets.pack_slot`` of the expert's placed copy on the port's device."""
    sent: int = 0
    """Bytes written into the ring so far."""


@dataclass(frozen=True)
class Answer:
    """What a worker answered for message ``nid``: output bytes, or an error."""

    nid: int
    status: FrameStatus
    data: np.ndarray | None = None
    """``uint8`` output rows (OK)."""
    reason: str = ""


class Port:
    """One attached device's rings, as the NIC drives them.

    Args:
        device_id: the agent's device id.
        rx_name, tx_name: shared-memory names of the device's rx and tx packet rings.
    """

    def __init__(self, device_id: int, rx_name: str, tx_name: str) -> None:
        self.device_id = device_id
        self._buffers: list[SharedBuffer] = []
        self.queue: deque[Outbound] = deque()
        self._assembling: dict[int, tuple[np.ndarray, int]] = {}
        """nid -> (answer buffer, bytes landed so far)."""
        self.rx_bell: PortBell | None = None
        self.tx_bell: PortBell | None = None
        try:
            self.rx = self._ring(rx_name, abi.RingKind.RX_PACKET)
            self.tx = self._ring(tx_name, abi.RingKind.TX_PACKET)
            self.rx_bell = PortBell.open(rx_name)
            self.tx_bell = PortBell.open(tx_name)
        except BaseException:
            self.close()
            self.close_bells()
            raise
        self.failed = ""
        """Why the port stopped being a route ("" while it is one)."""
        self.refused_packets = 0
        """tx packets that failed their checksum or fit no message awaited."""

    def _ring(self, name: str, kind: abi.RingKind) -> Ring:
        buf = SharedBuffer(name)
        self._buffers.append(buf)
        ring = Ring(buf.array, kind)
        if ring.payload is None:
            raise ValueError(f"{name} is not a packet ring")
        return ring

    @property
    def room(self) -> int:
        """Payload bytes of one packet."""
        assert self.rx.payload is not None
        return int(self.rx.payload.shape[1])

    @property
    def tx_rings(self) -> bool:
        """Whether the worker rings the tx doorbell after answering (the NIC may sleep on it)."""
        return self.tx_bell is not None and self.tx.doorbell

    def pump(self) -> int:
        """Write as much of the queued messages into the rx ring as it has room for, then ring
        its doorbell; returns the bytes written."""
        moved = 0
        while self.queue:
            m = self.queue[0]
            fit = min(self.rx.free_entries(), packets.part_limit(self.rx.capacity)) * self.room
            if fit == 0:
                break
            part = m.payload[m.sent:m.sent + fit]
            send_packets(self.rx, part, m.nid, m.model_index, m.key.layer, m.key.expert,
                         base=m.sent, total=m.payload.size, slot=m.slot)
            m.sent += part.size
            moved += part.size
            if m.sent >= m.payload.size:
                self.queue.popleft()
        if moved and self.rx_bell is not None:
            self.rx_bell.ring()
        return moved

    def drop(self, nid: int) -> None:
        """Forget message ``nid`` (timed out or cancelled): its unsent parts are not sent."""
        self.queue = deque(m for m in self.queue if m.nid != nid)
        self._assembling.pop(nid, None)

    def answers(self, expected: Callable[[int], int | None]) -> list[Answer]:
        """Collect what the worker published on the tx ring. ``expected(nid)`` is the answer's
        size in bytes for a message in flight on this port (None: not one); packets of any
        other message are consumed and counted as refused."""
        out: list[Answer] = []
        while (h := peek_packet(self.tx)) is not None:
            nid, total = h.message_id, h.total_length
            size = expected(nid)
            if h.flags & abi.PacketFlags.ERROR:
                buf = np.zeros(self.room, np.uint8)
                try:
                    receive_packets(self.tx, buf)
                except BufferError:
                    break
                if size is not None:
                    status = h.status
                    known = status in FrameStatus._value2member_map_
                    out.append(Answer(nid, FrameStatus(status) if known
                                      else FrameStatus.WORKER_FAILED,
                                      reason=bytes(buf).rstrip(b"\0").decode(errors="replace")))
                    self._assembling.pop(nid, None)
                continue
            if size is None or total != size:
                if not self._skip_part():
                    break
                if size is not None:
                    self._assembling.pop(nid, None)
                    out.append(Answer(nid, FrameStatus.WORKER_FAILED,
                                      reason=f"the worker answered {total} bytes, {size} expected"))
                continue
            buf, landed = self._assembling.get(nid) or (np.empty(size, np.uint8), 0)
            try:
                _, written, refused = receive_packets(self.tx, buf)
            except BufferError:
                break  # the part is not all there yet
            landed += written
            if refused:
                self.refused_packets += refused
                self._assembling.pop(nid, None)
                out.append(Answer(nid, FrameStatus.WORKER_FAILED,
                                  reason=f"{refused} answer packets failed their checksum"))
            elif landed >= size:
                self._assembling.pop(nid, None)
                out.append(Answer(nid, FrameStatus.OK, buf))
            else:
                self._assembling[nid] = (buf, landed)
        return out

    def _skip_part(self) -> bool:
        """Consume the next part without landing it anywhere (counted as refused); False when
        it is not all there yet."""
        try:
            _, _, refused = receive_packets(self.tx, np.zeros(0, np.uint8))
        except BufferError:
            return False
        self.refused_packets += refused
        return True

    def close(self) -> None:
        self.queue.clear()
        self._assembling.clear()
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()

    def close_bells(self) -> None:
        """Close the doorbells (apart from :meth:`close`: the NIC's loop may be polling the tx
        one, and closes them itself after that poll)."""
        for bell in (self.rx_bell, self.tx_bell):
            if bell is not None:
                bell.close()


class TxBells:
    """The attached ports' tx doorbells in the NIC loop's poller. Only the loop registers,
    unregisters and closes them (:meth:`update`, under the NIC's lock, between polls): a port
    detached by the control thread keeps its doorbells open until the poll that may be using
    them has returned.

    Args:
        poller: the loop's poller.
    """

    def __init__(self, poller: zmq.Poller) -> None:
        self._poller = poller
        self._by_fd: dict[int, PortBell] = {}
        self._detached: list[Port] = []
        self.changed = False
        """Whether a port was attached or detached since the last :meth:`update`."""

    def detached(self, port: Port) -> None:
        """``port`` is gone: its doorbells go at the next update."""
        self._detached.append(port)
        self.changed = True

    def update(self, ports: Iterable[Port], ready: dict[object, int]) -> None:
        """Consume the wakes of the doorbells the last poll found ``ready``, then follow the
        ports attached and detached since."""
        for fd, bell in self._by_fd.items():
            if fd in ready:
                bell.drain()
        if not self.changed:
            return
        self.changed = False
        for port in self._detached:
            if port.tx_bell is not None and self._by_fd.pop(port.tx_bell.fileno(), None):
                self._poller.unregister(port.tx_bell.fileno())
            port.close_bells()
        self._detached.clear()
        for port in ports:
            if port.tx_bell is not None and port.tx_bell.fileno() not in self._by_fd:
                self._by_fd[port.tx_bell.fileno()] = port.tx_bell
                self._poller.register(port.tx_bell.fileno(), zmq.POLLIN)

    def close(self) -> None:
        for port in self._detached:
            port.close_bells()
        self._detached.clear()
        self._by_fd.clear()
