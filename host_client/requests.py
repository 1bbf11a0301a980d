"""The client's side of a device's data-plane channel (docs/ABI.md): post ACQUIRE / RELEASE /
PREFETCH entries into the agent's request ring, take replies, and watch slot-state words.
No gRPC call and no thread hop on this path: a handle polls one word of shared memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple

import numpy as np

from dpu_offload import abi, futex
from dpu_offload.bell import Bell
from dpu_offload.channel import Channel, state_word
from dpu_offload.keys import ExpertKey, key_index_problem
from dpu_offload.ring import store_fence
from dpu_offload.shm import SharedBuffer
from host_client.errors import AgentUnavailable, InvalidArgument, refusal, status_text

log = logging.getLogger("host_client")

SPIN_SECONDS = 150e-6
"""A waiter polls until this long after its request was posted, then sleeps on the word it
waits for (a futex the agent wakes): the handles of one post, waited one after another, spin
once between them, not once each."""
NAP_SECONDS = 0.005
"""Longest single sleep of a waiter (it checks the device and the agent between sleeps)."""
CHECK_SECONDS = 0.05
"""How often a waiting handle checks the device and the agent connection."""


Request = tuple[int, int, int, int, int, int, int]
"""A request-ring entry's fields a client chooses: (opcode, flags, model index, layer, expert,
count, prefetch) (``abi.REQUEST_DTYPE``; ``publish`` adds the id and the post time)."""
_PACKED = abi.packer(abi.REQUEST_DTYPE)
"""A request entry in field order: request_id, opcode, flags, model, layer, expert, posted_ns,
count, prefetch, seq."""


class Grant(NamedTuple):
    """A grant this client may hit again by a pin: the agent's reply (``abi.REPLY_DTYPE``)
    and where its slot lies, (region id, byte offset), read from it once."""

    reply: np.void
    where: tuple[int, int]


def grant_where(reply: np.void) -> tuple[int, int]:
    """(region id, byte offset in that region) of the slot a granting reply names."""
    return int(reply["region_id"]), int(reply["slot_offset"])


class Wake(Enum):
    """What a post does to the agent's loop once its entries are published."""

    WAIT = "wait"
    """Ring the doorbell and yield the CPU: the caller waits for the replies (an acquire)."""
    RING = "ring"
    """Ring the doorbell and keep the CPU: the agent must act now, nobody waits (a release,
    a prefetch hint)."""
    LAZY = "lazy"
    """No ring while half the ring or more is free: the agent reads the entries at its next
    wake (another post's ring, or the end of its doze: ``DOZE_SECONDS``, 50 ms), in order with
    what follows them. For what only informs the agent (a routing visit): a wake of a sleeping
    loop is a system call, and in a VM an interrupt of another CPU."""


class ClientChannel:
    """A mapped channel and the bookkeeping of this client's requests on it.

    Replies are taken by whoever looks first: the handle that waits for one, or a post, which
    hands each answered reply to the callback registered with its request (oldest first) and,
    when the ring is short of room, sweeps every reply in. A reply entry is reused only after
    its reply was taken.
    """

    def __init__(self, shm_name: str, size: int, bell: Bell | None = None) -> None:
        self._buffer = SharedBuffer(shm_name, size)
        self.view = Channel(self._buffer.array)
        self._bell = bell
        """The agent's doorbell, rung after every post (None: the agent polls)."""
        self.capacity = self.view.capacity
        self._layout = abi.channel_layout(self.capacity)
        self._lock = threading.Lock()
        self._next_id = 1
        self._waiting: dict[int, Callable[[np.void], None] | None] = {}
        """ring position -> what to do with a refusal of it (None: its reply is kept for the
        handle that takes it), in posting order (the first key is the oldest reply entry still
        in use)."""
        self._callbacks: deque[int] = deque()
        """Positions posted with ``on_refusal``, oldest first."""
        self._taken: dict[int, np.void] = {}
        """Replies swept for handles that have not looked yet."""
        self._checked: dict[int, int] = {}
        """slot-state index -> the newest generation whose check this client started."""
        self._granted: dict[ExpertKey, tuple[int, int, np.void]] = {}
        """expert -> (slot-state index, READY word of its generation, reply) of the last grant:
        where a pinned hit may find it."""
        self._pinned: dict[ExpertKey, list[int]] = {}
        """expert -> the slot-state index of each pinned hit this client holds on it."""
        self._asleep: Counter[int] = Counter()
        """Address -> this process's threads asleep on that word of the channel."""
        self.device_address = 0
        """The channel's address as the device's kernels see it (registered host memory)."""

    def post(self, entries: list[tuple[abi.RequestOp, int, ExpertKey]],
             on_refusal: Callable[[np.void], None] | None = None,
             timeout: float = 5.0, wake: Wake = Wake.WAIT) -> list[int]:
        """Publish ``(op, model index, key)`` entries (:meth:`publish`); returns their ring
        positions."""
        for _, _, key in entries:
            problem = key_index_problem(key)
            if problem:
                raise InvalidArgument(problem)
        return self.publish([(op, 0, model, key.layer, key.expert, 0, 0)
                             for op, model, key in entries], on_refusal, timeout, wake)

    def post_visit(self, model: int, layer: int, tokens: dict[int, int], prefetch: int,
                   on_refusal: Callable[[np.void], None]) -> list[int]:
        """One MoE layer's routing (``tokens[e]``: tokens that chose expert ``e``; checked by
        the caller) as ROUTE entries, one per expert, the last flagged LAST with ``prefetch``;
        the agent is woken only for a prefetch (:class:`Wake`)."""
        route = abi.RequestOp.ROUTE
        entries = [(route, 0, model, layer, e, n, 0) for e, n in tokens.items()]
        entries[-1] = (route, abi.RequestFlags.LAST, model, layer, entries[-1][4],
                       entries[-1][5], prefetch)
        return self.publish(entries, on_refusal, wake=Wake.RING if prefetch else Wake.LAZY)

    def publish(self, entries: list[Request], on_refusal: Callable[[np.void], None] | None = None,
                timeout: float = 5.0, wake: Wake = Wake.WAIT) -> list[int]:
        """Publish request ``entries`` (:data:`Request` tuples; their ids, post time and seq
        are set here) with one fence and wake the agent's loop as ``wake`` says; returns their
        ring positions. ``on_refusal`` gets each reply that is not OK (the OK ones are only
        retired), as the next posts find them; None: a handle takes each reply
        (:meth:`take`). Replies that came for earlier posts' callbacks are looked at after
        the entries are published (the agent's work first). AgentUnavailable when the agent
        does not make room within ``timeout`` seconds."""
        n = len(entries)
        if n > self.capacity:
            raise ValueError(f"{n} requests in one post; the channel holds {self.capacity}")
        deadline = time.monotonic() + timeout
        raw = bytearray(n * _PACKED.size)
        with self._lock:
            while not self._has_room_locked(n):
                self._call_back_locked()
                self._sweep_locked()  # replies handles have not taken yet hold their entries
                if self._has_room_locked(n):
                    break
                if time.monotonic() > deadline:
                    raise AgentUnavailable(f"the agent took no request for {timeout} s "
                                           f"({len(self._waiting)} unanswered)")
                time.sleep(0)
            first, request_id, now = self.view.requests.produced, self._next_id, time.monotonic_ns()
            for j, (op, flags, model, layer, expert, count, prefetch) in enumerate(entries):
                _PACKED.pack_into(raw, j * _PACKED.size, request_id + j, op, flags, model, layer,
                                  expert, now, count, prefetch, 0)
            self._next_id += n
            positions = list(range(first, first + n))
            for p in positions:
                self._waiting[p] = on_refusal
            if on_refusal is not None:
                self._callbacks.extend(positions)
            self.view.requests.push_packed(raw, n)
        if self._bell is not None and (
                wake is not Wake.LAZY
                or self.view.requests.free_entries() < self.capacity // 2):
            self._bell.ring(yield_cpu=wake is Wake.WAIT)
        if self._callbacks:
            with self._lock:
                self._call_back_locked()
        return positions

    def announce(self) -> None:
        """Wake the agent's loop ahead of a post this client is preparing: woken to nothing
        yet, it polls for its spin, so its wake-up overlaps the preparation."""
        if self._bell is not None:
            self._bell.ring(yield_cpu=False)

    def remember(self, key: ExpertKey, reply: np.void) -> None:
        """Note the agent's grant of a slot for ``key``: once that delivery reads READY, a later
        acquire of ``key`` may be a pinned hit on it (:meth:`pin_many`)."""
        index, generation = int(reply["state_index"]), int(reply["generation"])
        word = state_word(generation, abi.SlotState.READY)
        with self._lock:
            self._granted[key] = (index, word, Grant(reply, grant_where(reply)))

    def pin_many(self, keys: list[ExpertKey]) -> list[Grant | None]:
        """Pinned hits: per key, its last grant if that slot still holds it READY, with a pin
        taken on it in the pin table (the agent will not give the slot to another delivery
        until :meth:`unpin`); None where the agent must be asked. One fence for all
        (``Channel.try_pin_many``)."""
        with self._lock:
            granted = [self._granted.get(key) for key in keys]
            taken = iter(self.view.try_pin_many([g[:2] for g in granted if g is not None]))
            hits: list[Grant | None] = []
            for key, g in zip(keys, granted, strict=True):
                if g is not None and next(taken):
                    self._pinned.setdefault(key, []).append(g[0])
                    hits.append(g[2])
                else:
                    hits.append(None)
            return hits

    def hold(self, key: ExpertKey, index: int, generation: int) -> bool:
        """Hold a ``PIN_HELD`` grant of ``key`` (slot-state ``index``, ``generation``) by a
        pin (``Channel.hold``); False when the slot went to another delivery first."""
        with self._lock:
            if not self.view.hold(index, generation):
                return False
            self._pinned.setdefault(key, []).append(index)
            return True

    def unpin(self, key: ExpertKey, index: int | None = None) -> bool:
        """Drop one pin on ``key`` (the one on slot-state ``index``, or the latest); False
        when this client holds none (the reference is then the agent's to drop: post a
        RELEASE)."""
        with self._lock:
            return self._unpin_locked(key, index)

    def unpin_many(self, keys: list[ExpertKey]) -> list[bool]:
        """:meth:`unpin` (the latest pin) of each of ``keys``, under one lock."""
        with self._lock:
            return [self._unpin_locked(key, None) for key in keys]

    def _unpin_locked(self, key: ExpertKey, index: int | None) -> bool:
        held = self._pinned.get(key)
        if not held or (index is not None and index not in held):
            return False
        if index is None:
            index = held.pop()
        else:
            held.remove(index)
        self.view.unpin(index)
        if not held:
            del self._pinned[key]
        return True

    def _has_room_locked(self, n: int) -> bool:
        """Whether ``n`` more requests fit: free ring entries, and no reply entry they would
        reuse still waiting to be taken (the oldest waiting position is the first key)."""
        first = self.view.requests.produced
        return self.view.requests.free_entries() >= n and \
            first + n - next(iter(self._waiting), first) <= self.capacity

    def claim_check(self, index: int, generation: int) -> bool:
        """True for the first caller to claim the check of slot ``index``'s LANDED
        ``generation`` (it must launch it); later callers wait for its verdict."""
        with self._lock:
            if self._checked.get(index, -1) >= generation:
                return False
            self._checked[index] = generation
            return True

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
        published in the channel's ``sleepers`` so that the agent wakes us (it skips the wake
        system call for a word none of ours sleeps on)."""
        with self._lock:
            self._asleep[address] += 1
            self._publish_sleepers_locked()
        try:
            futex.wait(address, value, timeout)
        finally:
            with self._lock:
                self._asleep[address] -= 1
                if not self._asleep[address]:
                    del self._asleep[address]
                self._publish_sleepers_locked()

    def _publish_sleepers_locked(self) -> None:
        asleep = self._asleep
        self.view.set_sleepers(sum(asleep.values()),
                               next(iter(asleep)) if len(asleep) == 1 else None)

    def wait_reply(self, position: int, timeout: float, posted: float | None = None
                   ) -> np.void:
        """The reply to ``position``, polled until ``SPIN_SECONDS`` after ``posted`` (monotonic
        seconds; default now), then slept for until it comes; AgentUnavailable after
        ``timeout`` seconds, AgentUnavailable if the channel faulted."""
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
        """Retire the replies that came for callbacks' positions, oldest first, handing the
        refusals among them to their callbacks (a few loads when nothing came; one fence for
        all that came)."""
        callbacks, waiting, view = self._callbacks, self._waiting, self.view
        came = 0
        for p in callbacks:
            if p in waiting and not view.replied(p):
                break
            came += 1
        if not came:
            return
        store_fence()  # the seq words above before the replies' other fields
        done = [callbacks.popleft() for _ in range(came)]
        self._retire_all([p for p in done if p in waiting])

    def _retire_all(self, positions: list[int]) -> None:
        """The replies to ``positions`` (all still waiting) came: each kept for its handle, or
        its refusal handed to its callback (the OK ones only forgotten). Their statuses are
        read in one gather; only what is kept or refused is copied."""
        replies = self.view.replies
        at = np.array(positions, np.intp) % self.capacity
        for p, i, status in zip(positions, at.tolist(), replies["status"][at].tolist(),
                                strict=True):
            on_refusal = self._waiting.pop(p)
            if on_refusal is None:
                self._taken[p] = replies[i].copy()
            elif status != abi.RequestStatus.OK:
                on_refusal(replies[i].copy())

    def _sweep_locked(self) -> None:
        """Take every reply that came (for callbacks, or kept for their handles)."""
        if not self._waiting:
            return
        first = next(iter(self._waiting))  # the oldest waiting position
        last = self.view.requests.produced
        done = np.flatnonzero(self.view.answered(first, last))
        store_fence()  # the seq words above before the replies' other fields
        self._retire_all([p for p in (first + done).tolist() if p in self._waiting])

    def check(self) -> None:
        """AgentUnavailable when the agent stopped serving this channel."""
        fault = int(self.view.requests.header["fault"])
        if fault:
            raise refusal(abi.RequestStatus.UNAVAILABLE,
                                 f"the agent stopped serving this channel: "
                                 f"{status_text(fault)} (its header was overwritten)")

    @property
    def states_address(self) -> int:
        """Device address of the slot-state table (after the device registered us)."""
        return self.device_address + self._layout.states

    def word_address(self, index: int) -> int:
        """Device address of slot-state word ``index`` (after the device registered us)."""
        return self.states_address + index * abi.SLOT_STATE_DTYPE.itemsize

    def reply_address(self, position: int) -> int:
        """Device address of the reply entry of ring ``position`` (after the device registered
        us)."""
        return (self.device_address + self._layout.replies
                + position % self.capacity * abi.REPLY_DTYPE.itemsize)

    def word(self, index: int) -> int:
        return int(self.view.words[index])

    def slot_status(self, index: int) -> int:
        return int(self.view.states["status"][index])

    def close(self) -> None:
        self._buffer.close()
