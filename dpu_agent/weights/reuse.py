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
from collections.abc import Set as AbstractSet

import numpy as np
from numba import njit

from dpu_agent.routing.stats import FEATURES, LayerStats, RoutingStats, Visit
from dpu_offload.jit import keep_cache
from dpu_offload.keys import ExpertKey

keep_cache(__file__)

K = FEATURES
"""Features per expert (``dpu_agent.routing.stats``): a constant, selected at the last visit,
the share at each horizon."""
_FLOOR = 1e-4
"""A linear fit can go below 0: clipped, or p / d would prefer the nearest layer."""


@njit(cache=True, nogil=True, boundscheck=True)
def _lowest(p: np.ndarray, stamp: np.ndarray, held: np.ndarray) -> int:
    """The held expert of lowest ``p``, of equals the least recently used (lowest
    ``stamp``); -1 when none is held."""
    low = -1
    for e in range(p.size):
        if held[e] and (low < 0 or p[e] < p[low] or (p[e] == p[low] and stamp[e] < stamp[low])):
            low = e
    return low


@njit(cache=True, nogil=True, boundscheck=True)
def _set_low(p: np.ndarray, stamp: np.ndarray, held: np.ndarray, low: np.ndarray,
             low_e: np.ndarray, at: int) -> None:
    """``low[at]``, ``low_e[at]``: the lowest ``p`` of row ``at``'s held experts and which
    (inf, -1 when none is held)."""
    e = _lowest(p[at], stamp[at], held[at])
    low_e[at] = e
    low[at] = np.inf if e < 0 else p[at, e]


@njit(cache=True, nogil=True, boundscheck=True)
def _hold(p: np.ndarray, stamp: np.ndarray, held: np.ndarray, low: np.ndarray,
          low_e: np.ndarray, at: int, e: int) -> None:
    """Expert ``e`` of row ``at`` is resident."""
    held[at, e] = True
    if p[at, e] < low[at] or (p[at, e] == low[at] and stamp[at, e] < stamp[at, low_e[at]]):
        low[at] = p[at, e]
        low_e[at] = e


@njit(cache=True, nogil=True, boundscheck=True)
def _free(p: np.ndarray, stamp: np.ndarray, held: np.ndarray, low: np.ndarray,
          low_e: np.ndarray, at: int, e: int) -> None:
    """Expert ``e`` of row ``at`` is not resident any more."""
    held[at, e] = False
    if low_e[at] == e:
        _set_low(p, stamp, held, low, low_e, at)


@njit(cache=True, nogil=True, boundscheck=True)
def _take(p: np.ndarray, stamp: np.ndarray, held: np.ndarray, low: np.ndarray,
          low_e: np.ndarray, now: int) -> tuple[int, int, float]:
    """The held expert of least ``p / d`` (row ``at``, expert ``e``), ``d`` the steps from
    filling the layer at row ``now`` (0 if negative) until row ``at``'s layer comes round
    (``n`` for itself), of equals in a row the least recently used, made not held; returns
    (at, e, p / d), (-1, -1, inf) when none is held."""
    n = low.size
    now = max(now, 0)
    best, at = np.inf, -1
    for i in range(n):
        d = (i - now) % n
        v = low[i] / (d if d else n)
        if v < best:
            best, at = v, i
    if at < 0:
        return -1, -1, best
    e = low_e[at]
    _free(p, stamp, held, low, low_e, at, e)
    return at, e, best


@njit(cache=True, nogil=True, boundscheck=True)
def _predict(features: np.ndarray, weights: np.ndarray, p: np.ndarray, stamp: np.ndarray,
             held: np.ndarray, low: np.ndarray, low_e: np.ndarray, at: int) -> None:
    """Row ``at`` of ``p``: ``clip(features[:, :K] @ weights, _FLOOR, 1)`` for the layer's
    experts (``features``: ``float64[E, >= K]``); then its ``low``."""
    for e in range(features.shape[0]):
        v = 0.0
        for f in range(K):
            v += features[e, f] * weights[f]
        p[at, e] = min(max(v, _FLOOR), 1.0)
    _set_low(p, stamp, held, low, low_e, at)


@njit(cache=True, nogil=True, boundscheck=True)
def _learn(acc: np.ndarray, x: np.ndarray, forget: float, ridge: float, weights: np.ndarray
           ) -> None:
    """One visit's least-squares update: ``acc = forget * acc + x^T x`` (``x``:
    ``float64[E, K + 1]``, features and target), then ``weights`` solves ``(acc[:K, :K] +
    ridge I) w = acc[:K, K]`` by Cholesky (kept as they were if that is not positive definite,
    which the ridge rules out)."""
    n = K + 1
    for i in range(n):
        for j in range(n):
            acc[i, j] *= forget
    for e in range(x.shape[0]):
        for i in range(n):
            xi = x[e, i]
            if xi != 0.0:
                for j in range(n):
                    acc[i, j] += xi * x[e, j]
    chol = np.zeros((K, K))
    for i in range(K):
        for j in range(i + 1):
            v = acc[i, j] + (ridge if i == j else 0.0)
            for m in range(j):
                v -= chol[i, m] * chol[j, m]
            if i == j:
                if v <= 0.0:
                    return
                chol[i, i] = np.sqrt(v)
            else:
                chol[i, j] = v / chol[j, j]
    y = np.empty(K)
    for i in range(K):
        v = acc[i, K]
        for m in range(i):
            v -= chol[i, m] * y[m]
        y[i] = v / chol[i, i]
    for i in range(K - 1, -1, -1):
        v = y[i]
        for m in range(i + 1, K):
            v -= chol[m, i] * weights[m]
        weights[i] = v / chol[i, i]


@njit(cache=True, nogil=True, boundscheck=True)
def _learn_predict(acc: np.ndarray, x: np.ndarray, forget: float, ridge: float,
                   weights: np.ndarray, features: np.ndarray, p: np.ndarray, stamp: np.ndarray,
                   held: np.ndarray, low: np.ndarray, low_e: np.ndarray, at: int) -> None:
    """``_learn`` then ``_predict``."""
    _learn(acc, x, forget, ridge, weights)
    _predict(features, weights, p, stamp, held, low, low_e, at)


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
        p: ``float64[n, W]``: per expert the predicted chance that its layer's next visit
            selects it, made at the layer's last visit (or when the layer grew).
        stamp: ``int64[n, W]``: per expert the policy's clock at its last insert, the end of
            its last use (of equal ``p`` the lowest goes first: least recently used).
        held: ``bool[n, W]``: the experts the cache may evict (resident, not in use).
        low, low_e: ``float64[n]``, ``intp[n]``: per row the lowest ``p`` of a held expert
            and which (inf, -1: none held).
        current: the row last visited or filled (where distances count from when an eviction
            names no incoming expert of this model), -1 before any.
        rows: ``(p, stamp, held, low, low_e)``, the arguments the compiled functions take.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.acc = np.zeros((K + 1, K + 1))
        self.weights = np.zeros(K)
        self.by_at: list[int] = []
        self.at: dict[int, int] = {}
        self.width: list[int] = []
        self.keys: list[list[ExpertKey]] = []
        self.p = np.zeros((0, 0))
        self.stamp = np.zeros((0, 0), np.int64)
        self.held = np.zeros((0, 0), np.bool_)
        self.low = np.zeros(0)
        self.low_e = np.zeros(0, np.intp)
        self.rows = (self.p, self.stamp, self.held, self.low, self.low_e)
        self.current = -1

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
            self._reshape(rows, self.p.shape[1])
            at = self.at[number]
        experts = stats.experts
        if experts > self.width[at]:
            if experts > self.p.shape[1]:
                self._reshape(list(range(len(self.by_at))), experts)
            self.width[at] = experts
            self.keys[at] = [ExpertKey(self.name, number, e) for e in range(experts)]
            _predict(stats.features, self.weights, *self.rows, at)
        return at

    def _reshape(self, rows: list[int], width: int) -> None:
        """New arrays of ``len(rows)`` rows and ``width`` columns, row i copied from old row
        ``rows[i]`` (none: nothing predicted or held)."""
        p = np.zeros((len(rows), width))
        stamp = np.zeros((len(rows), width), np.int64)
        held = np.zeros((len(rows), width), np.bool_)
        old = self.p.shape[1]
        for i, r in enumerate(rows):
            if r >= 0:
                p[i, :old], stamp[i, :old], held[i, :old] = self.p[r], self.stamp[r], self.held[r]
        self.p, self.stamp, self.held = p, stamp, held
        self.low = np.full(len(rows), math.inf)
        self.low_e = np.full(len(rows), -1, np.intp)
        self.rows = (self.p, self.stamp, self.held, self.low, self.low_e)
        for i in range(len(rows)):
            _set_low(*self.rows, i)


class LearnedReusePolicy:
    """Evicts the expert with the fewest expected hits per step it would hold its slot, from a
    model of reuse learned online from the routing the agent observes.

    For expert (L, e) it predicts ``p``, the chance that the next visit of layer L selects e,
    from its history at layer L in the agent's routing statistics (``stats``): selected at the
    last visit or not, and the share of visits that selected it over horizons of 1, 4, 16, 64
    and 256 visits and all of them (recency and frequency at once). One linear model per model,
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
        model.stamp[at, e] = self._clock
        _hold(*model.rows, at, e)
        model.current = at

    def on_remove(self, key: ExpertKey) -> None:
        name, number, e = key
        model = self._models.get(name)
        at = model.at.get(number) if model is not None else None
        if at is not None and e < model.width[at]:
            _free(*model.rows, at, e)

    def predicted(self, key: ExpertKey) -> float:
        """The chance that the next visit of ``key``'s layer selects it (0 if never seen)."""
        model = self._models.get(key.model)
        at = model.at.get(key.layer) if model is not None else None
        if at is None or key.expert >= model.width[at]:
            return 0.0
        return float(model.p[at, key.expert])

    def observe(self, visit: Visit) -> None:
        """One visit of a layer (already folded into the routing statistics): the fit learns
        what the features before it said about what it selected; the layer's predictions are
        made anew from the features after it (other layers keep those of their own last
        visit)."""
        model = self._models.get(visit.model)
        at = model.at.get(visit.layer) if model is not None else None
        if at is None or visit.stats.experts > model.width[at]:
            model, at = self._row(ExpertKey(visit.model, visit.layer, visit.stats.experts - 1))
        _learn_predict(model.acc, visit.before, self._forget, self._ridge, model.weights,
                       visit.after, *model.rows, at)
        model.current = at

    def evict(self, candidates: AbstractSet[ExpertKey], incoming: ExpertKey | None = None
              ) -> ExpertKey | None:
        best: tuple[_Model, int, int] | None = None
        best_v = math.inf
        for name, model in self._models.items():
            now = model.current
            if incoming is not None and incoming[0] == name:
                now = model.at.get(incoming[1], now)
            skipped: list[tuple[int, int]] = []  # not allowed: set aside while searching
            while True:
                at, e, v = _take(*model.rows, now)
                if at < 0:
                    break
                if v < best_v and model.keys[at][e] in candidates:
                    if best is not None:  # better than the last model's: that one stays
                        _hold(*best[0].rows, best[1], best[2])
                    best, best_v = (model, at, e), v
                    break
                skipped.append((at, e))
                if v >= best_v:
                    break
            for at, e in skipped:
                _hold(*model.rows, at, e)
        if best is None:  # keys the policy never saw inserted
            return next(iter(candidates), None)
        model, at, e = best
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
