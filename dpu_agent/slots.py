"""A device's expert slots: one pool per size class, each slot's state, generation, the
expert it holds and the references on it. The one place of the reference rule (a slot nobody
holds goes idle, an eviction candidate) and of the slot-state table's mirror (the channel).
Which idle slot a miss takes is the pool's eviction policy's choice (the arena's policies,
``dpu_agent.weights.policies``: the agent gives each pool the configured one), and the policy
knows exactly the idle slots' experts: one enters it when its slot goes idle (a use just
ended) and leaves it when held again, evicted or dropped, so a victim is never searched for
among slots in use (a batch of B misses would cost O(B) each)."""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from dpu_agent.dataplane.channels import DeviceChannel
from dpu_agent.routing.stats import Visit
from dpu_agent.weights.policies import Evictable, EvictionPolicy, LruPolicy
from dpu_offload.abi import SlotState
from dpu_offload.channel import split_word, state_word
from dpu_offload.keys import ExpertKey
from dpu_offload.ring import RingError

_SETTLED = (SlotState.READY, SlotState.LANDED)
"""States in which a slot nobody holds may be evicted."""

MAX_HANDOFFS = 256
"""Slots of a pool whose ``PIN_HELD`` grants may wait for their pins at once (each eviction
reads their ``touches``); beyond, grants keep the agent's reference."""
CHECK_GRACE_SECONDS = 0.1
"""A LANDED slot whose generation a client was granted is not given to another delivery for
this long after it landed unless its verdict came: the client's check may be summing it, and
a check that saw LANDED publishes within microseconds of the bytes (docs/ABI.md)."""


@dataclass
class SlotPool:
    """A registered pool of equal-size expert slots on one device (one size class)."""

    region_id: int
    slot_bytes: int
    slot_count: int
    ipc_handle: bytes = b""
    """CUDA IPC handle of the pool's device memory, for a process that must open it."""
    shm_name: str = ""
    """Shared-memory name of a CPU reference pool a DMA engine writes."""
    state: list[SlotState] = field(default_factory=list)
    keys: list[ExpertKey | None] = field(default_factory=list)
    refs: list[int] = field(default_factory=list)
    transfer: list[int] = field(default_factory=list)
    checksums: list[tuple[int, ...]] = field(default_factory=list)
    """Per slot, the chunk checksums of the blob it holds (to verify copies made from it)."""
    by_key: dict[ExpertKey, int] = field(default_factory=dict)
    policy: EvictionPolicy = field(default_factory=LruPolicy)
    """Names the idle slot a miss takes; knows exactly the experts of ``idle`` and, where it
    reads routing, sees each reported visit (:meth:`observe`)."""
    generation: list[int] = field(default_factory=list)
    """Per slot, how many deliveries it was given (the slot-state table's generation)."""
    granted: list[bool] = field(default_factory=list)
    """Per slot, whether a client was granted its current generation (so may check it)."""
    landed_at: list[float] = field(default_factory=list)
    """Per slot, when the agent saw its delivery land (monotonic seconds)."""
    channel: DeviceChannel | None = None
    """The device's data-plane channel, whose slot-state table mirrors ``state``."""
    state_base: int = 0
    """Index of slot 0 in the channel's slot-state table."""
    home_layers: tuple[int, ...] = ()
    """The pool cut into this many equal runs of slots, the i-th the home of layer
    ``home_layers[i]``'s experts (checked by ``blob.pool_problem``); empty: no homes. A miss
    of a layer with a home takes a free slot of its home, else an idle one there (the policy's
    choice among them), and a slot elsewhere only when its home has neither: a layer's experts
    stay in one run of slots, which a client computes over alone."""

    def __post_init__(self) -> None:
        n = self.slot_count
        self.home_size = n // len(self.home_layers) if self.home_layers else n
        """Slots per home (the whole pool when there are no homes)."""
        self._home_of = {layer: i for i, layer in enumerate(self.home_layers)}
        self.idle: Evictable[tuple[int, int]] = Evictable(self.policy)
        """The eviction candidates, by the expert they hold (what the policy chooses among):
        READY or LANDED slots nobody holds through the agent, each as (slot, the client's
        ``touches`` count of the slot when it went idle: a slot the client hit since, by a
        pin, was used again, and the policy hears so before it is passed over once)."""
        self._handoffs: dict[int, tuple[int, int]] = {}
        """Slot -> (references of ``PIN_HELD`` grants not yet handed to the client's pin, the
        slot's ``touches`` when the first of them was granted)."""
        self._free = [list(range(first, first + self.home_size))
                      for first in range(0, n, self.home_size)]
        """Per home, a min-heap of its slots made FREE (entries whose slot was taken since are
        skipped): the lowest free slot in O(log n), where a scan of ``state`` costs the whole
        pool on every miss once it is full."""
        self.state = [SlotState.FREE] * n
        self.keys = [None] * n
        self.refs = [0] * n
        self.transfer = [0] * n
        self.checksums = [()] * n
        self.generation = [0] * n
        self.granted = [False] * n
        self.landed_at = [0.0] * n

    def _publish(self, idx: int, status: int = 0) -> None:
        if self.channel is not None:
            self.channel.publish_state(self.state_base + idx, self.generation[idx],
                                       self.state[idx], status)

    def expect(self, idx: int, expected: int) -> None:
        """Write the blob sum the FILLING slot's delivery must land beside its word (a
        DMA-engine device: the engine publishes LANDED, the consumer checks against this);
        the word, already FILLING, is not published again."""
        if self.channel is not None:
            self.channel.store_expected(self.state_base + idx, expected)

    def unheld_landing(self) -> int:
        """Slots nobody holds whose delivery is still in flight (a prefetch, or an acquire
        released before the agent saw its copy complete), or whose check may still be
        running (:meth:`checking`): evictable in a moment."""
        return sum(1 for i, r in enumerate(self.refs)
                   if r == 0 and (self.state[i] == SlotState.FILLING or self.checking(i)))

    def checking(self, idx: int) -> bool:
        """Whether the slot is LANDED, granted to a client, without a verdict yet and landed
        less than ``CHECK_GRACE_SECONDS`` ago: a check of the client's may be summing its
        bytes, and would publish the old generation's verdict over the next delivery's word
        (the GPU cannot compare-and-swap host memory)."""
        return (self.state[idx] == SlotState.LANDED and self.granted[idx]
                and time.monotonic() - self.landed_at[idx] < CHECK_GRACE_SECONDS
                and self.verdict(idx) is None)

    # The reference rule, in one place: a slot someone holds through the agent is never an
    # eviction candidate; one nobody holds is, once its delivery settled (READY or LANDED).
    def hold(self, idx: int, refs: int = 1) -> None:
        """Take ``refs`` references on slot ``idx`` (a use of its expert); a held slot is no
        eviction candidate."""
        self.refs[idx] += refs
        key = self.keys[idx]
        if key is not None and self.refs[idx] and self.is_idle(idx):
            self.idle.discard(key)

    def let_go(self, idx: int) -> bool:
        """Drop one reference on slot ``idx`` (queued for eviction if that was the last and its
        delivery settled); False when nobody held it."""
        if self.refs[idx] <= 0:
            return False
        self.refs[idx] -= 1
        self._idle_if_unheld(idx)
        return True

    def hand_off(self, idx: int) -> bool:
        """Slot ``idx`` was just granted (its reference taken): hand the reference to the
        client's pin (``PIN_HELD``), dropped once the slot's ``touches`` move past their value
        now (:meth:`settle_handoffs`). False, the reference staying the agent's (released by a
        RELEASE), while ``MAX_HANDOFFS`` slots of the pool wait for their pins: a client that
        takes no replies cannot make each eviction read the whole pool."""
        pending = self._handoffs.get(idx)
        if pending is None and len(self._handoffs) >= MAX_HANDOFFS:
            return False
        count, base = pending or (0, self._touches(idx))
        self._handoffs[idx] = (count + 1, base)
        return True

    def settle_handoffs(self) -> None:
        """Drop the references of ``PIN_HELD`` grants whose pins are in place (each pin counts
        its touch after it): as many as the touches moved, at most as many as were handed off
        and still held. The client's word is trusted with its own slots only: a touch it never
        pinned for costs it its own slot."""
        for idx, (count, base) in list(self._handoffs.items()):
            n = self._taken_over(idx, count, base)
            if not n:
                continue
            self.refs[idx] -= n
            left = min(count - n, self.refs[idx])
            if left:
                self._handoffs[idx] = (left, (base + n) & 0xFFFFFFFF)
            else:
                del self._handoffs[idx]
            self._idle_if_unheld(idx)

    def _taken_over(self, idx: int, count: int, base: int) -> int:
        """How many of slot ``idx``'s ``count`` handed-off references (``touches`` read
        ``base`` at the first) the client's pins have taken over: as many as the touches
        moved, at most ``count`` and the references still held."""
        return min(count, (self._touches(idx) - base) & 0xFFFFFFFF, self.refs[idx])

    def _idle_if_unheld(self, idx: int) -> None:
        key = self.keys[idx]
        if self.refs[idx] == 0 and self.state[idx] in _SETTLED and key is not None:
            self.idle.add(key, (idx, self._touches(idx)), self._home_at(idx))

    def is_idle(self, idx: int) -> bool:
        """Whether slot ``idx`` is an eviction candidate."""
        key = self.keys[idx]
        entry = None if key is None else self.idle.get(key)
        return entry is not None and entry[0] == idx

    def _touches(self, idx: int) -> int:
        return 0 if self.channel is None else self.channel.touches(self.state_base + idx)

    def allocate(self, key: ExpertKey, refs: int = 1) -> int | None:
        """A slot for ``key`` in FILLING state with ``refs`` references; None when every slot
        is held, pinned or may still be checked. In the home of ``key``'s layer (where it has
        one) a free slot, lowest first, else the idle slot the policy names there; then the
        same in the whole pool."""
        home = self._home_of.get(key.layer)
        if home is not None:
            idx = self._take_free(self._free[home], key, refs)
            if idx is None:
                idx = self._evict_for(key, refs, home)
            if idx is not None:
                return idx
        for heap in self._free:
            idx = self._take_free(heap, key, refs)
            if idx is not None:
                return idx
        return self._evict_for(key, refs)

    def _home_at(self, idx: int) -> int | None:
        """The home slot ``idx`` lies in; None in a pool without homes."""
        return idx // self.home_size if self.home_layers else None

    def _take_free(self, heap: list[int], key: ExpertKey, refs: int) -> int | None:
        """The lowest free slot of ``heap`` the client has not pinned, claimed for ``key``."""
        pinned = []
        try:
            while heap:
                idx = heapq.heappop(heap)
                if self.state[idx] != SlotState.FREE:
                    continue
                if self._claim(idx, key, refs):
                    return idx
                pinned.append(idx)
        finally:
            for idx in pinned:
                heapq.heappush(heap, idx)
        return None

    def _evict_for(self, key: ExpertKey, refs: int, home: int | None = None) -> int | None:
        """The idle slot (of ``home``, or any) the policy names for ``key``, claimed. A victim
        the client hit by a pin since it went idle counts as used and is passed over (named
        again only once every other idle slot was); one whose check may still run
        (:meth:`checking`) or that a client pins as it is claimed stays, passed over for this
        call. Those set aside leave ``idle`` and the policy while the search goes on and come
        back (as used) after it."""
        if self._handoffs:
            self.settle_handoffs()  # grants whose pins are in place may be candidates now
        passed: list[tuple[ExpertKey, tuple[int, int]]] = []
        second: list[tuple[ExpertKey, tuple[int, int]]] = []
        try:
            for again in (False, True):
                while (taken := self.idle.evict(key, home)) is not None:
                    victim, entry = taken
                    idx, seen = entry
                    touches = self._touches(idx)
                    if not again and touches != seen:
                        second.append((victim, (idx, touches)))
                        continue
                    if self.checking(idx) or not self._claim(idx, key, refs):
                        passed.append((victim, entry))
                        continue
                    del self.by_key[victim]
                    return idx
                self._back_to_idle(second)
        finally:
            self._back_to_idle(passed)
            self._back_to_idle(second)
        return None

    def _back_to_idle(self, entries: list[tuple[ExpertKey, tuple[int, int]]]) -> None:
        """Idle slots set aside during a search, candidates again (emptied)."""
        for key, entry in entries:
            self.idle.add(key, entry, self._home_at(entry[0]))
        entries.clear()

    def observe(self, visit: Visit) -> None:
        """A reported visit of a MoE layer (its arrays valid for this call), for a policy
        that reads routing."""
        self.policy.observe(visit)

    def _claim(self, idx: int, key: ExpertKey, refs: int) -> bool:
        """Give slot ``idx`` to a delivery of ``key`` (FILLING, the next generation, ``refs``
        references) unless the client has it pinned. EVICTING is stored before the pins are read
        (the client's mirror image: ``Channel.try_pin``); a pinned slot gets its old word back
        and keeps its expert (a waiter on that word sees EVICTING come and go, no new
        generation)."""
        channel, index = self.channel, self.state_base + idx
        if channel is not None:
            old_word = int(channel.view.words[index])
            channel.store_word(index, state_word(self.generation[idx], SlotState.EVICTING))
            if channel.pins_after(index)[0]:
                channel.store_word(index, old_word)
                channel.wake_state(index)
                return False
        self.state[idx] = SlotState.FILLING
        self.keys[idx] = key
        self.refs[idx] = refs
        self._handoffs.pop(idx, None)
        self.by_key[key] = idx
        self.generation[idx] += 1
        self.granted[idx] = False
        self._publish(idx)
        return True

    def mark_ready(self, idx: int) -> None:
        """Every chunk of the slot's delivery was verified: READY (idle if nobody holds it)."""
        self.state[idx] = SlotState.READY
        self._publish(idx)
        self._idle_if_unheld(idx)

    def mark_landed(self, idx: int) -> None:
        """Every chunk was copied, unchecked (a DMA-engine device), and the engine published
        LANDED (a SIGNAL; the expected sum was published with :meth:`expect`): the slot waits
        for its consumer's verdict (idle if nobody holds it). Nothing is published here: the
        consumer may have written its verdict already."""
        self.state[idx] = SlotState.LANDED
        self.landed_at[idx] = time.monotonic()
        self._idle_if_unheld(idx)

    def awaits_verdict(self, idx: int) -> bool:
        """Whether slot ``idx`` is LANDED with no verdict published for its generation: nothing
        to take up yet (read without the session's lock, the common case of a poll while the
        consumer checks; ``Deliveries.settle_landed`` decides the rest under it)."""
        return self.state[idx] == SlotState.LANDED and self.verdict(idx) is None

    def verdict(self, idx: int) -> SlotState | None:
        """What the consumer published for a LANDED slot's generation: READY, FAILED, or None
        while unchecked (any other word, which only the session's own process could have
        written, counts as unchecked)."""
        if self.channel is None:
            return None
        try:
            generation, state = split_word(int(self.channel.view.words[self.state_base + idx]))
        except RingError:  # no state at all
            return None
        if generation != self.generation[idx]:
            return None
        return state if state in (SlotState.READY, SlotState.FAILED) else None

    def fail(self, idx: int, status: int) -> None:
        """The slot's delivery failed for good with ``status`` (an ``abi.Status``): watchers
        see FAILED for this generation, and the slot is free again."""
        self.state[idx] = SlotState.FAILED
        self._publish(idx, status)
        self.free(idx)

    def free(self, idx: int) -> None:
        """Forget the slot's expert. The slot-state word keeps its last value (a FAILED stays
        visible) until the next :meth:`allocate` bumps the generation."""
        key = self.keys[idx]
        if self.is_idle(idx):
            self.idle.discard(key)
        if key is not None and self.by_key.get(key) == idx:
            del self.by_key[key]
        if self.state[idx] != SlotState.FREE:
            heapq.heappush(self._free[idx // self.home_size], idx)
        self.state[idx] = SlotState.FREE
        self.keys[idx] = None
        self.refs[idx] = 0
        self._handoffs.pop(idx, None)
        self.transfer[idx] = 0
        self.checksums[idx] = ()

    def ready_count(self) -> int:
        return sum(1 for s in self.state if s == SlotState.READY)

    def _held(self) -> list[bool]:
        """Per slot, whether it is held: a reference through the agent that is not a grant
        whose pin is in place, or a pin of the client's (read after a fence). Reads only, so
        a status call may ask without the session's lock."""
        held = [r > 0 for r in self.refs]
        if self.channel is None:
            return held
        for idx, (count, base) in dict(self._handoffs).items():  # a copy: the loop may settle
            held[idx] = self.refs[idx] > self._taken_over(idx, count, base)
        first = self.state_base
        self.channel.pins_after(first)  # the fence before the reads
        pins = self.channel.view.pins["pins"][first:first + self.slot_count].tolist()
        return [h or p > 0 for h, p in zip(held, pins, strict=True)]

    def held_count(self) -> int:
        """Slots held: a reference through the agent, or a pin of the client's."""
        return sum(self._held())

    def busy_count(self) -> int:
        """Slots held, filling or awaiting their check: what keeps the pool from being
        deregistered."""
        return sum(1 for i, h in enumerate(self._held())
                   if h or self.state[i] in (SlotState.FILLING, SlotState.LANDED))
