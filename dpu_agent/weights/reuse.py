"""The learned-reuse eviction policy: per MoE layer, a model of whether the layer's next visit
selects each expert, learned online from the routing the agent observes, and the layer-cyclic
distance to that visit.

Built for cost as much as for hit rate (docs/PERFORMANCE.md, "Expert cache"): a visit is a
dozen small NumPy operations (no per-expert Python), an eviction one vectorised pass over the
layers plus a Python ``min`` over one layer's resident experts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
from scipy.linalg import lapack

from dpu_agent.routing.stats import FEATURES, LayerStats, RoutingStats, Visit
from dpu_offload.keys import ExpertKey

K = FEATURES
"""Features per expert (``dpu_agent.routing.stats``): a constant, selected at the last visit,
the share at each horizon."""
_FLOOR = 1e-4
"""A linear fit can go below 0: clipped, or p / d would prefer the nearest layer."""


class _Layer:
    """One MoE layer's state.

    Attributes:
        stats: the layer's routing statistics (the agent's one store).
        p: per expert, the predicted chance that the next visit selects it, made at the
            layer's last visit (or when it grew).
        resident: experts of the layer in the cache.
        low: (p, expert) of the resident expert least likely to be selected next.
    """

    def __init__(self, stats: LayerStats) -> None:
        self.stats = stats
        self.p: list[float] = []
        self.resident: set[int] = set()
        self.low: tuple[float, int] | None = None

    def predict(self, weights: np.ndarray) -> None:
        self.p = np.clip(self.stats.features @ weights, _FLOOR, 1.0).tolist()
        self.refresh_low()

    def refresh_low(self) -> None:
        if self.resident:
            e = min(self.resident, key=self.p.__getitem__)
            self.low = (self.p[e], e)
        else:
            self.low = None


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
        self._ridge = ridge * np.eye(K)
        self._models: dict[str, _Model] = defaultdict(_Model)

    def _layer(self, model: _Model, key: ExpertKey) -> _Layer:
        """The policy's state of ``key``'s layer, its statistics grown to hold ``key`` (new
        experts get a prediction from the current fit)."""
        layer = model.layers.get(key.layer)
        if layer is None or key.expert >= len(layer.p):
            stats = self._stats.layer(key.model, key.layer, key.expert + 1)
            layer = model.layer(key.layer, stats)
            if len(layer.p) < stats.experts:
                layer.predict(model.weights)
        return layer

    def on_insert(self, key: ExpertKey) -> None:
        model = self._models[key.model]
        layer = self._layer(model, key)
        layer.resident.add(key.expert)
        if layer.low is None or layer.p[key.expert] < layer.low[0]:
            layer.low = (layer.p[key.expert], key.expert)
            model.publish(key.layer, layer)
        model.current = key.layer

    on_access = on_insert

    def on_remove(self, key: ExpertKey) -> None:
        model = self._models.get(key.model)
        layer = model.layers.get(key.layer) if model is not None else None
        if layer is None or key.expert not in layer.resident:
            return
        layer.resident.discard(key.expert)
        if layer.low is not None and layer.low[1] == key.expert:
            layer.refresh_low()
            model.publish(key.layer, layer)

    def predicted(self, key: ExpertKey) -> float:
        """The chance that the next visit of ``key``'s layer selects it (0 if never seen)."""
        model = self._models.get(key.model)
        layer = model.layers.get(key.layer) if model is not None else None
        if layer is None or key.expert >= len(layer.p):
            return 0.0
        return layer.p[key.expert]

    def observe(self, visit: Visit) -> None:
        """One visit of a layer (already folded into the routing statistics): the fit learns
        what the features before it said about what it selected; the layer's predictions are
        made anew from the features after it."""
        model = self._models[visit.model]
        layer = model.layer(visit.layer, visit.stats)
        x = visit.before
        acc = model.acc
        acc *= self._forget
        acc += x.T @ x
        _, weights, info = lapack.dposv(acc[:K, :K] + self._ridge, acc[:K, K])
        if info == 0:  # else (not positive definite: cannot happen with the ridge) keep the last
            model.weights = weights
        layer.predict(model.weights)  # other layers keep the prediction of their own last visit
        model.publish(visit.layer, layer)
        model.current = visit.layer

    def victim(self, candidates: Iterable[ExpertKey], incoming: ExpertKey | None = None
               ) -> ExpertKey | None:
        allowed = candidates if isinstance(candidates, (set, frozenset)) else set(candidates)
        names = {k.model for k in allowed} if incoming is None else {incoming.model}
        best, best_v = None, math.inf
        for name in names:
            model = self._models.get(name)
            if model is None or not model.by_at:
                continue
            now = model.at.get(incoming.layer if incoming is not None else model.current, 0)
            distance = model.distance[now]
            ratio = model.low / distance
            while True:
                at = int(ratio.argmin())
                v = float(ratio[at])
                if v >= best_v:
                    break
                number = model.by_at[at]
                layer = model.layers[number]
                assert layer.low is not None
                key = ExpertKey(name, number, layer.low[1])
                if key not in allowed:  # held now: the layer's least likely one not held
                    e = next((e for e in sorted(layer.resident, key=layer.p.__getitem__)
                              if ExpertKey(name, number, e) in allowed), None)
                    if e is None:
                        ratio[at] = math.inf
                        continue
                    v = layer.p[e] / float(distance[at])
                    if v != ratio[at]:
                        ratio[at] = v  # others may now come first
                        continue
                    key = ExpertKey(name, number, e)
                best, best_v = key, v
                break
        if best is None:  # keys the policy never saw inserted
            best = next(iter(allowed), None)
        return best
