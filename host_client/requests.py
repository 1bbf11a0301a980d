"""The client's side of a device's data-plane channel (docs/ABI.md): post ACQUIRE / RELEASE /
PREFETCH entries into the agent's request ring, take replies, and watch slot-state words.
No gRPC call and no thread hop on this path: a handle polls one word of shared memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from dpu_offload.keys import ExpertKey
from gpu_kernels import abi, futex
from gpu_kernels.channel import Channel, split_word
from gpu_kernels.shm import SharedBuffer

if TYPE_CHECKING:
    from host_client.memory import ExpertSlot

log = logging.getLogger("host_client")

SPIN_SECONDS = 150e-6
"""A waiter polls until this long after its request was posted, then sleeps on the word it
waits for (a futex the agent wakes): the handles of one post, waited one after another, spin
once between them, not once each."""
NAP_SECONDS = 0.005
"""Longest single sleep of a waiter (it checks the device and the agent between sleeps)."""
CHECK_SECONDS = 0.05
"""How often a waiting handle checks the device and the agent connection."""

_CODES = {
    abi.RequestStatus.BAD_OPCODE: grpc.StatusCode.INVALID_ARGUMENT,
    abi.RequestStatus.REQUEST_REUSED: grpc.StatusCode.INVALID_ARGUMENT,
}


class AgentUnavailable(ConnectionError):
    """The agent cannot be reached (or went away)."""


class TransferFailed(RuntimeError):
    """A delivery completed with an error status; the slot was not marked ready."""


class RequestRefused(grpc.RpcError):
    """The agent refused a request posted on the channel. ``code()`` and ``details()`` read as
    the same refusal over gRPC would; ``status`` is the channel's :class:`abi.RequestStatus`."""

    def __init__(self, status: abi.RequestStatus, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message

    def code(self) -> grpc.StatusCode:
        return _CODES.get(self.status) or getattr(grpc.StatusCode, self.status.name)

    def details(self) -> str:
        return self.message

    @classmethod
    def of(cls, reply: np.void) -> RequestRefused | None:
        """The refusal a reply carries; None for OK."""
        status = abi.RequestStatus(int(reply["status"]))
        if status == abi.RequestStatus.OK:
            return None
        return cls(status, bytes(reply["message"]).decode(errors="replace"))


class ClientChannel:
    """A mapped channel and the bookkeeping of this client's requests on it.

    Replies are taken by whoever looks first: the handle that waits for one, or a post, which
    hands each answered reply to the callback registered with its request (oldest first) and,
    when the ring is short of room, sweeps every reply in. A reply entry is reused only after
    its reply was taken.
    """

    def __init__(self, shm_name: str, size: int) -> None:
        self._buffer = SharedBuffer(shm_name, size)
        self.view = Channel(self._buffer.array)
        self.capacity = self.view.capacity
        self._lock = threading.Lock()
        self._next_id = 1
        self._waiting: dict[int, Callable[[np.void], None]] = {}
        """ring position -> what to do with its reply, in posting order (the first key is the
        oldest reply entry still in use)."""
        self._callbacks: deque[int] = deque()
        """Positions posted with ``on_reply``, oldest first."""
        self._taken: dict[int, np.void] = {}
        """Replies swept for handles that have not looked yet."""
        self._granted: dict[int, int] = {}
        """slot-state index -> the newest generation a reply granted this client."""
        self._sleepers = 0
        self.device_address = 0
        """The channel's address as the device's kernels see it (registered host memory)."""

    def post(self, entries: list[tuple[abi.RequestOp, int, ExpertKey]],
             on_reply: Callable[[np.void], None] | None = None,
             timeout: float = 5.0) -> list[int]:
        """Publish ``(op, model index, key)`` entries with one fence; returns their ring
        positions. ``on_reply`` gets each reply a sweep takes (None: a handle will take it).
        AgentUnavailable when the agent does not make room within ``timeout`` seconds."""
        n = len(entries)
        if n > self.capacity:
            raise ValueError(f"{n} requests in one post; the channel holds {self.capacity}")
        records = np.zeros(n, abi.REQUEST_DTYPE)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._call_back_locked()
            while not self._has_room_locked(n):
                self._sweep_locked()  # replies handles have not taken yet hold their entries
                if self._has_room_locked(n):
                    break
                if time.monotonic() > deadline:
                    raise AgentUnavailable(f"the agent took no request for {timeout} s "
                                           f"({len(self._waiting)} unanswered)")
                time.sleep(0)
            first = self.view.requests.produced
            for j, (op, model, key) in enumerate(entries):
                records[j] = (self._next_id + j, int(op), 0, model, key.layer, key.expert, 0)
            self._next_id += n
            positions = list(range(first, first + n))
            for p in positions:
                self._waiting[p] = on_reply or self._keep
            if on_reply is not None:
                self._callbacks.extend(positions)
            self.view.requests.push_many(records)
        return positions

    def _has_room_locked(self, n: int) -> bool:
        """Whether ``n`` more requests fit: free ring entries, and no reply entry they would
        reuse still waiting to be taken (the oldest waiting position is the first key)."""
        first = self.view.requests.produced
        return self.view.requests.free_entries() >= n and \
            first + n - next(iter(self._waiting), first) <= self.capacity

    def note_grant(self, reply: np.void) -> bool:
        """Record a grant; True when its slot generation was granted before (no new delivery:
        a slot's generation grows with each delivery into it, and only this client's
        requests are granted its slots)."""
        index, generation = int(reply["state_index"]), int(reply["generation"])
        with self._lock:
            seen = self._granted.get(index, -1)
            self._granted[index] = max(seen, generation)
        return generation <= seen

    def _keep(self, reply: np.void) -> None:
        self._taken[int(reply["seq"]) - 1] = reply

    def take(self, position: int) -> np.void | None:
        """The reply to ``position`` if it has come (each reply is taken once)."""
        with self._lock:
            reply = self._taken.pop(position, None)
            if reply is not None:
                return reply
            if position not in self._waiting:
                return None
            reply = self.view.reply_at(position)
            if reply is not None:
                del self._waiting[position]
            return reply

    def watch(self, position: int, index: int | None) -> tuple[int, int]:
        """(address, value now) of the word a waiter sleeps on: the reply's ``seq`` for
        ``position`` until it has come, then slot-state word ``index``."""
        view = self.view
        if index is None:
            return view.reply_seq_address(position), view.reply_seq(position)
        return view.word_address(index), int(view.words[index])

    def sleep(self, address: int, value: int, timeout: float) -> None:
        """Sleep until the word at ``address`` may differ from ``value`` (or ``timeout`` s),
        counted in the channel's ``sleepers`` so that the agent wakes us (it skips the wake
        system call while nobody of ours sleeps)."""
        with self._lock:
            self._sleepers += 1
            self.view.set_sleepers(self._sleepers)
        try:
            futex.wait(address, value, timeout)
        finally:
            with self._lock:
                self._sleepers -= 1
                self.view.set_sleepers(self._sleepers)

    def wait_reply(self, position: int, timeout: float, posted: float | None = None
                   ) -> np.void:
        """The reply to ``position``, polled until ``SPIN_SECONDS`` after ``posted`` (monotonic
        seconds; default now), then slept for until it comes; AgentUnavailable after
        ``timeout`` seconds, RequestRefused(UNAVAILABLE) if the channel faulted."""
        start = time.monotonic()
        spin_until = (start if posted is None else posted) + SPIN_SECONDS
        while True:
            address, value = self.watch(position, None)
            reply = self.take(position)
            if reply is not None:
                return reply
            now = time.monotonic()
            if now < spin_until:
                continue
            self.check()
            left = start + timeout - now
            if left <= 0:
                raise AgentUnavailable(f"the agent did not answer within {timeout} s")
            self.sleep(address, value, min(NAP_SECONDS, left))

    def _call_back_locked(self) -> None:
        """Hand the replies that came, oldest first, to their callbacks (a few loads when
        nothing came)."""
        callbacks = self._callbacks
        while callbacks:
            p = callbacks[0]
            if p in self._waiting:
                reply = self.view.reply_at(p)
                if reply is None:
                    return
                self._waiting.pop(p)(reply)
            callbacks.popleft()

    def _sweep_locked(self) -> None:
        """Take every reply that came (for callbacks, or kept for their handles)."""
        if not self._waiting:
            return
        first = next(iter(self._waiting))  # the oldest waiting position
        last = self.view.requests.produced
        done = np.flatnonzero(self.view.answered(first, last))
        for k in done.tolist():
            p = first + k
            callback = self._waiting.pop(p, None)
            if callback is not None:
                reply = self.view.reply_at(p)
                if reply is not None:
                    callback(reply)

    def check(self) -> None:
        """RequestRefused(UNAVAILABLE) when the agent stopped serving this channel."""
        fault = int(self.view.requests.header["fault"])
        if fault:
            raise RequestRefused(abi.RequestStatus.UNAVAILABLE,
                                 f"the agent stopped serving this channel: "
                                 f"{abi.Status(fault).name} (its header was overwritten)")

    def word_address(self, index: int) -> int:
        """Device address of slot-state word ``index`` (after the device registered us)."""
        states_at = abi.channel_layout(self.capacity)[1]
        return self.device_address + states_at + index * abi.SLOT_STATE_DTYPE.itemsize

    def word(self, index: int) -> int:
        return int(self.view.words[index])

    def slot_status(self, index: int) -> int:
        return int(self.view.states["status"][index])

    def close(self) -> None:
        self._buffer.close()


class StreamWait:
    """A wait enqueued on a CUDA stream (``AcquireHandle.enqueue_wait``).

    Attributes:
        slot: the expert's slot views; valid for kernels enqueued on the stream after the wait.
        result: ``uint32[1]`` device word: an index into ``cuda_ops.WAIT_OUTCOMES`` once the
            wait kernel ran (0 READY).
    """

    def __init__(self, key: ExpertKey, slot: ExpertSlot, result: Any, stream: Any) -> None:
        self.key, self.slot, self.result, self.stream = key, slot, result, stream

    def check(self) -> None:
        """Synchronise the stream; TransferFailed unless the expert was READY."""
        from gpu_kernels.cuda_ops import WAIT_OUTCOMES

        self.stream.synchronize()
        outcome = int(self.result.get()[0])
        if outcome:
            raise TransferFailed(f"{self.key}: stream wait ended with "
                                 f"{WAIT_OUTCOMES[outcome] if outcome < 4 else outcome}")


class AcquireHandle:
    """A pending (or already satisfied) acquire; :meth:`wait` returns the :class:`ExpertSlot`.

    Resolved by polling shared memory: first the reply (which slot, which generation), then
    that slot's state word until it reads READY or FAILED for the generation.
    """

    def __init__(self, key: ExpertKey, channel: ClientChannel, position: int,
                 make_slot: Callable[[np.void], ExpertSlot], check: Callable[[], None],
                 on_settle: Callable[[], None]) -> None:
        self.key = key
        self._channel = channel
        self._position = position
        self._make_slot = make_slot
        self._check = check
        self._on_settle = on_settle
        self._reply: np.void | None = None
        self._resident: bool | None = None
        self._slot: ExpertSlot | None = None
        self._error: BaseException | None = None
        self._posted = time.monotonic()

    def _settle(self, slot: ExpertSlot | None, error: BaseException | None) -> None:
        self._slot, self._error = slot, error
        self._on_settle()

    def _accept(self, reply: np.void) -> bool:
        """Take the agent's reply; True when it is a refusal (the outcome)."""
        refused = RequestRefused.of(reply)
        if refused is not None:
            self._settle(None, refused)
            return True
        self._reply = reply
        self._resident = self._channel.note_grant(reply)
        return False

    def wait_granted(self, timeout: float) -> None:
        """Block (asleep) until the agent answered the acquire: a slot, or a refusal."""
        if not self.granted():
            self._accept(self._channel.wait_reply(self._position, timeout, self._posted))

    def _poll(self) -> bool:
        """Advance as far as shared memory allows; True once the outcome is known."""
        if self._slot is not None or self._error is not None:
            return True
        if self._reply is None:
            reply = self._channel.take(self._position)
            if reply is None:
                return False
            if self._accept(reply):
                return True
        index = int(self._reply["state_index"])
        generation, state = split_word(self._channel.word(index))
        mine = int(self._reply["generation"])
        if generation == mine and state == abi.SlotState.READY:
            self._settle(self._make_slot(self._reply), None)
        elif generation == mine and state == abi.SlotState.FAILED:
            status = abi.Status(self._channel.slot_status(index))
            self._settle(None, TransferFailed(f"{self.key}: delivery completed with "
                                              f"{status.name}"))
        elif generation > mine:
            self._settle(None, TransferFailed(f"{self.key}: its slot was given to another "
                                              "delivery before this one completed"))
        else:
            return False
        return True

    def enqueue_wait(self, stream: Any, timeout: float = 30.0) -> StreamWait:
        """Make ``stream`` (a CuPy stream of the slot's GPU) wait on the GPU until this expert
        is READY, and return at once: kernels enqueued on ``stream`` afterwards read verified
        bytes (``StreamWait.slot``), though the expert may not have landed when they are
        enqueued. Only the grant is awaited here (one reply). ``StreamWait.check()`` raises
        if the delivery failed or timed out after ``timeout`` seconds."""
        from gpu_kernels import cuda_ops

        self.wait_granted(timeout)
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        result = cuda_ops.cp.empty(1, cuda_ops.cp.uint32)  # no fill kernel: no module load
        cuda_ops.cp.cuda.runtime.memsetAsync(result.data.ptr, 0xFF, 4, stream.ptr)
        cuda_ops.wait_ready(self._channel.word_address(int(self._reply["state_index"])),
                            int(self._reply["generation"]), timeout, result, stream)
        return StreamWait(self.key, self._make_slot(self._reply), result, stream)

    def done(self) -> bool:
        """Whether the outcome is known (wait would return or raise at once)."""
        return self._poll()

    def granted(self) -> bool:
        """Whether the agent has answered the acquire (a slot, or a refusal)."""
        self._poll()
        return self._reply is not None or isinstance(self._error, RequestRefused)

    @property
    def resident(self) -> bool | None:
        """Once granted: True when this acquire started no delivery (the expert was in its
        slot, or already on its way there, for an earlier request of this client); False when
        the agent began a delivery for it; None before the grant or after a refusal."""
        self._poll()
        return self._resident

    @property
    def refusal(self) -> RequestRefused | None:
        """The agent's refusal of the acquire, once answered."""
        return self._error if isinstance(self._error, RequestRefused) else None

    def wait(self, timeout: float | None = 30.0) -> ExpertSlot:
        """Block until the bytes are verified in the slot. Raises RequestRefused (the agent
        refused the acquire), TransferFailed (the delivery failed), AgentUnavailable (the agent
        went away), DeviceFault (the device faulted: checked while waiting, so a dead consumer
        is an error, not a hang), or TimeoutError after ``timeout`` seconds."""
        start = time.monotonic()
        next_check = start + CHECK_SECONDS
        while True:
            index = None if self._reply is None else int(self._reply["state_index"])
            address, value = self._channel.watch(self._position, index)
            if self._poll():
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
            if now - self._posted > SPIN_SECONDS:
                self._channel.sleep(address, value,
                                    min(NAP_SECONDS, max(0.0, next_check - now)))
        if self._error is not None:
            raise self._error
        assert self._slot is not None
        return self._slot
