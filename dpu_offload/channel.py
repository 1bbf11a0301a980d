"""The data-plane channel of one device over any shared buffer (layout: ``abi.channel_layout``).

Three parts, one buffer, created by the agent per registered device and mapped by the client:

- ``requests``: a ring of ``REQUEST_DTYPE`` (the client produces, the agent consumes);
- ``replies``: ``REPLY_DTYPE[capacity]``; the reply to the request at ring position ``p`` is
  entry ``p % capacity``, published with ``seq = p + 1`` written last;
- ``states``: ``SLOT_STATE_DTYPE[MAX_CHANNEL_SLOTS]``, one per slot of the device's pools,
  written by the agent (and, on a GPU, by the verifying kernel); the client polls one word;
- ``pins``: ``PIN_DTYPE[MAX_CHANNEL_SLOTS]``, written by the client: the slots it holds by a
  pin (pinned hits, PIN_HELD grants), which the agent reads before it gives a slot to another
  delivery.

Plain NumPy: the agent (aarch64, no CUDA) and the host client both use it. See docs/ABI.md.
"""

from __future__ import annotations

import struct

import numpy as np

from dpu_offload import abi, futex
from dpu_offload.ring import Ring, RingError, store_fence

_STATE_MASK = (1 << abi.SLOT_STATE_BITS) - 1
_REPLY = abi.packer(abi.REPLY_DTYPE)
_REPLY_BODY = abi.REPLY_DTYPE.fields["seq"][1]
_MESSAGE_BYTES = abi.REPLY_DTYPE.fields["message"][0].itemsize
_U32 = struct.Struct("<I")
_STATUS_AT = abi.SLOT_STATE_DTYPE.fields["status"][1]
_STATUS_EXPECTED = struct.Struct("<II")
assert abi.SLOT_STATE_DTYPE.fields["expected"][1] == _STATUS_AT + 4
_SLEEPERS_AT = abi.HEADER_DTYPE.fields["sleepers"][1]


def state_word(generation: int, state: abi.SlotState) -> int:
    """The slot-state ``word`` for ``generation`` in ``state``."""
    return (generation << abi.SLOT_STATE_BITS) | int(state)


_STATES: tuple[abi.SlotState | None, ...] = tuple(
    abi.SlotState(v) if v in abi.SlotState._value2member_map_ else None
    for v in range(_STATE_MASK + 1))
"""Each state byte's :class:`abi.SlotState` (None: no state): a lookup where constructing the
enum costs ~1 us, on the path of every poll of a slot's word."""


def split_word(word: int) -> tuple[int, abi.SlotState]:
    """(generation, state) of a slot-state ``word``; RingError for an unknown state."""
    state = _STATES[word & _STATE_MASK]
    if state is None:
        raise RingError(f"slot-state word {word:#x} holds no known state")
    return word >> abi.SLOT_STATE_BITS, state


class Channel:
    """Views of a channel laid out in ``buffer`` (``uint8``, at least
    ``channel_layout(capacity).total`` bytes).

    Attributes:
        requests: the request :class:`Ring`.
        replies: ``REPLY_DTYPE[capacity]`` view.
        states: ``SLOT_STATE_DTYPE[MAX_CHANNEL_SLOTS]`` view.
        words: ``uint64[MAX_CHANNEL_SLOTS]`` view of every state's ``word``.
        pins: ``PIN_DTYPE[MAX_CHANNEL_SLOTS]`` view (the client's pins).
    """

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.requests = Ring(buffer, abi.RingKind.REQUEST)
        self.capacity = self.requests.capacity
        layout = abi.channel_layout(self.capacity)
        replies_at, states_at = layout.replies, layout.states
        if buffer.size < layout.total:
            raise RingError(f"channel of {self.capacity} requests needs {layout.total} bytes, "
                            f"buffer has {buffer.size}")
        self.replies = np.ndarray((self.capacity,), abi.REPLY_DTYPE, buffer=buffer,
                                  offset=replies_at)
        self._reply_seq = np.ndarray((self.capacity,), "<u8", buffer=buffer,
                                     offset=replies_at + abi.REPLY_DTYPE.fields["seq"][1],
                                     strides=(abi.REPLY_DTYPE.itemsize,))
        self.states = np.ndarray((abi.MAX_CHANNEL_SLOTS,), abi.SLOT_STATE_DTYPE, buffer=buffer,
                                 offset=states_at)
        self.words = np.ndarray((abi.MAX_CHANNEL_SLOTS,), "<u8", buffer=buffer,
                                offset=states_at, strides=(abi.SLOT_STATE_DTYPE.itemsize,))
        self.pins = np.ndarray((abi.MAX_CHANNEL_SLOTS,), abi.PIN_DTYPE, buffer=buffer,
                               offset=layout.pins)
        self._pin_counts, self._touches = self.pins["pins"], self.pins["touches"]
        self._sleepers = np.ndarray((1,), "<u8", buffer=buffer, offset=_SLEEPERS_AT)
        self._bytes = memoryview(buffer)
        self._replies_at, self._states_at = replies_at, states_at
        self._base = base = int(buffer.ctypes.data)
        self._reply_seq_at = base + replies_at + abi.REPLY_DTYPE.fields["seq"][1]
        self._words_at = base + states_at

    @classmethod
    def format(cls, buffer: np.ndarray, capacity: int) -> Channel:
        """Zero the channel's bytes, write the request ring's header; return the channel."""
        total = abi.channel_layout(capacity).total
        if buffer.size < total:
            raise RingError(f"channel of {capacity} requests needs {total} bytes, "
                            f"buffer has {buffer.size}")
        buffer[:total] = 0
        Ring.format(buffer, abi.RingKind.REQUEST, capacity)
        return cls(buffer)

    # -- agent side ------------------------------------------------------------------------
    def reply(self, position: int, request_id: int, status: abi.RequestStatus,
              message: str = "", *, region_id: int = 0, slot_index: int = 0,
              state_index: int = 0, generation: int = 0, slot_offset: int = 0,
              flags: int = 0) -> None:
        """Publish the reply to the request at ring ``position``."""
        at = self._replies_at + (position % self.capacity) * _REPLY.size
        i = position % self.capacity
        self._reply_seq[i] = 0
        store_fence()
        self._bytes[at:at + _REPLY_BODY] = _REPLY.pack(
            request_id, int(status), region_id, slot_index, state_index, generation,
            slot_offset, message.encode()[:_MESSAGE_BYTES], flags, 0)[:_REPLY_BODY]
        store_fence()
        self._reply_seq[i] = position + 1
        self._wake(self.reply_seq_address(position))

    def publish_state(self, index: int, generation: int, state: abi.SlotState,
                      status: int = 0, expected: int = 0) -> None:
        """Set slot-state entry ``index`` (one 64-bit store of the word, after ``status`` and
        ``expected``), then wake its sleepers."""
        at = self._states_at + index * abi.SLOT_STATE_DTYPE.itemsize
        _STATUS_EXPECTED.pack_into(self._bytes, at + _STATUS_AT, status, expected)
        store_fence()
        self.store_word(index, state_word(generation, state))
        self.wake_state(index)

    def store_expected(self, index: int, expected: int) -> None:
        """Slot-state entry ``index``'s ``expected`` := ``expected`` (the word is untouched:
        whoever publishes the state later fences before its store)."""
        at = self._states_at + index * abi.SLOT_STATE_DTYPE.itemsize + _STATUS_AT + 4
        _U32.pack_into(self._bytes, at, expected)

    def store_word(self, index: int, word: int) -> None:
        """Slot-state word ``index`` := ``word`` (one 64-bit store; no wake)."""
        self.words[index] = word

    def pins_after(self, index: int) -> tuple[int, int]:
        """(pins, touches) of slot ``index`` as they read after everything this process stored
        before (a fence first): the agent stores a slot's new word, then asks this, so that a
        client's pin is either seen here or finds the new word (:meth:`try_pin`)."""
        store_fence()
        return int(self._pin_counts[index]), int(self._touches[index])

    def touches(self, index: int) -> int:
        """How many pinned hits slot ``index`` has had (mod 2^32; no ordering)."""
        return int(self._touches[index])

    def wake_state(self, index: int) -> None:
        """Wake the client's sleepers on slot-state word ``index`` (after it was written, by
        this process or by a device)."""
        self._wake(self.word_address(index))

    def _wake(self, address: int) -> None:
        """Wake the sleepers on ``address`` if the client says one may sleep on it (a wake
        system call costs the waker microseconds even when nobody sleeps). The fence orders
        the word just published before the load of ``sleepers`` (the client's mirror image:
        it stores ``sleepers``, fences, and the futex re-reads the word), so no sleeper is
        missed."""
        store_fence()
        sleepers = int(self._sleepers[0])
        if sleepers & 0xFFFFFFFF and (sleepers >> 32) in (abi.SLEEPING_ON_ANY,
                                                           address - self._base):
            futex.wake(address)

    def reply_seq_address(self, position: int) -> int:
        """Address (this process) of the reply ``seq`` word for ring ``position``."""
        return self._reply_seq_at + (position % self.capacity) * abi.REPLY_DTYPE.itemsize

    def reply_seq(self, position: int) -> int:
        """The reply ``seq`` word for ring ``position`` as it reads now."""
        return int(self._reply_seq[position % self.capacity])

    def word_address(self, index: int) -> int:
        """Address (this process) of slot-state ``word`` ``index``."""
        return self._words_at + index * abi.SLOT_STATE_DTYPE.itemsize

    # -- client side -----------------------------------------------------------------------
    def replied(self, position: int) -> bool:
        """Whether the reply to the request at ``position`` is published (its ``seq`` names
        it); fence before reading its other fields."""
        return int(self._reply_seq[position % self.capacity]) == position + 1

    def reply_at(self, position: int) -> np.void | None:
        """A copy of the reply to the request at ``position``, or None while unpublished."""
        if not self.replied(position):
            return None
        store_fence()
        return self.replies[position % self.capacity].copy()

    def try_pin(self, index: int, word: int) -> bool:
        """Take a pinned hit on slot ``index`` if its word reads ``word`` (READY of the caller's
        generation): count the pin and the touch, fence, and read the word again; True if it
        still reads ``word``, else the pin is undone. The agent stores a slot's new word before
        it reads the slot's pins (:meth:`pins_after`), so it sees this pin or this read sees its
        word: a pinned slot is never given to another delivery. The caller serialises its own
        threads (the pin table has one writer)."""
        return self.try_pin_many([(index, word)])[0]

    def try_pin_many(self, wanted: list[tuple[int, int]]) -> list[bool]:
        """:meth:`try_pin` of each ``(index, word)`` with one fence for them all: every pin
        is counted before any word is read again, so each slot's argument holds as for one."""
        words, touches, pins = self.words, self._touches, self._pin_counts
        taken = []
        for index, word in wanted:
            hit = int(words[index]) == word
            if hit:
                touches[index] = (int(touches[index]) + 1) & 0xFFFFFFFF
                pins[index] = int(pins[index]) + 1
            taken.append(hit)
        if True in taken:
            store_fence()
            for j, (index, word) in enumerate(wanted):
                if taken[j] and int(words[index]) != word:
                    self.unpin(index)
                    taken[j] = False
        return taken

    def hold(self, index: int, generation: int) -> bool:
        """Hold a ``PIN_HELD`` grant of slot ``index``'s ``generation`` by a pin: count the
        pin, fence, count the touch (the agent drops the grant's reference once it sees the
        touch, so the pin must be visible first), fence, and read the word. True while the
        word names ``generation`` (in any state: a FAILED verdict ends the caller's wait, which
        then unpins); else the pin is undone: the slot went to another delivery first (only
        a touch of another of the caller's pins can let the agent drop the grant's reference
        before this one). The caller serialises its own threads (the pin table has one
        writer)."""
        self._pin_counts[index] = int(self._pin_counts[index]) + 1
        store_fence()
        self._touches[index] = (int(self._touches[index]) + 1) & 0xFFFFFFFF
        store_fence()
        if int(self.words[index]) >> abi.SLOT_STATE_BITS == generation:
            return True
        self.unpin(index)
        return False

    def unpin(self, index: int) -> None:
        """Drop one pin on slot ``index`` (the caller took it with :meth:`try_pin` or
        :meth:`hold`)."""
        self._pin_counts[index] = max(0, int(self._pin_counts[index]) - 1)

    def set_sleepers(self, count: int, address: int | None) -> None:
        """Publish how many of the client's threads are (about to be) asleep on words of this
        channel, and the address (this process) of the one word they all sleep on (None: more
        than one), in one store fenced before the caller's futex wait reads its word."""
        on = abi.SLEEPING_ON_ANY if address is None else address - self._base
        self._sleepers[0] = (on << 32) | count if count else 0
        store_fence()

    def answered(self, first: int, last: int) -> np.ndarray:
        """``bool[last - first]``: which of positions ``first .. last - 1`` have replies
        (at most ``capacity`` positions)."""
        pos = np.arange(first, last, dtype=np.uint64)
        idx = (pos % np.uint64(self.capacity)).astype(np.intp)
        return self._reply_seq[idx] == pos + np.uint64(1)
