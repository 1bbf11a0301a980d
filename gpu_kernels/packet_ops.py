"""One interface for moving a message part through a device's packet rings, whatever computes:
:class:`HostPacketOps` (the compiled twins, ``packet_twin``, on buffers in host memory) and
:class:`CudaPacketOps` (``dpu_receive_packets`` / ``dpu_send`` on device buffers, the rings in
registered host memory the GPU maps). The expert worker's thread holds one and never asks
which (docs/ACTIVATIONS.md).

Both leave ring positions to the caller: ``receive`` takes a part whose ``packets`` are all
published (``packet_twin.part_packets``), ``send`` a part that fits the ring's free entries now
(the caller waits for room), so neither blocks.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from dpu_offload.ring import Ring
from gpu_kernels import packet_twin


class PacketOps(Protocol):
    """Receive into, and send from, buffers of one kind of memory."""

    def receive(self, rx: Ring, dst: Any, packets: int) -> tuple[int, int]:
        """Check and land the next ``packets`` packets of ``rx`` into ``dst`` (``uint8``,
        the whole message's buffer, bytes placed at each packet's offset) and consume them:
        (bytes written, packets refused). A refused packet writes nothing."""
        ...

    def send(self, tx: Ring, data: Any, message_id: int, model: int, layer: int, expert: int,
             *, base: int, total: int, status: int = 0, flags: int = 0) -> int:
        """Publish ``data`` (``uint8``, a 16-byte multiple; at most the ring's free entries'
        worth) as packets of message ``message_id`` on ``tx``, the part of ``total`` bytes
        that starts ``base`` bytes in, its last packet flagged LAST | ``flags``, every header
        carrying ``status``; returns the packets published, once they are."""
        ...


class HostPacketOps:
    """:class:`PacketOps` over NumPy buffers: the compiled twins."""

    def receive(self, rx: Ring, dst: np.ndarray, packets: int) -> tuple[int, int]:
        _, written, refused = packet_twin.receive_packets(rx, dst, packets)
        return written, refused

    def send(self, tx: Ring, data: np.ndarray, message_id: int, model: int, layer: int,
             expert: int, *, base: int, total: int, status: int = 0, flags: int = 0) -> int:
        return packet_twin.send_packets(tx, data, message_id, model, layer, expert, base=base,
                                        total=total, status=status, flags=flags)


class CudaPacketOps:
    """:class:`PacketOps` over CuPy buffers: the packet kernels on the current stream.

    Args:
        rx_device_ptr, tx_device_ptr: device addresses of the rx and tx rings (registered,
            mapped host memory).
    """

    def __init__(self, rx_device_ptr: int, tx_device_ptr: int) -> None:
        from gpu_kernels import cuda_ops, launch

        self._cp, self._ops = launch.cp, cuda_ops
        self._rx, self._tx = rx_device_ptr, tx_device_ptr

    def receive(self, rx: Ring, dst: Any, packets: int) -> tuple[int, int]:
        _, written, refused = self._ops.receive_packets(rx, self._rx, dst, packets)
        return written, refused

    def send(self, tx: Ring, data: Any, message_id: int, model: int, layer: int, expert: int,
             *, base: int, total: int, status: int = 0, flags: int = 0) -> int:
        n = self._ops.send_packets(tx, self._tx, self._cp.asarray(data), message_id, model,
                                   layer, expert, base=base, total=total, status=status,
                                   flags=flags)
        self._cp.cuda.get_current_stream().synchronize()
        return n
