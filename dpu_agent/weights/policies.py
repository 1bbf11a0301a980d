"""Eviction policies of the weight cache, behind one interface.

A policy only orders keys; the cache decides what is evictable (unpinned, resident). Every
policy sees the same events: inserts, accesses, removals, and (for the routing-aware one)
routing observations of which experts each step selected.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from typing import Protocol

from dpu_agent.weights.reuse import LearnedReusePolicy
from dpu_offload.keys import ExpertKey


class EvictionPolicy(Protocol):
    """Observes cache traffic and names the next victim among candidates."""

    name: str

    def on_insert(self, key: ExpertKey) -> None: ...
    def on_access(self, key: ExpertKey) -> None: ...
    def on_remove(self, key: ExpertKey) -> None: ...
    def observe(self, model: str, layer: int, tokens: Mapping[int, int]) -> None: ...
    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        """The key to evict among ``candidates`` to make room for ``incoming`` (None if
        unknown), or None when there is none."""
        ...


class LruPolicy:
    """Least recently used."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def on_insert(self, key: ExpertKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        self._order.pop(key, None)

    def observe(self, model: str, layer: int, tokens: Mapping[int, int]) -> None:
        pass

    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        allowed = set(candidates)
        return next((k for k in self._order if k in allowed), None)


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

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        self._tick.pop(key, None)

    def observe(self, model: str, layer: int, tokens: Mapping[int, int]) -> None:
        pass

    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        return min(candidates, key=lambda k: (self._count[k], self._tick.get(k, 0)),
                   default=None)


class RoutingAwarePolicy:
    """Evicts the expert whose next use is expected furthest away, from routing statistics.

    Decode visits a model's MoE layers in order, one token after another. For expert (L, e),
    with the layer last observed being C, layer L comes next in ``d = (L - C) mod n`` steps
    (``n`` if L = C); each visit selects e with probability ``p``: the mean of its
    exponentially decayed shares of the layer's selections over a short and a long horizon
    (``half_lives``, in visits of that layer), so both recent locality and lasting popularity
    count. The expected time to
    its next use is ``d + n (1 - p) / p``; the victim maximises it (Belady's rule with the
    future replaced by that expectation). With one layer it reduces to a decayed LFU.
    """

    name = "routing"

    def __init__(self, half_lives: tuple[float, ...] = (64.0,), prior: float = 0.5
                 ) -> None:
        self._decays = [0.5 ** (1.0 / h) for h in half_lives]
        self._prior = prior
        self._score: dict[tuple[str, int], list[dict[int, float]]] = defaultdict(
            lambda: [{} for _ in self._decays])
        self._mass: dict[tuple[str, int], list[float]] = defaultdict(
            lambda: [0.0] * len(self._decays))
        self._layers: dict[str, set[int]] = defaultdict(set)
        self._current: dict[str, int] = {}

    def on_insert(self, key: ExpertKey) -> None:
        pass

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        pass

    def observe(self, model: str, layer: int, tokens: Mapping[int, int]) -> None:
        """One step of routing at ``layer``: ``tokens[e]`` tokens selected expert e."""
        slot = (model, layer)
        mass = self._mass[slot]
        for h, (scores, decay) in enumerate(zip(self._score[slot], self._decays, strict=True)):
            for e in scores:
                scores[e] *= decay
            for e, n in tokens.items():
                if n > 0:
                    scores[e] = scores.get(e, 0.0) + 1.0
            mass[h] = mass[h] * decay + 1.0
        self._layers[model].add(layer)
        self._current[model] = layer

    def expected_steps(self, key: ExpertKey) -> float:
        layers = sorted(self._layers.get(key.model, ())) or [key.layer]
        n = len(layers)
        current = self._current.get(key.model, key.layer)
        pos = {layer: i for i, layer in enumerate(layers)}
        d = (pos.get(key.layer, 0) - pos.get(current, 0)) % n or n
        slot = (key.model, key.layer)
        shares = [(scores.get(key.expert, 0.0) + self._prior * 1e-3) / (mass + self._prior)
                  for scores, mass in zip(self._score[slot], self._mass[slot], strict=True)]
        p = min(max(sum(shares) / len(shares), 1e-9), 1.0)
        return d + n * (1.0 - p) / p if p < 1.0 else float(d)

    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        best, best_t = None, -math.inf
        for k in candidates:
            t = self.expected_steps(k)
            if t > best_t:
                best, best_t = k, t
        return best


POLICIES: dict[str, type] = {"lru": LruPolicy, "lfu": LfuPolicy, "routing": RoutingAwarePolicy,
                             "reuse": LearnedReusePolicy}
"""Config name -> policy class."""
