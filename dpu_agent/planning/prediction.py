"""Which experts the next MoE layer will select, predicted from the routing the agent is told
(ReportRouting, in the agent's routing statistics), so that a prefetch can start before the
layer asks.

Two signals, learned online with no offline training: how a layer's selection predicts the
next layer's (the statistics' transition counts between consecutive MoE layers), and the next
layer's own recent history (selected at its last visit, its share of recent visits). A
per-model history can be learned from a recorded trace first (``RoutingStats.learn``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from dpu_agent.routing.stats import LAST, SHARE, RoutingStats
from dpu_offload.jit import keep_cache

keep_cache(__file__)

HISTORY_HORIZON = 16.0
"""The next layer's share of selections over this many of its visits is half its history."""
_SHARE = SHARE[HISTORY_HORIZON]
"""Its column of a layer's features."""


class NextLayerPredictor:
    """Predicts the experts of the MoE layer after the last visit ``stats`` observed.

    Args:
        stats: the agent's routing statistics.
        history_weight: weight of the next layer's own history against the transitions.
    """

    def __init__(self, stats: RoutingStats, history_weight: float = 0.5) -> None:
        self.stats = stats
        self.history_weight = history_weight

    def predict(self, model: str, k: int) -> tuple[int, list[int]]:
        """(number of the next MoE layer, its ``k`` likeliest experts, best first) after the
        last visit observed; (-1, []) before any."""
        stats = self.stats.model(model)
        if stats.previous is None or k <= 0:
            return -1, []
        layer, chosen = stats.previous
        nxt = stats.next_layer(layer)
        score = scores(stats.layers[nxt].features, stats.layers[layer].onward,
                       chosen.astype(np.int64, copy=False), self.history_weight)
        return nxt, [int(e) for e in top(score, k)]


@njit(cache=True, nogil=True, boundscheck=True)
def scores(features: np.ndarray, onward: np.ndarray, chosen: np.ndarray,
           history_weight: float) -> np.ndarray:
    """``float64[E]``: each expert of the next layer's score, its own history
    (``history_weight`` x the mean of selected-at-its-last-visit and its share over
    ``HISTORY_HORIZON`` visits; ``features``: that layer's ``float64[E, FEATURES]``) plus, for
    each expert ``chosen`` at this layer, the share of its transitions that went to it
    (``onward``: this layer's ``float64[E', E'']`` counts; a layer seen with fewer experts
    so far votes for the experts it has seen). One compiled pass: the visit's prediction
    runs on the agent's data-plane thread (a ROUTE visit's prefetch)."""
    n = features.shape[0]
    score = np.empty(n)
    for e in range(n):
        score[e] = history_weight * (0.5 * features[e, LAST] + 0.5 * features[e, _SHARE])
    width = min(onward.shape[1], n)
    for c in chosen:
        total = 0.0
        for e in range(onward.shape[1]):
            total += onward[c, e]
        total = max(total, 1e-9)
        for e in range(width):
            score[e] += onward[c, e] / total
    return score


@njit(cache=True, nogil=True, boundscheck=True)
def top(score: np.ndarray, k: int) -> np.ndarray:
    """``int64[<= k]``: the indices of the ``k`` highest positive scores, highest first, ties
    to the lower index (what a stable sort of ``-score`` gives)."""
    taken = np.zeros(score.shape[0], np.bool_)
    out = np.empty(min(k, score.shape[0]), np.int64)
    n = 0
    while n < out.shape[0]:
        best = -1
        for e in range(score.shape[0]):
            if not taken[e] and score[e] > 0 and (best < 0 or score[e] > score[best]):
                best = e
        if best < 0:
            break
        taken[best] = True
        out[n] = best
        n += 1
    return out[:n]


def warm_up() -> None:
    """Compile (or load from Numba's cache) the predictor's compiled code on a scratch model,
    so that no visit's prefetch pays for it on the agent's data-plane thread."""
    stats = RoutingStats()
    stats.declare("warm-up", (0, 1), 2)
    for layer in (0, 1, 0):
        stats.observe("warm-up", layer, {0: 1})
    NextLayerPredictor(stats).predict("warm-up", 1)
