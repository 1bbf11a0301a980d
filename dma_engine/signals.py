"""SIGNAL descriptors: the engine writes a delivery's slot-state word (LANDED) once the
delivery's bytes have landed, in the same stream as the payload, as a DMA engine writes a
semaphore after the data it moved (docs/ABI.md, "SIGNAL"; docs/DOCA.md). Then the waiters the
client put to sleep on that word are woken.

The engine checks each SIGNAL against what it may write: an entry of its device's slot-state
table (16-byte aligned, inside the table) and a word that reads LANDED; it never publishes
READY or FAILED (a DMA engine cannot know the bytes are right) and never signals a transfer one
of whose copies before the SIGNAL it refused (dma_engine/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from dpu_offload import abi
from dpu_offload.channel import Channel
from dpu_offload.shm import SharedBuffer

_ENTRY = abi.SLOT_STATE_DTYPE.itemsize
TABLE_BYTES = abi.MAX_CHANNEL_SLOTS * _ENTRY
"""Bytes of a channel's slot-state table: the range a SIGNAL's ``dst_offset`` must fall in."""


@dataclass(frozen=True)
class SignalWrite:
    """Descriptor ``first`` of a batch: slot-state word ``index`` becomes ``word`` (one 64-bit
    store; the entry's ``expected`` was written by the agent before the delivery began)."""

    first: int
    index: int
    word: int
    count: int = 1
    """Descriptors it completes (a :class:`~gpu_kernels.copy_runs.CopyRun` may complete many)."""


def check_signal(offset: int, word: int) -> abi.Status:
    """A SIGNAL's own status: OUT_OF_BOUNDS outside the table, BAD_ALIGNMENT off an entry's
    start, BAD_OPCODE for a word that does not read LANDED (in that order of precedence)."""
    if offset >= TABLE_BYTES:
        return abi.Status.OUT_OF_BOUNDS
    if offset % _ENTRY:
        return abi.Status.BAD_ALIGNMENT
    if word & ((1 << abi.SLOT_STATE_BITS) - 1) != abi.SlotState.LANDED:
        return abi.Status.BAD_OPCODE
    return abi.Status.OK


class SlotStates:
    """The engine's mapping of one device's channel, for SIGNAL writes and wakes.

    Args:
        name: the channel's shared-memory name; ``size``: its bytes.
    """

    def __init__(self, name: str, size: int) -> None:
        self._buffer = SharedBuffer(name, size)
        try:
            self.channel = Channel(self._buffer.array)
        except BaseException:
            self._buffer.close()
            raise

    @property
    def address(self) -> int:
        """Address (this process) of entry 0 of the slot-state table."""
        return self.channel.word_address(0)

    @property
    def buffer(self) -> SharedBuffer:
        return self._buffer

    def write(self, op: SignalWrite) -> None:
        """The word, from the CPU (no wake: :meth:`wake`)."""
        self.channel.store_word(op.index, op.word)

    def wake(self, op: SignalWrite) -> None:
        """Wake the client's sleepers on the entry's word (once the write is visible)."""
        self.channel.wake_state(op.index)

    def close(self) -> None:
        self._buffer.close()
