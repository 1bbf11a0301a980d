"""The learned-reuse eviction policy: per MoE layer, a model of whether the layer's next visit
selects each expert, learned online from the routing the agent observes, and the layer-cyclic
distance to that visit.

Built for cost as much as for hit rate (docs/PERFORMANCE.md, "Expert cache"): the state of a
model is a few arrays (one row per MoE layer in decode order), a visit is one compiled
least-squares update and prediction, an eviction one compiled search over the layers and one
compiled update of the victim's row, an insert (an expert's use ended: it may be evicted) or a
removal (used again, dropped) one compiled update.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Set as AbstractSet

import numpy as np

from dpu_agent.routing.stats import LayerStats, RoutingStats, Visit
from dpu_agent.weights import reuse_state as state
from dpu_agent.weights.reuse_state import LOW_E, K, P
from dpu_offload.keys import ExpertKey

HORIZON_STEPS = 4
"""Decode steps (visits of any of a model's MoE layers) the fit's target looks ahead: with
``n`` MoE layers, a layer's next ``max(1, round(HORIZON_STEPS / n))`` visits. Many layers: the
next visit alone (``p / d`` already weighs the distance to it); one or two layers: the next
few, so an expert's worth is not read from one noisy visit."""
HORIZON_DISCOUNT = 0.8
"""Weight of the k-th visit ahead in the target, relative to the (k-1)-th."""


class _Delayed:
    """One layer's latest visits whose target is not complete yet, when the fit looks more than
    one visit ahead: the features before each visit, and what each visit selected.

    Attributes:
        features: up to ``visits`` of ``float64[E, K]``, oldest first.
        selected: up to ``visits`` of ``float64[E]`` (1.0 where the visit selected the expert).
        weights: ``float64[visits]``, ``HORIZON_DISCOUNT ** k``, summing to 1.
    """

    def __init__(self, visits: int) -> None:
        self.features: deque[np.ndarray] = deque(maxlen=visits)
        self.selected: deque[np.ndarray] = deque(maxlen=visits)
        w = HORIZON_DISCOUNT ** np.arange(visits, dtype=np.float64)
        self.weights = w / w.sum()

    @property
    def visits(self) -> int:
        return len(self.weights)

    def push(self, before: np.ndarray) -> np.ndarray | None:
        """Add a visit (``before``: ``float64[E, K + 1]``, its features and what it selected);
        returns the oldest visit's sample (``float64[E, K + 1]``: its features and the
        discounted share of the next ``visits`` visits that selected each expert) once that
        many were seen, else None. A layer that grew starts over."""
        if self.features and self.features[-1].shape[0] != before.shape[0]:
            self.features.clear()
            self.selected.clear()
        self.features.append(before[:, :K].copy())
        self.selected.append(before[:, K].copy())
        if len(self.features) < self.visits:
            return None
        x = np.empty((before.shape[0], K + 1))
        x[:, :K] = self.features[0]
        x[:, K] = self.weights @ np.stack(self.selected)
        return x


class _Model:
    """A model's fit and its MoE layers' state, one row per layer in decode order.

    Attributes:
        acc: ``float64[K + 1, K + 1]``: the forgetting sum over visits of ``x^T x`` of the
            visited layer (features and target), so ``acc[:K, :K]`` is the Gram matrix and
            ``acc[:K, K]`` the moment of the least-squares fit.
        weights: ``float64[K]``, the fit.
        name: the model's name.
        by_at: the layer numbers in decode order; ``at``: layer number -> its row;
            ``width``: per row the experts ``p`` holds a prediction for; ``keys``: per row
            the key of each of them.
        grid: ``float64[3, n, W]``, planes ``P``, ``STAMP``, ``HELD``: per expert the predicted
            chance that its layer's next visit selects it (made at the layer's last visit or
            when the layer grew), the policy's clock at its last insert (of equal ``P`` the
            lowest goes first: least recently used), and whether the cache may evict it.
        low: ``float64[2, n]``, rows ``LOW``, ``LOW_E``: per layer the lowest ``P`` of a held
            expert and which.
        current: the row last visited or filled (where distances count from when an eviction
            names no incoming expert of this model), -1 before any.
        delayed: layer number -> its visits awaiting their target, while the fit looks more
            than one visit ahead (``HORIZON_STEPS``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.acc = np.zeros((K + 1, K + 1))
        self.weights = np.zeros(K)
        self.by_at: list[int] = []
        self.at: dict[int, int] = {}
        self.width: list[int] = []
        self.keys: list[list[ExpertKey]] = []
        self.grid = np.zeros((3, 0, 0))
        self.low = np.zeros((2, 0))
        self.current = -1
        self.delayed: dict[int, _Delayed] = {}

    def place(self, number: int, stats: LayerStats) -> int:
        """The row of layer ``number``, made (rows re-ordered) or widened to every expert of
        ``stats`` (the layer's routing statistics, the agent's one store); new experts get a
        prediction from the current fit, not held."""
        at = self.at.get(number)
        if at is None:
            old, current = self.at, self.by_at[self.current] if self.current >= 0 else None
            self.by_at = sorted([*old, number])
            self.at = {la: i for i, la in enumerate(self.by_at)}
            rows = [old.get(la, -1) for la in self.by_at]
            self.width = [0 if r < 0 else self.width[r] for r in rows]
            self.keys = [[] if r < 0 else self.keys[r] for r in rows]
            self.current = -1 if current is None else self.at[current]
            self._reshape(rows, self.grid.shape[2])
            at = self.at[number]
        experts = stats.experts
        if experts > self.width[at]:
            if experts > self.grid.shape[2]:
                self._reshape(list(range(len(self.by_at))), experts)
            self.width[at] = experts
            self.keys[at] = [ExpertKey(self.name, number, e) for e in range(experts)]
            state.predict(stats.features, self.weights, self.grid, self.low, at)
        return at

    def _reshape(self, rows: list[int], width: int) -> None:
        """New arrays of ``len(rows)`` rows and ``width`` columns, row i copied from old row
        ``rows[i]`` (none: nothing predicted or held)."""
        grid = np.zeros((3, len(rows), width))
        old = self.grid.shape[2]
        for i, r in enumerate(rows):
            if r >= 0:
                grid[:, i, :old] = self.grid[:, r]
        self.grid = grid
        self.low = np.empty((2, len(rows)))
        for i in range(len(rows)):
            state.set_low(grid, self.low, i)


class LearnedReusePolicy:
    """Evicts the expert with the fewest expected hits per step it would hold its slot, from a
    model of reuse learned online from the routing the agent observes.

    For expert (L, e) it predicts ``p``, the chance that the next visit of layer L selects e
    (with one or two MoE layers, the discounted share of its next few visits that do:
    ``HORIZON_STEPS``), from its history at layer L in the agent's routing statistics
    (``stats``): selected at the last visit or not, and the share of visits that selected it
    over horizons of 1, 4, 16, 64 and 256 visits and all of them (recency and frequency at
    once). One linear model per model,
    fitted by least squares with forgetting (``forget`` per visit) on every expert of each
    visited layer, so it follows a shift in routing and needs no offline training; a layer's
    predictions are made at its visit. Decode visits MoE layers in order, so layer L comes next
    in ``d`` steps counted from the layer being filled (``n`` for that layer itself: its other
    experts are not needed before the next token). The victim minimises ``p / d``: a slot held
    for an expert far away must pay for the wait with a higher chance of use. With one MoE layer
    it orders by ``p`` alone. Of equal ``p`` in a layer (every expert before any visit is
    reported, and the many a fit clips to its floor) the least recently used goes first, so a
    client that reports no routing gets LRU within each layer and the layer order across them.
    """

    name = "reuse"
    reads_routing = True

    def __init__(self, stats: RoutingStats, forget: float = 0.98, ridge: float = 1e-3) -> None:
        self._stats = stats
        self._forget = forget
        self._ridge = ridge
        self._models: dict[str, _Model] = {}
        self._clock = 0

    def _row(self, key: ExpertKey) -> tuple[_Model, int]:
        """``key``'s model and row, the layer's statistics grown to hold ``key``."""
        model = self._models.get(key.model)
        if model is None:
            model = self._models[key.model] = _Model(key.model)
        stats = self._stats.layer(key.model, key.layer, key.expert + 1)
        return model, model.place(key.layer, stats)

    def on_insert(self, key: ExpertKey) -> None:
        name, number, e = key
        model = self._models.get(name)
        at = model.at.get(number) if model is not None else None
        if at is None or e >= model.width[at]:
            model, at = self._row(key)
        self._clock += 1
        state.insert(model.grid, model.low, at, e, self._clock)
        model.current = at

    def on_remove(self, key: ExpertKey) -> None:
        name, number, e = key
        model = self._models.get(name)
        at = model.at.get(number) if model is not None else None
        if at is not None and e < model.width[at]:
            state.free(model.grid, model.low, at, e)

    def predicted(self, key: ExpertKey) -> float:
        """The chance that the next visit of ``key``'s layer selects it (0 if never seen)."""
        model = self._models.get(key.model)
        at = model.at.get(key.layer) if model is not None else None
        if at is None or key.expert >= model.width[at]:
            return 0.0
        return float(model.grid[P, at, key.expert])

    def observe(self, visit: Visit) -> None:
        """One visit of a layer (already folded into the routing statistics): the fit learns
        what the features before it said about what it selected; the layer's predictions are
        made anew from the features after it (other layers keep those of their own last
        visit)."""
        model = self._models.get(visit.model)
        at = model.at.get(visit.layer) if model is not None else None
        if at is None or visit.stats.experts > model.width[at]:
            model, at = self._row(ExpertKey(visit.model, visit.layer, visit.stats.experts - 1))
        visits = max(1, round(HORIZON_STEPS / len(model.by_at)))
        if visits == 1:
            model.delayed.pop(visit.layer, None)
            state.learn_predict(model.acc, visit.before, self._forget, self._ridge,
                                model.weights, visit.after, model.grid, model.low, at)
        else:
            delayed = model.delayed.get(visit.layer)
            if delayed is None or delayed.visits != visits:
                delayed = model.delayed[visit.layer] = _Delayed(visits)
            x = delayed.push(visit.before)
            if x is not None:
                state.learn(model.acc, x, self._forget, self._ridge, model.weights)
            state.predict(visit.after, model.weights, model.grid, model.low, at)
        model.current = at

    def evict(self, candidates: AbstractSet[ExpertKey], incoming: ExpertKey | None = None,
              one_layer: tuple[str, int] | None = None) -> ExpertKey | None:
        if one_layer is not None:
            victim = self._lowest_in_layer(candidates, one_layer)
            if victim is not None:
                return victim
        best: tuple[_Model, int, int] | None = None
        best_v = math.inf
        for name, model in self._models.items():
            now = model.current
            if incoming is not None and incoming[0] == name:
                now = model.at.get(incoming[1], now)
            skipped: list[tuple[int, int]] = []  # not allowed: set aside while searching
            while True:
                at, e, v = state.take(model.grid, model.low, now)
                if at < 0:
                    break
                if v < best_v and model.keys[at][e] in candidates:
                    if best is not None:  # better than the last model's: that one stays
                        state.hold(best[0].grid, best[0].low, best[1], best[2])
                    best, best_v = (model, at, e), v
                    break
                skipped.append((at, e))
                if v >= best_v:
                    break
            for at, e in skipped:
                state.hold(model.grid, model.low, at, e)
        if best is None:  # keys the policy never saw inserted
            return next(iter(candidates), None)
        model, at, e = best
        return model.keys[at][e]

    def _lowest_in_layer(self, candidates: AbstractSet[ExpertKey], layer: tuple[str, int]
                         ) -> ExpertKey | None:
        """Of ``candidates``, all of ``layer`` (model, layer number): the held one of least
        ``P``, made not held (the full search's victim: one layer, one distance); None if the
        policy holds none of them. The layer's lowest is looked at first: a slot pool's home
        of one layer usually holds it, and then no candidate is read."""
        model = self._models.get(layer[0])
        at = model.at.get(layer[1], -1) if model is not None else -1
        if at < 0:
            return None
        e = int(model.low[LOW_E, at])
        if e < 0:
            return None
        if model.keys[at][e] not in candidates:
            experts = np.fromiter((key[2] for key in candidates), np.int64, len(candidates))
            e = state.lowest_among(model.grid, at, experts)
            if e < 0:
                return None
        state.free(model.grid, model.low, at, e)
        return model.keys[at][e]


def warm_up() -> None:
    """Compile (or load from Numba's cache) the routing fold's and this policy's compiled
    code by exercising each on a scratch model, so that no acquire or report pays for it
    (seconds on a cold cache)."""
    stats = RoutingStats()
    policy = LearnedReusePolicy(stats)
    keys = [ExpertKey("warm-up", layer, expert) for layer in (0, 1) for expert in (0, 1)]
    for layer in (0, 1, 0):
        policy.observe(stats.observe("warm-up", layer, {0: 1}))
    for key in keys:
        policy.on_insert(key)
    policy.evict(set(keys[1:]), keys[0])
    policy.evict({keys[2]}, keys[0])
    policy.on_remove(keys[0])
    state.lowest_among(policy._models["warm-up"].grid, 0, np.zeros(1, np.int64))
