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

import numpy as np

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


class _LayerStats:
    """One MoE layer's selection history: per expert, decayed selection counts at each
    horizon (``[E, H]``) and the visit count decayed alike (``[H]``), the feature rows
    (``[E, 2 + H]``: a constant, selected at the last visit, the share of visits that selected
    it at each horizon), which experts are resident, and (computed when asked, kept until the
    next visit) each expert's predicted chance to be selected at the next visit and the
    resident expert with the lowest."""

    def __init__(self, horizons: int) -> None:
        self.counts = np.zeros((0, horizons))
        self.visits = np.zeros(horizons)
        self.x = np.zeros((0, 2 + horizons))
        self.resident: set[int] = set()
        self._p: list[float] | None = None
        self._lowest: tuple[float, int] | None = None

    def grow(self, experts: int) -> None:
        n = self.x.shape[0]
        if experts > n:
            self.counts = np.vstack([self.counts, np.zeros((experts - n, self.counts.shape[1]))])
            self.x = np.vstack([self.x, np.zeros((experts - n, self.x.shape[1]))])
            self.x[:, 0] = 1.0
            self._p = None

    def visit(self, chosen: list[int], decay: np.ndarray) -> None:
        """Fold in one visit that selected ``chosen``; the feature rows follow."""
        self.counts *= decay
        self.counts[chosen] += 1.0
        self.visits = self.visits * decay + 1.0
        self.x[:, 1] = 0.0
        self.x[chosen, 1] = 1.0
        np.divide(self.counts, self.visits, out=self.x[:, 2:])
        self._p = self._lowest = None

    def admit(self, expert: int) -> None:
        self.resident.add(expert)
        if self._lowest is not None and self._p is not None and \
                self._p[expert] < self._lowest[0]:
            self._lowest = (self._p[expert], expert)

    def evict(self, expert: int) -> None:
        self.resident.discard(expert)
        if self._lowest is not None and self._lowest[1] == expert:
            self._lowest = None

    def p(self, weights: np.ndarray) -> list[float]:
        if self._p is None:
            # A linear fit can go below 0: clipped, or p / d would prefer the nearest layer.
            self._p = np.clip(self.x @ weights, 1e-4, 1.0).tolist()
        return self._p

    def lowest(self, weights: np.ndarray) -> tuple[float, int]:
        """(p, expert) of the resident expert least likely to be selected next."""
        if self._lowest is None:
            p = self.p(weights)
            e = min(self.resident, key=p.__getitem__)
            self._lowest = (p[e], e)
        return self._lowest


class LearnedReusePolicy:
    """Evicts the expert with the fewest expected hits per step it would hold its slot, from a
    model of reuse learned online from the routing the agent observes.

    For expert (L, e) it predicts ``p``, the chance that the next visit of layer L selects
    e, from its history at layer L: selected at the last visit or not, and the share of
    visits that selected it over horizons of 1, 4, 16, 64 and 256 visits and all of them
    (recency and frequency at once). One linear model per model, fitted by recursive least
    squares with forgetting (``forget`` per visit) on every expert of each visited layer, so it
    follows a shift in routing and needs no offline training; a layer's predictions are made at
    its visit. Decode visits MoE layers in order, so layer L comes next in
    ``d`` steps counted from the layer being filled (``n`` for that layer itself: its other
    experts are not needed before the next token). The victim minimises ``p / d``: a slot
    held for an expert far away must pay for the wait with a higher chance of use. With one
    MoE layer it orders by ``p`` alone.
    """

    name = "reuse"
    HALF_LIVES = (1.0, 4.0, 16.0, 64.0, 256.0, math.inf)
    """Horizons of the selection shares, in visits of the layer."""

    def __init__(self, forget: float = 0.98, ridge: float = 1e-3) -> None:
        self._decay = np.array([0.5 ** (1.0 / h) for h in self.HALF_LIVES])
        self._forget = forget
        k = 2 + len(self.HALF_LIVES)
        self._ridge = ridge * np.eye(k)
        self._gram: dict[str, np.ndarray] = defaultdict(lambda: np.zeros((k, k)))
        self._moment: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(k))
        self._weights: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(k))
        self._layers: dict[tuple[str, int], _LayerStats] = {}
        self._order: dict[str, dict[int, int]] = defaultdict(dict)
        """model -> MoE layer -> its position among the layers seen, in layer order."""
        self._current: dict[str, int] = {}

    def _stats(self, model: str, layer: int) -> _LayerStats:
        stats = self._layers.get((model, layer))
        if stats is None:
            stats = self._layers[(model, layer)] = _LayerStats(len(self.HALF_LIVES))
            order = sorted([*self._order[model], layer])
            self._order[model] = {la: i for i, la in enumerate(order)}
        return stats

    def on_insert(self, key: ExpertKey) -> None:
        stats = self._stats(key.model, key.layer)
        stats.grow(key.expert + 1)
        stats.admit(key.expert)
        self._current[key.model] = key.layer

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        stats = self._layers.get((key.model, key.layer))
        if stats is not None:
            stats.evict(key.expert)

    def predicted(self, key: ExpertKey) -> float:
        """The chance that the next visit of ``key``'s layer selects it (0 if never seen)."""
        stats = self._layers.get((key.model, key.layer))
        if stats is None or key.expert >= stats.x.shape[0]:
            return 0.0
        return stats.p(self._weights[key.model])[key.expert]

    def observe(self, model: str, layer: int, tokens: Mapping[int, int]) -> None:
        """One visit of ``layer``: ``tokens[e]`` tokens selected expert e."""
        stats = self._stats(model, layer)
        chosen = [e for e, n in tokens.items() if n > 0]
        stats.grow(max(chosen, default=-1) + 1)
        x = stats.x
        gram, moment = self._gram[model], self._moment[model]
        gram *= self._forget
        moment *= self._forget
        gram += x.T @ x
        moment += x[chosen].sum(axis=0)
        weights = self._weights[model] = np.linalg.solve(gram + self._ridge, moment)
        stats.visit(chosen, self._decay)
        stats.p(weights)  # other layers keep the prediction of their own last visit
        self._current[model] = layer

    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        allowed = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
        models = {k.model for k in allowed} if incoming is None else {incoming.model}
        best, best_v = None, math.inf
        for model in models:
            order, weights = self._order.get(model, {}), self._weights[model]
            n = max(1, len(order))
            now = order.get(incoming.layer if incoming is not None
                            else self._current.get(model, -1), 0)
            for layer, at in order.items():
                stats = self._layers[(model, layer)]
                if not stats.resident:
                    continue
                d = (at - now) % n or n
                p, e = stats.lowest(weights)
                if p / d >= best_v:
                    continue
                key = ExpertKey(model, layer, e)
                if key not in allowed:  # held now: the next lowest of the layer
                    ps = stats.p(weights)
                    rest = [r for r in stats.resident if ExpertKey(model, layer, r) in allowed]
                    if not rest:
                        continue
                    e = min(rest, key=ps.__getitem__)
                    p, key = ps[e], ExpertKey(model, layer, e)
                if p / d < best_v:
                    best, best_v = key, p / d
        if best is None:  # keys the policy never saw inserted
            best = next(iter(allowed), None)
        return best


POLICIES: dict[str, type] = {"lru": LruPolicy, "lfu": LfuPolicy, "routing": RoutingAwarePolicy,
                             "reuse": LearnedReusePolicy}
"""Config name -> policy class."""
