"""What an acquire returns: a handle that polls one slot-state word (docs/ABI.md), and checks
a DMA-engine delivery's landed bytes in this process, on this process's device (the slot's
consumer: a kernel on the caller's stream, or the NumPy twin on the CPU reference device).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dpu_offload import abi
from dpu_offload.channel import split_word
from dpu_offload.keys import ExpertKey
from host_client.errors import AgentError, TransferFailed, refusal_of, status_text
from host_client.requests import (
    CHECK_SECONDS,
    NAP_SECONDS,
    SPIN_SECONDS,
    ClientChannel,
    grant_where,
)
from host_client.slot_checks import LandedCheck, StreamWait

if TYPE_CHECKING:
    from host_client.devices import CheckTicket
    from host_client.memory import ExpertSlot

VERDICT_SPIN_SECONDS = 0.01
"""A waiter polls (does not sleep) this long after its slot read LANDED where the check's
verdict is written by a device that wakes no sleeper (a GPU kernel; ``Device.verdict_wakes``):
it normally follows within microseconds."""
MAX_REFETCHES = 2
"""A host ``wait`` whose check finds a mismatch acquires again this many times (the agent
refetches the expert from the checkpoint); a stream wait cannot (its kernels already ran)."""


class AcquireHandle:
    """A pending (or already satisfied) acquire; :meth:`wait` returns the :class:`ExpertSlot`.

    Resolved by polling shared memory: first the reply (which slot, which generation), then
    that slot's state word until it reads READY or FAILED for the generation. Where the DMA
    engine delivers, the acquire starts the check on the device with its post
    (:meth:`check_at_post`): the device waits for the reply and then for LANDED, so the
    verdict follows the bytes by the check's own time, and a waiter woken at LANDED polls on
    for it. A handle whose check gave up before the bytes landed starts another
    (``LandedCheck``) when it finds them landed unchecked.
    """

    def __init__(self, key: ExpertKey, channel: ClientChannel, position: int,
                 make_slot: Callable[[np.void], ExpertSlot], check: Callable[[], None],
                 on_settle: Callable[[], None], landed: LandedCheck | None = None,
                 repost: Callable[[], int] | None = None) -> None:
        self.key = key
        self._channel = channel
        self._position = position
        self._make_slot = make_slot
        self._check = check
        self._on_settle = on_settle
        self._landed = landed
        self._repost = repost
        """Posts the acquire again, returning its ring position (DMA-engine devices)."""
        self._refetches = 0
        self._ticket: CheckTicket | None = None
        """The check this handle started, or its batch's (None: not started, or another
        handle's)."""
        self._landed_at: float | None = None
        """When the slot's word was first seen LANDED for this handle's generation."""
        self._reply: np.void | None = None
        self._slot: ExpertSlot | None = None
        self._error: BaseException | None = None
        self._posted = time.monotonic()
        self._pinned = False
        self._held: int | None = None
        """Slot-state index this handle holds by a pin (a ``PIN_HELD`` grant), until it fails
        or is released."""

    @classmethod
    def pinned(cls, key: ExpertKey, channel: ClientChannel, reply: np.void,
               slot: ExpertSlot) -> AcquireHandle:
        """A pinned hit (``ClientChannel.pin_many``): settled at once, nothing was posted."""
        handle = cls(key, channel, -1, lambda _: slot, lambda: None, lambda: None)
        handle._reply, handle._slot, handle._pinned = reply, slot, True
        return handle

    def _settle(self, slot: ExpertSlot | None, error: BaseException | None) -> None:
        if error is not None:
            self._let_go()
        self._slot, self._error = slot, error
        self._on_settle()

    def _let_go(self) -> None:
        """Drop this handle's pin on a grant it will not use (a failed delivery)."""
        if self._held is not None:
            self._channel.unpin(self.key, self._held)
            self._held = None

    def _again(self) -> None:
        """Post the acquire again (the agent refetches, or grants another slot)."""
        assert self._repost is not None
        self._let_go()
        self._reply, self._posted = None, time.monotonic()
        self._ticket = self._landed_at = None
        self._position = self._repost()

    def _accept(self, reply: np.void) -> bool:
        """Take the agent's reply; True when it is a refusal (the outcome)."""
        refused = refusal_of(reply)
        if refused is not None:
            self._settle(None, refused)
            return True
        index, generation = int(reply["state_index"]), int(reply["generation"])
        if int(reply["flags"]) & abi.ReplyFlags.PIN_HELD:
            if not self._channel.hold(self.key, index, generation):
                # Another of this client's pins touched the slot first, the agent took that
                # for this one and the slot went on: ask again.
                if self._repost is None:
                    self._settle(None, TransferFailed(f"{self.key}: its slot was given to "
                                                      "another delivery before it was held"))
                    return True
                self._again()
                return False
            self._held = index
        self._reply = reply
        self._channel.remember(self.key, reply)
        if self._ticket is not None:  # checked by its batch's launch: no other check is started
            self._channel.claim_check(index, generation)
        return False

    @staticmethod
    def check_at_post(handles: list[AcquireHandle], nbytes: list[int],
                      timeout: float = 30.0) -> None:
        """Start, in one launch, the checks of handles whose ACQUIREs were just posted on one
        DMA-engine device (``nbytes``: each expert's blob size), before the agent answered:
        the device takes each slot from its reply and checks it as soon as its bytes land, so
        no wake-up of the client stands between the grants and the checks."""
        landed = handles[0]._landed
        if landed is None:
            return
        ticket = landed.start_posted([(h._position, n) for h, n in zip(handles, nbytes,
                                                                        strict=True)], timeout)
        for h in handles:
            h._ticket = ticket

    def wait_granted(self, timeout: float, spin: bool = True) -> None:
        """Block until the agent answered the acquire (a slot, or a refusal): polling until
        ``SPIN_SECONDS`` after the post, then asleep (at once with ``spin=False``: a reply
        that is far off, as a batch's last is)."""
        self._poll()
        while self._reply is None and self._error is None:  # a pin lost asks again
            self._accept(self._channel.wait_reply(self._position, timeout,
                                                  self._posted if spin else -math.inf))

    def _poll(self, timeout: float = 30.0) -> bool:
        """Advance as far as shared memory allows (checking a LANDED slot this handle
        claims, for at most ``timeout`` s); True once the outcome is known."""
        if self._slot is not None or self._error is not None:
            return True
        if self._reply is None:
            reply = self._channel.take(self._position)
            if reply is None:
                return False
            if self._accept(reply):
                return True
            if self._reply is None:  # asked again
                return False
        reply = self._reply
        index, mine = int(reply["state_index"]), int(reply["generation"])
        generation, state = split_word(self._channel.word(index))
        if generation == mine and state in (abi.SlotState.FILLING, abi.SlotState.LANDED):
            self._start_check(reply, index, mine, state, timeout)
            return False
        if generation == mine and state == abi.SlotState.READY:
            self._settle(self._make_slot(reply), None)
        elif generation == mine and state == abi.SlotState.FAILED:
            status = self._channel.slot_status(index)
            if (status == abi.Status.CHECKSUM_MISMATCH and self._repost is not None
                    and self._refetches < MAX_REFETCHES):
                self._refetches += 1
                self._again()
                return False
            self._settle(None, TransferFailed(f"{self.key}: delivery completed with "
                                              f"{status_text(status)}"))
        elif generation > mine:
            self._settle(None, TransferFailed(f"{self.key}: its slot was given to another "
                                              "delivery before this one completed"))
        else:
            return False
        return True

    def _start_check(self, reply: np.void, index: int, mine: int, state: abi.SlotState,
                     timeout: float) -> None:
        """The delivery is under way (FILLING) or has landed unchecked (LANDED): start its
        check if this handle claims it, or again if the one it started ended with no verdict
        (it gave up before the bytes landed)."""
        if state == abi.SlotState.LANDED and self._landed_at is None:
            self._landed_at = time.monotonic()
        if self._landed is None:
            return
        if self._ticket is None:
            if self._claims_check():
                self._ticket = self._landed.start(reply, self._make_slot(reply), timeout)
        elif state == abi.SlotState.LANDED and self._ticket.done():
            generation, now = split_word(self._channel.word(index))
            if generation == mine and now == abi.SlotState.LANDED:  # still no verdict
                self._ticket = self._landed.start(reply, self._make_slot(reply), timeout)

    def _claims_check(self) -> bool:
        """Whether this handle, granted and not settled, with no check started, finds its
        delivery under way or landed unchecked and claims its check (the first handle of the
        client to ask does)."""
        reply = self._reply
        if self._landed is None or reply is None or self._slot is not None \
                or self._error is not None or self._ticket is not None:
            return False
        index, mine = int(reply["state_index"]), int(reply["generation"])
        generation, state = split_word(self._channel.word(index))
        return (generation == mine and state in (abi.SlotState.FILLING, abi.SlotState.LANDED)
                and self._channel.claim_check(index, mine))

    def _verdict_due(self) -> bool:
        """Whether the slot has landed so recently that its check's verdict is moments away
        and comes from a device that wakes nobody (a GPU kernel): poll rather than sleep. The
        CPU reference device's check wakes the word's sleepers (``Device.verdict_wakes``)."""
        return (self._landed_at is not None
                and time.monotonic() - self._landed_at < VERDICT_SPIN_SECONDS
                and not (self._landed is not None and self._landed.device.verdict_wakes))

    def enqueue_wait(self, stream: Any, timeout: float = 30.0) -> StreamWait:
        """Make ``stream`` (a CuPy stream of the slot's GPU) wait on the GPU until this expert
        is READY, and return at once: kernels enqueued on ``stream`` afterwards read verified
        bytes (``StreamWait.slot``), though the expert may not have landed when they are
        enqueued. Where the DMA engine delivers, the check of the landed bytes runs on
        ``stream`` too. Only the grant is awaited here (one reply). ``StreamWait.check()``
        raises if the delivery failed or timed out after ``timeout`` seconds. Release the
        expert only after the stream has passed the kernels that read it."""
        from gpu_kernels import cuda_ops
        from gpu_kernels.host_words import WORDS

        self.wait_granted(timeout)
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        if self._slot is not None:  # READY and held: nothing to wait for on the device
            return StreamWait(self.key, self._slot, None, stream)
        result = WORDS.take(0xFFFFFFFF)
        slot = self._make_slot(self._reply)
        if self._landed is not None:
            self._landed.enqueue(self._reply, slot, stream, timeout, result.device)
        else:
            cuda_ops.wait_ready(self._channel.word_address(int(self._reply["state_index"])),
                                int(self._reply["generation"]), timeout, result.device, stream)
        return StreamWait(self.key, slot, result, stream)

    def done(self) -> bool:
        """Whether the outcome is known (wait would return or raise at once)."""
        return self._poll()

    def granted(self) -> bool:
        """Whether the agent has answered the acquire (a slot, or a refusal)."""
        self._poll()
        return self._reply is not None or self.refusal is not None

    @property
    def resident(self) -> bool | None:
        """Once granted: True when this acquire started no delivery (the expert was in its
        slot, or already on its way there: a cache hit); False when the agent began a delivery
        for it; None before the grant or after a refusal. A pinned hit is resident."""
        reply = self._grant()
        if reply is None:
            return None
        return self._pinned or bool(int(reply["flags"]) & abi.ReplyFlags.RESIDENT)

    @property
    def pinned_hit(self) -> bool:
        """Whether this acquire was a pinned hit: served from the pin table, no request
        posted (release it like any other)."""
        return self._pinned

    @property
    def where(self) -> tuple[int, int] | None:
        """(region id, byte offset) of the granted slot in its pool; None before the grant."""
        if self._slot is not None and self._slot.where is not None:
            return self._slot.where
        reply = self._grant()
        return None if reply is None else grant_where(reply)

    def _grant(self) -> np.void | None:
        """The agent's grant, polled for only until it is known; None before it."""
        if self._reply is None:
            self._poll()
        return self._reply

    @property
    def refusal(self) -> AgentError | None:
        """The agent's refusal of the acquire (through the channel), once answered."""
        error = self._error
        return error if isinstance(error, AgentError) and error.status is not None else None

    def wait(self, timeout: float | None = 30.0) -> ExpertSlot:
        """Block until the bytes are verified in the slot. Raises an :class:`AgentError` (the
        agent refused the acquire: NotFound, ResourceExhausted...), TransferFailed (the
        delivery failed), AgentUnavailable (the agent went away), DeviceFault (the device
        faulted: checked while waiting, so a dead consumer is an error, not a hang), or
        TimeoutError after ``timeout`` seconds."""
        if self._slot is not None:  # settled (a batch's handles are waited for twice)
            return self._slot
        start = time.monotonic()
        next_check = start + CHECK_SECONDS
        while True:
            index = None if self._reply is None else int(self._reply["state_index"])
            address, value = self._channel.watch(self._position, index)
            left = 30.0 if timeout is None else max(0.0, start + timeout - time.monotonic())
            if self._poll(left):
                break
            if (self._reply is None) != (index is None):
                continue  # the reply came: watch the slot's word from now on
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_SECONDS
                try:
                    self._check()
                except Exception as exc:  # noqa: BLE001 - DeviceFault, AgentUnavailable
                    self._settle(None, exc)
                    break
                if timeout is not None and now - start >= timeout:
                    raise TimeoutError(f"{self.key} not ready after {timeout} s")
            if self._verdict_due():
                time.sleep(0)  # the GIL to this process's other threads meanwhile
            elif now - self._posted > SPIN_SECONDS:
                self._channel.sleep(address, value,
                                    min(NAP_SECONDS, max(0.0, next_check - now)))
        if self._error is not None:
            raise self._error
        assert self._slot is not None
        return self._slot
