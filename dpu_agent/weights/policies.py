"""Eviction policies of the weight cache, behind one interface.

A policy only orders keys; the cache (the arena's or a slot pool) decides what is evictable
and keeps it in an :class:`Evictable`, which tells the policy exactly that set: a key is
inserted as it becomes evictable (filled and its last user done with it: each insert is a use)
and removed as it is used again, evicted or dropped, so ``evict`` never searches past keys in
use. Every policy also sees each visit of a
MoE layer that routing reported (already folded into the agent's routing statistics, which the
policies that ``reads_routing`` read: :func:`make_policy`).
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Generic, Protocol, TypeVar

from dpu_agent.routing.stats import SHARE, RoutingStats, Visit
from dpu_agent.weights.reuse import LearnedReusePolicy
from dpu_offload.keys import ExpertKey


class EvictionPolicy(Protocol):
    """Observes cache traffic and names the next victim among candidates."""

    name: str

    def on_insert(self, key: ExpertKey) -> None:
        """``key`` became evictable: resident, and its use (the fill, a hit) just ended."""
        ...

    def on_remove(self, key: ExpertKey) -> None:
        """``key`` stopped being evictable other than by ``evict`` (used again, invalidated,
        dropped)."""
        ...

    def observe(self, visit: Visit) -> None: ...

    def evict(self, candidates: AbstractSet[ExpertKey], incoming: ExpertKey | None = None,
              one_layer: tuple[str, int] | None = None) -> ExpertKey | None:
        """The key to evict among ``candidates`` to make room for ``incoming`` (None if
        unknown), already forgotten as ``on_remove`` would; None when there is none.
        ``candidates`` is only read, during the call. ``one_layer`` (model, layer): every
        candidate is of that layer (a hint a policy may use to search less)."""
        ...


class LruPolicy:
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def observe(self, visit: Visit) -> None:
        pass

    def evict(self, candidates: AbstractSet[ExpertKey], incoming: ExpertKey | None = None,
              one_layer: tuple[str, int] | None = None) -> ExpertKey | None:
        key = next((k for k in self._order if k in candidates), None)
        if key is not None:
            self.on_remove(key)
        return key


class LfuPolicy:
    """Least frequently used (counts survive eviction; ties broken by recency)."""

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[ExpertKey, int] = defaultdict(int)
        self._tick: dict[ExpertKey, int] = {}
        self._clock = 0

    def on_insert(self, key: ExpertKey) -> None:
        self._clock += 1
        self._count[key] += 1
        self._tick[key] = self._clock

    def on_remove(self, key: ExpertKey) -> None:
        self._tick.pop(key, None)

    def observe(self, visit: Visit) -> None:
        pass

    def evict(self, candidates: AbstractSet[ExpertKey], incoming: ExpertKey | None = None,
              one_layer: tuple[str, int] | None = None) -> ExpertKey | None:
        key = min(candidates, key=lambda k: (self._count[k], self._tick.get(k, 0)),
                  default=None)
        if key is not None:
            self.on_remove(key)
        return key


class RoutingAwarePolicy:
    """Evicts the expert whose next use is expected furthest away, from routing statistics.

    Decode visits a model's MoE layers in order, one token after another. For expert (L, e),
    with the layer last observed being C, layer L comes next in ``d = (L - C) mod n`` steps
    (``n`` if L = C); each visit selects e with probability ``p``: its share of the layer's
    selections over ``horizon`` visits (``dpu_agent.routing.stats.HALF_LIVES``), pulled
    towards a small prior while the layer has few visits. The expected time to its next use
    is ``d + n (1 - p) / p``; the victim maximises it (Belady's rule with the future replaced
    by that expectation). With one layer it reduces to a decayed LFU.
    """

    name = "routing"
    reads_routing = True

    def __init__(self, stats: RoutingStats, horizon: float = 64.0, prior: float = 0.5) -> None:
        self._stats = stats
        self._column = SHARE[horizon]
        self._decay = 0.5 ** (1.0 / horizon)
        self._prior = prior
        self._current: dict[str, int] = {}

    def on_insert(self, key: ExpertKey) -> None:
        pass

    def on_remove(self, key: ExpertKey) -> None:
        pass

    def observe(self, visit: Visit) -> None:
        self._current[visit.model] = visit.layer

    def expected_steps(self, key: ExpertKey) -> float:
        model = self._stats.model(key.model)
        layer = model.layers.get(key.layer)
        n = max(1, len(model.order))
        current = self._current.get(key.model, key.layer)
        d = (model.position.get(key.layer, 0) - model.position.get(current, 0)) % n or n
        share, mass = 0.0, 0.0
        if layer is not None and key.expert < layer.experts:
            share = float(layer.features[key.expert, self._column])
            mass = (1.0 - self._decay ** layer.visits) / (1.0 - self._decay)
        p = min(max((share * mass + self._prior * 1e-3) / (mass + self._prior), 1e-9), 1.0)
        return d + n * (1.0 - p) / p if p < 1.0 else float(d)

    def evict(self, candidates: AbstractSet[ExpertKey], incoming: ExpertKey | None = None,
              one_layer: tuple[str, int] | None = None) -> ExpertKey | None:
        best, best_t = None, -math.inf
        for k in candidates:
            t = self.expected_steps(k)
            if t > best_t:
                best, best_t = k, t
        return best


V = TypeVar("V")


class Evictable(Generic[V]):
    """The keys a cache may evict now, each with a value of the cache's, and the policy that
    orders them, kept in step: the policy is told of a key as it enters (``on_insert``, a use
    just ended) and as it leaves other than by :meth:`evict` (``on_remove``). A key may enter
    in a group (a slot pool's home: a run of slots kept for one layer), so that an eviction
    can be asked for among that group's keys alone."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self._policy = policy
        self._values: dict[ExpertKey, V] = {}
        self._groups: dict[int, dict[ExpertKey, None]] = {}
        self._group_of: dict[ExpertKey, int] = {}
        self._group_layers: dict[int, Counter[tuple[str, int]]] = {}
        """Per group, how many of its keys each (model, layer) has."""

    def add(self, key: ExpertKey, value: V, group: int | None = None) -> None:
        """``key`` became evictable (or, already so, was used again), with ``value``, in
        ``group`` (None: none)."""
        self._leave_group(key)
        self._values[key] = value
        if group is not None:
            self._groups.setdefault(group, {})[key] = None
            self._group_of[key] = group
            self._group_layers.setdefault(group, Counter())[key[0], key[1]] += 1
        self._policy.on_insert(key)

    def discard(self, key: ExpertKey) -> None:
        """``key`` is not evictable any more (held again, invalidated, dropped); no-op if it
        was not."""
        if key in self._values:
            del self._values[key]
            self._leave_group(key)
            self._policy.on_remove(key)

    def evict(self, incoming: ExpertKey | None = None, group: int | None = None
              ) -> tuple[ExpertKey, V] | None:
        """The key the policy names to make room for ``incoming`` (among ``group``'s keys, or
        all), and its value, both removed; None when nothing is evictable there."""
        one_layer = None
        if group is None:
            candidates = self._values.keys()
        else:
            candidates = self._groups.get(group, {}).keys()
            if not candidates:
                return None
            layers = self._group_layers.get(group)
            if layers is not None and len(layers) == 1:
                one_layer = next(iter(layers))
        victim = self._policy.evict(candidates, incoming, one_layer)
        if victim is None:
            return None
        self._leave_group(victim)
        return victim, self._values.pop(victim)

    def _leave_group(self, key: ExpertKey) -> None:
        group = self._group_of.pop(key, None)
        if group is not None:
            del self._groups[group][key]
            layers = self._group_layers[group]
            layers[key[0], key[1]] -= 1
            if not layers[key[0], key[1]]:
                del layers[key[0], key[1]]

    def get(self, key: ExpertKey) -> V | None:
        return self._values.get(key)

    def values(self) -> list[V]:
        return list(self._values.values())

    def __iter__(self) -> Iterator[ExpertKey]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


POLICIES: dict[str, type] = {"lru": LruPolicy, "lfu": LfuPolicy, "routing": RoutingAwarePolicy,
                             "reuse": LearnedReusePolicy}
"""Config name -> policy class."""


def reads_routing(name: str) -> bool:
    """Whether the policy named ``name`` (a key of ``POLICIES``) reads routing statistics
    and reported visits."""
    return getattr(POLICIES[name], "reads_routing", False)


def make_policy(name: str, stats: RoutingStats) -> EvictionPolicy:
    """The policy named ``name`` (a key of ``POLICIES``), reading ``stats`` if it reads
    routing."""
    cls = POLICIES[name]
    return cls(stats) if reads_routing(name) else cls()
