"""How a granted slot's bytes are checked and awaited on this process's device: a DMA-engine
delivery's landed bytes summed where they landed (:class:`LandedCheck`), and a CUDA stream's
wait for an expert's verdict (:class:`StreamWait`), so kernels are enqueued before the bytes
land (docs/ABI.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_offload.keys import ExpertKey
from host_client.errors import TransferFailed
from host_client.requests import ClientChannel

if TYPE_CHECKING:
    from gpu_kernels.host_words import HostWord
    from host_client.devices import CheckTicket, Device
    from host_client.memory import ExpertSlot


class StreamWait:
    """A wait enqueued on a CUDA stream (``AcquireHandle.enqueue_wait``).

    Attributes:
        slot: the expert's slot views; valid for kernels enqueued on the stream after the wait.
        result: ``uint32`` word in mapped host memory (``host_words.HostWord``): an index into
            ``cuda_ops.WAIT_OUTCOMES`` once the wait ran (0 READY); None where nothing was
            enqueued (the expert was READY and held when the wait was asked for).
    """

    def __init__(self, key: ExpertKey, slot: ExpertSlot, result: HostWord | None,
                 stream: Any) -> None:
        self.key, self.slot, self.result, self.stream = key, slot, result, stream
        self._outcome: int | None = None if result is not None else 0

    @property
    def settled(self) -> bool:
        """Whether the outcome is known without synchronising the stream (nothing was
        enqueued, or :meth:`check` has run)."""
        return self._outcome is not None

    def check(self) -> None:
        """Synchronise the stream (unless nothing was enqueued); TransferFailed unless the
        expert was READY (after a checksum mismatch the agent refetches it for the next
        acquire)."""
        from gpu_kernels.cuda_ops import WAIT_OUTCOMES
        from gpu_kernels.host_words import WORDS

        if self._outcome is None:
            assert self.result is not None
            self.stream.synchronize()
            self._outcome = int(self.result.host[0])
            WORDS.give(self.result)
        outcome = self._outcome
        if outcome:
            raise TransferFailed(f"{self.key}: stream wait ended with "
                                 f"{WAIT_OUTCOMES[outcome] if outcome < 5 else outcome}")


class LandedCheck:
    """How one device's slots that the DMA engine fills are checked: the device waits for the
    bytes to land, sums the blob and publishes READY or FAILED (CHECKSUM_MISMATCH) in the
    slot-state table, once per delivery (the first handle to claim it starts it, as soon as
    it is granted)."""

    def __init__(self, device: Device, channel: ClientChannel) -> None:
        self.device, self.channel = device, channel

    def start(self, reply: np.void, slot: ExpertSlot, timeout: float) -> CheckTicket:
        """Start the check of the granted slot on the device (it waits there for LANDED); the
        verdict appears in the slot's word."""
        index = int(reply["state_index"])
        return self.device.start_check(self.channel.view.states,
                                       self.channel.word_address(index), index,
                                       int(reply["generation"]), slot.blob, timeout)

    def start_posted(self, posted: list[tuple[int, int]], timeout: float) -> CheckTicket:
        """Start the checks of ACQUIREs just posted, ``(ring position, blob bytes)`` each, in
        one launch (``Device.start_checks``): each takes its slot from its reply when the
        agent answers and is checked as soon as its bytes land; one ticket for all."""
        from host_client.devices import GrantCheck

        channel = self.channel
        return self.device.start_checks(
            channel.view, channel.states_address,
            [GrantCheck(p, channel.reply_address(p), n) for p, n in posted], timeout)

    def enqueue(self, reply: np.void, slot: ExpertSlot, stream: Any, timeout: float,
                result: Any) -> None:
        """Enqueue on ``stream`` the wait for the slot's verdict: the check itself for the
        first claimant of this delivery, a wait for someone else's check otherwise."""
        from gpu_kernels import cuda_ops

        index, generation = int(reply["state_index"]), int(reply["generation"])
        address = self.channel.word_address(index)
        if self.channel.claim_check(index, generation):
            self.device.enqueue_check(address, index, generation, slot.blob, timeout, result,
                                      stream)
        else:
            cuda_ops.wait_ready(address, generation, timeout, result, stream)
