"""The checks a CUDA device runs on the slots the DMA engine fills (ready.cu through
``cuda_ops``): one slot's, enqueued on a caller's stream or on a check lane's, and a posted
batch's, started before the agent answered. The verdict goes to the slot-state table; the
device words they need (running sums, outcomes) and the batches' parameter blocks in mapped
host memory are kept here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dpu_offload import abi
from gpu_kernels import cuda_ops, launch
from host_client.devices import CHECK_LANES, GrantCheck

PARAM_BLOCKS = 256
"""Batch checks' parameter blocks in mapped host memory, used round-robin: a block is written
again only once the launch that read it has ended (256 batches later, in practice at once)."""


class KernelTicket:
    """Landed-slot checks enqueued on check streams: ended once all their events have."""

    def __init__(self, *ended: Any) -> None:
        self.ended = ended

    def done(self) -> bool:
        return all(e.done for e in self.ended)


class CudaSlotChecks:
    """The slot checks of the GPU ``ordinal``; callers serialise :meth:`start` and
    :meth:`start_batch` (they reuse per-lane words).

    Args:
        ordinal: the GPU.
        register: registers host memory mapped for the device: (address, bytes) -> device
            address.
        table: the device's region table (``uint8`` device array) that a batch check bounds
            each granted slot against.
    """

    def __init__(self, ordinal: int, register: Callable[[int, int], int], table: Any) -> None:
        cp = launch.cp
        self.ordinal, self._table = ordinal, table
        self.dev = cp.cuda.Device(ordinal)
        with self.dev:
            self._words = cp.zeros(3 * abi.MAX_CHANNEL_SLOTS, cp.uint32)
            """``uint32[3 * MAX_CHANNEL_SLOTS]``: per slot index, its check's running sum and
            block count (scratch), then its check's outcome word (one lane's stream orders a
            slot's checks, so each reuses it after the last ended)."""
            self._batch_words = cp.zeros(
                (CHECK_LANES, (cuda_ops.CHECK_SCRATCH_WORDS + 1) * cuda_ops.MAX_BATCH_CHECKS),
                cp.uint32)
            """Per lane: a batch check's scratch (``CHECK_SCRATCH_WORDS * MAX_BATCH_CHECKS``)
            and outcomes (``MAX_BATCH_CHECKS``); a lane's stream orders its launches, so each
            reuses them."""
        self._params = np.zeros((PARAM_BLOCKS, cuda_ops.MAX_BATCH_CHECKS), abi.CHECK_DTYPE)
        """Batch checks' parameters (``abi.CHECK_DTYPE``), a block per launch, round-robin;
        registered mapped (the kernel reads them in place)."""
        self._params_at = register(int(self._params.ctypes.data), int(self._params.nbytes))
        self._ended: list[Any] = [None] * PARAM_BLOCKS
        self._next = 0

    def _outcome_word(self, index: int) -> Any:
        at = 2 * abi.MAX_CHANNEL_SLOTS + index
        return self._words[at:at + 1]

    def enqueue(self, entry_address: int, index: int, generation: int, blob: Any,
                timeout: float, result: Any, stream: Any) -> None:
        """Enqueue on ``stream`` the check of slot-state entry ``index`` (at device address
        ``entry_address``) for ``generation``: wait for LANDED, sum ``blob`` (a CuPy ``uint8``
        view, a multiple of 16 bytes), publish the verdict; the outcome (an index into
        ``cuda_ops.WAIT_OUTCOMES``) into ``result`` (``uint32[1]``, device or mapped host
        memory)."""
        if blob.size % 16:
            raise ValueError(f"a slot check needs a multiple of 16 bytes, got {blob.size}")
        with self.dev:
            scratch = self._words[2 * index:2 * index + 2]
            # The check's blocks read its outcome word: a device word, copied to ``result``
            # after (a caller's word may be in host memory, each read a trip across PCIe).
            word = self._outcome_word(index)
            cuda_ops.verify_landed(entry_address, generation, int(blob.data.ptr),
                                   int(blob.size), timeout, word, scratch, stream)
            if int(result.data.ptr) != int(word.data.ptr):
                launch.cp.cuda.runtime.memcpyAsync(int(result.data.ptr), int(word.data.ptr), 4,
                                                   4, stream.ptr)  # cudaMemcpyDefault

    def start(self, entry_address: int, index: int, generation: int, blob: Any,
              timeout: float) -> KernelTicket:
        """:meth:`enqueue` on the slot's check lane, not waited for."""
        with self.dev:
            stream = launch.shared_stream(self.ordinal, f"check-{index % CHECK_LANES}")
            self.enqueue(entry_address, index, generation, blob, timeout,
                         self._outcome_word(index), stream)
            ended = launch.cp.cuda.Event(disable_timing=True)
            ended.record(stream)
        return KernelTicket(ended)

    def start_batch(self, states_address: int, checks: list[GrantCheck], timeout: float
                    ) -> KernelTicket:
        """One launch per ``MAX_BATCH_CHECKS`` requests (``cuda_ops.verify_granted_batch``)
        on the lanes' streams in turn, each slot checked as soon as its reply came and its
        bytes landed (the channel's slot-state table at ``states_address``); the ticket ends
        with the last launch."""
        if not checks:
            raise ValueError("no slot to check")
        if any(c.nbytes % 16 for c in checks):
            raise ValueError("a slot check needs a multiple of 16 bytes")
        launched = []
        for first in range(0, len(checks), cuda_ops.MAX_BATCH_CHECKS):
            part = checks[first:first + cuda_ops.MAX_BATCH_CHECKS]
            with self.dev:
                block = self._next
                self._next = (block + 1) % PARAM_BLOCKS
                if self._ended[block] is not None:
                    self._ended[block].synchronize()  # its launch still reads the block
                params = self._params[block, :len(part)]
                params["reply"] = [c.reply_address for c in part]
                params["seq"] = [c.position + 1 for c in part]
                params["states"] = states_address
                params["n16"] = [c.nbytes // 16 for c in part]
                lane = block % CHECK_LANES
                stream = launch.shared_stream(self.ordinal, f"check-{lane}")
                words = self._batch_words[lane]
                cuda_ops.verify_granted_batch(
                    self._params_at + block * self._params.strides[0], len(part),
                    int(params["n16"].max()), self._table, timeout,
                    words[cuda_ops.CHECK_SCRATCH_WORDS * cuda_ops.MAX_BATCH_CHECKS:], words,
                    stream)
                ended = launch.cp.cuda.Event(disable_timing=True)
                ended.record(stream)
                self._ended[block] = ended
            launched.append(ended)
        return KernelTicket(*launched)
