"""The learned-reuse eviction policy: per MoE layer, a model of whether the layer's next visit
selects each expert, learned online from the routing the agent observes, and the layer-cyclic
distance to that visit.

Built for cost as much as for hit rate (docs/PERFORMANCE.md, "Expert cache"): a visit is one
compiled least-squares update and prediction (Numba; no per-expert Python), an eviction one
vectorised pass over the layers plus a compiled search of one layer's resident experts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

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
def _lowest(p: np.ndarray, held: np.ndarray) -> int:
    """The held expert of lowest ``p`` (the first of equals), -1 when none is held."""
    low = -1
    for e in range(p.size):
        if held[e] and (low < 0 or p[e] < p[low]):
            low = e
    return low


@njit(cache=True, nogil=True, boundscheck=True)
def _first(low: np.ndarray, distance: np.ndarray, now: int) -> tuple[int, float]:
    """The position ``at`` of least ``low / distance[now]`` (the first of equals) and that
    value (inf at position 0 when every ``low`` is inf)."""
    best, at = np.inf, 0
    for i in range(low.size):
        v = low[i] / distance[now, i]
        if v < best:
            best, at = v, i
    return at, best


@njit(cache=True, nogil=True, boundscheck=True)
def _by_chance(p: np.ndarray, held: np.ndarray) -> np.ndarray:
    """``intp[held]``: the held experts, lowest ``p`` first (equals in expert order)."""
    experts = np.flatnonzero(held)
    return experts[np.argsort(p[experts], kind="mergesort")]


@njit(cache=True, nogil=True, boundscheck=True)
def _predict(features: np.ndarray, weights: np.ndarray, held: np.ndarray, p: np.ndarray
             ) -> int:
    """``p = clip(features @ weights, _FLOOR, 1)`` (``float64[E]``); returns ``_lowest``."""
    for e in range(features.shape[0]):
        v = 0.0
        for f in range(K):
            v += features[e, f] * weights[f]
        p[e] = min(max(v, _FLOOR), 1.0)
    return _lowest(p, held)


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
                   weights: np.ndarray, features: np.ndarray, held: np.ndarray, p: np.ndarray
                   ) -> int:
    """``_learn`` then ``_predict``."""
    _learn(acc, x, forget, ridge, weights)
    return _predict(features, weights, held, p)


class _Layer:
    """One MoE layer's state.

    Attributes:
        stats: the layer's routing statistics (the agent's one store).
        p: ``float64[E]``, per expert the predicted chance that the next visit selects it, made
            at the layer's last visit (or when it grew).
        held: ``bool[E]``, the experts of the layer in the cache.
        low: (p, expert) of the resident expert least likely to be selected next.
    """

    def __init__(self, stats: LayerStats) -> None:
        self.stats = stats
        self.p = np.zeros(0)
        self.held = np.zeros(0, np.bool_)
        self.low: tuple[float, int] | None = None

    def grow(self) -> None:
        """Room for every expert of the statistics (new ones: not held)."""
        experts = self.stats.experts
        if experts > self.p.size:
            self.p = np.zeros(experts)
            self.held = np.concatenate([self.held, np.zeros(experts - self.held.size, np.bool_)])

    def predict(self, weights: np.ndarray) -> None:
        """``p`` of every expert from the features now (a layer that grew, between visits)."""
        self.grow()
        self._set_low(_predict(self.stats.features, weights, self.held, self.p))

    def learn(self, acc: np.ndarray, before: np.ndarray, forget: float, ridge: float,
              weights: np.ndarray) -> None:
        """``_learn`` from a visit of this layer, then ``predict`` (one compiled call)."""
        self.grow()
        self._set_low(_learn_predict(acc, before, forget, ridge, weights, self.stats.features,
                                     self.held, self.p))

    def refresh_low(self) -> None:
        self._set_low(_lowest(self.p, self.held))

    def _set_low(self, e: int) -> None:
        self.low = None if e < 0 else (float(self.p[e]), e)

    def by_chance(self) -> list[int]:
        """The held experts, least likely to be selected next first."""
        return _by_chance(self.p, self.held).tolist()


class _Model:
    """A model's fit and its MoE layers in decode order.

    Attributes:
        acc: ``float64[K + 1, K + 1]``: the forgetting sum over visits of ``x^T x`` of the
            visited layer (features and target), so ``acc[:K, :K]`` is the Gram matrix and
            ``acc[:K, K]`` the moment of the least-squares fit.
        weights: ``float64[K]``, the fit.
        layers: layer number -> state; ``at``: layer number -> position in decode order;
            ``by_at``: the layer numbers in decode order.
        current: the layer last visited or filled (where distances count from when an
            eviction names no incoming expert).
        low: ``float64[n]``, per position the ``p`` of the layer's least likely resident expert
            (inf: none resident).
        distance: ``float64[n, n]``, ``distance[now, at]``: steps from filling the layer at
            ``now`` until the layer at ``at`` comes round (``n`` for itself).
    """

    def __init__(self) -> None:
        self.acc = np.zeros((K + 1, K + 1))
        self.weights = np.zeros(K)
        self.layers: dict[int, _Layer] = {}
        self.at: dict[int, int] = {}
        self.by_at: list[int] = []
        self.low = np.zeros(0)
        self.distance = np.zeros((0, 0))
        self.current = -1

    def layer(self, number: int, stats: LayerStats) -> _Layer:
        state = self.layers.get(number)
        if state is None:
            state = self.layers[number] = _Layer(stats)
            self.by_at = sorted(self.layers)
            self.at = {la: i for i, la in enumerate(self.by_at)}
            n = len(self.by_at)
            steps = (np.arange(n)[None, :] - np.arange(n)[:, None]) % n
            self.distance = np.where(steps == 0, n, steps).astype(np.float64)
            self.low = np.full(n, math.inf)
            for la, s in self.layers.items():
                self.publish(la, s)
        return state

    def publish(self, number: int, state: _Layer) -> None:
        """Copy the layer's lowest resident ``p`` into ``low``."""
        self.low[self.at[number]] = math.inf if state.low is None else state.low[0]


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
    it orders by ``p`` alone.
    """

    name = "reuse"
    reads_routing = True

    def __init__(self, stats: RoutingStats, forget: float = 0.98, ridge: float = 1e-3) -> None:
        self._stats = stats
        self._forget = forget
        self._ridge = ridge
        self._models: dict[str, _Model] = defaultdict(_Model)

    def _layer(self, model: _Model, key: ExpertKey) -> _Layer:
        """The policy's state of ``key``'s layer, its statistics grown to hold ``key`` (new
        experts get a prediction from the current fit)."""
        layer = model.layers.get(key.layer)
        if layer is None or key.expert >= layer.p.size:
            stats = self._stats.layer(key.model, key.layer, key.expert + 1)
            layer = model.layer(key.layer, stats)
            if layer.p.size < stats.experts:
                layer.predict(model.weights)
        return layer

    def on_insert(self, key: ExpertKey) -> None:
        name, number, e = key
        model = self._models[name]
        layer = model.layers.get(number)
        if layer is None or e >= layer.p.size:
            layer = self._layer(model, key)
        layer.held[e] = True
        p = float(layer.p[e])
        if layer.low is None or p < layer.low[0]:
            layer.low = (p, e)
            model.low[model.at[number]] = p
        model.current = number

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        name, number, e = key
        model = self._models.get(name)
        layer = model.layers.get(number) if model is not None else None
        if layer is None or e >= layer.held.size or not layer.held[e]:
            return
        layer.held[e] = False
        if layer.low is not None and layer.low[1] == e:
            layer.refresh_low()
            model.publish(number, layer)

    def predicted(self, key: ExpertKey) -> float:
        """The chance that the next visit of ``key``'s layer selects it (0 if never seen)."""
        model = self._models.get(key.model)
        layer = model.layers.get(key.layer) if model is not None else None
        if layer is None or key.expert >= layer.p.size:
            return 0.0
        return float(layer.p[key.expert])

    def observe(self, visit: Visit) -> None:
        """One visit of a layer (already folded into the routing statistics): the fit learns
        what the features before it said about what it selected; the layer's predictions are
        made anew from the features after it."""
        model = self._models[visit.model]
        layer = model.layer(visit.layer, visit.stats)
        # Other layers keep the prediction of their own last visit.
        layer.learn(model.acc, visit.before, self._forget, self._ridge, model.weights)
        model.publish(visit.layer, layer)
        model.current = visit.layer

    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        allowed = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
        names = (incoming.model,) if incoming is not None else {k.model for k in allowed}
        best, best_v = None, math.inf
        for name in names:
            model = self._models.get(name)
            if model is None or not model.by_at:
                continue
            now = model.at.get(incoming.layer if incoming is not None else model.current, 0)
            at, v = _first(model.low, model.distance, now)
            number = model.by_at[at]
            low = model.layers[number].low
            if low is not None and (name, number, low[1]) in allowed:  # the usual case
                if v < best_v:
                    best, best_v = ExpertKey(name, number, low[1]), v
                continue
            distance = model.distance[now]
            ratio = model.low / distance
            exact: dict[int, int] = {}  # position -> its layer's least likely allowed expert
            while True:
                at = int(ratio.argmin())
                v = float(ratio[at])
                if v >= best_v:
                    break
                number = model.by_at[at]
                e = exact.get(at)
                if e is None:
                    layer = model.layers[number]
                    assert layer.low is not None
                    e = layer.low[1]
                    # A key is a tuple: a plain one finds it in ``allowed`` at less cost.
                    if (name, number, e) not in allowed:  # held now: the next least likely
                        e = exact[at] = next((e for e in layer.by_chance()
                                              if (name, number, e) in allowed), -1)
                        ratio[at] = math.inf if e < 0 else float(layer.p[e] / distance[at])
                        continue  # others may now come first
                best, best_v = ExpertKey(name, number, e), v
                break
        if best is None:  # keys the policy never saw inserted
            best = next(iter(allowed), None)
        return best


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
    policy.on_remove(policy.victim(set(keys[1:]), keys[0]) or keys[1])
    policy.victim({keys[2]}, keys[0])
